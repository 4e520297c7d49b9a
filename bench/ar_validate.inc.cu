// ar_validate.inc.cu — part of bench/ar_bench.cu (included there, one
// translation unit): `--validate` runs every algorithm against the f64
// reference, NCCL and the other ranks: sizes, launch shapes, bursts without
// host sync, CUDA-graph replays, bad input refused before launch.

// Run one all-reduce of case c with algo (in-place or not) and check it.
static void run_check(weft_ar *ar, Case &c, int algo, bool inplace, const char *tag, DBuf &din,
                      DBuf &dout, DBuf &dnccl) {
  char name[200];
  snprintf(name, sizeof name, "%s %s %s n=%zu%s", tag, dtn(c.dt), algon(algo), c.n, inplace ? " inplace" : "");
  const size_t bytes = c.n * esz(c.dt);
  din.alloc(bytes);
  dout.alloc(bytes + GUARD);
  CK(cudaMemcpyAsync(din.p, c.mine.data(), bytes, cudaMemcpyHostToDevice, g_s));
  CK(cudaMemsetAsync(dout.p, POISON, bytes + GUARD, g_s));
  if (inplace) CK(cudaMemcpyAsync(dout.p, din.p, bytes, cudaMemcpyDeviceToDevice, g_s));
  CK(cudaStreamSynchronize(g_s));
  barrier();  // ranks launch together: host-side skew never eats the kernels' timeout
  int rc = weft_ar_run(ar, inplace ? dout.p : din.p, dout.p, c.n, c.dt, algo, g_s);
  if (rc) { check(false, name, "run -> %d: %s", rc, weft_last_error()); return; }
  CK(cudaStreamSynchronize(g_s));
  rc = weft_ar_check_error(ar);
  if (rc) { check(false, name, "kernel error %d: %s", rc, weft_last_error()); fatal("kernel error"); }
  std::vector<char> out(bytes + GUARD);
  CK(cudaMemcpy(out.data(), dout.p, bytes + GUARD, cudaMemcpyDeviceToHost));
  Cmp m = compare(c.dt, out.data(), c);
  bool guard_ok = true;
  for (size_t i = 0; i < GUARD; i++) guard_ok &= (unsigned char)out[bytes + i] == POISON;
  // identical on every rank
  auto hs = allgather_u64(hash_bytes(out.data(), bytes));
  bool same = true;
  for (int r = 1; r < g_world; r++) same &= hs[r] == hs[0];
  // NCCL on the same inputs
  size_t nccl_bad = 0, nccl_diff_bits = 0;
  if (nccl.comm) {
    dnccl.alloc(bytes);
    nccl_run(din.p, dnccl.p, c.n, c.dt, g_s);
    CK(cudaStreamSynchronize(g_s));
    std::vector<char> no(bytes);
    CK(cudaMemcpy(no.data(), dnccl.p, bytes, cudaMemcpyDeviceToHost));
    nccl_bad = compare(c.dt, no.data(), c).bad;
    const int es = esz(c.dt);
    for (size_t i = 0; i < c.n; i++) {
      double a = load_d(c.dt, out.data(), i), b = load_d(c.dt, no.data(), i);
      if (memcmp(out.data() + i * es, no.data() + i * es, es) && !(isnan(a) && isnan(b)) && !(a == 0 && b == 0))
        nccl_diff_bits++;
    }
  }
  check(m.bad == 0 && guard_ok && same && nccl_bad == 0, name,
        "%zu bad vs f64 ref (first i=%zu got %.9g want %.9g), guard %s, ranks %s, nccl bad %zu",
        m.bad, m.first, m.got, m.want, guard_ok ? "ok" : "OVERWRITTEN", same ? "identical" : "DIFFER", nccl_bad);
  if (nccl.comm && nccl_diff_bits && g_world == 2)
    LOG("note %s: %zu of %zu elements differ in bits from NCCL (both within tolerance)", name, nccl_diff_bits, c.n);
}

