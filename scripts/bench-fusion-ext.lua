#!/usr/bin/env luajit
-- bench-fusion-ext.lua — the fusion patterns of weft.fusion_ext, timed by
-- CUDA-graph replay (a graph of --reps calls, replayed --iters times; per
-- call: the median replay / reps).
--
--   The single-rank kernels (one GPU, against a copy kernel moving the same
--   bytes): bench/moe_local_bench.cu (make moe-local-bench).
--
--   scripts/weft-run -n N scripts/bench-fusion-ext.lua ranks [--tokens ...] [--hidden ...]
--        [--top-k 8] [--patterns moe,finalize,prepost,rs] [--smoke]
--     N ranks, one GPU each: every pattern fused (auto) against the unfused
--     path (policy override fused=unfused), side by side. Timings of ranks
--     sharing one GPU (MPS) mean nothing: --smoke only checks that it runs.
--     Writes fusion-ext-ranks-<machine>-<date>.{json,md} (rank 0).
local ffi = require("ffi")
local root = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/lua_path.lua")
-- WEFT_FAKE_DEVICE=1: a CPU rehearsal of the script's logic on the pretend GPU
-- (tests/helpers/fake_device.lua; its times mean nothing)
if os.getenv("WEFT_FAKE_DEVICE") == "1" then
  package.path = root .. "/tests/?.lua;" .. package.path
  require("helpers.fake_device").install()
end
local bench = require("weft.tools.bench")
local fmt = string.format

local mode = arg[1]
if mode ~= "ranks" then
  io.stderr:write("usage: bench-fusion-ext.lua ranks [--tokens a,b] [--hidden a,b] [--top-k K] ...\n"
                  .. "(one rank's kernels against copy bandwidth: build/moe_local_bench)\n")
  os.exit(2)
