// ar_link.inc.cu — part of bench/ar_bench.cu (included there): `--link`
// measures what the NVLink between two ranks actually delivers, with the
// same VMM mapping the all-reduce uses (weft_vmm), so the all-reduce's bus
// bandwidth can be compared with a ceiling instead of the 478 GB/s nominal.
//
// Ranks pair up (r, r^1). Each test: a host barrier, then a device-side
// handshake kernel (both ranks leave it within a link latency of each
// other), an event, the operation, an event. GB/s = bytes / time, per
// direction; "bidir": both ranks send at once (what an all-reduce does),
// "uni": rank 0 of the pair only.
//   sm-push    a copy kernel reads local memory and stores 16-byte vectors
//              into the peer's allocation (the all-reduce's store pattern)
//   sm-pull    the same kernel loading from the peer, storing locally
//   ce-push    cudaMemcpyAsync (copy engine) local -> peer
//   ce-pull    cudaMemcpyAsync peer -> local
//   local      the copy kernel and the copy engine within one GPU (HBM)
//   ce+sm k=K  a prototype of a copy-engine one-shot: the CE pushes the
//              input to the peer in K chunks, each followed by a flag (a
//              4-byte CE copy, or a stream write-value memop); a kernel
//              waits for each chunk's flag and reduces it (in + received ->
//              out, bf16). Results are checked (inputs change every
//              iteration, so stale data would show).

#include <cuda.h>

