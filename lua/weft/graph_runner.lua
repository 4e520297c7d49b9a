-- weft.graph_runner — CUDA graphs of a step function for a list of batch
-- sizes, replayed by size (SGLang's CudaGraphRunner, over weft.graph).
--
--   local runner = weft.graph_runner.new{
--     sizes = {1, 2, 4, 8, 16},                 -- increasing; captured largest first
--     alloc = function(max_bs) return {x = ..., res = ...} end,  -- static buffers, once
--     step  = function(bs, bufs, ctx) ... return outputs end,    -- uses rows [0, bs)
--     groups = {tp},                            -- default: weft.graph's default set
--     fusion = {hidden = 4096, dtype = "bf16"}, -- pre-initialize fused workspaces
--     warmup = 2,                               -- eager runs before each capture
--   }
--   local out, padded = runner:run(5, function(bufs, bs, padded) ... end)
--   runner:verify(8)                            -- replays against eager runs
--   runner:destroy()
--
-- step(bs, bufs, ctx): ctx.mode is "eager" in warmups and verify's eager
-- runs, "graph" while captured; ctx.note(text) adds a line of the step's own
-- to every watched group's record (see 4.). It returns the outputs (a tensor or a table of
-- them), kept per size: run() returns them sliced to the rows asked for.
--
-- What new() does, in order (collective over the check group, see below):
--  1. the size list is validated (non-empty, positive integers, strictly
--     increasing) and compared across ranks, before anything runs;
--  2. alloc(max_bs) makes the static buffers (a table of tensors, or any
--     value; tensors whose first dim is max_bs get padded rows, see run);
--  3. fusion workspaces are pre-initialized for max_bs x tokens_per_item
--     tokens (making one runs collectives, which a capture forbids): each
--     group's own, through weft.backends.device_backends.prepare (the workspace its
--     fused calls use), or opts.fusion.ctx's pre_initialize_workspaces;
--  4. for each size, largest first: `warmup` eager runs and one capture of
--     step(bs, bufs, ctx) on the runner's capture stream (weft.graph.capture,
--     groups entered once each), then the ranks all-gather what they
--     captured: ok or the error, and per watched group a digest of what went
--     through it (op, dtype, element count, in order; ctx.note(s) adds a line
--     of the step's own to every group's). If any rank failed, or two ranks
--     of one group captured different work on it, every rank destroys what
--     it captured and raises an error naming the group, the ranks that differ
--     and what each captured, instead of leaving a graph that would hang at
--     replay (M.capture_verdict, a pure function of the gathered list).
--
-- One memory pool for all the runner's graphs: device blocks allocated while
-- one of its graphs is captured (outputs, intermediates, scratch of the
-- backends) belong to the runner. A block freed during or after a capture
-- goes back to the runner's own free list, where the next (smaller) capture
-- reuses it; nothing the graphs write is handed to anybody else before
-- runner:destroy(). As with SGLang's shared pool, the graphs never run at the
-- same time and a replay's outputs are valid until the next run.
--
-- The check group: opts.check_group (a GroupCoordinator or a weft.cpugroup),
-- else the world group when weft.init() ran, else the first group in
-- opts.groups with a cpu group; none (one process): no comparison. The
-- ranks gathered are the check group's; what must be equal is compared
-- within each watched group among those ranks, never across two groups:
-- at TP 2 x PP 2 with groups = {tp}, tp.0 and tp.1 each agree within
-- themselves, while the world still agrees on the size list and on whether
-- every capture succeeded, so no rank keeps a graph another dropped.
-- opts.backend replaces the CUDA side (tests: tests/unit/graph_runner_spec.lua).
local M = {}

local type, tostring, error, pcall, ipairs, pairs = type, tostring, error, pcall, ipairs, pairs
local fmt, concat, floor = string.format, table.concat, math.floor
local show = require("weft.internal.show").value -- names a refused value's type
local E = require("weft.internal.errors")
local unpack = unpack or table.unpack

local R = {}
R.__index = R
M.Runner = R