// ------------------------------------------------------------------ validate

static void validate(size_t max_bytes) {
  DBuf din, dout, dn;
  const int dts[] = {WEFT_BF16, WEFT_F16, WEFT_F32};
  const size_t small[] = {1, 7, 1023, 4096, (1u << 20) + 3};
  uint64_t seed = 1000;
  // 1. sizes x dtypes x algorithms, eager, half of them in place
  int k = 0;
  for (int dt : dts)
    for (size_t n : small)
      for (int algo = 0; algo <= 3; algo++) {
        Case c{dt, n, seed++, true, {}, {}, {}};
        make_case(c);
        run_check(g_ar, c, algo, (k++ & 1) != 0, "eager", din, dout, dn);
      }
  // 1b. launch shapes other than the automatic ones (weft_ar_set_param):
  // split pusher/reducer blocks, multi-sub-round flag rounds, tiny grids
  // (many rounds / many Lamport steps), small blocks; in place and not
  {
    struct K { int algo, threads, grid, sub, split; } ks[] = {
        {3, 0, 0, 2, 1}, {3, 256, 0, 4, 0}, {3, 256, 6, 1, 1}, {3, 0, 2, 1, 1}, {3, 64, 3, 3, 0},
        {1, 32, 3, 0, 0}, {1, 64, 0, 0, 0}, {1, 256, 1, 0, 0}, {2, 0, 5, 0, 0},
    };
    const size_t kn[] = {7, 1023, 4096, (1u << 20) + 3, (3u << 20) + 5};
    int i = 0;
    for (auto &k : ks) {
      WK(weft_ar_set_param(g_ar, "threads", k.threads));
      WK(weft_ar_set_param(g_ar, "grid", k.grid));
      WK(weft_ar_set_param(g_ar, "sub", k.sub));
      WK(weft_ar_set_param(g_ar, "split", k.split));
      for (size_t n : kn) {
        const int dt = (i % 5 == 4) ? WEFT_F32 : WEFT_BF16;
        int kind, g, t;
        const char *why;
        if (weft_ar_resolve(g_ar, n, dt, k.algo, &kind, &why) || kind != k.algo) continue;
        Case c{dt, n, seed++, true, {}, {}, {}};
        make_case(c);
        WK(weft_ar_shape(g_ar, n, dt, k.algo, &g, &t));
        char tag[96];
        snprintf(tag, sizeof tag, "shape %dx%d sub%d%s", g, t, k.sub ? k.sub : 1, k.split ? " split" : "");
        run_check(g_ar, c, k.algo, (i++ & 1) != 0, tag, din, dout, dn);
      }
    }
    for (const char *nm : {"threads", "grid", "sub", "split"}) WK(weft_ar_set_param(g_ar, nm, 0));
    check(weft_ar_set_param(g_ar, "threads", 48) == WEFT_EINVAL && weft_ar_set_param(g_ar, "nonsense", 1) == WEFT_EINVAL &&
              weft_ar_set_param(g_ar, "grid", 5000) == WEFT_EINVAL,
          "set_param rejects bad values", "%s", weft_last_error());
  }
  // 2. benchmark sizes (bf16), each algorithm, changing data
  for (size_t bytes = 1024; bytes <= max_bytes; bytes *= (g_quick ? 16 : 2)) {
    Case c{WEFT_BF16, bytes / 2, seed++, true, {}, {}, {}};
    make_case(c);
    for (int algo = 0; algo <= 3; algo++) {
      int kind;
      const char *why;
      if (weft_ar_resolve(g_ar, c.n, c.dt, algo, &kind, &why)) continue;  // does not fit: skip
      run_check(g_ar, c, algo, algo == 2, "size", din, dout, dn);
    }
  }
  // 3. bursts: mixed algorithms and sizes back to back, no host sync between
  for (int dt : {WEFT_BF16, WEFT_F32}) {
    const size_t ns[] = {4096, 1023, (1u << 20) + 3, 7, 65536, 4096, 1u << 18, 3, 300000, 16};
    const int algos[] = {1, 2, 3, 1 | WEFT_AR_NO_PDL, 0, 3 | WEFT_AR_NO_PDL, 1, 2, 1, 1};
    const int K = 10;
    std::vector<Case> cs(K);
    std::vector<DBuf> ins(K), outs(K);
    for (int i = 0; i < K; i++) {
      cs[i] = Case{dt, ns[i], seed++, true, {}, {}, {}};
      make_case(cs[i]);
      ins[i].alloc(ns[i] * esz(dt));
      outs[i].alloc(ns[i] * esz(dt));
      CK(cudaMemcpy(ins[i].p, cs[i].mine.data(), ns[i] * esz(dt), cudaMemcpyHostToDevice));
      CK(cudaMemset(outs[i].p, POISON, ns[i] * esz(dt)));
    }
    barrier();
    for (int rep = 0; rep < 3; rep++) {
      bool ok = true;
      for (int i = 0; i < K; i++) {
        int rc = weft_ar_run(g_ar, ins[i].p, outs[i].p, ns[i], dt, algos[i], g_s);
        if (rc) { LOG("burst run: %s", weft_last_error()); ok = false; }
      }
      CK(cudaStreamSynchronize(g_s));
      if (weft_ar_check_error(g_ar)) { LOG("burst: %s", weft_last_error()); fatal("burst kernel error"); }
      size_t bad = 0;
      for (int i = 0; i < K; i++) {
        std::vector<char> o(ns[i] * esz(dt));
        CK(cudaMemcpy(o.data(), outs[i].p, o.size(), cudaMemcpyDeviceToHost));
        size_t b = compare(dt, o.data(), cs[i]).bad;
        if (b) LOG("burst %s rep %d call %d (%s n=%zu): %zu bad", dtn(dt), rep, i, algon(algos[i]), ns[i], b);
        bad += b;
      }
      char name[96];
      snprintf(name, sizeof name, "burst %s rep %d (10 mixed calls, no sync)", dtn(dt), rep);
      check(ok && bad == 0, name, "%zu bad elements", bad);
      // change the data for the next repetition
      for (int i = 0; i < K; i++) {
        cs[i].seed = seed++;
        make_case(cs[i]);
        CK(cudaMemcpy(ins[i].p, cs[i].mine.data(), ns[i] * esz(dt), cudaMemcpyHostToDevice));
        CK(cudaMemset(outs[i].p, POISON, ns[i] * esz(dt)));
      }
      barrier();
    }
  }
  // 4. CUDA graph: capture 4 calls, replay with refilled inputs
  {
    const int dt = WEFT_BF16;
    const size_t ns[] = {4096, (1u << 20) + 3, 1023, 1u << 16};
    const int algos[] = {1, 2, 3, 0};
    const int K = 4;
    std::vector<Case> cs(K);
    std::vector<DBuf> ins(K), outs(K);
    for (int i = 0; i < K; i++) {
      cs[i] = Case{dt, ns[i], seed++, true, {}, {}, {}};
      make_case(cs[i]);
      ins[i].alloc(ns[i] * 2);
      outs[i].alloc(ns[i] * 2);
      CK(cudaMemcpy(ins[i].p, cs[i].mine.data(), ns[i] * 2, cudaMemcpyHostToDevice));
    }
    // warm up outside capture (as nccl-tests does)
    for (int i = 0; i < K; i++) WK(weft_ar_run(g_ar, ins[i].p, outs[i].p, ns[i], dt, algos[i], g_s));
    CK(cudaStreamSynchronize(g_s));
    WK(weft_ar_check_error(g_ar));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(g_s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < K; i++) WK(weft_ar_run(g_ar, ins[i].p, outs[i].p, ns[i], dt, algos[i], g_s));
    CK(cudaStreamEndCapture(g_s, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    barrier();
    for (int rep = 0; rep < 5; rep++) {
      for (int i = 0; i < K; i++) {
        cs[i].seed = seed++;
        make_case(cs[i]);
        CK(cudaMemcpyAsync(ins[i].p, cs[i].mine.data(), ns[i] * 2, cudaMemcpyHostToDevice, g_s));
        CK(cudaMemsetAsync(outs[i].p, POISON, ns[i] * 2, g_s));
      }
      CK(cudaStreamSynchronize(g_s));
      barrier();  // (not needed for correctness; keeps the ranks' replays close)
      CK(cudaGraphLaunch(exec, g_s));
      CK(cudaStreamSynchronize(g_s));
      if (weft_ar_check_error(g_ar)) { LOG("graph: %s", weft_last_error()); fatal("graph kernel error"); }
      size_t bad = 0;
      for (int i = 0; i < K; i++) {
        std::vector<char> o(ns[i] * 2);
        CK(cudaMemcpy(o.data(), outs[i].p, o.size(), cudaMemcpyDeviceToHost));
        bad += compare(dt, o.data(), cs[i]).bad;
      }
      char name[96];
      snprintf(name, sizeof name, "graph replay %d with refilled inputs (4 calls, 3 kernels)", rep);
      check(bad == 0, name, "%zu bad elements", bad);
    }
    // several replays back to back, then one check (epochs advance in device memory)
    for (int rep = 0; rep < 7; rep++) CK(cudaGraphLaunch(exec, g_s));
    CK(cudaStreamSynchronize(g_s));
    size_t bad = 0;
    for (int i = 0; i < K; i++) {
      std::vector<char> o(ns[i] * 2);
      CK(cudaMemcpy(o.data(), outs[i].p, o.size(), cudaMemcpyDeviceToHost));
      bad += compare(dt, o.data(), cs[i]).bad;
    }
    check(bad == 0 && weft_ar_check_error(g_ar) == 0, "graph 7 replays back to back", "%zu bad", bad);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    // eager after graph (the epoch is shared between both)
    Case c{WEFT_BF16, 5000, seed++, true, {}, {}, {}};
    make_case(c);
    run_check(g_ar, c, 1, false, "eager-after-graph", din, dout, dn);
  }
  // 5. bad input: rejected before launch, with the right code
  {
    DBuf b;
    b.alloc(1 << 20);
    char *p = (char *)b.p;
    size_t maxb;
    WK(weft_ar_info(g_ar, NULL, NULL, &maxb, NULL, NULL));
    struct { const char *name; int rc; } t[] = {
        {"unaligned input", weft_ar_run(g_ar, p + 2, p + 4096, 100, WEFT_BF16, 0, g_s)},
        {"unaligned output", weft_ar_run(g_ar, p, p + 4098, 100, WEFT_BF16, 0, g_s)},
        {"size above workspace", weft_ar_run(g_ar, p, p, maxb / 2 + 8, WEFT_BF16, 0, g_s)},
        {"dtype i32", weft_ar_run(g_ar, p, p, 100, WEFT_I32, 0, g_s)},
        {"dtype f64", weft_ar_run(g_ar, p, p, 100, WEFT_F64, 0, g_s)},
        {"count 0", weft_ar_run(g_ar, p, p, 0, WEFT_BF16, 0, g_s)},
        {"NULL buffer", weft_ar_run(g_ar, NULL, p, 100, WEFT_BF16, 0, g_s)},
        {"unknown algo", weft_ar_run(g_ar, p, p, 100, WEFT_BF16, 9, g_s)},
    };
    for (auto &x : t) {
      char name[96];
      snprintf(name, sizeof name, "bad input rejected: %s", x.name);
      check(x.rc == WEFT_EINVAL, name, "rc %d (%s)", x.rc, weft_last_error());
    }
    CK(cudaStreamSynchronize(g_s));
    check(weft_ar_check_error(g_ar) == 0, "bad input launched nothing", "%s", weft_last_error());
  }
}
