-- weft.tensor — host/device buffers with a dtype, a shape and strides.
--
-- Interface: docs/lua-interfaces.md (weft.tensor). Conventions chosen here:
--  * dims and starts are 0-based like torch/SGLang (t:size(0) is the first
--    dim, negative dims count from the end); t.shape / t.strides are plain
--    1-based Lua arrays (t.shape[1] == t:size(0)); strides are in elements.
--  * t.ptr always points at the tensor's first element (views move it).
--  * host storage: weft_host_alloc (64-byte aligned, zeroed) under ffi.gc;
--    device storage: weft.cuda, required lazily in the device branch only,
--    so host-only use never loads it.
--  * views (view/reshape/narrow/transpose) share storage, and its liveness,
--    with their base: base:free() releases the storage and invalidates the
--    base and every view of it (their t.ptr becomes nil, so every use, a
--    collective's included, raises "storage was freed"); view:free() only
--    drops that view, never the storage under the base. free() on a wrapped
--    tensor only drops the owner reference. free() is idempotent.
--  * a storage used by a pending async operation (weft.async) is pinned
--    until the operation settles: free() of it (or of a view) raises "in use
--    by a pending <op>", and the GC cannot collect it (PINNED holds it), so
--    its finalizer never frees memory under the worker thread.
--  * random fills are deterministic in the seed; without {seed=} a per-process
--    counter is used (deterministic per program run). The device generator
--    (kernels/devops.cu) is the host one: uniform fills are bit-identical on
--    host and device, normal fills agree to a few ulp.
local ffi = require("ffi")
local wffi = require("weft.internal.ffi")
local C = wffi.C

local type, tonumber, tostring, pairs = type, tonumber, tostring, pairs
local floor, huge = math.floor, math.huge
local ffi_cast, ffi_gc = ffi.cast, ffi.gc
local copy_bytes = require("weft.internal.hostmem").copy -- any size (ffi.copy stops at 2^31)
local E = require("weft.internal.errors")
local concat, fmt = table.concat, string.format

local M = {}

-- ---------------------------------------------------------------- dtypes

local DTYPES = {
  f32 = { code = 0, size = 4, name = "f32", ctype = "float*", kind = "float" },
  f16 = { code = 1, size = 2, name = "f16", ctype = "uint16_t*", kind = "packed" },
  bf16 = { code = 2, size = 2, name = "bf16", ctype = "uint16_t*", kind = "packed" },
  i32 = { code = 3, size = 4, name = "i32", ctype = "int32_t*", kind = "int",
          min = -2147483648, max = 2147483647 },
  i64 = { code = 4, size = 8, name = "i64", ctype = "int64_t*", kind = "int",
          min = -2 ^ 63, max = 2 ^ 63 - 1024 }, -- largest double below 2^63
  u8 = { code = 5, size = 1, name = "u8", ctype = "uint8_t*", kind = "int", min = 0, max = 255 },
  f64 = { code = 6, size = 8, name = "f64", ctype = "double*", kind = "float" },
  f8e4m3 = { code = 7, size = 1, name = "f8e4m3", ctype = "uint8_t*", kind = "packed" },
}
local ALIASES = {
  float32 = "f32", float16 = "f16", bfloat16 = "bf16", int32 = "i32", int64 = "i64",
  uint8 = "u8", float64 = "f64", float8_e4m3fn = "f8e4m3", e4m3 = "f8e4m3",
}
local DTYPE_LIST = "f32, f16, bf16, f64, i32, i64, u8, f8e4m3"
local F64 = DTYPES.f64

-- "weft: tensor.<op>: <msg>"; level as weft.internal.errors.fail's (default 2: the
-- caller of the function that calls fail), + 1 for this frame
local function fail(op, msg, level)
  E.fail((level or 2) + 1, "tensor." .. op, "%s", msg)
end

local function resolve_dtype(name, op)
  if name == nil then return DTYPES.f32 end
  local d = DTYPES[name] or DTYPES[ALIASES[name] or ""]
  if not d then
    fail(op, fmt("unknown dtype %s (known: %s and aliases float32, bfloat16, ...)",
                 type(name) == "string" and ("'" .. name .. "'") or tostring(name), DTYPE_LIST), 3)
  end
  return d
