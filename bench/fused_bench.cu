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

/* ------------------------------------------------------- host test data */

struct HostData {
  int64_t T = 0, H = 0;
  int dtype = WEFT_BF16;
  std::vector<std::vector<uint8_t>> in; /* per rank */
  std::vector<uint8_t> res, gamma;
  float scale = 0.004f;                 /* FP8 dequant scale: some values saturate */
};

static void put_zero(uint8_t *p, int64_t i, int dt, bool neg) {
  if (dt == WEFT_F32) { uint32_t v = neg ? 0x80000000u : 0; memcpy(p + 4 * i, &v, 4); }
  else { uint16_t v = neg ? 0x8000u : 0; memcpy(p + 2 * i, &v, 2); }
}

/* Uniform [-1, 1) in chunks of 64 rows (seeded per chunk: identical on every
 * rank whatever the thread count), ~3% +0 and ~3% -0, and zero rows (every
 * rank and the residual) at row % 29 == 7. */
static void fill(std::vector<uint8_t> &v, int64_t T, int64_t H, int dt, uint64_t seed, int role) {
  const int es = esize(dt);
  v.assign((size_t)(T * H * es), 0);
  const int64_t chunks = (T + 63) / 64;
  parallel_for(chunks, [&](int64_t c) {
    const int64_t r0 = c * 64, r1 = std::min(T, r0 + 64);
    uint8_t *p = v.data() + r0 * H * es;
    if (weft_host_fill_random(p, (size_t)((r1 - r0) * H), dt, seed_of(seed, c), 0))
      fatal("weft_host_fill_random", -1, __LINE__);
    for (int64_t r = r0; r < r1; r++)
      for (int64_t j = 0; j < H; j++) {
        const int64_t i = r * H + j;
        const uint64_t h = mix64(seed ^ (uint64_t)i * 0x9E3779B97F4A7C15ULL);
        if (r % 29 == 7 && role >= 0) put_zero(v.data(), i, dt, ((r + role) & 1) != 0);
        else if (h % 100 < 3) put_zero(v.data(), i, dt, false);
        else if (h % 100 < 6) put_zero(v.data(), i, dt, true);
      }
  });
}

static void gen(HostData &d, int64_t T, int64_t H, int dt, uint64_t seed) {
  d.T = T; d.H = H; d.dtype = dt;
  d.in.resize(g_world);
  for (int s = 0; s < g_world; s++) fill(d.in[s], T, H, dt, seed_of(seed, 1, s), s);
  fill(d.res, T, H, dt, seed_of(seed, 2), 0);
  fill(d.gamma, 1, H, dt, seed_of(seed, 3), -1);
}

/* -------------------------------------------------- reference and compare */

struct Want { int pattern, flags; float eps; bool norm_out, quant_out; };
struct Got { std::vector<uint8_t> out, res_out, norm_out, quant; };
struct Score { int64_t bad = 0, fp8_1ulp = 0, fp8_bad = 0, fp8_n = 0, n = 0; double worst = 0; };

/* Tolerances. Every rounding to the output dtype T obeys the standard model
 * with underflow: fl(v) = v(1 + d) + h, |d| <= u, |h| <= eta (half the
 * smallest subnormal of T: 2^-25 f16, 2^-134 bf16, 2^-150 f32), and the f32
 * arithmetic before it is covered by K ue (|value| + the sum of magnitudes
 * of its terms). So, with x the exact sum, S the sum of |terms|, n the
 * exact norm and w the weight:
 *   residual_out (out): |y - x| <= K ue (|x| + S) + eta
 *   norm_out:           |m - n| <= K ue (|n| + |w| rstd S) + eta (1 + 2 rstd |w|)
 * (the eta rstd |w| term: y's own underflow carried through the norm; the 2
 * covers the device's rstd against the exact one). The eta terms matter only
 * where a value is a T subnormal (f16 below 6.1e-5: a weight of 1.8e-6
 * makes every norm of its column one). FP8: the device quantises its f32
 * norm n' (|n' - n| within the norm_out bound, which also covers n''s final
 * rounding to T) times fl(1/scale) (relative error <= 2^-23, taken as 2^-22);
 * e4m3 RNE with saturation is monotone, so its code must lie between the
 * quantisations of the two ends of that interval. */
