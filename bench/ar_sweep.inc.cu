// ar_sweep.inc.cu — part of bench/ar_bench.cu (included there, one
// translation unit): `--sweep` measures weft's kernels under many launch
// shapes (weft_ar_set_param) to find what the automatic choices in
// kernels/allreduce.cu (shape_for) and src/coll/allreduce.c (resolve) should be.
//
//  - small sizes (8-256 KiB), Lamport one-shot: threads per block x vectors
//    per thread (the grid follows);
//  - large sizes (64, 128, 256 MiB): flag one-shot (threads x sub-rounds x
//    blocks per SM x pusher/reducer split), two-shot (blocks per SM), and
//    Lamport (grid).
// Every configuration is timed in graph mode, then checked once against NCCL
// on the same inputs (device-side comparison; a mismatch is a FAIL).

// |a - b| beyond bf16 rounding of a 2-term f32 sum (or NaN vs number): bad.
__global__ void count_bad_bf16(const __nv_bfloat16 *a, const __nv_bfloat16 *b, size_t n,
                               unsigned long long *bad) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    const bool nx = isnan(x), ny = isnan(y);
    if (nx || ny) { local += nx != ny; continue; }
    if (fabsf(x - y) > ldexpf(fmaxf(fabsf(x), fabsf(y)), -7) + 1e-30f) local++;
  }
  if (local) atomicAdd(bad, local);
}

struct SweepCfg {
  int algo;  // WEFT_AR_ONESHOT (Lamport), WEFT_AR_ONESHOT_FLAG, WEFT_AR_TWOSHOT
  int threads, grid, sub, split, bps;
};

static std::string cfg_name(const SweepCfg &c, int grid, int threads) {
  char s[160];
  if (c.algo == WEFT_AR_ONESHOT)
    snprintf(s, sizeof s, "sweep:oneshot t%d g%d%s", threads, grid, c.threads || c.grid ? "" : " (auto)");
  else if (c.algo == WEFT_AR_ONESHOT_FLAG)
    snprintf(s, sizeof s, "sweep:oneshot-flag t%d g%d sub%d%s%s", threads, grid, c.sub ? c.sub : 1,
             c.split ? " split" : "", !c.threads && !c.grid && !c.sub && !c.split && !c.bps ? " (auto)" : "");
  else
    snprintf(s, sizeof s, "sweep:twoshot t%d g%d%s", threads, grid, !c.grid && !c.bps ? " (auto)" : "");
  return s;
}

static void apply_cfg(const SweepCfg &c, int default_bps) {
  WK(weft_ar_set_param(g_ar, "threads", c.threads));
  WK(weft_ar_set_param(g_ar, "grid", c.grid));
  WK(weft_ar_set_param(g_ar, "sub", c.sub));
  WK(weft_ar_set_param(g_ar, "split", c.split));
  WK(weft_ar_set_param(g_ar, "blocks_per_sm", c.bps ? c.bps : default_bps));
}

// Times every configuration at one size (skipping shapes already measured),
// checks each against NCCL, records "sweep:..." rows. Returns the best us.
static void sweep_size(size_t bytes, const std::vector<SweepCfg> &cfgs, int default_bps, DBuf &ref,
                       unsigned long long *d_bad) {
  const size_t n = bytes / 2;
  std::vector<DBuf> ins, outs;
  make_bufs(bytes, ins, outs);
  const int nb = (int)ins.size();
  ref.alloc(bytes);
  if (nccl.comm) {
    nccl_run(ins[0].p, ref.p, n, WEFT_BF16, g_s);
    CK(cudaStreamSynchronize(g_s));
  }
  std::vector<std::string> seen;
  std::vector<std::pair<double, std::string>> rows;
  const int reps = bytes >= (64u << 20) ? 6 : 10;
  for (const SweepCfg &c : cfgs) {
    apply_cfg(c, default_bps);
    int kind;
    const char *why;
    if (weft_ar_resolve(g_ar, n, WEFT_BF16, c.algo, &kind, &why) || kind != c.algo) continue;  // does not fit
    int grid, threads;
    WK(weft_ar_shape(g_ar, n, WEFT_BF16, c.algo, &grid, &threads));
    const std::string name = cfg_name(c, grid, threads);
    // the same launch as one already measured (caps made them equal)
    std::string key = name.substr(0, name.find(" (auto)"));
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) continue;
    seen.push_back(key);
    auto call = [&](int i) { WK(weft_ar_run(g_ar, ins[i % nb].p, outs[i % nb].p, n, WEFT_BF16, c.algo, g_s)); };
    call(0);
    CK(cudaStreamSynchronize(g_s));
    const double us = graph_us(call, graph_calls(bytes), reps);
    check_kernel_error(name.c_str(), bytes);
    // correctness of this shape: outs[0] (from ins[0]) against NCCL's
    unsigned long long bad = 0;
    if (nccl.comm) {
      call(0);
      CK(cudaMemsetAsync(d_bad, 0, sizeof *d_bad, g_s));
      count_bad_bf16<<<264, 512, 0, g_s>>>((const __nv_bfloat16 *)outs[0].p, (const __nv_bfloat16 *)ref.p, n, d_bad);
      CK(cudaGetLastError());
      CK(cudaMemcpyAsync(&bad, d_bad, sizeof bad, cudaMemcpyDeviceToHost, g_s));
      CK(cudaStreamSynchronize(g_s));
      check_kernel_error(name.c_str(), bytes);
      bad = (unsigned long long)allreduce_i64((int64_t)bad, WEFT_SUM);
      if (bad) {
        g_fail++;
        LOG("FAIL %s at %s: %llu elements differ from NCCL", name.c_str(), fmt_bytes(bytes).c_str(), bad);
      }
    }
    Rec r{"all_reduce", name, "graph", bytes, us, busbw_of(bytes, us)};
    r.grid = grid;
    r.threads = threads;
    g_recs.push_back(r);
    char line[256];
    snprintf(line, sizeof line, "%-48s %9.2f us %6.0f GB/s%s", name.c_str() + 6, us, r.busbw, bad ? "  WRONG RESULTS" : "");
    rows.push_back({us, line});
  }
  apply_cfg(SweepCfg{WEFT_AR_ONESHOT, 0, 0, 0, 0, 0}, default_bps);  // back to automatic
  if (g_rank != 0) return;
  std::sort(rows.begin(), rows.end());
  printf("\nsweep %s (graph, fastest first):\n", fmt_bytes(bytes).c_str());
  for (size_t i = 0; i < rows.size(); i++)
    if (i < 12 || rows[i].second.find("(auto)") != std::string::npos) printf("  %2zu %s\n", i + 1, rows[i].second.c_str());
  fflush(stdout);
}

