/* quick_allreduce_kernels.cuh — the quick all-reduce: weft's two-shot all-reduce
 * (kernels/allreduce.cu's ar_twoshot) whose wire format is a codec
 * (src/coll/quick_codec.h): int8, int4 or fp8 e4m3 with one f32 scale per
 * block of 32 elements, or fp (the input dtype: no compression, the
 * reference path through the same kernel).  bf16 and f16, worlds 2, 4, 6, 8,
 * over the weft_ar workspace (same epochs, flags, sites and error words).
 *
 * Per chunk, part j belongs to rank j:
 *  A. every rank encodes its input of part q and pushes codes + scales to
 *     rank q (reduce-scatter);
 *  B. the owner decodes every rank's contribution (its own one encoded and
 *     decoded in registers, the same functions), sums them in f32 in rank
 *     order, encodes the sum ONCE and pushes those bytes to every peer; its
 *     own output is the decoded bytes it pushed;
 *  C. every rank decodes the owners' bytes into its output.
 * So every rank decodes the same bytes with the same function: every rank
 * ends with the same bits.  An element's result depends only on its
 * 32-element block of every rank's input (blocks are aligned to the buffer
 * start, whoever owns them), which is what deterministic mode needs.
 * The schedule is ar_twoshot's (ar_layout.cuh twoshot_rounds: one pipeline of
 * rounds and flags for every wire), with this wire in its steps; one 16-byte
 * vector per thread and part (a block of 32 elements = 4 adjacent threads,
 * its max found with two shuffles).
 *
 * Also: the codec steps alone on one GPU (weft_qr_codec_step), for the
 * throughput benchmark and for checking them against the CPU reference.
 *
 * This header holds the kernels and their launch templates; the build writes
 * one translation unit per dtype (mk/kernel_units.mk: WF_QR_UNIT below) that
 * instantiates those of one dtype and exports its launch and codec-step
 * functions, so that nvcc compiles them in parallel;
 * kernels/quick_allreduce.cu keeps the entry points. */
#pragma once
#include "ar_layout.cuh"
#include "quick_codec.cuh"

extern "C" {
#include "coll/ar_internal.h"
#include "weft.h"
}

