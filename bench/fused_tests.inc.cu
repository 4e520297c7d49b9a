// fused_tests.inc.cu — part of bench/fused_bench.cu (included there, one
// translation unit): the checks (--only refusals, matrix, variants, stress,
// graph, faults), each a PASS/FAIL verdict agreed by every rank.

/* ---------------------------------------------------------------- tests */

static void test_matrix(weft_fusion *ws, bool quick) {
  const int64_t toks[] = {1, 3, 77, 128, 1000, 8192};
  const int64_t hids[] = {2048, 4096, 5120, 7168, 8192, 16384};
  for (int64_t T : toks)
    for (int64_t H : hids) {
      if (quick && T == 8192 && H > 4096) continue;
      HostData d;
      gen(d, T, H, WEFT_BF16, seed_of(11, (uint64_t)T, (uint64_t)H));
      Dev v;
      v.alloc(T, H, WEFT_BF16);
      Got g1, g2;
      for (int algo : {WEFT_FUSION_ONESHOT, WEFT_FUSION_TWOSHOT}) {
        v.upload(d);
        weft_fusion_params p = params(v, d, WEFT_FUSION_AR_RMSNORM, algo, WEFT_FUSION_FP32_ACC, 1e-6f);
        (algo == WEFT_FUSION_ONESHOT ? g1 : g2) = run_and_check(ws, v, d, p, "matrix");
      }
      verdict(g1.res_out == g2.res_out && g1.norm_out == g2.norm_out,
              "matrix: %lldx%lld one-shot and two-shot outputs bit-equal", (long long)T, (long long)H);
      v.release();
    }
}

/* PDL consumer: waits for its predecessor, then copies src to dst. */
__global__ void pdl_consumer(const uint4 *src, uint4 *dst, size_t n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    dst[i] = src[i];
}

static void launch_consumer(const void *src, void *dst, size_t bytes) {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.gridDim = dim3(264);
  cfg.blockDim = dim3(256);
  cfg.stream = g_stream;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  CU(cudaLaunchKernelEx(&cfg, pdl_consumer, (const uint4 *)src, (uint4 *)dst, bytes / 16));
}

