-- weft.tools.bench helpers used by scripts/bench (host-only: runs everywhere).
local bench = require("weft.tools.bench")

describe("weft.tools.bench helpers", function()
  it("takes medians", function()
    assert.are.equal(2, bench.median { 3, 1, 2 })
    assert.are.equal(2.5, bench.median { 4, 1, 3, 2 })
    local t = { 5, 1, 4 }
    bench.median(t)
    assert.are.same({ 5, 1, 4 }, t)   -- input untouched
  end)

  it("writes the results format of docs/architecture.md#conventions-in-one-place", function()
    local doc = { machine = "nvidia-h200-x2", date = "2026-11-30", commit = "abc1234",
                  records = { { op = "all_reduce", backend = "nccl", mode = "graph", dtype = "bf16",
                                world = 2, bytes = 1024, us = 10.25, busbw_gbs = 0.1 } } }
    local s = bench.json(doc, "  ")
    assert.matches('"machine": "nvidia%-h200%-x2"', s)
    assert.matches('"date": "2026%-11%-30"', s)
    assert.matches('{"op": "all_reduce", "backend": "nccl",.*"us": 10.25.*}', s)
    assert.are.equal('["a\\"b",null,3,[]]', bench.json { 'a"b', 0 / 0, 3, {} })
    local dir = os.tmpname()
    os.remove(dir)
    local j, m = bench.write(dir, "unit", doc, "# table\n")
    assert.matches("/unit%-nvidia%-h200%-x2%-2026%-11%-30%.json$", j)
    local f = assert(io.open(j))
    assert.are.equal(s .. "\n", f:read("*a"))
    f:close()
    f = assert(io.open(m))
    assert.are.equal("# table\n", f:read("*a"))
    f:close()
    os.remove(j); os.remove(m); os.remove(dir)
  end)

  it("names machines and sizes", function()
    if os.getenv("WEFT_MACHINE") then pending("WEFT_MACHINE is set") return end
    assert.are.equal("nvidia-h200-x2", bench.machine_name("NVIDIA H200", 2))
    assert.are.equal("nvidia-h200", bench.machine_name("NVIDIA H200", 1))
    assert.are.equal("256 MiB", bench.human_bytes(2 ^ 28))
    assert.are.equal("64 KiB", bench.human_bytes(65536))
    assert.are.equal("| a | b |\n|---|---|\n| 1 | 2 |\n", bench.table({ "a", "b" }, { { "1", "2" } }))
  end)
end)