namespace {

using namespace wf;

struct QArgs {
  const char *in;
  char *out;
  uint64_t nvec;
  int tail;
  int rank;
  char *ws[WF_MAX_WORLD];
  uint64_t off_data, data_par;
  SpinEnv env;
};

/* --------------------------------------------------------------- the kernel */

template <typename T, bool D>
__device__ __forceinline__ uint4 load_term(const QArgs &a, uint64_t v) {
  if (v >= a.nvec) return make_uint4(0, 0, 0, 0);
  uint4 x = (a.tail && v == a.nvec - 1)
                ? ld_vec_partial<T>(reinterpret_cast<const T *>(a.in + v * 16), a.tail)
                : ld_vec(a.in + v * 16);
  return D ? lamport_sanitize<T>(x) : x;
}
template <typename T>
__device__ __forceinline__ void store_out(const QArgs &a, uint64_t v, uint4 x) {
  if (v >= a.nvec) return;
  if (a.tail && v == a.nvec - 1) st_vec_partial<T>(reinterpret_cast<T *>(a.out + v * 16), x, a.tail);
  else st_vec(a.out + v * 16, x);
}

struct QLam {
  uint64_t off_lamport, lamport_slot;
};

template <typename T, int W, int C, bool D>
__global__ void __launch_bounds__(WF_QR_THREADS, W == 2 ? 2 : 1) qr_twoshot(QArgs a, QLam lam) {
  using K = Codec<C>;
  pdl_wait(); /* before any memory access: the previous kernel is complete */
  pdl_launch_dependents();
  agree_announce(a.env.ag);
  const uint32_t E = epoch_load(epochs_of(a));
  const uint32_t par = E & 1;
  const int me = a.rank, t = threadIdx.x, b = blockIdx.x, G = gridDim.x;
  const uint64_t nvec = a.nvec, PV = WF_QR_PART, CW = PV * W;
  const uint64_t nchunks = (nvec + CW - 1) / CW;
  const uint64_t R = (uint64_t)b < nchunks ? (nchunks - 1 - b) / G + 1 : 0;
  const uint64_t slot = nchunks * K::PB;
  /* slots: [0, W-1) reduce-scatter inputs, [W-1, 2W-2) all-gather results */
  const char *region_me = a.ws[me] + a.off_data + par * a.data_par;

  lamport_maintain<W>(a, lam, E, 0); /* it uses none of them */

  twoshot_rounds<W>(
      a, E, R, WF_AR_SITE_QRS, WF_AR_SITE_QAG,
      [&](uint64_t c) { /* A: encode part q of chunk c, push it to rank q */
        uint4 raws[W - 1]; /* every part's input loaded first: W-1 loads in flight */
#pragma unroll
        for (int k = 1; k < W; k++) raws[k - 1] = load_term<T, D>(a, c * CW + ((me + k) % W) * PV + t);
#pragma unroll
        for (int k = 1; k < W; k++) {
          const int q = (me + k) % W;
          const uint4 raw = raws[k - 1];
          char *dst = a.ws[q] + a.off_data + par * a.data_par + pslot(me, q) * slot + c * K::PB;
          if (C == WF_QR_FP) {
            put<C>(dst, t, raw, 0.f);
          } else {
            float x[8], s;
            Pack<T>::to_f32(raw, x);
            const uint4 cq = encode<C>(x, s);
            put<C>(dst, t, cq, s);
          }
        }
      },
      [&](uint64_t c) { /* B: sum my part of chunk c in rank order, encode once, push */
        const uint64_t v = c * CW + me * PV + t;
        float acc[8];
#pragma unroll 1
        for (int p = 0; p < W; p++) {
          float y[8];
          if (p == me) {
            through_wire<T, C>(load_term<T, D>(a, v), y);
          } else {
            float s = 0.f;
            const uint4 cq = get<C>(region_me + pslot(p, me) * slot + c * K::PB, t, s);
            if (C == WF_QR_FP) Pack<T>::to_f32(cq, y);
            else decode<C>(cq, s, y);
          }
#pragma unroll
          for (int i = 0; i < 8; i++) acc[i] = p == 0 ? y[i] : __fadd_rn(acc[i], y[i]);
        }
        uint4 wire, res;
        float s = 0.f;
        if (C == WF_QR_FP) {
          wire = res = Pack<T>::from_f32(acc);
        } else {
          float y[8];
          wire = encode<C>(acc, s);
          decode<C>(wire, s, y); /* my output: the bytes I push, decoded */
          res = Pack<T>::from_f32(y);
        }
#pragma unroll 1
        for (int k = 1; k < W; k++) {
          const int q = (me + k) % W;
          put<C>(a.ws[q] + a.off_data + par * a.data_par + (W - 1 + pslot(me, q)) * slot + c * K::PB, t, wire, s);
        }
        store_out<T>(a, v, res);
      },
      [&](uint64_t c) { /* C: decode the owners' results of chunk c */
#pragma unroll 1
        for (int k = 1; k < W; k++) {
          const int p = (me + k) % W;
          const uint64_t v = c * CW + p * PV + t;
          if (v >= nvec) continue;
          float s = 0.f;
          const uint4 cq = get<C>(region_me + (W - 1 + pslot(p, me)) * slot + c * K::PB, t, s);
          if (C == WF_QR_FP) {
            store_out<T>(a, v, cq);
          } else {
            float y[8];
            decode<C>(cq, s, y);
            store_out<T>(a, v, Pack<T>::from_f32(y));
          }
        }
      });
  __syncthreads();
  agree_verify(a.env, WF_AR_SITE_AGREE);
  epoch_advance(epochs_of(a), E);
}

/* ------------------------------------------------ codec steps on one GPU
 * The same encode/decode as the kernel above, on one GPU, in the wire
 * layout of quick_codec.h (parts of WF_QR_PART vectors):
 *  quantize: in (T) -> wire;
 *  reduce: W wires of the same count -> decode, f32 sum in order, encode
 *          once -> wire_out, and the decoded result (T) -> out.
 * One vector per thread, grid-stride over whole parts.  P (the probe):
 * the same loads and stores at the same addresses with no codec work
 * (the words are only xor-ed together), the memory pattern's own rate.
 * 32 registers (4 blocks of 512 per SM): at 36-40 the 2-rank reduce and the
 * quantize lost a quarter of their resident warps. */
template <typename T, int C, bool P>
__global__ void __launch_bounds__(WF_QR_THREADS, 4) qr_step_quantize(const char *in, char *wire, uint64_t nvec,
                                                                  int tail) {
  const int t = threadIdx.x;
  const uint64_t parts = (nvec + WF_QR_PART - 1) / WF_QR_PART;
  constexpr int U = 2; /* parts per iteration: both loads in flight before either is encoded */
  for (uint64_t p0 = blockIdx.x; p0 < parts; p0 += (uint64_t)U * gridDim.x) {
    uint4 raw[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const uint64_t v = (p0 + (uint64_t)u * gridDim.x) * WF_QR_PART + t;
      raw[u] = make_uint4(0, 0, 0, 0);
      if (v < nvec)
        raw[u] = (tail && v == nvec - 1) ? ld_vec_partial<T>(reinterpret_cast<const T *>(in + v * 16), tail)
                                         : ld_vec(in + v * 16);
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      const uint64_t pp = p0 + (uint64_t)u * gridDim.x;
      if (pp >= parts) break; /* uniform across the block */
      char *part = wire + pp * Codec<C>::PB;
      if (C == WF_QR_FP) {
        put<C>(part, t, raw[u], 0.f);
      } else if (P) {
        const uint4 r = raw[u];
        put<C>(part, t, make_uint4(r.x ^ r.z, r.y ^ r.w, 0, 0), __uint_as_float(r.x ^ r.w));
      } else {
        float x[8], s;
        Pack<T>::to_f32(raw[u], x);
        const uint4 q = encode<C>(x, s);
        put<C>(part, t, q, s);
      }
    }
  }
}

template <typename T, int W, int C, bool P>
__global__ void __launch_bounds__(WF_QR_THREADS, 4) qr_step_reduce(const char *wires, uint64_t wire_stride,
                                                                char *wire_out, char *out, uint64_t nvec,
                                                                int tail) {
  const int t = threadIdx.x;
  const uint64_t parts = (nvec + WF_QR_PART - 1) / WF_QR_PART;
  for (uint64_t pp = blockIdx.x; pp < parts; pp += gridDim.x) {
    const uint64_t v = pp * WF_QR_PART + t;
    float acc[8];
    uint4 mix = make_uint4(0, 0, 0, 0); /* the probe's stand-in for the sum */
    uint32_t smix = 0;
#pragma unroll
    for (int p = 0; p < W; p++) {
      float y[8], s = 0.f;
      const uint4 q = get<C>(wires + p * wire_stride + pp * Codec<C>::PB, t, s);
      if (P) {
        mix.x ^= q.x; mix.y ^= q.y; mix.z ^= q.z; mix.w ^= q.w;
        smix ^= __float_as_uint(s);
        continue;
      }
      if (C == WF_QR_FP) Pack<T>::to_f32(q, y);
      else decode<C>(q, s, y);
#pragma unroll
      for (int i = 0; i < 8; i++) acc[i] = p == 0 ? y[i] : __fadd_rn(acc[i], y[i]);
    }
    uint4 res;
    if (P) {
      put<C>(wire_out + pp * Codec<C>::PB, t, mix, __uint_as_float(smix));
      res = make_uint4(mix.x, mix.y ^ smix, mix.z, mix.w);
    } else if (C == WF_QR_FP) {
      res = Pack<T>::from_f32(acc);
      put<C>(wire_out + pp * Codec<C>::PB, t, res, 0.f);
    } else {
      float s, y[8];
      const uint4 q = encode<C>(acc, s);
      put<C>(wire_out + pp * Codec<C>::PB, t, q, s);
      decode<C>(q, s, y);
      res = Pack<T>::from_f32(y);
    }
    if (v < nvec) {
      if (tail && v == nvec - 1) st_vec_partial<T>(reinterpret_cast<T *>(out + v * 16), res, tail);
      else st_vec(out + v * 16, res);
    }
  }
}

/* ------------------------------------------------------------------ launch */


/* The grid: a deterministic function of the call and the agreed handle
 * parameters (same on every rank), capped to what is co-resident. */
template <typename KF>
int grid_for(const wf_ar_args *a, uint64_t nvec, KF kernel, int *occ) {
  const int sms = a->sms > 0 ? a->sms : 1;
  const uint64_t bps = (uint64_t)(a->blocks_per_sm > 0 ? a->blocks_per_sm : 2);
  const uint64_t r = (uint64_t)resident(kernel, WF_QR_THREADS, occ);
  const uint64_t cap = (uint64_t)sms * (bps < r ? bps : r);
  uint64_t g = a->grid > 0 ? (uint64_t)a->grid : balanced(wf_qr_chunks(nvec, a->world), cap);
  if (g > cap) g = cap;
  if (g < 1) g = 1;
  if (g > WF_MAX_GRID) g = WF_MAX_GRID;
  return (int)g;
}

template <typename T, int W, int C, bool D>
cudaError_t launch_q(const wf_ar_args *a, const QArgs &k, int *grid, cudaStream_t s, bool launch) {
  static int occ = 0;
  auto kern = qr_twoshot<T, W, C, D>;
  *grid = grid_for(a, k.nvec, kern, &occ);
  if (!launch) return cudaSuccess;
  QLam lam = {a->off_lamport, a->lamport_slot};
  QArgs ka = k; /* the call's descriptor: what every rank must launch alike */
  ka.env.ag.d0 = wf_agree_d0(WF_AGREE_QUICK, (unsigned)a->kind, (unsigned)a->dtype, 0, (unsigned)*grid,
                             WF_QR_THREADS, D ? 32u : 0u);
  ka.env.ag.d1 = a->count;
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  cfg.gridDim = dim3(*grid);
  cfg.blockDim = dim3(WF_QR_THREADS);
  cfg.stream = s;
  if (a->pdl) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&cfg, kern, ka, lam);
}

