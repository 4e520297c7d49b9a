-- One rank of tests/unit/policy_spec.lua's multi-rank check (weft-run -n 3):
-- all_gatherv, reduce_scatterv and out-of-place all_reduce on host tensors
-- against references, and explain on a real group. Prints "OK <name>".
local weft = require("weft")
local T = weft.tensor

local world = weft.init()
local me, W = world.rank_in_group, world.world_size
local function ok(name) io.stdout:write("OK ", name, "\n"); io.stdout:flush() end
local function check(cond, msg, ...) if not cond then error(msg:format(...), 2) end end

-- all_gatherv: rank r has r + 1 rows of 2 values (r*100 + row*10 + col)
local sizes = {}
for r = 1, W do sizes[r] = r end
local function rows_of(r)
  local t = {}
  for i = 0, r do t[#t + 1] = { r * 100 + i * 10, r * 100 + i * 10 + 1 } end
  return t
end
for _, dt in ipairs { "f32", "i64", "bf16" } do
  local x = T.from_table(rows_of(me), dt)
  local out = world:all_gatherv(x, sizes)
  local want = {}
  for r = 0, W - 1 do for _, row in ipairs(rows_of(r)) do want[#want + 1] = row[1]; want[#want + 1] = row[2] end end
  local got = out:to_table()
  check(#got == #want, "all_gatherv %s: %d values, want %d", dt, #got, #want)
  for i = 1, #want do check(got[i] == want[i], "all_gatherv %s [%d]: %s, want %s", dt, i, got[i], want[i]) end
  -- into a given tensor
  local into = T.zeros({ #want / 2, 2 }, dt)
  check(world:all_gatherv(x, sizes, into) == into, "all_gatherv returns the given output")
end
ok("all_gatherv")

-- reduce_scatterv: 6 rows; rank r keeps rows per {1, 2, 3}
local vals = {}
for i = 1, 6 do vals[i] = i * (me + 1) end
local t = T.from_table(vals, "f32", { 6, 1 })
local out = world:reduce_scatterv(t, nil, sizes)
local total = W * (W + 1) / 2         -- sum over ranks of (rank + 1)
local off = 0
for r = 1, me do off = off + sizes[r] end
local got = out:to_table()
check(#got == sizes[me + 1], "reduce_scatterv: %d rows, want %d", #got, sizes[me + 1])
for i = 1, #got do check(got[i] == (off + i) * total, "reduce_scatterv [%d]: %s", i, got[i]) end
local ok2, err = pcall(world.reduce_scatterv, world, t, nil, { 1, 1, 1 })
check(not ok2 and tostring(err):find("sizes sum to 3 rows, the input has 6", 1, true), "bad sizes: %s", tostring(err))
ok("reduce_scatterv")

-- out-of-place all_reduce leaves the input alone
local a = T.from_table({ me, 1 }, "f32")
local o = T.zeros({ 2 }, "f32")
world:all_reduce(a, "sum", o)
check(a:to_table()[1] == me, "input changed")
check(o:to_table()[1] == W * (W - 1) / 2 and o:to_table()[2] == W, "out-of-place sum")
ok("all_reduce out of place")

-- explain on a real group: host rules, and the device rules named once
local e = weft.policy.explain(world, a)
local route = os.getenv("WEFT_HOST_BACKEND") == "store" and "store" or "shm"
check(e:find("all_reduce f32 {2} (8 B, cpu) on world (3 ranks): " .. route, 1, true), "explain: %s", e)
check(e:find("device rules passed over: host tensor", 1, true), "explain: %s", e)
ok("explain")

weft.shutdown()
