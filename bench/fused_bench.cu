// fused_bench.cu — validate-then-benchmark harness for the fused all-reduce
// + residual add + RMSNorm (+ FP8) of src/coll/fusion.c / kernels/fused_norm.cu.
//
// Run as N processes (torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT), e.g. scripts/gpu-fusion. Every rank generates
// every rank's input (deterministic seeds), so each checks its own outputs
// against an f64 host reference without exchanging data; only 64-bit hashes
// cross the cpu group (all ranks must produce bit-equal outputs).
//
// Checks (each counted PASS/FAIL; any FAIL makes the exit status 1):
//   matrix    tokens {1,3,77,128,1000,8192} x hidden {2048,4096,5120,7168,
//             8192,16384}, bf16, AR+RMSNorm, one-shot and two-shot on the
//             same data: each against the reference, the two bit-equal, all
//             ranks bit-equal; inputs and residual hold +0, -0 and zero rows;
//   variants  f16 / f32, AR / AR+RMSNorm / +FP8 (within the e4m3 codes the
//             norm bound allows, and code for code the host quantisation of
//             the device's residual_out), Gemma, f32 accumulation off,
//             PDL with trigger early / at end followed by a PDL consumer,
//             the one-shot with a different grid on each rank;
//   stress    a long eager sequence of calls of changing size, algorithm and
//             pattern (Lamport rotation and clears with varying sizes);
//   graph     a CUDA graph of several calls replayed many times on changing
//             data, every replay checked;
//   refusals  bad shapes, alignment, dtype, overlap, tokens over the maximum:
//             WEFT_EINVAL before launch, and the workspace still works;
//   faults    a peer that never launches: WEFT_ETIMEOUT, no hang; an abort:
//             WEFT_EABORT.
// Benchmark (bf16, hidden {4096, 8192} x tokens {1,...,8192}, CUDA-graph
// replay, median per call): fused one-shot / two-shot / auto (+ PDL), the
// unfused path (NCCL all-reduce + weft_cuda_rmsnorm), plain all-reduces of
// the same bytes (this kernel's AR pattern, weft_ar, NCCL), the grid each
// point used; then the sweep: the one-shot at 1..128 tokens with 1, 2, 4, 8
// blocks per row (cluster), to tune the automatic choice, and at the
// automatic geometry where the time goes (probes that leave out the
// sum-of-squares exchange, or everything after residual_out; the AR pattern;
// the old late-input prologue; a per-phase clock inside the kernel); then
// the skew test: a peer late before every replay must cost its lateness once,
// not put the pair into a slow state (A/B against the old spin). JSON +
// markdown (results format: docs/architecture.md#conventions-in-one-place) into --out (default $OUT, else .).
//
// --only a,b,...: run only these parts (refusals, matrix, variants, stress,
// graph, faults, bench, sweep, skew); --quick: fewer repetitions.
//
// This file: the plumbing and main. The parts, included below as one
// translation unit: bench/fused_reference.inc.cu (inputs, f64 reference,
// device buffers), fused_tests.inc.cu (the checks), fused_timing.inc.cu (the
// benchmark), fused_sweep.inc.cu, fused_skew.inc.cu, fused_results.inc.cu.
#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

#include "machine_tag.h"
#include "weft.h"
#include "coll/fusion_internal.h" /* wf_fused_set_tune, wf_fusion_geometry: the harness links the objects */

/* ------------------------------------------------------------ plumbing */

static int g_rank = 0, g_world = 1;
static weft_cpugroup *g_cg = nullptr;
static cudaStream_t g_stream;
static int g_pass = 0, g_fail = 0;

[[noreturn]] static void fatal(const char *what, int rc, int line) {
  fprintf(stderr, "[rank %d] FATAL line %d: %s -> %d: %s\n", g_rank, line, what, rc,
          weft_last_error());
  fflush(stderr);
  _exit(2);
}
#define WK(call) do { int rc_ = (call); if (rc_) fatal(#call, rc_, __LINE__); } while (0)
#define CU(call)                                                                         \
  do {                                                                                   \
    cudaError_t e_ = (call);                                                             \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "[rank %d] FATAL line %d: %s: %s\n", g_rank, __LINE__, #call,      \
              cudaGetErrorString(e_));                                                   \
      _exit(2);                                                                          \
    }                                                                                    \
  } while (0)

static void say(const char *fmt, ...) {
  if (g_rank != 0) return;
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  fflush(stdout);
}

