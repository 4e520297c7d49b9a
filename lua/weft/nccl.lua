-- weft.nccl — NCCL communicators over a cpu group (src/coll/nccl.c): the
-- binding. The GroupCoordinator's backend that calls it for device tensors is
-- weft.backends.device_backends.nccl_backend.
--
--   local c = nccl.new(cpugroup [, {timeout_ms=, blocking=}])   -- c.blocking: the mode
--   c:all_reduce(in_ptr, out_ptr, count, dtype, op [, stream])
--   c:synchronize([stream])      c:destroy()
--
-- Like weft.shm: raw device pointers, counts in elements, C dtype/op codes
-- (names such as "bf16" / "sum" are accepted too), ranks/roots/peers are
-- 0-based indices in the group. stream: nil (the thread's current stream), a
-- weft.cuda stream, or a raw cudaStream_t. Creation is collective over the
-- cpu group; every wait is bounded by the group timeout, after which the
-- communicator is aborted and every call on it raises.
local ffi = require("ffi")
local wffi = require("weft.internal.ffi")
local binding = require("weft.internal.binding")
local C = wffi.C

local type, tonumber, error, setmetatable = type, tonumber, error, setmetatable
local ffi_gc, ffi_new, ffi_string = ffi.gc, ffi.new, ffi.string
local fmt = string.format
local B = binding.new("nccl", "communicator")
local raise, code_of, live, sh = B.raise, B.code_of, B.live, binding.stream

local M = {}

local DTYPES = { f32 = 0, f16 = 1, bf16 = 2, i32 = 3, i64 = 4, u8 = 5, f64 = 6, f8e4m3 = 7,
                 float32 = 0, float16 = 1, bfloat16 = 2, int32 = 3, int64 = 4, uint8 = 5,
                 float64 = 6 }
local OPS = { sum = 0, max = 1, min = 2, prod = 4 }
M.DTYPES, M.OPS = DTYPES, OPS

local int1 = ffi_new("int[1]")

-- ---------------------------------------------------------------- module

-- NCCL version code (e.g. 22803), or nil with the reason when it cannot load.
function M.version()
  if C.weft_nccl_version(int1) ~= 0 then return nil, ffi_string(C.weft_last_error()) end
  return tonumber(int1[0])
end

function M.available() return M.version() ~= nil end

function M.group_start()
  if C.weft_nccl_group_start() ~= 0 then raise("group_start") end
end

function M.group_end()
  if C.weft_nccl_group_end() ~= 0 then raise("group_end") end
end

-- Runs fn between group_start and group_end (group_end runs even if fn raises).
function M.group(fn, ...)
  M.group_start()
  local ok, err = pcall(fn, ...)
  local rc = C.weft_nccl_group_end()
  if not ok then error(err, 2) end
  if rc ~= 0 then raise("group_end") end
end

-- ---------------------------------------------------------------- communicator

local Comm = {}
Comm.__index = Comm
M.Comm = Comm

-- A communicator nobody destroyed (dropped, or the process ends on an
-- error): destroyed as weft_nccl_destroy does, its finalize flushing what it
-- still runs (bounded by the group's timeout, after which it aborts). Not
-- an abort first: on an H100 (NCCL 2.28.3) a communicator ended by
-- ncclCommAbort alone left the process to die of SIGSEGV at its exit, in
-- 20 of 20 runs, with or without work in flight; the destroy path 11 of 11
-- clean (bench/results/gpu-tests-nvidia-h100-2026-12-07.md).
local function finalize(h)
  C.weft_nccl_destroy(h)
end

-- nccl.new(cpugroup [, {timeout_ms=, blocking=}]): collective over the cpu
-- group; name, index, size and timeout come from the group (timeout_ms
-- overrides afterwards). Init is bounded by the group timeout in both modes.
-- blocking=true (the default, or WEFT_NCCL_BLOCKING=1): calls go to a
-- blocking communicator split from a non-blocking one (inline enqueue, the
-- cheap eager path; a watchdog ends a call blocked on a peer). blocking=false
-- (or WEFT_NCCL_BLOCKING=0): calls go to the non-blocking communicator (NCCL
-- enqueues from a helper thread: tens of µs more per eager call).
-- c.blocking tells which one this communicator is.
function M.new(cpugroup, opts)
  B.need_group(cpugroup)
  local blocking = -1
  if opts and opts.blocking ~= nil then blocking = opts.blocking and 1 or 0 end
  local out = ffi_new("weft_nccl*[1]")
  if C.weft_nccl_create(cpugroup.handle, blocking, out) ~= 0 then raise("new") end
  local h = ffi_gc(out[0], finalize)
  local r, n, d = ffi_new("int[1]"), ffi_new("int[1]"), ffi_new("int[1]")
  C.weft_nccl_info(h, r, n, d)
  local size = tonumber(n[0])
  C.weft_nccl_blocking(h, int1)
  local self = setmetatable({
    handle = h, name = cpugroup.name or "?", rank = tonumber(r[0]), size = size,
    device = tonumber(d[0]), blocking = int1[0] == 1,
    counts = ffi_new("size_t[?]", size),
    counts2 = ffi_new("size_t[?]", size),
  }, Comm)
  if opts and opts.timeout_ms then self:set_timeout(opts.timeout_ms) end
  return self
end

function Comm:set_timeout(ms)
  if C.weft_nccl_set_timeout(self.handle, ms) ~= 0 then raise("set_timeout") end
end

-- fills c.counts (or c.counts2) from a Lua array of size numbers
local function counts_of(c, list, buf, op)
  if type(list) ~= "table" or #list ~= c.size then
    error(fmt("weft: nccl.%s: group %s: expected %d per-rank counts, got %s", op, c.name, c.size,
              type(list) == "table" and #list or type(list)), 3)
  end
  for i = 1, c.size do
    local n = list[i]
    if type(n) ~= "number" or n < 0 or n % 1 ~= 0 then
      error(fmt("weft: nccl.%s: group %s: count %d is %s", op, c.name, i - 1, tostring(n)), 3)
    end
    buf[i - 1] = n
  end
  return buf
end

function Comm:all_reduce(inp, out, count, dtype, op, stream)
  local h = live(self, "all_reduce")
  if C.weft_nccl_all_reduce(h, inp, out or inp, count, code_of(DTYPES, dtype, "dtype", "all_reduce"),
                            code_of(OPS, op or 0, "op", "all_reduce"), sh(stream)) ~= 0 then
    raise("all_reduce")
  end
end

function Comm:all_gather(inp, out, count, dtype, stream)
  local h = live(self, "all_gather")
  if C.weft_nccl_all_gather(h, inp, out, count, code_of(DTYPES, dtype, "dtype", "all_gather"),
                            sh(stream)) ~= 0 then
    raise("all_gather")
  end
end

function Comm:all_gatherv(inp, out, counts, dtype, stream)
  local h = live(self, "all_gatherv")
  local buf = counts_of(self, counts, self.counts, "all_gatherv")
  if C.weft_nccl_all_gatherv(h, inp, out, buf, code_of(DTYPES, dtype, "dtype", "all_gatherv"),
                             sh(stream)) ~= 0 then
    raise("all_gatherv")
  end
end

function Comm:reduce_scatter(inp, out, count_out, dtype, op, stream)
  local h = live(self, "reduce_scatter")
  if C.weft_nccl_reduce_scatter(h, inp, out, count_out,
                                code_of(DTYPES, dtype, "dtype", "reduce_scatter"),
                                code_of(OPS, op or 0, "op", "reduce_scatter"), sh(stream)) ~= 0 then
    raise("reduce_scatter")
  end
end

function Comm:reduce_scatterv(inp, out, counts, dtype, op, stream)
  local h = live(self, "reduce_scatterv")
  local buf = counts_of(self, counts, self.counts, "reduce_scatterv")
  if C.weft_nccl_reduce_scatterv(h, inp, out, buf, code_of(DTYPES, dtype, "dtype", "reduce_scatterv"),
                                 code_of(OPS, op or 0, "op", "reduce_scatterv"), sh(stream)) ~= 0 then
    raise("reduce_scatterv")
  end
end

-- in-place when out is nil: buf on root is sent, elsewhere received into
function Comm:broadcast(buf, count, dtype, root, stream, out)
  local h = live(self, "broadcast")
  if C.weft_nccl_broadcast(h, buf, out or buf, count, code_of(DTYPES, dtype, "dtype", "broadcast"),
                           root, sh(stream)) ~= 0 then
    raise("broadcast")
  end
end

-- out: size * count elements on root (nil elsewhere)
function Comm:gather(inp, out, count, dtype, root, stream)
  local h = live(self, "gather")
  if C.weft_nccl_gather(h, inp, out, count, code_of(DTYPES, dtype, "dtype", "gather"), root,
                        sh(stream)) ~= 0 then
    raise("gather")
  end
end

function Comm:send(buf, count, dtype, peer, stream)
  local h = live(self, "send")
  if C.weft_nccl_send(h, buf, count, code_of(DTYPES, dtype, "dtype", "send"), peer, sh(stream)) ~= 0 then
    raise("send")
  end
end

function Comm:recv(buf, count, dtype, peer, stream)
  local h = live(self, "recv")
  if C.weft_nccl_recv(h, buf, count, code_of(DTYPES, dtype, "dtype", "recv"), peer, sh(stream)) ~= 0 then
    raise("recv")
  end
end

-- all_to_all_single: equal splits of `count` elements, or per-peer
-- send_counts/recv_counts (Lua arrays of size numbers, packed in peer order).
function Comm:all_to_all(inp, out, count, dtype, send_counts, recv_counts, stream)
  local h = live(self, "all_to_all")
  local sc, rc = nil, nil
  if send_counts ~= nil or recv_counts ~= nil then
    sc = counts_of(self, send_counts, self.counts, "all_to_all")
    rc = counts_of(self, recv_counts, self.counts2, "all_to_all")
  end
  if C.weft_nccl_all_to_all(h, inp, out, count or 0, sc, rc,
                            code_of(DTYPES, dtype, "dtype", "all_to_all"), sh(stream)) ~= 0 then
    raise("all_to_all")
  end
end

-- Waits for stream (bounded by the group timeout, polling the communicator).
function Comm:synchronize(stream)
  local h = live(self, "synchronize")
  if C.weft_nccl_synchronize(h, sh(stream)) ~= 0 then raise("synchronize") end
end

function Comm:abort()
  if self.handle ~= nil then C.weft_nccl_abort(self.handle) end
end

function Comm:destroy()
  local h = binding.release(self)
  if h ~= nil and C.weft_nccl_destroy(h) ~= 0 then raise("destroy") end
end

return M
