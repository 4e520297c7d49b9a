-- weft.tools.launcher — the logic behind scripts/weft-run: start N ranks of a Lua
-- script (or any command) with torchrun's environment, relay their output with
-- a rank prefix, and stop all of them when one fails or a signal arrives.
--
-- Environment given to each rank:
--   RANK              node_rank * nproc_per_node + local_rank (global rank)
--   WORLD_SIZE        nnodes * nproc_per_node
--   LOCAL_RANK        rank on this node, 0 .. nproc_per_node-1
--   LOCAL_WORLD_SIZE  nproc_per_node
--   MASTER_ADDR       --master-addr (default 127.0.0.1): where rank 0's store listens
--   MASTER_PORT       --master-port, or a free port found on MASTER_ADDR
--   WEFT_NNODES       --nnodes (number of nodes)
--   WEFT_NODE_RANK    --node-rank (index of this node)
--   LUA_PATH          <repo>/lua/?.lua;<repo>/lua/?/init.lua; then the old LUA_PATH
--
-- Process model: every rank is forked into its own process group (so a signal
-- reaches the whole tree a rank starts), with stdout/stderr on pipes and stdin
-- on /dev/null. The launcher blocks SIGINT/SIGTERM/SIGCHLD (and SIGHUP unless
-- it was ignored, as under nohup), reads them from a signalfd, and waits for
-- everything in one poll(): no busy loop, no signal handlers in Lua.
-- Each rank reaped has its pending /dev/shm names removed (weft.internal.shm_names):
-- a rank stopped while creating a segment cannot unlink it itself.
-- Linux only (signalfd, prctl); constants below are the generic Linux ABI.
local ffi = require("ffi")
local bit = require("bit")
local shm_names = require("weft.internal.shm_names")

local byte, concat, gsub, format = string.byte, table.concat, string.gsub, string.format

local M = {}

M.GRACE_FAILURE = 3   -- s between SIGTERM and SIGKILL when a rank failed / timeout
M.GRACE_SIGNAL = 5    -- s between a forwarded SIGINT/SIGTERM and SIGKILL
-- A second SIGINT/SIGTERM kills the ranks at once, unless it is the same
-- signal within this many s: a terminal's Ctrl-C reaches a wrapper script
-- (scripts/serve/start) and weft-run together, and the wrapper passes it on.
M.REPEAT_SIGNAL = 1
M.DRAIN = 2           -- s to keep reading pipes a rank's children hold after it exits
M.MAX_LINE = 16 * 1024 * 1024  -- a longer line without newline is split

---------------------------------------------------------------------------
-- POSIX through the FFI (type names are private so no other cdef can clash)
---------------------------------------------------------------------------
if not pcall(ffi.typeof, "weft_run_pollfd") then
  ffi.cdef [[
  typedef struct { int fd; short events; short revents; } weft_run_pollfd;
  typedef struct { unsigned long val[16]; } weft_run_sigset;
  typedef struct {
    uint32_t signo; int32_t err; int32_t code; uint32_t pid; uint32_t uid;
    int32_t fd; uint32_t tid; uint32_t band; uint32_t overrun; uint32_t trapno;
    int32_t status; int32_t int_; uint64_t ptr; uint64_t utime; uint64_t stime;
    uint64_t addr; uint8_t pad[48];
  } weft_run_sfd_siginfo;
  typedef struct { uint16_t family; uint16_t port; uint32_t addr; uint8_t zero[8]; } weft_run_sockaddr_in;
  ]]
end
ffi.cdef [[
int fork(void);
int execvp(const char *file, const char **argv);
void _exit(int status);
int pipe2(int *fds, int flags);
int dup2(int oldfd, int newfd);
int close(int fd);
int open(const char *path, int flags, ...);
int fcntl(int fd, int cmd, ...);
long read(int fd, void *buf, unsigned long n);
long write(int fd, const void *buf, unsigned long n);
int poll(void *fds, unsigned long nfds, int timeout);
int waitpid(int pid, int *status, int options);
int kill(int pid, int sig);
int weft_run_isatty(int fd) __asm__("isatty");
int weft_run_tcgetattr(int fd, void *t) __asm__("tcgetattr");
int weft_run_tcsetattr(int fd, int when, const void *t) __asm__("tcsetattr");
int weft_run_tcgetpgrp(int fd) __asm__("tcgetpgrp");
int weft_run_tcsetpgrp(int fd, int pgrp) __asm__("tcsetpgrp");
int weft_run_getpgrp(void) __asm__("getpgrp");
int setpgid(int pid, int pgid);
int getpid(void);
int getppid(void);
int prctl(int option, ...);
int setenv(const char *name, const char *value, int overwrite);
int sigemptyset(void *set);
int sigaddset(void *set, int sig);
int sigprocmask(int how, const void *set, void *old);
int signalfd(int fd, const void *mask, int flags);
void *signal(int sig, void *handler);
int socket(int domain, int type, int protocol);
int bind(int fd, const void *addr, uint32_t len);
int getsockname(int fd, void *addr, uint32_t *len);
int weft_run_setsockopt(int fd, int level, int name, const void *val, uint32_t len) __asm__("setsockopt");
int inet_pton(int af, const char *src, void *dst);
char *strerror(int errnum);
char *realpath(const char *path, char *resolved);
void free(void *p);
]]
local C = ffi.C
assert(ffi.sizeof("weft_run_sfd_siginfo") == 128 and ffi.sizeof("weft_run_sigset") == 128)

