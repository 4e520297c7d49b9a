-- initialize_model_parallel with the layout in WEFT_TEST_MP ("tp=2,pp=2,..."),
-- prints every group's properties as PROP lines (the spec compares them with
-- hand-checked layouts), then proves each distinct group works: its members
-- agree on who they are and an all_reduce over it is right.
local U = require("helpers.group_util")
local weft = U.weft
local T = weft.tensor

local mp = {}
for k, v in (os.getenv("WEFT_TEST_MP") or ""):gmatch("([%w_]+)=([%w_]+)") do
  if v == "true" then mp[k] = true else mp[k] = tonumber(v) end
end

local world = weft.init()
local me = world.rank
U.check(not weft.model_parallel_is_initialized(), "not initialized before")
weft.initialize_model_parallel(mp)
U.check(weft.model_parallel_is_initialized(), "initialized after")

local KINDS = { "tp", "pp", "attn_tp", "attn_cp", "moe_ep", "moe_tp", "moe_dp", "dcp", "pdmux_prefill_tp" }
local groups = {}
for _, k in ipairs(KINDS) do
  local ok, g = pcall(weft[k])
  if ok then groups[k] = g
  elseif k ~= "dcp" and k ~= "pdmux_prefill_tp" then error(g) end
end

local lines = {}
for _, k in ipairs(KINDS) do
  local g = groups[k]
  if g then
    local same = "-"
    for _, k2 in ipairs(KINDS) do
      if k2 == k then break end
      if groups[k2] == g then same = k2; break end
    end
    lines[#lines + 1] = ("PROP rank=%d kind=%s name=%s ranks=%s rig=%d ws=%d first=%d last=%d isfirst=%s islast=%s next=%d prev=%d same=%s local=%d")
      :format(me, k, g.unique_name, table.concat(g.ranks, ","), g.rank_in_group, g.world_size, g.first_rank,
              g.last_rank, tostring(g.is_first_rank), tostring(g.is_last_rank), g.next_rank, g.prev_rank, same,
              g.local_rank)
    U.check(weft[k .. "_size"]() == g.world_size and weft[k .. "_rank"]() == g.rank_in_group,
            "%s size/rank getters", k)
  end
end
U.check(weft.world_size() == world.world_size and weft.world_rank() == me, "world getters")
U.check(weft.get_tensor_model_parallel_world_size() == groups.tp.world_size, "seed getter names")
for _, l in ipairs(lines) do U.say("%s", l) end

-- every distinct group: members agree, and a collective over it is right
local seen = {}
for _, k in ipairs(KINDS) do
  local g = groups[k]
  if g and not seen[g] then
    seen[g] = true
    local names = g:all_gather_object({ rank = me, name = g.unique_name })
    for i, e in ipairs(names) do
      U.check(e.rank == g.ranks[i] and e.name == g.unique_name, "%s: member %d says %s/%s", k, i, e.rank, e.name)
    end
    local x = T.full({ 4 }, me + 1, "i32")
    g:all_reduce(x)
    local want = 0
    for _, r in ipairs(g.ranks) do want = want + r + 1 end
    U.same(x:to_table(), { want, want, want, want }, k .. " all_reduce")
  end
end
U.ok("layout groups work")

-- SGLang's PD-multiplexing switch: tp() returns the duplicate group
if groups.pdmux_prefill_tp then
  U.check(groups.pdmux_prefill_tp ~= groups.tp, "duplicate tp group is a separate object")
  U.check(groups.pdmux_prefill_tp.unique_name:match("^pdmux_prefill_tp%."), "duplicate tp group name")
  weft.set_pdmux_status(true)
  U.check(weft.tp() == groups.pdmux_prefill_tp, "tp() is the prefill group while multiplexing")
  weft.set_pdmux_status(false)
  U.check(weft.tp() == groups.tp, "tp() back to the decode group")
  U.ok("pdmux prefill tp group")
end

weft.destroy_model_parallel()
U.check(not weft.model_parallel_is_initialized(), "destroyed")
for _, g in pairs(groups) do U.check(g.destroyed, "every group destroyed") end
weft.shutdown()
U.ok("done")
