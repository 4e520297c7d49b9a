-- Ranks of tests/unit/sized_memo_spec.lua on a pretend GPU (WEFT_FAKE_DEVICE=1, 2
-- ranks): the eager device all_reduce's memo of the size-dependent choice
-- (weft.backends.device_backends.sized_memo). After the first calls the rules are not
-- walked again; every input the choice reads still steers each later call.
-- Prints "PASS <name>" / "FAIL <name>: why"; exits 1 on a failure.
local root = (arg[0]:match("^(.*)/tests/helpers/[^/]*$") or ".")
package.path = root .. "/tests/?.lua;" .. package.path
local fake = require("helpers.fake_device")
fake.install()
local weft = require("weft")
local policy = require("weft.policy")
local db = require("weft.backends.device_backends")
local C = require("weft.internal.ffi").C

local world = weft.init { timeout_ms = 20000 }
local DEV = "cuda:" .. require("weft.cuda").current_device()
local failed = false
local function check(name, ok, why)
  if ok then print("PASS " .. name) else failed = true; print("FAIL " .. name .. ": " .. tostring(why)) end
end

-- count the kernel launches (and their algorithm) and the policy walks
local real_run = C.weft_ar_run
local runs, algos = 0, {}
C.weft_ar_run = function(h, i, o, c, dt, algo, s)
  runs = runs + 1; algos[#algos + 1] = tonumber(algo)
  return real_run(h, i, o, c, dt, algo, s)
end
local real_select = policy.select
local walks = 0
policy.select = function(...) walks = walks + 1; return real_select(...) end

local x = weft.tensor.randn({ 4096 }, "bf16", DEV)     -- 8 KiB
local function calls(n, t)
  runs, walks, algos = 0, 0, {}
  for _ = 1, n do world:all_reduce(t or x) end
end

world:all_reduce(x)   -- makes the workspace
calls(2)
calls(50)
check("memoised: 50 calls, 0 policy walks, 50 kernel launches", walks == 0 and runs == 50,
      ("walks %d, launches %d"):format(walks, runs))

policy.set { all_reduce = "twoshot" }
calls(3)
check("policy.set re-decides (twoshot: algorithm 2)", runs == 3 and algos[3] == 2 and walks == 1,
      ("launches %d, last algorithm %s, walks %d"):format(runs, tostring(algos[#algos]), walks))
policy.set { all_reduce = "default" }

world.use_custom_allreduce = false
calls(3)
check("g.use_custom_allreduce = false sends the next calls to NCCL", runs == 0, ("%d launches"):format(runs))
world.use_custom_allreduce = nil
calls(3)
check("g.use_custom_allreduce = nil brings the kernels back", runs == 3, ("%d launches"):format(runs))

local kind = world._kind or "world"
local saved = db.custom_ar_by_kind[kind]
db.custom_ar_by_kind[kind] = false
calls(3)
check("the per-kind table edited in place is seen", runs == 0, ("%d launches"):format(runs))
db.custom_ar_by_kind[kind] = saved
calls(3)
check("and restored", runs == 3, ("%d launches"):format(runs))

-- an unaligned input of the same size: NCCL, and the aligned one still takes the kernels
local big = weft.tensor.randn({ 4097 }, "bf16", DEV)
local un = big:narrow(0, 1, 4096)
calls(3, un)
check("an unaligned input of a memoised size goes to NCCL", runs == 0, ("%d launches"):format(runs))
calls(3)
check("the aligned one still takes the kernels", runs == 3, ("%d launches"):format(runs))

-- the workspace's size bounds the choice: a size over it never takes the kernels
local d = db.ensure_ar(world)
local over = weft.tensor.randn({ d.ar.max_bytes / 2 + 8 }, "bf16", DEV)
calls(2, over)
check("a size over the workspace goes to NCCL (twice)", runs == 0, ("%d launches"):format(runs))
over:free()

-- the output's alignment is the rule's check (per call): an unaligned `out`
-- of a memoised size goes to NCCL, an aligned one takes the kernels, memoised
local ubuf = weft.tensor.empty({ 4097 }, "bf16", DEV)
local uout, aout = ubuf:narrow(0, 1, 4096), weft.tensor.empty({ 4096 }, "bf16", DEV)
runs, walks = 0, 0
for _ = 1, 3 do world:all_reduce(x, "sum", uout) end
check("an unaligned output goes to NCCL, asked of the rules each call", runs == 0 and walks == 3,
      ("launches %d, walks %d"):format(runs, walks))
runs, walks = 0, 0
for _ = 1, 3 do world:all_reduce(x, "sum", aout) end
check("an aligned output takes the kernels, memoised", runs == 3 and walks == 0,
      ("launches %d, walks %d"):format(runs, walks))

-- The algorithm is chosen once, by the rule (C's choice through
-- weft_ar_resolve): every weft_ar_run from the Lua path got a kernel, never
-- "auto" (0), and the kernel explain names is the one that ran
local KIND = require("weft.backends.custom_ar").KIND_NAME
local autos = 0
for _, a in ipairs(fake.ar_algos) do if a % 256 == 0 then autos = autos + 1 end end
local function ran_as_explained(t)
  local n = #fake.ar_algos
  world:all_reduce(t)
  local k = KIND[(fake.ar_algos[#fake.ar_algos] or 0) % 256]
  local e = policy.explain(world, t)
  return #fake.ar_algos == n + 1 and k ~= nil and e:find("-> " .. k .. " kernel", 1, true) ~= nil, k, e
end
local ok1, k1, e1 = ran_as_explained(x)
local mid = weft.tensor.randn({ 5 * 1048576 }, "bf16", DEV)   -- 10 MiB: above the one-shot limit
local ok2, k2, e2 = ran_as_explained(mid)
mid:free()
check("the algorithm is chosen once: weft_ar_run never gets auto, and runs the kernel explain names",
      #fake.ar_algos > 0 and autos == 0 and ok1 and ok2 and k1 == "oneshot" and k2 == "twoshot",
      ("%d runs, %d with auto; 8 KiB ran %s (%s); 10 MiB ran %s (%s)"):format(#fake.ar_algos, autos,
        tostring(k1), ok1 and "as explained" or e1, tostring(k2), ok2 and "as explained" or e2))

-- a failed kernel breaks the group's workspace: the memo must not outlive it
C.weft_ar_run = function() runs = runs + 1; return -5 end
local ok = pcall(world.all_reduce, world, x)
C.weft_ar_run = function(h, i, o, c, dt, algo, s)
  runs = runs + 1; algos[#algos + 1] = tonumber(algo)
  return real_run(h, i, o, c, dt, algo, s)
end
local ok2, err2 = pcall(world.all_reduce, world, x)
check("after a failed kernel the next call raises (no stale choice)", not ok and not ok2 and
      tostring(err2):find("failed earlier", 1, true) ~= nil, tostring(err2))

io.stdout:flush()
weft.shutdown()
os.exit(failed and 1 or 0)
