-- weft.tune.choice — what weft.policy would pick for a call on the real group,
-- running nothing (in graph mode, as replays run), and the tuned file loaded
-- through the policy's own loader: the before/after of scripts/weft-tune
-- (docs/tuning.md). Needs the device backends, unlike weft.tune.
local tune = require("weft.tune")
local tensor = require("weft.tensor")
local graph = require("weft.graph")
local policy = require("weft.policy")

-- What weft.policy would pick for a call of this size on the real group g,
-- in graph mode (the mode CUDA-graph replays run in). `which`: "builtin"
-- (no policy file) or "tuned" (the file being written, loaded through the
-- policy's own loader).
local Choice = {}

-- the largest fused token count the group declares (weft-tune sets it)
Choice.max_tokens = nil

function Choice.probe_tensor(g, op, pt, ptr)
  if op == "all_reduce" then
    return tensor.wrap(ptr, { pt.bytes / tune.ESIZE[pt.dtype] }, pt.dtype, "cuda")
  end
  return tensor.wrap(ptr, { pt.tokens, pt.hidden }, pt.dtype, "cuda")
end

-- set by the adapter below: fn(g, op, t) -> backend name in tune's terms
Choice.select = nil

function Choice.pick(g, op, pt, ptr)
  local t = Choice.probe_tensor(g, op, pt, ptr)
  local ok, be = pcall(Choice.select, g, op, t)
  if not ok then return nil, tostring(be) end
  return be
end

-- graph mode without a capture: weft.policy reads weft.graph.current()
local function in_graph_mode(fn, ...)
  local saved = graph.current
  local ctx = { mode = "graph", stream = nil }
  graph.current = function() return ctx end
  local r = { pcall(fn, ...) }
  graph.current = saved
  if not r[1] then error(r[2], 0) end
  return unpack(r, 2)
end

-- weft.backends.device_backends.choice(g, op, t, opts): the backend a call would get,
-- in the file's terms, running nothing (all_reduce: the "custom_ar" rule's
-- algorithm or "nccl"; fused: the path and kernel of fused_decision)
local db = require("weft.backends.device_backends")

Choice.select = function(g, op, t)
  local o = { max_tokens = Choice.max_tokens }
  local pop = op == "all_reduce" and "all_reduce" or "fused_allreduce_rmsnorm"
  return in_graph_mode(function()
    local be, why
    be, why = db.choice(g, pop, t, o)
    if be == nil then error(tostring(why), 0) end
    return be
  end)
end

-- Loads a derived file through the policy's own loader, after checking that
-- every rank derived the same text.
function Choice.load_tuned(text, cg)
  -- every rank derived from the same (slower rank's) numbers: check it
  local mine = { #text, tune.checksum(text) }
  local lo, hi = cg:allreduce_i64(mine, "min"), cg:allreduce_i64(mine, "max")
  if lo[1] ~= hi[1] or lo[2] ~= hi[2] then
    error("weft-tune: ranks derived different policy files (a bug: the inputs are agreed)", 0)
  end
  local path = os.tmpname()
  tune.write_file(path, text)
  local ok, err = pcall(policy.load_file, path)
  os.remove(path)
  if not ok then error("weft-tune: the policy loader refused the derived file: " .. tostring(err), 0) end
end

return Choice
