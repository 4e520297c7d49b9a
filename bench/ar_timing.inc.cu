// ar_timing.inc.cu — part of bench/ar_bench.cu (included there, one
// translation unit): `--bench` times every backend at every size (graph and
// eager) and checks the policy against the measured crossovers; its records
// and timing helpers (Rec, graph_us, make_bufs) serve the sweep and link too.

// ------------------------------------------------------------------ bench

__global__ void fill_rand_bf16(__nv_bfloat16 *p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint64_t z = seed ^ (i * 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    p[i] = __float2bfloat16_rn((float)((z >> 40) * (2.0 / 16777216.0) - 1.0));
  }
}

// One measured point (results format: docs/architecture.md#conventions-in-one-place). op "all_reduce" (backends nccl, oneshot,
// ..., and "sweep ..." configurations) or "link" (bench/ar_link.inc.cu).
struct Rec {
  std::string op, backend, mode;
  size_t bytes;
  double us, busbw;
  int grid = 0, threads = 0;  // weft kernels: the launch shape
};
static std::vector<Rec> g_recs;

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

static double busbw_of(size_t bytes, double us) { return bytes / us / 1e3 * 2.0 * (g_world - 1) / g_world; }

// Graph replay timing of call(i) (i: call index, rotates buffers): ig calls
// captured once, replayed back to back with an event between replays (GPU
// time only, no host skew). Returns the slower rank's median us per call.
template <typename F> static double graph_us(F call, int ig, int reps) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(g_s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < ig; i++) call(i);
  CK(cudaStreamEndCapture(g_s, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  barrier();
  for (int i = 0; i < 2; i++) CK(cudaGraphLaunch(exec, g_s));
  CK(cudaStreamSynchronize(g_s));
  std::vector<cudaEvent_t> ev(reps + 1);
  for (auto &e : ev) CK(cudaEventCreate(&e));
  barrier();
  CK(cudaEventRecord(ev[0], g_s));
  for (int r = 0; r < reps; r++) {
    CK(cudaGraphLaunch(exec, g_s));
    CK(cudaEventRecord(ev[r + 1], g_s));
  }
  CK(cudaEventSynchronize(ev[reps]));
  std::vector<double> gt;
  for (int r = 0; r < reps; r++) {
    float ms;
    CK(cudaEventElapsedTime(&ms, ev[r], ev[r + 1]));
    gt.push_back(ms * 1e3 / ig);
  }
  for (auto &e : ev) CK(cudaEventDestroy(e));
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  return allreduce_i64((int64_t)(median(gt) * 1e3), WEFT_MAX) / 1e3;  // ns resolution
}

static int graph_calls(size_t bytes) { return bytes <= (1u << 20) ? 100 : bytes <= (16u << 20) ? 20 : 5; }

static void check_kernel_error(const char *what, size_t bytes) {
  if (weft_ar_check_error(g_ar)) {
    LOG("%s %zu: %s", what, bytes, weft_last_error());
    fatal("kernel error during a benchmark");
  }
}

// backend: -1 NCCL, else weft algo
static bool bench_one(int backend, size_t bytes, std::vector<DBuf> &ins, std::vector<DBuf> &outs) {
  const size_t n = bytes / 2;
  const int nb = (int)ins.size();
  int grid = 0, threads = 0;
  if (backend >= 0) {
    int kind;
    const char *why;
    if (weft_ar_resolve(g_ar, n, WEFT_BF16, backend, &kind, &why)) return false;
    if ((backend & 0xff) == WEFT_AR_ONESHOT && kind != WEFT_AR_ONESHOT) return false;  // measured as oneshot-flag
    WK(weft_ar_shape(g_ar, n, WEFT_BF16, backend, &grid, &threads));
  }
  auto call = [&](int i) {
    if (backend < 0) nccl_run(ins[i % nb].p, outs[i % nb].p, n, WEFT_BF16, g_s);
    else WK(weft_ar_run(g_ar, ins[i % nb].p, outs[i % nb].p, n, WEFT_BF16, backend, g_s));
  };
  const std::string name = backend < 0 ? "nccl" : algon(backend);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  // warm up
  for (int i = 0; i < 5; i++) call(i);
  CK(cudaStreamSynchronize(g_s));
  // eager: many calls back to back
  const int ie = bytes <= (1u << 20) ? 200 : bytes <= (16u << 20) ? 50 : 10;
  std::vector<double> eager;
  for (int rep = 0; rep < 3; rep++) {
    barrier();
    CK(cudaEventRecord(e0, g_s));
    for (int i = 0; i < ie; i++) call(i);
    CK(cudaEventRecord(e1, g_s));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    eager.push_back(ms * 1e3 / ie);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  const double g_us = graph_us(call, graph_calls(bytes), g_quick ? 10 : 20);
  if (backend >= 0) check_kernel_error(name.c_str(), bytes);
  const double e_us = allreduce_i64((int64_t)(median(eager) * 1e3), WEFT_MAX) / 1e3;
  Rec r{"all_reduce", name, "graph", bytes, g_us, busbw_of(bytes, g_us)};
  r.grid = grid;
  r.threads = threads;
  g_recs.push_back(r);
  r.mode = "eager";
  r.us = e_us;
  r.busbw = busbw_of(bytes, e_us);
  g_recs.push_back(r);
  return true;
}

static std::string fmt_bytes(size_t b) {
  char s[32];
  if (b >= (1u << 20)) snprintf(s, sizeof s, "%zu MiB", b >> 20);
  else snprintf(s, sizeof s, "%zu KiB", b >> 10);
  return s;
}

static const Rec *find_rec(const char *op, const std::string &backend, const char *mode, size_t bytes) {
  for (auto &r : g_recs)
    if (r.op == op && r.backend == backend && r.mode == mode && r.bytes == bytes) return &r;
  return nullptr;
}

// Input buffers (random bf16, different on every rank) for one size.
static void make_bufs(size_t bytes, std::vector<DBuf> &ins, std::vector<DBuf> &outs) {
  const int nb = (int)std::max<size_t>(1, std::min<size_t>(4, (size_t)(1u << 30) / bytes));
  ins.assign(nb, DBuf());
  outs.assign(nb, DBuf());
  for (int i = 0; i < nb; i++) {
    ins[i].alloc(bytes);
    outs[i].alloc(bytes);
    fill_rand_bf16<<<1024, 256, 0, g_s>>>((__nv_bfloat16 *)ins[i].p, bytes / 2, mix64(bytes * 7 + i + g_rank * 1000003ull));
    CK(cudaGetLastError());
  }
  CK(cudaStreamSynchronize(g_s));
}

static const char *kBackends[] = {"nccl", "oneshot", "oneshot-flag", "twoshot", "auto", "auto-determ",
                                  "oneshot-nopdl", "quick-fp", "quick-int8", "quick-int4", "quick-fp8"};

static void bench(size_t max_bytes) {
  // auto-determ: deterministic mode (issue 18) beside the default, same buffers
  const int backends[] = {-1, 1, 3, 2, 0, WEFT_AR_AUTO | WEFT_AR_DETERMINISTIC};
  const double t0 = now_s();
  for (size_t bytes = 1024; bytes <= max_bytes; bytes *= (g_quick ? 4 : 2)) {
    std::vector<DBuf> ins, outs;
    make_bufs(bytes, ins, outs);
    for (int be : backends) {
      if (be < 0 && !nccl.comm) continue;
      bench_one(be, bytes, ins, outs);
    }
    if (bytes <= (1u << 20)) bench_one(WEFT_AR_ONESHOT | WEFT_AR_NO_PDL, bytes, ins, outs);
    // the quick all-reduce's codecs (docs/quick-allreduce.md) from 1 MiB: bus
    // bandwidth counted on the bf16 bytes, so above the link means compression paid
    if (bytes >= (1u << 20))
      for (int q = WEFT_AR_QUICK_FP; q <= WEFT_AR_QUICK_FP8; q++) bench_one(q, bytes, ins, outs);
    if (g_rank == 0) {
      std::string line = "bench " + fmt_bytes(bytes) + ":";
      for (auto &r : g_recs)
        if (r.op == "all_reduce" && r.bytes == bytes && r.mode == "graph") {
          char s[96];
          snprintf(s, sizeof s, " %s %.2f us", r.backend.c_str(), r.us);
          line += s;
          if (r.grid) { snprintf(s, sizeof s, " [%dx%d]", r.grid, r.threads); line += s; }
        }
      LOG("%s", line.c_str());
    }
  }
  if (g_rank != 0) return;
  // table for people
  printf("\n%-9s", "bytes");
  for (auto nm : kBackends) printf(" %13s", nm);
  printf("   (graph us; bus GB/s at >= 1 MiB)\n");
  for (size_t bytes = 1024; bytes <= max_bytes; bytes *= 2) {
    printf("%-9s", fmt_bytes(bytes).c_str());
    for (auto nm : kBackends) {
      const Rec *r = find_rec("all_reduce", nm, "graph", bytes);
      char s[32] = "-";
      if (r && bytes >= (1u << 20)) snprintf(s, sizeof s, "%.1f/%.0f", r->us, r->busbw);
      else if (r) snprintf(s, sizeof s, "%.2f", r->us);
      printf(" %13s", s);
    }
    printf("\n");
  }
  printf("eager small-size latency (us):");
  for (auto &r : g_recs)
    if (r.op == "all_reduce" && r.mode == "eager" && (r.bytes == 1024 || r.bytes == 65536) && r.backend != "auto")
      printf(" %s@%s=%.2f", r.backend.c_str(), fmt_bytes(r.bytes).c_str(), r.us);
  // the policy against the measurements: which weft kernel was fastest at
  // each size, what auto ran, and the crossovers that src/coll/allreduce.c's
  // resolve() should use
  printf("\n\npolicy check (graph us): size: best weft kernel | auto's | nccl\n");
  size_t last_lamport_best = 0, first_twoshot_best = 0;
  for (size_t bytes = 1024; bytes <= max_bytes; bytes *= 2) {
    const char *algos[] = {"oneshot", "oneshot-flag", "twoshot"};
    const Rec *best = nullptr;
    for (auto nm : algos) {
      const Rec *r = find_rec("all_reduce", nm, "graph", bytes);
      if (r && (!best || r->us < best->us)) best = r;
    }
    const Rec *au = find_rec("all_reduce", "auto", "graph", bytes);
    const Rec *nc = find_rec("all_reduce", "nccl", "graph", bytes);
    if (!best) continue;
    if (best->backend == "oneshot") last_lamport_best = bytes;
    if (best->backend == "twoshot" && !first_twoshot_best) first_twoshot_best = bytes;
    printf("  %-8s %-13s %8.2f | %8.2f%s | %8.2f\n", fmt_bytes(bytes).c_str(), best->backend.c_str(), best->us,
           au ? au->us : 0.0, au && au->us > best->us * 1.03 ? " (>3% off)" : "", nc ? nc->us : 0.0);
  }
  // deterministic mode against the default (goal: <= 1.15x everywhere)
  double worst = 0;
  size_t worst_at = 0;
  for (size_t bytes = 1024; bytes <= max_bytes; bytes *= 2) {
    const Rec *au = find_rec("all_reduce", "auto", "graph", bytes);
    const Rec *de = find_rec("all_reduce", "auto-determ", "graph", bytes);
    if (au && de && de->us / au->us > worst) { worst = de->us / au->us; worst_at = bytes; }
  }
  if (worst_at) printf("deterministic / default (graph): worst %.3fx at %s\n", worst, fmt_bytes(worst_at).c_str());
  // the quick all-reduce against weft's bf16 two-shot and NCCL: the first size
  // from which each codec is faster than both (the policy file's quick_min)
  for (int q = WEFT_AR_QUICK_INT8; q <= WEFT_AR_QUICK_FP8; q++) {
    size_t cross = 0;
    for (size_t bytes = max_bytes; bytes >= (1u << 20); bytes /= 2) {
      const Rec *qr = find_rec("all_reduce", algon(q), "graph", bytes);
      const Rec *tw = find_rec("all_reduce", "twoshot", "graph", bytes);
      const Rec *nc = find_rec("all_reduce", "nccl", "graph", bytes);
      if (!qr || !tw) continue;
      if (qr->us < tw->us && (!nc || qr->us < nc->us)) cross = bytes;
      else break;
    }
    printf("quick crossover: %s faster than two-shot and NCCL from %s up\n", algon(q),
           cross ? fmt_bytes(cross).c_str() : "- (never)");
  }
  printf("measured crossovers: Lamport one-shot best up to %s; two-shot first best at %s\n",
         last_lamport_best ? fmt_bytes(last_lamport_best).c_str() : "-",
         first_twoshot_best ? fmt_bytes(first_twoshot_best).c_str() : "-");
  printf("bench took %.1f s\n", now_s() - t0);
}
