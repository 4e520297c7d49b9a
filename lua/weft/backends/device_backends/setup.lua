-- weft.backends.device_backends.setup — the per-group device state behind weft.backends.device_backends:
-- configuration, the group facts the device rules read (kind, custom
-- all-reduce enabled, CUDA present), set-up (NCCL communicator, custom
-- all-reduce workspace, fusion context, scratch), prepare, info and the
-- destroy / graph-enter hooks. weft.backends.device_backends re-exports its public
-- fields (config, setup, ensure_ar, prepare, info, ...); the rest is for the
-- sibling modules (weft.backends.device_backends.nccl_backend, weft.backends.device_backends.checks).
--
-- Lazy, collective set-up. A group's device state is made on its first
-- device collective: every rank of the group reaches it in that same call
-- (every rank calls the same collective), so it is agreed without an extra
-- round. It all-gathers (host, device, NCCL loadable) over the cpu group,
-- creates the NCCL communicator when every rank has its own GPU and NCCL,
-- and votes (AND) on the outcome, so all ranks use NCCL or all stage through
-- the host. The custom all-reduce workspace is made on the first all_reduce
-- the custom rule accepts (weft_ar_create agrees inside; one more AND vote
-- here): if it fails on any rank, every rank uses NCCL. A graph capture
-- cannot run these collectives: weft.graph.capture enters its groups (and
-- calls M.prepare) before it begins.
local ffi = require("ffi")
local policy = require("weft.policy")

local type, tostring, tonumber, error, pcall, ipairs, pairs = type, tostring, tonumber, error, pcall, ipairs, pairs
local fmt, floor, max = string.format, math.floor, math.max

local M = {}

---------------------------------------------------------------- lazy modules
local mods = {}
local function mod(name)
  local m = mods[name]
  if m == nil then m = require(name); mods[name] = m end
  return m
end
local function CUDA() return mod("weft.cuda") end
local function T() return mod("weft.tensor") end

---------------------------------------------------------------- configuration
local function env_num(name, default, lo)
  local v = tonumber(os.getenv(name) or "")
  if v == nil or v ~= floor(v) or v < (lo or 1) then return default end
  return v
end

local MIB = 1048576
-- custom_ar_max_bytes: the custom all-reduce workspace holds calls up to this
-- size, and the size rule lets every call that fits use it: on 2 x H200 weft's
-- auto beats NCCL at every size measured, 1 KiB to 256 MiB, eager and in
-- graphs (bench/results/ar-nvidia-h200-x2-2026-11-30.md). 64 MiB covers
-- 8192 tokens x 4096 hidden in bf16 at ~176 MiB of workspace per GPU (two
-- data parities of max_bytes plus 48 MiB of Lamport buffers, for 2 ranks).
-- fused_max_tokens: the fusion workspace's token capacity when the caller
-- declares no max_tokens; longer calls take the unfused path.
M.config = {
  custom_ar_max_bytes = env_num("WEFT_CUSTOM_AR_MAX_BYTES", 64 * MIB, 16),
  fused_max_tokens = env_num("WEFT_FUSION_MAX_TOKENS", 2048, 1),
}

-- Which groups use the custom all-reduce: the seed's use_custom_allreduce per
-- init_model_parallel_group (off for PP, attention TP, MoE EP and MoE TP).
-- weft also enables the world and custom groups (the seed does not): the
-- workspace is only made when such a group all-reduces device tensors.
-- g.use_custom_allreduce = true/false overrides this per group; a
-- policy.set{all_reduce = "oneshot"|...} override does too.
M.custom_ar_by_kind = {
  tp = true, pdmux_prefill_tp = true, dcp = true, attn_cp = true, moe_dp = true,
  pp = false, attn_tp = false, moe_ep = false, moe_tp = false,
}

local AR_WORLDS = { [2] = true, [4] = true, [6] = true, [8] = true }

local function is_device(t)
  return type(t) == "table" and t.device ~= nil and t.device ~= "cpu"
end
M.is_device = is_device

