// moe_reduce.cu — the local MoE reduction on one rank (weft_cuda_moe_reduce,
// the device twin of weft_host_moe_reduce): each token's top_k expert
// outputs weighted by their router scales, plus the shared expert's output,
// in f32, rounded once. With a weight it is also the whole end of an MoE
// layer on a group of one rank in one kernel: the reduction, the residual add
// and the RMSNorm (the fused patterns' single-rank case, and what
// scripts/gpu-fusion measures against copy bandwidth).
//
// Every byte is read once and written once: top_k (+1 shared, +1 residual)
// rows in, 1-3 rows out; a thread keeps its vectors between the sums and
// the norm. Four shapes, by tokens and row size (measured on an H200:
// bench/results/moe-stream-variants-nvidia-h200-2026-12-03.md):
//  - a few tokens: a row split over a cluster of 2-4 blocks
//    (moe_reduce_split_kernel);
//  - else one block per row (moe_reduce_kernel), except for rows of
//    513-1024 vectors (hidden 4104-8192 in bf16) at more tokens than SMs:
//    half a row's threads, two rows per SM (moe_reduce_pair_kernel), and
//    from 6 rows per SM a ring of bulk copies through shared memory
//    (moe_reduce_stream_kernel).
// All four give a row the same bits (block_sum's order over row_threads).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cluster.cuh"
#include "fused_ext.cuh"
#include "cuda/cuda_internal.h"

namespace {

using namespace wfx;

struct LocalArgs {
  MoeIn m;
  void *out;
  const void *residual, *weight;
  void *residual_out, *norm_out;
  int32_t hidden;
  float eps;
  int gemma;
};

/* After moe_vec: stores the partial x (out); with a norm, makes y the
 * residual_out row, round(round(x) + residual) as the unfused path, stores
 * it and adds its sum of squares to ss. y: x in f32, then residual_out in
 * f32; rv: the residual's vector. */
template <typename T>
__device__ __forceinline__ void finish_vec(const LocalArgs &a, size_t off, bool norm, bool res, uint4 rv,
                                           float (&y)[Pack<T>::N], float &ss) {
  constexpr int N = Pack<T>::N;
  const uint4 xv = Pack<T>::from_f32(y);
  if (a.out) st_vec((char *)a.out + off, xv);
  if (norm) {
    Pack<T>::to_f32(xv, y);
    if (res) {
      float r[N];
      Pack<T>::to_f32(rv, r);
#pragma unroll
      for (int e = 0; e < N; e++) y[e] += r[e];
    }
    const uint4 yv = Pack<T>::from_f32(y);
    if (a.residual_out) st_vec((char *)a.residual_out + off, yv);
    Pack<T>::to_f32(yv, y);
    ss += sumsq_f32<T>(y);
  }
}

/* VM: vectors of a row per thread (1 up to 1024 vectors: hidden 8192 in
 * bf16/f16; 2 or 4 beyond), so a thread holds only the registers its row
 * needs and the expert loads of moe_vec stay in flight without spills (the
 * one kernel with kVM = 4 for every size spilled 300 bytes; VM 4, rows of
 * more than 2048 vectors, still spills ~100). */
template <typename T, int VM>
__global__ void __launch_bounds__(kMaxThreads) moe_reduce_kernel(const LocalArgs a) {
  constexpr int N = Pack<T>::N;
  __shared__ float red[33];
  const int nv = a.hidden / N;
  const size_t rb = (size_t)a.hidden * sizeof(T);
  const bool norm = a.weight != nullptr;
  for (int t = blockIdx.x; t < a.m.tokens; t += gridDim.x) {
    float y[VM][N];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < VM; k++) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < nv) {
        const size_t off = (size_t)t * rb + (size_t)j * 16;
        /* the residual's load goes out with the experts' first batch */
        uint4 rv = make_uint4(0, 0, 0, 0);
        const bool res = norm && a.residual;
        moe_vec<T, VM == 1 ? kBatchMax : 2>(a.m, t, j, rb, y[k], res ? (const char *)a.residual + (size_t)t * rb : nullptr, &rv);
        finish_vec<T>(a, off, norm, res, rv, y[k], ss);
      }
    }
    if (!norm) continue;
    /* the weight (L2-resident) requested before the block sum, used after it */
    uint4 wv[VM];
