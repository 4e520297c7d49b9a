/* fusion_internal.h — what src/coll/fusion.c hands to kernels/fused_norm.cu.
 * Plain C (gcc and nvcc both read it); nothing here is exported.
 *
 * Workspace layout: every rank owns one VMM allocation of the same size,
 * mapped into every peer (src/cuda/vmm.c). Offsets are identical on all ranks:
 *
 *   [off_state]   wf_fused_state: epochs, Lamport byte counts, error word
 *                 (only the owner touches it)
 *   [off_flags]   u64 flags[2 parity][2 phase][WF_MAX_GRID][8 sender]
 *                 (two-shot; peers write, the owner polls)
 *   [off_rs]      two-shot reduce-scatter inbox: [world][rows_per_rank][hidden]
 *   [off_ag]      two-shot all-gather inbox:     [world][rows_per_rank][hidden]
 *   [off_lamport] three Lamport buffers of lamport_buf_bytes each; a call of
 *                 T tokens uses [world][T][hidden] of one buffer (own slot
 *                 unused), initialised to -0.0 of the workspace dtype. */
#ifndef WEFT_FUSION_INTERNAL_H
#define WEFT_FUSION_INTERNAL_H

#include "coll/limits.h"
#include <stddef.h>
#include <stdint.h>

#include "coll/agree.h"

#define WF_FUSED_MAX_HIDDEN 16384

/* Device-side state of one rank (at off_state of its own workspace). */
typedef struct wf_fused_state {
  uint32_t lamport_epoch[WF_MAX_GRID]; /* one-shot calls so far */
  uint32_t flag_epoch[WF_MAX_GRID];    /* two-shot calls so far */
  uint64_t lamport_bytes[3]; /* bytes per slot written at the last use of buffer i */
  unsigned long long err_dev; /* first failure (packed, kernels/common.cuh err_pack) */
  wf_agree_area agree;        /* the calls' agreement (peers write their slots here) */
} wf_fused_state;

/* Error "site" codes in the packed error word: which wait failed. */
enum { WF_FUSED_SITE_LAMPORT = 1, WF_FUSED_SITE_RS = 2, WF_FUSED_SITE_AG = 3, WF_FUSED_SITE_ROW = 4,
       WF_FUSED_SITE_AGREE = 5 /* the end of a call: a peer's announcement of it */ };

/* wf_fused_args.flags (same bits as the public WEFT_FUSION_* flags) */
enum {
  WF_FUSED_GEMMA = 1, WF_FUSED_FP32_ACC = 2, WF_FUSED_PDL = 4, WF_FUSED_TRIGGER_AT_END = 8,
  WF_FUSED_DETERMINISTIC = 16 /* the sum rounded to the dtype before the residual (needs FP32_ACC) */
};
/* wf_fused_args.pattern (== WEFT_FUSION_AR / _AR_RMSNORM / _AR_RMSNORM_FP8) */
enum { WF_FUSED_AR = 0, WF_FUSED_ARN = 1, WF_FUSED_ARN_FP8 = 2 };
/* algorithms (== WEFT_FUSION_ONESHOT / _TWOSHOT) */
enum { WF_FUSED_ONESHOT = 1, WF_FUSED_TWOSHOT = 2 };

/* One call, by value as the kernel argument (graph-replay safe: pointers and
 * constants only; epochs live in device memory). */
typedef struct wf_fused_args {
  const void *in;       /* [tokens][hidden] this rank's partial sums */
  const void *res_in;   /* [tokens][hidden] residual (ARN, ARN_FP8) */
  const void *gamma;    /* [hidden] RMSNorm weight */
  void *out;            /* AR: the sum, dtype (may be in) */
  void *res_out;        /* ARN*: in + residual, dtype (may be res_in) */
  void *norm_out;       /* ARN: required; ARN_FP8: optional */
  void *quant_out;      /* ARN_FP8: e4m3 of norm / *scale */
  const float *scale;   /* ARN_FP8: device pointer, dequantisation scale */
  void *peer[WF_MAX_WORLD]; /* each rank's workspace base, mapped here */
  uint64_t off_state, off_flags, off_rs, off_ag, off_lamport;
  uint64_t lamport_buf_bytes;
  /* wf::SpinEnv fields (kernels/common.cuh) */
  const uint32_t *abort_host;
  unsigned long long *err_dev;
  unsigned long long *err_host;
  uint64_t timeout_ns;
  wf_agree agree;       /* area, me, world; the launch adds the call's descriptor */
  float eps;
  int32_t tokens, hidden, rank, world, pattern, flags, dtype; /* dtype: WEFT_* */
  int32_t num_sms;      /* agreed (min over the group) SM count: same grid everywhere */
  int32_t cluster;      /* set by the launch: one-shot blocks per row group (1: none) */
  int32_t probe;        /* set by the launch: WF_FUSED_PROBE_* (0 outside fused_bench) */
  int32_t push_ahead;   /* set by the launch: one-shot rows pushed before the first is consumed */
  unsigned long long *trace; /* set by the launch: NULL, or fused_bench's phase clock sums */
} wf_fused_args;

/* Measurement probes (fused_bench's sweep only; wf_fused_set_probe). The
 * first two keep the results correct and restore an old behaviour for an
 * A/B; the last two leave work out, so their outputs are WRONG (timing only). */