static double eta_of(int dt) { return dt == WEFT_BF16 ? 0x1p-134 : dt == WEFT_F16 ? 0x1p-25 : 0x1p-150; }

static Score check(const HostData &d, const Want &w, const Got &g) {
  const int64_t T = d.T, H = d.H;
  const int dt = d.dtype, W = g_world;
  const double u = dt == WEFT_BF16 ? 0x1p-8 : dt == WEFT_F16 ? 0x1p-11 : 0x1p-24;
  const double ue = std::max(u, 0x1p-20); /* f32: rsqrtf and f32 sums of 16384 squares */
  const double eta = eta_of(dt);
  const double K = (w.flags & WEFT_FUSION_FP32_ACC) ? 4.0 : 4.0 + 2.0 * W;
  const bool gemma = (w.flags & WEFT_FUSION_GEMMA) != 0;
  std::vector<double> gam(H);
  WK(weft_host_convert(d.gamma.data(), dt, gam.data(), WEFT_F64, (size_t)H));
  std::vector<Score> part((size_t)T);
  parallel_for(T, [&](int64_t r) {
    Score &sc = part[(size_t)r];
    std::vector<double> x(H, 0.0), S(H, 0.0), t(H), n(H), o(H), ab(H, eta);
    const size_t off = (size_t)(r * H * esize(dt));
    for (int s = 0; s < W; s++) {
      weft_host_convert(d.in[s].data() + off, dt, t.data(), WEFT_F64, (size_t)H);
      for (int64_t j = 0; j < H; j++) { x[j] += t[j]; S[j] += std::fabs(t[j]); }
    }
    auto cmp = [&](const std::vector<uint8_t> &dev, const std::vector<double> &ref,
                   const std::vector<double> &mag, const std::vector<double> &abs_tol) {
      weft_host_convert(dev.data() + off, dt, o.data(), WEFT_F64, (size_t)H);
      for (int64_t j = 0; j < H; j++) {
        const double tol = K * ue * (std::fabs(ref[j]) + mag[j]) + abs_tol[j] + 1e-300;
        const double e = std::fabs(o[j] - ref[j]) / tol;
        if (!(e <= 1.0)) sc.bad++;
        if (e > sc.worst || e != e) sc.worst = e != e ? 1e30 : e;
        sc.n++;
      }
    };
    if (w.pattern == WEFT_FUSION_AR) { cmp(g.out, x, S, ab); return; }
    weft_host_convert(d.res.data() + off, dt, t.data(), WEFT_F64, (size_t)H);
    double ss = 0;
    for (int64_t j = 0; j < H; j++) { x[j] += t[j]; S[j] += std::fabs(t[j]); ss += x[j] * x[j]; }
    cmp(g.res_out, x, S, ab);
    const double rstd = 1.0 / std::sqrt(ss / (double)H + (double)w.eps);
    std::vector<double> nm(H), na(H), tn(H);
    for (int64_t j = 0; j < H; j++) {
      const double wj = gemma ? 1.0 + gam[j] : gam[j];
      n[j] = x[j] * rstd * wj;
      nm[j] = std::fabs(n[j]) + std::fabs(wj) * rstd * S[j];
      na[j] = eta * (1.0 + 2.0 * rstd * std::fabs(wj));
      tn[j] = K * ue * nm[j] + na[j]; /* the norm_out bound, as in cmp */
    }
    if (w.norm_out) cmp(g.norm_out, n, nm, na);
    if (w.quant_out) {
      /* (1) the device code lies between the quantisations of the ends of
       * the interval the norm bound allows (see the tolerance note above);
       * (2) the quantisation of the device's own residual_out, normalised
       * in f64, must match exactly bar f32-vs-f64 ties (counted, rare). */
      std::vector<uint8_t> qlo(H), qhi(H), qe(H);
      std::vector<double> lo(H), hi(H), b(H), y(H);
      const double rho = 0x1p-22;
      for (int64_t j = 0; j < H; j++) {
        const double l = (n[j] - tn[j]) / (double)d.scale, h = (n[j] + tn[j]) / (double)d.scale;
        lo[j] = l - rho * std::fabs(l);
        hi[j] = h + rho * std::fabs(h);
      }
      weft_host_convert(lo.data(), WEFT_F64, qlo.data(), WEFT_F8E4M3, (size_t)H);
      weft_host_convert(hi.data(), WEFT_F64, qhi.data(), WEFT_F8E4M3, (size_t)H);
      weft_host_convert(qlo.data(), WEFT_F8E4M3, lo.data(), WEFT_F64, (size_t)H);
      weft_host_convert(qhi.data(), WEFT_F8E4M3, hi.data(), WEFT_F64, (size_t)H);
      weft_host_convert(g.quant.data() + (size_t)(r * H), WEFT_F8E4M3, b.data(), WEFT_F64, (size_t)H);
      for (int64_t j = 0; j < H; j++)
        if (!(lo[j] <= b[j] && b[j] <= hi[j])) sc.fp8_bad++;
      weft_host_convert(g.res_out.data() + off, dt, y.data(), WEFT_F64, (size_t)H);
      double ssy = 0;
      for (int64_t j = 0; j < H; j++) ssy += y[j] * y[j];
      const double ry = 1.0 / std::sqrt(ssy / (double)H + (double)w.eps);
      for (int64_t j = 0; j < H; j++) t[j] = y[j] * ry * (gemma ? 1.0 + gam[j] : gam[j]) / (double)d.scale;
      weft_host_convert(t.data(), WEFT_F64, qe.data(), WEFT_F8E4M3, (size_t)H);
      for (int64_t j = 0; j < H; j++) sc.fp8_1ulp += qe[j] != g.quant[(size_t)(r * H + j)];
      sc.fp8_n += H;
    }
  });
  Score tot;
  for (auto &p : part) {
    tot.bad += p.bad; tot.n += p.n; tot.fp8_1ulp += p.fp8_1ulp; tot.fp8_bad += p.fp8_bad;
    tot.fp8_n += p.fp8_n;
    tot.worst = std::max(tot.worst, p.worst);
  }
  return tot;
}

