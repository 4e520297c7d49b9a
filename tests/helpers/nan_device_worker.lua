-- One rank of the device NaN checks (issue 13 item 5): float max/min of
-- device tensors propagate NaN whichever rank holds it (tests/helpers/nan_cases.lua).
-- On the pretend GPU (WEFT_FAKE_DEVICE=1, tests/helpers/fake_device.lua,
-- whose NCCL max/min drop NaN as NCCL's fmaxf/__hmax do) or on 2 real GPUs:
--   WEFT_FAKE_DEVICE=1 scripts/weft-run -n 2 tests/helpers/nan_device_worker.lua
-- Prints "PASS <name>" / "FAIL <name>: <why>" per check, "DONE <n> failed".
local root = (arg[0]:match("^(.*)/tests/helpers/[^/]*$") or ".")
package.path = root .. "/tests/?.lua;" .. package.path
if os.getenv("WEFT_FAKE_DEVICE") == "1" then require("helpers.fake_device").install() end
local G = require("helpers.gpu_ranks")
local N = require("helpers.nan_cases")
local weft = require("weft")
local cuda = require("weft.cuda")

local world = weft.init { timeout_ms = 30000 }
assert(world.world_size == 2, "run with 2 ranks")
weft.initialize_model_parallel { tp = 2 }
local tp = weft.tp()
local S = G.soft_checks()
local check, done = G.checks(world, S)
local c = { g = tp, dev = "cuda:" .. cuda.current_device(), want = S.want }

check("nan_all_reduce", function() N.all_reduce(c) end)
check("nan_reduce_scatter", function() N.reduce_scatter(c) end)
check("nan_graph_replay", function() N.graph(c) end)
check("nan_explain", function() N.explain(c) end)
weft.destroy_model_parallel()
weft.shutdown()
done()
