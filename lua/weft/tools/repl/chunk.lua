-- weft.tools.repl.chunk — one chunk of REPL input, from text to answer: what typed
-- text means (expression, statement, incomplete, syntax error; top-level
-- locals made to persist), the environment chunks run in (printed output
-- captured per chunk), running a chunk under a deadline and Ctrl-C (a count
-- hook; chunks run with the JIT off), values as text, and an answer's lines
-- for the console. lua/weft/tools/repl.lua describes the behaviour; weft.tools.repl
-- re-exports every field.
local concat, format = table.concat, string.format
local now_ms = require("weft.internal.clock").now_ms
local drain = require("weft.tools.repl.input").drain
local key_less = require("weft.serialize").key_less

local M = {}

M.HOOK_COUNT = 10000     -- VM instructions between deadline/interrupt checks
M.MAX_OUTPUT = 65536     -- bytes of printed output kept per rank and chunk
M.SHOW_ITEMS = 16        -- table entries shown
M.SHOW_DEPTH = 3         -- nested tables shown
M.SHOW_STRING = 200      -- characters of a string inside a table

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

local BRACKETS = { ["("] = 1, ["["] = 1, ["{"] = 1, [")"] = -1, ["]"] = -1, ["}"] = -1 }

-- Statements followed by one expression, the last top-level statement
-- (after a `;` or a line break outside any block or bracket): the code that
-- runs the statements (top-level locals kept) and returns the expression's
-- values packed as expr_code does, or nil when the text is not of that form.
function M.split_last_expr(text, chunkname)
  local toks = lex(text)
  if not toks then return nil end
  local cuts, depth = {}, 0
  for k, t in ipairs(toks) do
    if t[1] == "name" and OPENS[t[2]] then depth = depth + 1
    elseif t[1] == "name" and CLOSES[t[2]] then depth = depth - 1
    elseif t[1] == "op" and BRACKETS[t[2]] then depth = depth + BRACKETS[t[2]]
    end
    if depth == 0 then
      if t[1] == "op" and t[2] == ";" then cuts[#cuts + 1] = t.e
      elseif toks[k + 1] and text:sub(t.e + 1, toks[k + 1].s - 1):find("\n") then cuts[#cuts + 1] = t.e end
    end
  end
  for i = #cuts, 1, -1 do
    local head, tail = text:sub(1, cuts[i]), text:sub(cuts[i] + 1)
    if tail:find("%S") and loadstring(head, chunkname) and loadstring("return " .. tail, chunkname) then
      local g = M.globalize_locals(head)
      if not loadstring(g, chunkname) then g = head end
      local code = g .. " " .. expr_code(tail, chunkname)
      if loadstring(code, chunkname) then return code end
    end
  end
  return nil
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
    -- statements ending in an expression (`x = f(); x[1]`): run them and
    -- print the expression's values, as `=x[1]` would
    local code = M.split_last_expr(text, chunkname)
    if code then return "expr", code end
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
  table.sort(keys, key_less)
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
-- weft_interrupt_arm when libweft loads (the REPL also runs without it)
local wffi_C
local function arm_interrupt(fd, ms)
  if wffi_C == nil then
    local ok, wffi = pcall(require, "weft.internal.ffi")
    wffi_C = ok and wffi.C or false
  end
  if not wffi_C then return false end
  wffi_C.weft_interrupt_arm(fd and tonumber(fd) or -1, ms and math.floor(ms) or 0)
  return true
end

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
  -- weft's own blocking waits (C code, where no hook runs) end at the same
  -- deadline or Ctrl-C: they poll sigfd (never read it) between slices
  local armed = arm_interrupt(sigfd, deadline_ms)
  local r = pack(xpcall(fn, keep, packer))
  if armed then arm_interrupt(nil, nil) end
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

return M