#pragma unroll
    for (int k = 0; k < VM; k++) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < nv) wv[k] = ld_vec((const char *)a.weight + (size_t)j * 16);
    }
    const float tot = block_sum(ss, red);
    const float rstd = rsqrtf(tot / (float)a.hidden + a.eps);
#pragma unroll
    for (int k = 0; k < VM; k++) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < nv)
        st_vec((char *)a.norm_out + (size_t)t * rb + (size_t)j * 16, norm_vec<T>(y[k], rstd, wv[k], a.gemma != 0));
    }
  }
}

/* A row of 513-1024 vectors on half its threads, two vectors a thread
 * (vectors t and t + blockDim), so that two rows share an SM: one block of
 * the whole row (up to 1024 threads at 64 registers) leaves the SM's loads
 * idle while it sums, normalises and exits. The sum of squares keeps
 * block_sum's bits over row_threads(nv) threads: vector j's thread there is
 * lane j % 32 of warp j / 32, here lane j % 32 of warp (j % blockDim) / 32,
 * so each vector's butterfly is the same and warp w's partial of vector
 * t + blockDim is that of warp w + blockDim / 32 there. */
template <typename T>
__global__ void __launch_bounds__(kMaxThreads / 2, 2) moe_reduce_pair_kernel(const LocalArgs a) {
  constexpr int N = Pack<T>::N;
  __shared__ float red[32];
  const int nv = a.hidden / N;
  const size_t rb = (size_t)a.hidden * sizeof(T);
  const bool norm = a.weight != nullptr;
  const bool res = norm && a.residual;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (int)blockDim.x >> 5;
  for (int t = blockIdx.x; t < a.m.tokens; t += gridDim.x) {
    uint4 yv[2];
    float ss[2] = {0.f, 0.f};
#pragma unroll
    for (int k = 0; k < 2; k++) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < nv) {
        const size_t off = (size_t)t * rb + (size_t)j * 16;
        uint4 rv = make_uint4(0, 0, 0, 0);
        float y[N];
        const void *first = res ? (const char *)a.residual + (size_t)t * rb : nullptr;
        moe_vec<T, kBatchMax>(a.m, t, j, rb, y, first, &rv);
        finish_vec<T>(a, off, norm, res, rv, y, ss[k]);
        yv[k] = Pack<T>::from_f32(y); /* y is residual_out's value: exact */
      }
    }
    if (!norm) continue;
    const float s0 = warp_xor_sum(ss[0]), s1 = warp_xor_sum(ss[1]);
    if (lane == 0) {
      red[warp] = s0;
      red[warp + nw] = s1;
    }
    __syncthreads();
    float tot = lane < 2 * nw ? red[lane] : 0.f;
    tot = warp_xor_sum(tot);
    __syncthreads(); /* red is reused by the next row */
    const float rstd = rsqrtf(tot / (float)a.hidden + a.eps);
#pragma unroll
    for (int k = 0; k < 2; k++) {
      const int j = threadIdx.x + k * blockDim.x;
      if (j < nv) {
        float y[N];
        Pack<T>::to_f32(yv[k], y);
        /* the weight (L2-resident) only now (registers); the SM's other row hides it */
        const uint4 wv = ld_vec((const char *)a.weight + (size_t)j * 16);
        st_vec((char *)a.norm_out + (size_t)t * rb + (size_t)j * 16, norm_vec<T>(y, rstd, wv, a.gemma != 0));
      }
    }
  }
}

/* A row of 513-1024 vectors streamed through shared memory, for more
 * tokens than SMs: one block per SM, a producer warp and half a row of
 * consumer threads (two vectors a thread, as moe_reduce_pair_kernel, the
 * same bits). The producer copies each half row of every input (the top_k
 * expert rows, the shared expert's, the residual) into a ring of stages
 * with bulk copies (TMA) completing on the stage's full barrier; consumers
 * reduce from shared memory, store, and free the stage. Stages ahead stay
 * in flight while the consumers sum and normalise: a row's tail no longer
 * leaves the SM's loads idle, and the bytes in flight cost no registers
 * (what limits the register kernels to about 90 % of a copy at 7168).
 * stages: how many fit (>= 2); the ring is [stages][slices][blockDim - 32]. */
