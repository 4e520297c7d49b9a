-- weft.tools.repl.input — what the REPL process reads and the signals it watches:
-- POSIX through the FFI (poll, read/write, signalfd, the terminal's
-- foreground process group), rank 0's input (GNU readline through the FFI
-- when the terminal is a tty and libreadline.so.8 loads, else plain lines
-- from fd 0), Tab completion of names and fields, and Ctrl-C. lua/weft/tools/repl.lua
-- describes the behaviour; weft.tools.repl re-exports open_input, complete and
-- HISTORY_LINES.
local ffi = require("ffi")

local C = ffi.C

local M = {}

M.HISTORY_LINES = 1000

---------------------------------------------------------------- POSIX (FFI)
-- Private asm-renamed names: no clash with another module's cdefs.
if not pcall(function() return C.weft_repl_poll end) then
  ffi.cdef [[
  typedef struct { int fd; short events; short revents; } weft_repl_pollfd;
  typedef struct { unsigned long val[16]; } weft_repl_sigset;
  int weft_repl_poll(void *fds, unsigned long n, int timeout) __asm__("poll");
  long weft_repl_read(int fd, void *buf, unsigned long n) __asm__("read");
  long weft_repl_write(int fd, const void *buf, unsigned long n) __asm__("write");
  int weft_repl_open(const char *path, int flags, ...) __asm__("open");
  int weft_repl_close(int fd) __asm__("close");
  int weft_repl_dup(int fd) __asm__("dup");
  int weft_repl_isatty(int fd) __asm__("isatty");
  int weft_repl_tcgetpgrp(int fd) __asm__("tcgetpgrp");
  int weft_repl_tcsetpgrp(int fd, int pgrp) __asm__("tcsetpgrp");
  int weft_repl_tcflush(int fd, int queue) __asm__("tcflush");
  int weft_repl_getpgrp(void) __asm__("getpgrp");
  int weft_repl_getpid(void) __asm__("getpid");
  int weft_repl_kill(int pid, int sig) __asm__("kill");
  int weft_repl_sigemptyset(void *set) __asm__("sigemptyset");
  int weft_repl_sigaddset(void *set, int sig) __asm__("sigaddset");
  int weft_repl_sigprocmask(int how, const void *set, void *old) __asm__("sigprocmask");
  int weft_repl_signalfd(int fd, const void *mask, int flags) __asm__("signalfd");
  int weft_repl_gethostname(char *name, size_t len) __asm__("gethostname");
  void *weft_repl_fdopen(int fd, const char *mode) __asm__("fdopen");
  int weft_repl_fflush(void *f) __asm__("fflush");
  void *weft_repl_malloc(size_t n) __asm__("malloc");
  void weft_repl_free(void *p) __asm__("free");
  void *weft_repl_signal(int sig, void *handler) __asm__("signal");
  ]]
end

local SIGINT, SIGUSR1, SIGTSTP, SIGTTOU = 2, 10, 20, 22
local SIG_BLOCK, SIG_SETMASK = 0, 2
local O_RDWR, O_NONBLOCK, O_CLOEXEC = 2, 0x800, 0x80000
local POLLIN = 1
local EINTR = 4
local TCIFLUSH = 0


local function write_fd(fd, s)
  local p, left = ffi.cast("const char *", s), #s
  while left > 0 do
    local n = tonumber(C.weft_repl_write(fd, p, left))
    if n > 0 then
      p, left = p + n, left - n
    elseif n < 0 and ffi.errno() == EINTR then   -- retry
    else
      return false
    end
  end
  return true
end

local function sigset(list)
  local set = ffi.new("weft_repl_sigset")
  C.weft_repl_sigemptyset(set)
  for _, s in ipairs(list) do C.weft_repl_sigaddset(set, s) end
  return set
end

-- Blocks `sig` and returns a non-blocking signalfd that reports it (or nil).
local function signal_fd(sig)
  local set = sigset { sig }
  C.weft_repl_sigprocmask(SIG_BLOCK, set, nil)
  local fd = C.weft_repl_signalfd(-1, set, O_NONBLOCK + O_CLOEXEC)
  return fd >= 0 and fd or nil
end

local sigbuf = ffi.new("uint8_t[128]")
-- true when at least one signal was pending on the signalfd (all are consumed)
local function drain(fd)
  if not fd then return false end
  local got = false
  while tonumber(C.weft_repl_read(fd, sigbuf, 128)) == 128 do got = true end
  return got
end

local function hostname()
  local b = ffi.new("char[256]")
  if C.weft_repl_gethostname(b, 255) ~= 0 then return "?" end
  return ffi.string(b)
end

-- Runs f with SIGTTOU blocked: tcsetpgrp from a background process group.
local function without_ttou(f)
  local old = ffi.new("weft_repl_sigset")
  C.weft_repl_sigprocmask(SIG_BLOCK, sigset { SIGTTOU }, old)
  local r = f()
  C.weft_repl_sigprocmask(SIG_SETMASK, old, nil)
  return r
end

