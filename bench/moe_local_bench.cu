// moe_local_bench.cu — the single-rank parts of weft.fusion_ext (issue 28
// item 3) against the copy bandwidth they could reach, on one GPU.
//
//   build/moe_local_bench [--hidden 4096,7168] [--tokens 1,2,...,8192] [--top-k 8]
//                         [--replays 15] [--out DIR] [--machine NAME]
//
// Kernels (bf16, f32 router scales, the shared expert on):
//   moe       weft_cuda_moe_reduce, the reduction alone: top_k expert rows +
//             the shared row + the scales in, the partial row out
//   moe_norm  the same with the residual and the weight: the end of an MoE
//             layer on one rank in one kernel (residual_out, norm_out out)
//   fin_norm  moe_norm reading the experts through a permutation (MoE
//             finalize: the permutation's entries read too)
//   rmsnorm   weft_cuda_rmsnorm with a residual: the norm math of every
//             unfused path (x + residual + weight in, residual_out + norm_out out)
//   unfused   moe, then rmsnorm (the unfused MoE end; timed, no copy twin)
// Each against a copy kernel that moves the same bytes: it reads every
// input row the kernel reads (and the scales / permutation words and the
// weight; for fin_norm the expert rows through the same permutation) and
// writes every output row, one block per token, with
// row_threads(hidden / 8) threads (one vector each, up to 1024 vectors);
// for the MoE kinds also (rows of 513-1024 vectors) with half of them (two
// vectors each: two blocks per SM), and with the row split over 2 and 4
// blocks (the freedom the kernel's cluster split takes at few tokens);
// each shape with plain loads and with loads that bypass L1
// (ld.global.nc.L1::no_allocate): the fastest copy is the reference
// (the norm kernel's own count for rmsnorm), every load of a vector issued
// before any store: % of copy = copy time / kernel time for the same bytes.
// The table's copy column says which shape won (blocks per row x threads).
// (For rmsnorm at few tokens the copy is a weak reference: with the norm
// kernel's 224-256 threads per row a copy thread moves its 2-4 vectors one
// after another, where the kernel loads them all first.)
//
// Method: CUDA graph of C calls replayed R times (event per replay, median /
// C); each call of a graph reads and writes its own slot of buffers, and
// the slots of a graph span at least 256 MiB (5x the 50 MiB L2), so no
// call reads data the previous ones left in L2 (fresh data, as after the
// expert GEMMs of a real layer at large batch). Data: uniform random bf16
// in [-2, 2), scales in [0, 1), a random permutation. Checks: every kernel's
// rows 0, T/2 and T-1 of slot 0 against an f64 host reference (bound: a
// few bf16 roundings), the copy's rows against the XOR of its inputs.
// Prints a table; writes DIR/moe-local-<machine>-<date>.{json,md}. Exit 0
// only when every check passed.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "machine_tag.h"

#include <algorithm>
#include <string>
#include <vector>

#include "weft.h"

#define CK(x)                                                                         \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      fprintf(stderr, "FATAL %s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(2);                                                                        \
    }                                                                                 \
  } while (0)