namespace lk {

__device__ __forceinline__ uint32_t ld_acq(const uint32_t *p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_rel(uint32_t *p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Bounded wait (about 2 s of clocks): sets *err and returns false on timeout.
__device__ bool wait_eq(const uint32_t *p, uint32_t v, int *err) {
  const long long t0 = clock64();
  while (ld_acq(p) != v) {
    if (clock64() - t0 > 4000000000ll) { atomicExch(err, 1); return false; }
  }
  return true;
}

__global__ void handshake(uint32_t *peer_flag, const uint32_t *my_flag, uint32_t v, int *err) {
  if (threadIdx.x == 0) {
    st_rel(peer_flag, v);
    wait_eq(my_flag, v, err);
  }
}

template <int UNR>
__global__ void __launch_bounds__(1024) copy_k(uint4 *dst, const uint4 *src, size_t n) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  for (; i + (UNR - 1) * stride < n; i += UNR * stride) {
    uint4 v[UNR];
#pragma unroll
    for (int u = 0; u < UNR; u++) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < UNR; u++) dst[i + u * stride] = v[u];
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

// The flag one-shot's push pattern without its reduction: rounds of cv
// vectors per block (chunk b, b + G, ...), each followed by __syncthreads and
// a system-scope release flag into the peer (never waited for). Against
// copy_k it prices the per-round fences.
__global__ void __launch_bounds__(512) push_rounds(uint4 *dst, const uint4 *src, size_t n, size_t cv,
                                                   uint32_t *peer_flags, uint32_t v) {
  const size_t nchunks = (n + cv - 1) / cv;
  for (size_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
    const size_t hi = (c + 1) * cv < n ? (c + 1) * cv : n;
    size_t i = c * cv + threadIdx.x;
    for (; i + blockDim.x < hi; i += 2 * blockDim.x) {
      const uint4 a = src[i], b = src[i + blockDim.x];
      dst[i] = a;
      dst[i + blockDim.x] = b;
    }
    if (i < hi) dst[i] = src[i];
    __syncthreads();
    if (threadIdx.x == 0) st_rel(&peer_flags[blockIdx.x], v);
  }
}

__device__ __forceinline__ uint4 add_bf16x8(uint4 a, uint4 b) {
  uint32_t *pa = reinterpret_cast<uint32_t *>(&a), *pb = reinterpret_cast<uint32_t *>(&b);
  uint4 r;
  uint32_t *pr = reinterpret_cast<uint32_t *>(&r);
#pragma unroll
  for (int k = 0; k < 4; k++) {
    __nv_bfloat162 x = *reinterpret_cast<__nv_bfloat162 *>(&pa[k]), y = *reinterpret_cast<__nv_bfloat162 *>(&pb[k]);
    float2 fx = __bfloat1622float2(x), fy = __bfloat1622float2(y);
    __nv_bfloat162 z = __floats2bfloat162_rn(fx.x + fy.x, fx.y + fy.y);
    pr[k] = *reinterpret_cast<uint32_t *>(&z);
  }
  return r;
}

// Chunk k of [0, n) vectors: wait for its flag, then out = in + received.
__global__ void __launch_bounds__(512) ce_reduce(const uint4 *in, const uint4 *recv, uint4 *out, size_t n, int K,
                                                 const uint32_t *flags, uint32_t v, int *err) {
  const size_t per = (n + K - 1) / K, stride = (size_t)gridDim.x * blockDim.x;
  for (int k = 0; k < K; k++) {
    __shared__ int ok;
    if (threadIdx.x == 0) ok = wait_eq(&flags[k], v, err);
    __syncthreads();
    if (!ok) return;
    const size_t lo = k * per, hi = lo + per < n ? lo + per : n;
    for (size_t i = lo + blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < hi; i += stride)
      out[i] = add_bf16x8(in[i], __ldcg(&recv[i]));
    __syncthreads();
  }
}

__global__ void fill_bf16(__nv_bfloat16 *p, size_t n, float v) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    p[i] = __float2bfloat16_rn(v);
}
__global__ void count_ne_bf16(const __nv_bfloat16 *p, size_t n, float v, unsigned long long *bad) {
  unsigned long long c = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    c += __bfloat162float(p[i]) != v;
  if (c) atomicAdd(bad, c);
}

}  // namespace lk

typedef CUresult (*WriteValue32Fn)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

struct Link {
  weft_vmm *vmm = nullptr;
  char *mine = nullptr, *peer = nullptr;  // this rank's allocation; the peer's, as mapped here
  DBuf src, dst, out;
  int partner = -1, sms = 132;
  uint32_t tag = 0;  // same sequence on both ranks
  int *d_err = nullptr;
  unsigned long long *d_bad = nullptr;
  uint32_t *d_tags = nullptr;  // d_tags[i] == i: sources for CE flag copies
  cudaStream_t ce = nullptr;
  WriteValue32Fn wv32 = nullptr;
  static const size_t kFlags = 1u << 20;  // flag area at the start of each allocation
  uint32_t *flag_mine(int i) { return reinterpret_cast<uint32_t *>(mine) + i; }
  uint32_t *flag_peer(int i) { return reinterpret_cast<uint32_t *>(peer) + i; }
};
static Link L;
static const int kTags = 1 << 16;

// One timed test. op(s) enqueues the measured work on stream s of this rank
// (run only by the ranks that send). Returns the slower rank's median us,
// or -1 on a timeout.
template <typename Op, typename Prep>
static double link_time(bool both, Op op, Prep prep, int reps) {
  std::vector<double> t;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  bool sender = both || (g_rank & 1) == 0;
  int failed = 0;
  for (int it = 0; it < reps + 2; it++) {
    const uint32_t v = ++L.tag;
    if (L.tag >= kTags - 64) L.tag = 0;
    prep(v);
    CK(cudaStreamSynchronize(g_s));
    CK(cudaStreamSynchronize(L.ce));
    barrier();
    lk::handshake<<<1, 32, 0, g_s>>>(L.flag_peer(0), L.flag_mine(0), v, L.d_err);
    CK(cudaEventRecord(e0, g_s));
    if (sender) op(g_s, v);
    CK(cudaEventRecord(e1, g_s));
    CK(cudaEventSynchronize(e1));
    CK(cudaStreamSynchronize(L.ce));
    int err = 0;
    CK(cudaMemcpy(&err, L.d_err, sizeof err, cudaMemcpyDeviceToHost));
    if (err) { failed = 1; CK(cudaMemset(L.d_err, 0, sizeof(int))); }
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (it >= 2) t.push_back(ms * 1e3);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  if (allreduce_i64(failed, WEFT_MAX)) return -1;
  const double mine = sender ? median(t) : 0.0;
  return allreduce_i64((int64_t)(mine * 1e3), WEFT_MAX) / 1e3;
}

static void link_rec(const std::string &name, size_t bytes, double us, const char *note = "") {
  const double gbs = us > 0 ? bytes / us / 1e3 : 0;
  if (us > 0) g_recs.push_back(Rec{"link", name, "eager", bytes, us, gbs});
  if (g_rank == 0)
    printf("  %-40s %8s %10.2f us %7.1f GB/s%s%s\n", name.c_str(), fmt_bytes(bytes).c_str(), us, gbs,
           us < 0 ? "  TIMEOUT" : "", note);
  fflush(stdout);
}

static void link_copy(const char *kind, bool both, size_t bytes, int blocks, int threads) {
  const size_t n = bytes / 16;
  uint4 *dst, *src;
  if (!strcmp(kind, "sm-push")) { dst = (uint4 *)(L.peer + Link::kFlags); src = (uint4 *)L.src.p; }
  else if (!strcmp(kind, "sm-pull")) { dst = (uint4 *)L.dst.p; src = (uint4 *)(L.peer + Link::kFlags); }
  else { dst = (uint4 *)L.dst.p; src = (uint4 *)L.src.p; }  // local
  auto op = [&](cudaStream_t s, uint32_t) {
    lk::copy_k<4><<<blocks, threads, 0, s>>>(dst, src, n);
    CK(cudaGetLastError());
  };
  const double us = link_time(both, op, [](uint32_t) {}, 8);
  char name[96];
  snprintf(name, sizeof name, "%s-%s g%dx%d", kind, both ? "bidir" : "uni", blocks, threads);
  link_rec(name, bytes, us);
}

static void link_push_rounds(size_t bytes, int blocks, size_t round_bytes) {
  const size_t n = bytes / 16;
  uint4 *dst = (uint4 *)(L.peer + Link::kFlags), *src = (uint4 *)L.src.p;
  auto op = [&](cudaStream_t s, uint32_t v) {
    lk::push_rounds<<<blocks, 512, 0, s>>>(dst, src, n, round_bytes / 16, L.flag_peer(4096), v);
    CK(cudaGetLastError());
  };
  const double us = link_time(true, op, [](uint32_t) {}, 8);
  char name[96];
  snprintf(name, sizeof name, "sm-push+fence/%zuKiB-bidir g%dx512", round_bytes >> 10, blocks);
  link_rec(name, bytes, us);
}

static void link_ce(const char *kind, bool both, size_t bytes) {
  void *dst, *src;
  if (!strcmp(kind, "ce-push")) { dst = L.peer + Link::kFlags; src = L.src.p; }
  else if (!strcmp(kind, "ce-pull")) { dst = L.dst.p; src = L.peer + Link::kFlags; }
  else { dst = L.dst.p; src = L.src.p; }
  auto op = [&](cudaStream_t s, uint32_t) { CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s)); };
  const double us = link_time(both, op, [](uint32_t) {}, 8);
  char name[96];
  snprintf(name, sizeof name, "%s-%s", kind, both ? "bidir" : "uni");
  link_rec(name, bytes, us);
}

