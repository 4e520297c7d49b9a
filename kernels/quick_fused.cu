/* quick_fused.cu — the fused all-reduce + residual add + RMSNorm two-shot
 * (fused_norm.cu's twoshot_kernel: same workspace, flags, epochs, sites and
 * error words) with the quick all-reduce's wire codecs (quick_codec.cuh:
 * int8, int4 or fp8 e4m3, one f32 scale per block of 32 elements).
 *
 * Tokens are split in W contiguous ranges; rank p owns range p.  Blocks of
 * 32 elements are aligned to the start of each ROW (the last block of a row
 * of hidden % 32 != 0 elements is short: its missing elements are +0), so a
 * row's result depends on that row's inputs only, whatever the batch.
 *  1. reduce-scatter: every rank encodes its rows of range p and pushes codes
 *     + scales to p's RS inbox;
 *  2. the owner decodes every rank's contribution (its own encoded and
 *     decoded in registers, the same functions), sums them in f32 in rank
 *     order, encodes the sum ONCE and pushes those bytes to every peer's AG
 *     inbox; its all-reduced value is the bytes it pushed, decoded;
 *  3. every rank decodes the owners' bytes of the other rows.
 * So every rank holds the same all-reduced value a (decoded, rounded to the
 * dtype: exactly what the quick all-reduce would return), then adds ITS
 * residual (y = dtype(a + residual) = residual_out) and normalises y, with
 * the norm's one summation order (kernels/common.cuh vec_sumsq, chunks of 32
 * vectors, the chunk partials in order).  Given the same residual on every
 * rank (tensor parallelism's replicated residual, as the one-shot kernel
 * assumes too), every rank ends with the same bits, and with rows of a
 * multiple of 32 elements the result equals the quick all-reduce followed by
 * the norm kernel bit for bit.
 *
 * Why the encoded sum and not the owner's y (or its norm) on the all-gather:
 * residual_out is the residual stream of the next layer; sending it encoded
 * would quantise the residual stream itself (its error would add up layer
 * after layer), sending it exact costs the full bytes on the all-gather half.
 * The encoded sum keeps both halves compressed, and the quantisation stays
 * on the all-reduced value alone, as in the unfused quick path.
 *
 * Waits: the flags of fused_norm.cu's two-shot (flag_value(E, 1) and (E, 2)
 * per block), polled by W - 1 threads per block with wf::wait_flag_geq: a
 * failure names the peer and the site and leaves the workspace poisoned. */
#include "quick_codec.cuh"
#include "fused_twoshot.cuh"

extern "C" {
#include "coll/fusion_internal.h"
#include "weft.h"
}