end

-- {code=, size=, name=} of a dtype name or alias.
function M.dtype_info(name)
  local d = resolve_dtype(name, "dtype_info")
  return { code = d.code, size = d.size, name = d.name }
end

-- ---------------------------------------------------------------- device

local function cuda_module(op)
  local ok, cuda = pcall(require, "weft.cuda")
  if not ok then fail(op, "device tensors need weft.cuda: " .. tostring(cuda), 3) end
  return cuda
end

-- -> device string, device index (nil for cpu)
local function parse_device(dev, op)
  if dev == nil or dev == "cpu" then return "cpu", nil end
  if type(dev) == "number" then dev = "cuda:" .. dev end
  if dev == "cuda" then
    local cuda = cuda_module(op)
    if not cuda.available() then fail(op, "no CUDA device (device 'cuda')", 3) end
    local i = cuda.current_device()
    return "cuda:" .. i, i
  end
  local n = type(dev) == "string" and dev:match("^cuda:(%d+)$")
  if not n then
    fail(op, fmt("unknown device %s (use 'cpu', 'cuda' or 'cuda:N')", tostring(dev)), 3)
  end
  return "cuda:" .. tonumber(n), tonumber(n)
end

-- ---------------------------------------------------------------- shapes

local function is_int(v) return type(v) == "number" and v == floor(v) and v > -huge and v < huge end

-- "{2, 3}" (each dim through tostring: refused shapes print too)
local function shape_str(shape) return E.shape_str(shape, ", ") end

-- The largest byte count (and element count) a tensor may have: every size,
-- stride and offset is a Lua number, exact only up to 2^53, and the C side
-- takes size_t. Above it products wrap or round, so shapes are refused.
local MAX_BYTES = 2 ^ 53
M.MAX_BYTES = MAX_BYTES

local describe = require("weft.internal.show").value

-- Validates and copies a shape; allow_infer: one -1 may appear (returns its dim).
-- info: the dtype (nil: 1-byte elements); the product of the non-zero sizes
-- times the element size must stay below MAX_BYTES (so the strides of a
-- shape with a zero size stay exact too).
local function parse_shape(shape, op, allow_infer, info)
  if type(shape) == "number" then shape = { shape } end
  if type(shape) ~= "table" then
    fail(op, "shape must be a table of sizes, got " .. describe(shape), 3)
  end
  local out, numel, infer = {}, 1, nil
  local span = info and info.size or 1
  for i = 1, #shape do
    local s = shape[i]
    if not is_int(s) then
      fail(op, fmt("bad shape %s: size %s at dim %d is not an integer",
                   shape_str(shape), describe(s), i - 1), 3)
    end
    if s == -1 and allow_infer then
      if infer then fail(op, fmt("bad shape %s: -1 appears more than once", shape_str(shape)), 3) end
      infer = i
    elseif s < 0 then
      fail(op, fmt("bad shape %s: size %d at dim %d is negative", shape_str(shape), s, i - 1), 3)
    else
      numel = numel * s
      if s > 0 then span = span * s end
    end
    out[i] = s
  end
  if span >= MAX_BYTES then -- rounded, but never below 2^53 when the exact value is above
    fail(op, fmt("shape %s of %s is %.4g bytes: too large (the limit is 2^53 bytes, the "
                 .. "largest size weft computes exactly)", shape_str(shape),
                 info and info.name or "1-byte elements", span), 3)
  end
  return out, numel, infer
end

local function contiguous_strides(shape)
  local st, acc = {}, 1
  for i = #shape, 1, -1 do st[i] = acc; acc = acc * shape[i] end
  return st
end

local function compute_contig(shape, strides)
  local expect = 1
  for i = #shape, 1, -1 do
    local s = shape[i]
    if s == 0 then return true end
    if s ~= 1 then
      if strides[i] ~= expect then return false end
      expect = expect * s
    end
  end
  return true
end

local function norm_dim(t, d, op)
  local nd = #t.shape
  if not is_int(d) or d < -nd or d >= nd then
    fail(op, fmt("dim %s out of range for a %d-dim tensor %s", describe(d), nd, shape_str(t.shape)), 3)
  end
  if d < 0 then d = d + nd end
  return d + 1 -- Lua index
