// fused_timing.inc.cu — part of bench/fused_bench.cu (included there, one
// translation unit): the benchmark (--only bench: fused, unfused and plain
// all-reduces by CUDA-graph replay) and the timing helpers that the sweep and
// skew parts use too (time_graph, bench_workspace, fresh_point, g_recs).

/* ----------------------------------------------------------- benchmark */

struct Rec { std::string op, backend; int64_t tokens, hidden, bytes; double us; };
static std::vector<Rec> g_recs;

/* Sleeps ns on the stream (a late peer, for the skew test). */
__global__ void delay_kernel(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

/* Median time per call of enqueue(), captured K times in one graph.
 * skew_ns > 0: rank 1 sleeps that long on its stream before every replay,
 * so every replay's first call finds rank 1 late (both ranks' figures then
 * include skew_ns / K per call). */
template <class F> static double time_graph(F enqueue, int K, int R, uint64_t skew_ns = 0) {
  enqueue();  /* warm-up outside the capture */
  CU(cudaStreamSynchronize(g_stream));
  weft_cuda_graph *gr = nullptr;
  WK(weft_cuda_graph_begin(g_stream));
  for (int k = 0; k < K; k++) enqueue();
  WK(weft_cuda_graph_end(g_stream, &gr));
  WK(weft_cpugroup_barrier(g_cg));
  const int warm = 3;
  std::vector<cudaEvent_t> ev(R + warm + 1);
  for (auto &e : ev) CU(cudaEventCreate(&e));
  for (int r = 0; r < R + warm; r++) {
    if (skew_ns && g_rank == 1) delay_kernel<<<1, 32, 0, g_stream>>>(skew_ns);
    CU(cudaEventRecord(ev[r], g_stream));
    WK(weft_cuda_graph_launch(gr, g_stream));
  }
  CU(cudaEventRecord(ev[R + warm], g_stream));
  CU(cudaStreamSynchronize(g_stream));
  std::vector<double> t;
  for (int r = warm; r < R + warm; r++) {
    float ms;
    CU(cudaEventElapsedTime(&ms, ev[r], ev[r + 1]));
    t.push_back(ms * 1e3 / K);
  }
  for (auto &e : ev) cudaEventDestroy(e);
  weft_cuda_graph_destroy(gr);
  std::sort(t.begin(), t.end());
  /* the agreed figure: the slower rank's median */
  int64_t v = (int64_t)(t[t.size() / 2] * 1000.0);
  WK(weft_cpugroup_allreduce_i64(g_cg, &v, 1, WEFT_MAX));
  return (double)v / 1000.0;
}

/* A bf16 workspace for the timing parts (10 s timeout). */
static weft_fusion *bench_workspace(int64_t max_tokens, int64_t hidden) {
  weft_fusion_opts o;
  memset(&o, 0, sizeof o);
  o.max_tokens = max_tokens; o.hidden = hidden; o.dtype = WEFT_BF16; o.timeout_ms = 10000;
  weft_fusion *ws = nullptr;
  WK(weft_fusion_create(g_cg, &o, &ws));
  return ws;
}

/* Fresh random device data for one benchmark point (bf16; the input
 * differs per rank): seeds a (input), a + 1 (residual), a + 2 (weight). */
static HostData fresh_point(const Dev &v, int64_t T, int64_t H, uint64_t a) {
  const int64_t n = T * H;
  WK(weft_cuda_fill_random(v.in, (size_t)n, WEFT_BF16, seed_of(a, (uint64_t)g_rank, (uint64_t)n), 0, g_stream));
  WK(weft_cuda_fill_random(v.res, (size_t)n, WEFT_BF16, seed_of(a + 1, (uint64_t)n), 0, g_stream));
  WK(weft_cuda_fill_random(v.gamma, (size_t)H, WEFT_BF16, a + 2, 0, g_stream));
  HostData d;
  d.T = T; d.H = H; d.dtype = WEFT_BF16;
  return d;
}

static void bench(int quick, weft_nccl *nccl, weft_ar *war) {
  const int64_t toks[] = {1, 8, 32, 128, 512, 2048, 8192};
  const int64_t hids[] = {4096, 8192};
  weft_fusion *ws = bench_workspace(8192, 8192);
  Dev v;
  v.alloc(8192, 8192, WEFT_BF16);
  for (int64_t H : hids)
    for (int64_t T : toks) {
      const int64_t bytes = T * H * 2, n = T * H;
      /* fresh random data for every point (device fill: fast) */
      const HostData pd = fresh_point(v, T, H, 20);
      const int K = n <= 128 * 8192 ? 40 : n <= 2048 * 8192 ? 10 : 4;
      const int R = quick ? 10 : 30;
      auto fused = [&](int pattern, int algo, int flags) {
        weft_fusion_params p = params(v, pd, pattern, algo, WEFT_FUSION_FP32_ACC | flags, 1e-6f);
        return time_graph([&] { WK(weft_fusion_run(ws, &p)); }, K, R);
      };
      auto rec = [&](const char *op, const char *backend, double us) {
        g_recs.push_back({op, backend, T, H, bytes, us});
        say("  %-18s %-18s %6lld x %-5lld %10.2f us  %7.1f GB/s\n", op, backend, (long long)T,
            (long long)H, us, (double)bytes / us / 1e3);
      };
      for (int algo : {WEFT_FUSION_ONESHOT, WEFT_FUSION_TWOSHOT}) {
        weft_fusion_params p = params(v, pd, WEFT_FUSION_AR_RMSNORM, algo, WEFT_FUSION_FP32_ACC, 1e-6f);
        int al = 0, b = 0, t = 0, c = 0;
        if (weft_fusion_resolve(ws, &p, &al, nullptr) == 0 && wf_fusion_geometry(ws, &p, &al, &b, &t, &c) == 0)
          say("  geometry %-8s %6lld x %-5lld %4d blocks x %4d threads, %d per row group%s\n",
              algo == WEFT_FUSION_ONESHOT ? "one-shot" : "two-shot", (long long)T, (long long)H, b, t,
              c, c > 1 ? " (cluster)" : "");
      }
      /* PDL on, as group:fused_allreduce_rmsnorm launches by default (and
       * the seed: launch_with_pdl=True; weft_ar too); fused_auto_nopdl is
       * the same call without it */
      const int PDL = WEFT_FUSION_PDL;
      rec("fused_ar_rmsnorm", "fused_oneshot", fused(WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_ONESHOT, PDL));
      if (T >= g_world)
        rec("fused_ar_rmsnorm", "fused_twoshot", fused(WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_TWOSHOT, PDL));
      rec("fused_ar_rmsnorm", "fused_auto", fused(WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_AUTO, PDL));
      rec("fused_ar_rmsnorm", "fused_auto_nopdl", fused(WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_AUTO, 0));
      /* deterministic mode (issue 18), same buffers: goal <= 1.15x fused_auto */
      rec("fused_ar_rmsnorm", "fused_auto_determ",
          fused(WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_AUTO, PDL | WEFT_FUSION_DETERMINISTIC));
      rec("all_reduce", "fused_ar_oneshot", fused(WEFT_FUSION_AR, WEFT_FUSION_ONESHOT, PDL));
      if (T >= g_world) rec("all_reduce", "fused_ar_twoshot", fused(WEFT_FUSION_AR, WEFT_FUSION_TWOSHOT, PDL));
      if (nccl) {
        rec("all_reduce", "nccl", time_graph([&] {
              WK(weft_nccl_all_reduce(nccl, v.in, v.copy, (size_t)n, WEFT_BF16, WEFT_SUM, g_stream));
            }, K, R));
        rec("fused_ar_rmsnorm", "unfused", time_graph([&] {
              WK(weft_nccl_all_reduce(nccl, v.in, v.copy, (size_t)n, WEFT_BF16, WEFT_SUM, g_stream));
              WK(weft_cuda_rmsnorm(v.copy, v.res, v.gamma, v.norm_out, v.res_out, T, H, WEFT_BF16,
                                   1e-6f, 0, g_stream));
            }, K, R));
      }
      if (war)
        rec("all_reduce", "weft_ar", time_graph([&] {
              WK(weft_ar_run(war, v.in, v.copy, (size_t)n, WEFT_BF16, WEFT_AR_AUTO, g_stream));
            }, K, R));
    }
  v.release();
  WK(weft_fusion_destroy(ws));
}