/* fp8_1ulp: codes that differ from the f64 quantisation of the device's own
 * residual_out (f32-vs-f64 ties only: expected around 1e-5 of them). */
static bool score_ok(const Score &s) {
  return s.bad == 0 && s.fp8_bad == 0 && s.fp8_1ulp * 1000 <= s.fp8_n + 2000;
}

/* ------------------------------------------------------- device buffers */

struct Dev {
  void *in = nullptr, *res = nullptr, *gamma = nullptr, *out = nullptr, *res_out = nullptr,
       *norm_out = nullptr, *quant = nullptr, *copy = nullptr;
  float *scale = nullptr;
  size_t bytes = 0, qbytes = 0;
  void alloc(int64_t T, int64_t H, int dt) {
    bytes = (size_t)(T * H * esize(dt)) + 256;
    qbytes = (size_t)(T * H) + 256;
    CU(cudaMalloc(&in, bytes)); CU(cudaMalloc(&res, bytes)); CU(cudaMalloc(&gamma, (size_t)H * 4 + 256));
    CU(cudaMalloc(&out, bytes)); CU(cudaMalloc(&res_out, bytes)); CU(cudaMalloc(&norm_out, bytes));
    CU(cudaMalloc(&quant, qbytes)); CU(cudaMalloc(&copy, bytes)); CU(cudaMalloc((void **)&scale, 256));
  }
  /* allocated for d's shape and loaded with its data */
  static Dev with(const HostData &d) {
    Dev v;
    v.alloc(d.T, d.H, d.dtype);
    v.upload(d);
    return v;
  }
  void release() {
    for (void *p : {in, res, gamma, out, res_out, norm_out, quant, copy, (void *)scale}) cudaFree(p);
    *this = Dev();
  }
  void upload(const HostData &d) {
    const size_t b = (size_t)(d.T * d.H * esize(d.dtype));
    CU(cudaMemcpyAsync(in, d.in[g_rank].data(), b, cudaMemcpyHostToDevice, g_stream));
    CU(cudaMemcpyAsync(res, d.res.data(), b, cudaMemcpyHostToDevice, g_stream));
    CU(cudaMemcpyAsync(gamma, d.gamma.data(), (size_t)d.H * esize(d.dtype), cudaMemcpyHostToDevice, g_stream));
    CU(cudaMemcpyAsync(scale, &d.scale, 4, cudaMemcpyHostToDevice, g_stream));
    /* outputs start as garbage, so a kernel that skips an element is caught */
    CU(cudaMemsetAsync(out, 0x7b, b, g_stream));
    CU(cudaMemsetAsync(res_out, 0x7b, b, g_stream));
    CU(cudaMemsetAsync(norm_out, 0x7b, b, g_stream));
    CU(cudaMemsetAsync(quant, 0x7b, (size_t)(d.T * d.H), g_stream));
  }
  Got download(const HostData &d, const Want &w) const {
    Got g;
    const size_t b = (size_t)(d.T * d.H * esize(d.dtype));
    CU(cudaStreamSynchronize(g_stream));
    auto get = [&](std::vector<uint8_t> &v, const void *p, size_t n) {
      v.resize(n);
      CU(cudaMemcpy(v.data(), p, n, cudaMemcpyDeviceToHost));
    };
    if (w.pattern == WEFT_FUSION_AR) get(g.out, out, b);
    else get(g.res_out, res_out, b);
    if (w.norm_out) get(g.norm_out, norm_out, b);
    if (w.quant_out) get(g.quant, quant, (size_t)(d.T * d.H));
    return g;
  }
};