constexpr int kMaxStages = 4;

template <typename T>
__global__ void __launch_bounds__(kMaxThreads / 2 + 32, 1) moe_reduce_stream_kernel(const LocalArgs a, int stages) {
  constexpr int N = Pack<T>::N;
  extern __shared__ __align__(128) uint4 ring[];
  __shared__ uint64_t full[kMaxStages], empty[kMaxStages];
  __shared__ float red[2][32];
  __shared__ float scale[kMaxStages][16]; /* the stage's token's scales, 0 where its entry is bad */
  __shared__ uint32_t live_k[kMaxStages]; /* bit k: expert k's slice is there; bit 31: a bad entry */
  const int nv = a.hidden / N, pt = (int)blockDim.x - 32, nwc = pt / 32;
  const size_t rb = (size_t)a.hidden * sizeof(T);
  const bool norm = a.weight != nullptr;
  const bool res = norm && a.residual;
  const int K = a.m.top_k, sh = a.m.shared ? 1 : 0;
  const int slices = K + sh + (res ? 1 : 0);
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; s++) {
      mbar_init_n(&full[s], 1);
      mbar_init_n(&empty[s], (uint32_t)nwc);
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    /* producer: lane k < top_k copies expert k's half row, lane top_k the
     * shared expert's, the next the residual's */
    const int lane = threadIdx.x;
    int it = 0;
    for (int t = blockIdx.x; t < a.m.tokens; t += gridDim.x) {
      const char *src = nullptr;
      float sk = 0.f;
      bool bad = false;
      if (lane < K) {
        int64_t si, r;
        if (a.m.perm) {
          si = (int64_t)t * K + lane;
          r = a.m.perm[si];
          if (r < 0 || r >= a.m.expert_rows) { bad = true; r = -1; }
        } else {
          si = (int64_t)lane * a.m.tokens + t;
          r = si;
        }
        if (r >= 0) {
          src = (const char *)a.m.input + (size_t)r * rb;
          sk = a.m.scales_f32 ? scalar_f32<float>(a.m.scales, si) : scalar_f32<T>(a.m.scales, si);
        }
      } else if (lane == K && sh) {
        src = (const char *)a.m.shared + (size_t)t * rb;
      } else if (lane == K + sh && res) {
        src = (const char *)a.residual + (size_t)t * rb;
      }
      const unsigned live = __ballot_sync(0xffffffffu, src != nullptr);
      const unsigned experts = (live & ((1u << K) - 1u)) | (__any_sync(0xffffffffu, bad) ? 1u << 31 : 0u);
      for (int h = 0; h < 2; h++, it++) {
        const int s = it % stages;
        const uint32_t bytes = (uint32_t)min(pt, nv - h * pt) * 16u;
        if (it >= stages) mbar_wait(&empty[s], (uint32_t)(it / stages - 1) & 1u);
        if (lane < 16) scale[s][lane] = sk;
        if (lane == 0) live_k[s] = experts;
        __syncwarp(); /* the scales before lane 0's arrive (release) */
        if (lane == 0) mbar_expect(&full[s], (uint32_t)__popc(live) * bytes);
        __syncwarp();
        if (src) bulk_g2s(ring + ((size_t)s * slices + lane) * pt, src + (size_t)h * pt * 16, bytes, &full[s]);
      }
    }
    return;
  }
  const int c = (int)threadIdx.x - 32, lane = c & 31, w = c >> 5;
  uint4 wv[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
  if (norm)
#pragma unroll
    for (int h = 0; h < 2; h++)
      if (c + h * pt < nv) wv[h] = ld_vec((const char *)a.weight + (size_t)(c + h * pt) * 16);
  int it = 0, row = 0;
  for (int t = blockIdx.x; t < a.m.tokens; t += gridDim.x, row++) {
    uint4 yv[2];
    float ss[2] = {0.f, 0.f};
#pragma unroll
    for (int h = 0; h < 2; h++, it++) {
      const int s = it % stages;
      mbar_wait(&full[s], (uint32_t)(it / stages) & 1u);
      const int j = c + h * pt;
      const uint32_t ok = live_k[s];
      if (j < nv) {
        const uint4 *slot = ring + (size_t)s * slices * pt + c;
        float y[N];
        if (sh) Pack<T>::to_f32(slot[(size_t)K * pt], y);
        else
#pragma unroll
          for (int e = 0; e < N; e++) y[e] = 0.f;
#pragma unroll
        for (int k = 0; k < 16; k++) {
          if (ok >> k & 1u) {
            float x[N];
            Pack<T>::to_f32(slot[(size_t)k * pt], x);
#pragma unroll
            for (int e = 0; e < N; e++) y[e] = __fmaf_rn(scale[s][k], x[e], y[e]);
          }
        }
        if (ok >> 31)
#pragma unroll
          for (int e = 0; e < N; e++) y[e] = __int_as_float(0x7fc00000);
        const uint4 rv = res ? slot[(size_t)(K + sh) * pt] : make_uint4(0, 0, 0, 0);
        finish_vec<T>(a, (size_t)t * rb + (size_t)j * 16, norm, res, rv, y, ss[h]);
        yv[h] = Pack<T>::from_f32(y); /* y is residual_out's value: exact */
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[s]);
    }
    if (!norm) continue;
    /* block_sum's bits over row_threads(nv) threads (see moe_reduce_pair_kernel);
     * red by row parity: a warp two rows ahead has passed the barrier of the row between */
    const int b = row & 1;
    const float s0 = warp_xor_sum(ss[0]), s1 = warp_xor_sum(ss[1]);
    if (lane == 0) {
      red[b][w] = s0;
      red[b][w + nwc] = s1;
    }
    asm volatile("bar.sync 1, %0;" ::"r"(pt) : "memory");
    float tot = lane < 2 * nwc ? red[b][lane] : 0.f;
    tot = warp_xor_sum(tot);
    const float rstd = rsqrtf(tot / (float)a.hidden + a.eps);
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int j = c + h * pt;
      if (j < nv) {
        float y[N];
        Pack<T>::to_f32(yv[h], y);
        st_vec((char *)a.norm_out + (size_t)t * rb + (size_t)j * 16, norm_vec<T>(y, rstd, wv[h], a.gemma != 0));
      }
    }
  }
}

