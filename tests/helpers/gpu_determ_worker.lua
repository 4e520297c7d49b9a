-- One rank of tests/gpu/gpu_determ_spec.lua: deterministic mode (docs/policy.md
-- §10) at world W, ranks sharing one GPU under MPS:
--   scripts/weft-mps -n W -- scripts/weft-run -n W tests/helpers/gpu_determ_worker.lua
-- Random inputs (with ±0.0 columns); every comparison is BIT FOR BIT (memcmp
-- of the result bytes), never a tolerance:
--   batch    row i of all_reduce(x) and of fused_allreduce_rmsnorm (both
--            outputs) from one 8192-row call equals row i from calls of
--            1 / 7 / 128 / 1000 rows (bf16, hidden 4096); f16 and f32 at 1000 rows;
--   paths    one-shot, flag one-shot, two-shot, auto all-reduce; fused
--            one-shot, fused two-shot and unfused (all_reduce + norm kernel);
--   graph    eager against CUDA-graph replay on new data;
--   ranks    every rank holds the same bytes (an FNV-1a hash, all-gathered);
--   default  with the mode off the policy and the numbers are as before.
-- Prints "PASS <name> (..)" / "FAIL <name>: why" per check, plus INFO lines;
-- exits 1 on a failure. WEFT_FAKE_DEVICE=1: a CPU rehearsal on the pretend
-- GPU (tests/helpers/fake_device.lua), where fused and unfused need not
-- agree (the fake reduces in f64): that comparison is then only reported.
local root = (arg[0]:match("^(.*)/tests/helpers/[^/]*$") or ".")
package.path = root .. "/tests/?.lua;" .. package.path
local FAKE = os.getenv("WEFT_FAKE_DEVICE") == "1"
local R = require("helpers.gpu_worker")
local ffi = require("ffi")
local bit = require("bit")
local G, weft, T, cuda, policy, db, graph, async = R.G, R.weft, R.T, R.cuda, R.policy, R.db, R.graph, R.async

pcall(ffi.cdef, "int memcmp(const void *a, const void *b, size_t n);")

local world = weft.init { timeout_ms = tonumber(os.getenv("WEFT_TIMEOUT_MS") or "") or 60000 }
local me, W = world.rank, world.world_size
local g = world
local DEV = "cuda:" .. cuda.current_device()
local ROWS = tonumber(os.getenv("WEFT_DETERM_ROWS") or "") or 8192   -- the full call
local HIDDEN = 4096
local BATCHES = { 1, 7, 128, 1000 }
local MAXT = ROWS

local S = G.soft_checks()
local want = S.want
local check, done = G.checks(world, S, function() policy.set { all_reduce = "default", fused = "default", group = g } end)

---------------------------------------------------------------- helpers
-- x of rows x hidden: random, per rank; column 5 is -0.0 on every rank (the
-- all -0.0 sum), column 6 -0.0 on rank 0 and +0.0 elsewhere
local function input(rows, dt, seed)
  local h = T.randn({ rows, HIDDEN }, dt, "cpu", { seed = seed + me })
  local z = T.from_table({ -0.0 }, dt, { 1 })
  local pz = T.from_table({ me == 0 and -0.0 or 0.0 }, dt, { 1 })
  local es = h:elem_size()
  local base = ffi.cast("uint8_t *", h.ptr)
  for r = 0, rows - 1 do
    ffi.copy(base + (r * HIDDEN + 5) * es, z.ptr, es)
    ffi.copy(base + (r * HIDDEN + 6) * es, pz.ptr, es)
  end
  z:free(); pz:free()
  local d = h:clone(DEV)
  h:free()
  return d
end

local function host(t) return t:to("cpu") end

-- rows (0-based) whose bytes differ between device tensors a and b: count, first
local function diff_rows(a, b)
  local ha, hb = host(a), host(b)
  local rb = HIDDEN * ha:elem_size()
  local rows = ha.numel / HIDDEN
  local pa, pb = ffi.cast("const uint8_t *", ha.ptr), ffi.cast("const uint8_t *", hb.ptr)
  local bad, first = 0, nil
  for r = 0, rows - 1 do
    if ffi.C.memcmp(pa + r * rb, pb + r * rb, rb) ~= 0 then
      bad = bad + 1
      first = first or r
    end
  end
  ha:free(); hb:free()
  return bad, first