// The copy-engine one-shot prototype (both ranks): CE pushes my input in K
// chunks into the peer's allocation, each chunk followed by its flag; my
// kernel reduces chunk k once the peer's flag k arrived.
static void link_ce_reduce(size_t bytes, int K, bool memop) {
  if (memop && !L.wv32) { link_rec("ce+sm memop: cuStreamWriteValue32 unavailable", bytes, -1); return; }
  const size_t n = bytes / 16;
  const size_t per = (n + K - 1) / K;
  cudaEvent_t go, done;
  CK(cudaEventCreateWithFlags(&go, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  float expect = 0;
  bool memop_failed = false;
  auto prep = [&](uint32_t v) {
    // inputs change every iteration: rank r holds (v % 8) * 4 + r + 1
    const float mine = (float)((v % 8) * 4 + g_rank + 1), other = (float)((v % 8) * 4 + L.partner + 1);
    expect = mine + other;
    lk::fill_bf16<<<1024, 256, 0, g_s>>>((__nv_bfloat16 *)L.src.p, bytes / 2, mine);
    CK(cudaMemsetAsync(L.out.p, 0, bytes, g_s));
  };
  auto op = [&](cudaStream_t s, uint32_t v) {
    CK(cudaEventRecord(go, s));
    CK(cudaStreamWaitEvent(L.ce, go, 0));
    for (int k = 0; k < K; k++) {
      const size_t lo = k * per, cnt = std::min(n, lo + per) - std::min(n, lo);
      if (cnt) CK(cudaMemcpyAsync(L.peer + Link::kFlags + lo * 16, (char *)L.src.p + lo * 16, cnt * 16,
                                  cudaMemcpyDeviceToDevice, L.ce));
      if (memop) {
        CUresult r = L.wv32((CUstream)L.ce, (CUdeviceptr)L.flag_peer(64 + k), v, 0);
        if (r != CUDA_SUCCESS) {  // fall back so the peer does not time out
          memop_failed = true;
          CK(cudaMemcpyAsync(L.flag_peer(64 + k), L.d_tags + v, 4, cudaMemcpyDeviceToDevice, L.ce));
        }
      } else {
        CK(cudaMemcpyAsync(L.flag_peer(64 + k), L.d_tags + v, 4, cudaMemcpyDeviceToDevice, L.ce));
      }
    }
    CK(cudaEventRecord(done, L.ce));
    lk::ce_reduce<<<2 * L.sms, 512, 0, s>>>((const uint4 *)L.src.p, (const uint4 *)(L.mine + Link::kFlags),
                                            (uint4 *)L.out.p, n, K, L.flag_mine(64), v, L.d_err);
    CK(cudaGetLastError());
    CK(cudaStreamWaitEvent(s, done, 0));
  };
  const double us = link_time(true, op, prep, 8);
  // check the last iteration's output
  CK(cudaMemsetAsync(L.d_bad, 0, sizeof *L.d_bad, g_s));
  lk::count_ne_bf16<<<264, 512, 0, g_s>>>((const __nv_bfloat16 *)L.out.p, bytes / 2, expect, L.d_bad);
  unsigned long long bad = 0;
  CK(cudaMemcpyAsync(&bad, L.d_bad, sizeof bad, cudaMemcpyDeviceToHost, g_s));
  CK(cudaStreamSynchronize(g_s));
  bad = (unsigned long long)allreduce_i64((int64_t)bad, WEFT_SUM);
  CK(cudaEventDestroy(go));
  CK(cudaEventDestroy(done));
  char name[96];
  snprintf(name, sizeof name, "ce+sm-reduce k=%d %s-flag", K, memop ? "memop" : "ce");
  char note[96] = "";
  if (us > 0 && bad) snprintf(note, sizeof note, "  WRONG: %llu elements", bad);
  if (memop_failed) snprintf(note + strlen(note), sizeof note - strlen(note), " (memop refused: CE flags)");
  link_rec(name, bytes, us, note);
  if (us > 0 && bad) g_fail++;
}

static void link_bench(size_t max_bytes) {
  if (g_world % 2) { LOG("link: needs an even world size"); return; }
  const double t0 = now_s();
  const size_t big = std::min<size_t>(max_bytes, 256u << 20);
  L.partner = g_rank ^ 1;
  int dev = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&L.sms, cudaDevAttrMultiProcessorCount, dev));
  WK(weft_vmm_create(g_grp, big + Link::kFlags, 0, &L.vmm));
  void *p;
  WK(weft_vmm_ptr(L.vmm, g_rank, &p));
  L.mine = (char *)p;
  WK(weft_vmm_ptr(L.vmm, L.partner, &p));
  L.peer = (char *)p;
  CK(cudaMemset(L.mine, 0, Link::kFlags));
  L.src.alloc(big);
  L.dst.alloc(big);
  L.out.alloc(big);
  CK(cudaMemset(L.src.p, 0x3c, big));
  CK(cudaMalloc(&L.d_err, sizeof(int)));
  CK(cudaMemset(L.d_err, 0, sizeof(int)));
  CK(cudaMalloc(&L.d_bad, sizeof *L.d_bad));
  CK(cudaMalloc(&L.d_tags, kTags * sizeof(uint32_t)));
  {
    std::vector<uint32_t> tg(kTags);
    for (int i = 0; i < kTags; i++) tg[i] = (uint32_t)i;
    CK(cudaMemcpy(L.d_tags, tg.data(), kTags * sizeof(uint32_t), cudaMemcpyHostToDevice));
  }
  CK(cudaStreamCreateWithFlags(&L.ce, cudaStreamNonBlocking));
  {
    void *fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &fn, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      L.wv32 = (WriteValue32Fn)fn;
    cudaGetLastError();
  }
  CK(cudaDeviceSynchronize());
  barrier();  // everyone zeroed their flags before anyone writes
  const int S = L.sms;
  if (g_rank == 0) printf("\nlink: ranks %d<->%d, per direction (bytes / time)\n", 0, 1);
  // ceiling versus size: the all-reduce's store pattern and the copy engine
  for (size_t b = 1u << 20; b <= big; b *= 4) {
    link_copy("sm-push", true, b, 2 * S, 512);
    link_ce("ce-push", true, b);
  }
  // at the sizes of the 360 GB/s target: shapes, directions, pull, local
  std::vector<size_t> at;
  if (big >= (64u << 20)) at.push_back(64u << 20);
  if (big != (64u << 20)) at.push_back(big);
  for (size_t b : at) {
    for (int m : {1, 4}) link_copy("sm-push", true, b, m * S, 512);
    link_copy("sm-push", true, b, S, 1024);
    link_copy("sm-push", true, b, 2 * S, 1024);
    link_copy("sm-push", false, b, 2 * S, 512);
    for (size_t rb : {(size_t)16 << 10, (size_t)64 << 10}) link_push_rounds(b, 2 * S, rb);
    link_ce("ce-push", false, b);
    link_copy("sm-pull", true, b, 2 * S, 512);
    link_copy("sm-pull", true, b, 4 * S, 512);
    link_ce("ce-pull", true, b);
    link_copy("local", true, b, 2 * S, 512);
    link_ce("local-ce", true, b);
    for (int K : {1, 4, 8, 16}) link_ce_reduce(b, K, false);
  }
  // last: a stream memop on a peer address is the one call here that might
  // be refused (it falls back to CE flags then)
  for (size_t b : at)
    for (int K : {4, 8, 16}) link_ce_reduce(b, K, true);
  CK(cudaDeviceSynchronize());
  barrier();  // no peer still writes into the allocation
  WK(weft_vmm_destroy(L.vmm));
  CK(cudaFree(L.d_err));
  CK(cudaFree(L.d_bad));
  CK(cudaFree(L.d_tags));
  CK(cudaStreamDestroy(L.ce));
  for (DBuf *d : {&L.src, &L.dst, &L.out}) {
    CK(cudaFree(d->p));
    d->p = nullptr;
    d->bytes = 0;
  }
  if (g_rank != 0) return;
  // the comparison the issue asks for: all-reduce bus bandwidth vs the link
  printf("\nall-reduce vs link (GB/s per direction; for 2 ranks bus bw = bytes moved per direction / time):\n");
  for (size_t b = 64u << 20; b <= big; b *= 2) {
    double best_ar = 0, sm = 0, ce = 0;
    std::string best_name = "-";
    for (auto &r : g_recs) {
      if (r.bytes != b || r.mode != "graph" || r.op != "all_reduce" || r.backend == "nccl") continue;
      if (r.busbw > best_ar) { best_ar = r.busbw; best_name = r.backend; }
    }
    for (auto &r : g_recs) {
      if (r.bytes != b || r.op != "link") continue;
      if (r.backend.compare(0, 13, "sm-push-bidir") == 0) sm = std::max(sm, r.busbw);
      if (r.backend == "ce-push-bidir") ce = std::max(ce, r.busbw);
    }
    const Rec *nc = find_rec("all_reduce", "nccl", "graph", b);
    printf("  %-8s best weft %6.1f (%s) | nccl %6.1f | sm-push bidir %6.1f | ce-push bidir %6.1f | weft/sm %5.1f%% weft/ce %5.1f%%\n",
           fmt_bytes(b).c_str(), best_ar, best_name.c_str(), nc ? nc->busbw : 0.0, sm, ce,
           sm > 0 ? 100 * best_ar / sm : 0.0, ce > 0 ? 100 * best_ar / ce : 0.0);
  }
  printf("link took %.1f s\n", now_s() - t0);
}

static void link_markdown(FILE *m) {
  bool any = false;
  for (auto &r : g_recs) any |= r.op == "link";
  if (!any) return;
  fprintf(m, "\n### link: what NVLink delivers between the two GPUs (eager, GB/s per direction)\n\n");
  fprintf(m, "| test | bytes | us | GB/s |\n|---|---|---|---|\n");
  for (auto &r : g_recs)
    if (r.op == "link") fprintf(m, "| %s | %s | %.2f | %.1f |\n", r.backend.c_str(), fmt_bytes(r.bytes).c_str(), r.us, r.busbw);
}