template <typename T, int W>
cudaError_t launch_qw(const wf_ar_args *a, const QArgs &k, int *g, cudaStream_t s, bool launch) {
  switch (a->kind) {
    case WF_AR_QUICK_FP:
      return a->determ ? launch_q<T, W, WF_QR_FP, true>(a, k, g, s, launch)
                       : launch_q<T, W, WF_QR_FP, false>(a, k, g, s, launch);
    case WF_AR_QUICK_INT8: return launch_q<T, W, WF_QR_INT8, false>(a, k, g, s, launch);
    case WF_AR_QUICK_INT4: return launch_q<T, W, WF_QR_INT4, false>(a, k, g, s, launch);
    case WF_AR_QUICK_FP8: return launch_q<T, W, WF_QR_FP8, false>(a, k, g, s, launch);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t launch_qt(const wf_ar_args *a, const QArgs &k, int *g, cudaStream_t s, bool launch) {
  switch (a->world) {
    case 2: return launch_qw<T, 2>(a, k, g, s, launch);
    case 4: return launch_qw<T, 4>(a, k, g, s, launch);
    case 6: return launch_qw<T, 6>(a, k, g, s, launch);
    case 8: return launch_qw<T, 8>(a, k, g, s, launch);
    default: return cudaErrorInvalidValue;
  }
}

/* one dtype (launch = false: only the grid a call would use) */
template <typename T>
int q_launch_t(const wf_ar_args *a, void *stream, int *grid, bool launch) {
  QArgs k;
  k.in = static_cast<const char *>(a->in);
  k.out = static_cast<char *>(a->out);
  k.nvec = wf_ar_nvec(a->count, 2);
  k.tail = (int)((a->count * 2) % 16) / 2;
  k.rank = a->rank;
  for (int i = 0; i < WF_MAX_WORLD; i++) k.ws[i] = a->ws[i];
  k.off_data = a->off_data;
  k.data_par = a->data_par;
  k.env.abort_host = a->abort_host;
  k.env.err_dev = reinterpret_cast<unsigned long long *>(a->ws[a->rank] + WF_AR_OFF_ERR);
  k.env.err_host = a->err_host;
  k.env.timeout_ns = a->timeout_ns;
  k.env.ag = a->agree;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return (int)launch_qt<T>(a, k, grid, s, launch);
}

/* codec steps (step 2 / 3: the probes of quantize / reduce, the same memory
 * traffic without the codec's work: scripts/bench-quick-codec.lua) */
template <typename T, int C, bool P>
cudaError_t step_cv(int step, int world, const void *in, void *wire, void *out, uint64_t nvec, int tail,
                    cudaStream_t s) {
  const uint64_t parts = cdiv(nvec, WF_QR_PART);
  int dev = 0, sms = 132;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  /* one wave: as many blocks as are resident at once (a fixed 4 per SM made
   * a second, one-third-full wave where a kernel takes over 32 registers,
   * the 2-rank reduce of int8 and fp8: 36-40) */
  auto grid = [&](auto kernel, int *occ) {
    const uint64_t cap = (uint64_t)sms * (uint64_t)resident(kernel, WF_QR_THREADS, occ);
    return (unsigned)(parts < cap ? parts : cap);
  };
  if (step == 0) {
    static int occ = 0;
    auto k = qr_step_quantize<T, C, P>;
    k<<<grid(k, &occ), WF_QR_THREADS, 0, s>>>(static_cast<const char *>(in), static_cast<char *>(wire), nvec, tail);
    return cudaGetLastError();
  }
  const uint64_t stride = wf_qr_wire_bytes(C, nvec);
  const char *w = static_cast<const char *>(in);
  char *wo = static_cast<char *>(wire);
  char *o = static_cast<char *>(out);
  auto reduce = [&](auto k, int *occ) { k<<<grid(k, occ), WF_QR_THREADS, 0, s>>>(w, stride, wo, o, nvec, tail); };
  static int occ[4] = {0, 0, 0, 0};
  switch (world) {
    case 2: reduce(qr_step_reduce<T, 2, C, P>, &occ[0]); break;
    case 4: reduce(qr_step_reduce<T, 4, C, P>, &occ[1]); break;
    case 6: reduce(qr_step_reduce<T, 6, C, P>, &occ[2]); break;
    case 8: reduce(qr_step_reduce<T, 8, C, P>, &occ[3]); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}
template <typename T, int C>
cudaError_t step_c(int step, int world, const void *in, void *wire, void *out, uint64_t nvec, int tail,
                   cudaStream_t s) {
  return step < 2 ? step_cv<T, C, false>(step, world, in, wire, out, nvec, tail, s)
                  : step_cv<T, C, true>(step - 2, world, in, wire, out, nvec, tail, s);
}

template <typename T>
cudaError_t step_t(int step, int codec, int world, const void *in, void *wire, void *out, uint64_t nvec,
                   int tail, cudaStream_t s) {
  switch (codec) {
    case WF_QR_FP: return step_c<T, WF_QR_FP>(step, world, in, wire, out, nvec, tail, s);
    case WF_QR_INT8: return step_c<T, WF_QR_INT8>(step, world, in, wire, out, nvec, tail, s);
    case WF_QR_INT4: return step_c<T, WF_QR_INT4>(step, world, in, wire, out, nvec, tail, s);
    case WF_QR_FP8: return step_c<T, WF_QR_FP8>(step, world, in, wire, out, nvec, tail, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

/* q_launch_t and step_t of one dtype: each pair defined by WF_QR_UNIT in a
 * unit the build writes (mk/kernel_units.mk) */
namespace wf_qr {
int launch_bf16(const wf_ar_args *a, void *stream, int *grid, bool launch);
int launch_f16(const wf_ar_args *a, void *stream, int *grid, bool launch);
int step_bf16(int step, int codec, int world, const void *in, void *wire, void *out, uint64_t nvec, int tail,
              cudaStream_t s);
int step_f16(int step, int codec, int world, const void *in, void *wire, void *out, uint64_t nvec, int tail,
             cudaStream_t s);
}  // namespace wf_qr

#define WF_QR_UNIT(name, T)                                                                                    \
  int wf_qr::launch_##name(const wf_ar_args *a, void *stream, int *grid, bool launch) {                        \
    return q_launch_t<T>(a, stream, grid, launch);                                                             \
  }                                                                                                            \
  int wf_qr::step_##name(int step, int codec, int world, const void *in, void *wire, void *out, uint64_t nvec, \
                         int tail, cudaStream_t s) {                                                           \
    return (int)step_t<T>(step, codec, world, in, wire, out, nvec, tail, s);                                   \
  }
