// fused_skew.inc.cu — part of bench/fused_bench.cu (included there, one
// translation unit): the late-peer test (--only skew), A/B against the old spin.

/* A late peer: rank 1 sleeps before every replay, so each replay starts with
 * a wait longer than 20 us. Per call this should cost about skew / 40 (the
 * calls per replay) over the figure without skew. With the old spin (every
 * waiting thread reads the host abort word once its wait passed 20 us; probe
 * OLD_SPIN) each call instead lasted about (waiting threads) x 31 ns and kept
 * the peer late for the next call: the stuck state of the 2026-11-30 run. */
static void skew_test(int quick) {
  weft_fusion *ws = bench_workspace(128, 8192);
  Dev v;
  v.alloc(128, 8192, WEFT_BF16);
  const int R = quick ? 5 : 15;
  struct Pt { int64_t T, H; };
  for (const Pt &pt : {Pt{32, 4096}, Pt{128, 4096}, Pt{128, 8192}}) {
    const int64_t T = pt.T, H = pt.H;
    const HostData d = fresh_point(v, T, H, 26);
    const weft_fusion_params p = params(v, d, WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_AUTO, WEFT_FUSION_FP32_ACC, 1e-6f);
    int al = 0, b = 0, t = 0, cl = 0;
    WK(wf_fusion_geometry(ws, &p, &al, &b, &t, &cl));
    auto run = [&](int probe, uint64_t skew_ns) {
      wf_fused_set_probe(probe, nullptr);
      const double us = time_graph([&] { WK(weft_fusion_run(ws, &p)); }, 40, R, skew_ns);
      wf_fused_set_probe(0, nullptr);
      return us;
    };
    const double base = run(0, 0), s50 = run(0, 50000), s300 = run(0, 300000);
    const double old50 = run(WF_FUSED_PROBE_OLD_SPIN, 50000);
    const int64_t bytes = T * H * 2;
    g_recs.push_back({"fused_ar_rmsnorm", "skew0", T, H, bytes, base});
    g_recs.push_back({"fused_ar_rmsnorm", "skew50", T, H, bytes, s50});
    g_recs.push_back({"fused_ar_rmsnorm", "skew300", T, H, bytes, s300});
    g_recs.push_back({"fused_ar_rmsnorm", "skew50_oldspin", T, H, bytes, old50});
    say("  skew   %4lld x %-5lld %d x %d threads: no skew %.2f us; peer 50 us late per 40 calls %.2f us "
        "(expect %.2f); 300 us late %.2f (expect %.2f); OLD spin, 50 us late %.2f us (stuck state: "
        "~%.0f us)\n", (long long)T, (long long)H, b, t, base, s50, base + 50.0 / 40, s300,
        base + 300.0 / 40, old50, (double)b * t * 0.031);
  }
  sync_and_check_error(ws, "skew");
  v.release();
  WK(weft_fusion_destroy(ws));
}