end

-- ---------------------------------------------------------------- objects

local Tensor = {}
Tensor.__index = Tensor
M.Tensor = Tensor

-- (a table given the metatable by hand is not one: no storage)
local function is_tensor(x) return getmetatable(x) == Tensor and type(rawget(x, "_storage")) == "table" end
M.is_tensor = is_tensor

-- storage: { ptr=, kind="host"|"cuda"|"wrap", dev=, owner=, freed=,
--            views= (weak set of the views made of it, made on the first),
--            pins=, pin_op=, pin_group= (while pending async operations use it) }
local function make(ptr, shape, strides, numel, info, device, dev_index, storage, contig)
  return setmetatable({
    ptr = ptr, dtype = info.name, shape = shape, strides = strides, numel = numel,
    nbytes = numel * info.size, device = device, device_index = dev_index,
    _info = info, _code = info.code, _esize = info.size, _storage = storage,
    _contig = contig,
  }, Tensor)
end

local WEAK_KEYS = { __mode = "k" }

-- Storages in use by pending async operations: held here, so neither they
-- nor their finalizers go while a worker thread may still touch the memory.
local PINNED = {}

local function alloc_storage(nbytes, dev_index, op)
  if dev_index == nil then
    local raw = C.weft_host_alloc(nbytes)
    if raw == nil then fail(op, fmt("host allocation of %d bytes failed: %s", nbytes, wffi.last_error()), 3) end
    return { ptr = ffi_gc(raw, C.weft_host_free), kind = "host" }
  end
  local cuda = cuda_module(op)
  local raw = cuda.alloc(nbytes > 0 and nbytes or 1, dev_index)
  if raw == nil then fail(op, fmt("device allocation of %d bytes on cuda:%d failed", nbytes, dev_index), 3) end
  if type(raw) == "number" then raw = ffi_cast("void*", raw) end
  local ptr = ffi_gc(raw, function(p) cuda.free(p, dev_index) end)
  return { ptr = ptr, kind = "cuda", dev = dev_index }
end

local function alloc(shape, numel, info, device, dev_index, op)
  local st = alloc_storage(numel * info.size, dev_index, op)
  local t = make(ffi_cast("void*", st.ptr), shape, contiguous_strides(shape), numel, info,
                 device, dev_index, st, true)
  t._owns = true
  return t
end

-- lvl: the frames between the check and the user's call (default: the
-- method that checks is called by the user)
local function check_live(t, op, lvl)
  lvl = lvl or 3
  if t._storage.freed then fail(op, "storage was freed (tensor or a view of it had :free() called)", lvl) end
  if t._dropped then fail(op, "storage was freed for this view (it had :free() called; its base is untouched)", lvl) end
end

local function in_use(st)
  return fmt("storage is in use by a pending %s on group %s; wait for its handle (h:wait()) or drain the "
             .. "group (g:async_drain()) first", tostring(st.pin_op), tostring(st.pin_group))
end

-- live, and not in use by a pending async operation (whose worker may be
-- reading or writing it now): what every method that reads or writes the
-- values checks
local function check_idle(t, op, lvl)
  lvl = lvl or 3
  check_live(t, op, lvl + 1)
  if t._storage.pins then fail(op, in_use(t._storage), lvl) end
end

-- ---------------------------------------------------------------- strided runs

-- Calls fn(elem_offset, run_length) for each maximal contiguous run of t in
-- logical (row-major) order; offsets are relative to t.ptr.
local function each_run(shape, strides, numel, fn)
  if numel == 0 then return end
  local k, run = #shape, 1
  while k >= 1 and (shape[k] == 1 or strides[k] == run) do
    run = run * shape[k]; k = k - 1
  end
  local idx, off = {}, 0
  for i = 1, k do idx[i] = 0 end
  while true do
    fn(off, run)
    local d = k
    while d >= 1 do
      idx[d] = idx[d] + 1
      off = off + strides[d]
      if idx[d] < shape[d] then break end
      off = off - strides[d] * shape[d]
      idx[d] = 0
      d = d - 1
    end
    if d < 1 then return end
  end
