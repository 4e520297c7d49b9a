-- NaN through device max/min (issue 13 item 5), the rank side: the checks
-- that tests/helpers/nan_device_worker.lua (pretend GPU, CPU spec) and
-- tests/helpers/gpu_group_worker.lua (2 real GPUs) run. Torch's rule: where
-- any rank holds a NaN the result is NaN; ±inf stay infinities. Every float
-- dtype; NaN on one rank only, on every rank, on none; eager in place and out
-- of place, reduce_scatter (dim 0 and an inner dim), reduce_scatterv, and a
-- captured graph replayed with NaN moved to other elements and ranks.
--
-- Every rank builds every rank's input (deterministic), so the reference is
-- computed locally, element by element, in f64 (inputs are small integers:
-- max/min are exact in every dtype).
local T = require("weft.tensor")
local graph = require("weft.graph")
local policy = require("weft.policy")

local M = {}

local NAN, INF = 0 / 0, math.huge
M.DTYPES = { "f32", "f64", "f16", "bf16" }
M.OPS = { "max", "min" }

-- the input of rank r (0-based) of W ranks, n elements, as f64 numbers;
-- `shift` moves the NaN pattern: element i holds NaN on rank (i + shift) %
-- (W + 2) alone when that is < W, on every rank when it is W, nowhere when
-- W + 1; a few ±inf and ±0 elsewhere
function M.values(W, r, n, seed, shift)
  local v = {}
  local x = seed * 7919 + r * 104729 + 13
  for i = 1, n do
    x = (x * 1103515245 + 12345) % 2147483648
    local k = (i + shift) % (W + 2)
    if k == r or k == W then v[i] = NAN
    elseif (i + shift) % 7 == 5 and r == 0 then v[i] = INF
    elseif (i + shift) % 11 == 3 and r == W - 1 then v[i] = -INF
    elseif (i + shift) % 13 == 6 then v[i] = (r % 2 == 0) and 0 or -0.0
    else v[i] = (x % 32) - 16 end
  end
  return v
end

