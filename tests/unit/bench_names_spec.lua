-- Results files carry the GPU they ran on: the machine part of their names
-- comes from the device name CUDA reports (cudaGetDeviceProperties' name),
-- by one rule in Lua (weft.tools.bench.device_tag) and in the C harnesses
-- (bench/machine_tag.h), checked here on the CPU; no harness assumes a GPU.
local bench = require("weft.tools.bench")
local S = require("helpers.spec_util")

local ROOT = os.getenv("PWD") or "."

-- device name, number of devices, tag
local CASES = {
  { "NVIDIA H100 80GB HBM3", 1, "nvidia-h100" },
  { "NVIDIA H100 80GB HBM3", 8, "nvidia-h100-x8" },
  { "NVIDIA H100 PCIe", 1, "nvidia-h100" },
  { "NVIDIA H200", 1, "nvidia-h200" },
  { "NVIDIA H200", 2, "nvidia-h200-x2" },
  { "NVIDIA A100-SXM4-80GB", 4, "nvidia-a100-x4" },
  { "NVIDIA GH200 480GB", 1, "nvidia-gh200" },
  { "Tesla V100-SXM2-16GB", 1, "tesla-v100" },
  { "NVIDIA GeForce RTX 4090", 1, "nvidia-geforce" },
  { "", 1, "unknown" },
}

describe("results files name the GPU they ran on", function()
  it("weft.tools.bench.device_tag: from the device name and count", function()
    for _, c in ipairs(CASES) do
      assert.are.equal(c[3], bench.device_tag(c[1], c[2]), c[1] .. " x" .. c[2])
    end
  end)

  it("bench/machine_tag.h (the C harnesses' rule) gives the same tags", function()
    local dir = S.shell("mktemp -d /tmp/weft-tag.XXXXXX"):match("^(%S+)")
    local src = { '#include "machine_tag.h"', "int main(void) {", "  char t[128];" }
    for _, c in ipairs(CASES) do
      src[#src + 1] = ('  weft_machine_tag("%s", %d, t, sizeof t); puts(t);'):format(c[1], c[2])
    end
    src[#src + 1] = '  weft_machine_tag("NVIDIA H100 80GB HBM3", 2, t, 8); puts(t);   /* cut to fit */'
    src[#src + 1] = "  return 0;\n}\n"
    local f = assert(io.open(dir .. "/t.c", "w"))
    f:write(table.concat(src, "\n"))
    f:close()
    local out, rc = S.shell(("cc -std=c11 -Wall -Wextra -Werror -I%s/bench -o %s/t %s/t.c && %s/t")
                            :format(ROOT, dir, dir, dir))
    os.execute("rm -rf " .. dir)
    assert.are.equal(0, rc, out)
    local lines = S.lines_of(out:gsub("rc=%d+%s*$", ""))
    for i, c in ipairs(CASES) do assert.are.equal(c[3], lines[i], c[1]) end
    assert.are.equal("nvidia-", lines[#CASES + 1])
  end)

  it("no harness or script names its results after a GPU it assumes", function()
    local out = S.shell(("cd %s && grep -rnE 'WEFT_MACHINE.{0,40}nvidia-h[0-9]' bench scripts --include='*.cu' "
                         .. "--include='*.lua' --include='*.h' ; grep -nE 'WEFT_MACHINE.{0,40}nvidia-h[0-9]' "
                         .. "scripts/gpu-ar scripts/gpu-fusion scripts/bench"):format(ROOT))
    assert.are.equal("", (out:gsub("rc=%d+%s*$", "")))
    for _, f in ipairs { "bench/moe_local_bench.cu", "bench/fused_bench.cu", "bench/ar_bench.cu" } do
      local t = assert(io.open(ROOT .. "/" .. f)):read("*a")
      assert.truthy(t:find("weft_machine_tag(prop.name", 1, true), f .. " does not name its results after its GPU")
    end
  end)
end)
