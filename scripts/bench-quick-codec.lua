#!/usr/bin/env luajit
-- bench-quick-codec.lua — one GPU: the quick all-reduce's codec steps alone
-- (weft_qr_codec_step: the kernel's own encode/decode functions), checked
-- against the CPU reference bit for bit, then timed beside a device copy of
-- the same bytes:
--   quantize  bf16 input -> wire (codes + one f32 scale per 32 elements)
--   reduce W  W wires -> decode, f32 sum in rank order, encode once -> wire,
--             and the decoded result -> bf16 output
-- Rates are given per byte of bf16 input the step stands for (quantize: its
-- input; reduce: the W contributions, W x the output), and as total memory
-- traffic (bytes read + written per second), against the copy's.
-- Beside each step, its probe: the same loads and stores at the same
-- addresses without the codec's work (the words only xor-ed together), the
-- rate the step's memory pattern allows on this GPU; what the step loses
-- to the probe is the codec's work, what the probe loses to the copy is the
-- pattern (small loads, the scales).
--
--   luajit scripts/bench-quick-codec.lua [--sizes 16,64,256] [--reps 20] [--machine NAME] [--out DIR]
--
-- Writes <out>/quick-codec-<machine>-<date>.json (results format: docs/architecture.md#conventions-in-one-place) and .md.
local ffi = require("ffi")
local root = dofile((arg[0]:match("^(.*)/[^/]*$") or ".") .. "/lua_path.lua")
local weft = require("weft")
local cuda = require("weft.cuda")
local T = weft.tensor
local Q = require("weft.quick")
local C = require("weft.internal.ffi").C

local opt = { sizes = "16,64,256", reps = 20, machine = false,   -- false: the GPU it runs on (below)
              out = "bench/results" }
local i = 1
while arg[i] do
  local k = arg[i]:match("^%-%-(.*)$")
  if not k or opt[k] == nil then io.stderr:write("usage: see the header of this file\n"); os.exit(2) end
  opt[k] = arg[i + 1]
  i = i + 2
end
opt.reps = tonumber(opt.reps)

if not cuda.available() then io.stderr:write("bench-quick-codec: no CUDA device\n"); os.exit(77) end
opt.machine = opt.machine or require("weft.tools.bench").machine_name(cuda.device_name(cuda.current_device()), 1)
local CODECS = { "fp", "int8", "int4", "fp8" }
local WORLDS = { 2, 4, 8 }
local MIB = 1048576
local BF16 = 2
local sz1 = ffi.new("size_t[1]")
local function wire_bytes(codec, n)
  assert(C.weft_qr_wire_bytes(Q.CODECS[codec], n, sz1) == 0)
  return tonumber(sz1[0])
end
local FORMS = { { name = "kernel", step = 0 }, { name = "probe", step = 2 } }
local function step(s, codec, W, inp, wire, out, n, form)
  if C.weft_qr_codec_step(s + (form or FORMS[1]).step, Q.CODECS[codec], BF16, W, inp, wire, out, n, nil) ~= 0 then
    error("codec step: " .. ffi.string(C.weft_last_error()))
  end
end

---------------------------------------------------------------- check first
-- The steps (the probes compute nothing to check), at a size of a few parts (the
-- tail) and, for 2 and 8 ranks, one of many waves (over 4 x the resident blocks'
-- parts).
local ok_all = true
for _, n in ipairs { 100003, 9437189 } do
  for _, codec in ipairs(CODECS) do
    for _, W in ipairs(WORLDS) do
      if n < 1e6 or W ~= 4 then
        local wb = wire_bytes(codec, n)
        local ins, dins, wires = {}, {}, cuda.alloc(W * wb)
        for r = 1, W do
          ins[r] = T.randn({ n }, "bf16", "cpu", { seed = 40 + r })
          -- the codec's edges in rank 1's input: Inf, NaN, a block of zeros,
          -- blocks of tiny and of subnormal values (bf16 bits)
          if r == 1 then
            local h = ffi.cast("uint16_t *", ins[r].ptr)
            h[64 * 32 + 5], h[65 * 32 + 9], h[66 * 32 + 31] = 0x7f80, 0xff80, 0x7fc0
            for k = 0, 31 do
              h[67 * 32 + k] = 0
              h[68 * 32 + k] = k % 2 == 0 and 0x0da2 or 0x8da2 -- about 1e-30
              h[69 * 32 + k] = k % 3 == 0 and 0x0001 or 0x8003 -- subnormal
            end
          end
          dins[r] = ins[r]:clone("cuda:0")
        end
        local ref = Q.reference(codec, "bf16", ins)
        local out = T.zeros({ n }, "bf16", "cuda:0")
        local wo = cuda.alloc(wb)
        for _, form in ipairs(FORMS) do
          if not form.name:find("probe") then
            for r = 1, W do step(0, codec, W, dins[r].ptr, ffi.cast("char *", wires) + (r - 1) * wb, nil, n, form) end
            out:fill_(0)
            step(1, codec, W, wires, wo, out.ptr, n, form)
            cuda.synchronize()
            local got = out:clone("cpu")
            local x, y = ffi.cast("const uint16_t *", got.ptr), ffi.cast("const uint16_t *", ref.ptr)
            local bad = 0
            for k = 0, n - 1 do
              -- bit for bit, NaNs aside (any NaN matches any NaN)
              if x[k] ~= y[k] and not (bit.band(x[k], 0x7fff) > 0x7f80 and bit.band(y[k], 0x7fff) > 0x7f80) then
                bad = bad + 1
              end
            end
            print(("check %-6s %-4s W=%d n=%d: %s"):format(form.name, codec, W, n, bad == 0
              and "bit-identical to the CPU reference" or (bad .. " elements differ")))
            if bad > 0 then ok_all = false end
            got:free()
          end
        end
        for r = 1, W do dins[r]:free(); ins[r]:free() end
        ref:free(); cuda.free(wires); cuda.free(wo); out:free()
      end
    end
  end
end

---------------------------------------------------------------- timing
local e0, e1 = cuda.event(), cuda.event()
local function time_us(fn)
  for _ = 1, 3 do fn() end
  local ts = {}
  for _ = 1, 5 do
    e0:record()
    for _ = 1, opt.reps do fn() end
    e1:record()
    e1:synchronize()
    ts[#ts + 1] = e0:elapsed(e1) * 1e3 / opt.reps
  end
  table.sort(ts)
  return ts[3]
end

local recs, lines = {}, {}
local function rec(r) recs[#recs + 1] = r end
-- one row: the step and its probe, traffic as a share of the copy's
local function row(size, name, codec, us, cus, inb, traffic, copy_traffic)
  local tr, ctr = traffic / us / 1e6, traffic / cus / 1e6
  lines[#lines + 1] = ("| %d MiB | %s | %s | %.1f | %.2f | %.2f | %.0f %% | %.1f | %.2f | %.0f %% |"):format(
    size, name, codec, us, inb / us / 1e6, tr, 100 * tr / copy_traffic, cus, ctr, 100 * ctr / copy_traffic)
end
-- the step, then its probe, back to back: drift hits both alike
local function time_forms(fn)
  local t = {}
  for k, form in ipairs(FORMS) do t[k] = time_us(function() fn(form) end) end
  return t
end
for s in opt.sizes:gmatch("%d+") do
  local bytes = tonumber(s) * MIB
  local n = bytes / 2
  local src = T.randn({ n }, "bf16", "cuda:0", { seed = 1 })
  local dst = cuda.alloc(bytes)
  local us = time_us(function() cuda.copy_async(dst, src.ptr, bytes) end)
  local copy_traffic = 2 * bytes / us / 1e6
  rec { op = "copy", backend = "cudaMemcpy", dtype = "bf16", bytes = bytes, us = us,
        input_tbs = bytes / us / 1e6, traffic_tbs = copy_traffic }
  lines[#lines + 1] = ("| %d MiB | copy | - | %.1f | %.2f | %.2f | 100 %% | | | |"):format(s, us, bytes / us / 1e6,
                                                                                         copy_traffic)
  for _, codec in ipairs(CODECS) do
    local wb = wire_bytes(codec, n)
    local wire = cuda.alloc(wb)
    local t = time_forms(function(form) step(0, codec, 2, src.ptr, wire, nil, n, form) end)
    for k, u in ipairs(t) do
      rec { op = "quick_quantize", backend = codec, form = FORMS[k].name, dtype = "bf16", bytes = bytes, us = u,
            input_tbs = bytes / u / 1e6, traffic_tbs = (bytes + wb) / u / 1e6 }
    end
    row(s, "quantize", codec, t[1], t[2], bytes, bytes + wb, copy_traffic)
    cuda.free(wire)
    for _, W in ipairs(WORLDS) do
      local m = math.floor(n / W / 8) * 8               -- elements per contribution
      local mwb = wire_bytes(codec, m)
      local wires = cuda.alloc(W * mwb)
      for r = 0, W - 1 do step(0, codec, 2, src.ptr, ffi.cast("char *", wires) + r * mwb, nil, m) end
      local wo, out = cuda.alloc(mwb), cuda.alloc(m * 2)
      local t = time_forms(function(form) step(1, codec, W, wires, wo, out, m, form) end)
      local inb, traffic = W * m * 2, W * mwb + mwb + m * 2
      for k, u in ipairs(t) do
        rec { op = "quick_reduce", backend = codec, form = FORMS[k].name, dtype = "bf16", world = W, bytes = inb,
              us = u, input_tbs = inb / u / 1e6, traffic_tbs = traffic / u / 1e6 }
      end
      row(s, "reduce W=" .. W, codec, t[1], t[2], inb, traffic, copy_traffic)
      cuda.free(wires); cuda.free(wo); cuda.free(out)
    end
  end
  src:free(); cuda.free(dst)
end

local date = os.date("!%Y-%m-%d")
local commit = os.getenv("WEFT_COMMIT") or "unknown"
local base = ("%s/quick-codec-%s-%s"):format(opt.out, opt.machine, date)
local records = {}
for i, r in ipairs(recs) do
  local rec = {}
  for _, k in ipairs { "op", "backend", "form", "dtype", "world", "bytes", "us", "input_tbs", "traffic_tbs" } do
    rec[k] = r[k]
  end
  records[i] = rec
end
local j = assert(io.open(base .. ".json", "w"))
j:write(require("weft.tools.bench").json({ machine = opt.machine, date = date, commit = commit, records = records }, "  "), "\n")
j:close()
local m = assert(io.open(base .. ".md", "w"))
m:write(("# Quick all-reduce codec steps on one GPU (%s, %s, commit %s)\n\n"):format(opt.machine, date, commit))
m:write("scripts/bench-quick-codec.lua: median of 5 runs of ", opt.reps, " back-to-back calls, CUDA events. ",
        "`input TB/s`: bytes of bf16 input the step stands for, per second (reduce: the W contributions); ",
        "`traffic TB/s`: bytes read + written per second. The copy is cudaMemcpy of the same bytes.\n",
        "Checked first: every codec's steps bit-identical to the CPU reference: ", ok_all and "yes" or "NO", "\n\n")
m:write("`of copy`: the step's traffic rate over the copy's (the goal: >= 90 %). Columns 8-10: the step's ",
        "probe, the same loads and stores without the codec's work (the memory pattern's own rate).\n\n")
m:write("| size | step | codec | us | input TB/s | traffic TB/s | of copy | probe us | probe traffic TB/s | probe of copy |\n",
        "|---|---|---|---|---|---|---|---|---|---|\n")
m:write(table.concat(lines, "\n"), "\n")
m:close()
print(table.concat(lines, "\n"))
print("wrote " .. base .. ".json and .md")
os.exit(ok_all and 0 or 1)
