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

// ------------------------------------------------------------------ dead peer

struct AbortArg { weft_ar *ar; double delay; };
static void *abort_later(void *p) {
  AbortArg *a = (AbortArg *)p;
  usleep((useconds_t)(a->delay * 1e6));
  weft_ar_abort(a->ar);
  return NULL;
}

static void dead_peer(size_t ws_bytes) {
  DBuf b;
  b.alloc(8 << 20);
  const int algos[] = {1, 2, 3};
  const size_t ns[] = {4096, 1u << 20, 1u << 20};
  const int tmo_ms = 2000;
  for (int i = 0; i < 3; i++) {
    weft_ar *ar;
    WK(weft_ar_create(g_grp, ws_bytes, &ar));
    WK(weft_ar_set_timeout(ar, tmo_ms));
    // two good calls first
    for (int k = 0; k < 2; k++) WK(weft_ar_run(ar, b.p, b.p, ns[i], WEFT_BF16, algos[i], g_s));
    CK(cudaStreamSynchronize(g_s));
    WK(weft_ar_check_error(ar));
    barrier();
    char name[96];
    snprintf(name, sizeof name, "dead peer reported (%s, timeout %d ms)", algon(algos[i]), tmo_ms);
    if (g_rank == 1) {
      LOG("dead-peer: rank 1 skips the call");
    } else {
      double t0 = now_s();
      WK(weft_ar_run(ar, b.p, b.p, ns[i], WEFT_BF16, algos[i], g_s));
      cudaError_t e = cudaStreamSynchronize(g_s);
      double dt = now_s() - t0;
      int rc = weft_ar_check_error(ar);
      std::string msg = weft_last_error();
      if (g_rank == 0)
        check(e == cudaSuccess && rc == WEFT_ETIMEOUT && msg.find("peer 1") != std::string::npos &&
                  dt < tmo_ms / 1000.0 + 3.0,
              name, "sync %s, rc %d after %.2f s: %s", cudaGetErrorString(e), rc, dt, msg.c_str());
      else
        LOG("dead-peer: rank %d: rc %d after %.2f s", g_rank, rc, dt);
      if (g_rank == 0) LOG("dead-peer message: %s", msg.c_str());
      int rc2 = weft_ar_run(ar, b.p, b.p, 16, WEFT_BF16, 1, g_s);
      if (g_rank == 0) check(rc2 == WEFT_ESTATE, "failed handle refuses further calls", "rc %d", rc2);
    }
    barrier();
    WK(weft_ar_destroy(ar));
  }
  // abort: rank 1 skips, rank 0 waits with a long timeout, a thread aborts
  {
    weft_ar *ar;
    WK(weft_ar_create(g_grp, ws_bytes, &ar));
    WK(weft_ar_set_timeout(ar, 60000));
    WK(weft_ar_run(ar, b.p, b.p, 4096, WEFT_BF16, 1, g_s));
    CK(cudaStreamSynchronize(g_s));
    barrier();
    if (g_rank == 0) {
      pthread_t th;
      AbortArg aa{ar, 0.5};
      double t0 = now_s();
      WK(weft_ar_run(ar, b.p, b.p, 4096, WEFT_BF16, 1, g_s));
      pthread_create(&th, NULL, abort_later, &aa);
      cudaError_t e = cudaStreamSynchronize(g_s);
      double dt = now_s() - t0;
      pthread_join(th, NULL);
      int rc = weft_ar_check_error(ar);
      check(e == cudaSuccess && rc == WEFT_EABORT && dt < 10.0, "abort ends a waiting kernel",
            "sync %s rc %d after %.2f s: %s", cudaGetErrorString(e), rc, dt, weft_last_error());
    }
    barrier();
    WK(weft_ar_destroy(ar));
  }
}

// ------------------------------------------------------------------ leaks

static int count_fds() {
  int n = 0;
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  while (struct dirent *e = readdir(d))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

static void leaks(int cycles) {
  size_t fr0, fr1, tot;
  // warm up: first creates initialise driver state
  for (int i = 0; i < 5; i++) {
    weft_vmm *w;
    WK(weft_vmm_create(g_grp, 64 << 20, 0, &w));
    WK(weft_vmm_destroy(w));
  }
  CK(cudaDeviceSynchronize());
  int fd0 = count_fds();
  CK(cudaMemGetInfo(&fr0, &tot));
  int64_t live0, bytes0;
  weft_vmm_stats(&live0, &bytes0, NULL);
  double t0 = now_s();
  for (int i = 0; i < cycles; i++) {
    weft_vmm *w;
    WK(weft_vmm_create(g_grp, (size_t)(1 + i % 7) << 20, 0, &w));
    void *p;
    WK(weft_vmm_ptr(w, (g_rank + 1) % g_world, &p));  // touch a peer's mapping
    CK(cudaMemsetAsync(p, 0, 4096, g_s));
    CK(cudaStreamSynchronize(g_s));
    barrier();  // peers finish writing before anyone destroys (destroy is local)
    WK(weft_vmm_destroy(w));
  }
  double dt = now_s() - t0;
  CK(cudaDeviceSynchronize());
  int fd1 = count_fds();
  CK(cudaMemGetInfo(&fr1, &tot));
  int64_t live1, bytes1;
  weft_vmm_stats(&live1, &bytes1, NULL);
  char name[96];
  snprintf(name, sizeof name, "vmm %d create/destroy cycles leak nothing", cycles);
  const double leaked_mib = ((double)fr0 - (double)fr1) / (1 << 20);
  check(fd1 == fd0 && leaked_mib < 64 && live1 == live0, name,
        "fds %d -> %d, device free %.1f MiB less, live %lld -> %lld", fd0, fd1, leaked_mib,
        (long long)live0, (long long)live1);
  LOG("leak: %d vmm cycles in %.2f s (%.2f ms each); fds %d -> %d; free device memory %+.1f MiB",
      cycles, dt, dt * 1e3 / cycles, fd0, fd1, -leaked_mib);
  // the all-reduce handle too (workspace + pinned words + init)
  const int arc = std::max(10, cycles / 10);
  fd0 = count_fds();
  CK(cudaMemGetInfo(&fr0, &tot));
  for (int i = 0; i < arc; i++) {
    weft_ar *ar;
    WK(weft_ar_create(g_grp, 4 << 20, &ar));
    DBuf b;
    b.alloc(1 << 16);
    WK(weft_ar_run(ar, b.p, b.p, 1 << 15, WEFT_BF16, i % 3 + 1, g_s));
    CK(cudaStreamSynchronize(g_s));
    WK(weft_ar_check_error(ar));
    barrier();
    WK(weft_ar_destroy(ar));
  }
  CK(cudaDeviceSynchronize());
  fd1 = count_fds();
  CK(cudaMemGetInfo(&fr1, &tot));
  snprintf(name, sizeof name, "allreduce %d create/run/destroy cycles leak nothing", arc);
  check(fd1 == fd0 && ((double)fr0 - (double)fr1) / (1 << 20) < 64, name, "fds %d -> %d, device free %.1f MiB less",
        fd0, fd1, ((double)fr0 - (double)fr1) / (1 << 20));
}

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

#include "ar_sweep.inc.cu"
#include "ar_link.inc.cu"

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