end
local rest = {}
for i = 2, #arg do rest[#rest + 1] = arg[i] end
local o = bench.parse_args(rest, {
  tokens = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192", hidden = "4096,7168", top_k = 8,
  reps = 20, iters = 15, out = os.getenv("OUT") or "bench/results", patterns = "moe,finalize,prepost,rs",
}, { ["--smoke"] = "smoke" }, "bench-fusion-ext")
local function nums(s)
  local t = {}
  for v in tostring(s):gmatch("[^,]+") do t[#t + 1] = tonumber(v) or v end
  return t
end
if o.smoke then o.tokens, o.hidden, o.reps, o.iters = "1,64", "4096", 3, 3 end

local weft = require("weft")
local cuda = require("weft.cuda")
local graph = require("weft.graph")
local policy = require("weft.policy")
local T = weft.tensor
local C = require("weft.internal.ffi").C

-- per-call µs of fn by graph replay (capture on the capture stream)
local function time_graph(fn, gopts)
  gopts = gopts or {}
  gopts.warmup = 1
  local cap = graph.capture(function() for _ = 1, o.reps do fn() end end, gopts)
  local s = cuda.current_stream()
  cap:replay(s)
  local us = bench.time_runs(cuda, s, o.iters, function() cap:replay(s) end)
  cap:destroy()
  return bench.median(us) / o.reps
end

local date = os.date("!%Y-%m-%d")
local machine = bench.machine_name(cuda.available() and cuda.device_name(cuda.current_device()) or "none",
                                   tonumber(os.getenv("WORLD_SIZE") or "1"))

---------------------------------------------------------------- N ranks
local world = weft.init { timeout_ms = 60000 }
local me, W = world.rank, world.world_size
local dev = "cuda:" .. cuda.current_device()
local K = o.top_k
local maxT = 0
for _, Tn in ipairs(nums(o.tokens)) do maxT = math.max(maxT, Tn * (Tn % W == 0 and 1 or W)) end
local out_rows = {}
for _, H in ipairs(nums(o.hidden)) do
  world:prepare_fusion_ext { max_tokens = maxT, hidden = H, dtype = "bf16" }
  for _, pat in ipairs(nums(o.patterns)) do
    for _, T0 in ipairs(nums(o.tokens)) do
      local Tn = pat == "rs" and math.ceil(T0 / W) * W or T0
      local res = T.randn({ pat == "rs" and Tn / W or Tn, H }, "bf16", dev, { seed = 4 })
      local w = T.randn({ H }, "bf16", dev, { seed = 5 })
      local no, ro = T.empty(res.shape, "bf16", dev), T.empty(res.shape, "bf16", dev)
      local ins = {}
      local fn
      if pat == "moe" then
        ins = { T.randn({ K, Tn, H }, "bf16", dev, { seed = 1 + me }), T.rand({ K, Tn }, "f32", dev, { seed = 2 }),
                T.randn({ Tn, H }, "bf16", dev, { seed = 3 + me }) }
        fn = function() world:fused_moe_allreduce_rmsnorm { expert_outputs = ins[1], expert_scales = ins[2], shared_output = ins[3],
                                                             residual = res, weight = w, norm_out = no, residual_out = ro, max_tokens = maxT } end
      elseif pat == "finalize" then
        local p = {}
        for i = 1, Tn * K do p[i] = (i * 7919) % (Tn * K) end
        ins = { T.randn({ Tn * K, H }, "bf16", dev, { seed = 1 + me }), T.from_table(p, "i32", { Tn, K }, dev),
                T.rand({ Tn, K }, "f32", dev, { seed = 2 }), T.randn({ Tn, H }, "bf16", dev, { seed = 3 + me }) }
        fn = function() world:fused_moe_finalize_allreduce_rmsnorm { expert_outputs = ins[1], expanded_idx_to_permuted_idx = ins[2],
                          expert_scale_factor = ins[3], shared_expert_output = ins[4], residual = res, weight = w,
                          norm_out = no, residual_out = ro, max_tokens = maxT } end
      elseif pat == "prepost" then
        ins = { T.randn({ Tn, H }, "bf16", dev, { seed = 1 + me }) }
        fn = function() world:fused_allreduce_prepost_rmsnorm(ins[1], res, w, w, 1e-6, { norm_out = no, residual_out = ro, max_tokens = maxT }) end
      else
        ins = { T.randn({ Tn, H }, "bf16", dev, { seed = 1 + me }), T.empty({ Tn, H }, "bf16", dev) }
        fn = function() world:fused_reduce_scatter_rmsnorm(ins[1], res, w, 1e-6, { norm_out = no, residual_out = ro,
                                                                                    gathered_out = ins[2], max_tokens = maxT }) end
      end
      local gopts = { groups = { world }, fusion = { max_tokens = maxT, hidden = H, dtype = "bf16", ext = true } }
      local tf = time_graph(fn, gopts)
      local pf = world:fusion_ext_last()
      policy.set { fused = "unfused" }
      local tu = time_graph(fn, gopts)
      policy.set { fused = "default" }
      if me == 0 then
        out_rows[#out_rows + 1] = { pattern = pat, hidden = H, tokens = Tn, fused_us = tf, unfused_us = tu, fused_path = pf }
        io.write(fmt("%-9s H %d T %d: fused %.2f us (%s), unfused %.2f us\n", pat, H, Tn, tf, tostring(pf), tu))
        io.stdout:flush()
      end
      for _, t in ipairs(ins) do t:free() end
      for _, t in ipairs { res, w, no, ro } do t:free() end
    end
  end
end
if me == 0 then
  local doc = { kind = "fusion-ext-ranks", machine = machine, date = date, commit = bench.commit(), world = W,
                smoke = o.smoke or false, shared_gpu = os.getenv("WEFT_ALLOW_SHARED_GPU") == "1", rows = out_rows }
  local base = fmt("%s/fusion-ext-ranks-%s-%s", o.out, machine, date)
  os.execute("mkdir -p '" .. o.out .. "'")
  local f = assert(io.open(base .. ".json", "w")); f:write(bench.json(doc, "  "), "\n"); f:close()
  local md = {}
  for _, r in ipairs(out_rows) do
    md[#md + 1] = { r.pattern, tostring(r.hidden), tostring(r.tokens), fmt("%.2f", r.fused_us), fmt("%.2f", r.unfused_us) }
  end
  local note = doc.shared_gpu and "ranks SHARING one GPU (MPS): these times are not speed, only a run of the script" or ""
  local fo = assert(io.open(base .. ".md", "w"))
  fo:write(fmt("# weft.fusion_ext, %d ranks (%s, %s, commit %s)\n\n%s\n\n", W, machine, date, doc.commit, note),
           bench.table({ "pattern", "hidden", "tokens", "fused µs", "unfused µs" }, md))
  fo:close()
  print("wrote " .. base .. ".json and .md")
end
world:barrier()
