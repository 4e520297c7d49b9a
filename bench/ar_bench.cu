// ar_bench.cu — validate-then-benchmark harness for weft's own all-reduce
// (src/coll/allreduce.c, kernels/allreduce.cu), NCCL side by side on the same
// buffers. One process per GPU; rank/world/rendezvous from RANK, WORLD_SIZE,
// LOCAL_RANK, MASTER_ADDR, MASTER_PORT (scripts/weft-run or scripts/gpu-ar).
//
//   build/ar_bench [--validate] [--bench] [--sweep] [--link] [--dead-peer]
//                  [--leak N] [--quick] [--out DIR] [--max-bytes N]
// (no mode flag: validate + dead-peer + bench). Exit 0 only when every check
// passed. Results: DIR/ar-<machine>-<date>.json and .md (results format: docs/architecture.md#conventions-in-one-place),
// DIR/ar-validate.txt. Prints "PASS <name>" / "FAIL <name>: why" lines and
// tables (rank 0): the benchmark (every power of 2, 4x steps with --quick)
// with a policy check against the measured crossovers; --sweep: launch
// shapes of each kernel (bench/ar_sweep.inc.cu); --link: what NVLink
// delivers to copy kernels and the copy engine, and a copy-engine one-shot
// prototype (bench/ar_link.inc.cu).
//
// Checks: f64 host reference on the same random data every rank generates
// for all ranks (so no data exchange is needed), NCCL on the same inputs,
// bitwise-identical outputs across ranks (hash all-gather), poisoned outputs
// with guard elements after the end, in-place calls, ±0 / NaN / Inf inputs,
// bursts of calls with changing data and mixed algorithms without host sync,
// CUDA-graph replays with refilled inputs, bad input rejected before launch,
// a dead peer reported within the timeout (and an abort), and N
// create/destroy cycles leaking neither fds nor device memory.
//
// This file: the basics, NCCL, the data and reference, the results files and
// main. Each mode is a bench/ar_*.inc.cu included below (one translation
// unit): ar_validate, ar_dead_peer, ar_leaks, ar_timing (--bench), ar_sweep,
// ar_link.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <dirent.h>
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include "machine_tag.h"
#include "weft.h"

// ------------------------------------------------------------------ basics

static int g_rank = 0, g_world = 1, g_local = 0;
static weft_store *g_store;
static weft_cpugroup *g_grp;
static int g_fail = 0, g_pass = 0;
static FILE *g_vlog;  // validation log (rank 0)
static bool g_quick = false;

static void logf_(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char buf[2048];
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  printf("[ar_bench r%d] %s\n", g_rank, buf);
  fflush(stdout);
  if (g_vlog) { fprintf(g_vlog, "r%d %s\n", g_rank, buf); fflush(g_vlog); }
}
#define LOG(...) logf_(__VA_ARGS__)

static void fatal(const char *what) {
  LOG("FATAL %s", what);
  exit(2);
}
#define CK(x)                                                                      \
  do {                                                                             \
    cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                       \
      char b_[512];                                                                \
      snprintf(b_, sizeof b_, "%s:%d %s: %s", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      fatal(b_);                                                                   \
    }                                                                              \
  } while (0)