/* A row split over a cluster of C blocks, for a few tokens (at most one
 * block per SM: tokens * C <= SMs; rows of at most 1024 vectors). There one
 * block per row leaves most SMs idle, and a block of a whole row (up to
 * 1024 threads at 64 registers) keeps only a batch of 4 expert loads of a
 * thread in flight: two round trips at top_k 8. A block of the split has
 * at most 512 threads, so a thread holds kSplitBatch expert loads at once
 * (one round trip up to top_k 8) and C times the SMs share the row.
 * Block r of a cluster serves vectors r * blockDim .. of the cluster's rows.
 * (At more tokens the split loses: 1 block of 14 warps per SM at ~110
 * registers against 28 warps, -20 to -35 points of the copy; with
 * batches of 4 at 70 registers, two blocks per SM, it only matched the
 * unsplit kernel.)
 * The norm's sum of squares has block_sum's bits: every warp's butterfly
 * sum goes by st.async to slot (global warp index) of every block's red[],
 * completing on that block's transaction barrier (one per row parity: a
 * sibling a row ahead writes the other one, and cannot be two ahead, which
 * needs this block's partials of the row in between); each block then sums
 * the warp partials in warp order as block_sum does over C * blockDim
 * threads. No cluster-wide barrier per row and no flush of this block's
 * stores (kernels/cluster.cuh). Every block of a cluster serves the same
 * rows, so every exchange it waits for is sent by co-scheduled siblings:
 * the waits end (as a __syncthreads would); no peer outside is involved. */
constexpr int kSplitThreads = 512;
constexpr int kSplitBatch = 8;

