-- GPU check of weft.async and the served engine (needs 2+ GPUs; run by
-- tests/unit/async_spec.lua's #gpu test under scripts/weft-run): device
-- all-reduces through NCCL on the progress worker, the engine of
-- scripts/serve/ on device tensors checked against the reference, and the
-- async-vs-blocking cost of a small device all-reduce (to $OUT when set).
local root = os.getenv("WEFT_ROOT") or "."
package.path = root .. "/scripts/serve/?.lua;" .. package.path
local ffi = require("ffi")
local weft = require("weft")
local async = require("weft.async")
local engine = require("serve_engine")
local model = require("serve_model")

local function say(fmt, ...) io.stdout:write(fmt:format(...), "\n"); io.stdout:flush() end
local function check(c, fmt, ...) if not c then error("check failed: " .. fmt:format(...), 2) end end

local cfg = engine.config()
cfg.device = "cuda"
cfg.hidden = 256
local e = engine.bringup(cfg)
local tp, W, me = e.tp, e.W, e.tp.rank_in_group
local T = weft.tensor

-- 1. async device all-reduce
for _, dt in ipairs({ "f32", "bf16" }) do
  local vals = {}
  for i = 1, 1000 do vals[i] = (me + 1) * ((i % 7) - 3) end
  local t = T.from_table(vals, dt, { 1000 }):to("cuda")
  local h = async.all_reduce(tp, t)
  check(h:wait() == t, "result is t")
  local got = t:to("cpu"):to_table()
  local s = W * (W + 1) / 2
  for i = 1, 1000 do check(got[i] == s * ((i % 7) - 3), "%s element %d: %s", dt, i, tostring(got[i])) end
end
say("OK device all_reduce")

-- 2. the served engine on device tensors
if me == 0 then
  local layers = e.layers
  local steps = 30
  local t0 = weft.now_us()
  for k = 1, steps do
    local layer = (k % 3 == 0) and "mlp" or "linear"
    local L = layers[layer]
    local rows = (k % 4) + 1
    local xs, flat = {}, ffi.new("float[?]", rows * L.d_in)
    for r = 1, rows do
      local x = {}
      for i = 1, L.d_in do x[i] = ((k * 31 + r * 7 + i) % 19 - 9) / 8; flat[(r - 1) * L.d_in + i - 1] = x[i] end
      xs[r] = x
    end
    local msg = { s = k, l = layer, b = rows, x = ffi.string(flat, rows * L.d_in * 4) }
    local hs = e:send(msg)
    local t, host, n = e:partial(msg)
    local hr = e:reduce(t)
    while not hr:test() do ffi.C.poll(nil, 0, 0) end
    hs:wait()
    host:copy_(t)
    local f = ffi.cast("float *", host.ptr)
    check(f[n - 1] == k * W, "check word of step %d: %s", k, tostring(f[n - 1]))
    for r = 1, rows do
      local ref = model.reference(L, xs[r])
      for o = 1, L.d_out do
        local y = f[(r - 1) * L.d_out + o - 1]
        check(math.abs(y - ref[o]) <= 1e-4 * (1 + math.abs(ref[o])), "step %d row %d out %d: %s vs %s", k, r, o, y, ref[o])
      end
    end
  end
  local per_step = (weft.now_us() - t0) / steps
  e:send({ stop = true }):wait()
  say("OK engine on device (%.1f us per step incl. checks)", per_step)
else
  while true do
    local msg = e:recv(2000)
    if msg then
      if msg.stop then break end
      e:execute(msg)
    end
  end
  say("OK engine on device")
end

-- 3. async vs blocking, small device all-reduce
local nc = tp.device_group
local recs = {}
for _, count in ipairs({ 16, 1024, 262144 }) do
  local t = T.ones({ count }, "f32", "cuda")
  local modes = {
    { "blocking", function() nc:all_reduce(t.ptr, t.ptr, count, "f32", "sum"); nc:synchronize() end },
    { "async_wait", function() async.all_reduce(tp, t):wait() end },
  }
  local xs = {}
  for _, m in ipairs(modes) do xs[m[1]] = {}; for _ = 1, 50 do m[2]() end end
  for _ = 1, 10 do
    for _, m in ipairs(modes) do
      tp:barrier()
      for _ = 1, 100 do
        local a = weft.now_us(); m[2](); local list = xs[m[1]]; list[#list + 1] = weft.now_us() - a
      end
    end
  end
  for _, m in ipairs(modes) do
    table.sort(xs[m[1]])
    local l = xs[m[1]]
    recs[#recs + 1] = ('{"op":"all_reduce","backend":"nccl","mode":"%s","dtype":"f32","world":%d,"bytes":%d,"us":%.2f,"p99_us":%.2f}')
      :format(m[1], W, count * 4, l[math.floor(#l / 2) + 1], l[math.ceil(#l * 0.99)])
  end
end
if me == 0 then
  for _, r in ipairs(recs) do say("BENCH %s", r) end
  local out = os.getenv("OUT")
  if out and out ~= "" then
    local f = io.open(out .. "/serve-gpu-" .. os.date("%Y-%m-%d") .. ".json", "w")
    if f then
      f:write('{"machine":"gpu","date":"', os.date("%Y-%m-%d"), '","records":[\n', table.concat(recs, ",\n"), "\n]}\n")
      f:close()
    end
  end
end
say("OK async overhead")
-- explicit teardown, in dependency order (the finalizers at lua_close run in
-- any order): the queues' workers, then the NCCL communicator the engine
-- made itself (the group does not own it), the message queue, the groups
require("weft.cuda").synchronize()
async.close(tp)
async.close(e.world)
if tp.device_group then tp.device_group:destroy(); tp.device_group = nil end
if e.mq then e.mq:destroy(); e.mq = nil end
weft.shutdown()
say("OK done")