#define WK(x)                                                                      \
  do {                                                                             \
    int r_ = (x);                                                                  \
    if (r_ != 0) {                                                                 \
      char b_[1024];                                                               \
      snprintf(b_, sizeof b_, "%s:%d %s -> %d: %s", __FILE__, __LINE__, #x, r_, weft_last_error()); \
      fatal(b_);                                                                   \
    }                                                                              \
  } while (0)

static void check(bool ok, const char *name, const char *fmt = "", ...) {
  if (ok) {
    g_pass++;
    LOG("PASS %s", name);
    return;
  }
  g_fail++;
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  LOG("FAIL %s: %s", name, buf);
}

static double now_s() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void barrier() { WK(weft_cpugroup_barrier(g_grp)); }
static int64_t allreduce_i64(int64_t v, int op) {
  WK(weft_cpugroup_allreduce_i64(g_grp, &v, 1, op));
  return v;
}
static std::vector<uint64_t> allgather_u64(uint64_t v) {
  const void *out;
  const size_t *lens;
  WK(weft_cpugroup_allgather(g_grp, &v, sizeof v, &out, &lens));
  std::vector<uint64_t> r(g_world);
  memcpy(r.data(), out, sizeof(uint64_t) * g_world);
  return r;
}

// f(begin, end, thread) over [0, n) on up to 16 threads.
template <typename F> static void par_for(size_t n, F f) {
  unsigned nt = std::min<unsigned>(16, std::max(1u, std::thread::hardware_concurrency()));
  if (n < (1u << 16)) nt = 1;
  std::vector<std::thread> th;
  for (unsigned t = 0; t < nt; t++)
    th.emplace_back([=] { f(n * t / nt, n * (t + 1) / nt, t); });
  for (auto &x : th) x.join();
}

// ------------------------------------------------------------------ NCCL

typedef struct { char internal[128]; } ncclUniqueId;
typedef void *ncclComm_t;
struct Nccl {
  void *h = nullptr;
  int (*getUniqueId)(ncclUniqueId *);
  int (*commInitRank)(ncclComm_t *, int, ncclUniqueId, int);
  int (*allReduce)(const void *, void *, size_t, int, int, ncclComm_t, cudaStream_t);
  int (*commDestroy)(ncclComm_t);
  const char *(*getErrorString)(int);
  int (*getVersion)(int *);
  ncclComm_t comm = nullptr;
  int version = 0;
} nccl;

static int nccl_dtype(int dt) { return dt == WEFT_F32 ? 7 : dt == WEFT_F16 ? 6 : 9; }

static void nccl_init() {
  const char *cands[] = {getenv("WEFT_NCCL_LIB"), "libnccl.so.2", "libnccl.so",
                         "/usr/local/cuda/lib64/libnccl.so.2", "/usr/lib/x86_64-linux-gnu/libnccl.so.2"};
  int ok = 0;
  for (const char *c : cands) {
    if (!c || !*c) continue;
    nccl.h = dlopen(c, RTLD_NOW | RTLD_LOCAL);
    if (nccl.h) break;
  }
  if (nccl.h) {
    nccl.getUniqueId = (int (*)(ncclUniqueId *))dlsym(nccl.h, "ncclGetUniqueId");
    nccl.commInitRank = (int (*)(ncclComm_t *, int, ncclUniqueId, int))dlsym(nccl.h, "ncclCommInitRank");
    nccl.allReduce = (int (*)(const void *, void *, size_t, int, int, ncclComm_t, cudaStream_t))dlsym(nccl.h, "ncclAllReduce");
    nccl.commDestroy = (int (*)(ncclComm_t))dlsym(nccl.h, "ncclCommDestroy");
    nccl.getErrorString = (const char *(*)(int))dlsym(nccl.h, "ncclGetErrorString");
    nccl.getVersion = (int (*)(int *))dlsym(nccl.h, "ncclGetVersion");
    ok = nccl.getUniqueId && nccl.commInitRank && nccl.allReduce && nccl.commDestroy;
  }
  // all ranks must agree before anyone waits in ncclCommInitRank
  if (!allreduce_i64(ok, WEFT_AND)) {
    LOG("NCCL not available on every rank (%s): NCCL comparisons skipped", dlerror() ? dlerror() : "symbols missing");
    nccl.comm = nullptr;
    return;
  }
  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  if (g_rank == 0 && nccl.getUniqueId(&id) != 0) fatal("ncclGetUniqueId");
  const void *out;
  size_t len;
  WK(weft_cpugroup_broadcast(g_grp, 0, &id, sizeof id, &out, &len));
  memcpy(&id, out, sizeof id);
  int r = nccl.commInitRank(&nccl.comm, g_world, id, g_rank);
  if (r != 0) {
    LOG("ncclCommInitRank failed: %s", nccl.getErrorString ? nccl.getErrorString(r) : "?");
    fatal("nccl init");
  }
  if (nccl.getVersion) nccl.getVersion(&nccl.version);
  LOG("NCCL %d ready", nccl.version);
}

static void nccl_run(const void *in, void *out, size_t count, int dt, cudaStream_t s) {
  int r = nccl.allReduce(in, out, count, nccl_dtype(dt), 0 /*sum*/, nccl.comm, s);
  if (r != 0) fatal("ncclAllReduce");
}

// ------------------------------------------------------------ data and ref

static int esz(int dt) { return dt == WEFT_F32 ? 4 : 2; }
static const char *dtn(int dt) { return dt == WEFT_F32 ? "f32" : dt == WEFT_F16 ? "f16" : "bf16"; }
static const char *algon(int a) {
  if (a & WEFT_AR_DETERMINISTIC) return (a & 0xff) == 0 ? "auto-determ" : "determ";
  if (a & WEFT_AR_NO_PDL) {
    a &= 0xff;
    return a == 0 ? "auto-nopdl" : a == 1 ? "oneshot-nopdl" : a == 2 ? "twoshot-nopdl" : "oneshot-flag-nopdl";
  }
  if (a >= WEFT_AR_QUICK_FP && a <= WEFT_AR_QUICK_FP8) {
    static const char *const q[] = {"quick-fp", "quick-int8", "quick-int4", "quick-fp8"};
    return q[a - WEFT_AR_QUICK_FP];
  }
  return a == 0 ? "auto" : a == 1 ? "oneshot" : a == 2 ? "twoshot" : "oneshot-flag";
}

static inline uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static inline float urand(uint64_t seed, uint64_t i) {
  return (float)((mix64(seed ^ mix64(i)) >> 40) * (2.0 / 16777216.0) - 1.0);
}

static inline double load_d(int dt, const void *p, size_t i) {
  if (dt == WEFT_F32) return ((const float *)p)[i];
  if (dt == WEFT_F16) return __half2float(((const __half *)p)[i]);
  return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
}
static inline void store_f(int dt, void *p, size_t i, float v) {
  if (dt == WEFT_F32) ((float *)p)[i] = v;
  else if (dt == WEFT_F16) ((__half *)p)[i] = __float2half_rn(v);
  else ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v);
}
static inline void store_bits(int dt, void *p, size_t i, uint32_t bits) {
  if (dt == WEFT_F32) ((uint32_t *)p)[i] = bits;
  else ((uint16_t *)p)[i] = (uint16_t)bits;
}