enum {
  WF_FUSED_PROBE_OLD_SPIN = 1,   /* every waiting thread reads the host abort word from 20 us
                                    (kernels/common.cuh bounded_spin), not one per block per 100 us */
  WF_FUSED_PROBE_LATE_INPUT = 2, /* one-shot: load the input after the epoch/error check */
  WF_FUSED_PROBE_NO_REDUCE = 4,  /* one-shot norm: no sum-of-squares exchange/barrier (wrong norm) */
  WF_FUSED_PROBE_NO_NORM = 8,    /* one-shot norm: residual add and residual_out only */
  WF_FUSED_PROBE_CLUSTER_BARRIER = 16, /* one-shot, rows split over a cluster: the chunk partials by
                                         plain remote stores + barrier.cluster.arrive.release (the
                                         old exchange), not st.async on transaction barriers */
  WF_FUSED_PROBE_LATE_TRIGGER = 32,   /* one-shot: griddepcontrol.launch_dependents after the pushes
                                         (the earlier place), not at entry */
  WF_FUSED_PROBE_EARLY_CLUSTER_WAIT = 64, /* one-shot, clustered: wait for the cluster's blocks to
                                             have started before the first poll (the earlier place),
                                             not just before the first partials are sent */
  WF_FUSED_PROBE_NO_RESIDUAL_LOAD = 128,  /* one-shot norm: the residual is taken as 0 (wrong) */
  WF_FUSED_PROBE_NO_CLUSTER_SYNC = 256,   /* one-shot, with NO_NORM or NO_REDUCE only (no remote
                                             shared-memory writes): no barrier.cluster at all */
  WF_FUSED_PROBE_EARLY_MBAR_INIT = 512    /* one-shot, clustered: initialise the transaction
                                             barriers and arrive on the cluster barrier before the
                                             first pushes (the earlier place), not after them */
};
/* trace[] slots (block 0, thread 0, one-shot, first row; SM clock cycles
 * since the kernel's entry, summed over calls): */
enum {
  WF_FUSED_TR_CALLS = 0, WF_FUSED_TR_CHECKED = 1, WF_FUSED_TR_PUSHED = 2, WF_FUSED_TR_CLEARED = 3,
  WF_FUSED_TR_ARRIVED = 4, WF_FUSED_TR_REDUCED = 5, WF_FUSED_TR_STORED = 6, WF_FUSED_TR_END = 7,
  WF_FUSED_TR_SLOTS = 8
};

#ifdef __cplusplus
extern "C" {
#endif
/* kernels/fused_norm.cu. Return a cudaError_t value (0 = success); the
 * stream is a cudaStream_t. The grid is a pure function of the arguments and
 * num_sms, hence the same on every rank. */
int wf_fused_launch(const wf_fused_args *a, int algo, void *stream);
/* Fill the Lamport region with -0.0 of dtype and zero state and flags. */
int wf_fused_init(void *base, uint64_t lamport_off, uint64_t lamport_bytes,
                  uint64_t zero_bytes, int dtype, void *stream);
/* The grid the launch would use (for tests and the bench): blocks, threads
 * per block, one-shot blocks per row group (cluster; 1 for the two-shot). */
int wf_fused_grid(const wf_fused_args *a, int algo, int *blocks, int *threads, int *cluster);
/* Tuning (bench/fused_bench.cu's cluster sweep; process-wide): cluster
 * 1/2/4/8 forces the one-shot's blocks per row group (anything else:
 * automatic); min_threads (<= 0: 128) is the vectors per block the automatic
 * choice splits a long row down to. The one-shot's result does not depend on
 * its grid, even when ranks differ (no block pairing across ranks). */
void wf_fused_set_tune(int cluster, int min_threads);
/* One-shot push-ahead distance in rows (process-wide; < 1: the default, or
 * WEFT_FUSION_PUSH_AHEAD): fused_bench's sweep. */
void wf_fused_set_push_ahead(int rows);
/* Probes (process-wide, same on every rank): WF_FUSED_PROBE_* bits for every
 * later launch, and trace (device memory, WF_FUSED_TR_SLOTS zeroed u64, or
 * NULL) for the one-shot's phase clock. 0 / NULL: production behaviour. */
void wf_fused_set_probe(int probe, unsigned long long *trace);
/* kernels/quick_fused.cu: the two-shot with a quick wire codec (codec
 * WF_QR_INT8, _INT4 or _FP8 of src/coll/quick_codec.h; pattern ARN only,
 * bf16/f16, worlds 2, 4, 6, 8). Same workspace, flags and epochs as the
 * exact two-shot. row_bytes: one encoded row (<= hidden * 2). */
int wf_qr_fused_launch(const wf_fused_args *a, int codec, void *stream);
int wf_qr_fused_grid(const wf_fused_args *a, int codec, int *blocks, int *threads);
uint64_t wf_qr_fused_row_bytes(int codec, int hidden);
/* src/coll/fusion.c: the kernel and grid a call would use (no launch). */
struct weft_fusion;
struct weft_fusion_params;
int wf_fusion_geometry(struct weft_fusion *f, const struct weft_fusion_params *p, int *algo,
                       int *blocks, int *threads, int *cluster);
#ifdef __cplusplus
}
#endif

#endif
