-- weft.internal.ffi — loads libweft.so and declares its C contract (src/weft.h).
-- The declarations come from the library itself (weft_ffi_cdef), so Lua and C
-- can never disagree about signatures; the ABI version is checked on load.
local ffi = require("ffi")

local M = {}
M.ABI_VERSION = 4

ffi.cdef [[ const char *weft_ffi_cdef(void); ]]

-- The folder the modules were loaded from (the one holding weft/): <repo>/lua
-- in the source tree, <prefix>/share/lua/5.1 once installed.
local function lua_dir()
  local src = debug.getinfo(1, "S").source
  if src:sub(1, 1) ~= "@" then return "./" end
  return src:sub(2):match("^(.*/)weft/") or "./"
end

local function candidates()
  local list = {}
  local env = os.getenv("WEFT_LIB")
  if env and env ~= "" then list[#list + 1] = env end
  local dir = lua_dir()
  list[#list + 1] = dir .. "../build/libweft.so"              -- source tree: make lib
  list[#list + 1] = dir .. "../build/host/libweft.so"         -- source tree: make demo without a GPU
  list[#list + 1] = dir .. "../../../lib/libweft.so"          -- make install: <prefix>/lib
  list[#list + 1] = dir .. "../../../lib/lua/5.1/libweft.so"  -- luarocks: <tree>/lib/lua/5.1
  for pat in package.cpath:gmatch("[^;]+") do
    local p = pat:gsub("%?", "libweft")
    list[#list + 1] = p
  end
  return list
end

local function load_library()
  local tried = {}
  for _, path in ipairs(candidates()) do
    local f = io.open(path, "rb")
    if f then
      f:close()
      local ok, lib = pcall(ffi.load, path)
      if ok then return lib, path end
      tried[#tried + 1] = path .. " (" .. tostring(lib) .. ")"
    else
      tried[#tried + 1] = path
    end
  end
  error("weft: load: libweft.so not found (run `make` or `make install`, or set WEFT_LIB); tried: "
        .. table.concat(tried, ", "), 0)
end

local lib, path = load_library()
-- A second copy of this module in one Lua state (package.loaded cleared,
-- nginx's lua_code_cache off) finds the declarations already made.
if not pcall(ffi.typeof, "weft_store_opts") then ffi.cdef(ffi.string(lib.weft_ffi_cdef())) end

-- Keep the library referenced for the life of the process (a collected library would unmap code the finalizers call).
M.C = lib
M.path = path

local abi = lib.weft_abi_version()
if abi ~= M.ABI_VERSION then
  error(("weft: load: %s has ABI version %d, this Lua layer expects %d (rebuild)")
        :format(path, abi, M.ABI_VERSION), 0)
end

M.codes = {
  [0] = "OK", [-1] = "EINVAL", [-2] = "ETIMEOUT", [-3] = "ESYS", [-4] = "ECLOSED",
  [-5] = "ENOMEM", [-6] = "ENODEV", [-7] = "ECUDA", [-8] = "ENCCL", [-9] = "EPROTO",
  [-10] = "EAUTH", [-11] = "EAGAIN", [-12] = "ESTATE", [-13] = "EABORT", [-14] = "EMISMATCH",
}

local ffi_string = ffi.string

-- Last C error message.
function M.last_error()
  return ffi_string(lib.weft_last_error())
end

-- Raise a Lua error for a failed C call. `op` names the Lua-level operation;
-- the C message already names the group and cause. level: error() level.
function M.raise(rc, op, level)
  error(("weft: %s: %s"):format(op, ffi_string(lib.weft_last_error())), (level or 1) + 1)
end

-- Check a return code; returns rc when it is 0 (or in `allowed`).
function M.check(rc, op, level)
  if rc ~= 0 then
    error(("weft: %s: %s"):format(op, ffi_string(lib.weft_last_error())), (level or 1) + 1)
  end
  return rc
end

return M