local cuda_ok_cache
local function cuda_ok()
  if cuda_ok_cache == nil then
    local ok, c = pcall(require, "weft.cuda")
    local ok2, avail = false, false
    if ok then ok2, avail = pcall(c.available) end
    cuda_ok_cache = ok2 and avail == true
  end
  return cuda_ok_cache
end
-- tests: pretend CUDA is (not) there; nil: ask again
function M._set_cuda_available(v) cuda_ok_cache = v end

local gname = require("weft.internal.errors").gname   -- a group's name in messages

local function group_kind(g)
  local k = g._kind
  if k == nil then
    local n = tostring(g.unique_name)
    k = n:match("^([%w_]+)%.%d+$") or (n == "world" and "world" or "custom")
    g._kind = k
  end
  return k
end

-- custom AR enabled on g? -> bool, source
local function ar_enabled(g)
  local u = g.use_custom_allreduce
  if u ~= nil then return u and true or false, "g.use_custom_allreduce" end
  local v = M.custom_ar_by_kind[group_kind(g)]
  if v == nil then return true, "weft default" end
  return v, "the seed's table"
end

---------------------------------------------------------------- host name
pcall(ffi.cdef, "int gethostname(char *name, size_t len);")
local function hostname()
  local buf = ffi.new("char[256]")
  if ffi.C.gethostname(buf, 255) == 0 then return ffi.string(buf) end
  return os.getenv("HOSTNAME") or "?"
end

---------------------------------------------------------------- device state
-- g._dev = { device, nccl (weft.nccl comm or nil), nccl_why, shared (text or
--   nil), own_nccl, ar (weft.backends.custom_ar or nil), ar_state (nil: not tried,
--   "ready", "failed" (creation, on every rank), "off", "broken" (a kernel failed on this rank)), ar_why, scratch = {}, retired = {} }

local function graph_refusal(g, op)
  error(fmt("weft: %s: group %s has not set up its device communicators, and a graph capture "
            .. "cannot (it needs collectives over the cpu group): pass the group to "
            .. "weft.graph.capture(fn, {groups = {...}}) (groups are set up before capture begins), "
            .. "call weft.backends.device_backends.prepare(g) on every rank first, or run the call once eagerly",
            op, gname(g)), 0)
end