---------------------------------------------------------------- completion
local function fields_of(v, methods, into)
  local seen = 0
  while v ~= nil and seen < 4 do
    seen = seen + 1
    if type(v) == "table" and not methods then
      for k in pairs(v) do if type(k) == "string" then into[k] = true end end
    end
    local mt = getmetatable(v)
    local idx = type(mt) == "table" and rawget(mt, "__index") or nil
    if type(idx) ~= "table" then break end
    v = idx
    methods = false
  end
end

-- Completions of text ("wef", "weft.ini", "tp:all_") in env, sorted.
function M.complete(text, env)
  local base, sep, last = text:match("^(.-)([.:])([%w_]*)$")
  local obj, names = env, {}
  if base then
    if not base:match("^[%a_][%w_]*[%w_.]*$") then return {} end
    for part in base:gmatch("[^.]+") do
      local ok, v = pcall(function() return obj[part] end)
      if not ok or v == nil then return {} end
      obj = v
    end
  else
    last, base, sep = text, "", ""
  end
  fields_of(obj, sep == ":", names)
  local res = {}
  for k in pairs(names) do
    if k:sub(1, #last) == last and k:match("^[%a_][%w_]*$") and (sep ~= "" or not k:match("^_")) then
      res[#res + 1] = base .. sep .. k
    end
  end
  table.sort(res)
  return res
end

---------------------------------------------------------------- input
local Input = {}
Input.__index = Input

local rl_lib   -- readline, loaded once
local function load_readline()
  if rl_lib ~= nil then return rl_lib or nil end
  rl_lib = false
  if os.getenv("WEFT_REPL_READLINE") == "0" then return nil end
  local ok, lib = pcall(ffi.load, "readline")
  if not ok then ok, lib = pcall(ffi.load, "libreadline.so.8") end
  if not ok then return nil end
  pcall(ffi.cdef, [[
  typedef void (*weft_repl_rl_vcpfunc)(char *);
  typedef char *(*weft_repl_rl_compentry)(const char *, int);
  typedef char **(*weft_repl_rl_attempted)(const char *, int, int);
  char **rl_completion_matches(const char *text, weft_repl_rl_compentry entry);
  void rl_callback_handler_install(const char *prompt, weft_repl_rl_vcpfunc lhandler);
  void rl_callback_read_char(void);
  void rl_callback_handler_remove(void);
  void rl_replace_line(const char *text, int clear_undo);
  int rl_crlf(void);
  void using_history(void);
  void add_history(const char *line);
  int read_history(const char *filename);
  int write_history(const char *filename);
  int history_truncate_file(const char *filename, int nlines);
  extern int rl_catch_signals;
  extern int rl_point;
  extern int rl_end;
  void rl_redisplay(void);
  extern void *rl_outstream;
  extern const char *rl_readline_name;
  extern const char *rl_basic_word_break_characters;
  extern weft_repl_rl_attempted rl_attempted_completion_function;
  extern int rl_completion_append_character;
  extern int rl_attempted_completion_over;
  ]])
  local ok2 = pcall(function() return lib.rl_callback_read_char, lib.rl_outstream end)
  if not ok2 then return nil end
  rl_lib = lib
  return lib
end

local NAME = "weft"
local BREAKS = " \t\n\"\\'`@$><=;|&{(+-*/%^~#,)}[]"

-- opts: { env = (for completion), sigint = bool (Ctrl-C / SIGINT handling) }
function M.open_input(opts)
  opts = opts or {}
  local self = setmetatable({ fd = 0, buf = "", eof = false }, Input)
  self.tty = C.weft_repl_isatty(0) == 1
  self.out = 1
  -- Ctrl-C, or a SIGINT sent to weft-run (which passes it to rank 0 alone,
  -- on a terminal or not): read here, never LuaJIT's "interrupted!" anywhere
  if opts.sigint ~= false then self.sigfd = signal_fd(SIGINT) end
  if self.tty then
    local fd = C.weft_repl_open("/dev/tty", O_RDWR + O_CLOEXEC, ffi.cast("int", 0))
    if fd >= 0 then self.out = fd end
    -- under weft-run each rank has its own process group: take the terminal's
    -- foreground (reading from the background would stop us with SIGTTIN)
    local fg, me = C.weft_repl_tcgetpgrp(0), C.weft_repl_getpgrp()
    if fg > 0 and fg ~= me then
      if without_ttou(function() return C.weft_repl_tcsetpgrp(0, me) end) == 0 then
        self.old_fg = fg
        -- Ctrl-Z would stop this rank only, behind the shell's back
        C.weft_repl_signal(SIGTSTP, ffi.cast("void *", 1))
      end
    end
    local rl = load_readline()
    if rl then
      self.rl = rl
      local f = C.weft_repl_fdopen(C.weft_repl_dup(self.out), "w")
      if f ~= nil then rl.rl_outstream = f end
      rl.rl_catch_signals = 0
      rl.rl_readline_name = NAME
      rl.rl_basic_word_break_characters = BREAKS
      self.line_cb = ffi.cast("weft_repl_rl_vcpfunc", function(p)
        self.got = true
        if p == nil then
          self.line = nil
        else
          self.line = ffi.string(p)
          C.weft_repl_free(p)
        end
        rl.rl_callback_handler_remove()
      end)
      local env, matches, mi = opts.env, {}, 0
      self.comp_cb = ffi.cast("weft_repl_rl_compentry", function(text, state)
        if state == 0 then
          local ok, m = pcall(M.complete, ffi.string(text), env or _G)
          matches, mi = ok and m or {}, 0
        end
        mi = mi + 1
        local m = matches[mi]
        if not m then return nil end
        local p = ffi.cast("char *", C.weft_repl_malloc(#m + 1))
        ffi.copy(p, m)
        return p
      end)
      -- readline resets the append character before each completion: set it here
      self.attempt_cb = ffi.cast("weft_repl_rl_attempted", function(text)
        rl.rl_completion_append_character = 0
        rl.rl_attempted_completion_over = 1   -- no file names
        return rl.rl_completion_matches(text, self.comp_cb)
      end)
      rl.rl_attempted_completion_function = self.attempt_cb
      rl.using_history()
      local h = os.getenv("WEFT_REPL_HISTORY")
      if h == nil then
        local home = os.getenv("HOME")
        h = home and home ~= "" and (home .. "/.weft_repl_history") or ""
      end
      if h ~= "" then self.history = h; rl.read_history(h) end
    end
  end
  return self
end

function Input:write(s) write_fd(self.out, s) end

-- Next line without its newline; nil, "eof" | "interrupt".
function Input:read(prompt)
  if self.rl then return self:read_rl(prompt) end
  if self.tty then self:write(prompt) end
  local pfd = ffi.new("weft_repl_pollfd[2]")
  local buf = ffi.new("char[4096]")
  while true do
    local nl = self.buf:find("\n", 1, true)
    if nl then
      local line = self.buf:sub(1, nl - 1)
      self.buf = self.buf:sub(nl + 1)
      return line
    end
    if self.eof then
      if self.buf ~= "" then local l = self.buf; self.buf = ""; return l end
      if self.tty then self:write("\n") end
      return nil, "eof"
    end
    pfd[0].fd, pfd[0].events, pfd[0].revents = 0, POLLIN, 0
    pfd[1].fd, pfd[1].events, pfd[1].revents = self.sigfd or -1, POLLIN, 0
    local n = C.weft_repl_poll(pfd, 2, -1)
    if n < 0 and ffi.errno() ~= EINTR then self.eof = true end
    if n > 0 and pfd[1].revents ~= 0 then
      drain(self.sigfd)
      C.weft_repl_tcflush(0, TCIFLUSH)
      self.buf = ""
      self:write("\n")   -- the terminal (cooked mode) echoed "^C"
      return nil, "interrupt"
    end
    if n > 0 and pfd[0].revents ~= 0 then
      local got = tonumber(C.weft_repl_read(0, buf, 4096))
      if got > 0 then
        self.buf = self.buf .. ffi.string(buf, got)
      elseif got == 0 or ffi.errno() ~= EINTR then
        self.eof = true
      end
    end
  end
end

function Input:read_rl(prompt)
  local rl = self.rl
  self.got, self.line = false, nil
  rl.rl_callback_handler_install(prompt, self.line_cb)
  local pfd = ffi.new("weft_repl_pollfd[2]")
  while not self.got do
    pfd[0].fd, pfd[0].events, pfd[0].revents = 0, POLLIN, 0
    pfd[1].fd, pfd[1].events, pfd[1].revents = self.sigfd or -1, POLLIN, 0
    local n = C.weft_repl_poll(pfd, 2, -1)
    if n < 0 and ffi.errno() ~= EINTR then
      rl.rl_callback_handler_remove()
      return nil, "eof"
    end
    if n > 0 and pfd[1].revents ~= 0 then
      drain(self.sigfd)
      rl.rl_point = rl.rl_end        -- "^C" after the input, like a shell
      rl.rl_redisplay()
      self:write("^C")
      rl.rl_replace_line("", 0)
      rl.rl_callback_handler_remove()   -- may return the cursor to column 0
      self:write("\n")
      return nil, "interrupt"
    end
    if n > 0 and pfd[0].revents ~= 0 then rl.rl_callback_read_char() end
  end
  if self.line == nil then self:write("\n"); return nil, "eof" end
  return self.line
end
jit.off(Input.read_rl)

function Input:add_history(text)
  if self.rl and text:find("%S") then self.rl.add_history(text) end
end

function Input:close()
  if self.closed then return end
  self.closed = true
  if self.rl and self.history then
    self.rl.write_history(self.history)
    self.rl.history_truncate_file(self.history, M.HISTORY_LINES)
  end
  if self.old_fg then
    without_ttou(function() return C.weft_repl_tcsetpgrp(0, self.old_fg) end)
  end
end

---------------------------------------------------------------- for the other repl modules
M.SIGUSR1 = SIGUSR1
M.signal_fd, M.drain, M.hostname = signal_fd, drain, hostname

return M
