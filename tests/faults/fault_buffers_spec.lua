-- Freed and in-use buffers (issue 13 items 1-2): with real ranks (weft-run),
-- a collective on a view of freed host storage raises "storage was freed"
-- instead of writing into reused memory, freeing a view keeps its base, and
-- free() of a tensor a pending async operation uses raises "in use by a
-- pending <op>" (tests/helpers/fault_buffers_ranks.lua); in one process, a
-- pinned storage outlives every reference to it (the GC finalizer path).
local ROOT = os.getenv("PWD") or "."
local U = require("helpers.spec_util")
local P = require("helpers.rank_passes")

local function run(n) return P.run(ROOT, "tests/helpers/fault_buffers_ranks.lua", n, nil, 100) end

local count_ok = U.count_ok

describe("freed and in-use buffers #fault", function()
  local T
  setup(function() T = require("weft.tensor") end)

  it("2 ranks: freed views raise, a view's free keeps the base, pinned tensors refuse free", function()
    local out, rc = run(2)
    assert.are.equal(0, rc, out)
    assert.are.equal(2 * 4, count_ok(out), out)
  end)

  it("3 ranks: the same", function()
    local out, rc = run(3)
    assert.are.equal(0, rc, out)
    assert.are.equal(3 * 4, count_ok(out), out)
  end)

  it("a pinned storage is kept by the GC, and released once unpinned", function()
    local t = T.full({ 4096 }, 1, "f32")
    T._pin(t, "all_reduce", "g")
    local weak = setmetatable({ t._storage, t._storage.ptr }, { __mode = "v" })
    t = nil -- luacheck: ignore
    collectgarbage(); collectgarbage()
    assert.is_not_nil(weak[1], "a pinned storage was collected")
    assert.is_not_nil(weak[2], "a pinned pointer was collected (its finalizer ran)")
    local st = weak[1]
    assert.are.equal(1, st.pins)
    -- unpin through a stand-in tensor of the same storage
    T._unpin({ _storage = st })
    st = nil -- luacheck: ignore
    collectgarbage(); collectgarbage()
    assert.is_nil(weak[1], "an unpinned storage was never collected")
  end)

  it("free of a view or the base of a pinned storage raises and changes nothing", function()
    local t = T.full({ 8 }, 3, "f32")
    local v = t:narrow(0, 2, 4)
    T._pin(v, "broadcast", "tp")
    local ok, err = pcall(t.free, t)
    assert.is_false(ok)
    assert.matches("weft: tensor.free: storage is in use by a pending broadcast on group tp", err, 1, true)
    ok, err = pcall(v.free, v)
    assert.is_false(ok)
    assert.matches("in use by a pending broadcast", err, 1, true)
    -- nor are its values read or written while the operation may touch them
    ok, err = pcall(v.to_table, v)
    assert.is_false(ok)
    assert.matches("weft: tensor.to_table: storage is in use by a pending broadcast on group tp", err, 1, true)
    assert.is_false((pcall(t.fill_, t, 1)))
    T._unpin(v)
    assert.are.same({ 3, 3, 3, 3 }, v:to_table())
    v:free()
    assert.are.same({ 3, 3, 3, 3, 3, 3, 3, 3 }, t:to_table())
    t:free()
    assert.is_nil(t.ptr)
  end)
end)