end

local function same_bits(a, b, what)
  local bad, first = diff_rows(a, b)
  want(bad == 0, "%s: %d rows differ in their bits (first: row %s)", what, bad, tostring(first))
  return bad == 0
end

-- FNV-1a (64-bit) of a tensor's bytes, as hex
local function hash(t)
  local h = host(t)
  local n = tonumber(h.nbytes) / 4
  local p = ffi.cast("const uint32_t *", h.ptr)
  local x = ffi.new("uint64_t", 14695981039346656037ULL)
  local prime = 1099511628211ULL
  for i = 0, n - 1 do
    x = bit.bxor(x, ffi.cast("uint64_t", p[i])) * prime
  end
  h:free()
  return bit.tohex(x)
end

local function ranks_agree(t, what)
  local hs = world.cpu_group:allgather(hash(t))
  for r = 2, #hs do
    want(hs[r] == hs[1], "%s: rank %d's bytes differ from rank 0's (hash %s against %s)", what, r - 1, hs[r], hs[1])
  end
end

local function all_reduce_into(x, out, rows_per_call)
  local rows = x.shape[1]
  for off = 0, rows - 1, rows_per_call do
    local n = math.min(rows_per_call, rows - off)
    g:all_reduce(x:narrow(0, off, n), "sum", out:narrow(0, off, n))
  end
end

local function fused_into(x, res, w, yn, yr, rows_per_call, opts)
  local rows = x.shape[1]
  for off = 0, rows - 1, rows_per_call do
    local n = math.min(rows_per_call, rows - off)
    local o = { max_tokens = MAXT, norm_out = yn:narrow(0, off, n), residual_out = yr:narrow(0, off, n) }
    for k, v in pairs(opts or {}) do o[k] = v end
    g:fused_allreduce_rmsnorm(x:narrow(0, off, n), res:narrow(0, off, n), w, 1e-6, o)
  end
end

local function last_fused() local l = db.info(g).last_fused; return l and l.path or "?", l and l.why or "?" end

---------------------------------------------------------------- checks
check("setup", function()
  policy.set { deterministic = true, group = g }          -- collective: every rank, agreed
  local x = T.ones({ 16 }, "f32", DEV)
  g:all_reduce(x)
  want(x:compare(T.full({ 16 }, W, "f32")) == 0, "first all_reduce wrong")
  local info = db.info(g)
  want(info.custom_ar == "ready", "custom all-reduce %s: %s", tostring(info.custom_ar), tostring(info.custom_ar_why))
  local e = policy.explain(g, T.zeros({ 8, HIDDEN }, "bf16", DEV))
  want(e:find("deterministic: on", 1, true), "explain does not show the mode: %s", e)
  want(e:find("= deterministic mode", 1, true), "explain does not show the rule: %s", e)
  if me == 0 then print("INFO explain: " .. e:gsub("\n", " | ")) end
end)

local big = {}     -- kept for the later checks: bf16 8192 x 4096 inputs and full-call results

check("allreduce_batch_bf16", function()
  local x = input(ROWS, "bf16", 100)
  local full = T.empty(x.shape, "bf16", DEV)
  g:all_reduce(x, "sum", full)                           -- one call of ROWS rows
  if me == 0 then print(("INFO all_reduce %d x %d bf16: %s"):format(ROWS, HIDDEN, tostring(db.choice(g, "all_reduce", x)))) end
  -- as numbers, the host path's rank-order f32 sum (which keeps -0.0 + -0.0 = -0.0)
  local h = x:to("cpu"); g:all_reduce(h)
  local ma = full:compare(h)
  want(ma == 0, "full call against the host sum: max abs difference %g", ma)
  h:free()
  local out = T.empty(x.shape, "bf16", DEV)
  for _, b in ipairs(BATCHES) do
    all_reduce_into(x, out, b)
    same_bits(full, out, ("rows of %d-row calls against the %d-row call"):format(b, ROWS))
  end
  out:free()
  big.x, big.ar = x, full
end)

