-- weft.store — TCP key-value rendezvous (src/store/store.c).
--   local s = store.open{host="127.0.0.1", port=29500, server=true, timeout_ms=30000,
--                        secret=nil, bind_host=nil}
--   s:set(k, v)  s:get(k [, timeout_ms])  s:try_get(k)  s:multi_get{keys} [, timeout_ms]
--   s:add(k, d)  s:check{keys}  s:compare_set(k, expected, desired)  s:delete(k)
--   s:wait({keys} [, timeout_ms])  s:num_keys()  s:close()   s.port  s.handle
--   s:register_rank(rank, world)  this handle speaks for `rank`: waits then fail
--                                 within ~200 ms naming a rank that died (store_live.c)
-- Values are Lua strings (any bytes). Returned strings are copies: the C
-- reply buffer is reused by the next call.
local ffi = require("ffi")
local lstring = require("weft.internal.hostmem").string -- refuses lengths a Lua string cannot hold (ffi.string wraps a 64-bit one)
local wffi = require("weft.internal.ffi")
local binding = require("weft.internal.binding")
local E = require("weft.internal.errors")

local C = wffi.C
local ffi_new, ffi_gc = ffi.new, ffi.gc
local tonumber, type, error = tonumber, type, error
local last_error = wffi.last_error

local M = {}

local Store = {}
Store.__index = Store

-- "weft: store <op>: <msg>"; level as weft.internal.errors.fail's (default 1), + 1 for this frame
local function fail(op, msg, level)
  E.fail((level or 1) + 1, "store " .. op, "%s", msg)
end

local function handle_of(self, op)
  local h = self.handle
  if h == nil then fail(op, "destroyed (the store was closed)", 3) end
  return h
end

local function check_key(op, key)
  if type(key) ~= "string" then fail(op, "key must be a string, got " .. type(key), 3) end
end

local check = binding.check -- check(rc, op): the C message names op already

-- A const char*[n] array of the keys; `keys` (the Lua table) anchors the strings.
local function key_array(op, keys)
  if type(keys) ~= "table" or #keys == 0 then fail(op, "expected a non-empty array of keys", 3) end
  local n = #keys
  local arr = ffi_new("const char *[?]", n)
  for i = 1, n do
    check_key(op, keys[i])
    arr[i - 1] = keys[i]
  end
  return arr, n
end

local function to_ms(op, v)
  if v == nil then return -1 end
  if type(v) ~= "number" then fail(op, "timeout_ms must be a number", 3) end
  return v
end

function M.open(opts)
  opts = opts or {}
  if type(opts) ~= "table" then error("weft: store open: expected an options table", 2) end
  local o = ffi_new("weft_store_opts")
  -- Strings stay referenced by `opts` during the call; C copies what it keeps.
  o.host = opts.host
  o.bind_host = opts.bind_host
  o.port = opts.port or 0
  o.is_server = opts.server and 1 or 0
  o.timeout_ms = opts.timeout_ms or 0
  o.secret = opts.secret
  local out = ffi_new("weft_store *[1]")
  if C.weft_store_open(o, out) ~= 0 then
    error("weft: " .. last_error(), 2)
  end
  local h = ffi_gc(out[0], C.weft_store_close)
  local port = ffi_new("int[1]")
  C.weft_store_port(h, port)
  return setmetatable({
    handle = h,
    port = port[0],
    host = opts.host or "127.0.0.1",
    server = opts.server and true or false,
    timeout_ms = opts.timeout_ms,
    -- out-parameters, allocated once per store
    _val = ffi_new("const void *[1]"),
    _len = ffi_new("size_t[1]"),
    _i64 = ffi_new("int64_t[1]"),
    _int = ffi_new("int[1]"),
  }, Store)
end

function Store:set(key, bytes)
  local h = handle_of(self, "set")
  check_key("set", key)
  if type(bytes) ~= "string" then fail("set", "value must be a string, got " .. type(bytes), 2) end
  check(C.weft_store_set(h, key, bytes, #bytes), "set")
end

function Store:get(key, timeout_ms)
  local h = handle_of(self, "get")
  check_key("get", key)
  check(C.weft_store_get(h, key, to_ms("get", timeout_ms), self._val, self._len), "get")
  return lstring(self._val[0], self._len[0], "store get")
end

-- Never blocks: nil when the key is not set.
function Store:try_get(key)
  local h = handle_of(self, "try_get")
  check_key("try_get", key)
  local rc = C.weft_store_get(h, key, 0, self._val, self._len)
  if rc == C.WEFT_EAGAIN then return nil end
  check(rc, "try_get")
  return lstring(self._val[0], self._len[0], "store try_get")
end

-- Waits for all keys; returns their values in order (one round trip).
function Store:multi_get(keys, timeout_ms)
  local h = handle_of(self, "multi_get")
  local arr, n = key_array("multi_get", keys)
  local vals, lens = ffi_new("const void *[?]", n), ffi_new("size_t[?]", n)
  check(C.weft_store_multi_get(h, arr, n, to_ms("multi_get", timeout_ms), vals, lens), "multi_get")
  local res = {}
  for i = 1, n do res[i] = lstring(vals[i - 1], lens[i - 1], "store multi_get") end
  return res
end

function Store:add(key, delta)
  local h = handle_of(self, "add")
  check_key("add", key)
  if type(delta) ~= "number" then fail("add", "delta must be a number", 2) end
  check(C.weft_store_add(h, key, delta, self._i64), "add")
  return tonumber(self._i64[0])
end

function Store:check(keys)
  local h = handle_of(self, "check")
  local arr, n = key_array("check", keys)
  check(C.weft_store_check(h, arr, n, self._int), "check")
  return self._int[0] ~= 0
end

-- Sets key to desired when its value equals expected (an absent key matches
-- expected nil/""); returns the value after the call ("" when still absent).
function Store:compare_set(key, expected, desired)
  local h = handle_of(self, "compare_set")
  check_key("compare_set", key)
  expected = expected or ""
  if type(expected) ~= "string" or type(desired) ~= "string" then
    fail("compare_set", "expected and desired must be strings", 2)
  end
  check(C.weft_store_compare_set(h, key, expected, #expected, desired, #desired,
                                 self._val, self._len), "compare_set")
  return lstring(self._val[0], self._len[0], "store compare_set")
end

function Store:delete(key)
  local h = handle_of(self, "delete")
  check_key("delete", key)
  check(C.weft_store_delete(h, key, self._int), "delete")
  return self._int[0] ~= 0
end

function Store:wait(keys, timeout_ms)
  local h = handle_of(self, "wait")
  local arr, n = key_array("wait", keys)
  check(C.weft_store_wait(h, arr, n, to_ms("wait", timeout_ms)), "wait")
end

function Store:num_keys()
  local h = handle_of(self, "num_keys")
  check(C.weft_store_num_keys(h, self._i64), "num_keys")
  return tonumber(self._i64[0])
end

function Store:register_rank(rank, world)
  local h = handle_of(self, "register_rank")
  check(C.weft_store_register_rank(h, rank, world), "register_rank")
end

-- Idempotent. Stops the server thread when this process hosts it. Cpu groups
-- made on this store keep its memory alive but fail with "store was closed".
function Store:close()
  local h = binding.release(self)
  if h ~= nil then C.weft_store_close(h) end
end
Store.destroy = Store.close

function Store:__tostring()
  return ("weft.store(%s:%s%s)"):format(self.host, tostring(self.port),
                                         self.handle == nil and ", closed" or "")
end

M.Store = Store
return M
