-- The common start of a device rank script (tests/helpers/gpu_*_worker.lua):
-- the pretend GPU when WEFT_FAKE_DEVICE=1 (a CPU rehearsal; it must come
-- before any weft module loads), then the modules every worker uses.
--   local R = require("helpers.gpu_worker")
--   local G, weft, T, cuda, policy = R.G, R.weft, R.T, R.cuda, R.policy
if os.getenv("WEFT_FAKE_DEVICE") == "1" then require("helpers.fake_device").install() end
local weft = require("weft")
return {
  G = require("helpers.gpu_ranks"),
  weft = weft,
  T = weft.tensor,
  cuda = require("weft.cuda"),
  policy = require("weft.policy"),
  db = require("weft.backends.device_backends"),
  graph = require("weft.graph"),
  async = require("weft.async"),
  car = require("weft.backends.custom_ar"),
  -- the device of this rank: "cuda:<n>"
  dev = function() return "cuda:" .. require("weft.cuda").current_device() end,
}
