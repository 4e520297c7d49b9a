-- #gpu: the fusion patterns of weft.fusion_ext (kernels/fused_ext.cu) on one
-- GPU, ranks sharing it under MPS (scripts/weft-mps: one SM slice per rank),
-- at worlds 2, 4, 6 and 8 (and 1: the MoE end in one kernel): tests/helpers/fusion_ext_ranks.lua with device
-- tensors checks every pattern (MoE, MoE finalize, pre/post norm,
-- reduce-scatter + all-gather) against an f64 reference, random data, odd
-- token counts, top_k 1/2/8, with and without the shared expert, non-identity
-- permutations, bf16 and f16; one-shot and two-shot bit-identical, every rank
-- bit-identical, the unfused path within the same bounds, a graph replayed on
-- new data, explain, deterministic mode, refusals. Needs one GPU and
-- nvidia-cuda-mps-control (else pending). With $OUT set, each world's output
-- is kept there (fusion-ext-w<W>.log). FX_WORLDS narrows the worlds, FX_TIMEOUT_S
-- bounds each (default 200). Then a peer that never arrives (world 4): a
-- rank that leaves during fused_moe_allreduce_rmsnorm calls, one that stalls
-- past the timeout during fused_reduce_scatter_rmsnorm calls: every other
-- rank fails within the timeout (+ 3 s) naming the group, the method and
-- the late rank; the stalled rank's late call ends too; nothing hangs
-- (FX_NO_FAULTS=1 skips them; logs fusion-ext-leave.log, fusion-ext-stall.log).
-- run-tests: long (seven MPS worlds: ~50 s on one H200; started first in the GPU lanes)
local G = require("helpers.gpu_ranks")

local HIDDEN = { [1] = "4096,7168", [2] = "256,4096,7168", [4] = "4096", [6] = "1024", [8] = "4096" }
-- per rank: 4 patterns x 2 dtypes per hidden size, then the one-rank kernel's bits against the fused
-- kernel's, refusals, two graph checks, explain, deterministic
local function checks(w)
  local n = 0
  for _ in HIDDEN[w]:gmatch("[^,]+") do n = n + 1 end
  return w == 1 and 8 * n + 1 or 8 * n + 6   -- one rank: only the patterns and the refusals
end

local run = G.once_per_world(function(w)
  local limit = tonumber(os.getenv("FX_TIMEOUT_S") or "") or 200   -- per world
  return G.shell_kept(("FX_DEVICE=1 FX_HIDDEN=%s FX_TOKENS=1,7,33 WEFT_TIMEOUT_MS=30000 LUA_PATH='%s/tests/?.lua;;' "
                       .. "timeout %d scripts/weft-mps -n %d -- scripts/weft-run -n %d --timeout %d "
                       .. "tests/helpers/fusion_ext_ranks.lua"):format(HIDDEN[w], os.getenv("PWD") or ".", limit, w, w,
                                                                      limit - 10), "fusion-ext-w" .. w .. ".log")
end)

-- a fault run at world 4 (tests/helpers/fusion_ext_ranks.lua FX_KILL)
local function fault_run(env, log)
  return G.shell_kept(("FX_DEVICE=1 FX_HIDDEN=4096 WEFT_TIMEOUT_MS=5000 %s LUA_PATH='%s/tests/?.lua;;' "
                       .. "timeout 120 scripts/weft-mps -n 4 -- scripts/weft-run -n 4 --timeout 100 "
                       .. "tests/helpers/fusion_ext_ranks.lua"):format(env, os.getenv("PWD") or "."), log)
end

local worlds = {}
for v in (os.getenv("FX_WORLDS") or "1,2,4,6,8"):gmatch("%d+") do worlds[#worlds + 1] = tonumber(v) end

describe("#gpu fusion_ext patterns (shared GPU, MPS)", function()
  for _, w in ipairs(worlds) do
    it(("world %d: every pattern against f64, fused and unfused"):format(w), function()
      if not G.need_gpus(1, function(why) pending(why) end) then return end
      local out, rc = run(w)
      if rc == 77 then pending(out:match("weft%-mps: ([^\n]*)") or "MPS cannot start here"); return end
      assert.is_nil(out:match("FAIL [^\n]*"), out:sub(-4000))
      for r = 0, w - 1 do assert.matches("%[rank" .. r .. "%] DONE 0 failed", out) end
      local k = 0
      for _ in out:gmatch("%] PASS ") do k = k + 1 end
      assert.are.equal(w * checks(w), k, out:sub(-4000))
    end)
  end

  local function survivors_named(out, victim)
    for r = 0, 3 do
      if r ~= victim then
        assert.is_truthy(out:find("[rank" .. r .. "] PASS killed", 1, true),
                         ("rank %d did not report the late rank:\n%s"):format(r, out:sub(-4000)))
      end
    end
    assert.is_nil(out:match("FAIL [^\n]*"), out:sub(-4000))
  end
  for _, f in ipairs {
    { "a rank that leaves during fused_moe_allreduce_rmsnorm", "FX_KILL=2 FX_KILL_OP=moe", "fusion-ext-leave.log", 2, "LEAVING" },
    { "a rank that stalls past the timeout during fused_reduce_scatter_rmsnorm", "FX_KILL=1 FX_KILL_OP=rs FX_KILL_HOW=stall",
      "fusion-ext-stall.log", 1, "STALLING" },
  } do
    it("world 4: " .. f[1] .. ": every other rank fails naming it, nothing hangs", function()
      if not G.need_gpus(1, function(why) pending(why) end) then return end
      if os.getenv("FX_NO_FAULTS") == "1" then pending("FX_NO_FAULTS=1"); return end
      local t0 = os.time()
      local out, rc = fault_run(f[2], f[3])
      if rc == 77 then pending(out:match("weft%-mps: ([^\n]*)") or "MPS cannot start here"); return end
      assert.is_truthy(out:find("[rank" .. f[4] .. "] " .. f[5], 1, true), out:sub(-4000))
      survivors_named(out, f[4])
      if f[5] == "STALLING" then assert.is_truthy(out:find("[rank1] PASS stalled", 1, true), out:sub(-4000)) end
      assert.is_true(os.time() - t0 < 100, "took " .. (os.time() - t0) .. " s")
    end)
  end
end)
