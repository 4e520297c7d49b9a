-- serve_front — rank 0 inside nginx's single worker (OpenResty API).
--
--   init_by_lua:         require("serve_front")        (loads weft: no thread,
--                                                      no socket, no CUDA)
--   init_worker_by_lua:  serve_front.init_worker()    (a 0-delay timer brings
--                                                      the world up, then runs
--                                                      the step scheduler)
--   POST /v1/layer       serve_front.layer()          {"x":[...]|[[...],...], "layer":"linear"|"mlp"}
--   GET  /health         serve_front.health()
--   GET  /topology       serve_front.topology()
--
-- The event loop never blocks on weft: every collective is an async handle
-- polled with ngx.sleep(0) (then 1 ms sleeps) between tests. Requests queue
-- FIFO; the scheduler takes the queue's head and every following request of
-- the same layer (up to WEFT_SERVE_MAX_BATCH rows) as one step, so steps are
-- numbered in arrival order and each answer names its step.
--
-- Failure: if a collective fails (a rank died, a timeout), the world is
-- marked broken with the cause; the step's requests and every later one get
-- 503 with that message, /health keeps answering (status "broken").
local ffi = require("ffi")
local weft = require("weft")
local async = require("weft.async")
local json = require("serve_json")
local engine_mod = require("serve_engine")
local model = require("serve_model")

local ngx = ngx
local M = {}

local S = {
  status = "starting",   -- starting | ok | broken
  reason = nil,
  started = ngx and ngx.now() or 0,
  steps = 0, served = 0, rejected = 0, heartbeats = 0,
  queue = {}, qhead = 1, qtail = 0,
  in_step = nil,
  cfg = nil, e = nil,
}
M.state = S

local MAX_QUEUE = 4096
local MAX_ROWS_PER_REQUEST = 64

local function send(status, body, extra_headers)
  ngx.status = status
  ngx.header["Content-Type"] = "application/json"
  ngx.header["Content-Length"] = #body + 1
  if extra_headers then for k, v in pairs(extra_headers) do ngx.header[k] = v end end
  ngx.print(body, "\n")
  return ngx.exit(status)
end

local function reply(status, tbl, extra_headers)
  return send(status, json.encode(tbl), extra_headers)
end

local function log(fmt, ...)
  ngx.log(ngx.NOTICE, "weft-serve: ", fmt:format(...))
end

local now_ms = async.now_ms   -- monotonic, sub-millisecond (ngx.now() is cached per loop)

-- Between two tests of a handle: a 1 ms timer (Debian's nginx lacks the
-- patch that makes ngx.sleep(0) cheap).
local yield = async.ngx_yield(function(s) ngx.sleep(s) end, 0, 0.001)

---------------------------------------------------------------- bring-up
local function files_ready(dir, W)
  for r = 1, W - 1 do
    local f = io.open(("%s/ready.%d"):format(dir, r), "r")
    if not f then return false, r end
    f:close()
  end
  return true
end

local scheduler

local function boot(premature)
  if premature then return end
  local cfg = engine_mod.config()
  S.cfg = cfg
  local W = tonumber(os.getenv("WORLD_SIZE") or "1")
  -- wait (yielding) until every worker rank is about to connect, so that
  -- the blocking bring-up below only takes the time of its round trips
  if cfg.dir and W > 1 then
    local deadline = now_ms() + cfg.timeout_ms
    while true do
      local ok, missing = files_ready(cfg.dir, W)
      if ok then break end
      if now_ms() > deadline then
        S.status, S.reason = "broken", ("rank %d did not start within %d ms"):format(missing, cfg.timeout_ms)
        log("%s", S.reason)
        return
      end
      ngx.sleep(0.02)
    end
  end
  local ok, e = pcall(engine_mod.bringup, cfg)
  if not ok then
    S.status, S.reason = "broken", "bring-up failed: " .. tostring(e)
    log("%s", S.reason)
    return
  end
  S.e = e
  S.status = "ok"
  log("world of %d ranks up (device %s, channel %s)", e.W, e.device, cfg.channel)
  local tok, terr = ngx.timer.at(0, scheduler)
  if not tok then S.status, S.reason = "broken", "cannot start the scheduler: " .. tostring(terr) end