namespace {

using namespace wf;

constexpr int QF_MAXT = 512;                                   /* threads per block at most */
constexpr int QF_VMAX = WF_FUSED_MAX_HIDDEN / 8 / QF_MAXT;     /* vectors per thread per row */
constexpr int QF_NCM = WF_FUSED_MAX_HIDDEN / 8 / 32;           /* chunk partials of the longest row */

/* Bytes of one encoded row of nv vectors: codes, then one f32 scale per
 * block of 4 vectors, rounded up to 16 bytes (never more than the row in
 * bf16/f16: the inbox slots of the exact two-shot hold it). */
__host__ __device__ __forceinline__ uint64_t enc_row_bytes(int code_bytes, int nv) {
  const uint64_t b = (uint64_t)nv * (uint64_t)code_bytes + (uint64_t)((nv + 3) / 4) * 4u;
  return (b + 15u) / 16u * 16u;
}

/* y = dtype(a + r) of the decoded all-reduced value (already rounded to the
 * dtype, as the quick all-reduce returns it) and the residual. */
template <typename T>
__device__ __forceinline__ uint4 add_residual(const float (&dec)[8], uint4 rv) {
  float a[8], r[8];
  Pack<T>::to_f32(Pack<T>::from_f32(dec), a);
  Pack<T>::to_f32(rv, r);
#pragma unroll
  for (int e = 0; e < 8; e++) a[e] = __fadd_rn(a[e], r[e]);
  return Pack<T>::from_f32(a);
}

template <typename T, int W, int C>
__global__ void __launch_bounds__(QF_MAXT, 1) qr_fused_twoshot(const wf_fused_args a) {
  using K = Codec<C>;
  __shared__ float red[2][QF_NCM];
  pdl_wait();
  agree_announce(a.agree);
  char *const local = (char *)a.peer[a.rank];
  wf_fused_state *const st = (wf_fused_state *)(local + a.off_state);
  const uint32_t E = epoch_load(st->flag_epoch);
  if (__syncthreads_or(threadIdx.x == 0 && *(volatile unsigned long long *)a.err_dev != 0ull)) return;
  const SpinEnv env{a.abort_host, a.err_dev, a.err_host, a.timeout_ns, a.agree};
  const int NV = a.hidden / 8, NC = (NV + 31) / 32, rank = a.rank, tid = threadIdx.x;
  const int wbase = tid - (tid & 31);
  const size_t RB = (size_t)a.hidden * sizeof(T);
  const uint64_t ERB = enc_row_bytes(K::CB, NV), SC = (uint64_t)NV * K::CB;
  const int rows_per = (a.tokens + W - 1) / W;
  const size_t slot = (size_t)rows_per * ERB;
  const char *const in = (const char *)a.in;
  const uint64_t ag_mine = a.off_ag + (uint64_t)rank * slot;
  const char *const rs = local + a.off_rs;
  const char *const ag = local + a.off_ag;
  auto wait = [&](uint64_t *f, uint64_t target, uint32_t peer, uint32_t site) {
    return wait_flag_geq(f, target, env, peer, site, E);
  };

  /* the norm of row grow, from this block's residual_out of it (each vector
   * re-read by the thread that stored it), after every put of the row */
  auto norm_row = [&](int grow, int p2) {
    __syncthreads();
    const int lane = tid & 31;
    float tot = 0.f;
#pragma unroll
    for (int m = 0; m < QF_NCM / 32; m++) {
      const int idx = lane + 32 * m;
      if (idx < NC) tot += red[p2][idx];
    }
    tot = warp_xor_sum(tot);
    const float rstd = rsqrtf(tot / (float)a.hidden + a.eps);
    const float one = (a.flags & WF_FUSED_GEMMA) ? 1.f : -0.f; /* -0.0: the identity (fused_norm.cu) */
#pragma unroll
    for (int k = 0; k < QF_VMAX; k++) {
      const int j = tid + k * blockDim.x;
      if (j < NV) {
        const size_t goff = (size_t)grow * RB + (size_t)j * 16;
        float x[8], g[8], n[8];
        Pack<T>::to_f32(ld_vec((const char *)a.res_out + goff), x);
        Pack<T>::to_f32(ld_vec((const char *)a.gamma + (size_t)j * 16), g);
#pragma unroll
        for (int e = 0; e < 8; e++) n[e] = x[e] * rstd * (g[e] + one);
        st_vec((char *)a.norm_out + goff, Pack<T>::from_f32(n));
      }
    }
  };
  /* y of vector j of row grow from the decoded value; stores residual_out and
   * this warp's chunk partial (whole warps) */
  auto finish_vec = [&](int grow, int j, int k, const float (&dec)[8], int p2) {
    float s = 0.f;
    if (j < NV) {
      const size_t goff = (size_t)grow * RB + (size_t)j * 16;
      const uint4 yv = add_residual<T>(dec, ld_vec((const char *)a.res_in + goff));
      st_vec((char *)a.res_out + goff, yv);
      s = vec_sumsq<T>(yv);
    }
    s = warp_xor_sum(s);
    if ((tid & 31) == 0) red[p2][(wbase + k * (int)blockDim.x) / 32] = s;
  };

  /* 1. my part of row grow, encoded, into its owner's RS inbox (row r there) */
  auto push = [&](char *dst, int grow, int r) {
    uint4 v[QF_VMAX];
#pragma unroll
    for (int k = 0; k < QF_VMAX; k++) {
      const int j = tid + k * blockDim.x;
      v[k] = j < NV ? ld_vec(in + (size_t)grow * RB + (size_t)j * 16) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < QF_VMAX; k++) {
      const int j = tid + k * blockDim.x;
      if (wbase + k * (int)blockDim.x >= NV) break; /* warp-uniform: encode shuffles */
      float x[8], s;
      Pack<T>::to_f32(v[k], x);
      const uint4 q = encode<C>(x, s);
      if (j < NV) put<C>(dst + (size_t)r * ERB, j, q, s, SC);
    }
  };
  /* 2. an own row: decode every rank's contribution, sum in rank order,
   *    encode once, push to every peer's AG inbox; my value: those bytes decoded */
  auto own = [&](int grow, int r, int parity) {
#pragma unroll 1
    for (int k = 0; k < QF_VMAX; k++) {
      const int j = tid + k * blockDim.x;
      if (wbase + k * (int)blockDim.x >= NV) break;
      const size_t goff = (size_t)grow * RB + (size_t)j * 16;
      float acc[8];
#pragma unroll 1
      for (int p = 0; p < W; p++) {
        float y[8];
        if (p == rank) {
          float x[8], s;
          Pack<T>::to_f32(j < NV ? ld_vec(in + goff) : make_uint4(0, 0, 0, 0), x);
          const uint4 q = encode<C>(x, s);
          decode<C>(q, s, y);
        } else {
          float s = 0.f;
          const uint4 q = get<C>(rs + (size_t)p * slot + (size_t)r * ERB, j < NV ? j : 0, s, SC);
          decode<C>(q, s, y);
        }
#pragma unroll
        for (int e = 0; e < 8; e++) {
          if (j >= NV) y[e] = 0.f; /* past the row's end: +0, as the peers encoded it */
          acc[e] = p == 0 ? y[e] : __fadd_rn(acc[e], y[e]);
        }
      }
      float s, dec[8];
      const uint4 wire = encode<C>(acc, s);
      decode<C>(wire, s, dec); /* my value: the bytes I push, decoded */
      if (j < NV) {
#pragma unroll 1
        for (int i = 1; i < W; i++)
          put<C>((char *)a.peer[(rank + i) % W] + ag_mine + (size_t)r * ERB, j, wire, s, SC);
      }
      finish_vec(grow, j, k, dec, parity);
    }
    norm_row(grow, parity);
  };
  /* 3. a peer's row: decode the owner's bytes, residual, norm */
  auto pull = [&](int p, int grow, int r, int parity) {
#pragma unroll 1
    for (int k = 0; k < QF_VMAX; k++) {
      const int j = tid + k * blockDim.x;
      if (wbase + k * (int)blockDim.x >= NV) break;
      float s = 0.f, dec[8];
      const uint4 q = get<C>(ag + (size_t)p * slot + (size_t)r * ERB, j < NV ? j : 0, s, SC);
      decode<C>(q, s, dec);
      finish_vec(grow, j, k, dec, parity);
    }
    norm_row(grow, parity);
  };
  fused_twoshot_ranges<W>(a, env, st, E, slot, wait, push, own, pull);
}

/* ------------------------------------------------------------------ launch */

typedef void (*qf_kernel)(const wf_fused_args);

template <typename T, int W> qf_kernel pick_c(int codec) {
  switch (codec) {
    case WF_QR_INT8: return qr_fused_twoshot<T, W, WF_QR_INT8>;
    case WF_QR_INT4: return qr_fused_twoshot<T, W, WF_QR_INT4>;
    case WF_QR_FP8: return qr_fused_twoshot<T, W, WF_QR_FP8>;
  }
  return nullptr;
}
template <typename T> qf_kernel pick_w(int codec, int world) {
  switch (world) {
    case 2: return pick_c<T, 2>(codec);
    case 4: return pick_c<T, 4>(codec);
    case 6: return pick_c<T, 6>(codec);
    case 8: return pick_c<T, 8>(codec);
  }
  return nullptr;
}
qf_kernel pick(int dtype, int codec, int world) {
  switch (dtype) {
    case WEFT_BF16: return pick_w<__nv_bfloat16>(codec, world);
    case WEFT_F16: return pick_w<__half>(codec, world);
  }
  return nullptr;
}

/* The grid: a pure function of the arguments, the agreed num_sms and this
 * binary's occupancy (same on every rank): threads for one row (at most
 * QF_VMAX vectors each), one block per row of a rank's range, at most what
 * is resident at once (a peer's block b waits for ours). */
int shape(const wf_fused_args *a, int codec, qf_kernel *k, int *blocks, int *threads) {
  if (a->pattern != WF_FUSED_ARN || a->hidden < 8 || a->hidden % 8 || a->hidden > WF_FUSED_MAX_HIDDEN)
    return (int)cudaErrorInvalidValue;
  *k = pick(a->dtype, codec, a->world);
  if (!*k) return (int)cudaErrorInvalidValue;
  const int nv = a->hidden / 8;
  const int per = (nv + QF_MAXT - 1) / QF_MAXT;
  const int t = ((nv + per - 1) / per + 31) / 32 * 32;
  int bps = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&bps, *k, t, 0) != cudaSuccess) {
    return (int)cudaGetLastError();
  }
  if (bps < 1) bps = 1;
  const int sms = a->num_sms > 0 ? a->num_sms : 1;
  const long work = (a->tokens + a->world - 1) / a->world;
  long g = (long)sms * bps;
  if (g > work) g = work;
  if (g > WF_MAX_GRID) g = WF_MAX_GRID;
  if (g < 1) g = 1;
  *blocks = (int)g;
  *threads = t;
  return 0;
}

}  // namespace

