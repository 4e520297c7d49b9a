/* fused_norm.cu — the host side of the all-reduce fused with residual add +
 * RMSNorm (+ FP8 quant): the grid (geometry, occupancy), the launch and the
 * workspace's initialisation. The kernels, and how they work, are in
 * kernels/fused_norm_kernels.cuh, instantiated per dtype and mode (f32: and
 * algorithm and worlds) in units the build writes (mk/kernel_units.mk). */
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "fused_norm_kernels.cuh"

namespace {

using namespace wf;

/* ------------------------------------------------------------ host side */

__global__ void fill_u32_kernel(uint32_t *p, size_t n, uint32_t v) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = v;
}

/* det: the deterministic-mode instantiation (WF_FUSED_DETERMINISTIC) */
kernel_fn pick(int dtype, int algo, int world, bool det) {
  switch (dtype) {
  case WEFT_BF16: return det ? wf_fused::pick_bf16_det(algo, world) : wf_fused::pick_bf16(algo, world);
  case WEFT_F16: return det ? wf_fused::pick_f16_det(algo, world) : wf_fused::pick_f16(algo, world);
  case WEFT_F32:
    if (algo == WF_FUSED_ONESHOT && world <= 5)
      return det ? wf_fused::pick_f32_det_oneshot_w2_5(world) : wf_fused::pick_f32_oneshot_w2_5(world);
    if (algo == WF_FUSED_ONESHOT)
      return det ? wf_fused::pick_f32_det_oneshot_w6_8(world) : wf_fused::pick_f32_oneshot_w6_8(world);
    return det ? wf_fused::pick_f32_det_twoshot(world) : wf_fused::pick_f32_twoshot(world);
  }
  return nullptr;
}

/* Occupancy, cached: deterministic for a given binary and device, hence
 * equal on every rank of a homogeneous node. clusters == 0: resident blocks
 * per SM for (kernel, threads); else the co-resident clusters of that size
 * on the whole GPU (GPC placement included). */
int occupancy(kernel_fn k, int threads, int clusters, int *out) {
  struct entry { kernel_fn k; int threads, clusters, n; };
  static entry cache[512];
  static int used = 0;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  for (int i = 0; i < used; i++)
    if (cache[i].k == k && cache[i].threads == threads && cache[i].clusters == clusters) {
      *out = cache[i].n;
      return 0;
    }
  int n = 0;
  cudaError_t e;
  if (clusters == 0) {
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, threads, 0);
  } else {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    cfg.gridDim = dim3((unsigned)clusters);
    cfg.blockDim = dim3((unsigned)threads);
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = (unsigned)clusters;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    e = cudaOccupancyMaxActiveClusters(&n, (const void *)k, &cfg);
  }
  if (e != cudaSuccess) { cudaGetLastError(); return (int)e; }
  if (n < 1) n = clusters ? 0 : 1;
  if (used < 512) { cache[used] = entry{k, threads, clusters, n}; used++; }
  *out = n;
  return 0;
}

/* Tuning override (fused_bench's cluster sweep, or WEFT_FUSION_CLUSTER =
 * 1, 2, 4, 8 in the environment, read once): forced blocks per row group
 * for the one-shot (1: never split a row), and the vectors per block the
 * automatic choice splits a long row down to. Process-wide. Ranks may even
 * differ: the one-shot's data are indexed by row, not by block, so each rank
 * may use its own grid (fused_bench checks it). Probes: fused_bench only. */
int g_force_cluster = -1, g_min_threads = 128, g_push_ahead = -1;
int g_probe = 0;
unsigned long long *g_trace = nullptr;
/* Rows of at most this many vectors stay in one block (4 KiB of bf16). */
constexpr int kSplitAboveVectors = 256;
/* the default push-ahead distance in rows: 1 measured best (2 x H200, 512 and
 * 2048 tokens: 512 x 8192 32.3 us against 35.7 at 2, 38.8 at 4; 2048 x 4096
 * 58.2 against 62.7 / 72.5): more rows in flight per block only crowd the link */
constexpr int kPushAhead = 1;

/* One-shot rows a block pushes before it consumes its first (WEFT_FUSION_PUSH_AHEAD, read once) */
int push_ahead() {
  if (g_push_ahead < 1) {
    const char *e = getenv("WEFT_FUSION_PUSH_AHEAD");
    const int v = e ? atoi(e) : 0;
    g_push_ahead = v >= 1 && v <= 1 << 20 ? v : kPushAhead;
  }
  return g_push_ahead;
}

