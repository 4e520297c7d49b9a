-- Two independent Lua VMs in one process (luaL_newstate through the FFI, as
-- nginx's lua_code_cache off does), then a second copy of weft in this VM
-- (package.loaded cleared): each keeps its own state in its own handles.
local ffi = require("ffi")
ffi.cdef [[
  typedef struct lua_State lua_State;
  lua_State *luaL_newstate(void);
  void luaL_openlibs(lua_State *L);
  int luaL_loadstring(lua_State *L, const char *s);
  int lua_pcall(lua_State *L, int nargs, int nresults, int errfunc);
  const char *lua_tolstring(lua_State *L, int idx, size_t *len);
  void lua_settop(lua_State *L, int idx);
  void lua_close(lua_State *L);
]]
local C = ffi.C

local function vm()
  local L = C.luaL_newstate()
  assert(L ~= nil, "luaL_newstate")
  C.luaL_openlibs(L)
  return L
end

-- runs chunk in L; returns its string result or raises with its error
local function run(L, chunk)
  if C.luaL_loadstring(L, chunk) ~= 0 or C.lua_pcall(L, 0, 1, 0) ~= 0 then
    local msg = ffi.string(C.lua_tolstring(L, -1, nil))
    C.lua_settop(L, 0)
    error("vm: " .. msg, 2)
  end
  local s = C.lua_tolstring(L, -1, nil)
  local r = s ~= nil and ffi.string(s) or "nil"
  C.lua_settop(L, 0)
  return r
end

local path = package.path
local setup = ("package.path = %q\n"):format(path) .. [[
  weft = require("weft")
  async = require("weft.async")
  store = require("weft.store")
  s = store.open { server = true, port = 0, timeout_ms = 5000 }
  c = store.open { host = "127.0.0.1", port = s.port, timeout_ms = 5000 }
  g = { unique_name = "vm", timeout_ms = 5000 }
  return tostring(s.port)
]]
local A, B = vm(), vm()
local pa, pb = run(A, setup), run(B, setup)
assert(pa ~= pb, "each VM has its own store server")
run(A, [[ s:set("who", "A") return "ok" ]])
run(B, [[ s:set("who", "B") return "ok" ]])
-- an async get in A, pending while B works, completed by A's own client
run(A, [[ local d = async._desc(g, "get"); d.kind = async.KINDS.STORE_GET; d.comm = s.handle
          d.key = "later"; d.timeout_ms = 5000
          h = async._submit(g, "get", nil, function(hh) local p, _, _, n = async.result_bytes(hh)
            return require("ffi").string(p, n) end)
          return tostring(h:test()) ]])
assert(run(B, [[ return c:get("who") ]]) == "B", "B sees its own store")
run(A, [[ c:set("later", "from A") return "ok" ]])
assert(run(A, [[ return h:wait() ]]) == "from A", "A's async get")
assert(run(A, [[ return c:get("who") ]]) == "A", "A sees its own store")
assert(run(B, [[ return tostring(c:try_get("later")) ]]) == "nil", "B's store never saw A's key")
run(A, [[ async.close(g); c:close(); s:close() return "ok" ]])
C.lua_close(A)
-- B still works after A is gone (nothing process-global was torn down)
assert(run(B, [[ s:set("after", "1") return c:get("after") ]]) == "1", "B after A closed")
run(B, [[ c:close(); s:close() return "ok" ]])
C.lua_close(B)
print("OK two VMs")

-- a second copy of weft in this VM
local store1 = require("weft.store")
local s1 = store1.open { server = true, port = 0, timeout_ms = 5000 }
s1:set("k", "first")
local dist1 = require("weft.dist")
for k in pairs(package.loaded) do if k:match("^weft") then package.loaded[k] = nil end end
local weft2 = require("weft")
local store2 = require("weft.store")
assert(store2 ~= store1, "a fresh module")
local s2 = store2.open { server = true, port = 0, timeout_ms = 5000 }
s2:set("k", "second")
assert(s1:get("k") == "first" and s2:get("k") == "second", "both copies work independently")
assert(require("weft.dist") ~= dist1 and not weft2.is_initialized(), "separate dist state")
s1:close(); s2:close()
print("OK second copy")
