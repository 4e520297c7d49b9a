-- weft.tune.report — the markdown of scripts/weft-tune's results (rank 0):
-- the measured tables per world and dtype, the policy file, and the built-in
-- policy against the tuned one (docs/tuning.md). The script measures and
-- derives; this only writes what it found.
local tune = require("weft.tune")
local bench = require("weft.tools.bench")
local nccl = require("weft.nccl")

local fmt = string.format

local M = {}

-- Appends the report's sections to md. r: the script's findings, named as its
-- locals were (machine, date, nranks, rounds, reps, out_file, worlds, dtypes,
-- data, sections, compare: the before/after rows, differ, faster, slower, na:
-- their counts, policy_text, opts).
function M.markdown(md, r)
  local MACHINE, DATE, nranks, ROUNDS, REPS, OUT_FILE = r.machine, r.date, r.nranks, r.rounds, r.reps, r.out_file
  local WORLDS, DTYPES, DATA, SECTIONS, COMPARE = r.worlds, r.dtypes, r.data, r.sections, r.compare
  local differ, faster, slower, na = r.differ, r.faster, r.slower, r.na
  local policy_text, opts = r.policy_text, r.opts
  local function f2(x) return x and fmt("%.2f", x) or "" end
  -- "auto (oneshot)": a name and the kernel it runs, when they differ
  local function label(name, kernel)
    if name == nil then return "?" end
    if kernel and kernel ~= name then return fmt("%s (%s)", name, kernel) end
    return name
  end
  md[#md + 1] = fmt("# weft-tune: %s, %s (commit %s)\n\n", MACHINE, DATE, bench.commit())
  md[#md + 1] = fmt("%d ranks, NCCL %s, NCCL_NVLS_ENABLE=%s. CUDA-graph replay of several calls per graph, "
                    .. "%d rounds x %d replays, median of the round medians of the slower rank, µs per call. "
                    .. "Outputs checked against NCCL on fresh random data. Policy file: `%s`.\n\n",
                    nranks, tostring(nccl.version()), tostring(os.getenv("NCCL_NVLS_ENABLE")), ROUNDS, REPS, OUT_FILE)
  for _, w in ipairs(WORLDS) do
    local D = DATA[w]
    if D then
      for _, dtype in ipairs(DTYPES) do
        local pts = D.all_reduce[dtype]
        if pts then
          md[#md + 1] = fmt("## all_reduce, world %d, %s\n\n", w, dtype)
          local hdr = { "bytes" }
          for _, b in ipairs(tune.AR_BACKENDS) do hdr[#hdr + 1] = b end
          hdr[#hdr + 1] = "built-in"; hdr[#hdr + 1] = "tuned"
          local rows = {}
          for _, pt in ipairs(pts) do
            local r = { tune.human_bytes(pt.bytes) }
            for _, b in ipairs(tune.AR_BACKENDS) do
              local m = pt.res[b]
              r[#r + 1] = m and (f2(m.us) .. (m.ok and "" or " (FAIL)")) or ""
            end
            r[#r + 1] = tostring(D.builtin[pt] or "?")
            r[#r + 1] = tostring(D.tuned[pt] or tune.pick(SECTIONS.all_reduce[w][dtype] or {}, pt.bytes) or "?")
            rows[#rows + 1] = r
          end
          md[#md + 1] = bench.table(hdr, rows) .. "\n"
        end
        local fpts = D.fused[dtype]
        if fpts and #fpts > 0 then
          md[#md + 1] = fmt("## fused all-reduce + RMSNorm, world %d, %s\n\n", w, dtype)
          local rows = {}
          for _, pt in ipairs(fpts) do
            local r = { fmt("%d x %d", pt.tokens, pt.hidden), tune.human_bytes(pt.bytes) }
            for _, b in ipairs(tune.FUSED_BACKENDS) do
              local m = pt.res[b]
              r[#r + 1] = m and (f2(m.us) .. (m.ok and "" or " (FAIL)")) or ""
            end
            r[#r + 1] = tostring(D.builtin[pt] or "?")
            r[#r + 1] = tostring(D.tuned[pt] or "?")
            rows[#rows + 1] = r
          end
          md[#md + 1] = bench.table({ "tokens x hidden", "bytes", "fused_oneshot", "fused_twoshot", "built-in", "tuned" },
                                    rows) .. "\n"
        end
      end
    end
  end
  md[#md + 1] = "## The policy file\n\n```lua\n" .. policy_text() .. "```\n\n"
  if opts.compare then
    md[#md + 1] = "## Built-in policy against the tuned one (graph mode, same run)\n\n"
    md[#md + 1] = fmt("Each row: what each policy chooses for that call (and the kernel that runs), timed here; "
                      .. "one timing when both run the same kernel. SLOWER: the tuned choice is slower than the built-in one by more than "
                      .. "max(%g %%, the spread of its rounds) + %g µs. %d points, %d with a different choice, "
                      .. "%d faster, %d slower beyond noise, %d without a timing.\n\n",
                      100 * tune.NOISE_REL, tune.NOISE_ABS, #COMPARE, differ, faster, slower, na)
    local rows = {}
    for _, row in ipairs(COMPARE) do
      local pt = row.pt
      rows[#rows + 1] = { fmt("%d", pt.world), pt.op, pt.dtype,
                          pt.op == "all_reduce" and tune.human_bytes(pt.bytes)
                            or fmt("%d x %d (%s)", pt.tokens, pt.hidden, tune.human_bytes(pt.bytes)),
                          label(row.builtin, row.k0), f2(row.us0), label(row.tuned, row.k1), f2(row.us1),
                          (row.us0 and row.us1) and fmt("%.3f", row.us1 / row.us0) or "",
                          row.verdict .. (row.note and (" (" .. row.note .. ")") or "") }
    end
    md[#md + 1] = bench.table({ "world", "op", "dtype", "size", "built-in", "µs", "tuned", "µs", "tuned / built-in",
                                "verdict" }, rows) .. "\n"
    -- where the policy does not follow the file: the group's own limits
    local off = {}
    for _, row in ipairs(COMPARE) do
      if not row.follows then
        local pt = row.pt
        local m = pt.res[row.file]
        off[#off + 1] = { fmt("%d", pt.world), pt.op, pt.dtype,
                          pt.op == "all_reduce" and tune.human_bytes(pt.bytes) or fmt("%d x %d", pt.tokens, pt.hidden),
                          row.file, m and f2(m.us) or "", label(row.tuned, row.k1), f2(row.us1) }
      end
    end
    if #off > 0 then
      md[#md + 1] = "### Sizes where the policy does not follow the file\n\n"
        .. "The group serves these through another path whatever the file says: all-reduces above its "
        .. "custom all-reduce workspace (`WEFT_CUSTOM_AR_MAX_BYTES`, default 64 MiB) go to NCCL; fused "
        .. "calls above the declared `max_tokens` take the unfused path. The file's choice and its time "
        .. "as measured above, for a workspace large enough:\n\n"
      md[#md + 1] = bench.table({ "world", "op", "dtype", "size", "file", "µs", "policy runs", "µs" }, off) .. "\n"
    end
  end
end

return M
