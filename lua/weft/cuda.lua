-- weft.cuda — the device runtime from Lua (src/cuda/cuda.c, src/cuda/cuda_pool.c, src/cuda/graph.c).
--
-- Interface: docs/lua-interfaces.md (weft.cuda). Loaded lazily (by weft.tensor
-- for device tensors); on a machine without a GPU everything loads,
-- available() is false and device calls raise "no CUDA device".
--  * pointers are cdata void*; sizes are bytes, counts are elements;
--  * streams: cuda.stream() makes an owned non-blocking stream (what a graph
--    capture needs); cuda.current_stream() wraps the thread's current one
--    (initially the legacy default stream, handle NULL);
--  * frees requested while this thread captures a graph are deferred until
--    the capture ends (a graph must not see its memory reused under it).
local ffi = require("ffi")
local wffi = require("weft.internal.ffi")
local C = wffi.C
local show = require("weft.internal.show").value -- names a refused value's type
local E = require("weft.internal.errors")

local type, tonumber, error, setmetatable = type, tonumber, error, setmetatable
local ffi_gc, ffi_new, ffi_string = ffi.gc, ffi.new, ffi.string
local fmt = string.format

local M = {}

local int1 = ffi_new("int[1]")
local ptr1 = ffi_new("void*[1]")
local float1 = ffi_new("float[1]")

local function check(rc, op)
  if rc ~= 0 then
    error(fmt("weft: cuda.%s: %s", op, ffi_string(C.weft_last_error())), 3)
  end
end

-- "weft: cuda.<op>: <msg>" where weft.internal.errors.fail(2, ...) would put it (+ 1 for this frame)
local function fail(op, msg)
  E.fail(3, "cuda." .. op, "%s", msg)
end

-- ---------------------------------------------------------------- devices

local count_cache
function M.device_count()
  if count_cache == nil then
    C.weft_cuda_device_count(int1)
    count_cache = tonumber(int1[0])
  end
  return count_cache
end

function M.available() return M.device_count() > 0 end

function M.current_device()
  check(C.weft_cuda_get_device(int1), "current_device")
  return tonumber(int1[0])
end

function M.set_device(i)
  if type(i) ~= "number" then fail("set_device", "device index must be a number, got " .. type(i)) end
  check(C.weft_cuda_set_device(i), "set_device")
end

function M.device_name(i)
  local buf = ffi_new("char[256]")
  check(C.weft_cuda_device_name(i or -1, buf, 256), "device_name")
  return ffi_string(buf)
end

function M.synchronize() check(C.weft_cuda_synchronize(), "synchronize") end

-- Device index that owns ptr, or nil for host memory.
function M.pointer_device(ptr)
  check(C.weft_cuda_pointer_device(ptr, int1), "pointer_device")
  local d = tonumber(int1[0])
  if d < 0 then return nil end
  return d
end

-- ---------------------------------------------------------------- memory

local capture_depth, deferred = 0, {}

function M.alloc(nbytes, dev)
  if type(nbytes) ~= "number" or nbytes < 0 then
    fail("alloc", "byte count must be a non-negative number, got " .. show(nbytes))
  end
  check(C.weft_cuda_malloc(ptr1, nbytes, dev or -1), "alloc")
  return ptr1[0]
end