end

-- Elements spanned from t.ptr (strides are never negative here).
local function span_elems(t)
  if t.numel == 0 then return 0 end
  local s = 1
  for i = 1, #t.shape do s = s + (t.shape[i] - 1) * t.strides[i] end
  return s
end

-- t's elements, laid out by its strides from `base`, gathered into the
-- contiguous host buffer `dense` of the same dtype (to_dense) or scattered
-- back from it, run by run.
local function move_runs(base, t, dense, to_dense)
  local es = t._esize
  local b, d, pos = ffi_cast("uint8_t*", base), ffi_cast("uint8_t*", dense), 0
  each_run(t.shape, t.strides, t.numel, function(off, n)
    if to_dense then copy_bytes(d + pos * es, b + off * es, n * es)
    else copy_bytes(b + off * es, d + pos * es, n * es) end
    pos = pos + n
  end)
end

local function raw_copy(dst_ptr, dst_dev, src_ptr, src_dev, nbytes)
  if nbytes == 0 then return end
  if dst_dev == nil and src_dev == nil then
    copy_bytes(dst_ptr, src_ptr, nbytes)
  else
    cuda_module("copy_").copy(dst_ptr, src_ptr, nbytes)
  end
end

local function host_empty(shape, numel, info, op)
  return alloc(shape, numel, info, "cpu", nil, op)
end

-- move_runs for a non-contiguous t anywhere: a device t's span goes through
-- a host stage (copied back after a scatter, so its gaps keep their values).
local function move_strided(t, dense, to_dense, op)
  if t.device_index == nil then return move_runs(t.ptr, t, dense, to_dense) end
  local span = span_elems(t)
  local stage = host_empty({ span }, span, t._info, op)
  raw_copy(stage.ptr, nil, t.ptr, t.device_index, span * t._esize)
  move_runs(stage.ptr, t, dense, to_dense)
  if not to_dense then raw_copy(t.ptr, t.device_index, stage.ptr, nil, span * t._esize) end
  stage:free()
end

-- A contiguous host tensor with t's values and dtype (t itself when possible).
local function host_contig(t, op)
  check_idle(t, op, 4)
  if t.device_index == nil and t._contig then return t end
  local h = host_empty(t.shape, t.numel, t._info, op)
  if t._contig then
    raw_copy(h.ptr, nil, t.ptr, t.device_index, t.nbytes)
  else
    move_strided(t, h.ptr, true, op)
  end
  return h
end

-- A contiguous host tensor of t's values converted to `info`.
local function host_as(t, info, op)
  local h = host_contig(t, op)
  if info == t._info then return h end
  local out = host_empty(t.shape, t.numel, info, op)
  wffi.check(C.weft_host_convert(h.ptr, t._code, out.ptr, info.code, t.numel), "tensor." .. op, 3)
  if h ~= t then h:free() end
  return out
end

-- Writes the contiguous host tensor h (same dtype, same numel) into t.
local function store_from_host(t, h, op)
  if t._contig then
    raw_copy(t.ptr, t.device_index, h.ptr, nil, t.nbytes)
  else
    move_strided(t, h.ptr, false, op)
  end
end

-- ---------------------------------------------------------------- constructors

function M.empty(shape, dtype, device)
  local info = resolve_dtype(dtype, "empty")
  local s, numel = parse_shape(shape, "empty", false, info)
  local dev, idx = parse_device(device, "empty")
  return alloc(s, numel, info, dev, idx, "empty")
end

local function filled(op, shape, value, dtype, device)
  local info = resolve_dtype(dtype, op)
  local s, numel = parse_shape(shape, op, false, info)
  local dev, idx = parse_device(device, op)
  local t = alloc(s, numel, info, dev, idx, op)
  if value ~= 0 or idx ~= nil then t:fill_(value) end -- host storage is already zeroed
  return t
end

