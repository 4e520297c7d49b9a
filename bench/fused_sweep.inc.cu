// fused_sweep.inc.cu — part of bench/fused_bench.cu (included there, one
// translation unit): the tuning sweep (--only sweep): blocks per row, push-ahead
// distance, probes that leave work out, and the one-shot's phase clock.

/* The one-shot's phase clock (kernels/fused_norm.cu, WF_FUSED_TR_*): mean
 * ns since kernel entry at each phase, block 0 thread 0, first row. */
struct Trace { std::string what; int64_t T, H; int cluster; double us; double ns[WF_FUSED_TR_SLOTS]; };
static std::vector<Trace> g_traces;
static double g_clock_ghz = 0;

static double clock_ghz() {
  if (g_clock_ghz == 0) {
    int dev = 0, khz = 0;
    CU(cudaGetDevice(&dev));
    CU(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, dev));
    g_clock_ghz = khz > 0 ? khz / 1e6 : 1.98;
  }
  return g_clock_ghz;
}

/* One timed configuration under probe bits (and the phase clock when trace
 * is set); every rank sets the same. */
static double timed(weft_fusion *ws, const weft_fusion_params &p, int probe, int R,
                    unsigned long long *trace = nullptr, double *ns = nullptr) {
  if (trace) CU(cudaMemsetAsync(trace, 0, WF_FUSED_TR_SLOTS * sizeof(unsigned long long), g_stream));
  wf_fused_set_probe(probe, trace);
  const double us = time_graph([&] { WK(weft_fusion_run(ws, &p)); }, 40, R);
  wf_fused_set_probe(0, nullptr);
  if (trace && ns) {
    unsigned long long h[WF_FUSED_TR_SLOTS];
    CU(cudaMemcpy(h, trace, sizeof h, cudaMemcpyDeviceToHost));
    const double n = h[WF_FUSED_TR_CALLS] ? (double)h[WF_FUSED_TR_CALLS] : 1.0;
    ns[0] = (double)h[WF_FUSED_TR_CALLS];
    for (int i = 1; i < WF_FUSED_TR_SLOTS; i++) ns[i] = (double)h[i] / n / clock_ghz();
  }
  return us;
}

/* The one-shot with 1, 2, 4, 8 blocks per row (forced), at few tokens: the
 * data for the automatic choice (kernels/fused_norm.cu geometry()). Then, at
 * the automatic geometry, where the time goes: the same call without the
 * sum-of-squares exchange (wrong norm), with the residual add only, as the
 * AR pattern, and with the input loaded late (the old prologue), timed; and
 * the phase clock of the fused and the AR call. */