// Rank r's input for a case: uniform [-1, 1) plus special values in the
// first 8 positions (when count >= 16).
static void gen(int dt, void *buf, size_t n, int r, uint64_t seed, bool specials) {
  par_for(n, [&](size_t a, size_t b, unsigned) {
    for (size_t i = a; i < b; i++) store_f(dt, buf, i, urand(seed * 131 + r, i));
  });
  if (!specials || n < 16) return;
  const uint32_t negz = dt == WEFT_F32 ? 0x80000000u : 0x8000u;
  store_bits(dt, buf, 0, negz);                              // -0 everywhere: sum ±0
  store_bits(dt, buf, 1, r == 0 ? 0u : negz);                // +0 and -0
  if (r == g_world - 1) store_f(dt, buf, 2, NAN); // NaN from one rank
  if (r == 0) store_f(dt, buf, 3, INFINITY);                 // +Inf
  if (r == 0) store_f(dt, buf, 4, INFINITY);                 // +Inf + -Inf = NaN
  if (r == 1) store_f(dt, buf, 4, -INFINITY);
  store_f(dt, buf, 5, 0.0f);                                 // exact zero
  store_f(dt, buf, 6, r == 0 ? 0.75f : r == 1 ? -0.75f : 0.0f);  // cancellation
  if (dt == WEFT_F32 && r == 0) store_bits(dt, buf, 7, 0x80008000u);  // the Lamport sentinel word
  if (dt != WEFT_F32) {  // a 16-bit pair of -0.0 (the sentinel word) at 8, 9
    store_bits(dt, buf, 8, negz);
    store_bits(dt, buf, 9, negz);
  }
}

struct Case {
  int dt;
  size_t n;
  uint64_t seed;
  bool specials;
  std::vector<char> mine;     // this rank's input
  std::vector<double> ref;    // f64 sum over ranks
  std::vector<double> absum;  // sum of |x| (accumulation-error bound)
};

