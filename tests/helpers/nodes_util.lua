-- The spec side of the simulated-node tests (tests/unit/nodes_spec.lua,
-- tests/faults/fault_nodes_spec.lua): run scripts/weft-sim-nodes and read back what
-- the nodes printed. A run that cannot make namespaces (not root, no
-- iproute2, no permission) exits 77: the spec marks itself pending.
local P = require("helpers.procs")
local S = require("helpers.spec_util")

local N = {}
N.ROOT = P.ROOT
N.SKIP = 77

-- run{nodes=, per_node=, args = {...}, env = {NAME = value}, node_env = {"1:NAME=v"},
--     timeout = s} -> output (stdout + stderr, then "rc=N"), rc, wall seconds
function N.run(o)
  local env = { ("LUA_PATH=%s"):format(P.q(P.ROOT .. "/tests/?.lua;;")) }
  for k, v in pairs(o.env or {}) do env[#env + 1] = k .. "=" .. P.q(v) end
  local args = {}
  for _, a in ipairs(o.args) do args[#args + 1] = P.q(a) end
  local extra = {}
  for _, e in ipairs(o.node_env or {}) do extra[#extra + 1] = "--node-env " .. P.q(e) end
  local cmd = ("cd %s && env %s timeout -s KILL %d scripts/weft-sim-nodes -N %d -n %d --timeout %d %s %s")
    :format(P.q(P.ROOT), table.concat(env, " "), (o.timeout or 120) + 30, o.nodes, o.per_node,
            o.timeout or 120, table.concat(extra, " "), table.concat(args, " "))
  local t0 = P.now()
  local out, rc = S.shell(cmd)
  return out, rc, P.now() - t0
end

-- the message of a skipped run, for pending()
function N.skipped(out) return out:match("weft%-sim%-nodes: skipped: ([^\n]*)") or "namespaces unavailable" end

-- lines "[nodeK rankR] <text>" -> { {node=, rank=, text=} ... }
function N.rank_lines(out)
  local t = {}
  for node, rank, text in out:gmatch("%[node(%d+) rank(%d+)%] ([^\n]*)") do
    t[#t + 1] = { node = tonumber(node), rank = tonumber(rank), text = text }
  end
  return t
end

-- how many ranks printed "OK <what>"
function N.count_ok(out, what)
  local n = 0
  for _, l in ipairs(N.rank_lines(out)) do if l.text == "OK " .. what then n = n + 1 end end
  return n
end

-- namespaces of weft-sim-nodes runs that still exist (a run leaves none)
function N.leftover_namespaces()
  local p = io.popen("ip netns list 2>/dev/null")
  local s = p:read("*a"); p:close()
  local t = {}
  for name in s:gmatch("(weft%-%d+%-[%w]+)") do
    local pid = tonumber(name:match("^weft%-(%d+)%-"))
    -- another run in progress (its script still lives) is not a leftover
    if os.execute(("kill -0 %d 2>/dev/null"):format(pid)) ~= 0 then t[#t + 1] = name end
  end
  return table.concat(t, " ")
end

return N