static void test_variants(weft_fusion *ws) {
  struct V { int64_t T, H; int dt, pattern, flags; };
  const V vs[] = {
      {77, 4096, WEFT_F16, WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_FP32_ACC},
      {1000, 5120, WEFT_F16, WEFT_FUSION_AR_RMSNORM, 0},
      {77, 4096, WEFT_F32, WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_FP32_ACC},
      {128, 16384, WEFT_F32, WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_FP32_ACC | WEFT_FUSION_GEMMA},
      {3, 7168, WEFT_BF16, WEFT_FUSION_AR, WEFT_FUSION_FP32_ACC},
      {1000, 8192, WEFT_BF16, WEFT_FUSION_AR, 0},
      {1000, 4096, WEFT_F32, WEFT_FUSION_AR, WEFT_FUSION_FP32_ACC},
      {77, 4096, WEFT_BF16, WEFT_FUSION_AR_RMSNORM, 0},
      {128, 8192, WEFT_BF16, WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_FP32_ACC | WEFT_FUSION_GEMMA},
      {1, 4096, WEFT_BF16, WEFT_FUSION_AR_RMSNORM_FP8, WEFT_FUSION_FP32_ACC},
      {1000, 7168, WEFT_BF16, WEFT_FUSION_AR_RMSNORM_FP8, WEFT_FUSION_FP32_ACC},
      {77, 2048, WEFT_F16, WEFT_FUSION_AR_RMSNORM_FP8, WEFT_FUSION_GEMMA},
      {128, 16384, WEFT_F32, WEFT_FUSION_AR_RMSNORM_FP8, WEFT_FUSION_FP32_ACC},
      {8, 24, WEFT_BF16, WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_FP32_ACC}, /* tiny rows */
      {5, 1000, WEFT_F32, WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_FP32_ACC}, /* odd vectors/row */
  };
  int i = 0;
  for (const V &c : vs) {
    HostData d;
    gen(d, c.T, c.H, c.dt, seed_of(12, (uint64_t)i++));
    Dev v;
    v.alloc(c.T, c.H, c.dt);
    for (int algo : {WEFT_FUSION_ONESHOT, WEFT_FUSION_TWOSHOT}) {
      for (int norm_opt = 0; norm_opt < (c.pattern == WEFT_FUSION_AR_RMSNORM_FP8 ? 2 : 1); norm_opt++) {
        v.upload(d);
        weft_fusion_params p = params(v, d, c.pattern, algo, c.flags, 1e-5f, norm_opt == 0);
        run_and_check(ws, v, d, p, "variant");
      }
    }
    v.release();
  }
  /* PDL: trigger early / at end, followed by a PDL-launched consumer that
   * must see the whole norm_out; eager, then inside a graph. */
  for (int graph = 0; graph < 2; graph++)
    for (int at_end = 0; at_end < 2; at_end++)
      for (int algo : {WEFT_FUSION_ONESHOT, WEFT_FUSION_TWOSHOT}) {
        HostData d;
        gen(d, 128, 4096, WEFT_BF16, seed_of(13, (uint64_t)(graph * 4 + at_end * 2 + algo)));
        Dev v = Dev::with(d);
        const int flags = WEFT_FUSION_FP32_ACC | WEFT_FUSION_PDL | (at_end ? WEFT_FUSION_TRIGGER_AT_END : 0);
        weft_fusion_params p = params(v, d, WEFT_FUSION_AR_RMSNORM, algo, flags, 1e-6f);
        const size_t b = (size_t)(d.T * d.H * 2);
        weft_cuda_graph *gr = nullptr;
        if (graph) WK(weft_cuda_graph_begin(g_stream));
        WK(weft_fusion_run(ws, &p));
        launch_consumer(v.norm_out, v.copy, b);
        if (graph) {
          WK(weft_cuda_graph_end(g_stream, &gr));
          WK(weft_cuda_graph_launch(gr, g_stream));
        }
        sync_and_check_error(ws, "pdl");
        const Want w = want_of(p);
        Got g = v.download(d, w);
        std::vector<uint8_t> cp(b);
        CU(cudaMemcpy(cp.data(), v.copy, b, cudaMemcpyDeviceToHost));
        const Score s = check(d, w, g);
        verdict(score_ok(s) && cp == g.norm_out,
                "pdl %s trigger_completion_at_end=%d %s: %lld outside tolerance, consumer %s",
                graph ? "graph" : "eager", at_end, aname(algo), (long long)s.bad,
                cp == g.norm_out ? "saw all of norm_out" : "saw STALE data");
        if (gr) weft_cuda_graph_destroy(gr);
        v.release();
      }
}

/* The one-shot indexes its data by row, never by block, so ranks may launch
 * different grids (the cluster occupancy may follow a chip's GPC layout):
 * rank 0 splits rows over 8 blocks, the others use one block per row. The
 * outputs must still be right and bit-equal on every rank. */
