-- Run first on every rank by `weft-run --repl tests/helpers/repl_init.lua TOKEN`
-- (like lua -i script): its globals land in the REPL environment, and the
-- token in the command line lets the spec find stray rank processes.
started = ("started %d/%d"):format(rank, world_size)
function pair_sum(x) return x + 1 end
print("init " .. rank .. " " .. tostring(arg[1]))