static void make_case(Case &c) {
  const size_t bytes = c.n * esz(c.dt);
  c.mine.assign(bytes, 0);
  c.ref.assign(c.n, 0.0);
  c.absum.assign(c.n, 0.0);
  std::vector<char> tmp(bytes);
  for (int r = 0; r < g_world; r++) {
    void *dst = r == g_rank ? c.mine.data() : tmp.data();
    gen(c.dt, dst, c.n, r, c.seed, c.specials);
    par_for(c.n, [&](size_t a, size_t b, unsigned) {
      for (size_t i = a; i < b; i++) {
        double x = load_d(c.dt, dst, i);
        c.ref[i] += x;
        c.absum[i] += fabs(x);
      }
    });
  }
}

struct Cmp {
  size_t bad = 0, first = (size_t)-1;
  double got = 0, want = 0;
};

static Cmp compare(int dt, const void *out, const Case &c) {
  const double rel = dt == WEFT_F32 ? ldexp(1.0, -23) : dt == WEFT_F16 ? ldexp(1.0, -10) : ldexp(1.0, -7);
  const double tiny = dt == WEFT_F32 ? 1e-37 : dt == WEFT_F16 ? 6e-8 : 1e-37;
  std::vector<Cmp> parts(16);
  par_for(c.n, [&](size_t a, size_t b, unsigned t) {
    Cmp m;
    for (size_t i = a; i < b; i++) {
      const double o = load_d(dt, out, i), e = c.ref[i];
      bool ok;
      if (isnan(e)) ok = isnan(o);
      else if (isinf(e)) ok = o == e;
      else ok = !isnan(o) && fabs(o - e) <= rel * fabs(e) + (g_world - 1) * ldexp(1.0, -23) * c.absum[i] + tiny;
      if (!ok) {
        if (!m.bad) { m.first = i; m.got = o; m.want = e; }
        m.bad++;
      }
    }
    parts[t] = m;
  });
  Cmp r;
  for (auto &m : parts)  // threads cover increasing ranges: the first bad one is the first
    if (m.bad) {
      if (!r.bad) { r.first = m.first; r.got = m.got; r.want = m.want; }
      r.bad += m.bad;
    }
  return r;
}

static uint64_t hash_bytes(const void *p, size_t n) {
  const uint64_t *w = (const uint64_t *)p;
  uint64_t h = 1469598103934665603ull;
  size_t k = n / 8;
  for (size_t i = 0; i < k; i++) h = (h ^ w[i]) * 1099511628211ull;
  for (size_t i = k * 8; i < n; i++) h = (h ^ ((const unsigned char *)p)[i]) * 1099511628211ull;
  return h;
}

// ------------------------------------------------------------------ device bufs

struct DBuf {
  void *p = nullptr;
  size_t bytes = 0;
  void alloc(size_t b) {
    if (b <= bytes) return;
    if (p) CK(cudaFree(p));
    CK(cudaMalloc(&p, b));
    bytes = b;
  }
  ~DBuf() { if (p) cudaFree(p); }
};

static const size_t GUARD = 256;  // bytes after the output, must stay poisoned
static const unsigned char POISON = 0x7b;

static weft_ar *g_ar;
static cudaStream_t g_s;

// The modes, one translation unit: each file below uses what is above it
// (ar_timing.inc.cu's records and timing helpers: the sweep and link too).
#include "ar_validate.inc.cu"   // --validate
#include "ar_dead_peer.inc.cu"  // --dead-peer
#include "ar_leaks.inc.cu"      // --leak N
#include "ar_timing.inc.cu"     // --bench
#include "ar_sweep.inc.cu"      // --sweep
#include "ar_link.inc.cu"       // --link