function M.zeros(shape, dtype, device) return filled("zeros", shape, 0, dtype, device) end
function M.ones(shape, dtype, device) return filled("ones", shape, 1, dtype, device) end
function M.full(shape, value, dtype, device)
  if type(value) ~= "number" then fail("full", "value must be a number, got " .. type(value)) end
  local info = resolve_dtype(dtype, "full")
  if info.kind == "int" and (not is_int(value) or value < info.min or value > info.max) then
    fail("full", fmt("%s is not an integer in range for %s", describe(value), info.name))
  end
  return filled("full", shape, value, dtype, device)
end

local seed_counter = 0x5eed

local function random(op, dist, shape, dtype, device, opts)
  local info = resolve_dtype(dtype, op)
  local s, numel = parse_shape(shape, op, false, info)
  local dev, idx = parse_device(device, op)
  if opts ~= nil and type(opts) ~= "table" then fail(op, "options must be a table like {seed=N}", 3) end
  local seed = opts and opts.seed
  if seed == nil then
    seed_counter = seed_counter + 1
    seed = seed_counter
  elseif not (is_int(seed) and seed >= 0) and type(seed) ~= "cdata" then
    fail(op, "seed must be a non-negative integer, got " .. describe(seed), 3)
  end
  local t = alloc(s, numel, info, dev, idx, op)
  if numel > 0 then
    if idx == nil then
      wffi.check(C.weft_host_fill_random(t.ptr, numel, info.code, seed, dist), "tensor." .. op, 3)
    else
      cuda_module(op).fill_random(t.ptr, numel, info.code, seed, dist, idx)
    end
  end
  return t
end

function M.rand(shape, dtype, device, opts) return random("rand", 0, shape, dtype, device, opts) end
function M.randn(shape, dtype, device, opts) return random("randn", 1, shape, dtype, device, opts) end