/* A check result: every rank records it; the verdict is agreed (MAX of fails). */
static void verdict(bool ok_local, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  int64_t bad = ok_local ? 0 : 1;
  WK(weft_cpugroup_allreduce_i64(g_cg, &bad, 1, WEFT_MAX));
  if (!ok_local) fprintf(stderr, "[rank %d] FAIL %s\n", g_rank, msg);
  if (bad) { g_fail++; say("FAIL %s\n", msg); }
  else { g_pass++; say("PASS %s\n", msg); }
}

static uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}
static uint64_t seed_of(uint64_t a, uint64_t b, uint64_t c = 0, uint64_t d = 0) {
  return mix64(mix64(mix64(mix64(a) ^ b) ^ c) ^ d);
}

template <class F> static void parallel_for(int64_t n, F f) {
  const int nt = (int)std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::atomic<int64_t> next(0);
  auto work = [&] {
    for (int64_t i; (i = next.fetch_add(1)) < n;) f(i);
  };
  std::vector<std::thread> ts;
  for (int t = 1; t < nt; t++) ts.emplace_back(work);
  work();
  for (auto &t : ts) t.join();
}

static int esize(int dt) { return dt == WEFT_F32 ? 4 : 2; }
static const char *dname(int dt) { return dt == WEFT_F32 ? "f32" : dt == WEFT_F16 ? "f16" : "bf16"; }
static const char *pname(int p) {
  return p == WEFT_FUSION_AR ? "AR" : p == WEFT_FUSION_AR_RMSNORM ? "AR+RMSNorm" : "AR+RMSNorm+FP8";
}
static const char *aname(int a) { return a == WEFT_FUSION_ONESHOT ? "one-shot" : a == WEFT_FUSION_TWOSHOT ? "two-shot" : "auto"; }

static uint64_t fnv(const void *p, size_t n, uint64_t h = 1469598103934665603ULL) {
  const uint8_t *b = (const uint8_t *)p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ULL;
  return h;
}
/* true when every rank passed the same hash */
static bool same_everywhere(uint64_t h) {
  const void *all;
  const size_t *lens;
  WK(weft_cpugroup_allgather(g_cg, &h, sizeof h, &all, &lens));
  for (int i = 0; i < g_world; i++)
    if (memcmp((const char *)all + i * sizeof h, &h, sizeof h) != 0) return false;
  return true;
}

/* The harness's parts, one translation unit: each file below uses the
 * plumbing above and the files before it. */
#include "fused_reference.inc.cu" /* inputs, f64 reference, device buffers */
#include "fused_tests.inc.cu"     /* the checks */
#include "fused_timing.inc.cu"    /* the benchmark and its timing helpers */
#include "fused_sweep.inc.cu"     /* the tuning sweep and phase clock */
#include "fused_skew.inc.cu"      /* the late-peer test */
#include "fused_results.inc.cu"   /* JSON and markdown */

/* ---------------------------------------------------------------- main */

static const char *envs(const char *n, const char *d) {
  const char *v = getenv(n);
  return v && *v ? v : d;
}

