-- weft policy file (docs/policy.md), written by scripts/weft-tune; see docs/tuning.md.
-- Per world size and dtype, the first entry whose upto >= the call's bytes serves it;
-- the entry without upto serves everything larger. Measured on the machine below:
-- CUDA-graph replay, median of the slower rank.
-- worlds {2}, dtypes {bf16,f16,f32}; tie margin 2 % / 0.1 us.
return {
  version = 1,
  machine = "nvidia-h200-x2",
  date = "2026-11-30",
  all_reduce = {
    [2] = {
      bf16 = {
        { upto = 16777216, backend = "oneshot" },  -- 16 MiB
        { backend = "twoshot" },
      },
      f16 = {
        { upto = 16777216, backend = "oneshot" },  -- 16 MiB
        { backend = "twoshot" },
      },
      f32 = {
        { upto = 16777216, backend = "oneshot" },  -- 16 MiB
        { backend = "twoshot" },
      },
    },
  },
  fused = {
    [2] = {
      bf16 = {
        { upto = 4194304, backend = "fused_oneshot" },  -- 4 MiB
        { upto = 16777216, backend = "fused_twoshot" },  -- 16 MiB
        { backend = "fused_oneshot" },
      },
      f16 = {
        { upto = 4194304, backend = "fused_oneshot" },  -- 4 MiB
        { upto = 16777216, backend = "fused_twoshot" },  -- 16 MiB
        { backend = "fused_oneshot" },
      },
      f32 = {
        { upto = 4194304, backend = "fused_oneshot" },  -- 4 MiB
        { upto = 16777216, backend = "fused_twoshot" },  -- 16 MiB
        { backend = "fused_oneshot" },
      },
    },
  },
}