extern "C" uint64_t wf_qr_fused_row_bytes(int codec, int hidden) { return enc_row_bytes(wf_qr_code_bytes(codec), hidden / 8); }

extern "C" int wf_qr_fused_grid(const wf_fused_args *a, int codec, int *blocks, int *threads) {
  qf_kernel k;
  return shape(a, codec, &k, blocks, threads);
}

extern "C" int wf_qr_fused_launch(const wf_fused_args *a, int codec, void *stream) {
  qf_kernel k;
  int blocks, threads;
  int e = shape(a, codec, &k, &blocks, &threads);
  if (e) return e;
  wf_fused_args args = *a; /* the call's descriptor: what every rank must launch alike */
  args.agree.d0 = wf_agree_d0(WF_AGREE_QFUSED, (unsigned)codec, (unsigned)a->dtype, (unsigned)a->pattern,
                              (unsigned)blocks, (unsigned)threads,
                              (unsigned)a->flags & (WF_FUSED_GEMMA | WF_FUSED_FP32_ACC | WF_FUSED_DETERMINISTIC));
  args.agree.d1 = ((uint64_t)(uint32_t)a->tokens << 32) | (uint32_t)a->hidden;
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  cfg.gridDim = dim3((unsigned)blocks);
  cfg.blockDim = dim3((unsigned)threads);
  cfg.stream = (cudaStream_t)stream;
  if (a->flags & WF_FUSED_PDL) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  return (int)cudaLaunchKernelEx(&cfg, k, args);
}
