-- weft.backends.custom_ar — weft's own one-shot / two-shot all-reduce (src/coll/allreduce.c,
-- kernels/allreduce.cu) from Lua: raw device pointers, counts in elements,
-- dtype and algorithm by code or name, like weft.nccl.
--
--   local ar = custom_ar.new(cpugroup, max_bytes)   -- collective (votes inside)
--   ar:run(in_ptr, out_ptr, count, "bf16", "auto" [, stream])   -- in == out: in place
--   ar:resolve(count, "bf16", "auto") -> "oneshot"|"twoshot"|"oneshot_flag", why
--   ar:kernel(count, "bf16", "auto") -> the kernel's code (ALGO), or nil: the
--     same answer without the strings (the custom_ar rule's, per call)
--   ar:check_error() -> nil | message (a kernel that timed out or was aborted)
--   ar.max_bytes ar.rank ar.world ar.lamport_bytes ar.oneshot_max
--   ar:set_timeout(ms)  ar:set_param(name, value)  ar:abort()  ar:destroy()
--
-- Sum only; f32, f16, bf16 (f32 accumulation); world 2, 4, 6, 8; any count up
-- to max_bytes; buffers 16-byte aligned. Kernels read the input inside the
-- launch (no registration, no staging) and keep their epochs in device
-- memory, so a captured call replays correctly with new input data.
-- Creation is collective over the cpu group and agreed (every rank succeeds
-- or every rank fails with the reason); destroy is local.
local ffi = require("ffi")
local wffi = require("weft.internal.ffi")
local binding = require("weft.internal.binding")
local C = wffi.C
local show = require("weft.internal.show").value -- names a refused value's type

local type, error, tonumber, tostring, setmetatable = type, error, tonumber, tostring, setmetatable
local ffi_gc, ffi_new, ffi_string = ffi.gc, ffi.new, ffi.string
local B = binding.new("custom_ar", "handle")
local raise, code_of, live, sh = B.raise, B.code_of, B.live, binding.stream

local M = {}

M.ALGO = { auto = 0, oneshot = 1, twoshot = 2, oneshot_flag = 3,
           -- the quick all-reduce (weft.quick, docs/quick-allreduce.md): bf16/f16 only
           quick_fp = 4, quick_int8 = 5, quick_int4 = 6, quick_fp8 = 7 }
M.NO_PDL = 256
M.KIND_NAME = { [1] = "oneshot", [2] = "twoshot", [3] = "oneshot_flag",
                [4] = "quick_fp", [5] = "quick_int8", [6] = "quick_int4", [7] = "quick_fp8" }
M.DTYPES = { f32 = 0, f16 = 1, bf16 = 2 }
M.WORLD_SIZES = { [2] = true, [4] = true, [6] = true, [8] = true }

local ALGO, DTYPES = M.ALGO, M.DTYPES

local kind1 = ffi_new("int[1]")
local why1 = ffi_new("const char*[1]")

local AR = {}
AR.__index = AR
M.AR = AR

-- new(cpugroup, max_bytes) -> handle. Collective; raises with the C message
-- (on every rank) when the workspace cannot be made.
function M.new(cpugroup, max_bytes)
  B.need_group(cpugroup)
  if type(max_bytes) ~= "number" or max_bytes < 16 then
    error("weft: custom_ar.new: max_bytes must be a number >= 16, got " .. show(max_bytes), 2)
  end
  local out = ffi_new("weft_ar*[1]")
  if C.weft_ar_create(cpugroup.handle, max_bytes, out) ~= 0 then
    raise("new")
  end
  local h = ffi_gc(out[0], C.weft_ar_destroy)
  local r, w = ffi_new("int[1]"), ffi_new("int[1]")
  local mb, lb, om = ffi_new("size_t[1]"), ffi_new("size_t[1]"), ffi_new("size_t[1]")
  C.weft_ar_info(h, r, w, mb, lb, om)
  return setmetatable({
    handle = h, name = cpugroup.name or "?", rank = tonumber(r[0]), world = tonumber(w[0]),
    max_bytes = tonumber(mb[0]), lamport_bytes = tonumber(lb[0]), oneshot_max = tonumber(om[0]),
  }, AR)
end

-- run(in, out, count, dtype, algo [, stream [, no_pdl]])
function AR:run(inp, out, count, dtype, algo, stream, no_pdl)
  local h = live(self, "run")
  local a = code_of(ALGO, algo or 0, "algorithm", "run")
  if no_pdl then a = a + M.NO_PDL end
  local rc = C.weft_ar_run(h, inp, out or inp, count, code_of(DTYPES, dtype, "dtype", "run"), a, sh(stream))
  -- refused before anything was enqueued (size, dtype: the same answer on
  -- every rank): the handle stays usable; anything else is a failed launch
  self.refused = rc == C.WEFT_EINVAL
  if rc ~= 0 then raise("run") end
end

-- resolve(count, dtype, algo) -> kernel name, why; nil, message when the call
-- would be refused (size, dtype)
function AR:resolve(count, dtype, algo)
  local h = live(self, "resolve")
  local d = type(dtype) == "number" and dtype or DTYPES[dtype]
  if d == nil then return nil, "dtype " .. tostring(dtype) .. " is not f32, f16 or bf16" end
  local a = type(algo) == "number" and algo or ALGO[algo or "auto"]
  if a == nil then return nil, "unknown algorithm " .. tostring(algo) end
  if C.weft_ar_resolve(h, count, d, a, kind1, why1) ~= 0 then
    return nil, ffi_string(C.weft_last_error())
  end
  return M.KIND_NAME[tonumber(kind1[0])] or "?", ffi_string(why1[0])
end

-- kernel(count, dtype, algo) -> the code (1-7) of the kernel weft_ar_resolve
-- picks for the call, or nil when it would refuse it (the run then raises
-- C's message). No strings made: the custom_ar rule asks it per call it
-- walks (weft.backends.device_backends.checks).
function AR:kernel(count, dtype, algo)
  local h = self.handle
  if h == nil then return nil end
  local d = DTYPES[dtype]
  if d == nil or C.weft_ar_resolve(h, count, d, algo, kind1, nil) ~= 0 then return nil end
  return tonumber(kind1[0])
end

-- nil, or the message of the first kernel failure (no synchronization)
function AR:check_error()
  local h = self.handle
  if h == nil then return "handle destroyed" end
  if C.weft_ar_check_error(h) ~= 0 then return ffi_string(C.weft_last_error()) end
  return nil
end

function AR:set_timeout(ms)
  if C.weft_ar_set_timeout(live(self, "set_timeout"), ms) ~= 0 then raise("set_timeout") end
end

function AR:set_param(name, value)
  if C.weft_ar_set_param(live(self, "set_param"), name, value) ~= 0 then raise("set_param") end
  if name == "oneshot_max" then self.oneshot_max = value end
  -- the kernels already chosen for this handle's calls (memoised by the
  -- group that owns it) may change: its owner's hook drops them
  if self.on_param ~= nil then self.on_param() end
end

function AR:abort()
  if self.handle ~= nil then C.weft_ar_abort(self.handle) end
end

-- Local; waits (bounded) for this rank's last call, then frees everything.
AR.destroy = binding.destroyer(C.weft_ar_destroy)

return M
