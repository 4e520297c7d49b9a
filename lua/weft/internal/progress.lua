-- weft.internal.progress — what a long-running tool is doing now, how far it is and
-- about how long is left (make bench-host, weft-tune, bench-soak, ...).
--
--   local P = progress.new { name = "bench-host", steps = 12, quiet = opts.q }
--   P:step("weft, 2 ranks, f32")          -- step 1 of 12 begins
--   P:update(4000, 20000, "calls")        -- within the step: 4000 of 20000
--   P:note("a line of its own")           -- kept above the progress line
--   P:finish("wrote x.json")              -- the last line
--
-- On a terminal (the stream's descriptor is a tty) the progress is one line,
-- rewritten in place ("\r", erase line), kept to the terminal's width and
-- redrawn at most every 0.2 s; piped, it is one line per step (an update
-- prints at every 10 % of its step); quiet, nothing. A line reads
--   bench-host: [3/12] weft, 4 ranks, bf16 (42 s, about 1 min 30 s left)
-- The estimate is the time so far per step done (a step's update counts as
-- its fraction) times the steps left, steps weighted by `weights` where the
-- tool knows they differ (else all 1); none before the first step has begun
-- to move. More steps than announced (a tool that adds passes) raise the
-- total with them.
--
-- opts: name, steps (the total) or weights (one per step: their relative
-- cost), quiet, stream (an object with :write; default
-- io.stderr), fd (its descriptor, for the tty check and the width; default 2),
-- tty (true/false: overrides the check), width, now (a clock in seconds, for
-- tests). WEFT_PROGRESS_FD=N sends the progress to descriptor N (weft-tune's
-- ranks write to the terminal weft-tune was started from, past weft-run's
-- pipes).
local ffi = require("ffi")

local fmt, floor, max, min = string.format, math.floor, math.max, math.min

local M = {}

if not pcall(function() return ffi.C.weft_progress_isatty end) then
  ffi.cdef [[
  int weft_progress_isatty(int fd) __asm__("isatty");
  int weft_progress_ioctl(int fd, unsigned long req, void *arg) __asm__("ioctl");
  long weft_progress_write(int fd, const void *buf, unsigned long n) __asm__("write");
  ]]
end
local C = ffi.C
local TIOCGWINSZ = 0x5413

local function isatty(fd) return C.weft_progress_isatty(fd) == 1 end

local function term_width(fd)
  local ws = ffi.new("unsigned short[4]")
  if C.weft_progress_ioctl(fd, TIOCGWINSZ, ws) == 0 and ws[1] > 0 then return ws[1] end
  return 80
end

-- a stream over a bare descriptor (WEFT_PROGRESS_FD)
local function fd_stream(fd)
  return { write = function(_, s) C.weft_progress_write(fd, s, #s) end }
end

-- "42 s", "3 min 05 s", "1 h 02 min"
function M.duration(s)
  s = max(0, floor(s + 0.5))
  if s < 60 then return fmt("%d s", s) end
  if s < 3600 then return fmt("%d min %02d s", floor(s / 60), s % 60) end
  return fmt("%d h %02d min", floor(s / 3600), floor(s % 3600 / 60))
end

local P = {}
P.__index = P

function M.new(opts)
  opts = opts or {}
  local self = setmetatable({
    name = opts.name or "weft", total = opts.steps or (opts.weights and #opts.weights) or 0,
    weights = opts.weights, quiet = opts.quiet and true or false,
    k = 0, frac = 0, label = nil, shown = nil, last_draw = -1, next_mark = 0.1,
    now = opts.now or function() return require("weft.internal.clock").now_ns() * 1e-9 end,
  }, P)
  local fd = opts.fd
  local stream = opts.stream
  if not stream then
    local env = tonumber(os.getenv("WEFT_PROGRESS_FD") or "")
    if env and env ~= 2 then fd = fd or env; stream = fd_stream(env)
    else stream = io.stderr end
  end
  fd = fd or 2
  self.stream = stream
  if opts.tty ~= nil then self.tty = opts.tty else self.tty = isatty(fd) end
  self.width = opts.width or (self.tty and term_width(fd)) or 80
  self.t0 = self.now()
  return self
end

local function weight(self, i) return self.weights and self.weights[i] or 1 end

-- elapsed and estimated seconds left (nil before any progress)
function P:times()
  local el = self.now() - self.t0
  local done, all = 0, 0
  for i = 1, self.total do
    local w = weight(self, i)
    all = all + w
    if i < self.k then done = done + w elseif i == self.k then done = done + w * self.frac end
  end
  if done <= 0 then return el, nil end
  return el, el / done * max(0, all - done)
end

function P:text(extra)
  local el, left = self:times()
  local s = fmt("%s: [%d/%d] %s", self.name, self.k, self.total, self.label or "")
  if extra then s = s .. ", " .. extra end
  return s .. fmt(" (%s%s)", M.duration(el), left and (", about " .. M.duration(left) .. " left") or "")
end

function P:draw(text, force)
  if self.quiet then return end
  if self.tty then
    local t = self.now()
    if t < (self.hold_until or 0) or (not force and t - self.last_draw < 0.2) then return end
    self.last_draw = t
    if #text > self.width - 1 then text = text:sub(1, self.width - 2) .. "~" end
    self.stream:write("\r\27[K" .. text)
    self.shown = text
  else
    self.stream:write(text .. "\n")
  end
end

-- step k+1 begins: label says what it runs
function P:step(label)
  self.k = self.k + 1
  if self.k > self.total then self.total = self.k end
  self.label, self.frac, self.next_mark, self.sub = label, 0, 0.1, nil
  self:draw(self:text(), true)
end

-- within the current step: `done` of `of` (a unit word for the line)
function P:update(done, of, unit)
  if of and of > 0 then self.frac = min(1, max(0, done / of)) end
  self.sub = fmt("%s/%s%s", tostring(done), tostring(of), unit and (" " .. unit) or "")
  if self.tty then
    self:draw(self:text(self.sub))
  elseif self.frac >= self.next_mark - 1e-9 then
    while self.next_mark <= self.frac + 1e-9 do self.next_mark = self.next_mark + 0.1 end
    self:draw(self:text(self.sub))
  end
end

-- more steps than announced (a pass added)
function P:add_steps(n) self.total = self.total + n end

-- erase the progress line (tty) so that other output starts a clean line;
-- hold_s: draw nothing for that long (output of the tool's own that another
-- process relays, weft-run's, lands first)
function P:clear(hold_s)
  if self.tty and self.shown and not self.quiet then
    self.stream:write("\r\27[K")
    self.shown = nil
  end
  if hold_s then self.hold_until = self.now() + hold_s end
end

-- a line of its own above the progress line (quiet: nothing)
function P:note(text)
  if self.quiet then return end
  self:clear()
  self.stream:write(self.name .. ": " .. text .. "\n")
  if self.tty and self.label then self:draw(self:text(self.sub), true) end
end

-- the last line: the time taken and `text`
function P:finish(text)
  if self.quiet then return end
  self:clear()
  self.stream:write(fmt("%s: %s%s\n", self.name, text and (text .. ", ") or "",
                        "done in " .. M.duration(self.now() - self.t0)))
end

return M