static void test_grids(weft_fusion *ws) {
  struct G { int64_t T, H; int pattern; };
  const G gs[] = {{3, 8192, WEFT_FUSION_AR_RMSNORM}, {32, 8192, WEFT_FUSION_AR_RMSNORM},
                  {77, 4096, WEFT_FUSION_AR_RMSNORM}, {5, 16384, WEFT_FUSION_AR}};
  int i = 0;
  /* variant 0: rank 0 splits rows over 8 blocks, the others do not split;
   * 1: every rank splits rows over 8 blocks */
  for (int variant = 0; variant < 2; variant++)
  for (const G &c : gs) {
    HostData d;
    gen(d, c.T, c.H, WEFT_BF16, seed_of(15, (uint64_t)i++));
    Dev v = Dev::with(d);
    wf_fused_set_tune(g_rank == 0 || variant == 1 ? 8 : 1, 0);
    weft_fusion_params p = params(v, d, c.pattern, WEFT_FUSION_ONESHOT, WEFT_FUSION_FP32_ACC, 1e-6f);
    int al = 0, b = 0, t = 0, cl = 0;
    WK(wf_fusion_geometry(ws, &p, &al, &b, &t, &cl));
    int64_t mine[3] = {b, t, cl}, lo[3] = {b, t, cl};
    WK(weft_cpugroup_allreduce_i64(g_cg, mine, 3, WEFT_MAX));
    WK(weft_cpugroup_allreduce_i64(g_cg, lo, 3, WEFT_MIN));
    say("     (one-shot %lldx%lld, a different grid per rank: %lld..%lld blocks x %lld..%lld threads, "
        "%lld..%lld per row group)\n", (long long)c.T, (long long)c.H, (long long)lo[0], (long long)mine[0],
        (long long)lo[1], (long long)mine[1], (long long)lo[2], (long long)mine[2]);
    run_and_check(ws, v, d, p, "variant");
    wf_fused_set_tune(0, 0);
    v.release();
  }
}

/* In place: residual_out = residual and norm_out = input (AR: out =
 * input), at few tokens (rows split over blocks) and more, both algorithms:
 * every vector must be read before it is written, by the same thread. */
static void test_inplace(weft_fusion *ws) {
  struct C { int64_t T, H; int pattern, algo; };
  const C cs[] = {{1, 8192, WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_ONESHOT},
                  {3, 16384, WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_ONESHOT},
                  {1, 4096, WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_ONESHOT},
                  {32, 8192, WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_ONESHOT},
                  {77, 4096, WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_TWOSHOT},
                  {5, 16384, WEFT_FUSION_AR, WEFT_FUSION_ONESHOT},
                  {2, 8192, WEFT_FUSION_AR_RMSNORM_FP8, WEFT_FUSION_ONESHOT}};
  int i = 0;
  for (const C &c : cs) {
    HostData d;
    gen(d, c.T, c.H, WEFT_BF16, seed_of(16, (uint64_t)i++));
    Dev v = Dev::with(d);
    Dev w = v; /* a view: the outputs are the inputs' buffers */
    w.res_out = v.res;
    w.norm_out = v.in;
    w.out = v.in;
    const weft_fusion_params p = params(w, d, c.pattern, c.algo, WEFT_FUSION_FP32_ACC | WEFT_FUSION_PDL, 1e-6f);
    run_and_check(ws, w, d, p, "in place");
    v.release();
  }
}

/* Many eager calls of changing size, algorithm and pattern. */
static void test_stress(weft_fusion *ws, int iters) {
  const int64_t hs[] = {2048, 4096, 5120};
  Dev v;
  v.alloc(512, 5120, WEFT_BF16);
  int64_t bad = 0, n = 0;
  bool same = true;
  for (int it = 0; it < iters; it++) {
    const uint64_t h = seed_of(14, (uint64_t)it);
    const int64_t T = 1 + (int64_t)(h % 512), H = hs[(h >> 12) % 3];
    const int algo = 1 + (int)((h >> 20) % 2);
    const int pattern = (int)((h >> 24) % 3);
    HostData d;
    gen(d, T, H, WEFT_BF16, h);
    v.upload(d);
    weft_fusion_params p = params(v, d, pattern, algo, WEFT_FUSION_FP32_ACC, 1e-6f);
    WK(weft_fusion_run(ws, &p));
    sync_and_check_error(ws, "stress");
    const Want w = want_of(p);
    Got g = v.download(d, w);
    Score s = check(d, w, g);
    bad += score_ok(s) ? 0 : 1;
    n++;
    same = same_everywhere(hash_got(g)) && same;
  }
  verdict(bad == 0 && same, "stress: %lld eager calls of changing size/algorithm/pattern: %lld bad%s",
          (long long)n, (long long)bad, same ? "" : ", ranks DIFFER");
  v.release();
}

/* A graph of four calls (one-shot, two-shot, AR one-shot, FP8 two-shot),
 * replayed with new data every time; every replay is checked. */
