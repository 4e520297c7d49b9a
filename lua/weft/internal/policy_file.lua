-- weft.internal.policy_file — the tuned policy file: crossover sizes measured on the
-- machine at hand (written by scripts/weft-tune), read and validated here;
-- weft.policy consults it. Pure Lua (no libweft), tested on the CPU.
--
--   return {
--     version = 1, machine = "nvidia-h200-x2", date = "2026-11-30",
--     all_reduce = {                 -- device all-reduce of `bytes` on `world` ranks
--       [2] = { bf16 = { { upto = 8388608, backend = "oneshot" },
--                        { upto = 268435456, backend = "twoshot" },
--                        { backend = "nccl" } },
--               ["*"] = { { backend = "auto" } } },   -- any other dtype
--     },
--     quick_min = {                  -- the quick all-reduce: bytes from which each codec
--       [2] = { bf16 = { int8 = 8388608, int4 = 8388608, fp8 = 8388608 } },   -- serves (weft.quick)
--     },
--     fused = {                      -- fused all-reduce + residual + RMSNorm
--       [2] = { bf16 = { { upto = 33554432, backend = "fused_oneshot" },
--                        { backend = "fused_twoshot" } } },
--     },
--   }
--
-- Entries of a list are tried in order: the first whose `upto` (bytes,
-- inclusive) is at least the call's size, or that has no `upto`, gives the
-- backend. A size beyond every `upto` gets the built-in choice. World keys
-- are integers or "*", dtype keys f32, f16, bf16 or "*".
--
-- The file is Lua run with an empty environment (no library functions; a
-- file that calls any fails, naming the call), and never as bytecode.
-- Validation names the file and the entry ("all_reduce[2].bf16[3].backend").
local M = {}

local type, tostring, pairs, ipairs, pcall = type, tostring, pairs, ipairs, pcall
local floor, huge = math.floor, math.huge
local fmt, concat = string.format, table.concat
local show = require("weft.internal.show").value -- names a refused value's type
local E = require("weft.internal.errors")

M.VERSION = 1

-- Backend names each section accepts, and what they mean to weft.policy.
M.BACKENDS = {
  all_reduce = {
    nccl = "NCCL", auto = "weft custom all-reduce, its own size rule (src/coll/allreduce.c)",
    oneshot = "weft one-shot (Lamport; flag one-shot above its buffers)",
    twoshot = "weft two-shot (reduce-scatter + all-gather)",
    oneshot_flag = "weft flag one-shot",
  },
  fused = {
    fused_auto = "fused kernel, its own one-/two-shot rule (src/coll/fusion.c)",
    fused_oneshot = "fused one-shot kernel", fused_twoshot = "fused two-shot kernel",
    unfused = "all-reduce, then the norm kernel",
  },
}
M.SECTIONS = { all_reduce = true, fused = true }
M.META = { version = true, machine = true, date = true, commit = true, notes = true,
           source = true, meta = true, tool = true }
M.DTYPES = { f32 = true, f16 = true, bf16 = true, ["*"] = true }