static weft_fusion_params params(const Dev &v, const HostData &d, int pattern, int algo, int flags,
                                 float eps, bool with_norm_out = true) {
  weft_fusion_params p;
  memset(&p, 0, sizeof p);
  p.pattern = pattern; p.algo = algo; p.flags = flags; p.dtype = d.dtype;
  p.tokens = d.T; p.hidden = d.H;
  p.input = v.in; p.residual = v.res; p.weight = v.gamma;
  p.out = v.out; p.residual_out = v.res_out;
  p.norm_out = (pattern == WEFT_FUSION_AR_RMSNORM || with_norm_out) ? v.norm_out : nullptr;
  p.quant_out = v.quant; p.scale = v.scale;
  p.eps = eps; p.stream = g_stream;
  return p;
}

static Want want_of(const weft_fusion_params &p) {
  Want w;
  w.pattern = p.pattern; w.flags = p.flags; w.eps = p.eps;
  w.norm_out = p.pattern != WEFT_FUSION_AR && p.norm_out;
  w.quant_out = p.pattern == WEFT_FUSION_AR_RMSNORM_FP8;
  return w;
}

static uint64_t hash_got(const Got &g) {
  uint64_t h = fnv(g.out.data(), g.out.size());
  h = fnv(g.res_out.data(), g.res_out.size(), h);
  h = fnv(g.norm_out.data(), g.norm_out.size(), h);
  return fnv(g.quant.data(), g.quant.size(), h);
}

static void sync_and_check_error(weft_fusion *ws, const char *what) {
  CU(cudaStreamSynchronize(g_stream));
  int rc = weft_fusion_check_error(ws);
  if (rc) fatal(what, rc, __LINE__);
}

/* One call: run, check against the reference, all ranks bit-equal. */
static Got run_and_check(weft_fusion *ws, const Dev &v, const HostData &d, const weft_fusion_params &p,
                         const char *tag) {
  WK(weft_fusion_run(ws, &p));
  sync_and_check_error(ws, tag);
  const Want w = want_of(p);
  Got g = v.download(d, w);
  const Score s = check(d, w, g);
  const bool same = same_everywhere(hash_got(g));
  verdict(score_ok(s) && same,
          "%s: %lldx%lld %s %s %s flags=%d: %lld/%lld outside tolerance (worst %.3g of tol)%s%s",
          tag, (long long)d.T, (long long)d.H, dname(d.dtype), pname(p.pattern), aname(p.algo),
          p.flags, (long long)s.bad, (long long)s.n, s.worst,
          w.quant_out ? (", fp8 " + std::to_string(s.fp8_bad) + " bad, " +
                         std::to_string(s.fp8_1ulp) + " of " + std::to_string(s.fp8_n) +
                         " off the device-residual quantisation").c_str() : "",
          same ? "" : ", ranks DIFFER");
  return g;
}

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