int main(int argc, char **argv) {
  bool quick = false, do_check = true, do_bench = true;
  std::string only;
  const char *out = envs("OUT", "."), *machine = envs("WEFT_MACHINE", ""),
             *commit = envs("WEFT_COMMIT", "unknown");
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--quick")) quick = true;
    else if (!strcmp(argv[i], "--no-bench")) do_bench = false;
    else if (!strcmp(argv[i], "--no-check")) do_check = false;
    else if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
    else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = std::string(",") + argv[++i] + ",";
    else if (!strcmp(argv[i], "--machine") && i + 1 < argc) machine = argv[++i];
    else {
      fprintf(stderr, "usage: %s [--quick] [--no-check] [--no-bench] [--only PART,...] [--out DIR] "
              "[--machine NAME]\n  parts: refusals matrix variants stress graph faults skew bench sweep\n", argv[0]);
      return 2;
    }
  }
  g_rank = atoi(envs("RANK", "0"));
  g_world = atoi(envs("WORLD_SIZE", "1"));
  const int local = atoi(envs("LOCAL_RANK", envs("RANK", "0")));
  if (g_world < 2) { fprintf(stderr, "fused_bench: needs WORLD_SIZE >= 2 (run through scripts/gpu-fusion)\n"); return 2; }
  WK(weft_cuda_set_device(local));
  char tag[128];
  if (!*machine) {   // the GPU it runs on names the results, unless --machine / WEFT_MACHINE
    cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, local));
    weft_machine_tag(prop.name, g_world, tag, sizeof tag);
    machine = tag;
  }
  weft_store_opts so;
  memset(&so, 0, sizeof so);
  so.host = envs("MASTER_ADDR", "127.0.0.1");
  so.port = atoi(envs("MASTER_PORT", "29500"));
  so.is_server = g_rank == 0;
  so.timeout_ms = 120000;
  weft_store *st = nullptr;
  WK(weft_store_open(&so, &st));
  std::vector<int> ranks(g_world);
  for (int i = 0; i < g_world; i++) ranks[i] = i;
  WK(weft_cpugroup_create(st, "fusion-bench", ranks.data(), g_world, g_rank, 120000, &g_cg));
  CU(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  say("fused_bench: world %d, %s%s\n", g_world, weft_build_info(), quick ? ", quick" : "");

  timespec t_start;
  clock_gettime(CLOCK_MONOTONIC, &t_start);
  auto secs = [&] {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)(t.tv_sec - t_start.tv_sec) + (t.tv_nsec - t_start.tv_nsec) / 1e9;
  };
  auto part = [&](const char *name) {
    return only.empty() || only.find(std::string(",") + name + ",") != std::string::npos;
  };
  do_check = do_check && (part("refusals") || part("matrix") || part("variants") || part("stress") ||
                          part("graph") || part("faults"));
  if (do_check) {
    weft_fusion_opts o;
    memset(&o, 0, sizeof o);
    o.max_tokens = 8192; o.hidden = 16384; o.dtype = WEFT_F32; o.timeout_ms = 10000;
    weft_fusion *ws = nullptr;
    WK(weft_fusion_create(g_cg, &o, &ws));
    weft_fusion_info info;
    WK(weft_fusion_get_info(ws, &info));
    say("check workspace: %.1f MiB per rank, auto one-shot up to %s bytes\n",
        info.workspace_bytes / 1048576.0,
        info.oneshot_max_bytes == INT64_MAX ? "any number of" : std::to_string(info.oneshot_max_bytes).c_str());
    if (part("refusals")) { say("-- refusals (%.0f s)\n", secs()); test_refusals(ws); }
    if (part("matrix")) { say("-- matrix (%.0f s)\n", secs()); test_matrix(ws, quick); }
    if (part("variants")) {
      say("-- variants (%.0f s)\n", secs());
      test_variants(ws);
      test_grids(ws);
      test_inplace(ws);
    }
    if (part("stress")) { say("-- stress (%.0f s)\n", secs()); test_stress(ws, quick ? 40 : 150); }
    if (part("graph")) {
      say("-- graph (%.0f s)\n", secs());
      test_graph(ws, 77, 4096, quick ? 10 : 40);
      test_graph(ws, 1000, 7168, quick ? 5 : 15);
    }
    WK(weft_fusion_destroy(ws));
    if (part("faults")) { say("-- faults (%.0f s)\n", secs()); test_faults(g_cg); }
    say("checks: %d passed, %d failed (%.0f s)\n", g_pass, g_fail, secs());
  }
  do_bench = do_bench && (part("bench") || part("sweep") || part("skew"));
  if (do_bench) {
    weft_nccl *nccl = nullptr;
    if (weft_nccl_create(g_cg, 1, &nccl)) { /* blocking: calls enqueue inline */
      say("NCCL unavailable (%s): no unfused / NCCL figures\n", weft_last_error());
      nccl = nullptr;
    }
    weft_ar *war = nullptr;
    if (weft_ar_create(g_cg, (size_t)8192 * 8192 * 2, &war)) {
      say("weft_ar unavailable (%s)\n", weft_last_error());
      war = nullptr;
    }
    if (part("bench")) {
      say("-- benchmark (graph replay, median per call) (%.0f s)\n", secs());
      bench(quick, nccl, war);
      write_results(out, machine, commit); /* again below with the sweep */
    }
    if (part("sweep")) {
      say("-- one-shot blocks per row (graph replay, median per call) (%.0f s)\n", secs());
      sweep(quick);
      write_results(out, machine, commit);
    }
    if (part("skew")) {
      say("-- late peer (graph replay, median per call) (%.0f s)\n", secs());
      skew_test(quick);
      write_results(out, machine, commit);
    }
    if (war) weft_ar_destroy(war);
    if (nccl) weft_nccl_destroy(nccl);
  }
  WK(weft_cpugroup_barrier(g_cg));
  weft_cpugroup_destroy(g_cg);
  weft_store_close(st);
  say("fused_bench: %d passed, %d failed (%.0f s)\n", g_pass, g_fail, secs());
  return g_fail ? 1 : 0;
}