static void write_results(const char *outdir, size_t max_bytes) {
  if (g_rank != 0 || g_recs.empty()) return;
  char date[16], machine[256];
  time_t t = time(NULL);
  strftime(date, sizeof date, "%Y-%m-%d", gmtime(&t));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, g_local));
  const char *mk = getenv("WEFT_MACHINE");
  snprintf(machine, sizeof machine, "%s", mk ? mk : "");
  if (!mk || !*mk) weft_machine_tag(prop.name, g_world, machine, sizeof machine);
  const char *commit = getenv("WEFT_COMMIT");
  std::string base = std::string(outdir) + "/ar-" + machine + "-" + date;
  FILE *j = fopen((base + ".json").c_str(), "w");
  FILE *m = fopen((base + ".md").c_str(), "w");
  if (!j || !m) { LOG("cannot write %s.{json,md}", base.c_str()); if (j) fclose(j); if (m) fclose(m); return; }
  fprintf(j, "{\"machine\": \"%s\", \"date\": \"%s\", \"commit\": \"%s\", \"nccl_version\": %d, \"records\": [\n",
          machine, date, commit ? commit : "unknown", nccl.version);
  for (size_t i = 0; i < g_recs.size(); i++) {
    auto &r = g_recs[i];
    char shape[64] = "";
    if (r.grid) snprintf(shape, sizeof shape, ", \"grid\": %d, \"threads\": %d", r.grid, r.threads);
    fprintf(j, "  {\"op\": \"%s\", \"backend\": \"%s\", \"mode\": \"%s\", \"dtype\": \"bf16\", "
               "\"world\": %d, \"bytes\": %zu, \"us\": %.3f, \"busbw_gbs\": %.2f%s}%s\n",
            r.op.c_str(), r.backend.c_str(), r.mode.c_str(), g_world, r.bytes, r.us, r.busbw, shape,
            i + 1 < g_recs.size() ? "," : "");
  }
  fprintf(j, "]}\n");
  fclose(j);
  const size_t nnames = sizeof kBackends / sizeof kBackends[0];
  bool any_bench = false;
  for (auto &r : g_recs) any_bench |= r.op == "all_reduce" && r.backend.compare(0, 5, "sweep") != 0;
  for (const char *mode : {"graph", "eager"}) {
    if (!any_bench) break;
    fprintf(m, "\n### all-reduce bf16, world %d, %s mode: median us per call (bus GB/s)\n\n", g_world, mode);
    fprintf(m, "| bytes |");
    for (auto nm : kBackends) fprintf(m, " %s |", nm);
    fprintf(m, "\n|---|");
    for (size_t k = 0; k < nnames; k++) fprintf(m, "---|");
    fprintf(m, "\n");
    for (size_t bytes = 1024; bytes <= max_bytes; bytes *= 2) {
      fprintf(m, "| %s |", fmt_bytes(bytes).c_str());
      for (auto nm : kBackends) {
        const Rec *r = find_rec("all_reduce", nm, mode, bytes);
        if (r) fprintf(m, " %.2f (%.0f) |", r->us, r->busbw);
        else fprintf(m, " |");
      }
      fprintf(m, "\n");
    }
  }
  sweep_markdown(m);
  link_markdown(m);
  fprintf(m, "\nmachine %s, date %s, commit %s, NCCL %d; graph: median over replays of a graph of "
             "5-100 calls rotating over up to 4 random input buffers; eager: calls back to back; "
             "each figure the slower rank's median. Sweep: graph mode, one configuration of weft_ar_set_param "
             "per row. Link: eager, both ranks start together (a device-side handshake), GB/s per direction.\n",
          machine, date, commit ? commit : "unknown", nccl.version);
  fclose(m);
  printf("wrote %s.json and .md\n", base.c_str());
}

// ------------------------------------------------------------------ main