static void sweep(size_t max_bytes) {
  const double t0 = now_s();
  int dev = 0, sms = 132;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int default_bps = (int)std::max<long>(1, std::min<long>(8, getenv("WEFT_AR_BLOCKS_PER_SM") ? atol(getenv("WEFT_AR_BLOCKS_PER_SM")) : 2));
  DBuf ref;
  unsigned long long *d_bad;
  CK(cudaMalloc(&d_bad, sizeof *d_bad));
  // small: Lamport, threads x vectors per thread (grid = nvec / (threads x vpt))
  for (size_t bytes = 8u << 10; bytes <= std::min<size_t>(256u << 10, max_bytes); bytes *= 2) {
    std::vector<SweepCfg> cfgs;
    cfgs.push_back({WEFT_AR_ONESHOT, 0, 0, 0, 0, 0});
    const int nvec = (int)(bytes / 16);
    for (int t : {32, 64, 128, 256})
      for (int vpt : {1, 2, 4}) {
        const int g = (nvec + t * vpt - 1) / (t * vpt);
        if (g >= 1 && g <= 1024) cfgs.push_back({WEFT_AR_ONESHOT, t, g, 0, 0, 0});
      }
    sweep_size(bytes, cfgs, default_bps, ref, d_bad);
  }
  // large: flag one-shot, two-shot, Lamport
  for (size_t bytes = 64u << 20; bytes <= max_bytes && bytes <= (256u << 20); bytes *= 2) {
    std::vector<SweepCfg> cfgs;
    cfgs.push_back({WEFT_AR_ONESHOT_FLAG, 0, 0, 0, 0, 0});
    cfgs.push_back({WEFT_AR_TWOSHOT, 0, 0, 0, 0, 0});
    for (int split : {0, 1})
      for (int t : {256, 512})
        for (int sub : {1, 2, 4})
          for (int bps : {1, 2, 3, 4}) cfgs.push_back({WEFT_AR_ONESHOT_FLAG, t, 0, sub, split, bps});
    for (int bps : {1, 2, 3, 4}) cfgs.push_back({WEFT_AR_TWOSHOT, 0, 0, 0, 0, bps});
    cfgs.push_back({WEFT_AR_ONESHOT, 0, 0, 0, 0, 0});
    for (int t : {128, 256})
      for (int m : {1, 2, 3}) cfgs.push_back({WEFT_AR_ONESHOT, t, sms * m, 0, 0, 0});
    sweep_size(bytes, cfgs, default_bps, ref, d_bad);
  }
  CK(cudaFree(d_bad));
  if (g_rank == 0) printf("sweep took %.1f s\n", now_s() - t0);
}

static void sweep_markdown(FILE *m) {
  bool any = false;
  for (auto &r : g_recs) any |= r.backend.compare(0, 6, "sweep:") == 0;
  if (!any) return;
  fprintf(m, "\n### sweep: launch shapes (graph mode, median us per call, bus GB/s; fastest first per size)\n\n");
  fprintf(m, "| bytes | configuration | grid x threads | us | bus GB/s |\n|---|---|---|---|---|\n");
  std::vector<size_t> sizes;
  for (auto &r : g_recs)
    if (r.backend.compare(0, 6, "sweep:") == 0 && std::find(sizes.begin(), sizes.end(), r.bytes) == sizes.end())
      sizes.push_back(r.bytes);
  for (size_t b : sizes) {
    std::vector<const Rec *> rs;
    for (auto &r : g_recs)
      if (r.bytes == b && r.backend.compare(0, 6, "sweep:") == 0) rs.push_back(&r);
    std::sort(rs.begin(), rs.end(), [](const Rec *x, const Rec *y) { return x->us < y->us; });
    for (auto *r : rs)
      fprintf(m, "| %s | %s | %dx%d | %.2f | %.0f |\n", fmt_bytes(b).c_str(), r->backend.c_str() + 6, r->grid,
              r->threads, r->us, r->busbw);
  }
}