local function names(set)
  local list = {}
  for k in pairs(set) do list[#list + 1] = k end
  table.sort(list)
  return concat(list, ", ")
end

-- "weft: policy file <name>: <where>: <what>" (no position: the file's fault)
local function fail(name, where, fmt_, ...)
  E.fail(0, "policy file " .. tostring(name), "%s" .. fmt_, where and (where .. ": ") or "", ...)
end

local function key_str(k)
  if type(k) == "string" and k:match("^[%a_][%w_]*$") then return "." .. k end
  return "[" .. (type(k) == "string" and fmt("%q", k) or tostring(k)) .. "]"
end

-- quick_min[world][dtype][codec] = bytes (world: integer >= 2 or "*"; dtype
-- bf16, f16 or "*"; codec int8, int4, fp8; bytes an integer >= 0)
M.QUICK_CODECS = { int8 = true, int4 = true, fp8 = true }
M.QUICK_DTYPES = { bf16 = true, f16 = true, ["*"] = true }

-- The path of a section's world-size key (section[world]); raises unless
-- the key is a world size or "*" and its value a table keyed by dtype.
local function world_path(name, section, world, by)
  local wpath = section .. key_str(world)
  if world ~= "*" and not (type(world) == "number" and world == floor(world) and world >= 2) then
    fail(name, wpath, "world size must be an integer >= 2 or \"*\"")
  end
  if type(by) ~= "table" then fail(name, wpath, "must be a table keyed by dtype") end
  return wpath
end

function M.validate_quick_min(q, name)
  if q == nil then return end
  if type(q) ~= "table" then fail(name, "quick_min", "must be a table keyed by world size") end
  for world, by in pairs(q) do
    local wpath = world_path(name, "quick_min", world, by)
    for dtype, codecs in pairs(by) do
      local dpath = wpath .. key_str(dtype)
      if not M.QUICK_DTYPES[dtype] then fail(name, dpath, "unknown dtype (%s)", names(M.QUICK_DTYPES)) end
      if type(codecs) ~= "table" then fail(name, dpath, "must be a table {int8 = bytes, ...}") end
      for codec, bytes in pairs(codecs) do
        local cpath = dpath .. key_str(codec)
        if not M.QUICK_CODECS[codec] then fail(name, cpath, "unknown codec (%s)", names(M.QUICK_CODECS)) end
        if type(bytes) ~= "number" or bytes ~= floor(bytes) or bytes < 0 or bytes == huge then
          fail(name, cpath, "must be an integer byte count >= 0, got %s", show(bytes))
        end
      end
    end
  end
end

-- one entry {upto=, backend=} of a section's list (entry i of n, above prev
-- bytes): its upto, or prev where it has none
local function check_entry(name, section, epath, e, i, n, prev)
  local allowed = M.BACKENDS[section]
  if type(e) ~= "table" then fail(name, epath, "must be a table {upto=, backend=}") end
  for k in pairs(e) do
    if k ~= "upto" and k ~= "backend" and k ~= "us" and k ~= "note" then
      fail(name, epath, "unknown field %s (upto, backend, us, note)", tostring(k))
    end
  end
  if type(e.backend) ~= "string" or not allowed[e.backend] then
    fail(name, epath .. ".backend", "unknown backend %s for %s (%s)",
         type(e.backend) == "string" and fmt("%q", e.backend) or tostring(e.backend), section, names(allowed))
  end
  if e.upto == nil then
    if i ~= n then fail(name, epath, "only the last entry may omit upto") end
    return prev
  end
  if type(e.upto) ~= "number" or e.upto ~= floor(e.upto) or e.upto <= prev or e.upto == huge then
    fail(name, epath .. ".upto", "must be an integer byte count above the previous entry's (%d), got %s",
         prev, tostring(e.upto))
  end
  return e.upto
end

-- a section's list of entries for one world size and dtype, at dpath
local function check_list(name, section, dpath, dtype, list)
  if not M.DTYPES[dtype] then fail(name, dpath, "unknown dtype (%s)", names(M.DTYPES)) end
  if type(list) ~= "table" or #list == 0 then fail(name, dpath, "must be a non-empty list of entries") end
  for k in pairs(list) do
    if type(k) ~= "number" or k < 1 or k > #list or k ~= floor(k) then
      fail(name, dpath, "must be a list (found key %s)", tostring(k))
    end
  end
  local prev = 0
  for i, e in ipairs(list) do prev = check_entry(name, section, dpath .. "[" .. i .. "]", e, i, #list, prev) end
end

-- validate(t, name) -> t (raises naming the file and the entry)
function M.validate(t, name)
  name = name or "(table)"
  if type(t) ~= "table" then fail(name, nil, "must return a table, got %s", type(t)) end
  if t.version ~= M.VERSION then
    fail(name, "version", "is %s, this weft reads version %d", tostring(t.version), M.VERSION)
  end
  for k in pairs(t) do
    if not M.SECTIONS[k] and not M.META[k] and k ~= "quick_min" then
      fail(name, tostring(k), "unknown key (sections: %s; information: %s)", names(M.SECTIONS), names(M.META))
    end
  end
  M.validate_quick_min(t.quick_min, name)
  for section in pairs(M.SECTIONS) do
    local s = t[section]
    if s ~= nil then
      if type(s) ~= "table" then fail(name, section, "must be a table keyed by world size") end
      for world, by_dtype in pairs(s) do
        local wpath = world_path(name, section, world, by_dtype)
        for dtype, list in pairs(by_dtype) do check_list(name, section, wpath .. key_str(dtype), dtype, list) end
      end
    end
  end
  return t
end

-- parse(text, name) -> validated table
function M.parse(text, name)
  name = name or "(string)"
  if type(text) ~= "string" then fail(name, nil, "expected Lua text, got %s", type(text)) end
  if text:sub(1, 1) == "\27" then fail(name, nil, "is precompiled bytecode; weft reads Lua text only") end
  local chunk, err = loadstring(text, "=" .. name)
  if not chunk then fail(name, nil, "syntax error: %s", tostring(err)) end
  setfenv(chunk, {})
  local ok, t = pcall(chunk)
  if not ok then fail(name, nil, "failed while running (it may only return a table of data): %s", tostring(t)) end
  return M.validate(t, name)
end

-- load(path) -> validated table (raises: unreadable, syntax, validation)
function M.load(path)
  local f, err = io.open(path, "rb")
  if not f then fail(path, nil, "cannot be read: %s", tostring(err)) end
  local text = f:read("*a")
  f:close()
  return M.parse(text, path)
end

-- The file weft loads automatically: WEFT_POLICY_FILE (explicit = true), else
-- $XDG_CONFIG_HOME/weft/policy.lua, else ~/.config/weft/policy.lua (only
-- when it exists). Returns path, explicit; nil when there is none.
function M.default_path(getenv)
  getenv = getenv or os.getenv
  local p = getenv("WEFT_POLICY_FILE")
  if p and p ~= "" then return p, true end
  local xdg = getenv("XDG_CONFIG_HOME")
  local home = getenv("HOME")
  local cand = (xdg and xdg ~= "") and (xdg .. "/weft/policy.lua")
               or (home and home ~= "") and (home .. "/.config/weft/policy.lua") or nil
  if cand then
    local f = io.open(cand, "rb")
    if f then f:close(); return cand, false end
  end
  return nil
end

-- lookup(t, section, world, dtype, bytes) -> backend, where ("all_reduce[2].bf16[1]")
-- or nil when the file says nothing for this call.
function M.lookup(t, section, world, dtype, bytes)
  if t == nil then return nil end
  local s = t[section]
  if s == nil then return nil end
  local by = s[world]
  local wk = world
  if by == nil then by = s["*"]; wk = "*" end
  if by == nil then return nil end
  local list = by[dtype]
  local dk = dtype
  if list == nil then list = by["*"]; dk = "*" end
  if list == nil then return nil end
  for i = 1, #list do
    local e = list[i]
    if e.upto == nil or bytes <= e.upto then
      return e.backend, section, wk, dk, i
    end
  end
  return nil
end

-- "all_reduce[2].bf16[1]" for what lookup returned
function M.where(section, wk, dk, i)
  return section .. key_str(wk) .. key_str(dk) .. "[" .. tostring(i) .. "]"
end

return M