check("allreduce_batch_f16_f32", function()
  for _, dt in ipairs { "f16", "f32" } do
    local x = input(1000, dt, 200)
    local full = T.empty(x.shape, dt, DEV)
    g:all_reduce(x, "sum", full)
    local out = T.empty(x.shape, dt, DEV)
    for _, b in ipairs { 1, 7, 128 } do
      all_reduce_into(x, out, b)
      same_bits(full, out, ("%s: %d-row calls against the 1000-row call"):format(dt, b))
    end
    x:free(); full:free(); out:free()
  end
end)

check("allreduce_paths", function()
  for _, rows in ipairs { 2048, ROWS } do          -- 2048 x 4096 bf16 = 16 MiB: the Lamport buffers' size
    local x = rows == ROWS and big.x or input(rows, "bf16", 300)
    local ref = T.empty(x.shape, "bf16", DEV)
    g:all_reduce(x, "sum", ref)
    local out = T.empty(x.shape, "bf16", DEV)
    local kinds = {}
    for _, algo in ipairs { "oneshot", "oneshot_flag", "twoshot", "auto" } do
      policy.set { all_reduce = algo, group = g }
      local ar = db.info(g).custom_ar == "ready" and g._dev.ar or nil
      local kind, why = nil, "no workspace"
      if ar then kind, why = ar:resolve(x.numel, "bf16", algo) end
      kinds[#kinds + 1] = algo .. "->" .. tostring(kind or "refused")
      if kind then
        g:all_reduce(x, "sum", out)
        same_bits(ref, out, ("%d rows: %s against auto"):format(rows, algo))
      else   -- does not fit at this world size: refused before launch, the group still works
        S.expect_error("does not fit", g.all_reduce, g, x, "sum", out)
        if me == 0 then print("INFO " .. algo .. " refused: " .. tostring(why)) end
      end
    end
    if me == 0 then print(("INFO all_reduce kernels at %d rows: %s"):format(rows, table.concat(kinds, " "))) end
    if rows ~= ROWS then x:free() end
    ref:free(); out:free()
  end
end)

local function fused_batch(dt, rows, batches, seed, label)
  local x = rows == ROWS and dt == "bf16" and big.x or input(rows, dt, seed)
  local res = T.randn({ rows, HIDDEN }, dt, "cpu", { seed = seed + 50 }):clone(DEV)
  local w = T.randn({ HIDDEN }, dt, "cpu", { seed = seed + 51 }):clone(DEV)
  local fn, fr = T.empty(x.shape, dt, DEV), T.empty(x.shape, dt, DEV)
  fused_into(x, res, w, fn, fr, rows)
  local p, why = last_fused()
  if me == 0 then print(("INFO fused %s %d x %d: %s (%s)"):format(dt, rows, HIDDEN, p, why)) end
  local yn, yr = T.empty(x.shape, dt, DEV), T.empty(x.shape, dt, DEV)
  for _, b in ipairs(batches) do
    fused_into(x, res, w, yn, yr, b)
    same_bits(fn, yn, ("%s norm_out: %d-row calls against the %d-row call"):format(label, b, rows))
    same_bits(fr, yr, ("%s residual_out: %d-row calls against the %d-row call"):format(label, b, rows))
  end
  yn:free(); yr:free()
  return x, res, w, fn, fr
end

check("fused_batch_bf16", function()
  local _, res, w, fn, fr = fused_batch("bf16", ROWS, BATCHES, 400, "bf16")
  big.res, big.w, big.fn, big.fr = res, w, fn, fr
end)

check("fused_batch_f16_f32", function()
  for _, dt in ipairs { "f16", "f32" } do
    local x, res, w, fn, fr = fused_batch(dt, 1000, { 1, 7, 128 }, 500, dt)
    x:free(); res:free(); w:free(); fn:free(); fr:free()
  end
end)

-- fused one-shot, fused two-shot and unfused give the same bits
local function fused_paths(dt, rows, seed, opts)
  local x = rows == ROWS and dt == "bf16" and big.x or input(rows, dt, seed)
  local res = rows == ROWS and dt == "bf16" and big.res or T.randn({ rows, HIDDEN }, dt, "cpu", { seed = seed + 50 }):clone(DEV)
  local w = rows == ROWS and dt == "bf16" and big.w or T.randn({ HIDDEN }, dt, "cpu", { seed = seed + 51 }):clone(DEV)
  local outs = {}
  for _, path in ipairs { "oneshot", "twoshot", "unfused" } do
    local yn, yr = T.empty(x.shape, dt, DEV), T.empty(x.shape, dt, DEV)
    local o = {}
    for k, v in pairs(opts or {}) do o[k] = v end
    if path == "unfused" then policy.set { fused = "unfused", group = g } else o.algo = path end
    fused_into(x, res, w, yn, yr, rows, o)
    policy.set { fused = "default", group = g }
    local p = last_fused()
    want(p == (path == "unfused" and "unfused" or "fused"), "%s %s: took the %s path", dt, path, p)
    outs[#outs + 1] = { path, yn, yr }
  end
  local label = ("%s %d rows%s"):format(dt, rows, opts and opts.gemma and " gemma" or "")
  for i = 2, #outs do
    local a, b = outs[1], outs[i]
    if FAKE and b[1] == "unfused" then
      local bn, br = diff_rows(a[2], b[2]), diff_rows(a[3], b[3])
      if me == 0 then print(("INFO fake device: %s fused vs unfused differ in %d / %d rows (expected: f64 fake)"):format(label, bn, br)) end
    else
      same_bits(a[2], b[2], ("%s norm_out: %s against %s"):format(label, b[1], a[1]))
      same_bits(a[3], b[3], ("%s residual_out: %s against %s"):format(label, b[1], a[1]))
    end
  end
  for _, o in ipairs(outs) do o[2]:free(); o[3]:free() end
  if not (rows == ROWS and dt == "bf16") then x:free(); res:free(); w:free() end
end

check("fused_paths", function()
  fused_paths("bf16", 1000, 600)
  fused_paths("bf16", 7, 610)
  fused_paths("bf16", ROWS, 0)
  fused_paths("f16", 1000, 620)
  fused_paths("f32", 1000, 630)
  fused_paths("bf16", 128, 640, { gemma = true })
end)

-- the fused residual_out is all_reduce(x) rounded + residual rounded again:
-- the same bits as the plain all-reduce followed by the norm kernel's add
check("fused_matches_all_reduce", function()
  local n = 1000
  local x, res = big.x:narrow(0, 0, n), big.res:narrow(0, 0, n)
  local s = T.empty(x.shape, "bf16", DEV)
  g:all_reduce(x, "sum", s)
  local yn, yr = cuda.rmsnorm(s, res, big.w, 1e-6, { deterministic = true })
  if FAKE then
    if me == 0 then print("INFO fake device: norm kernel against the fused rows not compared") end
  else
    same_bits(big.fn:narrow(0, 0, n), yn, "norm_out: fused against all_reduce + deterministic norm kernel")
    same_bits(big.fr:narrow(0, 0, n), yr, "residual_out: fused against all_reduce + deterministic norm kernel")
  end
  s:free(); yn:free(); yr:free()
end)

check("graph_replay", function()
  cuda.synchronize()
  local rows = 128
  local xa, oa = T.empty({ rows, HIDDEN }, "bf16", DEV), T.empty({ rows, HIDDEN }, "bf16", DEV)
  local xf, rf = T.empty({ rows, HIDDEN }, "bf16", DEV), T.empty({ rows, HIDDEN }, "bf16", DEV)
  local gn, gr = T.empty({ rows, HIDDEN }, "bf16", DEV), T.empty({ rows, HIDDEN }, "bf16", DEV)
  local cap = graph.capture(function()
    g:all_reduce(xa, "sum", oa)
    g:fused_allreduce_rmsnorm(xf, rf, big.w, 1e-6, { max_tokens = MAXT, norm_out = gn, residual_out = gr })
  end, { warmup = 1, groups = { g }, fusion = { max_tokens = MAXT, hidden = HIDDEN, dtype = "bf16" } })
  for round = 1, 3 do
    local off = (1000 * round) % (ROWS - rows)
    xa:copy_(big.x:narrow(0, off, rows)); xf:copy_(big.x:narrow(0, off, rows)); rf:copy_(big.res:narrow(0, off, rows))
    cap:replay()
    cuda.synchronize()
    same_bits(big.ar:narrow(0, off, rows), oa, ("replay %d: all_reduce against the eager %d-row call"):format(round, ROWS))
    same_bits(big.fn:narrow(0, off, rows), gn, ("replay %d: norm_out against eager"):format(round))
    same_bits(big.fr:narrow(0, off, rows), gr, ("replay %d: residual_out against eager"):format(round))
  end
  cap:destroy()
  for _, t in ipairs { xa, oa, xf, rf, gn, gr } do t:free() end
end)

check("ranks_agree", function()
  ranks_agree(big.ar, "all_reduce " .. ROWS .. " rows")
  ranks_agree(big.fn, "fused norm_out " .. ROWS .. " rows")
  ranks_agree(big.fr, "fused residual_out " .. ROWS .. " rows")
end)

-- what the mode refuses, before anything is enqueued
check("refusals", function()
  local lim = db.info(g).custom_ar_max_bytes or 64 * 1048576
  local huge = T.empty({ lim / 2 + 8 }, "bf16", DEV)
  S.expect_error("deterministic mode: .*cannot take weft's kernels", g.all_reduce, g, huge)
  huge:free()
  local x = big.x:narrow(0, 0, 16)
  S.expect_error("deterministic mode: device reduce_scatter", g.reduce_scatter, g, x, 0)
  S.expect_error("deterministic mode needs f32 accumulation", g.fused_allreduce_rmsnorm, g, x,
                 big.res:narrow(0, 0, 16), big.w, 1e-6, { fp32_acc = false })
  -- weft.async takes the group's (deterministic) path for float sums, not NCCL
  local y = T.empty(x.shape, "bf16", DEV)
  y:copy_(x)
  async.all_reduce(g, y):wait()
  same_bits(big.ar:narrow(0, 0, 16), y, "weft.async all_reduce against the 8192-row call")
  y:free()
  -- integer sums and float max are exact in any order: served as usual
  local i = T.ones({ 64 }, "i32", DEV)
  g:all_reduce(i)
  want(i:compare(T.full({ 64 }, W, "i32")) == 0, "i32 all_reduce wrong in deterministic mode")
  i:free()
end)

check("default_unchanged", function()
  policy.set { deterministic = false, group = g }       -- collective again
  local e = policy.explain(g, T.zeros({ 8, HIDDEN }, "bf16", DEV))
  want(not e:find("deterministic", 1, true), "explain mentions the mode when it is off: %s", e)
  local x = big.x:narrow(0, 0, 1000)
  local out = T.empty(x.shape, "bf16", DEV)
  g:all_reduce(x, "sum", out)
  local h = x:to("cpu"); g:all_reduce(h)
  want(out:compare(h) == 0, "default all_reduce against the host sum")
  local _, _, _, choice = policy.select(g, "all_reduce", x, "sum")
  want(choice and choice.det == false, "the default call carried the deterministic bit")
  h:free(); out:free()
  -- the default fused kernel: f32 sum + residual rounded once (near the deterministic one)
  local yn, yr = g:fused_allreduce_rmsnorm(x, big.res:narrow(0, 0, 1000), big.w, 1e-6, { max_tokens = MAXT })
  local d = G.f64(yr); local r = G.f64(big.fr:narrow(0, 0, 1000))
  local ma = d:compare(r)
  want(ma <= 0.25, "default residual_out far from the deterministic one: %g", ma)   -- a bf16 step at |x| < 32
  local bn, br = diff_rows(big.fn:narrow(0, 0, 1000), yn), diff_rows(big.fr:narrow(0, 0, 1000), yr)
  if me == 0 then print(("INFO default mode: %d / %d of 1000 rows' norm_out / residual_out bits differ from deterministic "
                         .. "(one rounding fewer)"):format(bn, br)) end
  d:free(); r:free(); yn:free(); yr:free()
  -- large calls leave the kernels as before (NCCL, or host staging on a shared GPU)
  local lim = db.info(g).custom_ar_max_bytes or 64 * 1048576
  local huge = T.zeros({ lim / 2 + 8 }, "bf16", DEV)
  local be = db.choice(g, "all_reduce", huge)
  want(be == "nccl" or be == "device_host", "above the workspace the default is %s", tostring(be))
  huge:free()
end)

weft.shutdown()
done()
