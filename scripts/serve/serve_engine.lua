-- serve_engine — what every rank of the served demo does: bring the world
-- up, receive each step from rank 0, compute its shard, all-reduce.
--
-- A step message (weft.serialize): { s = step, l = layer, b = rows,
-- x = f32 bytes [rows][d_in], slow = {rank=, ms=} | nil, stop = true | nil }.
-- rows = 0 is a heartbeat: the all-reduce then carries only the check word.
-- The all-reduced tensor is [rows * d_out + 1] f32; its last element is
-- each rank's step number, so rank 0 can verify that every rank computed
-- the same step (sum == world * step).
--
-- Channel (WEFT_SERVE_CHANNEL): "mq" (the shared-memory broadcaster,
-- weft.mq) or "cpu" (world:broadcast_object through the store); "auto"
-- picks mq when the module and its C side are there.
-- Device (WEFT_SERVE_DEVICE): "cpu" (host tensors, shm all-reduce) or
-- "cuda": the partial sums go to the GPU of LOCAL_RANK and are all-reduced
-- by NCCL (tp.device_group), then come back for the JSON answer.
local ffi = require("ffi")
local weft = require("weft")
local async = require("weft.async")
local group = require("weft.group")
local serialize = require("weft.serialize")
local model = require("serve_model")

local M = {}

local function env(name, default)
  local v = os.getenv(name)
  if v == nil or v == "" then return default end
  return v
end
local function env_num(name, default)
  local v = tonumber(env(name, nil))
  return v or default
end

function M.config()
  local c = {
    hidden = env_num("WEFT_SERVE_HIDDEN", 256),
    max_rows = env_num("WEFT_SERVE_MAX_BATCH", 64),
    device = env("WEFT_SERVE_DEVICE", "cpu"),
    channel = env("WEFT_SERVE_CHANNEL", "auto"),
    debug = env("WEFT_SERVE_DEBUG", "0") == "1",
    dir = env("WEFT_SERVE_DIR", nil),
    timeout_ms = env_num("WEFT_TIMEOUT_MS", 60000),
  }
  c.heartbeat_ms = env_num("WEFT_SERVE_HEARTBEAT_MS", math.min(1000, math.floor(c.timeout_ms / 4)))
  if c.channel == "auto" then
    local ok = pcall(require, "weft.mq") and pcall(function() return weft.ffi.C.weft_mq_create end)
    c.channel = ok and "mq" or "cpu"
  end
  return c
end

local E = {}
E.__index = E

-- Collective bring-up (every rank, same order). Blocking, once, at start.
function M.bringup(cfg)
  cfg = cfg or M.config()
  async.install(group.GroupCoordinator, group)
  local world = weft.init()
  local W = world.world_size
  weft.initialize_model_parallel { tp = W }
  local plan = weft.plan()
  local tp = weft.tp()
  local rank = world.rank
  local e = setmetatable({
    cfg = cfg, world = world, tp = tp, plan = plan, rank = rank, W = W,
    layers = model.layers(cfg.hidden), step = 0,
  }, E)
  e.shards = model.build(e.layers, tp.rank_in_group, tp.world_size)
  e.peers = world:all_gather_object({ rank = rank, pid = ffi.C.getpid(),
                                      local_rank = tonumber(os.getenv("LOCAL_RANK") or "0") })
  if cfg.channel == "mq" and W > 1 then
    e.mq = require("weft.mq").new(world.cpu_group, { writer = 0, chunk_bytes = 65536, chunks = 16 })
  end
  async.prepare(tp)
  async.prepare(world)
  if cfg.device == "cuda" then
    local cuda = require("weft.cuda")
    local lr = tonumber(os.getenv("LOCAL_RANK") or "0")
    cuda.set_device(lr % cuda.device_count())
    if W > 1 then
      tp.device_group = require("weft.nccl").new(tp.cpu_group)
      tp._dispatch = nil
    end
    e.device = "cuda"
  else
    e.device = "cpu"
  end
  -- one warm-up step of every path (all ranks): the first request pays nothing
  local t = weft.tensor.zeros({ 1 }, "f32", e.device == "cuda" and "cuda" or "cpu")
  async.all_reduce(tp, t):wait()
  return e
end

pcall(ffi.cdef, "int getpid(void);")

-- Output buffer for `rows` rows of layer L: a host tensor [rows*d_out + 1]
-- (and its device twin in cuda mode), reused while big enough.
function E:buffers(n)
  local b = self._buf
  if b and b.n >= n then return b end
  local T = weft.tensor
  b = { n = math.max(n, 1024) }
  b.host = T.zeros({ b.n }, "f32")
  b.f = ffi.cast("float *", b.host.ptr)
  if self.device == "cuda" then b.dev = T.zeros({ b.n }, "f32", "cuda") end
  self._buf = b
  return b
end

-- Computes this rank's partial outputs of msg into a tensor view of n
-- floats (rows*d_out + 1, the last one the step number); returns the
-- tensor to all-reduce and the host pointer of the answer.
function E:partial(msg)
  local L = self.layers[msg.l] or self.layers.linear
  local rows = msg.b or 0
  local n = rows * L.d_out + 1
  local b = self:buffers(n)
  if rows > 0 then
    local x = ffi.cast("const float *", ffi.cast("const char *", msg.x))
    model.partial(self.shards[L.name], x, rows, b.f)
  end
  b.f[n - 1] = msg.s
  local T = weft.tensor
  local host = T.wrap(b.host.ptr, { n }, "f32", "cpu", b.host)
  if self.device == "cuda" then
    local dev = T.wrap(b.dev.ptr, { n }, "f32", b.dev.device, b.dev)
    dev:copy_(host)
    return dev, host, n
  end
  return host, host, n
end

-- Worker ranks: the next step, or nil when none came within idle_ms.
function E:recv(idle_ms)
  if self.mq then
    local ok, msg = pcall(self.mq.recv_object, self.mq, idle_ms)
    if ok then return msg end
    if tostring(msg):find("timed out after", 1, true) then return nil end
    error(msg, 0)
  end
  return self.world:broadcast_object(nil, 0)
end

-- Worker ranks: run one step (blocking is fine here: nothing else to serve).
function E:execute(msg)
  if msg.slow and msg.slow.rank == self.rank and (msg.slow.ms or 0) > 0 then
    ffi.C.poll(nil, 0, math.min(msg.slow.ms, 120000))   -- debug: a slow step
  end
  local t = self:partial(msg)
  async.all_reduce(self.tp, t):wait()
  self.step = msg.s
end

pcall(ffi.cdef, "int poll(void *fds, unsigned long n, int timeout);")

-- Rank 0: sends msg (async handle); the step goes to every worker.
function E:send(msg)
  if self.W == 1 then return async.completed(msg) end
  if self.mq then return async.mq_send(self.world, self.mq, msg) end
  return async.broadcast_object(self.world, msg, 0)
end

-- Rank 0: the all-reduce of this rank's partial (async handle).
function E:reduce(t)
  return async.all_reduce(self.tp, t)
end

M.Engine = E
M.serialize = serialize
return M