end

-- A worker started after the first one (nginx respawned it after a crash or
-- a kill, or a reload) is not rank 0 of the running world: that rank's store
-- and groups died with the old worker, and the worker ranks cannot be
-- rejoined. It must not try the bring-up (it would block its event loop for
-- the whole timeout waiting for ranks that never come): it says why at once.
local function respawned()
  local d = ngx.shared and ngx.shared.weft_serve
  if not d then return nil end
  local me = ffi.C.getpid()
  local n = d:incr("workers", 1, 0)
  local prev = d:get("worker_pid")
  d:set("worker_pid", me)
  if not n or n <= 1 then return nil end
  local how = prev and ffi.C.kill(prev, 0) ~= 0 and "died" or "was replaced"
  return ("the nginx worker was restarted: the previous worker (pid %s, weft rank 0) %s, and "
          .. "the world's store and groups with it; a new worker cannot rejoin the running "
          .. "ranks: restart the service (scripts/serve/start)"):format(tostring(prev), how)
end

function M.init_worker()
  local sem = require("ngx.semaphore")
  S.wake = sem.new(0)
  local why = respawned()
  if why then
    S.status, S.reason = "broken", why
    log("%s", why)
    return
  end
  local ok, err = ngx.timer.at(0, boot)
  if not ok then S.status, S.reason = "broken", "cannot start the bring-up timer: " .. tostring(err) end
end

---------------------------------------------------------------- steps
-- every job of the step not answered yet gets fields (answered = true, and
-- status and err, or step and batch) and its waiting request wakes
local function answer_jobs(jobs, fields)
  for _, j in ipairs(jobs) do
    if not j.answered then
      for k, v in pairs(fields) do j[k] = v end
      j.answered = true
      j.sema:post(1)
    end
  end
end

local function fail_jobs(jobs, status, msg) answer_jobs(jobs, { status = status, err = msg }) end

local function broken(msg)
  if S.status ~= "broken" then
    S.status, S.reason = "broken", msg
    log("world broken: %s", msg)
  end
end

-- One step: broadcast, compute rank 0's shard, all-reduce, answer.
local function run_step(jobs)
  local e = S.e
  local layer = jobs[1] and jobs[1].layer or "linear"
  local L = e.layers[layer]
  local rows, slow = 0, nil
  for _, j in ipairs(jobs) do rows = rows + j.rows; slow = slow or j.slow end
  local x = ffi.new("float[?]", math.max(1, rows * L.d_in))
  local k = 0
  for _, j in ipairs(jobs) do
    for _, row in ipairs(j.x) do
      for i = 1, L.d_in do x[k] = row[i]; k = k + 1 end
    end
  end
  S.steps = S.steps + 1
  local step = S.steps
  local msg = { s = step, l = layer, b = rows, x = ffi.string(x, rows * L.d_in * 4), slow = slow }
  S.in_step = { step = step, rows = rows, since = now_ms() }
  local ok, err = pcall(function()
    local hs = e:send(msg)
    local t, host, n = e:partial(msg)
    local hr = e:reduce(t)
    -- the all-reduce ends after every rank read the step, so once it is
    -- done the send is too: one poll loop
    async.poll_wait(hr, yield)
    async.poll_wait(hs, yield)
    if t ~= host then host:copy_(t) end
    local f = ffi.cast("float *", host.ptr)
    local check = f[n - 1]
    if check ~= step * e.W then
      error(("ranks out of step: check word %s, expected %d x %d"):format(tostring(check), e.W, step), 0)
    end
    local r = 0
    for _, j in ipairs(jobs) do
      j.y = {}
      for q = 1, j.rows do
        local y = {}
        for o = 0, L.d_out - 1 do y[o + 1] = f[r * L.d_out + o] end
        j.y[q] = y
        r = r + 1
      end
    end
  end)
  S.in_step = nil
  if not ok then
    err = tostring(err)
    local i = err:find("weft: ", 1, true)     -- the cause, without a source position
    broken(("step %d failed: %s"):format(step, i and err:sub(i) or err))
    fail_jobs(jobs, 503, S.reason)
    return false
  end
  answer_jobs(jobs, { step = step, batch = rows })
  if rows == 0 then S.heartbeats = S.heartbeats + 1 end
  return true