template <typename T, int C>
__global__ void __cluster_dims__(C, 1, 1) __launch_bounds__(kSplitThreads)
    moe_reduce_split_kernel(const LocalArgs a) {
  constexpr int N = Pack<T>::N;
  __shared__ uint2 red[2][32];
  __shared__ uint64_t mb[2];
  const int nv = a.hidden / N;
  const size_t rb = (size_t)a.hidden * sizeof(T);
  const bool norm = a.weight != nullptr;
  const bool res = norm && a.residual;
  const int lane = threadIdx.x & 31;
  const int j = (int)(blockIdx.x % C) * blockDim.x + threadIdx.x; /* cluster rank: blockIdx.x % C */
  const int nw = C * (int)blockDim.x / 32;
  const bool live = j < nv;
  if (norm) {
    if (threadIdx.x == 0) {
      mbar_init(&mb[0]);
      mbar_init(&mb[1]);
      mbar_init_fence();
    }
    cluster_arrive_relaxed(); /* "started, barriers initialised"; waited on before the first remote store */
  }
  uint4 wv = make_uint4(0, 0, 0, 0);
  if (norm && live) wv = ld_vec((const char *)a.weight + (size_t)j * 16);
  bool started = false;
  int it = 0;
  for (int t = blockIdx.x / C; t < a.m.tokens; t += gridDim.x / C, it++) {
    float y[N];
    float ss = 0.f;
    if (live) {
      const size_t off = (size_t)t * rb + (size_t)j * 16;
      uint4 rv = make_uint4(0, 0, 0, 0);
      moe_vec<T, kSplitBatch>(a.m, t, j, rb, y, res ? (const char *)a.residual + (size_t)t * rb : nullptr, &rv);
      finish_vec<T>(a, off, norm, res, rv, y, ss);
    }
    if (!norm) continue;
    const int b = it & 1;
    if (threadIdx.x == 0) mbar_expect(&mb[b], (uint32_t)nw * 8u);
    if (!started) {
      cluster_wait_acquire();
      started = true;
    }
    const float s = warp_xor_sum(ss);
    if (lane < C)
      st_async_cluster(&red[b][j >> 5], &mb[b], (uint32_t)lane, make_uint2(__float_as_uint(s), 0u));
    while (!mbar_done(&mb[b], (uint32_t)(it >> 1) & 1u)) {
    }
    float tot = lane < nw ? __uint_as_float(red[b][lane].x) : 0.f;
    tot = warp_xor_sum(tot);
    const float rstd = rsqrtf(tot / (float)a.hidden + a.eps);
    if (live)
      st_vec((char *)a.norm_out + (size_t)t * rb + (size_t)j * 16, norm_vec<T>(y, rstd, wv, a.gemma != 0));
  }
  if (norm && !started) cluster_wait_acquire();
}

/* SMs of device dev (cached: asked once per device) */
int sm_count(int dev) {
  static int cache[64];
  if (dev < 0 || dev >= 64) return 0;
  int n = __atomic_load_n(&cache[dev], __ATOMIC_RELAXED);
  if (n == 0 && cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && n > 0)
    __atomic_store_n(&cache[dev], n, __ATOMIC_RELAXED);
  return n > 0 ? n : 0;
}

/* The cluster size for tokens rows of nv vectors (threads per whole row),
 * 1: no split. The largest C of 4, 2 whose blocks all fit one per SM and
 * whose blocks hold whole warps (the block sum's order). Measured on an
 * H200 (bench/results/moe-split-variants-nvidia-h200-2026-12-03.md): C = 4
 * is +8 to +25 points of the copy at 1-32 tokens, C = 2 at 64 no
 * different, any split from 128 tokens on -20 to -35 points. */
int split_of(int dev, int nv, int threads, int64_t tokens) {
  if (nv > kMaxThreads) return 1;
  const int sms = sm_count(dev);
  for (int c = 4; c >= 2; c /= 2)
    if ((threads / 32) % c == 0 && threads / c <= kSplitThreads && tokens * c <= sms) return c;
  return 1;
}

template <typename T>
void launch_vm(int vm, unsigned blocks, int threads, cudaStream_t s, const LocalArgs &a) {
  switch (vm) {
  case 1: moe_reduce_kernel<T, 1><<<blocks, threads, 0, s>>>(a); break;
  case 2: moe_reduce_kernel<T, 2><<<blocks, threads, 0, s>>>(a); break;
  default: moe_reduce_kernel<T, kVM><<<blocks, threads, 0, s>>>(a); break;
  }
}

