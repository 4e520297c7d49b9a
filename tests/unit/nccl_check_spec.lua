-- WEFT_NCCL_CHECK=1 (weft.backends.device_backends.nccl_backend's check mode): every
-- NCCL collective is agreed over the group's cpu group before it is
-- launched; ranks whose calls differ all fail naming every rank's call, and
-- nothing is launched. Here the cpu group is a stand-in that returns the
-- parts the other ranks would send (the exchange itself is the store
-- route's, tested in fault_mismatch_spec).
local NB = require("weft.backends.device_backends.nccl_backend")
local H = require("weft.group.host")
local T = require("weft.tensor")

-- a group of 2 whose other rank called `other` (op, tensor, extra)
local function group_with(other)
  local g = { unique_name = "tp.0", ranks = { 0, 1 }, rank_in_group = 0, world_size = 2 }
  g.cpu_group = {
    allgather = function(_, mine)
      local theirs = H.store_part(other[1], "", other[2], other[3])
      return { mine, theirs }
    end,
  }
  return g
end

describe("NCCL check mode", function()
  local launched
  local be = { all_reduce = function() launched = launched + 1 end,
               all_gather = function() launched = launched + 1 end,
               send = function() launched = launched + 1 end }
  local checked = NB.checked(be)
  before_each(function() launched = 0 end)

  it("lets a call every rank makes alike through", function()
    local x = T.zeros({ 8 }, "bf16")
    checked.all_reduce(group_with { "all_reduce", x, "sum 0" }, "all_reduce", x, x.ptr, "sum", 0)
    assert.are.equal(1, launched)
  end)

  it("refuses a dtype, a reduction or a dim that differs, before the launch, naming both calls", function()
    local x, h = T.zeros({ 8 }, "bf16"), T.zeros({ 8 }, "f16")
    local ok, err = pcall(checked.all_reduce, group_with { "all_reduce", h, "sum 0" }, "all_reduce", x, x.ptr,
                          "sum", 0)
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("ranks called different collectives on group tp.0", 1, true), err)
    assert.is_truthy(tostring(err):find("bf16", 1, true) and tostring(err):find("f16", 1, true), err)
    ok, err = pcall(checked.all_reduce, group_with { "all_reduce", x, "max 1" }, "all_reduce", x, x.ptr, "sum", 0)
    assert.is_false(ok, err)
    local y = T.zeros({ 2, 4 }, "bf16")
    ok, err = pcall(checked.all_gather, group_with { "all_gather", y, 0 }, "all_gather", y, 1, y)
    assert.is_false(ok, err)
    assert.are.equal(0, launched)
  end)

  it("leaves send/recv alone (the two ends make different calls)", function()
    assert.are.equal(be.send, checked.send)
  end)
end)