---------------------------------------------------------------- shared-GPU test mode
-- WEFT_ALLOW_SHARED_GPU=1 (never on by default) lets ranks share a GPU so the
-- kernels' logic runs at worlds 4-8 on a machine with fewer GPUs. NCCL is not
-- created (it refuses duplicate GPUs); weft's kernels run only when every
-- rank has its own MPS slice (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, at most
-- 100 / ranks per GPU): the SM count a rank sees is then its slice, so every
-- grid is co-resident with the other ranks' (a one-shot spinning on a peer
-- whose blocks cannot be scheduled would only time out). scripts/weft-mps
-- starts MPS and sets both. Timings in this mode mean nothing.
local function shared_gpu_vote()
  local allow = os.getenv("WEFT_ALLOW_SHARED_GPU") == "1" and "1" or "0"
  return allow .. "/" .. (os.getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") or "")
end

local function rank_list(g, idx)
  local r = {}
  for _, i in ipairs(idx) do r[#r + 1] = tostring(g.ranks[i]) end
  return table.concat(r, ",")
end

local function shared_gpu_mode(g, d, sharers, votes, op)
  local on, off, most = {}, {}, 1
  for i, v in ipairs(votes) do
    if v:sub(1, 1) == "1" then on[#on + 1] = i else off[#off + 1] = i end
  end
  if #on == 0 then return end
  if #off > 0 then
    error(fmt("weft: %s: group %s: WEFT_ALLOW_SHARED_GPU=1 on ranks %s but not on ranks %s "
              .. "(set it for every rank or none)", op, gname(g), rank_list(g, on), rank_list(g, off)), 0)
  end
  for _, n in pairs(sharers) do if n > most then most = n end end
  local slice = {}
  for i, v in ipairs(votes) do
    local pct = tonumber(v:sub(3))
    if not pct or pct <= 0 or pct * most > 100 then slice[#slice + 1] = i end
  end
  d.shared_mode = fmt("shared-GPU test mode (WEFT_ALLOW_SHARED_GPU=1): up to %d ranks per GPU", most)
  if #slice > 0 then
    d.kernel_block = fmt("%s; ranks %s have no MPS slice of at most %d %% "
                         .. "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; scripts/weft-mps sets it)",
                         d.shared, rank_list(g, slice), floor(100 / most))
  else
    d.kernels_shared_ok = true
  end
end

---------------------------------------------------------------- deterministic mode
-- The switch (weft.policy.deterministic) is local; the group agrees on it
-- here, so that no rank runs weft's kernels in one mode while a peer runs
-- them (or NCCL) in the other. Two places, both collective calls every rank
-- makes anyway, so the agreement adds no round that one rank could enter
-- alone:
--  * the group's first device call (setup): each rank's value rides on the
--    set-up all-gather; mixed -> every rank raises, naming both sides;
--  * policy.set{deterministic = v, group = g} (collective over g): an
--    all-gather of v, bounded by the group's timeout; mixed -> raises on
--    every rank, and nothing is stored.
-- A later local change (policy.set without the group object, on some rank)
-- never starts a collective: the next device call of the group raises
-- before it enqueues anything, naming the agreed value and how to change it.
local function determ_votes_error(g, votes, op)
  local on, off, bad = {}, {}, {}
  for i, v in ipairs(votes) do
    if v == "1" then on[#on + 1] = i elseif v == "0" then off[#off + 1] = i else bad[#bad + 1] = i end
  end
  if #bad > 0 then
    return fmt("weft: %s: group %s: WEFT_DETERMINISTIC is invalid on ranks %s%s", op, gname(g), rank_list(g, bad),
               policy.determ_env_error and (" (here: " .. policy.determ_env_error .. ")") or "")
  end
  if #on > 0 and #off > 0 then
    return fmt("weft: %s: group %s: deterministic mode is on for ranks %s and off for ranks %s "
               .. "(set policy.set{deterministic = ...} or WEFT_DETERMINISTIC alike on every rank, before the "
               .. "group's first device call)", op, gname(g), rank_list(g, on), rank_list(g, off))
  end
  return nil, #on > 0
end

-- policy.set{deterministic = v, group = g}: collective over g
policy.determ_hooks.agree = function(g, v)
  if g.world_size <= 1 or not g.is_member or g.destroyed or g.cpu_group == nil then return end
  local votes = g.cpu_group:allgather(v and "1" or "0")
  local err = determ_votes_error(g, votes, "policy.set")
  if err then error(err, 0) end
  local d = g._dev
  if d ~= nil then d.determ = v and true or false end
  g._host_determ = v and true or false   -- host routes across nodes too (weft.group.host)
  g._dispatch = nil
end

-- The quick all-reduce setting (policy.quick), agreed like deterministic
-- mode: on the set-up all-gather, and by policy.set{quick = v, group = g}.
local function quick_votes_error(g, votes, op)
  local by, order = {}, {}
  for i, v in ipairs(votes) do
    if by[v] == nil then by[v] = {}; order[#order + 1] = v end
    by[v][#by[v] + 1] = i
  end
  if by.E then
    return fmt("weft: %s: group %s: WEFT_QUICK_ALLREDUCE is invalid on ranks %s%s", op, gname(g), rank_list(g, by.E),
               policy.quick_env_error and (" (here: " .. policy.quick_env_error .. ")") or "")
  end
  if #order > 1 then
    local parts = {}
    for _, v in ipairs(order) do parts[#parts + 1] = fmt("%s on ranks %s", v, rank_list(g, by[v])) end
    return fmt("weft: %s: group %s: the quick all-reduce setting differs across ranks: %s (set "
               .. "policy.set{quick = ...} or WEFT_QUICK_ALLREDUCE alike on every rank, before the group's first "
               .. "device call)", op, gname(g), table.concat(parts, ", "))
  end
  return nil, order[1]
end

policy.quick_hooks.agree = function(g, v)
  if g.world_size <= 1 or not g.is_member or g.destroyed or g.cpu_group == nil then return end
  local votes = g.cpu_group:allgather(v)
  local err = quick_votes_error(g, votes, "policy.set")
  if err then error(err, 0) end
  local d = g._dev
  if d ~= nil then d.quick = v end
  g._dispatch = nil
end

-- A device setting's value for g (d[key] of its device state once that
-- exists and agreed it, else this rank's own), and the message a device call
-- raises where this rank's own value (from src) differs from the agreed one
local function agreed(g, key, mine, src, what, show, set)
  local d = g._dev
  if d == nil or d[key] == nil or d[key] == mine then return mine, nil end
  return d[key], fmt("%s is %s on this rank (%s) but group %s agreed on %s at its first device call: change "
                     .. "it with policy.set{%s, group = g} on every rank (collective over the group), or before "
                     .. "the group's first device call", what, show(mine), tostring(src), gname(g), show(d[key]), set(mine))
end

-- quick_state(g) -> "int8"|"int4"|"fp8"|"off", err: the group's agreed value
-- once its device state exists, else the local one
function M.quick_state(g)
  if policy.quick_env_error then return "off", "weft: " .. policy.quick_env_error end
  local v, src = policy.quick(g)
  return agreed(g, "quick", v, src, "the quick all-reduce", tostring,
                function(x) return ('quick = "%s"'):format(x) end)
end

-- determ_state(g) -> on (bool), err (nil or the message a device call raises):
-- the group's agreed value once its device state exists, else the local one
function M.determ_state(g)
  if policy.determ_env_error then return false, "weft: " .. policy.determ_env_error end
  local on, src = policy.deterministic(g)
  return agreed(g, "determ", on, src, "deterministic mode", function(x) return x and "on" or "off" end,
                function(x) return "deterministic = " .. tostring(x) end)
end

-- why weft's kernels cannot serve the group's device state d (ranks sharing
-- a GPU outside the shared-GPU test mode), or nil
function M.kernel_block(d)
  if d == nil or d.shared == nil or d.kernels_shared_ok then return nil end
  return d.kernel_block or d.shared
end

-- setup(g [, op]) -> d. Collective on the first call for a group of more than one rank.
function M.setup(g, op)
  local d = g._dev
  if d ~= nil then return d end
  op = op or "device setup"
  if g.destroyed then error(fmt("weft: %s: group %s is destroyed", op, gname(g)), 0) end
  local cuda = CUDA()
  if g.world_size <= 1 or not g.is_member then
    d = { device = cuda.current_device(), scratch = {}, retired = {}, nccl_why = "group of one rank" }
    d.determ = policy.deterministic(g) and true or false
    d.quick = policy.quick_env_error and "off" or policy.quick(g)
    g._dev = d
    return d
  end
  if policy.mode() == "graph" then graph_refusal(g, op) end
  local dev = cuda.current_device()
  local nccl = mod("weft.nccl")
  local have_nccl, nccl_msg = nccl.version()
  local host = hostname()
  local dvote = policy.determ_env_error and "E" or (policy.deterministic(g) and "1" or "0")
  local qvote = policy.quick_env_error and "E" or policy.quick(g)
  local list = g.cpu_group:allgather(fmt("%s\t%d\t%d\t%s\t%s\t%s", host, dev, have_nccl and 1 or 0, dvote,
                                         qvote, shared_gpu_vote()))
  local seen, shared, missing = {}, nil, nil
  local sharers, votes, dvotes, qvotes = {}, {}, {}, {}
  for i, s in ipairs(list) do
    local h, dv, nk, dt, qv, vote = s:match("^(.*)\t(%-?%d+)\t(%d)\t(%w)\t(%w+)\t(.*)$")
    dvotes[i], qvotes[i] = dt, qv
    local key = tostring(h) .. "\t" .. tostring(dv)
    if seen[key] and not shared then
      shared = fmt("ranks %d and %d share cuda:%s on %s", g.ranks[seen[key]], g.ranks[i], tostring(dv), tostring(h))
    end
    seen[key] = seen[key] or i
    sharers[key] = (sharers[key] or 0) + 1
    votes[i] = vote
    if nk ~= "1" and not missing then missing = g.ranks[i] end
  end
  local derr, don = determ_votes_error(g, dvotes, op)
  if derr then error(derr, 0) end             -- the same message on every rank; no state kept
  local qerr, qon = quick_votes_error(g, qvotes, op)
  if qerr then error(qerr, 0) end
  d = { device = dev, scratch = {}, retired = {}, shared = shared, determ = don, quick = qon }
  if shared then shared_gpu_mode(g, d, sharers, votes, op) end
  local existing = g.device_group
  if existing ~= nil and type(existing) == "table" and existing.handle ~= nil then
    d.nccl, d.device = existing, existing.device or dev        -- made by the caller (scripts/serve)
  elseif g.use_nccl == false then   -- the seed's use_pynccl, per group (agreed: every rank sets it)
    d.nccl_why = "g.use_nccl = false"
  elseif shared then
    d.nccl_why = shared .. " (NCCL needs one GPU per rank)"
  elseif missing then
    d.nccl_why = fmt("NCCL cannot be loaded on rank %d%s", missing,
                     missing == g.rank and (": " .. tostring(nccl_msg)) or "")
  else
    local ok, c = pcall(nccl.new, g.cpu_group)
    local agreed = g.cpu_group:allreduce_i64({ ok and 1 or 0 }, "and")[1]
    if ok and agreed == 1 then
      d.nccl, d.own_nccl = c, true
      g.device_group = c
    else
      if ok then pcall(c.abort, c); pcall(c.destroy, c) end
      d.nccl_why = ok and "NCCL communicator creation failed on another rank of the group"
                   or ("NCCL communicator creation failed: " .. tostring(c))
    end
  end
  g._dev = d
  g._dispatch = nil
  return d
end

local function ar_static_block(g, d)
  if not AR_WORLDS[g.world_size] then return fmt("world size %d (kernels for 2, 4, 6, 8)", g.world_size) end
  if not g.same_node then return "ranks on several nodes (NCCL is the path across nodes)" end
  return M.kernel_block(d)
end

-- ensure_ar(g) -> d. Collective the first time the custom all-reduce is tried.
function M.ensure_ar(g)
  local d = M.setup(g, "all_reduce")
  if d.ar_state ~= nil then return d end
  local why = ar_static_block(g, d)
  if why then d.ar_state, d.ar_why = "off", why; g._dispatch = nil; return d end
  if policy.mode() == "graph" then graph_refusal(g, "all_reduce") end
  local ok, h = pcall(mod("weft.backends.custom_ar").new, g.cpu_group, M.config.custom_ar_max_bytes)
  local agreed = g.cpu_group:allreduce_i64({ ok and 1 or 0 }, "and")[1]
  if ok and agreed == 1 then
    d.ar, d.ar_state = h, "ready"
    -- a parameter set on it (oneshot_max, twoshot_min) changes the kernel
    -- the rule resolves: the memoised choices go
    h.on_param = function() g._dispatch = nil end
    d.ar_why = fmt("workspace for calls up to %s (auto: one-shot up to %s)",
                   policy.human_bytes(h.max_bytes), policy.human_bytes(h.oneshot_max))
  else
    if ok then h:destroy() end
    d.ar_state = "failed"
    d.ar_why = ok and "workspace creation failed on another rank of the group"
               or ("workspace creation failed: " .. tostring(h))
  end
  g._dispatch = nil
  return d
end

-- prepare(g [, {fusion = {max_tokens=, hidden=, dtype=}}]): everything a
-- capture needs, made now (collective over g): NCCL, the custom all-reduce
-- (when enabled), the fusion workspace. Called by weft.graph.capture for the
-- groups it enters; call it yourself on every rank to keep set-up out of the
-- first request.
function M.prepare(g, o)
  if not g.is_member or g.world_size <= 1 or g.destroyed or not cuda_ok() then return end
  local d = M.setup(g, "prepare")
  local ov = policy.override(g, "all_reduce")
  local on = ar_enabled(g)
  if d.ar_state == nil and ov ~= "nccl" and (on or ov ~= nil) then M.ensure_ar(g) end
  local fz = o and o.fusion
  if fz and not M.kernel_block(d) and g.same_node and g.world_size <= 8 then
    local ctx = M.fusion_ctx(g)
    ctx:pre_initialize_workspaces { attn_coord = g, max_tokens = fz.max_tokens or M.config.fused_max_tokens,
                                    hidden = fz.hidden or 4096, dtype = fz.dtype or "bf16" }
  end
  g._dispatch = nil
  return d
end

-- info(g) -> a table describing the group's device state (for people and tests)
function M.info(g)
  local d = g._dev
  if d == nil then return { setup = false } end
  local f = g._fusion
  return {
    setup = true, device = d.device, nccl = d.nccl ~= nil, nccl_why = d.nccl_why, shared = d.shared, shared_mode = d.shared_mode,
    custom_ar = d.ar_state, custom_ar_why = d.ar_why, custom_ar_max_bytes = d.ar and d.ar.max_bytes,
    fusion = f and { initialized = f.attn.initialized, disabled = f.attn.disabled,
                     reason = f.attn.disabled_reason, creates = f.attn.creates } or nil,
    last_fused = g._fused_path and { path = g._fused_path, why = g._fused_why } or nil,
  }
end

---------------------------------------------------------------- per-call checks
local function wrong_device(g, op, t, what, d)
  error(fmt("weft: %s: %s is on %s but group %s runs on cuda:%d (the device that was current when "
            .. "it first used the GPU); move it with t:to(\"cuda:%d\")", op, what, tostring(t.device),
            gname(g), d.device, d.device), 0)
end

-- d for g after checking that the tensors are on its device
local function dev_of(g, op, a, b)
  local d = g._dev or M.setup(g, op)
  if a ~= nil and a.device_index ~= d.device then wrong_device(g, op, a, "input", d) end
  if b ~= nil and b.device_index ~= d.device then wrong_device(g, op, b, "output", d) end
  return d
end

local function stream_capturing()
  return policy.mode() == "graph"
end

local function scratch(d, slot, n)
  local s = d.scratch[slot]
  if s ~= nil and s.n >= n then return s.ptr end
  local nn = s and max(n, s.n * 2) or max(n, 256)
  local p = ffi.cast("uint8_t *", CUDA().alloc(nn, d.device))
  -- a graph captured earlier may still read the old buffer: keep it until destroy
  if s ~= nil then d.retired[#d.retired + 1] = s.ptr end
  d.scratch[slot] = { ptr = p, n = nn }
  return p
end

---------------------------------------------------------------- fusion context
function M.fusion_ctx(g)
  local f = g._fusion
  if f == nil then
    f = mod("weft.fusion").new()
    g._fusion = f
  end
  return f
end

---------------------------------------------------------------- lifecycle
local function destroy_hook(g)
  local am = package.loaded["weft.async"]
  if am and am.close then pcall(am.close, g) end   -- its queue may use the communicator
  if g._fusion then pcall(g._fusion.cleanup, g._fusion); g._fusion = nil end
  local d = g._dev
  if d == nil then return end
  g._dev = nil
  if d.ar then pcall(d.ar.destroy, d.ar) end
  if d.own_nccl and d.nccl then
    pcall(d.nccl.destroy, d.nccl)
    if g.device_group == d.nccl then g.device_group = nil end
  end
  local cuda = package.loaded["weft.cuda"]
  if cuda then
    for _, s in pairs(d.scratch) do pcall(cuda.free, s.ptr) end
    for _, p in ipairs(d.retired) do pcall(cuda.free, p) end
  end
  if d.scale_t then pcall(d.scale_t.free, d.scale_t) end
end

-- graph.capture enters each group once before it begins: set up what a
-- capture cannot (collectives), so the graph column of the table applies.
local function graph_enter(g, ctx)
  if not g.is_member or g.world_size <= 1 or not cuda_ok() then return end
  M.prepare(g, { fusion = ctx and ctx.fusion })
end

---------------------------------------------------------------- for the sibling modules
M.mod, M.CUDA, M.T = mod, CUDA, T
M.AR_WORLDS = AR_WORLDS
M.cuda_ok, M.gname, M.group_kind, M.ar_enabled = cuda_ok, gname, group_kind, ar_enabled
M.wrong_device, M.dev_of, M.stream_capturing, M.scratch = wrong_device, dev_of, stream_capturing, scratch
M.destroy_hook, M.graph_enter = destroy_hook, graph_enter

return M