int force_cluster() {
  if (g_force_cluster < 0) {
    const char *e = getenv("WEFT_FUSION_CLUSTER");
    const int v = e ? atoi(e) : 0;
    g_force_cluster = v == 1 || v == 2 || v == 4 || v == 8 ? v : 0;
    /* Shared-GPU test mode (ranks in MPS slices of one GPU): the cluster
     * occupancy counts the whole GPU, not the slice, so a split row's
     * clusters may not all be resident (seen at world 8: 14-SM slices, a
     * one-shot that never finished). Rows stay in one block there. */
    const char *s = getenv("WEFT_ALLOW_SHARED_GPU");
    if (g_force_cluster == 0 && s && !strcmp(s, "1")) g_force_cluster = 1;
  }
  return g_force_cluster;
}

struct Shape {
  kernel_fn k;
  int blocks, threads, cluster;
  bool cluster_launch;
};

/* threads for rows of nv vectors split over C blocks (per thread <= vmax) */
int threads_for(int nv, int C, int maxt, int vmax, int *t) {
  const int per = (nv + C * maxt - 1) / (C * maxt);
  if (per > vmax) return (int)cudaErrorInvalidValue;
  *t = ((nv + C * per - 1) / (C * per) + 31) / 32 * 32;
  return 0;
}

/* The grid: a pure function of the arguments, num_sms and the occupancy
 * of this binary (per-SM figures are the same on every GPU of a kind; the
 * cluster figure may follow a chip's GPC layout, but only the one-shot uses
 * it, and its result does not depend on the grid).
 *  - two-shot: one block per row of a rank's range, at most what is resident;
 *  - one-shot: C blocks per row group. Rows of up to kSplitAboveVectors
 *    vectors stay in one block (C = 1); longer rows are split over C = 2, 4
 *    or 8 blocks (the smallest C that brings a block to g_min_threads
 *    vectors, at most 8), as long as tokens * C blocks fit two per SM and
 *    tokens clusters are co-resident (norm patterns:
 *    cudaOccupancyMaxActiveClusters), else the next smaller C. Measured on
 *    2 x H200: bench/results/fused-nvidia-h200-x2-*.md (sweep). The grid
 *    never exceeds what is resident at once (clusters included). */
int geometry(const wf_fused_args *a, int algo, Shape *sh) {
  const int esz = a->dtype == WEFT_F32 ? 4 : 2;
  const bool one = algo == WF_FUSED_ONESHOT;
  const int maxt = esz == 4 ? Geo<float>::MAXT
                   : one && a->world > 2 ? OneGeo<__nv_bfloat16, 3>::MAXT
                                          : Geo<__nv_bfloat16>::MAXT;
  const int vmax = WF_FUSED_MAX_HIDDEN * esz / 16 / maxt;
  const int nv = a->hidden * esz / 16;
  const int sms = a->num_sms > 0 ? a->num_sms : 1;
  const kernel_fn k = pick(a->dtype, algo, a->world, (a->flags & WF_FUSED_DETERMINISTIC) != 0);
  if (!k || nv < 1) return (int)cudaErrorInvalidValue;
  const bool norm = a->pattern != WF_FUSED_AR;
  int C = 1, t = 0, e;
  const int force = force_cluster();
  if (algo == WF_FUSED_ONESHOT) {
    int cmax = force;
    if (force == 0) {
      cmax = 1;
      if (nv > kSplitAboveVectors)
        while (cmax < 8 && (nv + cmax - 1) / cmax > g_min_threads) cmax *= 2;
    }
    for (int c = cmax; c >= 2; c /= 2) {
      if (threads_for(nv, c, maxt, vmax, &t)) { if (force) break; continue; }
      if (force == 0 && (long)a->tokens * c > 2L * sms) continue;
      int room = 0;
      if (norm) {
        if (occupancy(k, t, c, &room)) room = 0; /* no cluster launch here: C = 1 */
      } else {
        if ((e = occupancy(k, t, 0, &room))) return e;
        room = room * sms / c;
      }
      if (room < 1) { if (force) break; continue; }
      if (force == 0 && room < a->tokens) continue;
      long q = a->tokens < room ? a->tokens : room;
      if (q > WF_MAX_GRID / c) q = WF_MAX_GRID / c;
      C = c;
      sh->blocks = (int)q * c;
      break;
    }
  }
  if (C == 1) {
    if ((e = threads_for(nv, 1, maxt, vmax, &t))) return e;
    int bps = 1;
    if ((e = occupancy(k, t, 0, &bps))) return e;
    const int work = algo == WF_FUSED_ONESHOT ? a->tokens : (a->tokens + a->world - 1) / a->world;
    long g = (long)sms * bps;
    if (g > work) g = work;
    if (g > WF_MAX_GRID) g = WF_MAX_GRID;
    if (g < 1) g = 1;
    sh->blocks = (int)g;
  }
  sh->k = k;
  sh->threads = t;
  sh->cluster = C;
  sh->cluster_launch = C > 1 && norm;
  return 0;
}

}  // namespace