end

local function take_batch()
  local first = S.queue[S.qhead]
  if not first then return nil end
  local jobs, rows = {}, 0
  while S.qhead <= S.qtail do
    local j = S.queue[S.qhead]
    if j.layer ~= first.layer or (rows > 0 and rows + j.rows > S.cfg.max_rows) then break end
    S.queue[S.qhead] = nil
    S.qhead = S.qhead + 1
    if not j.answered then jobs[#jobs + 1] = j; rows = rows + j.rows end
  end
  if S.qhead > S.qtail then S.qhead, S.qtail = 1, 0 end
  return jobs
end

scheduler = function(premature)
  if premature then return end
  local hb = S.cfg.heartbeat_ms / 1000
  while not ngx.worker.exiting() and S.status == "ok" do
    local jobs = take_batch()
    if jobs then
      if #jobs > 0 then run_step(jobs) end
    else
      local ok = S.wake:wait(hb)
      if not ok and S.qhead > S.qtail and S.status == "ok" then run_step({}) end   -- heartbeat
    end
  end
  -- broken (or exiting): answer whatever still waits
  while true do
    local jobs = take_batch()
    if not jobs then break end
    fail_jobs(jobs, 503, S.reason or "server is shutting down")
  end
  if ngx.worker.exiting() and S.e and S.e.mq and S.status == "ok" then
    pcall(function() S.e:send({ stop = true }) end)
  end
end

---------------------------------------------------------------- requests
local function bad(msg) return reply(400, { error = msg }) end

local function parse_rows(x, L)
  if type(x) ~= "table" or #x == 0 then return nil, "\"x\" must be a non-empty array of numbers (or of rows)" end
  local rows = x
  if type(x[1]) ~= "table" then rows = { x } end
  if #rows > MAX_ROWS_PER_REQUEST then
    return nil, ("over-size tensor: %d rows, at most %d per request"):format(#rows, MAX_ROWS_PER_REQUEST)
  end
  for r, row in ipairs(rows) do
    if type(row) ~= "table" then return nil, ("row %d is not an array"):format(r) end
    if #row ~= L.d_in then
      local what = #row > L.d_in and "over-size tensor: " or ""
      return nil, ("%srow %d has %d elements; layer '%s' takes %d"):format(what, r, #row, L.name, L.d_in)
    end
    for i = 1, L.d_in do
      local v = row[i]
      if type(v) ~= "number" then return nil, ("row %d element %d is not a number"):format(r, i) end
      if v ~= v or v > 3.4e38 or v < -3.4e38 then return nil, ("row %d element %d is out of f32 range"):format(r, i) end
    end
  end
  return rows
end

function M.layer()
  if ngx.req.get_method() ~= "POST" then
    return reply(405, { error = "POST a JSON body {\"x\": [...], \"layer\": \"linear\"|\"mlp\"}" })
  end
  ngx.req.read_body()
  local body = ngx.req.get_body_data()
  if not body then
    if ngx.req.get_body_file() then return bad("body too large") end
    return bad("empty body: expected JSON {\"x\": [...], \"layer\": \"linear\"|\"mlp\"}")
  end
  local ok, req = pcall(json.decode, body)
  if not ok then return bad(tostring(req)) end
  if type(req) ~= "table" or req[1] ~= nil then return bad("the body must be a JSON object") end
  local layers = S.e and S.e.layers or model.layers(S.cfg and S.cfg.hidden or tonumber(os.getenv("WEFT_SERVE_HIDDEN") or "256"))
  local lname = req.layer
  if lname == nil or lname == json.null then lname = "linear" end
  local L = type(lname) == "string" and layers[lname]
  if not L then return bad(("unknown layer %s (linear, mlp)"):format(json.encode(lname))) end
  local rows, why = parse_rows(req.x, L)
  if not rows then return bad(why) end
  local slow
  if req.debug ~= nil and req.debug ~= json.null then
    if not (S.cfg and S.cfg.debug) then return bad("\"debug\" needs the server started with --debug") end
    local d = req.debug
    if type(d) ~= "table" or type(d.slow_ms) ~= "number" or type(d.rank) ~= "number" then
      return bad("\"debug\" must be {\"slow_ms\": N, \"rank\": R}")
    end
    slow = { ms = d.slow_ms, rank = d.rank }
  end
  if S.status == "broken" then return reply(503, { error = S.reason }) end
  if S.status ~= "ok" then return reply(503, { error = "weft is starting (world not up yet)" }, { ["Retry-After"] = "1" }) end
  if S.qtail - S.qhead + 1 >= MAX_QUEUE then
    S.rejected = S.rejected + 1
    return reply(503, { error = "overloaded: " .. MAX_QUEUE .. " requests queued" }, { ["Retry-After"] = "1" })
  end
  local sem = require("ngx.semaphore")
  local job = { layer = L.name, x = rows, rows = #rows, slow = slow, sema = sem.new(0), t0 = now_ms() }
  S.qtail = S.qtail + 1
  S.queue[S.qtail] = job
  S.wake:post(1)
  local wait_s = (S.cfg.timeout_ms + 5000 + (slow and slow.ms or 0)) / 1000
  local got, werr = job.sema:wait(wait_s)
  if not got then
    job.answered = true
    return reply(503, { error = ("no answer within %d ms (%s); the world may be stuck"):format(wait_s * 1000, tostring(werr)) })
  end
  if job.err then return reply(job.status or 503, { error = job.err }) end
  S.served = S.served + 1
  local y = job.y
  if type(req.x[1]) ~= "table" then y = y[1] end
  return reply(200, { step = job.step, batch = job.batch, layer = L.name, world = S.e.W,
                      device = S.e.device, us = math.floor((now_ms() - job.t0) * 1000), y = y })
end

local function group_info(g, e)
  local info = { name = g.unique_name, ranks = g.ranks, size = g.world_size, rank_in_group = g.rank_in_group }
  if g.destroyed then info.state = "destroyed"
  elseif S.status == "broken" then info.state = "broken"
  else info.state = "ok" end
  local okb, be = pcall(function()
    local t = weft.tensor.empty({ 1 }, "f32", e.device == "cuda" and "cuda" or "cpu")
    return weft.policy.select(g, "all_reduce", t, "sum")
  end)
  info.backend = okb and be or "?"
  if g == e.tp and e.device == "cuda" and g.device_group then info.backend = "nccl" end
  info.async = async.stats(g)
  return info
end

function M.health()
  local e = S.e
  local body = {
    status = S.status, error = S.reason, rank = 0, pid = ffi.C.getpid(),
    world_size = tonumber(os.getenv("WORLD_SIZE") or "1"),
    uptime_s = math.floor(ngx.now() - S.started),
    steps = S.steps, served = S.served, heartbeats = S.heartbeats, rejected = S.rejected,
    queued = S.qtail - S.qhead + 1,
    in_step = S.in_step and { step = S.in_step.step, rows = S.in_step.rows,
                              ms = math.floor(now_ms() - S.in_step.since) } or json.null,
  }
  if e then
    body.device, body.channel, body.hidden = e.device, S.cfg.channel, S.cfg.hidden
    body.ranks = e.peers
    body.groups = { group_info(e.world, e) }
    if e.tp ~= e.world then body.groups[2] = group_info(e.tp, e) end
    body.layers = {}
    for name, L in pairs(e.layers) do body.layers[name] = { d_in = L.d_in, d_out = L.d_out } end
  end
  return reply(S.status == "ok" and 200 or 503, body)
end

function M.topology()
  local plan = weft.plan()
  if not plan then return reply(503, { error = S.reason or "weft is starting" }) end
  return send(200, weft.topology.to_json(plan))
end

pcall(ffi.cdef, "int getpid(void);")
pcall(ffi.cdef, "int kill(int pid, int sig);")
return M