-- dev is accepted for the interface; the pool knows every block's device.
function M.free(ptr, dev)
  if ptr == nil then return end
  if capture_depth > 0 then
    deferred[#deferred + 1] = ptr
    return
  end
  check(C.weft_cuda_free(ptr), "free")
end

-- For weft.graph: count captures in flight, run deferred frees after the last.
function M._capture_enter() capture_depth = capture_depth + 1 end
function M._capture_leave()
  capture_depth = capture_depth - 1
  if capture_depth == 0 and #deferred > 0 then
    local list = deferred
    deferred = {}
    for i = 1, #list do C.weft_cuda_free(list[i]) end
  end
end
function M.capturing() return capture_depth > 0 end

function M.pool_stats(dev)
  local st = ffi_new("weft_cuda_pool_stats")
  check(C.weft_cuda_pool_stats_get(dev or -1, st), "pool_stats")
  return {
    in_use_bytes = tonumber(st.in_use_bytes), in_use_blocks = tonumber(st.in_use_blocks),
    cached_bytes = tonumber(st.cached_bytes), cached_blocks = tonumber(st.cached_blocks),
    peak_bytes = tonumber(st.peak_bytes), device_allocs = tonumber(st.device_allocs),
    device_frees = tonumber(st.device_frees), hits = tonumber(st.hits), misses = tonumber(st.misses),
  }
end

function M.pool_trim(dev) check(C.weft_cuda_pool_trim(dev or -1), "pool_trim") end

local function stream_handle(s)
  if s == nil then return nil end
  if type(s) == "table" then return s.handle end
  return s
end
M.stream_handle = stream_handle

-- Synchronous copy, ordered after the current stream's work.
function M.copy(dst, src, nbytes)
  check(C.weft_cuda_memcpy(dst, src, nbytes), "copy")
end

function M.copy_async(dst, src, nbytes, stream)
  check(C.weft_cuda_memcpy_async(dst, src, nbytes, stream_handle(stream)), "copy_async")
end

function M.memset(ptr, value, nbytes, stream)
  check(C.weft_cuda_memset(ptr, value, nbytes, stream_handle(stream)), "memset")
end

-- dist 0: uniform [-1, 1); 1: standard normal. Runs on the current stream of
-- device dev (the thread's device when nil).
function M.fill_random(ptr, count, dtype_code, seed, dist, dev, stream)
  local cur
  if dev ~= nil then
    check(C.weft_cuda_get_device(int1), "fill_random")
    cur = tonumber(int1[0])
    if cur ~= dev then check(C.weft_cuda_set_device(dev), "fill_random") else cur = nil end
  end
  local rc = C.weft_cuda_fill_random(ptr, count, dtype_code, seed or 0, dist or 0,
                                     stream_handle(stream))
  if cur then C.weft_cuda_set_device(cur) end
  check(rc, "fill_random")
end

-- NaN pass around NCCL's float max/min (kernels/devops.cu): nan_mask writes
-- mask[i] = 1 where x[i] is NaN (u8, count elements), nan_fixup writes the
-- dtype's quiet NaN into x where mask is set. dtype_code: f32 0, f16 1,
-- bf16 2, f64 6. Async on stream (nil: the thread's current one); capturable.
function M.nan_mask(x, mask, count, dtype_code, stream)
  check(C.weft_cuda_nan_mask(x, mask, count, dtype_code, stream_handle(stream)), "nan_mask")
end

function M.nan_fixup(x, mask, count, dtype_code, stream)
  check(C.weft_cuda_nan_fixup(x, mask, count, dtype_code, stream_handle(stream)), "nan_fixup")
end

-- ---------------------------------------------------------------- streams

local Stream = {}
Stream.__index = Stream
M.Stream = Stream

local function destroy_stream(h) C.weft_cuda_stream_destroy(h) end

-- cuda.stream([{blocking=true}]) -> owned stream (non-blocking by default)
function M.stream(opts)
  local nonblocking = not (opts and opts.blocking)
  check(C.weft_cuda_stream_create(nonblocking and 1 or 0, ptr1), "stream")
  local h = ffi_gc(ptr1[0], destroy_stream)
  return setmetatable({ handle = h, owned = true }, Stream)
end

-- Wraps a raw cudaStream_t (not owned: never destroyed by weft).
function M.wrap_stream(handle)
  return setmetatable({ handle = handle, owned = false }, Stream)
end

function M.current_stream()
  check(C.weft_cuda_stream_get_current(ptr1), "current_stream")
  return setmetatable({ handle = ptr1[0], owned = false }, Stream)
end

function M.set_current_stream(s)
  check(C.weft_cuda_stream_set_current(stream_handle(s)), "set_current_stream")
end

function Stream:synchronize()
  check(C.weft_cuda_stream_synchronize(self.handle), "stream:synchronize")
end

-- This stream waits (on the device) for the work queued on `other` so far.
function Stream:wait_stream(other)
  check(C.weft_cuda_stream_wait_stream(self.handle, stream_handle(other)), "stream:wait_stream")
end

function Stream:wait_event(ev)
  check(C.weft_cuda_stream_wait_event(self.handle, ev.handle), "stream:wait_event")
end

function Stream:capturing()
  check(C.weft_cuda_stream_capturing(self.handle, int1), "stream:capturing")
  return int1[0] ~= 0
end

function Stream:is_default() return self.handle == nil end

function Stream:destroy()
  if self.owned and self.handle ~= nil then
    ffi_gc(self.handle, nil)
    check(C.weft_cuda_stream_destroy(self.handle), "stream:destroy")
  end
  self.handle = nil
  self.owned = false
end

-- ---------------------------------------------------------------- events

local Event = {}
Event.__index = Event
M.Event = Event

local function destroy_event(h) C.weft_cuda_event_destroy(h) end

-- cuda.event([{timing=false}]) -> event (timing on by default)
function M.event(opts)
  local timing = not (opts and opts.timing == false)
  check(C.weft_cuda_event_create(timing and 1 or 0, ptr1), "event")
  return setmetatable({ handle = ffi_gc(ptr1[0], destroy_event) }, Event)
end

function Event:record(stream)
  check(C.weft_cuda_event_record(self.handle, stream_handle(stream)), "event:record")
  return self
end

function Event:synchronize()
  check(C.weft_cuda_event_synchronize(self.handle), "event:synchronize")
end

-- Milliseconds from self to later (waits for later).
function Event:elapsed(later)
  check(C.weft_cuda_event_elapsed(self.handle, later.handle, float1), "event:elapsed")
  return tonumber(float1[0])
end

function Event:destroy()
  if self.handle ~= nil then
    ffi_gc(self.handle, nil)
    C.weft_cuda_event_destroy(self.handle)
    self.handle = nil
  end
end

-- ---------------------------------------------------------------- kernels

local NORM_DTYPES = { f32 = 0, f16 = 1, bf16 = 2 }

-- Residual add + RMSNorm on device tensors (kernels/norm.cu):
--   residual_out = x + residual; out = rmsnorm(residual_out) * weight
-- opts: out=, residual_out= (tensors; default: new tensors), gemma=true,
-- stream=, deterministic=true (the fused kernel's arithmetic, bit for bit: weft_cuda_rmsnorm
-- with WEFT_RMSNORM_DETERMINISTIC). residual may be nil (plain RMSNorm). Returns out, residual_out.
function M.rmsnorm(x, residual, weight, eps, opts)
  opts = opts or {}
  -- weft.tensor is loaded wherever a tensor exists: taken from there, not
  -- required (weft.tensor requires this module for device memory)
  local tensor = package.loaded["weft.tensor"]
  if tensor == nil then fail("rmsnorm", "input must be a device tensor (weft.tensor is not loaded)") end
  local function want(t, what)
    if not tensor.is_tensor(t) then fail("rmsnorm", what .. " must be a weft tensor") end
    if t.device_index ~= x.device_index then
      fail("rmsnorm", fmt("%s is on %s, input on %s", what, t.device, x.device))
    end
    if t.dtype ~= x.dtype then fail("rmsnorm", fmt("%s is %s, input is %s", what, t.dtype, x.dtype)) end
    if not t:is_contiguous() then fail("rmsnorm", what .. " is not contiguous") end
  end
  if not tensor.is_tensor(x) or x.device_index == nil then
    fail("rmsnorm", "input must be a device tensor")
  end
  if x.device_index ~= M.current_device() then
    fail("rmsnorm", fmt("input is on %s but the current device is cuda:%d", x.device, M.current_device()))
  end
  local code = NORM_DTYPES[x.dtype]
  if not code then fail("rmsnorm", "dtype " .. x.dtype .. " is not f32, f16 or bf16") end
  want(x, "input")
  local hidden = x.shape[#x.shape]
  local tokens = x.numel / hidden
  want(weight, "weight")
  if weight.numel ~= hidden then
    fail("rmsnorm", fmt("weight has %d elements, hidden size is %d", weight.numel, hidden))
  end
  if residual ~= nil then
    want(residual, "residual")
    if residual.numel ~= x.numel then fail("rmsnorm", "residual and input differ in size") end
  end
  local out = opts.out or tensor.empty(x.shape, x.dtype, x.device)
  want(out, "out")
  local res_out = opts.residual_out
  if residual ~= nil and res_out == nil then res_out = tensor.empty(x.shape, x.dtype, x.device) end
  if res_out ~= nil then want(res_out, "residual_out") end
  check(C.weft_cuda_rmsnorm(x.ptr, residual and residual.ptr, weight.ptr, out.ptr,
                            res_out and res_out.ptr, tokens, hidden, code, eps or 1e-6,
                            (opts.gemma and 1 or 0) + (opts.deterministic and 2 or 0),
                            stream_handle(opts.stream)), "rmsnorm")
  return out, res_out
end

return M
