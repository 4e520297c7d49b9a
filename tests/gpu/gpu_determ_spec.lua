-- #gpu: deterministic mode (docs/policy.md §10) on one GPU, ranks sharing it
-- under MPS (scripts/weft-mps: one SM slice per rank), at worlds 2 and 4:
-- tests/helpers/gpu_determ_worker.lua compares every row of 8192-row calls
-- bit for bit with the same rows sent in calls of 1 / 7 / 128 / 1000 rows,
-- across the all-reduce kernels and the fused / unfused paths, eager against
-- graph replay, across ranks, and checks that the default mode is as before.
-- Each check prints one verdict line per world:
--   DETERM PASS|FAIL w<W> <check>[: why]
-- Needs one GPU and nvidia-cuda-mps-control (else pending). With $OUT set,
-- each world's output is kept there (determ-w<W>.log).
local G = require("helpers.gpu_ranks")

local CHECKS = { "setup", "allreduce_batch_bf16", "allreduce_batch_f16_f32", "allreduce_paths",
                 "fused_batch_bf16", "fused_batch_f16_f32", "fused_paths", "fused_matches_all_reduce",
                 "graph_replay", "ranks_agree", "refusals", "default_unchanged" }

-- bounded so that both worlds end within one 600 s device command
local run = G.once_per_world(function(w)
  return G.shell_kept(("WEFT_TIMEOUT_MS=30000 timeout 290 scripts/weft-mps -n %d -- scripts/weft-run -n %d "
                       .. "--timeout 270 tests/helpers/gpu_determ_worker.lua"):format(w, w), "determ-w" .. w .. ".log")
end)

local function usable(w)
  if not G.need_gpus(1, function(why) pending(why) end) then return false end
  local out, rc = run(w)
  if rc == 77 then pending(out:match("weft%-mps: ([^\n]*)") or "MPS cannot start here"); return false end
  return true, out, rc
end

-- one verdict line per check and world (for people reading the log)
local function verdict(w, name, ok, why)
  print(("DETERM %s w%d %s%s"):format(ok and "PASS" or "FAIL", w, name, ok and "" or (": " .. why)))
  io.stdout:flush()
end

describe("#gpu deterministic mode (shared GPU, MPS)", function()
  for _, w in ipairs { 2, 4 } do
    for _, name in ipairs(CHECKS) do
      it(("world %d: %s"):format(w, name), function()
        local ok, out = usable(w)
        if not ok then return end
        local why
        for r = 0, w - 1 do
          local tag = "[rank" .. r .. "] "
          local fail = out:match("%[rank" .. r .. "%] FAIL " .. name .. ": ([^\n]*)")
          if fail then why = tag .. fail; break end
          if not out:find(tag .. "PASS " .. name .. " (", 1, true) then
            why = tag .. "never reported " .. name .. "; output tail:\n" .. out:sub(-3000)
            break
          end
        end
        verdict(w, name, why == nil, tostring(why))
        assert.is_nil(why, why)
      end)
    end
    it(("world %d: every rank exits cleanly"):format(w), function()
      local ok, out, rc = usable(w)
      if not ok then return end
      verdict(w, "exit", rc == 0, "rc " .. tostring(rc))
      assert.are.equal(0, rc, out:sub(-4000))
    end)
  end
end)