static void sweep(int quick) {
  weft_fusion *ws = bench_workspace(2048, 16384);
  Dev v;
  v.alloc(2048, 16384, WEFT_BF16);
  unsigned long long *trace = nullptr;
  CU(cudaMalloc((void **)&trace, WF_FUSED_TR_SLOTS * sizeof(unsigned long long)));
  const int R = quick ? 10 : 30;
  struct Pt { int64_t H, T; };
  const Pt pts[] = {{4096, 1}, {4096, 8}, {4096, 32}, {4096, 128}, {8192, 1},  {8192, 8},  {8192, 32},
                    {8192, 128}, {5120, 1}, {5120, 32}, {7168, 1}, {7168, 32}, {16384, 1}, {16384, 32}};
  for (const Pt &pt : pts) {
    const int64_t H = pt.H, T = pt.T;
    const HostData d = fresh_point(v, T, H, 23);
    /* PDL on: the default launch */
    const int fl = WEFT_FUSION_FP32_ACC | WEFT_FUSION_PDL;
    const weft_fusion_params pf = params(v, d, WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_ONESHOT, fl, 1e-6f);
    const weft_fusion_params pa = params(v, d, WEFT_FUSION_AR, WEFT_FUSION_ONESHOT, fl, 1e-6f);
    int auto_c = 1;
    /* exchange 0: st.async on transaction barriers (the kernel's own);
     * 1: the old plain remote stores + barrier.cluster (probe) */
    for (int xch : {0, 1})
      for (int c : {0, 1, 2, 4, 8}) {
        if (xch == 1 && c < 2) continue; /* no exchange without a split */
        wf_fused_set_tune(c, 0);
        int al = 0, b = 0, t = 0, cl = 0;
        /* a launch this configuration cannot make is skipped (on every rank) */
        int64_t bad = wf_fusion_geometry(ws, &pf, &al, &b, &t, &cl) != 0 || weft_fusion_run(ws, &pf) != 0;
        if (bad) say("  sweep  C=%d %lld x %lld: %s\n", c, (long long)T, (long long)H, weft_last_error());
        WK(weft_cpugroup_allreduce_i64(g_cg, &bad, 1, WEFT_MAX));
        if (bad) continue;
        if (c == 0) auto_c = cl;
        const double us = timed(ws, pf, xch ? WF_FUSED_PROBE_CLUSTER_BARRIER : 0, R);
        char be[32];
        snprintf(be, sizeof be, c == 0 ? "oneshot_auto" : xch ? "oneshot_bar_c%d" : "oneshot_c%d", c);
        g_recs.push_back({"fused_ar_rmsnorm", be, T, H, T * H * 2, us});
        say("  sweep  %-16s %6lld x %-5lld %10.2f us   (%d blocks x %d threads, %d per row group)\n", be,
            (long long)T, (long long)H, us, b, t, cl);
      }
    wf_fused_set_tune(0, 0);
    /* where the time goes, at the automatic geometry */
    struct Ab { const char *be, *op; const weft_fusion_params *p; int probe; };
    const Ab abs[] = {
        {"oneshot_auto_noreduce", "fused_ar_rmsnorm", &pf, WF_FUSED_PROBE_NO_REDUCE},
        {"oneshot_auto_resadd", "fused_ar_rmsnorm", &pf, WF_FUSED_PROBE_NO_NORM},
        {"oneshot_auto_late", "fused_ar_rmsnorm", &pf, WF_FUSED_PROBE_LATE_INPUT},
        {"oneshot_auto_latetrig", "fused_ar_rmsnorm", &pf, WF_FUSED_PROBE_LATE_TRIGGER},
        {"oneshot_auto_earlywait", "fused_ar_rmsnorm", &pf, WF_FUSED_PROBE_EARLY_CLUSTER_WAIT},
        {"oneshot_auto_earlyinit", "fused_ar_rmsnorm", &pf, WF_FUSED_PROBE_EARLY_MBAR_INIT},
        {"oneshot_auto_resadd_nosync", "fused_ar_rmsnorm", &pf,
         WF_FUSED_PROBE_NO_NORM | WF_FUSED_PROBE_NO_CLUSTER_SYNC},
        {"oneshot_auto_resadd_nores", "fused_ar_rmsnorm", &pf,
         WF_FUSED_PROBE_NO_NORM | WF_FUSED_PROBE_NO_RESIDUAL_LOAD},
        {"oneshot_auto_resadd_nosync_nores", "fused_ar_rmsnorm", &pf,
         WF_FUSED_PROBE_NO_NORM | WF_FUSED_PROBE_NO_CLUSTER_SYNC | WF_FUSED_PROBE_NO_RESIDUAL_LOAD},
        {"oneshot_auto_noreduce_nosync", "fused_ar_rmsnorm", &pf,
         WF_FUSED_PROBE_NO_REDUCE | WF_FUSED_PROBE_NO_CLUSTER_SYNC},
        {"fused_ar_oneshot_auto", "all_reduce", &pa, 0},
        {"fused_ar_oneshot_late", "all_reduce", &pa, WF_FUSED_PROBE_LATE_INPUT},
    };
    for (const Ab &x : abs) {
      const double us = timed(ws, *x.p, x.probe, R);
      g_recs.push_back({x.op, x.be, T, H, T * H * 2, us});
      say("  sweep  %-22s %6lld x %-5lld %10.2f us%s\n", x.be, (long long)T, (long long)H, us,
          x.probe & (WF_FUSED_PROBE_NO_REDUCE | WF_FUSED_PROBE_NO_NORM | WF_FUSED_PROBE_NO_RESIDUAL_LOAD)
              ? "   (probe: outputs not valid)" : "");
    }
    for (int which = 0; which < 2; which++) {
      Trace tc;
      tc.what = which ? "AR pattern" : "fused";
      tc.T = T; tc.H = H; tc.cluster = auto_c;
      tc.us = timed(ws, which ? pa : pf, 0, R, trace, tc.ns);
      g_traces.push_back(tc);
      say("  trace  %-10s %6lld x %-5lld %7.2f us/call (traced); ns after entry, block 0: checked %.0f "
          "pushed %.0f cleared %.0f arrived %.0f reduced %.0f stored %.0f end %.0f (%.0f calls, %.2f GHz)\n",
          tc.what.c_str(), (long long)T, (long long)H, tc.us, tc.ns[1], tc.ns[2], tc.ns[3], tc.ns[4],
          tc.ns[5], tc.ns[6], tc.ns[7], tc.ns[0], clock_ghz());
    }
  }
  /* push-ahead distance (rows a block pushes before consuming its first)
   * where blocks own several rows */
  for (const Pt &pt : {Pt{4096, 512}, Pt{8192, 512}, Pt{4096, 2048}, Pt{8192, 2048}}) {
    const int64_t H = pt.H, T = pt.T;
    const HostData d = fresh_point(v, T, H, 26);
    const weft_fusion_params pf = params(v, d, WEFT_FUSION_AR_RMSNORM, WEFT_FUSION_ONESHOT,
                                         WEFT_FUSION_FP32_ACC | WEFT_FUSION_PDL, 1e-6f);
    for (int ahead : {1, 2, 4, 8, 64}) {
      wf_fused_set_push_ahead(ahead);
      const double us = timed(ws, pf, 0, R);
      char be[32];
      snprintf(be, sizeof be, "oneshot_ahead%d", ahead);
      g_recs.push_back({"fused_ar_rmsnorm", be, T, H, T * H * 2, us});
      say("  sweep  %-16s %6lld x %-5lld %10.2f us\n", be, (long long)T, (long long)H, us);
    }
    wf_fused_set_push_ahead(0);
    /* where the time goes at these sizes too (probes leave work out) */
    {
      const weft_fusion_params pa = params(v, d, WEFT_FUSION_AR, WEFT_FUSION_ONESHOT,
                                           WEFT_FUSION_FP32_ACC | WEFT_FUSION_PDL, 1e-6f);
      struct Ab { const char *be, *op; const weft_fusion_params *p; int probe; };
      const Ab abs[] = {{"oneshot_auto_noreduce", "fused_ar_rmsnorm", &pf, WF_FUSED_PROBE_NO_REDUCE},
                        {"oneshot_auto_resadd", "fused_ar_rmsnorm", &pf, WF_FUSED_PROBE_NO_NORM},
                        {"fused_ar_oneshot_auto", "all_reduce", &pa, 0}};
      for (const Ab &x : abs) {
        const double us = timed(ws, *x.p, x.probe, R);
        g_recs.push_back({x.op, x.be, T, H, T * H * 2, us});
        say("  sweep  %-22s %6lld x %-5lld %10.2f us\n", x.be, (long long)T, (long long)H, us);
      }
    }
    /* rows split over a cluster here too (the automatic rule keeps one block
     * per row once tokens x C blocks exceed two per SM) */
    for (int c : {2, 4}) {
      wf_fused_set_tune(c, 0);
      int al = 0, b = 0, t = 0, cl = 0;
      int64_t bad = wf_fusion_geometry(ws, &pf, &al, &b, &t, &cl) != 0;
      WK(weft_cpugroup_allreduce_i64(g_cg, &bad, 1, WEFT_MAX));
      if (bad) continue;
      const double us = timed(ws, pf, 0, R);
      char be[32];
      snprintf(be, sizeof be, "oneshot_c%d", c);
      g_recs.push_back({"fused_ar_rmsnorm", be, T, H, T * H * 2, us});
      say("  sweep  %-16s %6lld x %-5lld %10.2f us   (%d blocks x %d threads, %d per row group)\n", be,
          (long long)T, (long long)H, us, b, t, cl);
    }
    wf_fused_set_tune(0, 0);
  }
  sync_and_check_error(ws, "sweep");
  cudaFree(trace);
  v.release();
  WK(weft_fusion_destroy(ws));
}