/* FlashInfer's best fused figure (docs/reference-measurements.md), µs, by hidden and tokens. */
static double flashinfer_best(int64_t H, int64_t T) {
  const int64_t toks[] = {1, 8, 32, 128, 512, 2048, 8192};
  const double h4[] = {4.47, 4.97, 5.84, 7.32, 19.5, 85.5, 333};
  const double h8[] = {5.10, 5.79, 6.86, 11.2, 38.0, 154, 601};
  for (int i = 0; i < 7; i++)
    if (toks[i] == T) return H == 4096 ? h4[i] : H == 8192 ? h8[i] : 0;
  return 0;
}

static double find(const std::string &op, const std::string &be, int64_t T, int64_t H) {
  for (auto &r : g_recs)
    if (r.op == op && r.backend == be && r.tokens == T && r.hidden == H) return r.us;
  return 0;
}

static void write_results(const char *dir, const char *machine, const char *commit) {
  if (g_rank != 0) return;
  char date[16];
  time_t now = time(nullptr);
  strftime(date, sizeof date, "%Y-%m-%d", gmtime(&now));
  std::string base = std::string(dir) + "/fused-" + machine + "-" + date;
  FILE *j = fopen((base + ".json").c_str(), "w");
  FILE *m = fopen((base + ".md").c_str(), "w");
  if (!j || !m) { fprintf(stderr, "cannot write %s.{json,md}\n", base.c_str()); return; }
  const double bw = 2.0 * (g_world - 1) / g_world;
  fprintf(j, "{\"machine\": \"%s\", \"date\": \"%s\", \"commit\": \"%s\", \"checks\": {\"passed\": %d, "
          "\"failed\": %d}, \"records\": [\n", machine, date, commit, g_pass, g_fail);
  for (size_t i = 0; i < g_recs.size(); i++) {
    const Rec &r = g_recs[i];
    fprintf(j, "  {\"op\": \"%s\", \"backend\": \"%s\", \"mode\": \"graph\", \"dtype\": \"bf16\", "
            "\"world\": %d, \"bytes\": %lld, \"tokens\": %lld, \"hidden\": %lld, \"us\": %.3f, "
            "\"busbw_gbs\": %.1f}%s\n", r.op.c_str(), r.backend.c_str(), g_world, (long long)r.bytes,
            (long long)r.tokens, (long long)r.hidden, r.us, (double)r.bytes / r.us / 1e3 * bw,
            i + 1 < g_recs.size() ? "," : "");
  }
  fprintf(j, "]}\n");
  fclose(j);

  const int64_t toks[] = {1, 8, 32, 128, 512, 2048, 8192};
  fprintf(m, "# Fused all-reduce + residual + RMSNorm — %s, %s, world %d, bf16\n\n", machine, date, g_world);
  fprintf(m, "CUDA-graph replay, median µs per call (the slower rank's), fresh random data; "
          "commit %s; correctness checks: %d passed, %d failed. Fused and weft_ar rows: launched with "
          "programmatic dependent launch (the default of group:fused_allreduce_rmsnorm and of weft_ar); "
          "fused_auto_nopdl: without; fused_auto_determ: deterministic mode (WEFT_FUSION_DETERMINISTIC). unfused: NCCL all-reduce, then weft's norm kernel.\n", commit, g_pass, g_fail);
  const char *backs[][2] = {
      {"fused_ar_rmsnorm", "fused_oneshot"}, {"fused_ar_rmsnorm", "fused_twoshot"},
      {"fused_ar_rmsnorm", "fused_auto"},    {"fused_ar_rmsnorm", "fused_auto_nopdl"},
      {"fused_ar_rmsnorm", "fused_auto_determ"}, {"fused_ar_rmsnorm", "unfused"},
      {"all_reduce", "fused_ar_oneshot"},
      {"all_reduce", "fused_ar_twoshot"},    {"all_reduce", "weft_ar"},
      {"all_reduce", "nccl"}};
  for (int64_t H : {4096, 8192}) {
    fprintf(m, "\n## hidden %lld\n\n| op / backend |", (long long)H);
    for (int64_t T : toks) fprintf(m, " %lld |", (long long)T);
    fprintf(m, "\n|---|");
    for (size_t i = 0; i < 7; i++) fprintf(m, "---|");
    fprintf(m, "\n");
    for (auto &b : backs) {
      fprintf(m, "| %s / %s |", b[0], b[1]);
      for (int64_t T : toks) {
        const double us = find(b[0], b[1], T, H);
        if (us > 0) fprintf(m, " %.2f |", us); else fprintf(m, " |");
      }
      fprintf(m, "\n");
    }
    fprintf(m, "| FlashInfer fused (best, §8) |");
    for (int64_t T : toks) fprintf(m, " %.2f |", flashinfer_best(H, T));
    fprintf(m, "\n\n| target | tokens | fused best µs | reference µs | ratio | limit | verdict |\n"
               "|---|---|---|---|---|---|---|\n");
    for (int64_t T : toks) {
      const double o = find("fused_ar_rmsnorm", "fused_oneshot", T, H);
      const double t = find("fused_ar_rmsnorm", "fused_twoshot", T, H);
      const double fb = t > 0 && t < o ? t : o;
      const double fi = flashinfer_best(H, T);
      if (fb <= 0) continue; /* not measured (--only) */
      const double lim = (T == 2048 || T == 8192) ? 0.75 : 1.0;
      fprintf(m, "| vs FlashInfer | %lld | %.2f | %.2f | %.2f | %.2f | %s |\n", (long long)T, fb, fi,
              fb / fi, lim, fb <= lim * fi ? "PASS" : "FAIL");
      const double un = find("fused_ar_rmsnorm", "unfused", T, H);
      if (un > 0)
        fprintf(m, "| vs unfused | %lld | %.2f | %.2f | %.2f | 0.50 | %s |\n", (long long)T, fb, un,
                fb / un, fb <= 0.5 * un ? "PASS" : "FAIL");
      double ar = 0;
      for (const char *be : {"fused_ar_oneshot", "fused_ar_twoshot", "weft_ar", "nccl"}) {
        const double x = find("all_reduce", be, T, H);
        if (x > 0 && (ar == 0 || x < ar)) ar = x;
      }
      if (ar > 0)
        fprintf(m, "| vs best plain all-reduce | %lld | %.2f | %.2f | %.2f | 1.15 | %s |\n",
                (long long)T, fb, ar, fb / ar, fb <= 1.15 * ar ? "PASS" : "FAIL");
      const double de = find("fused_ar_rmsnorm", "fused_auto_determ", T, H);
      const double au = find("fused_ar_rmsnorm", "fused_auto", T, H);
      if (de > 0 && au > 0)
        fprintf(m, "| deterministic vs default | %lld | %.2f | %.2f | %.2f | 1.15 | %s |\n",
                (long long)T, de, au, de / au, de <= 1.15 * au ? "PASS" : "FAIL");
      if (de > 0)
        fprintf(m, "| deterministic vs FlashInfer | %lld | %.2f | %.2f | %.2f | 1.00 | %s |\n",
                (long long)T, de, fi, de / fi, de <= fi ? "PASS" : "FAIL");
    }
  }
  /* one-shot vs two-shot, every size: the auto switch (WEFT_FUSION_ONESHOT_MAX)
   * belongs at the smallest size from which the two-shot wins at every
   * larger measured size (none: no limit) */
  fprintf(m, "\n## One-shot vs two-shot (fused_ar_rmsnorm)\n\n| hidden | tokens | bytes | one-shot µs | "
             "two-shot µs | faster |\n|---|---|---|---|---|---|\n");
  for (int64_t H : {4096, 8192}) {
    int64_t from = -1;
    for (int64_t T : toks) {
      const double o = find("fused_ar_rmsnorm", "fused_oneshot", T, H);
      const double t = find("fused_ar_rmsnorm", "fused_twoshot", T, H);
      if (o <= 0 || t <= 0) continue;
      fprintf(m, "| %lld | %lld | %lld | %.2f | %.2f | %s |\n", (long long)H, (long long)T,
              (long long)(T * H * 2), o, t, t < o ? "two-shot" : "one-shot");
      if (t < o) { if (from < 0) from = T * H * 2; }
      else from = -1;
    }
    fprintf(m, "\nhidden %lld: the two-shot wins at every size from %s.\n", (long long)H,
            from < 0 ? "none (no switch point: one-shot throughout)" : (std::to_string(from) + " bytes").c_str());
  }
  /* the cluster sweep */
  bool any_sweep = false, any_skew = false;
  for (auto &r : g_recs) {
    any_sweep = any_sweep || r.backend.rfind("oneshot_", 0) == 0;
    any_skew = any_skew || r.backend.rfind("skew", 0) == 0;
  }
  const int64_t sweep_pts[][2] = {{4096, 1}, {4096, 8}, {4096, 32}, {4096, 128}, {8192, 1}, {8192, 8},
                                  {8192, 32}, {8192, 128}, {5120, 1}, {5120, 32}, {7168, 1}, {7168, 32},
                                  {16384, 1}, {16384, 32}};
  if (any_sweep) {
    fprintf(m, "\n## One-shot blocks per row (sweep, PDL on), µs\n\nC blocks per row (a cluster), exchanging the "
               "chunk partials of the sum of squares through distributed shared memory: by st.async on "
               "transaction barriers (the kernel), or *barrier*: plain remote stores + "
               "barrier.cluster.arrive.release/wait (the earlier exchange, a probe).\n\n| hidden | tokens | auto (C) | "
               "1 | 2 | 4 | 8 | barrier 2 | barrier 4 | barrier 8 |\n|---|---|---|---|---|---|---|---|---|---|\n");
    for (auto &pt : sweep_pts) {
      const int64_t H = pt[0], T = pt[1];
      if (find("fused_ar_rmsnorm", "oneshot_auto", T, H) <= 0) continue;
      int ac = 0;
      for (auto &tr : g_traces)
        if (tr.T == T && tr.H == H) ac = tr.cluster;
      fprintf(m, "| %lld | %lld |", (long long)H, (long long)T);
      for (const char *be : {"oneshot_auto", "oneshot_c1", "oneshot_c2", "oneshot_c4", "oneshot_c8",
                             "oneshot_bar_c2", "oneshot_bar_c4", "oneshot_bar_c8"}) {
        const double us = find("fused_ar_rmsnorm", be, T, H);
        if (us <= 0) fprintf(m, " |");
        else if (!strcmp(be, "oneshot_auto") && ac) fprintf(m, " %.2f (%d) |", us, ac);
        else fprintf(m, " %.2f |", us);
      }
      fprintf(m, "\n");
    }
    fprintf(m, "\n## Where the time goes (one-shot, automatic geometry), µs per call\n\n"
               "Probes leave work out (outputs not valid): *no reduce* skips the sum-of-squares exchange "
               "and its barrier, *residual only* stops after residual_out. *late input*: the old prologue "
               "(input loaded after the epoch/error check). *late PDL trigger*: launch_dependents after the pushes, not at entry. weft_ar: the plain all-reduce of the same bytes "
               "(bench part).\n\n"
               "| hidden | tokens | fused | no reduce | residual only | AR pattern | fused, late input | "
               "AR, late input | fused, late PDL trigger | weft_ar |\n|---|---|---|---|---|---|---|---|---|---|\n");
    for (auto &pt : sweep_pts) {
      const int64_t H = pt[0], T = pt[1];
      if (find("fused_ar_rmsnorm", "oneshot_auto", T, H) <= 0) continue;
      fprintf(m, "| %lld | %lld |", (long long)H, (long long)T);
      const std::pair<const char *, const char *> cols[] = {
          {"fused_ar_rmsnorm", "oneshot_auto"},     {"fused_ar_rmsnorm", "oneshot_auto_noreduce"},
          {"fused_ar_rmsnorm", "oneshot_auto_resadd"}, {"all_reduce", "fused_ar_oneshot_auto"},
          {"fused_ar_rmsnorm", "oneshot_auto_late"}, {"all_reduce", "fused_ar_oneshot_late"},
          {"fused_ar_rmsnorm", "oneshot_auto_latetrig"}, {"all_reduce", "weft_ar"}};
      for (auto &c : cols) {
        const double us = find(c.first, c.second, T, H);
        if (us > 0) fprintf(m, " %.2f |", us); else fprintf(m, " |");
      }
      fprintf(m, "\n");
    }
    fprintf(m, "\n## One-shot push-ahead (rows a block pushes before consuming its first; default %d), µs\n\n"
               "| hidden | tokens | 1 | 2 | 4 | 8 | 64 |\n|---|---|---|---|---|---|---|\n", 1);
    for (auto &pt : {std::pair<int64_t, int64_t>{4096, 512}, {8192, 512}, {4096, 2048}, {8192, 2048}}) {
      if (find("fused_ar_rmsnorm", "oneshot_ahead1", pt.second, pt.first) <= 0) continue;
      fprintf(m, "| %lld | %lld |", (long long)pt.first, (long long)pt.second);
      for (const char *be : {"oneshot_ahead1", "oneshot_ahead2", "oneshot_ahead4", "oneshot_ahead8", "oneshot_ahead64"}) {
        const double us = find("fused_ar_rmsnorm", be, pt.second, pt.first);
        if (us > 0) fprintf(m, " %.2f |", us); else fprintf(m, " |");
      }
      fprintf(m, "\n");
    }
    fprintf(m, "\nPhase clock (block 0, thread 0, first row; mean ns after kernel entry at %.2f GHz; "
               "*arrived*: its own vector's data from the peer; *reduced*: the row's sum of squares known):\n\n"
               "| hidden | tokens | C | kernel | µs/call | checked | pushed | cleared | arrived | reduced | "
               "stored | end |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n", clock_ghz());
    for (auto &tr : g_traces) {
      fprintf(m, "| %lld | %lld | %d | %s | %.2f |", (long long)tr.H, (long long)tr.T, tr.cluster,
              tr.what.c_str(), tr.us);
      for (int i = 1; i < WF_FUSED_TR_SLOTS; i++) {
        if (tr.ns[i] > 0) fprintf(m, " %.0f |", tr.ns[i]); else fprintf(m, " |");
      }
      fprintf(m, "\n");
    }
  }
  if (any_skew) {
    fprintf(m, "\n## A late peer (rank 1 sleeps before every replay of 40 calls), µs per call\n\n"
               "Expected: the figure without skew + skew / 40. The old spin (every waiting thread "
               "reads the host abort word once a wait passed 20 µs) is kept as a probe for the A/B.\n\n"
               "| tokens × hidden | no skew | 50 µs late | expect | 300 µs late | expect | old spin, 50 µs late |\n"
               "|---|---|---|---|---|---|---|\n");
    for (auto &pt : {std::pair<int64_t, int64_t>{32, 4096}, {128, 4096}, {128, 8192}}) {
      const double b0 = find("fused_ar_rmsnorm", "skew0", pt.first, pt.second);
      if (b0 <= 0) continue;
      fprintf(m, "| %lld × %lld | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", (long long)pt.first,
              (long long)pt.second, b0, find("fused_ar_rmsnorm", "skew50", pt.first, pt.second),
              b0 + 50.0 / 40, find("fused_ar_rmsnorm", "skew300", pt.first, pt.second), b0 + 300.0 / 40,
              find("fused_ar_rmsnorm", "skew50_oldspin", pt.first, pt.second));
    }
  }
  fclose(m);
  printf("wrote %s.json and %s.md\n", base.c_str(), base.c_str());
}

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
