-- weft.tools.repl.link — the REPL's own channel between ranks (weft-run --repl):
-- its store (rank 0, port $WEFT_REPL_PORT) and cpu group, so chunks may
-- init, shut down or break weft's groups without touching the session; chunks
-- from rank 0 through weft.mq (same node) or point-to-point messages, answers
-- back point-to-point. weft.tools.repl re-exports open_link, MQ_CHUNK_BYTES and
-- MQ_CHUNKS.
local ffi = require("ffi")
local lstring = require("weft.internal.hostmem").string -- refuses lengths a Lua string cannot hold (ffi.string wraps a 64-bit one)
local hostname = require("weft.tools.repl.input").hostname   -- also declares C.weft_repl_*

local C = ffi.C

local M = {}

M.MQ_CHUNK_BYTES = 65536
M.MQ_CHUNKS = 8

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
  serialize = require("weft.serialize")
  local wffi = require("weft.internal.ffi")
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
  if rc ~= 0 then error("weft: repl: " .. require("weft.internal.ffi").last_error(), 0) end
  return serialize.decode(lstring(self.ptr[0], self.len[0], "repl link"))
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
        s = lstring(self.ptr[0], self.len[0], "repl link")
        C2.weft_mq_release(h)
      elseif rc ~= ETIMEOUT then
        error("weft: repl: " .. require("weft.internal.ffi").last_error(), 0)
      end
    else
      local h = self.cg.handle
      C2.weft_cpugroup_set_timeout(h, 60000)
      local rc = C2.weft_cpugroup_recv(h, 0, self.ptr, self.len)
      if rc == 0 then
        s = lstring(self.ptr[0], self.len[0], "repl link")
      elseif rc ~= ETIMEOUT then
        error("weft: repl: " .. require("weft.internal.ffi").last_error(), 0)
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

return M