int main(int argc, char **argv) {
  bool v = false, b = false, d = false, sw = false, lk = false;
  int leak = 0;
  const char *outdir = getenv("OUT") ? getenv("OUT") : ".";
  size_t max_bytes = 256u << 20;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--validate")) v = true;
    else if (!strcmp(argv[i], "--bench")) b = true;
    else if (!strcmp(argv[i], "--dead-peer")) d = true;
    else if (!strcmp(argv[i], "--sweep")) sw = true;
    else if (!strcmp(argv[i], "--link")) lk = true;
    else if (!strcmp(argv[i], "--quick")) g_quick = true;
    else if (!strcmp(argv[i], "--leak") && i + 1 < argc) leak = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--out") && i + 1 < argc) outdir = argv[++i];
    else if (!strcmp(argv[i], "--max-bytes") && i + 1 < argc) max_bytes = strtoull(argv[++i], NULL, 0);
    else { fprintf(stderr, "usage: ar_bench [--validate] [--bench] [--sweep] [--link] [--dead-peer] [--leak N] [--quick] [--out DIR] [--max-bytes N]\n"); return 2; }
  }
  if (!v && !b && !d && !leak && !sw && !lk) v = b = d = true;
  setenv("NCCL_NVLS_ENABLE", "0", 1);  // never NVLink multicast here
  g_rank = atoi(getenv("RANK") ? getenv("RANK") : "0");
  g_world = atoi(getenv("WORLD_SIZE") ? getenv("WORLD_SIZE") : "1");
  g_local = atoi(getenv("LOCAL_RANK") ? getenv("LOCAL_RANK") : getenv("RANK") ? getenv("RANK") : "0");
  if (g_world < 2) { fprintf(stderr, "ar_bench: needs WORLD_SIZE >= 2 (one process per GPU)\n"); return 2; }
  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  if (ndev < 1) fatal("no CUDA device");
  CK(cudaSetDevice(g_local % ndev));
  WK(weft_cuda_set_device(g_local % ndev));
  CK(cudaStreamCreateWithFlags(&g_s, cudaStreamNonBlocking));
  if (g_rank == 0 && (v || d || leak)) {
    std::string p = std::string(outdir) + "/ar-validate.txt";
    g_vlog = fopen(p.c_str(), "w");
  }

  weft_store_opts so;
  memset(&so, 0, sizeof so);
  so.host = getenv("MASTER_ADDR") ? getenv("MASTER_ADDR") : "127.0.0.1";
  so.port = atoi(getenv("MASTER_PORT") ? getenv("MASTER_PORT") : "29517");
  so.is_server = g_rank == 0;
  so.timeout_ms = 60000;
  WK(weft_store_open(&so, &g_store));
  std::vector<int> ranks(g_world);
  for (int i = 0; i < g_world; i++) ranks[i] = i;
  WK(weft_cpugroup_create(g_store, "ar_bench", ranks.data(), g_world, g_rank, 60000, &g_grp));
  LOG("world %d, cuda:%d; %s", g_world, g_local % ndev, weft_build_info());
  nccl_init();

  if (v || b || sw) {
    size_t need = std::max<size_t>(max_bytes, 8u << 20);
    int rc = weft_ar_create(g_grp, need, &g_ar);
    if (rc) { LOG("weft_ar_create: %s", weft_last_error()); fatal("create"); }
    size_t mb, lam, osm;
    WK(weft_ar_info(g_ar, NULL, NULL, &mb, &lam, &osm));
    LOG("allreduce: max %zu bytes, lamport %zu bytes per slot, auto one-shot limit %zu", mb, lam, osm);
  }
  double t0 = now_s();
  if (v) { validate(max_bytes); LOG("validate took %.1f s", now_s() - t0); t0 = now_s(); }
  if (d && g_world >= 2) { dead_peer(16u << 20); LOG("dead-peer took %.1f s", now_s() - t0); t0 = now_s(); }
  if (leak) { leaks(leak); LOG("leak took %.1f s", now_s() - t0); }
  // results are written after each phase, so a later failure keeps the earlier ones
  if (b) { bench(max_bytes); write_results(outdir, max_bytes); }
  if (sw) { sweep(max_bytes); write_results(outdir, max_bytes); }
  if (g_ar) WK(weft_ar_destroy(g_ar));
  g_ar = nullptr;
  if (lk) { link_bench(max_bytes); write_results(outdir, max_bytes); }
  int64_t fails = allreduce_i64(g_fail, WEFT_SUM);
  int64_t passes = allreduce_i64(g_pass, WEFT_SUM);
  if (nccl.comm) nccl.commDestroy(nccl.comm);
  LOG("SUMMARY %lld passed, %lld failed (all ranks)", (long long)passes, (long long)fails);
  barrier();
  weft_cpugroup_destroy(g_grp);
  weft_store_close(g_store);
  if (g_vlog) fclose(g_vlog);
  return fails ? 1 : 0;
}
