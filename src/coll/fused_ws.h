/* fused_ws.h — the workspace every family of fused kernels shares: one per
 * group, sized for the largest call every rank declared (agreed at create:
 * max tokens, hidden, element size, the one-shot capacity and the AUTO
 * one-shot limit, the smallest SM count), its capacity, the one-shot /
 * two-shot choice, and the lifecycle over devcoll.h (create's sequence,
 * destroy, preflight, check_error, abort). A family (src/coll/fusion.c:
 * all-reduce + residual + RMSNorm; src/coll/fusion_ext.c: the other
 * patterns) supplies its options check, its layout's size, its workspace
 * init and its launch arguments (wf_fws_family), and keeps its struct with a
 * wf_fws as first member. Internal: nothing here is exported. */
#ifndef WEFT_FUSED_WS_H
#define WEFT_FUSED_WS_H

#include "coll/devcoll.h"
#include "weft.h"

#include <stddef.h>
#include <stdint.h>

#define WF_FWS_KIB ((int64_t)1024)
#define WF_FWS_MIB (WF_FWS_KIB * WF_FWS_KIB)
#define WF_FWS_NO_LIMIT INT64_MAX /* an AUTO one-shot limit of "whenever it fits" */

static inline int64_t wf_fws_align(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

/* [p, p+n) overlaps [q, q+m) (NULL never overlaps) */
static inline int wf_fws_overlaps(const void *p, size_t n, const void *q, size_t m) {
  const uintptr_t a = (uintptr_t)p, b = (uintptr_t)q;
  return p && q && a < b + m && b < a + n;
}

/* The tokens the one-shot buffers hold: opts' oneshot_max_tokens (< 0:
 * none, 0 or above max_tokens: max_tokens). */
/* The flag rows of both families' workspaces: u64 [2 parity][2 phase][WF_MAX_GRID blocks][8 senders] */
#define WF_FWS_FLAG_BYTES ((int64_t)2 * 2 * WF_MAX_GRID * 8 * 8)
/* A row's bytes, and the rows of one rank's share of max_tokens (rounded up). */
static inline int64_t wf_fws_row_bytes(const weft_fusion_opts *o) { return o->hidden * wf_dev_esize(o->dtype); }
static inline int64_t wf_fws_rows_per(const weft_fusion_opts *o, int world) {
  return (o->max_tokens + world - 1) / world;
}
int64_t wf_fws_os_tokens(const weft_fusion_opts *o);
/* The options' NULL, world, hidden (a multiple of 8 up to max_hidden) and
 * max_tokens; each family checks its dtypes after. */
int wf_fws_check_size(const weft_fusion_opts *o, int world, int64_t max_hidden, const char *op);

typedef struct wf_fws wf_fws;

typedef struct wf_fws_family {
  const char *what;                       /* "fusion": "fusion create", "fusion run (group ...)" */
  const char *oneshot_env;                /* the variable overriding the AUTO one-shot limit */
  int64_t (*default_oneshot_max)(int world); /* that limit in bytes (WF_FWS_NO_LIMIT: none) */
  int (*check_opts)(const weft_fusion_opts *o, int world, const char *op);
  int64_t (*workspace_bytes)(const weft_fusion_opts *o, int world); /* the layout's total */
#if WEFT_HAVE_CUDA
  const wf_dev_names *names;               /* the words of its error reports */
  /* this rank's workspace init, enqueued on s (a cudaError_t), and where
   * its agreement area lies in every workspace */
  int (*clear)(wf_fws *w, cudaStream_t s);
  uint64_t agree_offset;
  /* the launch arguments every call starts from (peers, offsets, host
   * words, agreement): called once the workspace is ready */
  void (*bind)(wf_fws *w);
#endif
} wf_fws_family;

struct wf_fws {
  const wf_fws_family *fam;
  weft_fusion_opts opts;          /* as agreed (dtype: the widest element any rank asked) */
  int64_t os_tokens;              /* one-shot capacity */
  int64_t oneshot_max_bytes;      /* AUTO takes the one-shot up to this many bytes */
  size_t ws_bytes;
  int num_sms;                    /* the smallest of the group's */
  int me, world;                  /* this rank's index in the group, the group's size */
#if WEFT_HAVE_CUDA
  wf_dev dc;                       /* group, workspace, host words, in-flight state */
#endif
};

/* workspace_bytes and preflight of a family (same words, any build) */
int wf_fws_workspace_bytes(const wf_fws_family *fam, const weft_fusion_opts *opts, int world, size_t *bytes);
int wf_fws_preflight(const wf_fws_family *fam, const weft_fusion_opts *opts, int world, int *ok);
/* create (collective): a zeroed object of `size` bytes (>= sizeof(wf_fws),
 * the family's struct) with its workspace ready on every rank; *out NULL on
 * failure. Without CUDA: the options' check, then the no-device error. */
int wf_fws_create(const wf_fws_family *fam, weft_cpugroup *g, const weft_fusion_opts *opts, size_t size,
                  wf_fws **out);
/* destroy: local, bounded (waits for this rank's own last call); NULL is fine */
void wf_fws_destroy(wf_fws *w);
/* Whether (tokens, hidden, dtype) fits the workspace for algo (ONESHOT /
 * TWOSHOT; AUTO: the two-shot's capacity). */
int wf_fws_fits(const wf_fws *w, int64_t tokens, int64_t hidden, int dtype, int algo);
/* The kernel of a call of `bytes` asked as `asked` (AUTO, ONESHOT,
 * TWOSHOT) that fits the workspace's hidden and tokens: *algo and why. */
int wf_fws_choose(const wf_fws *w, int asked, int64_t tokens, int64_t hidden, int dtype, int64_t bytes,
                  const char *op, int *algo, const char **why);
/* check_error / abort of a handle (NULL: an argument error naming fam) */
int wf_fws_check_error(wf_fws *w, const char *verb);
int wf_fws_abort(wf_fws *w, const char *verb);

/* A family's handle: the workspace first (fused_ws.c allocates the whole
 * handle as one), then the launch arguments without the call's part. */
#if WEFT_HAVE_CUDA
#define WF_FWS_HANDLE_STRUCT(TYPE, ARGS) struct TYPE { wf_fws ws; ARGS base; }
#else
#define WF_FWS_HANDLE_STRUCT(TYPE, ARGS) struct TYPE { wf_fws ws; }
#endif

/* The handle functions every family exports alike, written once:
 * PREFIX_workspace_bytes, _preflight, _create, _destroy, _check_error and
 * _abort of TYPE (a struct whose first member is the wf_fws `ws`) over
 * FAMILY; WHAT names the family in argument errors ("fusion abort"). */
#define WF_FWS_HANDLE_API(PREFIX, TYPE, FAMILY, WHAT)                                            \
  int PREFIX##_workspace_bytes(const weft_fusion_opts *opts, int world, size_t *bytes) {       \
    return wf_fws_workspace_bytes(&FAMILY, opts, world, bytes);                                \
  }                                                                                            \
  int PREFIX##_preflight(const weft_fusion_opts *opts, int world, int *ok) {                   \
    return wf_fws_preflight(&FAMILY, opts, world, ok);                                         \
  }                                                                                            \
  int PREFIX##_create(weft_cpugroup *g, const weft_fusion_opts *opts, TYPE **out) {            \
    wf_fws *w = NULL;                                                                          \
    const int rc = wf_fws_create(&FAMILY, g, opts, sizeof(TYPE), &w);                          \
    if (out) *out = (TYPE *)w;                                                                 \
    return rc;                                                                                 \
  }                                                                                            \
  int PREFIX##_destroy(TYPE *f) {                                                              \
    wf_fws_destroy(f ? &f->ws : NULL);                                                         \
    return 0;                                                                                  \
  }                                                                                            \
  int PREFIX##_check_error(TYPE *f) { return wf_fws_check_error(f ? &f->ws : NULL, WHAT " check_error"); } \
  int PREFIX##_abort(TYPE *f) { return wf_fws_abort(f ? &f->ws : NULL, WHAT " abort"); }

#endif