/* Lets the stream kernel of T use up to the device's opt-in shared memory
 * per block (once per device); that size, 0 if unknown or if the kernel
 * this device runs was built below sm_90 (no bulk copies: it would wait
 * for bytes that never come). */
template <typename T> int stream_smem(int dev) {
  static int cache[64];
  if (dev < 0 || dev >= 64) return 0;
  int n = __atomic_load_n(&cache[dev], __ATOMIC_RELAXED);
  if (n) return n;
  cudaFuncAttributes fa;
  if (cudaFuncGetAttributes(&fa, moe_reduce_stream_kernel<T>) != cudaSuccess || fa.binaryVersion < 90 ||
      fa.ptxVersion < 90)
    return 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) return 0;
  n -= 1024; /* the kernel's static shared memory */
  if (cudaFuncSetAttribute(moe_reduce_stream_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, n) != cudaSuccess)
    return 0;
  __atomic_store_n(&cache[dev], n, __ATOMIC_RELAXED);
  return n;
}

/* threads of the pair and stream kernels' consumers: half a row's warps */
int half_threads(int threads) { return (threads / 32 + 1) / 2 * 32; }

/* The stream kernel if its ring holds >= 2 stages of this call's inputs
 * (top_k up to 10 at hidden 7168 bf16); false: not launched. */
template <typename T> bool launch_stream(int dev, int threads, int64_t tokens, cudaStream_t s, const LocalArgs &a) {
  const int pt = half_threads(threads);
  const int slices = a.m.top_k + (a.m.shared ? 1 : 0) + (a.weight && a.residual ? 1 : 0);
  const size_t stage = (size_t)slices * pt * 16;
  const int smem = stream_smem<T>(dev), sms = sm_count(dev);
  const int stages = smem > 0 ? (int)min((size_t)kMaxStages, (size_t)smem / stage) : 0;
  if (stages < 2 || sms <= 0) return false;
  const unsigned blocks = (unsigned)(tokens < sms ? tokens : sms);
  moe_reduce_stream_kernel<T><<<blocks, pt + 32, stages * stage, s>>>(a, stages);
  return true;
}

/* Rows of 513-1024 vectors, more rows than SMs: the stream kernel from
 * kStreamRowsPerSm rows per SM (its ring fills and drains once per block:
 * at 4 rows per SM it was 2-3 points behind the pair kernel, at 8 ahead),
 * else (or where its ring does not fit) the pair kernel. */
constexpr int kStreamRowsPerSm = 6;

template <typename T>
void launch_wide(int dev, int threads, int64_t tokens, unsigned blocks, cudaStream_t s, const LocalArgs &a) {
  if (tokens >= (int64_t)kStreamRowsPerSm * sm_count(dev) && launch_stream<T>(dev, threads, tokens, s, a)) return;
  moe_reduce_pair_kernel<T><<<blocks, half_threads(threads), 0, s>>>(a);
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

}  // namespace

