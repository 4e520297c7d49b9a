-- weft.tools.repl — the live REPL: scripts/weft-repl (one process) and
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
-- near '<eof>'); "=expr", bare expressions and a line whose last statement
-- is an expression (`x = f(); x[1]`) print their values; top-level
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
-- weft's own blocking waits (C code) honour the same deadline and Ctrl-C:
-- each chunk arms weft_interrupt_arm with the chunk's signalfd and deadline,
-- so a collective blocked in C ends on every rank ("interrupted") and its
-- group then refuses work; weft.recover() on every rank (one chunk) rebuilds
-- the groups (docs/faults.md). A chunk that breaks a weft group on some ranks
-- otherwise (a collective one rank skipped times out on the others, naming
-- it) leaves the REPL usable the same way.
-- A rank that dies (a crash, a signal) ends the session: weft-run stops the
-- others, as for any script. Ctrl-C (tty; also a SIGINT sent to weft-run, which passes it to rank 0
-- alone): clears the input line at the prompt; while a chunk runs it
-- interrupts the chunk on rank 0 and, through SIGUSR1, on the ranks of this
-- node that have not answered. Ctrl-D or :quit ends every rank cleanly
-- (weft.shutdown() when the chunks initialized weft on every rank).
-- SIGTERM sent to weft-run stops every rank at once (exit 143); weft-run then
-- gives the terminal back as it found it (readline's raw mode, the foreground).
--
-- Modules: this one holds the session of rank 0 (commands, waiting for the
-- ranks' answers), the workers' loop and the entry points; weft.tools.repl.chunk
-- (from text to answer: parse, environment, run under a deadline, show
-- values), weft.tools.repl.input (terminal input, completion, signals, POSIX
-- through the FFI) and weft.tools.repl.link (the channel between ranks). Their
-- public fields are re-exported here.
local ffi = require("ffi")
local repl_input = require("weft.tools.repl.input")   -- declares C.weft_repl_* (POSIX)
local repl_chunk = require("weft.tools.repl.chunk")
local repl_link = require("weft.tools.repl.link")

local concat, format = table.concat, string.format
local C = ffi.C

local M = {}

M.DEFAULT_TIMEOUT_MS = 60000
M.GRACE_MS = 2000        -- answers may arrive this long after the chunk deadline

local now_ms = require("weft.internal.clock").now_ms
M.now_ms = now_ms

local SIGUSR1 = repl_input.SIGUSR1
local signal_fd, drain, hostname = repl_input.signal_fd, repl_input.drain, repl_input.hostname

-- The other modules' public fields (the same functions; the tunables are
-- copies of theirs, read by the module that owns them).
M.HOOK_COUNT, M.MAX_OUTPUT = repl_chunk.HOOK_COUNT, repl_chunk.MAX_OUTPUT
M.SHOW_ITEMS, M.SHOW_DEPTH, M.SHOW_STRING = repl_chunk.SHOW_ITEMS, repl_chunk.SHOW_DEPTH, repl_chunk.SHOW_STRING
M.HISTORY_LINES = repl_input.HISTORY_LINES
M.MQ_CHUNK_BYTES, M.MQ_CHUNKS = repl_link.MQ_CHUNK_BYTES, repl_link.MQ_CHUNKS
M.globalize_locals, M.prepare = repl_chunk.globalize_locals, repl_chunk.prepare
M.show, M.show_values, M.new_env = repl_chunk.show, repl_chunk.show_values, repl_chunk.new_env
M.execute, M.format_answer = repl_chunk.execute, repl_chunk.format_answer
M.complete, M.open_input = repl_input.complete, repl_input.open_input
M.open_link = repl_link.open_link

---------------------------------------------------------------- ranks as text
-- "0-3", "0,2,5-7" (weft-run's form; loaded on first use)
M.ranks_str = require("weft.internal.show").ranks

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

---------------------------------------------------------------- the session (rank 0)
local Session = {}
Session.__index = Session

local HELP = [[
  any Lua chunk       runs on the selected ranks; =expr, a bare expression or a last
                      statement that is one (x = f(); x[1]) prints values
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

-- Answers of one chunk: ranks whose answers are equal (printed output, values
-- and error alike) print once as "[ranks 0-3] ...", the others each as
-- "[rank k] ...", in order of their first rank.
function Session:print_answers(answers, targets)
  local order, by = {}, {}
  for _, k in ipairs(targets) do
    local rec = answers[k]
    if rec then
      local key = concat({ rec.out or "", rec.vals or "\0", rec.err and tostring(rec.err) or "\0",
                           rec.cut and "cut" or "" }, "\1")
      local g = by[key]
      if not g then g = { rec = rec, ranks = {} }; by[key] = g; order[#order + 1] = g end
      g.ranks[#g.ranks + 1] = k
    end
  end
  for _, g in ipairs(order) do
    local prefix = #g.ranks > 1 and ("[ranks " .. M.ranks_str(g.ranks) .. "] ") or self:prefix(g.ranks[1])
    local lines = M.format_answer(g.rec, prefix)
    if #lines > 0 then self:say(concat(lines, "\n")) end
  end
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
      -- on a terminal after the "^C" it echoed
      if #sent > 0 then
        self:say((self.input.tty and ": " or "") .. "interrupting rank" .. (#sent > 1 and "s " or " ") .. M.ranks_str(sent))
      elseif self.input.tty then
        self:say("")
      end
      deadline = math.min(deadline, interrupted_at + M.GRACE_MS)
    end
    if self.ctx.interrupted then interrupt() end
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
  self:print_answers(answers, targets)
  for _, k in ipairs(targets) do
    if not answers[k] then
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

-- a chunk of input: when complete, into the history and run (or its syntax
-- error said); an incomplete one is returned, kept for the next line
function Session:submit(buf)
  local kind, code = M.prepare(buf)
  if kind == "incomplete" then return buf end
  self.input:add_history(buf)
  if kind == "error" then self:say(code) else self:run(code, "=stdin") end
end

function Session:loop()
  local buf
  while true do
    local line, why = self.input:read(buf and ">> " or "> ")
    if line == nil then
      if why ~= "interrupt" then return self:quit() end
      buf = nil
    elseif not buf and line:match("^%s*:") then
      local quit = self:meta(line) == "quit"
      self.input:add_history(line)
      if quit then return self:quit() end
    else
      buf = buf and (buf .. "\n" .. line) or line
      if buf:find("%S") then buf = self:submit(buf) else buf = nil end
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
answers come back as "[rank k] ...". See lua/weft/tools/repl.lua for the details.

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
      if s.ctx.interrupted then
        s.ctx.interrupted = false
        if s.input.tty then s:say("") end
      end
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
-- L: weft.tools.launcher; opts: parsed options (script optional). Returns exit code.
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
  local reserved   -- the store's port, held until the job ends (launcher.free_port)
  if not opts.master_port then
    local p, fd = L.free_port(opts.master_addr, true)
    if not p then
      io.stderr:write(format("weft-run: cannot find a free port on %s: %s\n", opts.master_addr, fd))
      return 1
    end
    opts.master_port, reserved = p, fd
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
      if not port or port == opts.master_port then
        if reserved then ffi.C.close(reserved) end
        return 1
      end
    end
  end
  local o = {}
  for k, v in pairs(opts) do o[k] = v end
  o.script = L.tool(root, "weft-repl")
  o.args = {}
  if opts.script then o.args = { opts.script, unpack(opts.args or {}) } end
  local plan = L.plan(o, root)
  for _, r in ipairs(plan.ranks) do
    r.env[#r.env + 1] = { "WEFT_REPL_PORT", tostring(port) }
    if r.rank == 0 then r.stdin, r.prefix = "inherit", "" end
  end
  -- rank 0 reads the terminal and owns Ctrl-C: weft-run passes a SIGINT on to it alone
  plan.interactive = opts.node_rank == 0
  local ok, rc = pcall(L.launch, plan)
  if reserved then ffi.C.close(reserved) end
  if not ok then error(rc, 0) end
  return rc
end

return M
