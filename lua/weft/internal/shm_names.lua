-- weft.internal.shm_names — weft's names in /dev/shm, by creator pid.
--
-- Every shared segment weft creates is named "/weft-<kind>-<creator pid>-<32
-- hex>" (src/host/shm_seg.c) and unlinked as soon as every rank has attached, so a
-- name only exists while a creation is in progress. A creator killed in that
-- window (SIGKILL, or the launcher's SIGTERM after another rank failed)
-- cannot unlink: weft-run calls remove_of(pid) for each rank it reaps, and
-- tests use of(pids) to check that a run of theirs left nothing. No libweft
-- needed (the launcher must work without the built library). Linux only.
local ffi = require("ffi")

local M = {}

M.DIR = "/dev/shm"

if not pcall(ffi.typeof, "weft_shmn_dirent") then
  ffi.cdef [[
  typedef struct {
    uint64_t d_ino; int64_t d_off; unsigned short d_reclen; unsigned char d_type;
    char d_name[256];
  } weft_shmn_dirent;
  ]]
end
pcall(ffi.cdef, "void *opendir(const char *name);")
pcall(ffi.cdef, "int closedir(void *dir);")
pcall(ffi.cdef, "int unlink(const char *path);")
-- readdir under a private name (others may declare it with another type)
pcall(ffi.cdef, "weft_shmn_dirent *weft_shmn_readdir(void *dir) __asm__(\"readdir\");")
local C = ffi.C

-- "weft-<letters>-<pid>-<32 hex>" -> pid, or nil when the name is not weft's.
function M.creator(name)
  local pid, hex = name:match("^weft%-%l+%-(%d+)%-(%x+)$")
  if not pid or #hex ~= 32 or hex:find("%u") then return nil end
  return tonumber(pid)
end

-- Names (without the directory) in M.DIR whose creator is one of pids
-- (a list or a set {[pid] = true}); every weft name when pids is nil.
function M.of(pids)
  local want
  if pids then
    want = {}
    for k, v in pairs(pids) do
      if v == true then want[tonumber(k)] = true else want[tonumber(v)] = true end
    end
  end
  local found = {}
  local d = C.opendir(M.DIR)
  if d == nil then return found end
  while true do
    local e = C.weft_shmn_readdir(d)
    if e == nil then break end
    local name = ffi.string(e.d_name)
    local pid = M.creator(name)
    if pid and (not want or want[pid]) then found[#found + 1] = name end
  end
  C.closedir(d)
  table.sort(found)
  return found
end

-- Unlinks the names created by pid (a process that has exited: reaped by
-- the caller, so its pid is not yet reused). Returns the names removed.
function M.remove_of(pid)
  local removed = {}
  for _, name in ipairs(M.of({ pid })) do
    if C.unlink(M.DIR .. "/" .. name) == 0 then removed[#removed + 1] = name end
  end
  return removed
end

return M