#define WK(x)                                                                         \
  do {                                                                                \
    if ((x) != 0) {                                                                   \
      fprintf(stderr, "FATAL %s:%d %s: %s\n", __FILE__, __LINE__, #x, weft_last_error()); \
      exit(2);                                                                        \
    }                                                                                 \
  } while (0)

static int g_fail = 0, g_pass = 0;

// ------------------------------------------------------------------ the copy kernel
constexpr int kMaxIn = 10, kMaxOut = 3;
struct CopyArgs {
  const char *in[kMaxIn];   // row t of input i: in[i] + t * rb
  char *out[kMaxOut];       // row t of output o: out[o] + t * rb
  const uint32_t *words[2]; // [tokens][top_k] 4-byte words (scales, permutation) or NULL
  const char *weight;       // one row read by every block, or NULL
  const int32_t *gather;    // fin_norm: inputs 0..top_k-1 are rows in[0] + gather[t * top_k + i] * rb
  int nin, nout, tokens, top_k, nv;
  int nc;                   // loads that bypass L1 (ld.global.nc.L1::no_allocate)
  int split;                // blocks per row (a row's vectors in split equal parts, as a cluster-split kernel)
  size_t rb;
};

template <bool NC> __device__ __forceinline__ uint4 ld_row(const char *p) {
  if (!NC) return *(const uint4 *)p;
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// One block per token, as the kernels; every load of a vector first, then
// the stores. The XOR keeps every load live. NIN: rows read (registers).
template <int NIN, bool GATHER, bool NC>
__global__ void __launch_bounds__(1024) copy_kernel(const CopyArgs a) {
  const int part = (int)(blockIdx.x % a.split), per = (a.nv + a.split - 1) / a.split;
  const int jend = min(a.nv, (part + 1) * per);
  for (int t = blockIdx.x / a.split; t < a.tokens; t += gridDim.x / a.split) {
    uint32_t wx = 0;
    for (int w = 0; w < 2; w++)
      if (a.words[w])
        for (int k = 0; k < a.top_k; k++) wx ^= a.words[w][(size_t)t * a.top_k + k];
    for (int j = part * per + threadIdx.x; j < jend; j += blockDim.x) {
      uint4 v[NIN];
#pragma unroll
      for (int i = 0; i < NIN; i++) {
        const char *row = GATHER && i < a.top_k ? a.in[0] + (size_t)a.gather[(size_t)t * a.top_k + i] * a.rb
                                                  : a.in[i] + (size_t)t * a.rb;
        v[i] = ld_row<NC>(row + (size_t)j * 16);
      }
      uint4 acc = make_uint4(wx, 0, 0, 0);
      if (a.weight) {
        const uint4 g = *(const uint4 *)(a.weight + (size_t)j * 16);
        acc.x ^= g.x; acc.y ^= g.y; acc.z ^= g.z; acc.w ^= g.w;
      }
#pragma unroll
      for (int i = 0; i < NIN; i++) { acc.x ^= v[i].x; acc.y ^= v[i].y; acc.z ^= v[i].z; acc.w ^= v[i].w; }
#pragma unroll
      for (int o = 0; o < kMaxOut; o++)
        if (o < a.nout) *(uint4 *)(a.out[o] + (size_t)t * a.rb + (size_t)j * 16) = acc;
    }
  }
}

// the gather (fin_norm) is a template argument: the other copies carry no test for it
template <bool G, bool NC> static void launch_copy_g(const CopyArgs &a, unsigned blocks, int threads, cudaStream_t s) {
  switch (a.nin) {
  case 2: copy_kernel<2, G, NC><<<blocks, threads, 0, s>>>(a); break;
  case 3: copy_kernel<3, G, NC><<<blocks, threads, 0, s>>>(a); break;
  case 4: copy_kernel<4, G, NC><<<blocks, threads, 0, s>>>(a); break;
  case 5: copy_kernel<5, G, NC><<<blocks, threads, 0, s>>>(a); break;
  case 6: copy_kernel<6, G, NC><<<blocks, threads, 0, s>>>(a); break;
  case 7: copy_kernel<7, G, NC><<<blocks, threads, 0, s>>>(a); break;
  case 8: copy_kernel<8, G, NC><<<blocks, threads, 0, s>>>(a); break;
  case 9: copy_kernel<9, G, NC><<<blocks, threads, 0, s>>>(a); break;
  default: copy_kernel<10, G, NC><<<blocks, threads, 0, s>>>(a); break;
  }
}
static void launch_copy(const CopyArgs &a, unsigned blocks, int threads, cudaStream_t s) {
  if (a.gather) { if (a.nc) launch_copy_g<true, true>(a, blocks, threads, s); else launch_copy_g<true, false>(a, blocks, threads, s); }
  else if (a.nc) launch_copy_g<false, true>(a, blocks, threads, s);
  else launch_copy_g<false, false>(a, blocks, threads, s);
  CK(cudaGetLastError());
}

// threads per row of kernels/norm.cu's vector path: the smallest vectors per
// thread (1, 2, 4, 8) giving at most 256 threads
static int norm_threads(int nv) {
  int vpt = 1;
  while (vpt < 8 && (nv + vpt - 1) / vpt > 256) vpt *= 2;
  return ((nv + vpt - 1) / vpt + 31) / 32 * 32;
}

// threads per row as kernels/fused_ext.cuh row_threads (1024 at most)
static int row_threads(int nv) {
  const int per = (nv + 1023) / 1024;
  const int t = (nv + per - 1) / per;
  return (t + 31) / 32 * 32;
}

// ------------------------------------------------------------------ data
// a counter hash (splitmix64): uniform 24-bit values in [0, 1)
__device__ float uniform(size_t i, uint64_t seed) {
  uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (float)(z >> 40) * (1.0f / 16777216.0f);
}
__global__ void fill_bf16(__nv_bfloat16 *p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = __float2bfloat16(uniform(i, seed) * 4.0f - 2.0f);
}
__global__ void fill_f32(float *p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = uniform(i, seed);
}

static float bf2f(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// ------------------------------------------------------------------ one configuration
struct Slot {            // one call's buffers
  char *x, *shared, *res, *ro, *no, *part, *cout[kMaxOut];
};

struct Row {
  int hidden, tokens;
  const char *kernel;
  double bytes, us, copy_us;
  std::string copy_shape;   // the fastest copy: blocks per row x threads, "nc": L1-bypassing loads
};
static std::vector<Row> g_rows;

static double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// per-call µs of launch(i) for i in [0, calls): a graph of the calls, replayed
template <typename F> static double time_graph(cudaStream_t s, int calls, int replays, F launch) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; i++) launch(i);
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaGraphLaunch(ge, s)); // warm-up
  std::vector<float> ms;
  for (int r = 0; r < replays; r++) {
    CK(cudaEventRecord(a, s));
    CK(cudaGraphLaunch(ge, s));
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float t;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  return median(ms) * 1e3 / calls;
}

static void want(bool ok, const char *fmt, ...) {
  if (ok) { g_pass++; return; }
  g_fail++;
  va_list ap;
  va_start(ap, fmt);
  printf("FAIL ");
  vprintf(fmt, ap);
  printf("\n");
  va_end(ap);
}

// f64 reference of token t: part (the rounded MoE sum), y = round(part + res), n
static void check_rows(const char *what, int H, int T, int K, const std::vector<int32_t> &perm, bool fin,
                       const Slot &sl, const float *sc_dev, const char *w_dev, bool norm) {
  const size_t rb = (size_t)H * 2;
  std::vector<float> sc((size_t)T * K);
  CK(cudaMemcpy(sc.data(), sc_dev, sc.size() * 4, cudaMemcpyDeviceToHost));
  std::vector<uint16_t> w(H), row(H), sh(H), res(H), got(H), gotn(H);
  CK(cudaMemcpy(w.data(), w_dev, rb, cudaMemcpyDeviceToHost));
  const int ts[3] = {0, T / 2, T - 1};
  for (int q = 0; q < 3; q++) {
    const int t = ts[q];
    std::vector<double> acc(H), mag(H);
    CK(cudaMemcpy(sh.data(), sl.shared + (size_t)t * rb, rb, cudaMemcpyDeviceToHost));
    for (int j = 0; j < H; j++) { acc[j] = bf2f(sh[j]); mag[j] = fabs(acc[j]); }
    for (int k = 0; k < K; k++) {
      double s;
      size_t r;
      if (fin) { s = sc[(size_t)t * K + k]; r = (size_t)perm[(size_t)t * K + k]; }
      else { s = sc[(size_t)k * T + t]; r = (size_t)k * T + t; }
      CK(cudaMemcpy(row.data(), sl.x + r * rb, rb, cudaMemcpyDeviceToHost));
      for (int j = 0; j < H; j++) { acc[j] += s * bf2f(row[j]); mag[j] += fabs(s * bf2f(row[j])); }
    }
    const double u = 1.0 / 256;   // bf16 unit roundoff
    if (!norm) {
      CK(cudaMemcpy(got.data(), sl.part + (size_t)t * rb, rb, cudaMemcpyDeviceToHost));
      int bad = -1;
      for (int j = 0; j < H && bad < 0; j++)
        if (!(fabs(bf2f(got[j]) - acc[j]) <= u * fabs(acc[j]) + 1e-5 * mag[j] + 1e-30)) bad = j;
      want(bad < 0, "%s H%d T%d row %d element %d: %g, reference %g", what, H, T, t, bad,
           bad >= 0 ? bf2f(got[bad]) : 0., bad >= 0 ? acc[bad] : 0.);
      continue;
    }
    CK(cudaMemcpy(res.data(), sl.res + (size_t)t * rb, rb, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(got.data(), sl.ro + (size_t)t * rb, rb, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gotn.data(), sl.no + (size_t)t * rb, rb, cudaMemcpyDeviceToHost));
    std::vector<double> y(H);
    double ss = 0;
    for (int j = 0; j < H; j++) {
      y[j] = acc[j] + bf2f(res[j]);
      mag[j] += fabs(bf2f(res[j]));
      ss += y[j] * y[j];
    }
    const double rstd = 1.0 / sqrt(ss / H + 1e-6);
    int bad = -1, badn = -1;
    for (int j = 0; j < H; j++) {
      if (bad < 0 && !(fabs(bf2f(got[j]) - y[j]) <= 3 * u * mag[j] + 1e-30)) bad = j;
      const double n = y[j] * rstd * bf2f(w[j]);
      if (badn < 0 && !(fabs(bf2f(gotn[j]) - n) <= (4 * u * mag[j] * rstd + 2 * u * fabs(y[j]) * rstd) * fabs(bf2f(w[j])) + 1e-30))
        badn = j;
    }
    want(bad < 0, "%s H%d T%d row %d residual_out element %d: %g, reference %g", what, H, T, t, bad,
         bad >= 0 ? bf2f(got[bad]) : 0., bad >= 0 ? y[bad] : 0.);
    want(badn < 0, "%s H%d T%d row %d norm_out element %d: %g, reference %g", what, H, T, t, badn,
         badn >= 0 ? bf2f(gotn[badn]) : 0., badn >= 0 ? y[badn] * rstd * bf2f(w[badn]) : 0.);
  }
}

// the copy's rows against the XOR of its inputs (row t of slot 0)
static void check_copy(const char *what, const CopyArgs &c, int t) {
  const size_t rb = c.rb;
  std::vector<uint32_t> acc(rb / 4, 0), v(rb / 4);
  uint32_t wx = 0;
  for (int w = 0; w < 2; w++)
    if (c.words[w]) {
      std::vector<uint32_t> ws(c.top_k);
      CK(cudaMemcpy(ws.data(), c.words[w] + (size_t)t * c.top_k, 4 * c.top_k, cudaMemcpyDeviceToHost));
      for (uint32_t x : ws) wx ^= x;
    }
  std::vector<int32_t> g(c.top_k);
  if (c.gather) CK(cudaMemcpy(g.data(), c.gather + (size_t)t * c.top_k, 4 * c.top_k, cudaMemcpyDeviceToHost));
  for (int i = 0; i < c.nin; i++) {
    const char *row = c.gather && i < c.top_k ? c.in[0] + (size_t)g[i] * rb : c.in[i] + (size_t)t * rb;
    CK(cudaMemcpy(v.data(), row, rb, cudaMemcpyDeviceToHost));
    for (size_t e = 0; e < v.size(); e++) acc[e] ^= v[e];
  }
  if (c.weight) {
    CK(cudaMemcpy(v.data(), c.weight, rb, cudaMemcpyDeviceToHost));
    for (size_t e = 0; e < v.size(); e++) acc[e] ^= v[e];
  }
  for (size_t e = 0; e < acc.size(); e += 4) acc[e] ^= wx;
  bool ok = true;
  for (int o = 0; o < c.nout; o++) {
    CK(cudaMemcpy(v.data(), c.out[o] + (size_t)t * rb, rb, cudaMemcpyDeviceToHost));
    ok = ok && !memcmp(v.data(), acc.data(), rb);
  }
  want(ok, "%s copy row %d: not the XOR of its inputs", what, t);
}

static std::vector<int> parse_list(const char *s) {
  std::vector<int> v;
  for (const char *p = s; *p;) {
    v.push_back(atoi(p));
    const char *c = strchr(p, ',');
    if (!c) break;
    p = c + 1;
  }
  return v;
}

int main(int argc, char **argv) {
  const char *env_out = getenv("OUT");
  std::string out = env_out && *env_out ? env_out : "bench/results";
  // the GPU it runs on names the results (below), unless --machine / WEFT_MACHINE
  std::string machine = getenv("WEFT_MACHINE") ? getenv("WEFT_MACHINE") : "";
  const char *commit = getenv("WEFT_COMMIT") ? getenv("WEFT_COMMIT") : "unknown";
  std::vector<int> hiddens = parse_list("4096,7168"),
                   tokens = parse_list("1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192");
  int K = 8, replays = 15;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--hidden") && i + 1 < argc) hiddens = parse_list(argv[++i]);
    else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) tokens = parse_list(argv[++i]);
    else if (!strcmp(argv[i], "--top-k") && i + 1 < argc) K = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--replays") && i + 1 < argc) replays = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
    else if (!strcmp(argv[i], "--machine") && i + 1 < argc) machine = argv[++i];
    else {
      fprintf(stderr, "usage: %s [--hidden a,b] [--tokens a,b] [--top-k K] [--replays R] [--out DIR] [--machine NAME]\n", argv[0]);
      return 2;
    }
  }
  if (K < 1 || K + 2 > kMaxIn) { fprintf(stderr, "top_k must be in [1, %d]\n", kMaxIn - 2); return 2; }
  CK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  if (machine.empty()) {
    char tag[128];
    weft_machine_tag(prop.name, 1, tag, sizeof tag);
    machine = tag;
  }
  printf("device: %s, %d SMs, L2 %d MiB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const size_t kSpan = 256ull << 20;   // the slots of a graph span at least this much
  const int kMaxCalls = 1024;

  for (int H : hiddens) {
    const size_t rb = (size_t)H * 2;
    const int nv = H / 8, threads = row_threads(nv);
    for (int T : tokens) {
      // one slot: experts K*T rows, shared, residual, ro, no, part, 3 copy outputs
      const size_t slot_b = ((size_t)K + 8) * T * rb;
      const int S = (int)std::min<size_t>(kMaxCalls, std::max<size_t>(1, (kSpan + slot_b - 1) / slot_b));
      const int calls = std::max(S, 4);
      char *arena;
      const size_t per = ((slot_b + 255) / 256) * 256;
      CK(cudaMalloc(&arena, per * S));
      std::vector<Slot> sl(S);
      for (int i = 0; i < S; i++) {
        char *p = arena + per * i;
        sl[i].x = p; p += (size_t)K * T * rb;
        sl[i].shared = p; p += (size_t)T * rb;
        sl[i].res = p; p += (size_t)T * rb;
        sl[i].ro = p; p += (size_t)T * rb;
        sl[i].no = p; p += (size_t)T * rb;
        sl[i].part = p; p += (size_t)T * rb;
        for (int o = 0; o < kMaxOut; o++) { sl[i].cout[o] = p; p += (size_t)T * rb; }
      }
      float *sc;
      int32_t *perm_d;
      char *w;
      CK(cudaMalloc(&sc, (size_t)T * K * 4 * S));
      CK(cudaMalloc(&perm_d, (size_t)T * K * 4));
      CK(cudaMalloc(&w, rb));
      fill_bf16<<<1024, 256, 0, s>>>((__nv_bfloat16 *)arena, per * S / 2, 0x1234 + T * 7 + H);
      fill_f32<<<256, 256, 0, s>>>(sc, (size_t)T * K * S, 0x77 + T);
      fill_bf16<<<8, 256, 0, s>>>((__nv_bfloat16 *)w, H, 0x99);
      std::vector<int32_t> perm((size_t)T * K);
      for (size_t i = 0; i < perm.size(); i++) perm[i] = (int32_t)i;
      uint64_t z = 88172645463325252ull + T;
      for (size_t i = perm.size(); i > 1; i--) {
        z ^= z << 13; z ^= z >> 7; z ^= z << 17;
        std::swap(perm[i - 1], perm[z % i]);
      }
      CK(cudaMemcpy(perm_d, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaStreamSynchronize(s));
      auto scales = [&](int i) { return sc + (size_t)T * K * (i % S); };

      struct Kind {
        const char *name;
        int nin, nout, words;  // rows read (+ scales / perm words), rows written
        bool weight;
      };
      const Kind kinds[4] = {{"moe", K + 1, 1, 1, false}, {"moe_norm", K + 2, 2, 1, true},
                             {"fin_norm", K + 2, 2, 2, true}, {"rmsnorm", 2, 2, 0, true}};
      for (const Kind &kd : kinds) {
        const bool is_moe = strcmp(kd.name, "rmsnorm") != 0;
        auto launch = [&](int i) {
          const Slot &q = sl[i % S];
          if (!strcmp(kd.name, "moe"))
            WK(weft_cuda_moe_reduce(q.x, scales(i), WEFT_F32, nullptr, (int64_t)K * T, q.shared, q.part, nullptr,
                                    nullptr, nullptr, nullptr, T, H, K, WEFT_BF16, 1e-6f, 0, s));
          else if (!strcmp(kd.name, "moe_norm"))
            WK(weft_cuda_moe_reduce(q.x, scales(i), WEFT_F32, nullptr, (int64_t)K * T, q.shared, nullptr, q.res, w,
                                    q.ro, q.no, T, H, K, WEFT_BF16, 1e-6f, 0, s));
          else if (!strcmp(kd.name, "fin_norm"))
            WK(weft_cuda_moe_reduce(q.x, scales(i), WEFT_F32, perm_d, (int64_t)K * T, q.shared, nullptr, q.res, w,
                                    q.ro, q.no, T, H, K, WEFT_BF16, 1e-6f, 0, s));
          else
            WK(weft_cuda_rmsnorm(q.shared, q.res, w, q.no, q.ro, T, H, WEFT_BF16, 1e-6f, 0, s));
        };
        bool gather_rows = true;
        int copy_nc = 0;
        auto copy_args = [&](int i) {
          const Slot &q = sl[i % S];
          CopyArgs c = {};
          int n = 0;
          if (is_moe) {
            for (int k = 0; k < K; k++) c.in[n++] = q.x + (size_t)k * T * rb;
            c.in[n++] = q.shared;
            if (kd.nin == K + 2) c.in[n++] = q.res;
            c.words[0] = (const uint32_t *)scales(i);
            if (kd.words == 2) {   // fin_norm: the expert rows through the same permutation
              c.words[1] = (const uint32_t *)perm_d;
              if (gather_rows) c.gather = perm_d;
            }
          } else {
            c.in[n++] = q.shared;
            c.in[n++] = q.res;
          }
          c.nin = n;
          c.nout = kd.nout;
          for (int o = 0; o < kd.nout; o++) c.out[o] = q.cout[o];
          c.weight = kd.weight ? w : nullptr;
          c.tokens = T;
          c.top_k = K;
          c.nv = nv;
          c.rb = rb;
          c.nc = copy_nc;
          return c;
        };
        // the copy at the kernel's threads per row; for the MoE kinds also
        // (rows of 513-1024 vectors) at half of them, two vectors a thread
        // (two blocks per SM), and a row split over 2 and 4 blocks (the
        // freedom of the cluster-split kernel); each with plain and with
        // L1-bypassing loads: the fastest is the reference
        int copy_threads = is_moe ? threads : norm_threads(nv), copy_split = 1;
        auto copy = [&](int i) {
          CopyArgs c = copy_args(i);
          c.split = copy_split;
          launch_copy(c, (unsigned)(std::min(T, 65535 / copy_split) * copy_split), copy_threads, s);
        };
        launch(0);   // outside a capture first (the library's lazy set-up)
        CK(cudaStreamSynchronize(s));
        const double tk = time_graph(s, calls, replays, launch);
        struct Shape { int threads, split; };
        std::vector<Shape> shapes = {{copy_threads, 1}};
        if (is_moe && threads > 512) shapes.push_back({(threads / 32 + 1) / 2 * 32, 1});
        if (is_moe && (threads / 32) % 2 == 0) shapes.push_back({threads / 2, 2});
        if (is_moe && (threads / 32) % 4 == 0) shapes.push_back({threads / 4, 4});
        double tc = 1e30;
        Shape best = shapes[0];
        int best_nc = 0;
        for (const Shape &sh : shapes)
          for (int nc = 0; nc < 2; nc++) {
            copy_threads = sh.threads;
            copy_split = sh.split;
            copy_nc = nc;
            const double t = time_graph(s, calls, replays, copy);
            if (t < tc) { tc = t; best = sh; best_nc = nc; }
          }
        copy_threads = best.threads;
        copy_split = best.split;
        copy_nc = best_nc;
        // bytes: rows in + rows out, the words, the weight (read by every block, mostly from L2)
        const double bytes = (double)(kd.nin + kd.nout) * T * rb + (double)kd.words * T * K * 4 + (kd.weight ? rb : 0);
        const std::string shape = std::to_string(best.split) + " x " + std::to_string(best.threads) + (best_nc ? " nc" : "");
        g_rows.push_back({H, T, kd.name, bytes, tk, tc, shape});
        if (kd.words == 2) {   // fin_norm also against a copy reading the expert rows in order
          gather_rows = false;
          const double tf = time_graph(s, calls, replays, copy);
          gather_rows = true;
          g_rows.push_back({H, T, "fin_norm (copy: rows in order)", bytes, tk, tf, shape});
        }
        printf("H %d T %d %-9s kernel %9.2f us %7.0f GB/s | copy %9.2f us %7.0f GB/s (%d x %d%s) | %5.1f %% of copy\n",
               H, T, kd.name, tk, bytes / tk / 1e3, tc, bytes / tc / 1e3, copy_split, copy_threads,
               copy_nc ? " nc" : "", 100 * tc / tk);
        fflush(stdout);
        // checks on slot 0
        launch(0);
        copy(0);
        CK(cudaStreamSynchronize(s));
        if (is_moe)
          check_rows(kd.name, H, T, K, perm, kd.words == 2, sl[0], scales(0), w, strcmp(kd.name, "moe") != 0);
        else {
          // rmsnorm: x = shared, no MoE: check through the same reference with K = 0
          check_rows(kd.name, H, T, 0, perm, false, sl[0], scales(0), w, true);
        }
        const CopyArgs c0 = copy_args(0);
        check_copy(kd.name, c0, 0);
        check_copy(kd.name, c0, T - 1);
      }
      // the unfused MoE end: the reduction, then the norm kernel
      auto unfused = [&](int i) {
        const Slot &q = sl[i % S];
        WK(weft_cuda_moe_reduce(q.x, scales(i), WEFT_F32, nullptr, (int64_t)K * T, q.shared, q.part, nullptr, nullptr,
                                nullptr, nullptr, T, H, K, WEFT_BF16, 1e-6f, 0, s));
        WK(weft_cuda_rmsnorm(q.part, q.res, w, q.no, q.ro, T, H, WEFT_BF16, 1e-6f, 0, s));
      };
      const double tu = time_graph(s, calls, replays, unfused);
      g_rows.push_back({H, T, "unfused", 0, tu, 0, ""});
      printf("H %d T %d unfused   %9.2f us (moe, then rmsnorm)\n", H, T, tu);
      CK(cudaFree(arena));
      CK(cudaFree(sc));
      CK(cudaFree(perm_d));
      CK(cudaFree(w));
    }
  }
  printf("checks: %d passed, %d failed\n", g_pass, g_fail);

  // results
  char date[16];
  time_t now = time(nullptr);
  strftime(date, sizeof date, "%Y-%m-%d", gmtime(&now));
  const std::string base = out + "/moe-local-" + machine + "-" + date;
  FILE *j = fopen((base + ".json").c_str(), "w"), *m = fopen((base + ".md").c_str(), "w");
  if (!j || !m) { fprintf(stderr, "cannot write %s.{json,md}\n", base.c_str()); return 2; }
  fprintf(j, "{\"kind\": \"moe-local\", \"machine\": \"%s\", \"date\": \"%s\", \"commit\": \"%s\", \"top_k\": %d, "
          "\"replays\": %d, \"checks\": {\"passed\": %d, \"failed\": %d}, \"rows\": [\n", machine.c_str(), date,
          commit, K, replays, g_pass, g_fail);
  for (size_t i = 0; i < g_rows.size(); i++) {
    const Row &r = g_rows[i];
    fprintf(j, "  {\"hidden\": %d, \"tokens\": %d, \"kernel\": \"%s\", \"bytes\": %.0f, \"us\": %.3f, \"copy_us\": %.3f, "
            "\"copy_shape\": \"%s\"}%s\n", r.hidden, r.tokens, r.kernel, r.bytes, r.us, r.copy_us, r.copy_shape.c_str(),
            i + 1 < g_rows.size() ? "," : "");
  }
  fprintf(j, "]}\n");
  fclose(j);
  fprintf(m, "# Single-rank kernels of weft.fusion_ext against a copy kernel (%s, %s, commit %s)\n\n", machine.c_str(),
          date, commit);
  fprintf(m, "`build/moe_local_bench` (bench/moe_local_bench.cu; `scripts/gpu-fusion --ext-only`). bf16, top_k %d, "
          "f32 scales, shared expert on. Each kernel against a copy kernel moving the same bytes (every row it reads "
          "and writes, fin_norm's expert rows through the same permutation, the scales / permutation words, the "
          "weight), one block per token, all loads of a vector before "
          "its stores, with row_threads(hidden / 8) threads per row; for the MoE kinds also, for rows of 513-1024 "
          "vectors, with half of them, two vectors a thread (two blocks per SM), and with the row split over 2 and 4 "
          "blocks; each shape with plain loads and with loads that bypass L1 (ld.global.nc.L1::no_allocate): the "
          "fastest copy is the reference. CUDA graph of calls, each on its "
          "own slot of buffers (the slots span >= 256 MiB: no call reads what an earlier one left in L2), "
          "median of %d replays / calls per graph. %% of copy = copy µs / kernel µs. Checks (rows 0, T/2, T-1 against "
          "an f64 reference; the copies against the XOR of their inputs): %d passed, %d failed.\n\n",
          K, replays, g_pass, g_fail);
  fprintf(m, "moe: the reduction alone (K+1 rows + scales in, 1 row out); moe_norm: + residual + RMSNorm in one kernel "
          "(K+2 rows in, 2 out); fin_norm: moe_norm through the permutation (MoE finalize); rmsnorm: weft_cuda_rmsnorm "
          "with the residual (2 rows in, 2 out); unfused: moe then rmsnorm, µs only.\n\n");
  fprintf(m, "| hidden | tokens | kernel | bytes | kernel µs | kernel GB/s | copy µs | copy GB/s | copy shape | %% of copy |\n"
             "|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Row &r : g_rows) {
    if (!strcmp(r.kernel, "unfused"))
      fprintf(m, "| %d | %d | unfused (moe, rmsnorm) | | %.2f | | | | | |\n", r.hidden, r.tokens, r.us);
    else
      fprintf(m, "| %d | %d | %s | %.0f | %.2f | %.0f | %.2f | %.0f | %s | %.1f %% |\n", r.hidden, r.tokens, r.kernel,
              r.bytes, r.us, r.bytes / r.us / 1e3, r.copy_us, r.bytes / r.copy_us / 1e3, r.copy_shape.c_str(),
              100 * r.copy_us / r.us);
  }
  fclose(m);
  printf("wrote %s.json and .md\n", base.c_str());
  return g_fail ? 1 : 0;
}
