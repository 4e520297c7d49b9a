/* fusion_ext_internal.h — what src/coll/fusion_ext.c hands to
 * kernels/fused_ext.cu. Plain C (gcc and nvcc both read it).
 *
 * Workspace of one rank (one VMM allocation, mapped into every peer; the same
 * offsets on every rank):
 *   [0]          wfx_state: epochs (one slot per block), error word
 *   [off_flags]  u64 flags[2 parity][2 phase][WF_MAX_GRID][8 sender]
 *   [off_os]     one-shot inbox [2 parity][world][os_tokens][hidden]
 *   [off_rs]     two-shot reduce-scatter inbox [2 parity][world][rows_per][hidden]
 *   [off_ag]     two-shot all-gather inbox     [2 parity][world][rows_per][hidden]
 * rows_per = ceil(max_tokens / world). Peers push (remote 16-byte stores),
 * then raise a flag (release, system scope) in the owner's flag array; a rank
 * only polls its own memory. Parity = the call's epoch mod 2: a peer is at
 * most one call ahead (its next call needs our flags of this one). */
#ifndef WEFT_FUSION_EXT_INTERNAL_H
#define WEFT_FUSION_EXT_INTERNAL_H

#include "coll/limits.h"
#include <stddef.h>
#include <stdint.h>

#include "coll/agree.h"

#define WFX_MAX_HIDDEN 16384
#define WFX_MAX_TOPK 16

typedef struct wfx_state {
  uint32_t epoch[WF_MAX_GRID];
  unsigned long long err_dev;
  wf_agree_area agree; /* the calls' agreement (peers write their slots here) */
} wfx_state;

/* error sites */
enum { WFX_SITE_PUSH = 1, WFX_SITE_GATHER = 2, WFX_SITE_AGREE = 3 /* the end of a call */ };
/* kernel variants: ONE (every rank reduces every row), TWO (token ranges) */
enum { WFX_ONESHOT = 1, WFX_TWOSHOT = 2 };

typedef struct wfx_args {
  /* MoE partial (kernels/fused_ext.cuh MoeIn) */
  const void *input, *scales;
  const int32_t *perm;
  const void *shared;
  int64_t expert_rows;
  int32_t top_k, scales_f32;
  /* norm */
  const void *residual, *weight, *weight_pre;
  void *residual_out, *norm_out, *gathered_out;
  float eps, eps_pre;
  /* workspace */
  void *peer[WF_MAX_WORLD];
  uint64_t off_flags, off_os, off_rs, off_ag;
  uint64_t os_slot, rs_slot; /* bytes of one rank's slot: os_tokens / rows_per rows */
  const uint32_t *abort_host;
  unsigned long long *err_dev, *err_host;
  uint64_t timeout_ns;
  wf_agree agree; /* area, me, world; the launch adds the call's descriptor */
  int32_t tokens, hidden, rank, world, pattern, flags, dtype, num_sms, shared_gpu;
} wfx_args;

#ifdef __cplusplus
extern "C" {
#endif
/* cudaError_t value, 0 = success */
int wfx_launch(const wfx_args *a, int algo, void *stream);
int wfx_grid(const wfx_args *a, int algo, int *blocks, int *threads);
#ifdef __cplusplus
}
#endif

#endif