-- expected elements lo..hi (1-based) of the reduction of inputs (a list per rank)
function M.expect(inputs, rop, lo, hi)
  local e = {}
  for i = lo, hi do
    local acc, nan = nil, false
    for r = 1, #inputs do
      local a = inputs[r][i]
      if a ~= a then nan = true
      elseif acc == nil then acc = a
      elseif rop == "max" then if a > acc then acc = a end
      else if a < acc then acc = a end end
    end
    e[#e + 1] = nan and NAN or acc
  end
  return e
end

-- got (a tensor, any device) equals the expected numbers: NaN exactly where
-- expected, else the same value (+0 and -0 are not told apart)
function M.same(want, got, exp, what)
  local t = got:to_table()      -- through C's f64 conversion (canonical NaNs: safe to read in Lua)
  if not want(#t == #exp, "%s: %d elements, expected %d", what, #t, #exp) then return end
  local bad, first = 0, nil
  for i = 1, #exp do
    local g, e = t[i], exp[i]
    local ok
    if e ~= e then ok = g ~= g else ok = g == e end
    if not ok then
      bad = bad + 1
      first = first or ("element %d is %s, expected %s"):format(i - 1, tostring(g), tostring(e))
    end
  end
  want(bad == 0, "%s: %d wrong (first: %s)", what, bad, tostring(first))
end

local function inputs_of(W, n, seed, shift)
  local ins = {}
  for r = 0, W - 1 do ins[r + 1] = M.values(W, r, n, seed, shift) end
  return ins
end

-- c: { g = group, dev = "cuda:i", want = S.want }
function M.all_reduce(c)
  local g, want = c.g, c.want
  local W, me = g.world_size, g.rank_in_group
  local seed = 100
  for _, dt in ipairs(M.DTYPES) do
    for _, rop in ipairs(M.OPS) do
      for _, n in ipairs { 1, 3, 7, 9, 1029 } do
        seed = seed + 1
        local shift = seed % (W + 2)
        local ins = inputs_of(W, n, seed, shift)
        local exp = M.expect(ins, rop, 1, n)
        local what = ("%s %s n=%d"):format(dt, rop, n)
        local d = T.from_table(ins[me + 1], dt, { n }, c.dev)
        g:all_reduce(d, rop)
        M.same(want, d, exp, "all_reduce " .. what)
        -- out of place: the input is left as it was
        local x = T.from_table(ins[me + 1], dt, { n }, c.dev)
        local o = T.empty({ n }, dt, c.dev)
        g:all_reduce(x, rop, o)
        M.same(want, o, exp, "all_reduce out of place " .. what)
        M.same(want, x, ins[me + 1], "all_reduce out of place input " .. what)
        -- the async form (weft.async: the blocking path serves it)
        local a = T.from_table(ins[me + 1], dt, { n }, c.dev)
        require("weft.async").all_reduce(g, a, rop):wait()
        M.same(want, a, exp, "async all_reduce " .. what)
        a:free()
        -- the host path, the same answer (it already propagates NaN)
        local h = T.from_table(ins[me + 1], dt, { n })
        g:all_reduce(h, rop)
        M.same(want, h, exp, "host all_reduce " .. what)
        d:free(); x:free(); o:free(); h:free()
      end
    end
  end
  -- sum still sums (NaN propagates arithmetically: no pass), integers untouched
  local ins = inputs_of(W, 9, 7, 0)
  local d = T.from_table(ins[me + 1], "f32", { 9 }, c.dev)
  g:all_reduce(d, "sum")
  local got = d:to_table()
  for i = 1, 9 do
    local any = false
    for r = 1, W do local a = ins[r][i]; if a ~= a then any = true end end
    if any then want(got[i] ~= got[i], "sum: element %d is %s, expected NaN", i - 1, tostring(got[i])) end
  end
  d:free()
  local iv = T.from_table({ me, -me, 5 }, "i32", { 3 }, c.dev)
  g:all_reduce(iv, "max")
  local t = iv:to_table()
  want(t[1] == W - 1 and t[2] == 0 and t[3] == 5, "i32 max: {%s}", table.concat(t, ","))
end

function M.reduce_scatter(c)
  local g, want = c.g, c.want
  local W, me = g.world_size, g.rank_in_group
  local seed = 300
  for _, dt in ipairs(M.DTYPES) do
    for _, rop in ipairs(M.OPS) do
      -- dim 0 of {W*3, 5}: this rank's rows; dim 1 of {3, W*5}: this rank's columns
      for _, dim in ipairs { 0, 1 } do
        seed = seed + 1
        local rows, cols = dim == 0 and 3 * W or 3, dim == 0 and 5 or 5 * W
        local n = rows * cols
        local ins = inputs_of(W, n, seed, seed % (W + 2))
        local full = M.expect(ins, rop, 1, n)
        local exp = {}
        if dim == 0 then
          for i = me * 15 + 1, (me + 1) * 15 do exp[#exp + 1] = full[i] end
        else
          for rr = 0, 2 do
            for cc = me * 5, me * 5 + 4 do exp[#exp + 1] = full[rr * cols + cc + 1] end
          end
        end
        local d = T.from_table(ins[me + 1], dt, { rows, cols }, c.dev)
        local o = g:reduce_scatter(d, dim, nil, rop)
        M.same(want, o, exp, ("reduce_scatter %s %s dim %d"):format(dt, rop, dim))
        d:free(); o:free()
      end
      -- reduce_scatterv: rows per rank 1, 2, ... along dim 0, rows of 3
      seed = seed + 1
      local sizes, total = {}, 0
      for r = 1, W do sizes[r] = r; total = total + r end
      local n = total * 3
      local ins = inputs_of(W, n, seed, seed % (W + 2))
      local full = M.expect(ins, rop, 1, n)
      local off = 0
      for r = 1, me do off = off + sizes[r] end
      local exp = {}
      for i = off * 3 + 1, (off + sizes[me + 1]) * 3 do exp[#exp + 1] = full[i] end
      local d = T.from_table(ins[me + 1], dt, { total, 3 }, c.dev)
      local o = g:reduce_scatterv(d, nil, sizes, rop)
      M.same(want, o, exp, ("reduce_scatterv %s %s"):format(dt, rop))
      d:free(); o:free()
    end
  end
end

-- one graph with a max and a min all-reduce of every float dtype and a
-- reduce_scatter max, replayed with new data (the NaN moved each round)
function M.graph(c)
  local g, want = c.g, c.want
  local W, me = g.world_size, g.rank_in_group
  local n = 1031
  local bufs, plan = {}, {}
  for _, dt in ipairs(M.DTYPES) do
    for _, rop in ipairs(M.OPS) do
      plan[#plan + 1] = { dt = dt, rop = rop }
      bufs[#plan] = T.zeros({ n }, dt, c.dev)
    end
  end
  local rs_in, rs_out = T.zeros({ 2 * W, 3 }, "bf16", c.dev), T.empty({ 2, 3 }, "bf16", c.dev)
  local gr = graph.capture(function()
    for i, p in ipairs(plan) do g:all_reduce(bufs[i], p.rop) end
    g:reduce_scatter(rs_in, 0, rs_out, "max")
  end, { groups = { g } })
  for round = 1, 3 do
    local exps = {}
    for i, p in ipairs(plan) do
      local ins = inputs_of(W, n, 1000 * round + i, round + i)
      exps[i] = M.expect(ins, p.rop, 1, n)
      local h = T.from_table(ins[me + 1], p.dt, { n })
      bufs[i]:copy_(h); h:free()
    end
    local rins = inputs_of(W, 6 * W, 5000 + round, round)
    local h = T.from_table(rins[me + 1], "bf16", { 2 * W, 3 })
    rs_in:copy_(h); h:free()
    gr:replay()
    for i, p in ipairs(plan) do
      M.same(want, bufs[i], exps[i], ("graph replay %d all_reduce %s %s"):format(round, p.dt, p.rop))
    end
    M.same(want, rs_out, M.expect(rins, "max", me * 6 + 1, me * 6 + 6),
           ("graph replay %d reduce_scatter bf16 max"):format(round))
  end
  gr:destroy()
  for i = 1, #bufs do bufs[i]:free() end
  rs_in:free(); rs_out:free()
end

-- INFO lines (no assertion): what the pass costs, bf16 max, per call, eager
-- and in CUDA-graph replay: the NCCL call alone (the group's communicator,
-- raw) against tp:all_reduce(x, "max") (mask + u8 max + NCCL max + fix-up).
-- Real GPUs only (timings on the pretend GPU mean nothing).
function M.cost(c, world)
  local weft = require("weft")
  local cuda = require("weft.cuda")
  local g = c.g
  local comm = g.device_group
  for _, n in ipairs { 32768, 2097152, 33554432 } do          -- 64 KiB, 4 MiB, 64 MiB
    local x = T.zeros({ n }, "bf16", c.dev)
    local raw = function() comm:all_reduce(x.ptr, x.ptr, n, "bf16", "max") end
    local pass = function() g:all_reduce(x, "max") end
    local function eager(fn, reps)
      for _ = 1, 10 do fn() end
      cuda.synchronize(); world:barrier()
      local t0 = weft.now_us()
      for _ = 1, reps do fn() end
      cuda.synchronize()
      return (weft.now_us() - t0) / reps
    end
    local function replay(fn, reps)
      local gr = graph.capture(function() for _ = 1, 10 do fn() end end, { groups = { g } })
      gr:replay(); cuda.synchronize(); world:barrier()
      local t0 = weft.now_us()
      for _ = 1, reps do gr:replay() end
      cuda.synchronize()
      gr:destroy()
      return (weft.now_us() - t0) / (10 * reps)
    end
    local reps = n > 4000000 and 50 or 500
    local er, ep = eager(raw, reps), eager(pass, reps)
    local gr_, gp = replay(raw, reps / 10), replay(pass, reps / 10)
    print(("INFO nan pass bf16 max %d bytes: eager nccl %.1f us, with pass %.1f us (+%.1f); "
           .. "graph nccl %.1f us, with pass %.1f us (+%.1f)"):format(2 * n, er, ep, ep - er, gr_, gp, gp - gr_))
    io.stdout:flush()
    x:free()
  end
end

-- explain names the pass for float max/min, not for sum or integers
function M.explain(c)
  local g, want = c.g, c.want
  local f = T.zeros({ 8 }, "bf16", c.dev)
  local i = T.zeros({ 8 }, "i32", c.dev)
  local e = policy.explain(g, f, "all_reduce", "max")
  want(e:find("NaN pass: bf16 max adds", 1, true), "explain of bf16 max misses the NaN pass:\n%s", e)
  e = policy.explain(g, f, "reduce_scatter", "min")
  want(e:find("NaN pass: bf16 min adds", 1, true), "explain of reduce_scatter min misses the NaN pass:\n%s", e)
  e = policy.explain(g, f, "all_reduce", "sum")
  want(not e:find("NaN pass", 1, true), "explain of a sum mentions a NaN pass:\n%s", e)
  e = policy.explain(g, i, "all_reduce", "max")
  want(e:find("NaN pass: none (i32", 1, true), "explain of i32 max:\n%s", e)
  f:free(); i:free()
end

return M
