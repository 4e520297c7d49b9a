-- weft.repl — the live REPL: scripts/weft-repl (one process) and
-- `weft-run -n N --repl` (rank 0 interactive, every chunk run on every rank).
--
-- Input (rank 0): GNU readline through the FFI when the terminal is a tty and
-- libreadline.so.8 loads (line editing, history in $WEFT_REPL_HISTORY, default
-- ~/.weft_repl_history, "" = none; Tab completes names and fields); otherwise
-- plain lines from fd 0 (no prompts when stdin is not a tty: scripted use).
-- Why the FFI: libreadline8 is part of every Debian/Ubuntu base system (bash
-- needs it), while Debian's lua-readline is a PUC-Lua C module that is not
-- installed here and rlwrap is absent; the callback interface lets one poll()
-- watch the terminal and a signalfd for Ctrl-C. WEFT_REPL_READLINE=0 forces
-- plain input. Under weft-run each rank has its own process group, so rank 0
-- makes its group the terminal's foreground (and gives it back on exit);
-- Ctrl-Z is ignored there, Ctrl-\ kills rank 0 and with it the session.
-- Chunks: incomplete input continues with ">> " (the load error ends in
-- near '<eof>'); "=expr" and bare expressions print their values; top-level
-- `local` declarations become fields of the REPL environment, so they persist
-- from one chunk to the next (one environment per process; `weft`, `rank`,
-- `world_size` are predefined there, and `_G` is that environment).
--
-- Several ranks (weft-run --repl): rank 0 reads a chunk, sends it to the other
-- ranks (weft.mq shared-memory broadcaster when all ranks are on one node,
-- else point-to-point messages of the REPL's own cpu group), runs it, and
-- collects every rank's answer (output printed by the chunk, values or error)
-- through the cpu group, printed as "[rank k] ...". The REPL has its own store
-- (rank 0, port $WEFT_REPL_PORT, set by weft-run) and cpu group, so chunks may
-- init, shut down or break weft's groups without touching the session.
--
-- Bounds: every chunk runs under a deadline, the REPL timeout (:timeout MS;
-- default $WEFT_TIMEOUT_MS or 60 s, the group timeout): a count hook raises
-- "interrupted" in a chunk still running after it (chunks are compiled with
-- the JIT off so the hook also fires in tight loops). Rank 0 waits for answers
-- until the deadline plus GRACE_MS; a rank that does not answer (stuck inside
-- C code, where no hook runs) is reported and left out of later chunks until
-- its late answer arrives; the session goes on with the others. :quit with a
-- rank still stuck ends the session with a message and exit code 1, and
-- weft-run then stops that rank. Chunk code runs interpreted (JIT off for the
-- chunk and the functions it defines; weft's own functions still compile).
-- A chunk that breaks a weft group on some ranks (a collective one rank
-- skipped times out on the others, naming it) leaves the REPL usable:
-- weft.shutdown() then weft.init() on every rank builds the world again.
-- A rank that dies (a crash, a signal) ends the session: weft-run stops the
-- others, as for any script. Ctrl-C (tty): clears the input line at the prompt; while a chunk runs it
-- interrupts the chunk on rank 0 and, through SIGUSR1, on the ranks of this
-- node that have not answered. Ctrl-D or :quit ends every rank cleanly
-- (weft.shutdown() when the chunks initialized weft on every rank).
local ffi = require "ffi"

local concat, format = table.concat, string.format
local C = ffi.C

local M = {}

M.DEFAULT_TIMEOUT_MS = 60000
M.GRACE_MS = 2000        -- answers may arrive this long after the chunk deadline
M.HOOK_COUNT = 10000     -- VM instructions between deadline/interrupt checks
M.MAX_OUTPUT = 65536     -- bytes of printed output kept per rank and chunk
M.SHOW_ITEMS = 16        -- table entries shown
M.SHOW_DEPTH = 3         -- nested tables shown
M.SHOW_STRING = 200      -- characters of a string inside a table
M.HISTORY_LINES = 1000
M.MQ_CHUNK_BYTES = 65536
M.MQ_CHUNKS = 8

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

local now_ms = require("weft.clock").now_ms
M.now_ms = now_ms

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

---------------------------------------------------------------- ranks as text
-- "0-3", "0,2,5-7"
function M.ranks_str(list)
  local t, i = {}, 1
  while i <= #list do
    local j = i
    while list[j + 1] == list[j] + 1 do j = j + 1 end
    t[#t + 1] = j > i + 1 and (list[i] .. "-" .. list[j]) or
                (j == i + 1 and (list[i] .. "," .. list[j]) or tostring(list[i]))
    i = j + 1
  end
  return concat(t, ",")
end

-- "0,2,5-7" -> {0,2,5,6,7} (sorted, unique) or nil, message
function M.parse_ranks(s, world)
  local set, list = {}, {}
  for part in s:gmatch("[^,%s]+") do
    local a, b = part:match("^(%d+)%-(%d+)$")
    if not a then a = part:match("^(%d+)$"); b = a end
    if not a then return nil, "not a rank list: '" .. part .. "' (use e.g. 0,2 or 1-3)" end
    a, b = tonumber(a), tonumber(b)
    if a > b or b >= world then
      return nil, format("rank %s outside 0..%d", part, world - 1)
    end
    for r = a, b do set[r] = true end
  end
  for r = 0, world - 1 do if set[r] then list[#list + 1] = r end end
  if #list == 0 then return nil, "empty rank list" end
  return list
end

---------------------------------------------------------------- chunks
local KEYWORDS = {}
for w in ([[and break do else elseif end false for function goto if in local nil not or
            repeat return then true until while]]):gmatch("%a+") do KEYWORDS[w] = true end

-- Tokens of Lua source as { kind, text, s = start, e = end }, comments and
-- spaces dropped; nil when the text cannot be lexed (unfinished string...).
local function lex(src)
  local toks, i, n = {}, 1, #src
  local find, match, sub = string.find, string.match, string.sub
  while i <= n do
    local c = sub(src, i, i)
    if match(c, "%s") then
      i = i + 1
    elseif sub(src, i, i + 1) == "--" then
      local eq = match(src, "^%[(=*)%[", i + 2)
      if eq then
        local close = "]" .. eq .. "]"
        local e = find(src, close, i + 4 + #eq, true)
        if not e then return nil end
        i = e + #close
      else
        local e = find(src, "\n", i, true)
        i = e and e + 1 or n + 1
      end
    elseif c == '"' or c == "'" then
      local j = i + 1
      while true do
        local d = sub(src, j, j)
        if d == "" or d == "\n" then return nil end
        if d == "\\" then j = j + 2 elseif d == c then break else j = j + 1 end
      end
      toks[#toks + 1] = { "str", s = i, e = j }
      i = j + 1
    elseif c == "[" and match(src, "^%[=*%[", i) then
      local eq = match(src, "^%[(=*)%[", i)
      local close = "]" .. eq .. "]"
      local e = find(src, close, i + #eq + 2, true)
      if not e then return nil end
      toks[#toks + 1] = { "str", s = i, e = e + #close - 1 }
      i = e + #close
    elseif match(c, "[%a_]") then
      local w = match(src, "^[%w_]+", i)
      toks[#toks + 1] = { "name", w, s = i, e = i + #w - 1 }
      i = i + #w
    elseif match(c, "%d") or (c == "." and match(sub(src, i + 1, i + 1), "%d")) then
      local j = i + #match(src, "^[%w_.]+", i)
      if match(sub(src, j - 1, j - 1), "[eEpP]") and match(sub(src, j, j), "[+-]") then
        j = j + 1 + #match(src, "^[%w_.]*", j + 1)
      end
      toks[#toks + 1] = { "num", s = i, e = j - 1 }
      i = j
    else
      local p = match(src, "^%.%.%.", i) or match(src, "^[=~<>]=", i) or match(src, "^%.%.", i)
                or match(src, "^::", i) or c
      toks[#toks + 1] = { "op", p, s = i, e = i + #p - 1 }
      i = i + #p
    end
  end
  return toks
end

local OPENS = { ["function"] = true, ["do"] = true, ["if"] = true, ["repeat"] = true }
local CLOSES = { ["end"] = true, ["until"] = true }

-- Rewrites top-level `local` declarations into assignments to the chunk's
-- environment, so they outlive the chunk: `local x, y = 1` -> `x, y = 1`,
-- `local z` -> `z = nil`, `local function f` -> `function f`. Nested locals
-- are untouched. Returns the source unchanged when it cannot be lexed.
function M.globalize_locals(src)
  local toks = lex(src)
  if not toks then return src end
  local depth, edits = 0, {}
  for k, t in ipairs(toks) do
    if t[1] == "name" then
      local w = t[2]
      if w == "local" and depth == 0 then
        local nx = toks[k + 1]
        if nx and nx[2] == "function" then
          edits[#edits + 1] = { t.s, t.e, "" }
        elseif nx and nx[1] == "name" and not KEYWORDS[nx[2]] then
          local j = k + 1
          while toks[j + 1] and toks[j + 1][2] == "," and toks[j + 2] and toks[j + 2][1] == "name" do
            j = j + 2
          end
          edits[#edits + 1] = { t.s, t.e, "" }
          local after = toks[j + 1]
          if not (after and after[1] == "op" and after[2] == "=") then
            edits[#edits + 1] = { toks[j].e + 1, toks[j].e, " = nil" }
          end
        end
      elseif OPENS[w] then
        depth = depth + 1
      elseif CLOSES[w] then
        depth = depth - 1
      end
    end
  end
  for i = #edits, 1, -1 do
    local e = edits[i]
    src = src:sub(1, e[1] - 1) .. e[3] .. src:sub(e[2] + 1)
  end
  return src
end

local function incomplete(err)
  return err ~= nil and err:find("near '<eof>'$") ~= nil
end

-- Decides what typed text means. Returns
--   "expr", code     (values are printed)      "stmt", code
--   "incomplete"     (ask for more lines)       "error", message (syntax error)
-- An expression's values are packed by the function passed as the chunk's
-- vararg, so a call in it is no tail call (error positions stay: stdin:1:).
local function expr_code(e, chunkname)
  local code = "local __repl_pack = ...; return __repl_pack(" .. e .. "\n)"
  if loadstring(code, chunkname) then return code end
  return "return " .. e
end

function M.prepare(text, chunkname)
  chunkname = chunkname or "=stdin"
  if text:sub(1, 1) == "=" then
    local f, err = loadstring("return " .. text:sub(2), chunkname)
    if f then return "expr", expr_code(text:sub(2), chunkname) end
    if incomplete(err) then return "incomplete" end
    return "error", err
  end
  if loadstring("return " .. text, chunkname) then return "expr", expr_code(text, chunkname) end
  local f, err = loadstring(text, chunkname)
  if not f then
    if incomplete(err) then return "incomplete" end
    return "error", err
  end
  local g = M.globalize_locals(text)
  if g ~= text and loadstring(g, chunkname) then return "stmt", g end
  return "stmt", text
end

---------------------------------------------------------------- showing values
local function quote(s)
  if #s > M.SHOW_STRING then s = s:sub(1, M.SHOW_STRING) .. "..." end
  return (format("%q", s):gsub("\\\n", "\\n"))
end

local function key_str(k)
  if type(k) == "string" and k:match("^[%a_][%w_]*$") and not KEYWORDS[k] then return k end
  if type(k) == "string" then return "[" .. quote(k) .. "]" end
  return "[" .. tostring(k) .. "]"
end

local show
local function show_table(t, depth, seen)
  if seen[t] then return "<cycle>" end
  if depth >= M.SHOW_DEPTH then return "{...}" end
  seen[t] = true
  local parts, n, shown = {}, 0, 0
  local len = #t
  for i = 1, len do
    n = n + 1
    if shown < M.SHOW_ITEMS then parts[#parts + 1] = show(t[i], depth + 1, seen); shown = shown + 1 end
  end
  local keys = {}
  for k in pairs(t) do
    if not (type(k) == "number" and k >= 1 and k <= len and k % 1 == 0) then keys[#keys + 1] = k end
  end
  table.sort(keys, function(a, b)
    local ta, tb = type(a), type(b)
    if ta ~= tb then return ta < tb end
    if ta == "number" or ta == "string" then return a < b end
    return tostring(a) < tostring(b)
  end)
  for _, k in ipairs(keys) do
    n = n + 1
    if shown < M.SHOW_ITEMS then
      parts[#parts + 1] = key_str(k) .. " = " .. show(t[k], depth + 1, seen)
      shown = shown + 1
    end
  end
  seen[t] = nil
  if n > shown then parts[#parts + 1] = format("... (%d more)", n - shown) end
  return "{" .. concat(parts, ", ") .. "}"
end

-- One value as text: strings raw at the top level and quoted inside tables;
-- values with __tostring (tensors, groups) through it; tables briefly.
function show(v, depth, seen)
  local tv = type(v)
  if tv == "string" then return depth == 0 and v or quote(v) end
  if tv == "table" then
    local mt = getmetatable(v)
    if type(mt) == "table" and mt.__tostring then
      local ok, s = pcall(tostring, v)
      return ok and tostring(s) or ("<__tostring failed: " .. tostring(s) .. ">")
    end
    return show_table(v, depth, seen)
  end
  return tostring(v)
end

function M.show(v) return show(v, 0, {}) end

-- values v[i..j] separated by tabs, like print
function M.show_values(v, i, j)
  local parts = {}
  for k = i, j do parts[#parts + 1] = show(v[k], 0, {}) end
  return concat(parts, "\t")
end

---------------------------------------------------------------- environment
local function pack(...) return { n = select("#", ...), ... } end

-- ctx: { rank=, world=, capture=bool, ... } -> the REPL environment
function M.new_env(ctx)
  local env = setmetatable({}, { __index = _G })
  env._G = env
  env.rank = ctx.rank or 0
  env.world_size = ctx.world or 1
  local ok, weft = pcall(require, "weft")
  if ok then env.weft = weft else ctx.weft_error = weft end

  -- printed output of a chunk is kept and sent with its answer
  local function emit(s)
    if not ctx.capturing then io.stdout:write(s); io.stdout:flush(); return end
    if ctx.outlen >= M.MAX_OUTPUT then ctx.outcut = true; return end
    if ctx.outlen + #s > M.MAX_OUTPUT then
      s = s:sub(1, M.MAX_OUTPUT - ctx.outlen)
      ctx.outcut = true
    end
    ctx.out[#ctx.out + 1] = s
    ctx.outlen = ctx.outlen + #s
  end
  ctx.emit = emit
  if ctx.capture then
    env.print = function(...)
      local n = select("#", ...)
      local parts = {}
      for i = 1, n do parts[i] = tostring((select(i, ...))) end
      emit(concat(parts, "\t") .. "\n")
    end
    env.io = setmetatable({
      write = function(...)
        for i = 1, select("#", ...) do
          local v = select(i, ...)
          emit(type(v) == "number" and format("%.14g", v) or tostring(v))
        end
        return io.stdout
      end,
    }, { __index = io })
    env.os = setmetatable({
      exit = function()
        error("os.exit would end this rank only; end the session with :quit or Ctrl-D", 2)
      end,
    }, { __index = os })
  end
  return env
end

---------------------------------------------------------------- running a chunk
local PACKED = {}
local function packer(...) return { n = select("#", ...), [PACKED] = true, ... } end
local function err_text(e)
  if type(e) == "string" then return e end
  return show(e, 0, {})
end
local function keep(e) return e end   -- xpcall handler: no work while the hook may fire

-- Runs code in ctx.env with a deadline (ms from now; nil = none) and ctx.sigfd
-- (a signalfd that interrupts). Returns { ok=, vals=, err=, out=, cut=, ms= }.
function M.execute(ctx, code, chunkname, deadline_ms)
  local t0 = now_ms()
  local rec = { rank = ctx.rank }
  local fn, cerr = loadstring(code, chunkname or "=stdin")
  if not fn then rec.err = cerr; rec.out = ""; rec.ms = 0; return rec end
  setfenv(fn, ctx.env)
  jit.off(fn, true)   -- compiled loops never call hooks
  ctx.out, ctx.outlen, ctx.outcut, ctx.capturing = {}, 0, false, ctx.capture
  local deadline = deadline_ms and (t0 + deadline_ms)
  local sigfd = ctx.sigfd
  local hook
  if deadline or sigfd then
    local fired
    local co, base = coroutine.running(), 2
    while debug.getinfo(base, "l") do base = base + 1 end
    base = base - 1   -- frames from execute down
    hook = function()
      if not fired then
        if sigfd and drain(sigfd) then
          fired = "interrupted (Ctrl-C)"
          ctx.interrupted = true
        elseif deadline and now_ms() >= deadline then
          fired = format("interrupted: still running after %d ms (the REPL timeout; :timeout MS changes it)",
                         deadline_ms)
        end
        if fired then debug.sethook(hook, "", 1) end   -- keep raising past user pcalls
      end
      if fired then
        -- raise only inside the chunk: at least execute + xpcall + chunk
        -- frames deep (once back in execute the chunk is over)
        local info = debug.getinfo(2, "f")
        if not info or info.func == keep then return end
        if coroutine.running() ~= co then error(fired, 2) end   -- LuaJIT: one hook for all
        local d = 3
        while debug.getinfo(d, "l") do d = d + 1 end
        if d - 2 < base + 2 then return end
        error(fired, 2)
      end
    end
    debug.sethook(hook, "", M.HOOK_COUNT)
  end
  local r = pack(xpcall(fn, keep, packer))
  if hook then debug.sethook() end
  if r[1] and r.n == 2 and type(r[2]) == "table" and r[2][PACKED] then
    local v = r[2]
    r = { n = v.n + 1, true, unpack(v, 1, v.n) }
  end
  ctx.capturing = false
  rec.ms = now_ms() - t0
  if r[1] then
    if r.n > 1 then
      local ok, s = pcall(M.show_values, r, 2, r.n)
      rec.vals = ok and s or ("<cannot show the values: " .. tostring(s) .. ">")
    end
    rec.ok = true
  else
    rec.err = err_text(r[2])
  end
  rec.out, rec.cut = concat(ctx.out), ctx.outcut or nil
  ctx.out = {}
  return rec
end
jit.off(M.execute)

-- Lines of one answer for the console; prefix "" (one rank) or "[rank k] ".
function M.format_answer(rec, prefix, note)
  local lines = {}
  local p = prefix .. (note or "")
  local out = rec.out or ""
  if out ~= "" then
    if out:sub(-1) ~= "\n" then out = out .. "\n" end
    for l in out:gmatch("(.-)\n") do lines[#lines + 1] = p .. l end
  end
  if rec.cut then lines[#lines + 1] = p .. format("(output cut at %d bytes)", M.MAX_OUTPUT) end
  if note and #lines == 0 and not rec.err and not rec.vals then lines[1] = p .. "done" end
  if rec.err then
    local first = true
    for l in (tostring(rec.err) .. "\n"):gmatch("(.-)\n") do
      lines[#lines + 1] = p .. (first and "error: " or "  ") .. l
      first = false
    end
  elseif rec.vals then
    for l in (rec.vals .. "\n"):gmatch("(.-)\n") do lines[#lines + 1] = p .. l end
  end
  return lines
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

-- opts: { env = (for completion), sigint = bool (Ctrl-C handling on a tty) }
function M.open_input(opts)
  opts = opts or {}
  local self = setmetatable({ fd = 0, buf = "", eof = false }, Input)
  self.tty = C.weft_repl_isatty(0) == 1
  self.out = 1
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
    if opts.sigint ~= false then self.sigfd = signal_fd(SIGINT) end
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

---------------------------------------------------------------- link between ranks
-- Rank 0 -> others: chunk messages through weft.mq (same node) or cpu-group
-- point-to-point messages; answers always come back point-to-point, each
-- carrying its chunk's sequence number (a late answer is recognized). A
-- message {kind="via"} switches the channel for the messages after it, so
-- a rank that comes back late still reads everything in order.
local Link = {}
Link.__index = Link

local serialize   -- required with the link
local ETIMEOUT

function M.open_link(o)
  serialize = require "weft.serialize"
  local wffi = require "weft.ffi"
  ETIMEOUT = wffi.C.WEFT_ETIMEOUT
  local store = require("weft.store").open { host = o.host, port = o.port, server = o.rank == 0,
                                              timeout_ms = o.timeout_ms }
  local ranks = {}
  for r = 0, o.world - 1 do ranks[r + 1] = r end
  local ok, cg = pcall(require("weft.cpugroup").new, store, "weft-repl", ranks, o.rank, o.timeout_ms)
  if not ok then store:close(); error(cg, 0) end
  local self = setmetatable({ store = store, cg = cg, C = wffi.C, rank = o.rank, world = o.world,
                              timeout_ms = o.timeout_ms, via = "p2p",
                              ptr = ffi.new("const void *[1]"), len = ffi.new("size_t[1]") }, Link)
  local hello = cg:allgather(serialize.encode { pid = C.weft_repl_getpid(), host = hostname() })
  self.peers = {}
  local same = true
  for i, s in ipairs(hello) do
    self.peers[i - 1] = serialize.decode(s)
    if self.peers[i - 1].host ~= self.peers[0].host then same = false end
  end
  self.same_node = same
  local want = o.channel or "auto"
  if want ~= "p2p" and same and o.world > 1 then
    local okq, q = pcall(function()
      return require("weft.mq").new(cg, { writer = 0, chunk_bytes = M.MQ_CHUNK_BYTES, chunks = M.MQ_CHUNKS })
    end)
    local all = cg:allreduce_i64({ okq and 1 or 0 }, "min")[1] == 1
    if all then
      self.mq, self.via = q, "mq"
      q:set_timeout(o.timeout_ms)
    else
      if okq then q:destroy() end
      self.mq_error = okq and "another rank could not create it" or tostring(q)
    end
  end
  if want == "mq" and self.via ~= "mq" then
    self:close()
    error("weft: repl: WEFT_REPL_CHANNEL=mq but the message queue is unavailable: "
          .. (self.mq_error or (same and "one rank" or "ranks on several nodes")), 0)
  end
  self.start_via = self.via
  return self
end

-- rank 0: one message to every other rank, on the current channel
function Link:post(msg)
  if self.world == 1 then return end
  local s = serialize.encode(msg)
  if self.via == "mq" then
    self.mq:send_bytes(s)
  else
    for k = 1, self.world - 1 do self.cg:send(s, k) end
  end
end

-- rank 0: later messages go through `via` ("mq" | "p2p")
function Link:switch(via)
  if via == self.via or (via == "mq" and not self.mq) then return end
  self:post { kind = "via", via = via }
  self.via = via
end

-- rank 0: the next answer of rank k within ms, or nil on timeout
function Link:collect(k, ms)
  local h = self.cg.handle
  self.C.weft_cpugroup_set_timeout(h, math.max(1, math.floor(ms)))
  local rc = self.C.weft_cpugroup_recv(h, k, self.ptr, self.len)
  if rc == ETIMEOUT then return nil end
  if rc ~= 0 then error("weft: repl: " .. require("weft.ffi").last_error(), 0) end
  return serialize.decode(ffi.string(self.ptr[0], self.len[0]))
end

-- other ranks: the next message from rank 0 (waits as long as it takes, in
-- bounded slices; raises when rank 0 is gone)
function Link:next()
  local C2 = self.C
  while true do
    local s
    if self.via == "mq" then
      local h = self.mq.handle
      local rc = C2.weft_mq_dequeue(h, 60000, self.ptr, self.len)
      if rc == 0 then
        s = ffi.string(self.ptr[0], self.len[0])
        C2.weft_mq_release(h)
      elseif rc ~= ETIMEOUT then
        error("weft: repl: " .. require("weft.ffi").last_error(), 0)
      end
    else
      local h = self.cg.handle
      C2.weft_cpugroup_set_timeout(h, 60000)
      local rc = C2.weft_cpugroup_recv(h, 0, self.ptr, self.len)
      if rc == 0 then
        s = ffi.string(self.ptr[0], self.len[0])
      elseif rc ~= ETIMEOUT then
        error("weft: repl: " .. require("weft.ffi").last_error(), 0)
      end
    end
    if s then
      local msg = serialize.decode(s)
      if msg.kind == "via" then self.via = msg.via else return msg end
    end
  end
end

function Link:answer(rec)
  self.cg:send(serialize.encode(rec), 0)
end

function Link:close()
  if self.mq then self.mq:destroy(); self.mq = nil end
  if self.cg then self.cg:destroy(); self.cg = nil end
  if self.store then self.store:close(); self.store = nil end
end

---------------------------------------------------------------- the session (rank 0)
local Session = {}
Session.__index = Session

local HELP = [[
  any Lua chunk       runs on the selected ranks; =expr or a bare expression prints values
  :ranks              which ranks answer, their pids; chunks go to the selected ones
  :ranks 0,2 | 1-3    run the next chunks on these ranks only   (:ranks all: every rank)
  :timeout [MS]       show / set the deadline of a chunk (waits for answers end after it)
  :quit               end every rank (also Ctrl-D)
  :help               this text
 top-level locals persist (they become fields of the REPL environment); weft, rank
 and world_size are predefined; Ctrl-C clears the line, or interrupts a running chunk.]]

local function worker_list(self, pred)
  local t = {}
  for k = 0, self.world - 1 do if pred(k) then t[#t + 1] = k end end
  return t
end

function Session:say(s) self.input:write(s .. "\n") end

function Session:prefix(k)
  if self.world == 1 then return "" end
  return "[rank " .. k .. "] "
end

function Session:print_answer(rec, note)
  local lines = M.format_answer(rec, self:prefix(rec.rank), note)
  if #lines > 0 then self:say(concat(lines, "\n")) end
end

-- late answers of ranks that did not answer in time
function Session:poll_late(wait_ms)
  for k = 1, self.world - 1 do
    local st = self.state[k]
    if st.stuck then
      local rec = self.link:collect(k, wait_ms or 1)
      while rec do
        st.stuck, st.since = nil, nil
        self:print_answer(rec, format("(late answer to chunk %d, after %.1f s) ", rec.seq, rec.ms / 1000))
        rec = self.link:collect(k, 1)
      end
    end
  end
  if self.link and self.link.mq then
    local any = false
    for k = 1, self.world - 1 do if self.state[k].stuck then any = true end end
    self.link:switch(any and "p2p" or self.link.start_via)
  end
end

-- Runs code on the selected ranks that answer; prints every answer.
function Session:run(code, chunkname)
  local link, T = self.link, self.timeout_ms
  if link then self:poll_late() end
  self.seq = self.seq + 1
  local seq = self.seq
  local targets = worker_list(self, function(k) return self.selected[k] and not self.state[k].stuck end)
  local skipped = worker_list(self, function(k) return self.selected[k] and self.state[k].stuck end)
  for _, k in ipairs(skipped) do
    self:say(format("%s(not run: still busy with chunk %d)", self:prefix(k), self.state[k].since))
  end
  if #targets == 0 then return end
  local t0 = now_ms()
  if link then
    link:post { kind = "run", seq = seq, code = code, name = chunkname, targets = targets, timeout_ms = T }
  end
  local answers = {}
  self.ctx.interrupted = false
  if self.selected[0] and not self.state[0].stuck and targets[1] == 0 then
    answers[0] = M.execute(self.ctx, code, chunkname, T)
  end
  if link then
    local deadline = t0 + T + M.GRACE_MS
    local interrupted_at
    local function interrupt()
      if interrupted_at then return end
      interrupted_at = now_ms()
      local sent = {}
      for _, k in ipairs(targets) do
        local p = link.peers[k]
        if k ~= 0 and not answers[k] and p.host == link.peers[0].host then
          C.weft_repl_kill(p.pid, SIGUSR1)
          sent[#sent + 1] = k
        end
      end
      -- the terminal echoed "^C"
      self:say(#sent > 0 and (": interrupting rank" .. (#sent > 1 and "s " or " ") .. M.ranks_str(sent)) or "")
      deadline = math.min(deadline, interrupted_at + M.GRACE_MS)
    end
    if self.ctx.interrupted and self.input.tty then interrupt() end
    for _, k in ipairs(targets) do
      while k ~= 0 and not answers[k] do
        -- past the deadline each rank still gets one look (its answer may be there)
        local left = math.max(1, deadline - now_ms())
        local rec = link:collect(k, self.input.sigfd and math.min(left, 100) or left)
        if rec then
          if rec.seq == seq then
            answers[k] = rec
          else
            self:print_answer(rec, format("(late answer to chunk %s) ", tostring(rec.seq)))
          end
        elseif self.input.sigfd and drain(self.input.sigfd) then
          if interrupted_at then deadline = 0 end   -- a second Ctrl-C: stop waiting
          interrupt()
        elseif now_ms() >= deadline then
          break
        end
      end
    end
  end
  local missing = {}
  for _, k in ipairs(targets) do
    if answers[k] then
      self:print_answer(answers[k])
    else
      missing[#missing + 1] = k
      self.state[k].stuck, self.state[k].since, self.state[k].t = true, seq, t0
    end
  end
  if #missing > 0 then
    local waited = now_ms() - t0
    self:say(format("no answer from rank%s %s within %.1f s (chunk %d still running there, in code the "
                    .. "deadline hook cannot interrupt); %s left out of later chunks until %s answer%s. "
                    .. ":ranks shows them, :quit ends the session",
                    #missing > 1 and "s" or "", M.ranks_str(missing), waited / 1000, seq,
                    #missing > 1 and "they are" or "it is", #missing > 1 and "they" or "it",
                    #missing > 1 and "" or "s"))
    if link.mq then link:switch("p2p") end   -- a stuck reader must not fill the ring
  end
end

function Session:show_ranks()
  local sel = worker_list(self, function(k) return self.selected[k] end)
  self:say(format("world %d; chunks go to rank%s %s; timeout %d ms%s", self.world,
                  #sel > 1 and "s" or "", M.ranks_str(sel), self.timeout_ms,
                  self.link and (", channel " .. self.link.via) or ""))
  for k = 0, self.world - 1 do
    local st, p = self.state[k], self.link and self.link.peers[k] or { pid = C.weft_repl_getpid(), host = hostname() }
    local what = st.stuck and format("not answering: busy with chunk %d for %.0f s", st.since, (now_ms() - st.t) / 1000)
                 or "answering"
    self:say(format("  rank %d  pid %d  %s  %s%s", k, p.pid, p.host, what, self.selected[k] and "" or "  (not selected)"))
  end
end

-- Meta-command; returns "quit" to end.
function Session:meta(line)
  local cmd, rest = line:match("^%s*:(%S*)%s*(.-)%s*$")
  if cmd == "quit" or cmd == "q" or cmd == "exit" then return "quit" end
  if cmd == "help" or cmd == "h" or cmd == "?" then self:say(HELP); return end
  if cmd == "ranks" then
    if self.link then self:poll_late() end
    if rest == "" then self:show_ranks(); return end
    local list, err
    if rest == "all" then
      list = worker_list(self, function() return true end)
    else
      list, err = M.parse_ranks(rest, self.world)
    end
    if not list then self:say(":ranks: " .. err); return end
    self.selected = {}
    for _, k in ipairs(list) do self.selected[k] = true end
    self:say("chunks go to rank" .. (#list > 1 and "s " or " ") .. M.ranks_str(list))
    return
  end
  if cmd == "timeout" then
    if rest == "" then self:say(format("timeout %d ms", self.timeout_ms)); return end
    local ms = tonumber(rest)
    local min = self.link and 100 or 0
    if not ms or ms % 1 ~= 0 or ms < min then
      self:say(format(":timeout: expected whole milliseconds >= %d, got '%s'%s", min, rest,
                      self.link and "" or " (0: no deadline)"))
      return
    end
    self.timeout_ms = ms
    self.ctx.timeout_ms = ms
    self:say(format("timeout %d ms", ms))
    return
  end
  self:say(format("unknown command ':%s' (:help lists them)", cmd))
end

-- Ends every rank: quit -> bye (with whether weft is initialized) -> finish
-- (with the shutdown decision) -> done. Returns the exit code.
function Session:quit()
  local link = self.link
  if not link then return 0 end
  local dist = package.loaded["weft.dist"]
  self.seq = self.seq + 1
  local seq = self.seq
  self:poll_late()
  link:post { kind = "quit", seq = seq }
  local byes, stuck, all_dist = {}, {}, dist and dist.is_initialized() or false
  local deadline = now_ms() + (self.timeout_ms < 5000 and self.timeout_ms or 5000) + M.GRACE_MS
  for k = 1, self.world - 1 do
    while not byes[k] do
      local left = deadline - now_ms()
      if left <= 0 then break end
      local rec = link:collect(k, left)
      if not rec then break end
      if rec.kind == "bye" and rec.seq == seq then
        byes[k] = rec
      elseif rec.kind ~= "bye" then
        self:print_answer(rec, format("(late answer to chunk %s) ", tostring(rec.seq)))
      end
    end
    if byes[k] then all_dist = all_dist and byes[k].dist else stuck[#stuck + 1] = k end
  end
  local shutdown = #stuck == 0 and all_dist
  link:post { kind = "finish", shutdown = shutdown }
  local code = 0
  if shutdown then
    local ok, err = pcall(dist.shutdown)
    if not ok then self:say("weft.shutdown: " .. tostring(err)); code = 1 end
  end
  local dl = now_ms() + self.timeout_ms + M.GRACE_MS
  for k = 1, self.world - 1 do
    if byes[k] then
      while true do
        local rec = link:collect(k, math.max(1, dl - now_ms()))
        if not rec then self:say(format("rank %d did not confirm the end of the session", k)); code = 1; break end
        if rec.kind == "done" then
          if rec.err then self:say(format("[rank %d] weft.shutdown: %s", k, rec.err)); code = 1 end
          break
        end
      end
    end
  end
  link:close()
  if #stuck > 0 then
    self:say(format("rank%s %s did not answer :quit (busy with chunk %s; stuck in code that cannot be "
                    .. "interrupted): ending the session, weft-run stops %s",
                    #stuck > 1 and "s" or "", M.ranks_str(stuck),
                    tostring(self.state[stuck[1]].since or "?"), #stuck > 1 and "them" or "it"))
    return 1
  end
  return code
end

function Session:loop()
  local buf
  while true do
    local line, why = self.input:read(buf and ">> " or "> ")
    if line == nil then
      if why ~= "interrupt" then return self:quit() end
      buf = nil
    elseif not buf and line:match("^%s*:") then
      if self:meta(line) == "quit" then
        self.input:add_history(line)
        return self:quit()
      end
      self.input:add_history(line)
    else
      buf = buf and (buf .. "\n" .. line) or line
      if not buf:find("%S") then
        buf = nil
      else
        local kind, code = M.prepare(buf)
        if kind ~= "incomplete" then
          self.input:add_history(buf)
          buf = nil
          if kind == "error" then
            self:say(code)
          else
            self:run(code, "=stdin")
          end
        end
      end
    end
  end
end

---------------------------------------------------------------- workers (rank > 0)
local function worker_main(ctx, link)
  while true do
    local msg = link:next()
    if msg.kind == "run" then
      local mine = false
      for _, k in ipairs(msg.targets) do if k == ctx.rank then mine = true end end
      if mine then
        drain(ctx.sigfd)   -- an interrupt meant for an earlier chunk
        ctx.timeout_ms = msg.timeout_ms
        local rec = M.execute(ctx, msg.code, msg.name, msg.timeout_ms)
        rec.seq = msg.seq
        link:answer(rec)
      end
    elseif msg.kind == "quit" then
      local dist = package.loaded["weft.dist"]
      link:answer { kind = "bye", seq = msg.seq, dist = dist and dist.is_initialized() or false }
      local fin = link:next()
      local rec = { kind = "done" }
      if fin.kind == "finish" and fin.shutdown then
        local ok, err = pcall(dist.shutdown)
        if not ok then rec.err = tostring(err) end
      end
      link:answer(rec)
      link:close()
      return rec.err and 1 or 0
    end
  end
end

---------------------------------------------------------------- entry points
local function env_int(name, default)
  local v = tonumber(os.getenv(name) or "")
  if v and v >= 1 and v % 1 == 0 then return v end
  return default
end

local function read_file(path)
  local f, err = io.open(path, "rb")
  if not f then return nil, err end
  local s = f:read("*a")
  f:close()
  return s
end

local USAGE = [=[
usage: weft-repl [--timeout MS] [script.lua [args...]]
       weft-run -n N --repl [script.lua [args...]]

A LuaJIT REPL with weft loaded (the `weft` global). A script, when given, runs
first on every rank (like lua -i). Enter :help at the prompt for the commands.
Under weft-run --repl, rank 0 reads the chunks and runs each on every rank;
answers come back as "[rank k] ...". See lua/weft/repl.lua for the details.

  --timeout MS   deadline of one chunk (default: none for weft-repl alone,
                 $WEFT_TIMEOUT_MS or 60000 under weft-run --repl)
environment: WEFT_REPL_HISTORY (history file, "" for none), WEFT_REPL_READLINE=0
(plain input), WEFT_REPL_CHANNEL=auto|mq|p2p (how chunks reach the ranks)
]=]

-- argv: the script's arg table. Returns the exit code.
function M.main(argv)
  local args, timeout = {}, nil
  local i = 1
  while argv[i] do
    local a = argv[i]
    if a == "--help" or a == "-h" then io.stdout:write(USAGE); return 0 end
    if a == "--timeout" or a:match("^%-%-timeout=") then
      local v = a:match("^%-%-timeout=(.*)$")
      if not v then i = i + 1; v = argv[i] end
      timeout = tonumber(v or "")
      if not timeout or timeout < 0 or timeout % 1 ~= 0 then
        io.stderr:write("weft-repl: --timeout needs whole milliseconds\n"); return 2
      end
    elseif a == "--" then
      for j = i + 1, #argv do args[#args + 1] = argv[j] end
      break
    elseif a:sub(1, 1) == "-" and a ~= "-" then
      io.stderr:write("weft-repl: unknown option " .. a .. "\n" .. USAGE); return 2
    else
      for j = i, #argv do args[#args + 1] = argv[j] end
      break
    end
    i = i + 1
  end
  local script = args[1]
  local port = os.getenv("WEFT_REPL_PORT")
  local world = env_int("WORLD_SIZE", 1)
  local rank = tonumber(os.getenv("RANK") or "0") or 0
  local distributed = port ~= nil and port ~= ""
  local ctx = { rank = distributed and rank or 0, world = distributed and world or 1, capture = distributed }
  ctx.env = M.new_env(ctx)
  ctx.timeout_ms = timeout or (distributed and env_int("WEFT_TIMEOUT_MS", M.DEFAULT_TIMEOUT_MS)) or nil
  if ctx.timeout_ms == 0 then ctx.timeout_ms = nil end
  if distributed and not ctx.timeout_ms then ctx.timeout_ms = M.DEFAULT_TIMEOUT_MS end
  if script then
    local env_arg = { [0] = script }
    for j = 2, #args do env_arg[j - 1] = args[j] end
    ctx.env.arg = env_arg
  end

  local link
  if distributed then
    local ok, l = pcall(M.open_link, { rank = rank, world = world, host = os.getenv("MASTER_ADDR") or "127.0.0.1",
                                       port = tonumber(port), timeout_ms = ctx.timeout_ms,
                                       channel = os.getenv("WEFT_REPL_CHANNEL") })
    if not ok then io.stderr:write("weft-repl: rank " .. rank .. ": " .. tostring(l) .. "\n"); return 1 end
    link = l
  end
  if distributed and rank ~= 0 then
    ctx.sigfd = signal_fd(SIGUSR1)
    local ok, code = pcall(worker_main, ctx, link)
    if not ok then
      io.stderr:write("weft-repl: rank " .. rank .. ": " .. tostring(code) .. "\n")
      return 1
    end
    return code
  end

  local input = M.open_input { env = ctx.env }
  ctx.sigfd = input.sigfd
  local self = setmetatable({ ctx = ctx, link = link, input = input, world = ctx.world, seq = 0,
                              timeout_ms = ctx.timeout_ms or 0, state = {}, selected = {} }, Session)
  for k = 0, ctx.world - 1 do self.state[k] = {}; self.selected[k] = true end
  if not distributed then
    -- one process: the deadline is optional (0 = none)
    self.run = function(s, code, name)
      local rec = M.execute(s.ctx, code, name, s.timeout_ms > 0 and s.timeout_ms or nil)
      io.stdout:flush()
      if s.ctx.interrupted and s.input.tty then s.ctx.interrupted = false; s:say("") end
      s:print_answer(rec)
    end
  end
  local ok, code = pcall(function()
    if ctx.weft_error then self:say("weft-repl: cannot load weft: " .. tostring(ctx.weft_error)) end
    if input.tty then
      self:say(format("weft REPL (LuaJIT) - %s%s; :help for commands, Ctrl-D to quit",
                      distributed and format("%d rank%s, every chunk runs on each", ctx.world,
                                             ctx.world > 1 and "s" or "") or "one process",
                      input.rl and "" or " (no readline: plain input)"))
    end
    if script then
      local src, err = read_file(script)
      if not src then
        self:say("weft-repl: cannot read " .. script .. ": " .. tostring(err))
      else
        src = src:gsub("^#![^\n]*", "")
        self:run(src, "@" .. script)
      end
    end
    return self:loop()
  end)
  input:close()
  if not ok then
    io.stderr:write("weft-repl: " .. tostring(code) .. "\n")
    if link then link:close() end
    return 1
  end
  return code
end

-- weft-run --repl: every rank runs scripts/weft-repl; rank 0 gets the
-- launcher's stdin and no output prefix (its output is the console).
-- L: weft.launcher; opts: parsed options (script optional). Returns exit code.
function M.launch(opts, root, L)
  local function usage_error(msg)
    io.stderr:write("weft-run: " .. msg .. "\nTry 'weft-run --help'.\n")
    return 2
  end
  if opts.command then return usage_error("--repl runs Lua chunks: give an optional script.lua, not -- command") end
  if opts.node_rank >= opts.nnodes then
    return usage_error(format("--node-rank must be < --nnodes (got %d with %d nodes)", opts.node_rank, opts.nnodes))
  end
  if opts.nnodes > 1 and not opts.master_port then
    return usage_error("--master-port is required with --nnodes > 1")
  end
  if opts.script and not io.open(opts.script, "r") then
    return usage_error("cannot open script '" .. opts.script .. "'")
  end
  local function free_port()
    local p, perr = L.free_port(opts.master_addr)
    if not p then io.stderr:write(format("weft-run: cannot find a free port on %s: %s\n", opts.master_addr, perr)) end
    return p
  end
  if not opts.master_port then
    opts.master_port = free_port()
    if not opts.master_port then return 1 end
  end
  local port = tonumber(os.getenv("WEFT_REPL_PORT") or "")
  if not port then
    if opts.nnodes > 1 then
      port = opts.master_port + 1   -- every node must agree without talking
    else
      for _ = 1, 20 do
        port = free_port()
        if port ~= opts.master_port then break end
      end
      if not port or port == opts.master_port then return 1 end
    end
  end
  local o = {}
  for k, v in pairs(opts) do o[k] = v end
  o.script = root .. "/scripts/weft-repl"
  o.args = {}
  if opts.script then o.args = { opts.script, unpack(opts.args or {}) } end
  local plan = L.plan(o, root)
  for _, r in ipairs(plan.ranks) do
    r.env[#r.env + 1] = { "WEFT_REPL_PORT", tostring(port) }
    if r.rank == 0 then r.stdin, r.prefix = "inherit", "" end
  end
  return L.launch(plan)
end

return M