static void test_graph(weft_fusion *ws, int64_t T, int64_t H, int replays) {
  const int dt = WEFT_BF16;
  Dev v[4];
  for (auto &x : v) x.alloc(T, H, dt);
  const int pats[4] = {WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_AR,
                       WEFT_FUSION_AR_RMSNORM_FP8};
  const int algs[4] = {WEFT_FUSION_ONESHOT, WEFT_FUSION_TWOSHOT, WEFT_FUSION_ONESHOT, WEFT_FUSION_TWOSHOT};
  HostData d;
  auto seq = [&] {
    for (int k = 0; k < 4; k++) {
      weft_fusion_params p = params(v[k], d, pats[k], algs[k], WEFT_FUSION_FP32_ACC, 1e-6f);
      WK(weft_fusion_run(ws, &p));
    }
  };
  /* warm up outside the capture, then capture (as nccl-tests does) */
  gen(d, T, H, dt, seed_of(15, 0));
  for (auto &x : v) x.upload(d);
  seq();
  sync_and_check_error(ws, "graph warm-up");
  weft_cuda_graph *gr = nullptr;
  WK(weft_cuda_graph_begin(g_stream));
  seq();
  WK(weft_cuda_graph_end(g_stream, &gr));
  WK(weft_cpugroup_barrier(g_cg));
  int64_t bad = 0, diff = 0;
  bool same = true;
  for (int r = 0; r < replays; r++) {
    gen(d, T, H, dt, seed_of(15, (uint64_t)r + 1));
    for (auto &x : v) x.upload(d);
    WK(weft_cuda_graph_launch(gr, g_stream));
    sync_and_check_error(ws, "graph replay");
    Got g[4];
    uint64_t hh = 0;
    for (int k = 0; k < 4; k++) {
      weft_fusion_params p = params(v[k], d, pats[k], algs[k], WEFT_FUSION_FP32_ACC, 1e-6f);
      const Want w = want_of(p);
      g[k] = v[k].download(d, w);
      Score s = check(d, w, g[k]);
      bad += score_ok(s) ? 0 : 1;
      hh = fnv(&hh, 8, hash_got(g[k]));
    }
    diff += (g[0].res_out != g[1].res_out || g[0].norm_out != g[1].norm_out) ? 1 : 0;
    same = same_everywhere(hh) && same;
  }
  verdict(bad == 0 && diff == 0 && same,
          "graph: %lldx%lld, 4 calls x %d replays on changing data: %lld bad outputs, %lld one/two-shot "
          "mismatches%s", (long long)T, (long long)H, replays, (long long)bad, (long long)diff,
          same ? "" : ", ranks DIFFER");
  weft_cuda_graph_destroy(gr);
  for (auto &x : v) x.release();
}

