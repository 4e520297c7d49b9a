-- `require("weft")` must touch no CUDA, start no thread and open no socket
-- (nginx loads it in the master before fork). Prints a JSON-ish line.
local ffi = require("ffi")
ffi.cdef [[ long readlink(const char *path, char *buf, unsigned long size); int getpid(void); ]]
local function sockets()
  local pid = ffi.C.getpid()
  local list = {}
  local p = io.popen("ls /proc/" .. pid .. "/fd")
  local buf = ffi.new("char[256]")
  for fd in p:lines() do
    local n = ffi.C.readlink(("/proc/%d/fd/%s"):format(pid, fd), buf, 255)
    if n > 0 then
      local target = ffi.string(buf, n)
      if target:find("^socket:") then list[#list + 1] = fd .. "->" .. target end
    end
  end
  p:close()
  return list
end
local function tasks()
  local pid = ffi.C.getpid()
  local n = 0
  local p = io.popen("ls /proc/" .. pid .. "/task")
  for _ in p:lines() do n = n + 1 end
  p:close()
  return n
end
local before_t, before_s = tasks(), #sockets()
local weft = require("weft")
-- the submodules a serving process loads up front, too
require("weft.async"); require("weft.store"); require("weft.cpugroup"); require("weft.tensor")
require("weft.serialize"); require("weft.topology"); require("weft.policy")
local after_t, s = tasks(), sockets()
local cuda_loaded = package.loaded["weft.cuda"] ~= nil
print(("tasks_before=%d tasks_after=%d sockets_before=%d sockets_after=%d cuda_module=%s initialized=%s")
      :format(before_t, after_t, before_s, #s, tostring(cuda_loaded), tostring(weft.is_initialized())))