-- Flattens nested tables; returns flat values and the inferred shape.
local function flatten(values, op)
  if type(values[1]) ~= "table" then return values, { #values } end
  local shape, flat = {}, {}
  local probe = values
  while type(probe) == "table" do shape[#shape + 1] = #probe; probe = probe[1] end
  local function walk(v, d)
    if d > #shape then
      flat[#flat + 1] = v
      return
    end
    if type(v) ~= "table" or #v ~= shape[d] then
      fail(op, fmt("nested table is not rectangular at depth %d (expected %d entries)", d - 1, shape[d]), 4)
    end
    for i = 1, #v do walk(v[i], d + 1) end
  end
  walk(values, 1)
  return flat, shape
end

function M.from_table(values, dtype, shape, device)
  if type(values) ~= "table" then fail("from_table", "values must be a table, got " .. type(values)) end
  local info = resolve_dtype(dtype, "from_table")
  local flat, inferred = flatten(values, "from_table")
  local s, numel = parse_shape(shape or inferred, "from_table", false, info)
  if #flat ~= numel then
    fail("from_table", fmt("%d values do not fill shape %s (%d elements)", #flat, shape_str(s), numel))
  end
  local dev, idx = parse_device(device, "from_table")
  -- validate before allocating
  for i = 1, numel do
    local v = flat[i]
    if type(v) ~= "number" then
      fail("from_table", fmt("value %d is a %s, not a number", i, type(v)))
    end
    if info.kind == "int" and (not is_int(v) or v < info.min or v > info.max) then
      fail("from_table", fmt("value %d (%s) is not an integer in range for %s", i, tostring(v), info.name))
    end
  end
  local h = host_empty(s, numel, info, "from_table")
  if info.kind == "packed" then
    local tmp = host_empty(s, numel, F64, "from_table")
    local p = ffi_cast("double*", tmp.ptr)
    for i = 1, numel do p[i - 1] = flat[i] end
    wffi.check(C.weft_host_convert(tmp.ptr, F64.code, h.ptr, info.code, numel), "tensor.from_table", 2)
    tmp:free()
  else
    local p = ffi_cast(info.ctype, h.ptr)
    for i = 1, numel do p[i - 1] = flat[i] end
  end
  if idx == nil then return h end
  local t = alloc(s, numel, info, dev, idx, "from_table")
  raw_copy(t.ptr, idx, h.ptr, nil, h.nbytes)
  h:free()
  return t
end

-- Wraps memory owned elsewhere (no ownership; `owner` is kept referenced).
function M.wrap(ptr, shape, dtype, device, owner)
  local info = resolve_dtype(dtype, "wrap")
  local s, numel = parse_shape(shape, "wrap", false, info)
  local dev, idx = parse_device(device, "wrap")
  if type(ptr) == "number" then
    ptr = ffi_cast("void*", ptr)
  elseif type(ptr) ~= "cdata" then
    fail("wrap", "ptr must be a cdata pointer or an address, got " .. type(ptr))
  end
  if ptr == nil and numel > 0 then fail("wrap", "NULL pointer for " .. numel .. " elements") end
  local st = { ptr = ptr, kind = "wrap", dev = idx, owner = owner }
  local t = make(ffi_cast("void*", ptr), s, contiguous_strides(s), numel, info, dev, idx, st, true)
  t._owns = true
  return t
end

-- ---------------------------------------------------------------- accessors

function Tensor:dim() return #self.shape end
function Tensor:size(d)
  if d == nil then
    local s = {}
    for i = 1, #self.shape do s[i] = self.shape[i] end
    return s
  end
  return self.shape[norm_dim(self, d, "size")]
end
function Tensor:is_contiguous() return self._contig end
function Tensor:is_cuda() return self.device_index ~= nil end
function Tensor:dtype_code() return self._code end
function Tensor:elem_size() return self._esize end

-- ---------------------------------------------------------------- data

-- Flat Lua array of the values in logical order. Float data is read only
-- through a C conversion to f64, which canonicalizes NaNs: LuaJIT 2.1's GC64
-- interpreter takes some NaN bit patterns read straight from FFI arrays for
-- tagged GC values (and crashes on them).
function Tensor:to_table()
  local n = self.numel
  local h = host_contig(self, "to_table")
  local out = {}
  if self._info.kind == "int" then
    local p = ffi_cast(self._info.ctype, h.ptr)
    if self._info == DTYPES.i64 then
      for i = 1, n do out[i] = tonumber(p[i - 1]) end
    else
      for i = 1, n do out[i] = p[i - 1] end
    end
  else
    local tmp = host_empty({ n }, n, F64, "to_table")
    wffi.check(C.weft_host_convert(h.ptr, self._code, tmp.ptr, F64.code, n), "tensor.to_table", 2)
    local p = ffi_cast("double*", tmp.ptr)
    for i = 1, n do out[i] = p[i - 1] end
    tmp:free()
  end
  if h ~= self then h:free() end
  return out
end

function Tensor:copy_(src)
  check_idle(self, "copy_")
  if not is_tensor(src) then fail("copy_", "source is not a tensor") end
  check_idle(src, "copy_")
  if src.numel ~= self.numel then
    fail("copy_", fmt("element counts differ: destination %s has %d, source %s has %d",
                      shape_str(self.shape), self.numel, shape_str(src.shape), src.numel))
  end
  if self.numel == 0 then return self end
  if src._info == self._info and src._contig and self._contig then
    raw_copy(self.ptr, self.device_index, src.ptr, src.device_index, self.nbytes)
    return self
  end
  local h = host_as(src, self._info, "copy_")
  store_from_host(self, h, "copy_")
  if h ~= src then h:free() end
  return self
end

function Tensor:clone(device)
  check_idle(self, "clone")
  local dev, idx
  if device == nil then dev, idx = self.device, self.device_index
  else dev, idx = parse_device(device, "clone") end
  local s = {}
  for i = 1, #self.shape do s[i] = self.shape[i] end
  local t = alloc(s, self.numel, self._info, dev, idx, "clone")
  return t:copy_(self)
end

-- t:to(device) or t:to(dtype): self when nothing changes, else a copy.
function Tensor:to(x)
  local d = type(x) == "string" and (DTYPES[x] or DTYPES[ALIASES[x] or ""])
  if d then
    if d == self._info then return self end
    check_idle(self, "to")
    local s = {}
    for i = 1, #self.shape do s[i] = self.shape[i] end
    local t = alloc(s, self.numel, d, self.device, self.device_index, "to")
    return t:copy_(self)
  end
  local dev = parse_device(x, "to")
  if dev == self.device then return self end
  return self:clone(dev)
end

function Tensor:contiguous()
  if self._contig then return self end
  return self:clone()
end

function Tensor:fill_(v)
  check_idle(self, "fill_")
  local info = self._info
  if type(v) ~= "number" then fail("fill_", "value must be a number, got " .. type(v)) end
  if info.kind == "int" and (not is_int(v) or v < info.min or v > info.max) then
    fail("fill_", fmt("%s is not an integer in range for %s", describe(v), info.name))
  end
  local n = self.numel
  if n == 0 then return self end
  local target = self
  if not (self._contig and self.device_index == nil) then
    target = host_empty({ n }, n, info, "fill_")
  end
  -- one element, rounded like any conversion, then doubled across the buffer
  local one = ffi.new("double[1]", v)
  wffi.check(C.weft_host_convert(one, F64.code, target.ptr, info.code, 1), "tensor.fill_", 2)
  local p, es, have = ffi_cast("uint8_t*", target.ptr), info.size, 1
  while have < n do
    local k = have < n - have and have or n - have
    copy_bytes(p + have * es, p, k * es)
    have = have + k
  end
  if target ~= self then
    store_from_host(self, target, "fill_")
    target:free()
  end
  return self
end

local cmp_out = ffi.new("double[2]")

-- max |a - b| and max |a - b| / max(|b|, 1e-30) against ref (a tensor of any
-- dtype and device, or a flat Lua table); NaN on one side only gives Inf.
function Tensor:compare(ref)
  check_idle(self, "compare")
  if type(ref) == "table" and not is_tensor(ref) then
    ref = M.from_table(ref, "f64", { #ref })
  elseif not is_tensor(ref) then
    fail("compare", "reference must be a tensor or a table of numbers, got " .. type(ref))
  end
  if ref.numel ~= self.numel then
    fail("compare", fmt("element counts differ: %s has %d, reference %s has %d",
                        shape_str(self.shape), self.numel, shape_str(ref.shape), ref.numel))
  end
  -- one dtype: compared as it is (every value widens to f64 exactly in C),
  -- with no f64 copies of either side
  local info = self._info == ref._info and self._info or F64
  local a = host_as(self, info, "compare")
  local b = host_as(ref, info, "compare")
  wffi.check(C.weft_host_compare(a.ptr, b.ptr, self.numel, info.code, cmp_out, cmp_out + 1),
             "tensor.compare", 2)
  if a ~= self then a:free() end
  if b ~= ref then b:free() end
  return cmp_out[0], cmp_out[1]
end

-- base:free() releases the storage and invalidates every view of it;
-- view:free() drops the view only. Raises while a pending async operation
-- uses the storage (nothing changes then).
function Tensor:free()
  local st = self._storage
  if not st or st.freed or self._dropped then self.ptr = nil; return end
  if st.pins then fail("free", in_use(st)) end
  if not self._owns then -- a view: drop it, keep the storage
    if st.views and st.views[self] then st.views[self] = nil end
    self.ptr, self._dropped = nil, true
    return
  end
  st.freed = true
  local views = st.views
  if views then
    for v in pairs(views) do v.ptr = nil end
    st.views = nil
  end
  if st.kind == "host" then
    ffi_gc(st.ptr, nil)
    C.weft_host_free(st.ptr)
  elseif st.kind == "cuda" then
    ffi_gc(st.ptr, nil)
    cuda_module("free").free(st.ptr, st.dev)
  end
  st.ptr, st.owner = nil, nil
  self.ptr = nil
end

-- Pins t's storage for a pending operation `op` of group `group` (weft.async).
function M._pin(t, op, group)
  local st = t._storage
  st.pins = (st.pins or 0) + 1
  st.pin_op, st.pin_group = op, group
  PINNED[st] = true
end

-- Undoes one _pin when that operation has settled.
function M._unpin(t)
  local st = t._storage
  local n = (st.pins or 1) - 1
  if n > 0 then st.pins = n
  else st.pins, st.pin_op, st.pin_group, PINNED[st] = nil, nil, nil, nil end
end

-- true while t's storage is pinned by a pending async operation.
function M.is_pinned(t) return t._storage.pins ~= nil end
-- the op and group of the pending operation t's storage is pinned by, or nil
function M.pinned_by(t)
  local st = t._storage
  if st.pins then return st.pin_op, st.pin_group end
end

-- ---------------------------------------------------------------- views

local function view_of(t, ptr, shape, strides, numel)
  local st = t._storage
  local v = make(ptr, shape, strides, numel, t._info, t.device, t.device_index, st,
                 compute_contig(shape, strides))
  local views = st.views
  if not views then views = setmetatable({}, WEAK_KEYS); st.views = views end
  views[v] = true
  return v
end

function Tensor:view(shape)
  check_live(self, "view")
  if not self._contig then
    fail("view", fmt("tensor %s is not contiguous (a narrow or transpose view); use :contiguous() or :clone() first",
                     shape_str(self.shape)))
  end
  local s, numel, infer = parse_shape(shape, "view", true, self._info)
  if infer then
    if numel == 0 or self.numel % numel ~= 0 then
      fail("view", fmt("cannot infer -1 in shape %s for %d elements", shape_str(s), self.numel))
    end
    s[infer] = self.numel / numel
    numel = self.numel
  end
  if numel ~= self.numel then
    fail("view", fmt("shape %s has %d elements, tensor %s has %d",
                     shape_str(s), numel, shape_str(self.shape), self.numel))
  end
  return view_of(self, self.ptr, s, contiguous_strides(s), numel)
end
Tensor.reshape = Tensor.view

function Tensor:narrow(dim, start, length)
  check_live(self, "narrow")
  local d = norm_dim(self, dim, "narrow")
  local size = self.shape[d]
  if not is_int(start) or not is_int(length) or start < 0 or length < 0 or start > size
     or length > size - start then -- no start + length: it rounds above 2^53
    fail("narrow", fmt("start %s, length %s out of range for dim %d of size %d of %s",
                       describe(start), describe(length), d - 1, size, shape_str(self.shape)))
  end
  local s, st = {}, {}
  for i = 1, #self.shape do s[i] = self.shape[i]; st[i] = self.strides[i] end
  s[d] = length
  local numel = self.numel / size * length
  if size == 0 then numel = 0 end
  local ptr = ffi_cast("void*", ffi_cast("uint8_t*", self.ptr) + start * st[d] * self._esize)
  return view_of(self, ptr, s, st, numel)
end

function Tensor:transpose(d0, d1)
  check_live(self, "transpose")
  local a, b = norm_dim(self, d0, "transpose"), norm_dim(self, d1, "transpose")
  local s, st = {}, {}
  for i = 1, #self.shape do s[i] = self.shape[i]; st[i] = self.strides[i] end
  s[a], s[b] = s[b], s[a]
  st[a], st[b] = st[b], st[a]
  return view_of(self, self.ptr, s, st, self.numel)
end

-- ---------------------------------------------------------------- printing

local SHOW = 8

function Tensor:__tostring()
  local head = fmt("tensor(%s, %s, %s%s)", self.dtype, shape_str(self.shape), self.device,
                   self._contig and "" or ", non-contiguous")
  if self._storage.freed or self._dropped then return head .. " <freed>" end
  if self.numel == 0 then return head .. "[]" end
  local k = self.numel < SHOW and self.numel or SHOW
  local ok, vals = pcall(function()
    local first = self
    if self._contig then
      first = view_of(self, self.ptr, { k }, { 1 }, k)
    elseif self.numel > k then
      first = self:contiguous():view({ self.numel }):narrow(0, 0, k)
    end
    return first:to_table()
  end)
  if not ok then return head .. " <unreadable: " .. tostring(vals) .. ">" end
  local parts = {}
  for i = 1, k do
    local v = vals[i]
    parts[i] = (self._info.kind == "int") and fmt("%d", v) or fmt("%.6g", v)
  end
  if self.numel > k then parts[#parts + 1] = "..." end
  return head .. "[" .. concat(parts, ", ") .. "]"
end

-- keep a few names for other modules
M.DTYPE_NAMES = { "f32", "f16", "bf16", "f64", "i32", "i64", "u8", "f8e4m3" }
M.contiguous_strides = contiguous_strides

return M