static void test_refusals(weft_fusion *ws) {
  HostData d;
  gen(d, 64, 4096, WEFT_BF16, 16);
  Dev v;
  v.alloc(64, 4096, WEFT_BF16);
  v.upload(d);
  const weft_fusion_params good = params(v, d, WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_AUTO, WEFT_FUSION_FP32_ACC, 1e-6f);
  weft_fusion_info info;
  WK(weft_fusion_get_info(ws, &info));
  struct Bad { const char *what; weft_fusion_params p; };
  std::vector<Bad> bads;
  auto add = [&](const char *what, auto edit) { weft_fusion_params p = good; edit(p); bads.push_back({what, p}); };
  add("hidden not a multiple of 8", [](weft_fusion_params &p) { p.hidden = 4092; });
  add("hidden 0", [](weft_fusion_params &p) { p.hidden = 0; });
  add("tokens above the declared maximum", [&](weft_fusion_params &p) { p.tokens = info.max_tokens + 1; });
  add("negative tokens", [](weft_fusion_params &p) { p.tokens = -1; });
  add("misaligned input", [&](weft_fusion_params &p) { p.input = (char *)v.in + 2; });
  add("misaligned residual_out", [&](weft_fusion_params &p) { p.residual_out = (char *)v.res_out + 8; });
  add("unsupported dtype (i32)", [](weft_fusion_params &p) { p.dtype = WEFT_I32; });
  add("missing residual", [](weft_fusion_params &p) { p.residual = nullptr; });
  add("missing weight", [](weft_fusion_params &p) { p.weight = nullptr; });
  add("missing norm_out", [](weft_fusion_params &p) { p.norm_out = nullptr; });
  add("norm_out overlapping residual_out", [&](weft_fusion_params &p) { p.norm_out = (char *)v.res_out + 4096; });
  add("residual_out overlapping input partially", [&](weft_fusion_params &p) { p.residual_out = (char *)v.in + 4096; });
  add("unknown pattern", [](weft_fusion_params &p) { p.pattern = 7; });
  add("unknown algorithm", [](weft_fusion_params &p) { p.algo = 9; });
  add("unknown flags", [](weft_fusion_params &p) { p.flags = 64; });
  add("FP8 without scale", [](weft_fusion_params &p) { p.pattern = WEFT_FUSION_AR_RMSNORM_FP8; p.scale = nullptr; });
  add("negative eps", [](weft_fusion_params &p) { p.eps = -1.f; });
  if (info.dtype != WEFT_F32)
    add("dtype wider than the workspace", [](weft_fusion_params &p) { p.dtype = WEFT_F32; });
  for (auto &b : bads) {
    const int rc = weft_fusion_run(ws, &b.p);
    verdict(rc == WEFT_EINVAL, "refusal: %s -> %d (%s)", b.what, rc, rc ? weft_last_error() : "accepted!");
  }
  run_and_check(ws, v, d, good, "after refusals");
  v.release();
}

/* A peer that never launches: the kernel gives up at its deadline. */
static void test_faults(weft_cpugroup *cg) {
  for (int mode = 0; mode < 3; mode++) { /* 0: one-shot timeout, 1: two-shot timeout, 2: abort */
    weft_fusion_opts o;
    memset(&o, 0, sizeof o);
    o.max_tokens = 64; o.hidden = 4096; o.dtype = WEFT_BF16;
    o.timeout_ms = mode == 2 ? 60000 : 300;
    weft_fusion *f = nullptr;
    WK(weft_fusion_create(cg, &o, &f));
    HostData d;
    gen(d, 16, 4096, WEFT_BF16, 17);
    Dev v = Dev::with(d);
    CU(cudaStreamSynchronize(g_stream));
    int rc = 0;
    double ms = 0;
    if (g_rank == 0) {
      weft_fusion_params p = params(v, d, WEFT_FUSION_AR_RMSNORM,
                                    mode == 1 ? WEFT_FUSION_TWOSHOT : WEFT_FUSION_ONESHOT,
                                    WEFT_FUSION_FP32_ACC, 1e-6f);
      timespec t0, t1;
      clock_gettime(CLOCK_MONOTONIC, &t0);
      WK(weft_fusion_run(f, &p));
      if (mode == 2) { usleep(200000); WK(weft_fusion_abort(f)); }
      CU(cudaStreamSynchronize(g_stream));
      clock_gettime(CLOCK_MONOTONIC, &t1);
      ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
      rc = weft_fusion_check_error(f);
      if (rc) say("     (%s)\n", weft_last_error());
      const int rc2 = weft_fusion_run(f, &p);
      if (rc2 != WEFT_ESTATE) rc = 1; /* a failed workspace must refuse further calls */
    }
    const int want = mode == 2 ? WEFT_EABORT : WEFT_ETIMEOUT;
    verdict(g_rank != 0 || rc == want, "fault: %s -> %d after %.0f ms (want %d), later calls refused",
            mode == 0 ? "one-shot peer missing" : mode == 1 ? "two-shot peer missing" : "abort",
            rc, ms, want);
    WK(weft_cpugroup_barrier(cg));
    WK(weft_fusion_destroy(f));
    v.release();
  }
}