local SIGHUP, SIGINT, SIGKILL, SIGPIPE, SIGTERM, SIGCHLD, SIGTTOU = 1, 2, 9, 13, 15, 17, 22
local SIG_BLOCK, SIG_SETMASK = 0, 2
local O_RDONLY, O_NONBLOCK, O_CLOEXEC = 0, 0x800, 0x80000
local F_GETFD, F_GETFL, F_SETFL = 1, 3, 4
local POLLIN, POLLOUT, POLLERR, POLLHUP, POLLNVAL = 1, 4, 8, 16, 32
local WNOHANG, PR_SET_PDEATHSIG = 1, 1
local EINTR, EAGAIN, ESRCH = 4, 11, 3
local AF_INET, SOCK_STREAM = 2, 1
local SIG_DFL, SIG_IGN = ffi.cast("void *", 0), ffi.cast("void *", 1)

local SIGNAMES = { [1] = "SIGHUP", [2] = "SIGINT", [3] = "SIGQUIT", [4] = "SIGILL",
  [5] = "SIGTRAP", [6] = "SIGABRT", [7] = "SIGBUS", [8] = "SIGFPE", [9] = "SIGKILL",
  [10] = "SIGUSR1", [11] = "SIGSEGV", [12] = "SIGUSR2", [13] = "SIGPIPE",
  [14] = "SIGALRM", [15] = "SIGTERM", [24] = "SIGXCPU", [25] = "SIGXFSZ" }
M.SIGNAMES = SIGNAMES

-- struct pointers go through void *: an earlier cdef elsewhere in the process
-- (e.g. `struct timespec *`) wins over ours, and void * converts to either.
local function vp(x) return ffi.cast("void *", x) end
local function ul(x) return ffi.cast("unsigned long", x) end   -- variadic/fixed-safe
local function ci(x) return ffi.cast("int", x) end

local function strerror(e) return ffi.string(C.strerror(e)) end

local now_ns = require("weft.internal.clock").now_ns
local function now() return now_ns() * 1e-9 end   -- monotonic seconds
M.now = now

-- write everything, even to a non-blocking or slow fd; false once the reader is gone
local function write_all(fd, s)
  local p, left = ffi.cast("const char *", s), #s
  while left > 0 do
    local n = tonumber(C.write(fd, p, left))
    if n >= 0 then
      p, left = p + n, left - n
    else
      local e = ffi.errno()
      if e == EAGAIN then
        local pfd = ffi.new("weft_run_pollfd", fd, POLLOUT, 0)
        C.poll(vp(pfd), 1, 1000)
      elseif e ~= EINTR then
        return false
      end
    end
  end
  return true
end

local out_ok = { [1] = true, [2] = true }   -- stop writing to a closed stdout/stderr
local function emit(fd, s)
  if out_ok[fd] and not write_all(fd, s) then out_ok[fd] = false end
end
local say_name = "weft-run"   -- "weft-run[node1]" under --node-tag: several launchers share a terminal
local function say(fmt, ...) emit(2, say_name .. ": " .. format(fmt, ...) .. "\n") end

local function sigset(list)
  local set = ffi.new("weft_run_sigset")
  C.sigemptyset(vp(set))
  for _, s in ipairs(list) do C.sigaddset(vp(set), s) end
  return set
end

local function status_text(st)
  local sig = bit.band(st, 0x7f)
  if sig == 0 then return "exited with code " .. bit.band(bit.rshift(st, 8), 0xff) end
  return format("killed by signal %d (%s)", sig, SIGNAMES[sig] or "?")
end
-- exit code of the launcher for a rank's wait status (shell convention)
local function status_code(st)
  local sig = bit.band(st, 0x7f)
  if sig == 0 then return bit.band(bit.rshift(st, 8), 0xff) end
  return 128 + sig
end

-- A free TCP port on addr (bind to port 0, read it back). Falls back to the
-- wildcard address when addr is a host name or not local. With keep, the
-- socket stays bound (SO_REUSEADDR, never listening) and is returned too: a
-- reservation. The store's server (SO_REUSEADDR as well) binds the port
-- beside it, while other processes' bind(0) and connect() pass it by, so a
-- job started at the same moment cannot take the port between this probe
-- and rank 0's bind, nor after rank 0 closed its store while the job runs.
function M.free_port(addr, keep)
  local fd = C.socket(AF_INET, SOCK_STREAM + O_CLOEXEC, 0)
  if fd < 0 then return nil, "socket: " .. strerror(ffi.errno()) end
  if keep then C.weft_run_setsockopt(fd, 1, 2, ffi.new("int[1]", 1), 4) end  -- SOL_SOCKET, SO_REUSEADDR
  local sa = ffi.new("weft_run_sockaddr_in")
  sa.family = AF_INET
  local len = ffi.new("uint32_t[1]", ffi.sizeof(sa))
  local ok = addr and C.inet_pton(AF_INET, addr, vp(ffi.cast("char *", sa) + 4)) == 1
      and C.bind(fd, vp(sa), ffi.sizeof(sa)) == 0
  if not ok then
    sa.addr = 0
    if C.bind(fd, vp(sa), ffi.sizeof(sa)) ~= 0 then
      local e = ffi.errno(); C.close(fd)
      return nil, "bind: " .. strerror(e)
    end
  end
  local rc = C.getsockname(fd, vp(sa), len)
  local e = ffi.errno()
  if rc ~= 0 or not keep then C.close(fd) end
  if rc ~= 0 then return nil, "getsockname: " .. strerror(e) end
  local port = bit.bor(bit.lshift(bit.band(sa.port, 0xff), 8), bit.rshift(sa.port, 8))
  if keep then return port, fd end
  return port
