-- What the device calls' agreement announcements cost (src/coll/agree.h):
-- the custom all-reduce in CUDA-graph replays (20 calls per graph, median
-- of 30 replays per round, fresh random data checked against the host sum)
-- and eager (launch to synchronize), with the announcements on and off
-- (WEFT_DEVICE_AGREE is read when the workspace is created: run this twice).
--
--   WEFT_DEVICE_AGREE=1 scripts/weft-mps -n 2 -- scripts/weft-run -n 2 scripts/bench-agree.lua
--   WEFT_DEVICE_AGREE=0 scripts/weft-mps -n 2 -- scripts/weft-run -n 2 scripts/bench-agree.lua
--
-- Prints `agree=<0|1> <algo> <bytes> graph <us/call> eager <us/call>` on rank 0.
-- Ranks sharing one GPU under MPS measure the kernels' extra work beside the
-- same work, not the speed of a real 2-GPU all-reduce.
local weft = require("weft")
local cuda = require("weft.cuda")
local graph = require("weft.graph")
local policy = require("weft.policy")
local T = require("weft.tensor")
local world = weft.init()
local me, W = world.rank, world.world_size
local DEV = "cuda:" .. cuda.current_device()
local now = weft.now_us
local agree = os.getenv("WEFT_DEVICE_AGREE") or "1"

local function median(t) table.sort(t); return t[math.floor((#t + 1) / 2)] end

for _, algo in ipairs { "oneshot", "twoshot" } do
  policy.set { all_reduce = algo, group = world }
  for _, n in ipairs { 4096, 131072, 2097152 } do
    local h = T.rand({ n }, "i32", "cpu", { seed = 7 + me }):to("bf16")
    local x = h:clone(DEV)
    local want = h:clone("cpu"); world:all_reduce(want)  -- the host sum, for the check
    world:all_reduce(x); cuda.synchronize()
    local bad = x:compare(want)
    if bad ~= 0 then error(("agree=%s %s n=%d: result differs by %g"):format(agree, algo, n, bad)) end
    local gr = graph.capture(function() for _ = 1, 20 do world:all_reduce(x) end end, { groups = { world } })
    local gt, et = {}, {}
    for _ = 1, 30 do
      x:copy_(h); cuda.synchronize(); world:barrier()
      local t0 = now(); gr:replay(); cuda.synchronize()
      gt[#gt + 1] = (now() - t0) / 20
    end
    for _ = 1, 30 do
      x:copy_(h); cuda.synchronize(); world:barrier()
      local t0 = now(); world:all_reduce(x); cuda.synchronize()
      et[#et + 1] = now() - t0
    end
    gr:destroy()
    if me == 0 then
      print(("agree=%s %s %d graph %.2f eager %.2f"):format(agree, algo, n * 2, median(gt), median(et)))
      io.stdout:flush()
    end
    x:free(); h:free(); want:free()
  end
end
policy.set { all_reduce = "default", group = world }
weft.shutdown()