extern "C" void wf_fused_set_tune(int cluster, int min_threads) {
  g_force_cluster = cluster == 1 || cluster == 2 || cluster == 4 || cluster == 8 ? cluster : 0;
  g_min_threads = min_threads > 0 ? min_threads : 128;
}

extern "C" void wf_fused_set_push_ahead(int rows) { g_push_ahead = rows >= 1 ? rows : -1; }

extern "C" void wf_fused_set_probe(int probe, unsigned long long *trace) {
  g_probe = probe;
  g_trace = trace;
}

extern "C" int wf_fused_grid(const wf_fused_args *a, int algo, int *blocks, int *threads,
                             int *cluster) {
  Shape sh;
  int e = geometry(a, algo, &sh);
  if (e) return e;
  *blocks = sh.blocks;
  *threads = sh.threads;
  *cluster = sh.cluster;
  return 0;
}

extern "C" int wf_fused_launch(const wf_fused_args *a, int algo, void *stream) {
  Shape sh;
  int e = geometry(a, algo, &sh);
  if (e) return e;
  wf_fused_args args = *a;
  args.cluster = sh.cluster;
  args.probe = g_probe;
  args.push_ahead = push_ahead();
  args.trace = g_trace;
  /* the call's descriptor: what every rank must launch alike (the one-shot
   * pairs no blocks across ranks: its grid may differ, so it is left out) */
  args.agree.d0 = wf_agree_d0(WF_AGREE_FUSED, (unsigned)algo, (unsigned)a->dtype, (unsigned)a->pattern,
                              algo == WF_FUSED_TWOSHOT ? (unsigned)sh.blocks : 0u,
                              algo == WF_FUSED_TWOSHOT ? (unsigned)sh.threads : 0u,
                              (unsigned)a->flags & (WF_FUSED_GEMMA | WF_FUSED_FP32_ACC | WF_FUSED_DETERMINISTIC));
  args.agree.d1 = ((uint64_t)(uint32_t)a->tokens << 32) | (uint32_t)a->hidden;
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[2];
  int na = 0;
  cfg.gridDim = dim3((unsigned)sh.blocks);
  cfg.blockDim = dim3((unsigned)sh.threads);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = (cudaStream_t)stream;
  if (a->flags & WF_FUSED_PDL) {
    attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[na].val.programmaticStreamSerializationAllowed = 1;
    na++;
  }
  if (sh.cluster_launch) {
    attr[na].id = cudaLaunchAttributeClusterDimension;
    attr[na].val.clusterDim.x = (unsigned)sh.cluster;
    attr[na].val.clusterDim.y = 1;
    attr[na].val.clusterDim.z = 1;
    na++;
  }
  cfg.attrs = na ? attr : nullptr;
  cfg.numAttrs = (unsigned)na;
  return (int)cudaLaunchKernelEx(&cfg, sh.k, args);
}

extern "C" int wf_fused_init(void *base, uint64_t lamport_off, uint64_t lamport_bytes,
                             uint64_t zero_bytes, int dtype, void *stream) {
  cudaStream_t s = (cudaStream_t)stream;
  cudaError_t e = cudaMemsetAsync(base, 0, zero_bytes, s);
  if (e != cudaSuccess) return (int)e;
  (void)dtype; /* the sentinel word is the same for every dtype */
  const uint32_t pat = kLamportEmpty;
  const size_t n = lamport_bytes / 4;
  if (n) fill_u32_kernel<<<1024, 256, 0, s>>>((uint32_t *)((char *)base + lamport_off), n, pat);
  return (int)cudaGetLastError();
}