end

function M.realpath(path)
  local p = C.realpath(path, nil)
  if p == nil then return nil end
  local s = ffi.string(p)
  C.free(p)
  return s
end

---------------------------------------------------------------------------
-- Options. To add an option (e.g. a later --repl: rank 0 interactive, the
-- others run chunks), add a row here (`standalone = true` when it needs no
-- script) and branch on opts.<key> in M.main; M.launch already takes per-rank
-- argv, env, prefix and stdin ("null"|"inherit"), so a mode only builds a plan.
-- kind: "int" | "number" | "string" | "flag"; min/max bound numbers.
---------------------------------------------------------------------------
M.OPTIONS = {
  { long = "nproc-per-node", short = "n", key = "nproc", kind = "int", min = 1, max = 4096, default = 1,
    meta = "N", help = "ranks to start on this node (default 1)" },
  { long = "nnodes", key = "nnodes", kind = "int", min = 1, max = 65536, default = 1,
    meta = "N", help = "number of nodes (default 1)" },
  { long = "node-rank", key = "node_rank", kind = "int", min = 0, default = 0,
    meta = "K", help = "index of this node, 0 .. nnodes-1 (default 0)" },
  { long = "master-addr", key = "master_addr", kind = "string", default = "127.0.0.1",
    meta = "A", help = "address of rank 0's store (default 127.0.0.1)" },
  { long = "master-port", key = "master_port", kind = "int", min = 1, max = 65535,
    meta = "P", help = "port of rank 0's store (default: a free port, held by weft-run until the job ends so no job started beside it takes it; required with --nnodes > 1)" },
  { long = "timeout", key = "timeout", kind = "number", min = 0, meta = "S",
    help = "wall-clock limit in seconds: stop all ranks and exit 124 when reached" },
  { long = "no-prefix", key = "no_prefix", kind = "flag",
    help = "relay output without the \"[rankN] \" prefix" },
  { long = "node-tag", key = "node_tag", kind = "string", meta = "T",
    help = "prefix lines with \"[T rankN] \" (e.g. the node's name; weft-sim-nodes sets it)" },
  { long = "repl", key = "repl", kind = "flag", standalone = true,
    help = "live REPL: rank 0 reads Lua chunks from stdin, each runs on every rank (script optional)" },
  { long = "help", short = "h", key = "help", kind = "flag", standalone = true,
    help = "show this help" },
}

