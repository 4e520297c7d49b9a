-- serve_model — the tensor-parallel "layers" of the served demo.
--
-- Weights are a pure function of (layer, row, column), so every rank makes
-- only its shard, any world size gives the same answer, and a client (or a
-- test) can compute the reference without the server.
--   linear: y = W x                 W [out][in], row-parallel: rank r holds
--                                   the columns of its slice of `in`
--   mlp:    y = W2 relu(W1 x)       W1 [ff][in] column-parallel (rows of its
--                                   slice of ff), W2 [out][ff] row-parallel
-- Each rank computes a partial y; the all-reduce (sum) gives the result.
local ffi = require("ffi")

local floor = math.floor

local M = {}

-- hidden: model width (env WEFT_SERVE_HIDDEN, default 256)
function M.layers(hidden)
  hidden = hidden or 256
  return {
    linear = { name = "linear", kind = "linear", d_in = hidden, d_out = hidden, seed = 11 },
    mlp = { name = "mlp", kind = "mlp", d_in = hidden, d_ff = 2 * hidden, d_out = hidden, seed = 23 },
  }
end

-- Deterministic weight in [-1, 1) / sqrt(fan_in), exactly representable
-- arithmetic (all intermediate integers stay below 2^53).
local function w(seed, i, j, fan_in)
  local a = (i * 40503 + j * 2654435 + seed * 97231 + 12345) % 2147483647
  a = (a * 48271) % 2147483647
  a = (a * 48271) % 2147483647
  return (a / 1073741823.5 - 1) / math.sqrt(fan_in)
end
M.weight = w

-- [lo, hi) of rank r's slice of n over world ranks (uneven n allowed)
function M.slice(n, r, world)
  return floor(r * n / world), floor((r + 1) * n / world)
end

-- Builds this rank's shards (f32) of every layer.
function M.build(layers, rank, world)
  local shards = {}
  for name, L in pairs(layers) do
    local s = { layer = L }
    if L.kind == "linear" then
      local lo, hi = M.slice(L.d_in, rank, world)
      s.lo, s.hi, s.k = lo, hi, hi - lo
      s.w = ffi.new("float[?]", math.max(1, L.d_out * s.k))   -- [out][k]
      for o = 0, L.d_out - 1 do
        for j = lo, hi - 1 do s.w[o * s.k + (j - lo)] = w(L.seed, o, j, L.d_in) end
      end
    else
      local lo, hi = M.slice(L.d_ff, rank, world)
      s.lo, s.hi, s.k = lo, hi, hi - lo
      s.w1 = ffi.new("float[?]", math.max(1, s.k * L.d_in))  -- [k][in]
      s.w2 = ffi.new("float[?]", math.max(1, L.d_out * s.k)) -- [out][k]
      s.h = ffi.new("float[?]", math.max(1, s.k))
      for f = lo, hi - 1 do
        for j = 0, L.d_in - 1 do s.w1[(f - lo) * L.d_in + j] = w(L.seed, f, j, L.d_in) end
      end
      for o = 0, L.d_out - 1 do
        for f = lo, hi - 1 do s.w2[o * s.k + (f - lo)] = w(L.seed + 1, o, f, L.d_ff) end
      end
    end
    shards[name] = s
  end
  return shards
end

-- Partial outputs of `rows` inputs x (float* [rows][d_in]) into y (float*
-- [rows][d_out]); the sum over ranks is the layer's output.
function M.partial(shard, x, rows, y)
  local L = shard.layer
  local din, dout, k, lo = L.d_in, L.d_out, shard.k, shard.lo
  if L.kind == "linear" then
    local W = shard.w
    for r = 0, rows - 1 do
      local xr, yr = r * din + lo, r * dout
      for o = 0, dout - 1 do
        local acc, wo = 0.0, o * k
        for j = 0, k - 1 do acc = acc + W[wo + j] * x[xr + j] end
        y[yr + o] = acc
      end
    end
  else
    local W1, W2, h = shard.w1, shard.w2, shard.h
    for r = 0, rows - 1 do
      local xr, yr = r * din, r * dout
      for f = 0, k - 1 do
        local acc, wf = 0.0, f * din
        for j = 0, din - 1 do acc = acc + W1[wf + j] * x[xr + j] end
        h[f] = acc > 0 and acc or 0
      end
      for o = 0, dout - 1 do
        local acc, wo = 0.0, o * k
        for f = 0, k - 1 do acc = acc + W2[wo + f] * h[f] end
        y[yr + o] = acc
      end
    end
  end
end

-- Reference in doubles for one input vector (a Lua array), for tests and
-- clients; the weights are made once per layer table and kept in L._ref.
local function ref_weights(L)
  local R = L._ref
  if R then return R end
  R = {}
  if L.kind == "linear" then
    R.w = {}
    for o = 0, L.d_out - 1 do
      local row = {}
      for j = 0, L.d_in - 1 do row[j + 1] = w(L.seed, o, j, L.d_in) end
      R.w[o + 1] = row
    end
  else
    R.w1, R.w2 = {}, {}
    for f = 0, L.d_ff - 1 do
      local row = {}
      for j = 0, L.d_in - 1 do row[j + 1] = w(L.seed, f, j, L.d_in) end
      R.w1[f + 1] = row
    end
    for o = 0, L.d_out - 1 do
      local row = {}
      for f = 0, L.d_ff - 1 do row[f + 1] = w(L.seed + 1, o, f, L.d_ff) end
      R.w2[o + 1] = row
    end
  end
  L._ref = R
  return R
end

local function matvec(rows, x, n)
  local y = {}
  for o = 1, #rows do
    local row, acc = rows[o], 0
    for j = 1, n do acc = acc + row[j] * x[j] end
    y[o] = acc
  end
  return y
end

function M.reference(L, x)
  local R = ref_weights(L)
  if L.kind == "linear" then return matvec(R.w, x, L.d_in) end
  local h = matvec(R.w1, x, L.d_in)
  for f = 1, #h do if h[f] < 0 then h[f] = 0 end end
  return matvec(R.w2, h, L.d_ff)
end

return M
