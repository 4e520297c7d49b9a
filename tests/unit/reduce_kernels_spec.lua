-- The reduction kernels of src/host/shm_reduce.c come in copies picked from
-- the CPU's features (generic SSE2, AVX2 + F16C, AVX-512): every copy must
-- give the same bits, or ranks (and nodes) with different CPUs would
-- disagree. tests/helpers/reduce_bits.lua hashes the output over random bit
-- patterns under each choice.
local function hash(env)
  local p = io.popen(env .. " LUA_PATH='lua/?.lua;lua/?/init.lua;tests/?.lua;;' "
                     .. "luajit tests/helpers/reduce_bits.lua 2>&1")
  local out = p:read("*a")
  p:close()
  return out:match("^HASH %d+ %d+") or out
end

describe("weft_host_reduce's kernel copies", function()
  it("the best copy, the AVX2 one and the generic one give the same bits", function()
    local best = hash("")
    assert.is_truthy(best:match("^HASH"), best)
    assert.are.equal(best, hash("WEFT_NO_AVX512=1"))
    assert.are.equal(best, hash("WEFT_NO_AVX2=1"))
  end)
end)