function M.usage()
  local lines = {
    "usage: weft-run [options] script.lua [args...]",
    "       weft-run [options] -- command [args...]",
    "",
    "Starts nproc-per-node ranks of a Lua script (run with luajit, LUA_PATH",
    "extended with the repository's lua/ so `require \"weft\"` works) or of any",
    "command, and relays each line of their output prefixed with \"[rankN] \".",
    "A \"weft: warning: ...\" line several ranks print is shown once.",
    "",
    "options:",
  }
  for _, o in ipairs(M.OPTIONS) do
    local names = (o.short and ("-" .. o.short .. ", ") or "    ") .. "--" .. o.long
    if o.meta then names = names .. " " .. o.meta end
    lines[#lines + 1] = format("  %-28s %s", names, o.help)
  end
  for _, l in ipairs {
    "",
    "environment of each rank:",
    "  RANK              node_rank * nproc_per_node + local_rank",
    "  WORLD_SIZE        nnodes * nproc_per_node",
    "  LOCAL_RANK        rank on this node; LOCAL_WORLD_SIZE = nproc_per_node",
    "  MASTER_ADDR       --master-addr; MASTER_PORT = --master-port or a free port",
    "  WEFT_NNODES       --nnodes; WEFT_NODE_RANK = --node-rank",
    "  LUA_PATH          <repo>/lua/?.lua;<repo>/lua/?/init.lua; before the old one",
    "Ranks run in their own process groups with stdin on /dev/null. A script is",
    "run with $WEFT_LUAJIT (default: luajit from PATH).",
    "",
    "If a rank exits non-zero or dies by a signal, the others get SIGTERM, then",
    "SIGKILL after " .. M.GRACE_FAILURE .. " s; weft-run names that rank and exits with its code",
    "(128+N for signal N). SIGINT/SIGTERM are forwarded to every rank's process",
    "group, SIGKILL follows after " .. M.GRACE_SIGNAL .. " s (or at a second signal, other than the",
    "same one again within " .. M.REPEAT_SIGNAL .. " s); weft-run then exits 128+signal.",
    "With --repl, SIGINT goes to rank 0 alone, as Ctrl-C at its terminal does; after",
    "SIGTERM (or any end) the terminal's modes and foreground are given back as found.",
    "Exit 124: --timeout reached; 127: command not found; 2: bad usage.",
  } do lines[#lines + 1] = l end
  return concat(lines, "\n") .. "\n"
end

local function find_option(name, short)
  for _, o in ipairs(M.OPTIONS) do
    if (short and o.short == name) or (not short and o.long == name) then return o end
  end
end

local function convert(o, v, shown)
  if o.kind == "string" then
    if v == "" then return nil, shown .. " needs a non-empty value" end
    return v
  end
  -- an int is written in digits (tonumber takes "1e3" and " 5" too)
  local n = (o.kind ~= "int" or v:match("^%-?%d+$")) and tonumber(v) or nil
  if o.kind == "int" and (not n or n ~= math.floor(n)) then
    return nil, format("%s must be an integer (got '%s')", shown, v)
  end
  if not n or n ~= n then return nil, format("%s must be a number (got '%s')", shown, v) end
  if o.kind == "number" and o.min and n <= o.min then
    return nil, format("%s must be > %s (got '%s')", shown, o.min, v)
  end
  if o.kind == "int" and o.min and n < o.min then
    return nil, format("%s must be >= %d (got '%s')", shown, o.min, v)
  end
  if o.max and n > o.max then return nil, format("%s must be <= %d (got '%s')", shown, o.max, v) end
  return n
end

-- argv: array of strings (no arg[0]). Returns opts, or nil and a message.
-- opts.command: array to run (after --); opts.script + opts.args otherwise.
function M.parse_args(argv)
  local opts = {}
  for _, o in ipairs(M.OPTIONS) do opts[o.key] = o.default end
  local i = 1
  while i <= #argv do
    local a = argv[i]
    if a == "--" then
      opts.command = { unpack(argv, i + 1) }
      if #opts.command == 0 then return nil, "missing command after --" end
      break
    elseif a:sub(1, 2) == "--" then
      local name, val = a:match("^%-%-([^=]+)=(.*)$")
      name = (name or a:sub(3)):gsub("_", "-")   -- torchrun spells --nproc_per_node
      local o = find_option(name, false)
      if not o then return nil, "unknown option " .. a end
      if o.kind == "flag" then
        if val then return nil, "--" .. o.long .. " takes no value" end
        opts[o.key] = true
      else
        if not val then
          i = i + 1
          val = argv[i]
          if not val then return nil, "--" .. o.long .. " needs a value" end
        end
        local v, err = convert(o, val, "--" .. o.long)
        if err then return nil, err end
        opts[o.key] = v
      end
    elseif a:sub(1, 1) == "-" and #a > 1 then
      local o = find_option(a:sub(2, 2), true)
      if not o then return nil, "unknown option " .. a end
      local shown = "-" .. o.short .. "/--" .. o.long
      if o.kind == "flag" then
        if #a > 2 then return nil, "unknown option " .. a end
        opts[o.key] = true
      else
        local val = a:sub(3):gsub("^=", "")
        if val == "" then
          i = i + 1
          val = argv[i]
          if not val then return nil, shown .. " needs a value" end
        end
        local v, err = convert(o, val, shown)
        if err then return nil, err end
        opts[o.key] = v
      end
    else
      opts.script = a
      opts.args = { unpack(argv, i + 1) }
      break
    end
    i = i + 1
  end
  for _, o in ipairs(M.OPTIONS) do
    if o.standalone and opts[o.key] then return opts end
  end
  if not opts.script and not opts.command then
    return nil, "missing script: give script.lua [args...] or -- command [args...]"
  end
  if opts.node_rank >= opts.nnodes then
    return nil, format("--node-rank must be < --nnodes (got %d with %d nodes)",
                       opts.node_rank, opts.nnodes)
  end
  if opts.nnodes > 1 and not opts.master_port then
    return nil, "--master-port is required with --nnodes > 1 (every node must use the same port)"
  end
  if opts.script then
    local f = io.open(opts.script, "r")
    if not f then return nil, "cannot open script '" .. opts.script .. "'" end
    f:close()
  end
  return opts
end

---------------------------------------------------------------------------
-- Spawning
---------------------------------------------------------------------------
local function ensure_std_fds()
  -- a closed 0/1/2 would let pipe2() hand out that number and confuse dup2
  for fd = 0, 2 do
    if C.fcntl(fd, F_GETFD, ci(0)) < 0 then
      local nfd = C.open("/dev/null", fd == 0 and O_RDONLY or 1, ci(0))
      if nfd >= 0 and nfd ~= fd then C.dup2(nfd, fd); C.close(nfd) end
      if fd > 0 then out_ok[fd] = false end
    end
  end
end

local function new_pipe()
  local fds = ffi.new("int[2]")
  if C.pipe2(fds, O_CLOEXEC) ~= 0 then error("weft: launch: pipe2: " .. strerror(ffi.errno()), 0) end
  return fds[0], fds[1]
end

-- Forks one rank. r = {argv = {...}, env = {{k, v}, ...}, stdin = "null"|"inherit"}.
-- Returns pid, out_fd, err_fd; or nil, message when the command cannot be executed.
local function spawn(r, ctx)
  local anchor = {}   -- keep every C string alive until exec
  local argv = ffi.new("const char *[?]", #r.argv + 1)
  for i, s in ipairs(r.argv) do anchor[#anchor + 1] = s; argv[i - 1] = s end
  local out_r, out_w = new_pipe()
  local err_r, err_w = new_pipe()
  local st_r, st_w = new_pipe()     -- exec status: EOF = exec succeeded
  local null = -1
  if r.stdin ~= "inherit" then null = C.open("/dev/null", O_RDONLY + O_CLOEXEC, ci(0)) end
  local env = r.env
  local errbox = ffi.new("int[1]")
  local pid = C.fork()
  if pid == 0 then
    -- child: only system calls on data prepared above, then exec or _exit
    C.setpgid(0, 0)
    C.prctl(PR_SET_PDEATHSIG, ul(SIGKILL), ul(0), ul(0), ul(0))
    if C.getppid() ~= ctx.parent then C._exit(126) end   -- launcher already gone
    if null >= 0 then C.dup2(null, 0) end
    C.dup2(out_w, 1)
    C.dup2(err_w, 2)
    for _, kv in ipairs(env) do C.setenv(kv[1], kv[2], 1) end
    C.signal(SIGPIPE, ctx.pipe_ignored and SIG_IGN or SIG_DFL)
    C.signal(SIGINT, SIG_DFL)    -- forwarded signals must act even when the
    C.signal(SIGTERM, SIG_DFL)   -- launcher was started with them ignored (`&`)
    C.sigprocmask(SIG_SETMASK, vp(ctx.orig_mask), nil)
    C.execvp(argv[0], vp(argv))
    errbox[0] = ffi.errno()
    C.write(st_w, errbox, 4)
    C._exit(127)
  end
  local fork_errno = ffi.errno()
  C.close(out_w); C.close(err_w); C.close(st_w)
  if null >= 0 then C.close(null) end
  if pid < 0 then
    C.close(out_r); C.close(err_r); C.close(st_r)
    return nil, "fork: " .. strerror(fork_errno)
  end
  C.setpgid(pid, pid)   -- also here, so killpg works before the child runs
  local n
  repeat n = tonumber(C.read(st_r, errbox, 4)) until n >= 0 or ffi.errno() ~= EINTR
  C.close(st_r)
  if n == 4 then
    local stp = ffi.new("int[1]")
    C.waitpid(pid, stp, 0)
    C.close(out_r); C.close(err_r)
    return nil, format("cannot execute '%s': %s", r.argv[1], strerror(errbox[0]))
  end
  for _, fd in ipairs { out_r, err_r } do
    C.fcntl(fd, F_SETFL, ci(bit.bor(C.fcntl(fd, F_GETFL, ci(0)), O_NONBLOCK)))
  end
  return pid, out_r, err_r
end

---------------------------------------------------------------------------
-- Output relay: whole lines only, each batch in one write()
---------------------------------------------------------------------------
local function prefixed(block, prefix)   -- block ends with "\n"
  if prefix == "" then return block end
  return prefix .. (gsub(block:sub(1, -2), "\n", "\n" .. prefix)) .. "\n"
end

-- Whole lines of a stream, on their way out. With s.fold (a script's error
-- report starts with "<interpreter>: "), a rank's error report and what
-- follows it are held in s.report, so that launch() can print an error that
-- every rank raised once (fold_reports).
local function report_start(block, p)
  if block:sub(1, #p) == p then return 1 end
  local j = block:find("\n" .. p, 1, true)
  return j and j + 1
end

-- weft's own warnings ("weft: warning: ..." on stderr) are said once per
-- process, so a job of N ranks would print each N times: a line seen from
-- one rank already is dropped (s.said: the lines said so far, shared by
-- every rank's stderr of one launch).
local WARNING = "weft: warning: "
local function drop_said(s, block)
  if not s.said or not block:find(WARNING, 1, true) then return block end
  local keep = {}
  for line in block:gmatch("[^\n]*\n") do
    if line:sub(1, #WARNING) == WARNING then
      if not s.said[line] then s.said[line] = true; keep[#keep + 1] = line end
    else
      keep[#keep + 1] = line
    end
  end
  return concat(keep)
end

local function relay(s, block)
  if s.report then s.report[#s.report + 1] = block; return end
  block = drop_said(s, block)
  if block == "" then return end
  if s.fold then
    local i = report_start(block, s.fold)
    if i then
      if i > 1 then emit(s.out, prefixed(block:sub(1, i - 1), s.prefix)) end
      s.report = { block:sub(i) }
      return
    end
  end
  emit(s.out, prefixed(block, s.prefix))
end

local function stream_data(s, chunk)
  local last
  for i = #chunk, 1, -1 do
    if byte(chunk, i) == 10 then last = i; break end
  end
  if not last then
    s.pending[#s.pending + 1] = chunk
    s.plen = s.plen + #chunk
    if s.plen >= M.MAX_LINE then   -- bound memory on a newline-less flood
      emit(s.out, prefixed(concat(s.pending) .. "\n", s.prefix))
      s.pending, s.plen = {}, 0
    end
    return
  end
  local head = chunk:sub(1, last)
  if s.plen > 0 then head = concat(s.pending) .. head end
  s.pending, s.plen = {}, 0
  if last < #chunk then
    s.pending[1] = chunk:sub(last + 1)
    s.plen = #chunk - last
  end
  relay(s, head)
end

-- An unfinished last line is kept in s.partial until the rank's end is known:
-- a rank the launcher stopped may have been cut in the middle of a line (the
-- interpreter writes "luajit", ": ", the message in separate writes), and such
-- a half line is dropped rather than shown (finish_stream).
local function stream_close(s)
  if s.fd < 0 then return end
  if s.plen > 0 then s.partial = concat(s.pending) end
  s.pending, s.plen = {}, 0
  C.close(s.fd)
  s.fd = -1
end

local readbuf = ffi.new("char[65536]")
local function stream_read(s)
  while true do
    local n = tonumber(C.read(s.fd, readbuf, 65536))
    if n > 0 then stream_data(s, ffi.string(readbuf, n)); return end
    if n == 0 then stream_close(s); return end
    local e = ffi.errno()
    if e == EAGAIN then return end
    if e ~= EINTR then stream_close(s); return end
  end
end

local function finish_stream(s, cut)
  if s.partial and not cut then relay(s, s.partial .. "\n") end
  s.partial = nil
end

local ranks_text = require("weft.internal.show").ranks   -- "0-3", "0,2,5-7"
M.ranks_text = ranks_text

-- The held error reports: ranks whose message (the lines before "stack
-- traceback:") is the same print it once, "[ranks 0-3] ...", with one
-- traceback (the longest of them); a report of its own prints as it came.
local function fold_reports(ranks)
  local order, by = {}, {}
  for _, r in ipairs(ranks) do
    local s = r.err
    if s.report then
      local text = concat(s.report)
      local msg = text:match("^(.-\n)stack traceback:\n") or text
      local g = by[msg]
      if not g then g = { msg = msg, list = {} }; by[msg] = g; order[#order + 1] = g end
      g.list[#g.list + 1] = { r = r, text = text }
      s.report = nil
    end
  end
  for _, g in ipairs(order) do
    if #g.list == 1 then
      local e = g.list[1]
      emit(2, prefixed(e.text, e.r.err.prefix))
    else
      local nums, best = {}, g.list[1]
      for i, e in ipairs(g.list) do
        nums[i] = e.r.rank
        if #e.text > #best.text then best = e end
      end
      local tag = best.r.err.prefix:match("^%[(.-)rank%d+%] $") or ""   -- "node1 " with --node-tag
      local pre = best.r.err.prefix ~= "" and ("[" .. tag .. "ranks " .. ranks_text(nums) .. "] ") or ""
      emit(2, prefixed(g.msg, pre))
      local trace = best.text:sub(#g.msg + 1)
      if trace ~= "" then emit(2, prefixed(trace, best.r.err.prefix)) end
      say("ranks %s failed with this same error (one traceback shown, of rank %d)", ranks_text(nums), best.r.rank)
    end
  end
end

---------------------------------------------------------------------------
-- The terminal of an interactive session
---------------------------------------------------------------------------
-- An interactive rank 0 (the REPL) puts the terminal in raw mode (readline)
-- and takes its foreground; a rank stopped by a signal cannot give either
-- back. weft-run keeps what it found and restores it once the ranks are gone.
local TCSANOW = 0
local function tty_save()
  if C.weft_run_isatty(0) ~= 1 then return nil end
  local t = { modes = ffi.new("uint8_t[256]"), pgrp = C.weft_run_getpgrp() }   -- struct termios: 60 bytes
  if C.weft_run_tcgetattr(0, t.modes) ~= 0 then return nil end
  if C.weft_run_tcgetpgrp(0) ~= t.pgrp then t.pgrp = nil end   -- not ours to give back
  return t
end

local function tty_restore(t)
  -- from a background group (rank 0 held the foreground) the terminal calls
  -- raise SIGTTOU: blocked, they go through
  local old = ffi.new("weft_run_sigset")
  C.sigprocmask(SIG_BLOCK, vp(sigset { SIGTTOU }), vp(old))
  C.weft_run_tcsetattr(0, TCSANOW, t.modes)
  if t.pgrp and C.weft_run_tcgetpgrp(0) ~= t.pgrp then C.weft_run_tcsetpgrp(0, t.pgrp) end
  C.sigprocmask(SIG_SETMASK, vp(old), nil)
end

---------------------------------------------------------------------------
-- The launch loop
---------------------------------------------------------------------------
local function rank_list(list)
  local t = {}
  for i, r in ipairs(list) do t[i] = tostring(r.rank) end
  return concat(t, ", ")
end

-- spec = { ranks = { {rank=, argv=, env=, prefix=, stdin=}, ... },
--          timeout = seconds or nil, grace_failure =, grace_signal = }
-- Returns the launcher's exit code.
function M.launch(spec)
  assert(ffi.os == "Linux", "weft-run: Linux only")
  ensure_std_fds()
  local grace_failure = spec.grace_failure or M.GRACE_FAILURE
  local grace_signal = spec.grace_signal or M.GRACE_SIGNAL

  -- signals: block before the first fork, read them from a signalfd
  local handled = { SIGINT, SIGTERM, SIGCHLD }
  local old_hup = C.signal(SIGHUP, SIG_IGN)
  C.signal(SIGHUP, old_hup)
  if old_hup ~= SIG_IGN then handled[#handled + 1] = SIGHUP end   -- nohup: leave alone
  C.signal(SIGCHLD, SIG_DFL)   -- SIG_IGN would auto-reap and hide exit codes
  local ctx = { parent = C.getpid(), orig_mask = ffi.new("weft_run_sigset") }
  local old_pipe = C.signal(SIGPIPE, SIG_IGN)   -- a closed stdout must not kill us
  ctx.pipe_ignored = old_pipe == SIG_IGN
  local mask = sigset(handled)
  C.sigprocmask(SIG_BLOCK, vp(mask), vp(ctx.orig_mask))
  local sfd = C.signalfd(-1, vp(mask), O_NONBLOCK + O_CLOEXEC)
  if sfd < 0 then say("signalfd: %s", strerror(ffi.errno())); return 1 end
  local tty = spec.interactive and tty_save() or nil

  local ranks, live = {}, 0
  local first_failure, signal_got, signal_at, timed_out, launch_error
  local stopping, kill_at, drain_at = false, nil, nil
  local t0 = now()
  local timeout_at = spec.timeout and (t0 + spec.timeout) or nil

  local function group_alive(r)
    return r.pid and (not r.status or r.out.fd >= 0 or r.err.fd >= 0)
  end
  local function signal_all(sig)
    for _, r in ipairs(ranks) do
      if group_alive(r) then
        if C.kill(-r.pid, sig) ~= 0 and ffi.errno() == ESRCH and not r.status then
          C.kill(r.pid, sig)   -- group not formed yet (cannot happen after setpgid; cheap guard)
        end
      end
    end
  end
  local function begin_stop(sig, grace)
    if stopping then return end
    stopping = true
    signal_all(sig)
    kill_at = now() + grace
  end

  local said = {}   -- weft's warnings printed so far (drop_said)
  for _, rs in ipairs(spec.ranks) do
    local pid, out_fd, err_fd = spawn(rs, ctx)
    if not pid then
      launch_error = format("rank %d: %s", rs.rank, out_fd)
      begin_stop(SIGTERM, grace_failure)
      break
    end
    local prefix = rs.prefix or ""
    ranks[#ranks + 1] = { rank = rs.rank, pid = pid,
      out = { fd = out_fd, out = 1, prefix = prefix, pending = {}, plen = 0 },
      err = { fd = err_fd, out = 2, prefix = prefix, pending = {}, plen = 0, fold = rs.fold, said = said } }
    live = live + 1
  end

  local stp = ffi.new("int[1]")
  local function reap()
    for _, r in ipairs(ranks) do
      if not r.status then
        local p = C.waitpid(r.pid, stp, WNOHANG)
        if p == r.pid then
          r.status = stp[0]
          live = live - 1
          -- a rank stopped while creating a segment could not unlink its name
          shm_names.remove_of(r.pid)
          if r.status ~= 0 and not stopping and not first_failure then
            first_failure = r
            begin_stop(SIGTERM, grace_failure)
          end
        end
      end
    end
  end

  local nfds_max = 1 + 2 * #ranks
  local pfds = ffi.new("weft_run_pollfd[?]", nfds_max)
  local slots = {}
  local si = ffi.new("weft_run_sfd_siginfo[8]")
  local si_size = ffi.sizeof("weft_run_sfd_siginfo")

  while true do
    if live == 0 then
      local open = false
      for _, r in ipairs(ranks) do
        if r.out.fd >= 0 or r.err.fd >= 0 then open = true; break end
      end
      if not open then break end
      drain_at = drain_at or (now() + M.DRAIN)
    end
    -- one poll() for signals and every open pipe; sleep until the next deadline
    pfds[0].fd, pfds[0].events, pfds[0].revents = sfd, POLLIN, 0
    local n = 1
    for _, r in ipairs(ranks) do
      for _, s in ipairs { r.out, r.err } do
        if s.fd >= 0 then
          pfds[n].fd, pfds[n].events, pfds[n].revents = s.fd, POLLIN, 0
          slots[n] = s
          n = n + 1
        end
      end
    end
    local t = now()
    local next_at = kill_at
    if timeout_at and not stopping and (not next_at or timeout_at < next_at) then next_at = timeout_at end
    if drain_at and (not next_at or drain_at < next_at) then next_at = drain_at end
    local ms = next_at and math.max(0, math.ceil((next_at - t) * 1000)) or -1
    local rc = C.poll(vp(pfds), n, ms)
    if rc < 0 and ffi.errno() ~= EINTR then
      say("poll: %s", strerror(ffi.errno()))
      begin_stop(SIGKILL, 0)
    end

    if rc > 0 and pfds[0].revents ~= 0 then
      local got = tonumber(C.read(sfd, si, si_size * 8))
      local chld = false
      for k = 0, (got > 0 and math.floor(got / si_size) or 0) - 1 do
        local sig = si[k].signo
        if sig == SIGCHLD then
          chld = true
        elseif stopping and signal_got and sig == signal_got and now() - signal_at < M.REPEAT_SIGNAL then
          -- the same request once more (Ctrl-C seen by a wrapper that passes it on)
        elseif stopping and signal_got then
          -- a second SIGINT/SIGTERM: do not wait for the grace period
          say("received %s again: sending SIGKILL", SIGNAMES[sig] or ("signal " .. sig))
          signal_all(SIGKILL)
          kill_at = nil
        elseif sig == SIGINT and spec.interactive and not stopping and ranks[1] and not ranks[1].status then
          -- an interactive rank 0 (the REPL, on a terminal or reading a pipe)
          -- owns Ctrl-C: a SIGINT sent to weft-run (kill -INT, a job runner)
          -- is that Ctrl-C
          C.kill(-ranks[1].pid, SIGINT)
        else
          signal_at = signal_at or now()
          signal_got = signal_got or sig
          if stopping then
            signal_all(sig)
          else
            begin_stop(sig, grace_signal)
          end
        end
      end
      if chld then reap() end
    end
    if rc > 0 then
      for k = 1, n - 1 do
        if bit.band(pfds[k].revents, POLLIN + POLLHUP + POLLERR + POLLNVAL) ~= 0 then
          stream_read(slots[k])
        end
      end
    end

    t = now()
    if kill_at and t >= kill_at then
      local stuck = {}
      for _, r in ipairs(ranks) do if group_alive(r) then stuck[#stuck + 1] = r end end
      if #stuck > 0 then
        say("rank%s %s did not stop within %g s: sending SIGKILL", #stuck > 1 and "s" or "",
            rank_list(stuck), signal_got and grace_signal or grace_failure)
        signal_all(SIGKILL)
      end
      kill_at = nil
    end
    if timeout_at and not stopping and t >= timeout_at then
      timed_out = {}
      for _, r in ipairs(ranks) do if not r.status then timed_out[#timed_out + 1] = r end end
      begin_stop(SIGTERM, grace_failure)
    end
    if drain_at and t >= drain_at then   -- leaders gone; descendants hold the pipes
      if stopping then signal_all(SIGKILL) end
      for _, r in ipairs(ranks) do stream_close(r.out); stream_close(r.err) end
    end
  end

  C.close(sfd)
  C.sigprocmask(SIG_SETMASK, vp(ctx.orig_mask), nil)
  C.signal(SIGPIPE, old_pipe)
  if tty then
    tty_restore(tty)
    -- rank 0 may have left its prompt and a half-typed line: what follows starts a line
    if signal_got then emit(2, "\n") end
  end

  -- unfinished last lines (dropped for ranks the launcher stopped by a
  -- signal), then the held error reports, folded
  for _, r in ipairs(ranks) do
    local cut = stopping and r ~= first_failure and r.status ~= nil and bit.band(r.status, 0x7f) ~= 0
    finish_stream(r.out, cut)
    finish_stream(r.err, cut)
  end
  fold_reports(ranks)

  if launch_error then
    say("%s", launch_error)
    return 127
  elseif signal_got then
    say("received %s: stopped all %d ranks", SIGNAMES[signal_got] or ("signal " .. signal_got), #ranks)
    return 128 + signal_got
  elseif timed_out then
    say("timeout: --timeout %g s reached; stopped rank%s %s", spec.timeout,
        #timed_out == 1 and "" or "s", rank_list(timed_out))
    return 124
  elseif first_failure then
    say("rank %d %s", first_failure.rank, status_text(first_failure.status))
    return status_code(first_failure.status)
  end
  return 0
end

---------------------------------------------------------------------------
-- Entry
---------------------------------------------------------------------------
-- The folder weft's modules were loaded from: <repo>/lua in the source tree,
-- <prefix>/share/lua/5.1 once installed (make install, luarocks).
local function lua_dir()
  local src = debug.getinfo(1, "S").source
  local dir = src:match("^@(.*)/weft/[^@]*$") or (src:match("^@weft/") and ".") or "lua"
  return M.realpath(dir) or dir
end

-- The path of one of weft's tools (weft-run, weft-repl, ...): <root>/scripts
-- in the source tree, <root>/bin once installed.
function M.tool(root, name)
  local p = root .. "/scripts/" .. name
  local f = io.open(p, "rb")
  if f then f:close(); return p end
  return root .. "/bin/" .. name
end

-- Builds the per-rank launch spec from parsed options. root: repository root
-- or install prefix.
function M.plan(opts, root)
  local world = opts.nnodes * opts.nproc
  local dir = lua_dir()
  local lua_path = dir .. "/?.lua;" .. dir .. "/?/init.lua;"
  local old = os.getenv("LUA_PATH")
  lua_path = lua_path .. ((old and old ~= "") and old or ";")
  local argv
  if opts.command then
    argv = opts.command
  else
    argv = { os.getenv("WEFT_LUAJIT") or "luajit", opts.script, unpack(opts.args) }
  end
  local ranks = {}
  for lr = 0, opts.nproc - 1 do
    local rank = opts.node_rank * opts.nproc + lr
    ranks[#ranks + 1] = {
      rank = rank, argv = argv, stdin = "null",
      -- the interpreter's error report ("luajit: script.lua:3: ...") is held
      -- and folded with the other ranks' (only for scripts: a command's
      -- output is its own)
      fold = not opts.command and (argv[1] .. ": ") or nil,
      prefix = opts.no_prefix and "" or
               ("[" .. (opts.node_tag and (opts.node_tag .. " ") or "") .. "rank" .. rank .. "] "),
      env = {
        { "RANK", tostring(rank) }, { "WORLD_SIZE", tostring(world) },
        { "LOCAL_RANK", tostring(lr) }, { "LOCAL_WORLD_SIZE", tostring(opts.nproc) },
        { "MASTER_ADDR", opts.master_addr }, { "MASTER_PORT", tostring(opts.master_port) },
        { "WEFT_NNODES", tostring(opts.nnodes) }, { "WEFT_NODE_RANK", tostring(opts.node_rank) },
        { "LUA_PATH", lua_path },
      },
    }
  end
  return { ranks = ranks, timeout = opts.timeout }
end

-- argv: the script's `arg` table; root: repository root or install prefix
-- (the folder above the tool's own).
function M.main(argv, root)
  local list = {}
  for i = 1, #argv do list[i] = argv[i] end
  local opts, err = M.parse_args(list)
  if not opts then
    emit(2, "weft-run: " .. err .. "\nTry 'weft-run --help'.\n")
    return 2
  end
  if opts.help then emit(1, M.usage()); return 0 end
  root = M.realpath(root or ".") or root
  if opts.node_tag then say_name = "weft-run[" .. opts.node_tag .. "]" end
  if opts.repl then return require("weft.tools.repl").launch(opts, root, M) end
  local reserved
  if not opts.master_port then
    local port, fd_or_err = M.free_port(opts.master_addr, true)
    if not port then say("cannot find a free port on %s: %s", opts.master_addr, fd_or_err); return 1 end
    opts.master_port, reserved = port, fd_or_err
  end
  local ok, rc = pcall(M.launch, M.plan(opts, root))
  if reserved then C.close(reserved) end
  if not ok then error(rc, 0) end
  return rc
end

return M