-- "weft: graph_runner.<op>: <msg>"; level as weft.internal.errors.fail's (default 1),
-- + 1 for this frame; 0: no position (cross-rank outcomes are nobody's call site)
local function fail(op, msg, level)
  level = level or 1
  E.fail(level == 0 and 0 or level + 1, "graph_runner." .. op, "%s", msg)
end

local function list_str(t)
  local s = {}
  for i = 1, #t do s[i] = tostring(t[i]) end
  return "{" .. concat(s, ",") .. "}"
end

---------------------------------------------------------------- sizes

-- validate_sizes(sizes) -> a copy; raises on an empty, unsorted or bad list.
function M.validate_sizes(sizes, op)
  op = op or "new"
  if type(sizes) ~= "table" then
    fail(op, "sizes must be a list of batch sizes such as {1, 2, 4, 8}, got " .. type(sizes), 3)
  end
  if #sizes == 0 then
    fail(op, "the capture size list is empty: give the batch sizes to capture, such as {1, 2, 4, 8}", 3)
  end
  local out = {}
  for i = 1, #sizes do
    local s = sizes[i]
    if type(s) ~= "number" or s ~= floor(s) or s < 1 then
      fail(op, fmt("size %d of the capture list is %s: sizes must be positive integers", i, show(s)), 3)
    end
    if i > 1 and s <= sizes[i - 1] then
      fail(op, fmt("the capture size list %s is not sorted: %d at position %d follows %d "
                   .. "(give increasing sizes without repeats; they are captured largest first)",
                   list_str(sizes), s, i, sizes[i - 1]), 3)
    end
    out[i] = s
  end
  return out
end

-- Smallest captured size >= bs (sizes increasing), or nil when bs is larger.
function M.padded_size(sizes, bs)
  local lo, hi = 1, #sizes
  if bs > sizes[hi] then return nil end
  while lo < hi do
    local mid = floor((lo + hi) / 2)
    if sizes[mid] >= bs then hi = mid else lo = mid + 1 end
  end
  return sizes[lo]
end

---------------------------------------------------------------- digest

-- 32-bit FNV-1a, exact in doubles (h * 16777619 split as h << 24 + h * 403).
local bit = require("bit")
local bxor, lshift, tobit = bit.bxor, bit.lshift, bit.tobit
local function fnv(h, s)
  for i = 1, #s do
    h = bxor(h, s:byte(i))
    h = tobit(lshift(h, 24) + h * 403)
  end
  return h
end

local Rec = {}
Rec.__index = Rec

local function new_rec()
  return setmetatable({ active = false, depth = 0, n = 0, h = tobit(2166136261), lines = {},
                        per_group = {}, seqs = {}, nseqs = 0 }, Rec)
end

-- One sequence per watched group (instrument opens it, empty, so that a
-- group the step never called is still reported): name, its members (world
-- ranks, when the group lists them), and what went through it in order.
function Rec:open(key, name, members)
  if self.seqs[key] then return end
  self.seqs[key] = { name = name, members = members, n = 0, calls = 0, notes = 0,
                     h = tobit(2166136261), lines = {} }
  self.nseqs = self.nseqs + 1
end

local function seq_add(q, line, is_note)
  q.n = q.n + 1
  if is_note then q.notes = q.notes + 1 else q.calls = q.calls + 1 end
  q.h = fnv(q.h, line .. "\n")
  if #q.lines < 8 then q.lines[#q.lines + 1] = line end
end

-- a collective of group `key` (gname: its name), or (key nil) a note of the
-- step's own: a note enters every watched group's sequence (what the step
-- does between a group's collectives must match on that group's ranks), or
-- the "step" sequence when no group is watched
function Rec:add(line, gname, key)
  self.n = self.n + 1
  self.h = fnv(self.h, line .. "\n")
  if #self.lines < 8 then self.lines[#self.lines + 1] = line end
  if gname then self.per_group[gname] = (self.per_group[gname] or 0) + 1 end
  if key then
    seq_add(self.seqs[key], line, false)
  else
    if self.nseqs == 0 then self:open("(step)", "(step)", nil) end
    for _, q in pairs(self.seqs) do seq_add(q, line, true) end
  end
end

function Rec:summary()
  local groups = {}
  for k, q in pairs(self.seqs) do
    groups[k] = { name = q.name, members = q.members, n = q.n, calls = q.calls, notes = q.notes,
                  digest = bit.tohex(q.h), lines = q.lines }
  end
  return { n = self.n, digest = bit.tohex(self.h), lines = self.lines, per_group = self.per_group,
           groups = groups }
end

-- Group methods whose calls during a capture enter the digest (the outermost
-- call only: all_gather_into_tensor calling all_gather counts once).
M.COUNTED = { "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
              "reduce_scatter_tensor", "broadcast", "gather", "send", "recv", "all_to_all_single",
              "fused_allreduce_rmsnorm", "barrier", "broadcast_object", "all_gather_object",
              "send_object", "recv_object", "broadcast_tensor_dict", "send_tensor_dict",
              "recv_tensor_dict" }

local function describe_arg(a)
  if type(a) == "table" and a.dtype ~= nil and a.numel ~= nil then
    return fmt("%s x%d", tostring(a.dtype), a.numel)
  end
  return type(a)
end

local function pack(...) return { n = select("#", ...), ... } end

-- A watched group's identity in the digests: its name, the key its sequence
-- is compared under (name and members: two groups of one name, e.g. groups
-- of size 1, stay apart) and its members (world ranks) when it lists them.
function M.group_key(g)
  local gname = tostring(g.unique_name or g.name or "group")
  local r = rawget(g, "ranks") or g.ranks
  local members
  if type(r) == "table" and #r > 0 then
    members = {}
    for i = 1, #r do
      if type(r[i]) ~= "number" then members = nil; break end
      members[i] = r[i]
    end
  end
  return gname, members and (gname .. "[" .. concat(members, ",") .. "]") or gname, members
end

-- Shadows the counted methods of each distinct group with instance fields
-- for the duration of a capture; returns the function that removes them.
local function instrument(groups, rec)
  local undo, seen = {}, {}
  for _, g in ipairs(groups or {}) do
    if type(g) == "table" and not seen[g] then
      seen[g] = true
      local gname, key, members = M.group_key(g)
      rec:open(key, gname, members)
      for _, name in ipairs(M.COUNTED) do
        local orig, raw = g[name], rawget(g, name)
        if type(orig) == "function" then
          rawset(g, name, function(self, ...)
            if rec.active and rec.depth == 0 then
              rec:add(fmt("%s %s %s", gname, name, describe_arg((...))), gname, key)
            end
            rec.depth = rec.depth + 1
            local r = pack(pcall(orig, self, ...))
            rec.depth = rec.depth - 1
            if not r[1] then error(r[2], 0) end
            return unpack(r, 2, r.n)
          end)
          undo[#undo + 1] = { g, name, raw }
        end
      end
    end
  end
  return function()
    for i = #undo, 1, -1 do rawset(undo[i][1], undo[i][2], undo[i][3]) end
  end
end

---------------------------------------------------------------- memory pool

-- One interposer per cuda module table: while a pool is active, device
-- allocations come from (and are recorded in) it; frees of its blocks return
-- to its free list. Everything else passes through unchanged.
local ffi = require("ffi")
local fill_bytes = require("weft.internal.hostmem").fill -- any size (ffi.fill stops at 2^31)
local function key_of(p) return tonumber(ffi.cast("uintptr_t", p)) end

local hooks = setmetatable({}, { __mode = "k" })

local function interpose(cuda)
  local h = hooks[cuda]
  if h then return h end
  h = { orig_alloc = cuda.alloc, orig_free = cuda.free, active = nil, owner = {} }
  hooks[cuda] = h
  cuda.alloc = function(nbytes, dev)
    local pool = h.active
    if pool then return pool:alloc(nbytes, dev) end
    return h.orig_alloc(nbytes, dev)
  end
  cuda.free = function(p, dev)
    if p ~= nil then
      local pool = h.owner[key_of(p)]
      if pool then return pool:give_back(key_of(p)) end
    end
    return h.orig_free(p, dev)
  end
  return h
end

local Pool = {}
Pool.__index = Pool
M.Pool = Pool

function M.new_pool(cuda)
  local h = interpose(cuda)
  return setmetatable({ hook = h, blocks = {}, free_list = {}, bytes = 0, reused = 0, allocs = 0 }, Pool)
end

function Pool:alloc(nbytes, dev)
  -- best fit among the free blocks of this device, wasting at most 25 %
  local best, bi
  for i, b in ipairs(self.free_list) do
    if b.dev == dev and b.n >= nbytes and b.n <= nbytes * 1.25 + 4096 and (not best or b.n < best.n) then
      best, bi = b, i
    end
  end
  if best then
    table.remove(self.free_list, bi)
    self.reused = self.reused + 1
    return best.ptr
  end
  local p = self.hook.orig_alloc(nbytes, dev)
  local k = key_of(p)
  self.blocks[k] = { ptr = p, n = nbytes, dev = dev, key = k }
  self.hook.owner[k] = self
  self.bytes = self.bytes + nbytes
  self.allocs = self.allocs + 1
  return p
end

function Pool:give_back(k)
  local b = self.blocks[k]
  if b then self.free_list[#self.free_list + 1] = b end
end

function Pool:activate() self.hook.active = self end
function Pool:deactivate() if self.hook.active == self then self.hook.active = nil end end

-- After the graphs are gone: free blocks go back to the device pool; blocks
-- still held by live tensors are disowned (their later free is ordinary).
function Pool:release()
  self:deactivate()
  for _, b in ipairs(self.free_list) do
    self.hook.owner[b.key] = nil
    self.blocks[b.key] = nil
    self.hook.orig_free(b.ptr, b.dev)
  end
  self.free_list = {}
  for k in pairs(self.blocks) do self.hook.owner[k] = nil end
  self.blocks = {}
end

---------------------------------------------------------------- CUDA backend

local function is_tensor(t)
  return type(t) == "table" and t.dtype ~= nil and t.shape ~= nil and t.numel ~= nil
end

local FLOAT_CODES = { f32 = 0, f16 = 1, bf16 = 2 }

local capture_streams = {}   -- device -> the runners' capture stream

local function cuda_backend()
  local cuda = require("weft.cuda")
  local graph = require("weft.graph")
  local wffi = require("weft.internal.ffi")
  local C = wffi.C
  local B = { name = "cuda", cuda = cuda }
  function B.check() if not cuda.available() then fail("new", "no CUDA device", 4) end end
  -- one capture stream per device for every runner, never destroyed: a
  -- kernel handle may remember the stream of its last call (weft_ar does),
  -- and a destroyed stream's handle must not be asked about later
  function B.new_stream()
    local dev = cuda.current_device()
    local st = capture_streams[dev]
    if not st then st = cuda.stream(); capture_streams[dev] = st end
    return st
  end
  function B.destroy_stream() end
  function B.capture(fn, o) return graph.capture(fn, o) end
  -- the seed's graph_capture set (TP, PP, ...; the world without model parallel)
  function B.default_groups() return graph.default_groups and graph.default_groups() or {} end
  -- a group's device state for captures, fusion workspace included (the
  -- fused path's own context, so the workspace made is the one it uses)
  function B.prepare(g, fusion)
    local ok, db = pcall(require, "weft.backends.device_backends")
    if ok and type(db) == "table" and db.prepare then db.prepare(g, { fusion = fusion }) end
  end
  function B.capturing() return graph.capturing() end
  function B.current_stream() return cuda.current_stream() end
  function B.synchronize() cuda.synchronize() end
  -- zero rows [from, to) of t's first dimension
  function B.pad_rows(t, from, to)
    local row = t.nbytes / t.shape[1]
    local p = ffi.cast("uint8_t *", t.ptr) + from * row
    if t.device == "cpu" then fill_bytes(p, (to - from) * row, 0)
    else cuda.memset(p, 0, (to - from) * row) end
  end
  -- random values in rows [0, rows) of a float tensor (other dtypes untouched)
  function B.fill_rows(t, rows, seed)
    local code = FLOAT_CODES[t.dtype]
    if not code or rows == 0 then return end
    local count = t.numel / t.shape[1] * rows
    if t.device == "cpu" then
      wffi.check(C.weft_host_fill_random(t.ptr, count, code, seed, 0), "graph_runner fill")
    else
      cuda.fill_random(t.ptr, count, code, seed, 0)
    end
  end
  return B
end
M.cuda_backend = cuda_backend

---------------------------------------------------------------- cross-rank

-- The cpu group that compares captures, or nil (one process).
local function check_group_of(o)
  local function cpu_of(g)
    if type(g) ~= "table" then return nil end
    if g.cpu_group ~= nil then return g.cpu_group end
    if type(g.allgather) == "function" and g.handle ~= nil then return g end
    return nil
  end
  if o.check_group ~= nil then
    local c = cpu_of(o.check_group)
    if not c and not (o.check_group.world_size == 1 or o.check_group.size == 1) then
      fail("new", "check_group has no cpu group (give a GroupCoordinator or a weft.cpugroup)", 4)
    end
    return c
  end
  local ok, dist = pcall(require, "weft.dist")
  if ok and type(dist) == "table" and dist.get_or_nil then
    local w = dist.get_or_nil("world")
    if w and w.world_size and w.world_size > 1 and w.cpu_group then return w.cpu_group end
  end
  for _, g in ipairs(o.groups or {}) do
    local c = cpu_of(g)
    if c then return c end
  end
  return nil
end

local function ranks_of(cg)
  local r = cg.ranks or {}
  local n = cg.size or cg.world_size or #r
  local out = {}
  for i = 1, n do out[i] = r[i] or (i - 1) end
  return out
end

local serialize
local function ser()
  if not serialize then serialize = require("weft.serialize") end
  return serialize
end

-- all-gather v; -> array of decoded values (index = group position + 1)
local function gather(cg, v)
  if not cg then return { v } end
  local s = ser()
  local list = cg:allgather(s.encode(v))
  local out = {}
  for i = 1, #list do out[i] = s.decode(list[i]) end
  return out
end

-- Classes of equal keys -> the largest class first: { {key=, members={i...}}, ... }
local function classes(keys)
  local by, order = {}, {}
  for i, k in ipairs(keys) do
    if not by[k] then by[k] = {}; order[#order + 1] = k end
    by[k][#by[k] + 1] = i
  end
  local out = {}
  for _, k in ipairs(order) do out[#out + 1] = { key = k, members = by[k] } end
  table.sort(out, function(a, b)
    if #a.members ~= #b.members then return #a.members > #b.members end
    return a.members[1] < b.members[1]
  end)
  return out
end

local function rank_list(ranks, members)
  local s = {}
  for i, m in ipairs(members) do s[i] = tostring(ranks[m]) end
  return (#s == 1 and "rank " or "ranks ") .. concat(s, ",")
end

-- capture_verdict(bs, all, ranks) -> nil when every rank keeps its graph of
-- batch size bs, else the message every rank raises. all[i] is what check
-- group position i captured ({ok=, err=, sum=} with sum = Rec:summary()),
-- ranks[i] its world rank. Pure: every rank gets the same all-gathered list
-- and so the same answer, so the ranks keep or drop the size together.
--  * a capture failed anywhere in the check group: every rank drops it;
--  * else, per watched group: the group's members in the check group (every
--    rank that reports it, when the group does not list its members) must
--    have captured the same sequence on it (op, dtype, element count, in
--    order, notes included). Different groups are never compared with each
--    other: at TP 2 x PP 2, tp.0 (ranks 0,1) and tp.1 (ranks 2,3) each agree
--    within themselves. A member that does not watch a group the others
--    issued collectives on differs too.
function M.capture_verdict(bs, all, ranks)
  local bad = {}
  for i, s in ipairs(all) do if not s.ok then bad[#bad + 1] = i end end
  if #bad > 0 then
    local parts = {}
    for _, i in ipairs(bad) do parts[#parts + 1] = fmt("rank %s: %s", tostring(ranks[i]), tostring(all[i].err)) end
    return fmt("capture of batch size %d failed on %s (%s); every rank dropped its graphs",
               bs, rank_list(ranks, bad), concat(parts, "; "))
  end
  local pos = {}
  for i = 1, #all do pos[ranks[i] or (i - 1)] = i end
  local keys, first = {}, {}
  for _, s in ipairs(all) do
    for k, q in pairs(s.sum.groups or {}) do
      if not first[k] then first[k] = q; keys[#keys + 1] = k end
    end
  end
  table.sort(keys)
  local reports = {}
  for _, k in ipairs(keys) do
    local q0 = first[k]
    local who = {}
    if q0.members then
      for _, r in ipairs(q0.members) do if pos[r] then who[#who + 1] = pos[r] end end
    else
      for i, s in ipairs(all) do if (s.sum.groups or {})[k] then who[#who + 1] = i end end
    end
    table.sort(who)
    local any_calls = false
    for _, i in ipairs(who) do
      local q = (all[i].sum.groups or {})[k]
      if q and q.calls > 0 then any_calls = true end
    end
    local idx, ids = {}, {}
    for _, i in ipairs(who) do
      local q = (all[i].sum.groups or {})[k]
      if q then idx[#idx + 1] = i; ids[#ids + 1] = q.digest .. "/" .. q.n
      elseif any_calls then idx[#idx + 1] = i; ids[#ids + 1] = "unwatched" end
    end
    local cl = classes(ids)
    if #cl > 1 then
      local parts, differ = {}, {}
      for c = 1, #cl do
        local m = {}
        for j, x in ipairs(cl[c].members) do m[j] = idx[x] end
        cl[c].ranks = m
        if c > 1 then for _, x in ipairs(m) do differ[#differ + 1] = x end end
        if cl[c].key == "unwatched" then
          parts[#parts + 1] = fmt("%s did not watch %s (not among the runner's groups there)",
                                  rank_list(ranks, m), q0.name)
        else
          local q = all[m[1]].sum.groups[k]
          parts[#parts + 1] = fmt("%s captured %d collective(s) on %s%s, digest %s%s", rank_list(ranks, m),
                                  q.calls, q.name, q.notes > 0 and fmt(" and %d note(s)", q.notes) or "",
                                  q.digest, #q.lines > 0 and (" [" .. concat(q.lines, "; ") .. "]") or "")
        end
      end
      table.sort(differ)
      reports[#reports + 1] = fmt("%s %s from %s in %s (%s)", rank_list(ranks, differ),
                                  #differ == 1 and "differs" or "differ", rank_list(ranks, cl[1].ranks),
                                  k == "(step)" and "the step's notes" or ("group " .. q0.name),
                                  concat(parts, "; "))
    end
  end
  if #reports == 0 then return nil end
  return fmt("ranks captured different work at batch size %d: %s; replaying would hang or mix up "
             .. "collectives, so every rank dropped its graphs", bs, concat(reports, " | "))
end

---------------------------------------------------------------- runner

local function each_tensor(v, fn)
  if is_tensor(v) then fn(v); return end
  if type(v) == "table" then
    for _, x in pairs(v) do if is_tensor(x) then fn(x) end end
  end
end

-- new{sizes=, step=, alloc=, groups=, fusion=, warmup=2, check_group=,
--     pad=nil|false|function(bufs, bs, padded), slice=true, stream=, backend=}
function M.new(o)
  if type(o) ~= "table" then fail("new", "expected a table of options", 2) end
  local sizes = M.validate_sizes(o.sizes, "new")
  if type(o.step) ~= "function" then fail("new", "step must be a function(bs, bufs, ctx)", 2) end
  if o.alloc ~= nil and type(o.alloc) ~= "function" then fail("new", "alloc must be a function(max_bs)", 2) end
  local self = setmetatable({
    sizes = sizes, max_bs = sizes[#sizes], step = o.step, opts = o,
    backend = o.backend or cuda_backend(),
    warmup = o.warmup or 2,
    graphs = {}, outputs = {}, order = {}, summaries = {},
    stats = { replays = {}, runs = 0, padded_runs = 0 },
    destroyed = false,
  }, R)
  if self.backend.check then self.backend.check() end
  -- the groups entered around each capture and whose collectives are
  -- compared: opts.groups, else the seed's default set (weft.graph)
  self.groups = o.groups or (self.backend.default_groups and self.backend.default_groups()) or {}
  self.cg = check_group_of(o)
  self.ranks = self.cg and ranks_of(self.cg) or { 0 }
  if o.capture ~= false then self:capture() end
  return self
end

-- Everyone agrees on the size list before any step runs (a rank with another
-- list would otherwise meet the others' collectives at the wrong sizes).
function R:_agree_sizes()
  local all = gather(self.cg, concat(self.sizes, ","))
  local cl = classes(all)
  if #cl > 1 then
    local parts = {}
    for _, c in ipairs(cl) do parts[#parts + 1] = rank_list(self.ranks, c.members) .. ": {" .. c.key .. "}" end
    fail("capture", "ranks were given different capture size lists (" .. concat(parts, "; ")
         .. "); nothing was captured", 0)
  end
end

-- Fusion workspaces before the first capture (making one is collective).
-- opts.fusion = {hidden=, dtype=, max_tokens= (default max_bs x
-- tokens_per_item), ctx= (a weft.fusion context; default: each group's own,
-- through weft.backends.device_backends.prepare, which is what its fused calls use)}
function R:_preinit_fusion()
  local f = self.opts.fusion
  if not f then return end
  local spec = { max_tokens = f.max_tokens or self.max_bs * (f.tokens_per_item or 1),
                 hidden = f.hidden, dtype = f.dtype }
  self.fusion_spec = spec
  if f.ctx == nil and self.backend.prepare then
    for _, g in ipairs(self.groups) do
      if type(g) == "table" and (g.world_size or 1) > 1 then self.backend.prepare(g, spec) end
    end
    return
  end
  local ctx = f.ctx or require("weft.fusion").default()
  local coord = f.attn_coord
  if coord == nil then
    for _, g in ipairs(self.groups) do
      if type(g) == "table" and (g.world_size or 1) > 1 then coord = g; break end
    end
  end
  self.fusion_state = ctx:pre_initialize_workspaces{
    max_tokens = spec.max_tokens, hidden = spec.hidden, dtype = spec.dtype, algo = f.algo,
    attn_coord = coord, moe_coord = f.moe_coord,
    oneshot_max_tokens = f.oneshot_max_tokens, timeout_ms = f.timeout_ms,
  }
end

function R:_capture_one(bs)
  local B = self.backend
  local rec = new_rec()
  local undo = instrument(self.groups, rec)
  local out
  local ctx = { bs = bs, runner = self, note = function(s) if rec.active then rec:add(tostring(s)) end end }
  local function fn()
    ctx.mode = B.capturing() and "graph" or "eager"
    rec.active = ctx.mode == "graph"
    local r = self.step(bs, self.bufs, ctx)
    if rec.active then out = r end
    rec.active = false
  end
  if self.pool then self.pool:activate() end
  local ok, g = pcall(B.capture, fn, { stream = self.stream, warmup = self.warmup, groups = self.groups,
                                      fusion = self.fusion_spec })
  if self.pool then self.pool:deactivate() end
  rec.active = false
  undo()
  if not ok then return nil, tostring(g), rec end
  return g, out, rec
end

-- Captures every size, largest first (new() calls it unless capture=false).
function R:capture()
  if self.destroyed then fail("capture", "runner was destroyed", 2) end
  if #self.order > 0 then fail("capture", "already captured", 2) end
  local B = self.backend
  self:_agree_sizes()
  if self.bufs == nil and self.opts.alloc then self.bufs = self.opts.alloc(self.max_bs) end
  self:_preinit_fusion()
  self.stream = self.opts.stream or (B.new_stream and B.new_stream()) or nil
  self.own_stream = self.opts.stream == nil and self.stream ~= nil
  if B.cuda then self.pool = M.new_pool(B.cuda) end
  for i = #self.sizes, 1, -1 do
    local bs = self.sizes[i]
    local g, out, rec = self:_capture_one(bs)
    local mine = { ok = g ~= nil, err = g == nil and out or nil, sum = rec:summary() }
    local all = gather(self.cg, mine)
    local msg = M.capture_verdict(bs, all, self.ranks)
    if msg then
      if g then g:destroy() end
      self:_teardown()
      fail("capture", msg, 0)
    end
    self.graphs[bs] = g
    self.outputs[bs] = out
    self.order[#self.order + 1] = bs
    self.summaries[bs] = mine.sum
  end
  return self
end

function R:padded_size(bs) return M.padded_size(self.sizes, bs) end

function R:_pad(bs, padded)
  local pad = self.opts.pad
  if pad == false or padded == bs then return end
  if type(pad) == "function" then pad(self.bufs, bs, padded); return end
  local B = self.backend
  each_tensor(self.bufs, function(t)
    if t.shape[1] == self.max_bs and B.pad_rows then B.pad_rows(t, bs, padded) end
  end)
end

local function slice(v, padded, bs)
  if bs == padded then return v end
  if is_tensor(v) then
    if v.shape[1] == padded and v.narrow then return v:narrow(0, 0, bs) end
    return v
  end
  if type(v) == "table" then
    local out = {}
    for k, x in pairs(v) do out[k] = slice(x, padded, bs) end
    return out
  end
  return v
end

local function check_bs(self, op, bs)
  if self.destroyed then fail(op, "runner was destroyed", 3) end
  if #self.order == 0 then fail(op, "nothing captured yet", 3) end
  if type(bs) ~= "number" or bs ~= floor(bs) or bs < 1 then
    fail(op, "batch size must be a positive integer, got " .. show(bs), 3)
  end
  if bs > self.max_bs then
    fail(op, fmt("batch size %d exceeds the largest captured size %d (captured %s)", bs, self.max_bs,
                 list_str(self.sizes)), 3)
  end
end

-- run(bs [, fill]) -> outputs (rows [0, bs) when slicing), padded size.
-- fill(bufs, bs, padded) writes the inputs' first bs rows; the rows up to the
-- padded size are zeroed (opts.pad: a function of its own, or false).
function R:run(bs, fill, stream)
  check_bs(self, "run", bs)
  local padded = self:padded_size(bs)
  if fill then fill(self.bufs, bs, padded) end
  self:_pad(bs, padded)
  self.graphs[padded]:replay(stream)
  self.stats.runs = self.stats.runs + 1
  if padded ~= bs then self.stats.padded_runs = self.stats.padded_runs + 1 end
  self.stats.replays[padded] = (self.stats.replays[padded] or 0) + 1
  local out = self.outputs[padded]
  if self.opts.slice == false then return out, padded end
  return slice(out, padded, bs), padded
end

-- The eager counterpart of run (same padding, no graph): for checks.
function R:run_eager(bs, fill)
  check_bs(self, "run_eager", bs)
  local padded = self:padded_size(bs)
  if fill then fill(self.bufs, bs, padded) end
  self:_pad(bs, padded)
  local out = self.step(padded, self.bufs, { bs = padded, mode = "eager", runner = self, note = function() end })
  if self.opts.slice == false then return out, padded end
  return slice(out, padded, bs), padded
end

local function flat_tensors(v)
  local out = {}
  if is_tensor(v) then return { v } end
  if type(v) == "table" then
    local keys = {}
    for k, x in pairs(v) do if is_tensor(x) then keys[#keys + 1] = k end end
    table.sort(keys, function(a, b) return tostring(a) < tostring(b) end)
    for _, k in ipairs(keys) do out[#out + 1] = v[k] end
  end
  return out
end

local TOL = { f32 = 1e-4, f16 = 2e-2, bf16 = 6e-2 }

-- verify([n [, {fill=, atol=, sizes=}]]) -> report {ok=, checked=, worst=, mismatches=}
-- n checks (default: every captured size once, then sizes in between, which
-- pad): fresh random inputs (per rank and check), replay, then the same
-- inputs through an eager step; outputs compared (max abs error <= atol,
-- default by dtype). All ranks agree on the outcome; a mismatch anywhere
-- raises on every rank, naming the size and the rank.
function R:verify(n, vo)
  vo = vo or {}
  if self.destroyed then fail("verify", "runner was destroyed", 2) end
  local B = self.backend
  local cases = vo.sizes
  if not cases then
    cases = {}
    for i = #self.sizes, 1, -1 do cases[#cases + 1] = self.sizes[i] end
    for i = #self.sizes, 1, -1 do
      local lo = i > 1 and self.sizes[i - 1] or 0
      if self.sizes[i] - 1 > lo then cases[#cases + 1] = self.sizes[i] - 1 end
    end
  end
  n = n or #cases
  local me = self.cg and (self.cg.my_index or self.cg.rank_in_group or 0) or 0
  local report = { ok = true, checked = 0, worst = 0, mismatches = {} }
  for i = 1, n do
    local bs = cases[(i - 1) % #cases + 1]
    local seed = (vo.seed or 4242) + 1000 * i + 17 * me
    local fill = vo.fill or self.opts.fill or function(bufs, rows)
      each_tensor(bufs, function(t)
        if t.shape[1] == self.max_bs and B.fill_rows then B.fill_rows(t, rows, seed) end
      end)
    end
    -- inputs once, kept aside: the step may work in place
    local padded = self:padded_size(bs)
    fill(self.bufs, bs, padded, seed)
    self:_pad(bs, padded)
    local saved = {}
    each_tensor(self.bufs, function(t) saved[#saved + 1] = { t, t:clone() } end)
    local g_out = self:run(bs)
    local got = {}
    for k, t in ipairs(flat_tensors(g_out)) do got[k] = t:clone() end
    for _, p in ipairs(saved) do p[1]:copy_(p[2]) end
    local e_out = self:run_eager(bs)
    local want = flat_tensors(e_out)
    if #want ~= #got then
      report.ok = false
      report.mismatches[#report.mismatches + 1] = fmt("batch size %d: replay gave %d output tensor(s), eager %d",
                                                     bs, #got, #want)
    end
    for k = 1, math.min(#got, #want) do
      local err = got[k]:compare(want[k])
      local tol = vo.atol or TOL[want[k].dtype] or 0
      report.checked = report.checked + 1
      if err > report.worst then report.worst = err end
      if not (err <= tol) then
        report.ok = false
        report.mismatches[#report.mismatches + 1] = fmt(
          "batch size %d (graph of %d): output %d max abs error %g > %g", bs, padded, k, err, tol)
      end
    end
    for _, t in ipairs(got) do t:free() end
    for _, p in ipairs(saved) do p[2]:free() end
  end
  collectgarbage()
  -- agree: every rank raises if any rank saw a mismatch
  local all = gather(self.cg, { ok = report.ok, m = report.mismatches })
  local bad, parts = {}, {}
  for r, s in ipairs(all) do
    if not s.ok then
      bad[#bad + 1] = r
      parts[#parts + 1] = fmt("rank %s: %s", tostring(self.ranks[r]), concat(s.m, "; "))
    end
  end
  if #bad > 0 then
    fail("verify", "replayed outputs differ from eager runs on " .. rank_list(self.ranks, bad)
         .. " (" .. concat(parts, " | ") .. ")", 0)
  end
  return report
end

function R:_teardown()
  for _, bs in ipairs(self.sizes) do
    local g = self.graphs[bs]
    if g then g:destroy() end
  end
  self.graphs, self.outputs = {}, {}
  if self.pool then self.pool:release(); self.pool = nil end
  if self.own_stream and self.stream and self.backend.destroy_stream then
    self.backend.destroy_stream(self.stream)
  end
  self.stream = nil
end

-- Local; idempotent. The static buffers stay with the caller's references.
function R:destroy()
  if self.destroyed then return end
  self.destroyed = true
  if self.backend.synchronize then pcall(self.backend.synchronize) end
  self:_teardown()
  self.order = {}
end

return M
