/* ar_internal.h — what src/coll/allreduce.c and kernels/allreduce.cu share: the
 * launch arguments, the workspace layout constants and the per-call sizes.
 * Plain C (no CUDA types) so the host-only build compiles it too. */
#ifndef WEFT_AR_INTERNAL_H
#define WEFT_AR_INTERNAL_H

#include "coll/limits.h"
#include <stdint.h>

#include "coll/agree.h"

#define WF_AR_LAMPORT_THREADS 256 /* most threads per Lamport block (launch bound) */
#define WF_AR_FLAG_THREADS 512
#define WF_AR_FLAG_UNROLL 2       /* 16-byte vectors per thread per round (x sub) */
/* two-shot: 1 for world > 4 keeps the kernel under the register cap */
#define WF_AR_TWOSHOT_UNROLL(world) ((world) > 4 ? 1 : 2)

/* Kernel kinds (what the host resolved the algorithm to). */
enum { WF_AR_LAMPORT = 1, WF_AR_TWOSHOT = 2, WF_AR_ONESHOT_FLAG = 3,
       /* the quick (compressed two-shot) all-reduce, kernels/quick_allreduce.cu:
        * kind - WF_AR_QUICK_FP is the codec of src/coll/quick_codec.h */
       WF_AR_QUICK_FP = 4, WF_AR_QUICK_INT8 = 5, WF_AR_QUICK_INT4 = 6, WF_AR_QUICK_FP8 = 7 };

/* Wait sites named in error messages (kernels report them). */
enum { WF_AR_SITE_LAMPORT = 1, WF_AR_SITE_ONESHOT = 2, WF_AR_SITE_RS = 3, WF_AR_SITE_AG = 4,
       WF_AR_SITE_PUSHER = 5, /* split one-shot: a reducer waits for its own GPU's pusher */
       WF_AR_SITE_QRS = 6, WF_AR_SITE_QAG = 7, /* quick all-reduce: reduce-scatter, all-gather */
       WF_AR_SITE_AGREE = 8 /* the end of a call: a peer's announcement of it */ };

/* Workspace layout (same offsets on every rank):
 *   epochs[WF_MAX_GRID] u32 | lbytes[3] u64 | err u64 | agreement area |
 *   flags u64 [2 parity][2 phase][WF_MAX_GRID][WF_MAX_WORLD] |
 *   lamport [3 buffers][world-1 slots][lamport_slot bytes]  (sentinel-filled) |
 *   data [2 parity][data_par bytes]  */
#define WF_AR_OFF_EPOCHS 0u
#define WF_AR_OFF_LBYTES 4096u
#define WF_AR_OFF_ERR (4096u + 64u)
#define WF_AR_OFF_AGREE (4096u + 512u) /* wf_agree_area (src/coll/agree.h), 512 bytes */
#define WF_AR_OFF_FLAGS 8192u
#define WF_AR_FLAGS_BYTES (2u * 2u * WF_MAX_GRID * WF_MAX_WORLD * 8u)

typedef struct wf_ar_args {
  const void *in;
  void *out;
  uint64_t count;               /* elements */
  int dtype, kind, rank, world;
  char *ws[WF_MAX_WORLD];    /* this process's view of every rank's workspace */
  uint64_t off_lamport, lamport_slot, off_data, data_par;
  const uint32_t *abort_host;   /* device pointer of a host-mapped word */
  unsigned long long *err_host; /* device pointer of a host-mapped word */
  uint64_t timeout_ns;
  int sms, blocks_per_sm;       /* agreed by all ranks at create */
  int pdl;                      /* launch with programmatic dependent launch */
  /* launch shape (weft_ar_set_param; 0 = automatic, by size). Every rank
   * must use the same values: the flag protocol needs the same grid. */
  int grid;                     /* blocks (capped to what is co-resident) */
  int threads;                  /* Lamport: <= 256; flag one-shot: <= 512 (multiples of 32) */
  int sub;                      /* flag one-shot: round = threads x 2 x sub vectors */
  int split;                    /* flag one-shot: 1 = separate pusher and reducer blocks */
  int determ;                   /* WEFT_AR_DETERMINISTIC: the flag kernels sanitise their inputs
                                   as the Lamport one-shot does (same sums on every path) */
  wf_agree agree;               /* area, me, world; the launch adds the call's descriptor */
} wf_ar_args;

static inline uint64_t wf_ar_nvec(uint64_t count, int esize) {
  return (count * (uint64_t)esize + 15u) / 16u;
}
/* Bytes of one data parity region that a call of this kind needs. */
static inline uint64_t wf_ar_data_need(int kind, uint64_t nvec, int world) {
  if (kind == WF_AR_ONESHOT_FLAG) return (uint64_t)(world - 1) * nvec * 16u;
  if (kind == WF_AR_TWOSHOT) { /* two-shot always runs WF_AR_FLAG_THREADS threads */
    uint64_t pv = (uint64_t)WF_AR_FLAG_THREADS * WF_AR_TWOSHOT_UNROLL(world), chunks = (nvec + pv * world - 1) / (pv * world);
    return 2u * (uint64_t)(world - 1) * chunks * pv * 16u;
  }
  return 0;
}

/* kernels/allreduce.cu. Both return a cudaError_t value (0 = success). */
int wf_ar_launch(const wf_ar_args *a, void *stream);
/* The grid and block size wf_ar_launch would use for a (launches nothing). */
int wf_ar_shape(const wf_ar_args *a, int *grid, int *threads);
/* kernels/quick_allreduce.cu: the quick all-reduce (a->kind WF_AR_QUICK_*,
 * bf16/f16), its launch shape, and its codec steps alone on one GPU
 * (weft_qr_codec_step). cudaError_t values. */
int wf_qr_launch(const wf_ar_args *a, void *stream);
int wf_qr_shape(const wf_ar_args *a, int *grid, int *threads);
int wf_qr_step(int step, int codec, int dtype, int world, const void *in, void *wire, void *out,
               uint64_t count, void *stream);
/* Fill bytes (multiple of 16) at p with the Lamport sentinel. */
int wf_ar_fill_empty(void *p, uint64_t bytes, void *stream);

#endif
