-- Rank script for launcher_spec: floods stdout and stderr with numbered lines
-- of varying length (many longer than a pipe read), then a partial last line.
-- usage: launcher_lines.lua NLINES
local n = tonumber(arg[1]) or 1000
local rank = os.getenv("RANK")
io.stdout:setvbuf("full", 4096)   -- writes split lines at arbitrary points
io.stderr:setvbuf("full", 1000)
for i = 1, n do
  local len = (i * 7919 + tonumber(rank) * 104729) % 3000
  io.stdout:write("out ", rank, " ", i, " ", len, " ", string.rep("x", len), "\n")
  if i % 4 == 0 then
    io.stderr:write("err ", rank, " ", i, " ", string.rep("y", len % 500), "\n")
  end
end
io.stdout:write("tail ", rank, " no newline")
io.stderr:write("etail ", rank)