extern "C" int weft_cuda_moe_reduce(const void *input, const void *scales, int scales_dtype,
                                    const int32_t *perm, int64_t expert_rows, const void *shared,
                                    void *out, const void *residual, const void *weight,
                                    void *residual_out, void *norm_out, int64_t tokens,
                                    int64_t hidden, int top_k, int dtype, float eps, int flags,
                                    void *stream) {
  static const char op[] = "cuda moe_reduce";
  int dev;
  int rc = wf_cuda_device(&dev);
  if (rc) return rc;
  WF_CHECK_ARG(dtype == WEFT_F32 || dtype == WEFT_F16 || dtype == WEFT_BF16,
               "%s: dtype %d is not f32, f16 or bf16", op, dtype);
  WF_CHECK_ARG(scales_dtype == WEFT_F32 || scales_dtype == dtype,
               "%s: scales dtype %d must be f32 or the input's", op, scales_dtype);
  const int64_t es = dtype == WEFT_F32 ? 4 : 2;
  WF_CHECK_ARG(tokens >= 0 && tokens < (1ll << 31) && hidden >= 1 && (hidden * es) % 16 == 0 &&
                   hidden * es / 16 <= (int64_t)kVM * kMaxThreads,
               "%s: shape %lld x %lld: hidden must fill 16-byte vectors, at most %lld of them", op,
               (long long)tokens, (long long)hidden, (long long)kVM * kMaxThreads);
  WF_CHECK_ARG(top_k >= 1 && top_k <= 16, "%s: top_k %d out of range [1, 16]", op, top_k);
  WF_CHECK_ARG((flags & ~WEFT_RMSNORM_GEMMA) == 0, "%s: unknown flags %d", op, flags);
  WF_CHECK_ARG(eps >= 0.f, "%s: eps must be >= 0", op);
  if (tokens == 0) return 0;
  WF_CHECK_ARG(input && scales, "%s: NULL input or scales", op);
  WF_CHECK_ARG(weight ? norm_out != nullptr : out != nullptr, "%s: nothing to write (out or norm_out)", op);
  WF_CHECK_ARG(aligned16(input) && (!shared || aligned16(shared)) && (!out || aligned16(out)) &&
                   (!residual || aligned16(residual)) && (!weight || aligned16(weight)) &&
                   (!residual_out || aligned16(residual_out)) && (!norm_out || aligned16(norm_out)),
               "%s: tensors must be 16-byte aligned", op);
  LocalArgs a;
  a.m.input = input;
  a.m.scales = scales;
  a.m.perm = perm;
  a.m.shared = shared;
  a.m.expert_rows = expert_rows;
  a.m.tokens = (int32_t)tokens;
  a.m.top_k = top_k;
  a.m.scales_f32 = scales_dtype == WEFT_F32;
  a.out = out;
  a.residual = residual;
  a.weight = weight;
  a.residual_out = residual_out;
  a.norm_out = norm_out;
  a.hidden = (int32_t)hidden;
  a.eps = eps;
  a.gemma = (flags & WEFT_RMSNORM_GEMMA) != 0;
  const int threads = row_threads((int)(hidden * es / 16));
  const int64_t blocks = tokens < 65535 ? tokens : 65535;
  cudaStream_t s = stream ? (cudaStream_t)stream : wf_cuda_current_stream();
  const int nv = (int)(hidden * es / 16), vm = (nv + threads - 1) / threads;
  if (const int c = vm == 1 ? split_of(dev, nv, threads, tokens) : 1; c > 1) {
    /* tokens * c <= SMs: one cluster per row */
    const unsigned sb = (unsigned)(tokens * c);
    const int st = threads / c;
    if (c == 4) {
      switch (dtype) {
      case WEFT_F32: moe_reduce_split_kernel<float, 4><<<sb, st, 0, s>>>(a); break;
      case WEFT_F16: moe_reduce_split_kernel<__half, 4><<<sb, st, 0, s>>>(a); break;
      default: moe_reduce_split_kernel<__nv_bfloat16, 4><<<sb, st, 0, s>>>(a); break;
      }
    } else {
      switch (dtype) {
      case WEFT_F32: moe_reduce_split_kernel<float, 2><<<sb, st, 0, s>>>(a); break;
      case WEFT_F16: moe_reduce_split_kernel<__half, 2><<<sb, st, 0, s>>>(a); break;
      default: moe_reduce_split_kernel<__nv_bfloat16, 2><<<sb, st, 0, s>>>(a); break;
      }
    }
  } else if (vm == 1 && threads > kMaxThreads / 2 && tokens > sm_count(dev)) {
    switch (dtype) {
    case WEFT_F32: launch_wide<float>(dev, threads, tokens, (unsigned)blocks, s, a); break;
    case WEFT_F16: launch_wide<__half>(dev, threads, tokens, (unsigned)blocks, s, a); break;
    default: launch_wide<__nv_bfloat16>(dev, threads, tokens, (unsigned)blocks, s, a); break;
    }
  } else switch (dtype) {
  case WEFT_F32: launch_vm<float>(vm, (unsigned)blocks, threads, s, a); break;
  case WEFT_F16: launch_vm<__half>(vm, (unsigned)blocks, threads, s, a); break;
  default: launch_vm<__nv_bfloat16>(vm, (unsigned)blocks, threads, s, a); break;
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return wf_cuda_err(__FILE__, __LINE__, "moe_reduce kernel launch", e);
  return 0;
}
