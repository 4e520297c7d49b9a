/* devcoll.h — the host plumbing weft's own device collectives share
 * (src/coll/allreduce.c: the all-reduce; src/coll/fusion.c: the fused all-reduce +
 * RMSNorm): a handle's group facts and workspace (one VMM allocation per
 * rank), the host-mapped abort/error words its kernels watch, the votes at
 * create (SM count, workspace ready), one operation in flight per handle,
 * the bounded wait at destroy, and the report of a kernel's packed error
 * word (kernels/common.cuh err_pack). Internal: nothing here is exported.
 *
 * Messages name the handle as "<what> (group 'G', rank R ...)"; the
 * wf_dev_names table of each kind supplies the words that differ. */
#ifndef WEFT_DEVCOLL_H
#define WEFT_DEVCOLL_H

#include "coll/limits.h"
#include "host/cpugroup.h"
#include "cuda/cuda_internal.h"
#include "coll/agree.h"

#include <stddef.h>
#include <stdint.h>


/* Bytes per element of the reduction dtypes (f32, f16, bf16); 0 otherwise. */
static inline int wf_dev_esize(int dtype) {
  switch (dtype) {
    case WEFT_F32: return 4;
    case WEFT_F16: case WEFT_BF16: return 2;
    default: return 0;
  }
}
/* Short name of a WEFT_* dtype ("unknown" otherwise), for messages. */
const char *wf_dev_dtype_name(int dtype);
/* The error of an entry point in a build without CUDA. */
int wf_dev_nodev(const char *op);

/* What create needs of the cpu group, and op = "<verb> (group 'G', rank R of
 * N)" for its messages. */
typedef struct wf_dev_group {
  const char *name;
  const int *ranks;   /* global ranks */
  int n, me;
  int timeout_ms;     /* the group's */
  char op[160];
} wf_dev_group;
int wf_dev_group_info(weft_cpugroup *g, const char *verb, wf_dev_group *gi);

#if WEFT_HAVE_CUDA

/* Host-mapped words (cudaHostAllocMapped): the host raises abort, the
 * kernels mirror their first failure into err. */
typedef struct wf_dev_host {
  volatile uint32_t abort;
  uint32_t pad;
  volatile unsigned long long err;
  volatile uint64_t desc[4]; /* a mismatch: this rank's call (d0, d1), then the peer's */
} wf_dev_host;

/* The words that differ between the kinds' messages (one static table each). */
typedef struct wf_dev_names {
  const char *what;         /* "allreduce": "<what> (group ...): aborted" */
  const char *unit;         /* "handle": "<unit> unusable", "one operation in flight per <unit>" */
  const char *refuse_hint;  /* what to do, after "this <unit> failed earlier (why); " */
  const char *timeout_hint; /* what to do, after "<unit> unusable: " in a timeout report */
  const char *(*site)(unsigned site); /* the wait an error word's site code names */
  /* a call's agreement descriptor (src/coll/agree.h) in words: "twoshot bf16 x4096 ..." */
  void (*describe)(uint64_t d0, uint64_t d1, char *buf, size_t n);
} wf_dev_names;

typedef struct wf_dev {
  const wf_dev_names *names;
  char group[64];
  int n, me;
  int ranks[WF_MAX_WORLD];   /* global ranks, for messages */
  weft_vmm *vmm;                /* the workspace */
  wf_dev_host *host;             /* host view of the mapped words (NULL until mapped) */
  const uint32_t *abort_dev;    /* device pointers of host->abort and host->err */
  unsigned long long *err_dev;
  int timeout_ms;
  int failed;                   /* sticky: WEFT_ETIMEOUT / WEFT_EABORT */
  int busy;                     /* atomic: one host thread at a time */
  cudaStream_t last;            /* stream of the previous call (forgotten when weft destroys it) */
  int have_last;
  struct wf_dev *next_live;      /* the registry of live handles (host waits poll it) */
  int live;
  wf_agree_area *agree;         /* device address of this rank's agreement area (NULL: none) */
} wf_dev;

/* A rank's own failure before a vote: its code and message, kept because the
 * vote's calls overwrite weft_last_error(). */
typedef struct wf_dev_local {
  int rc;
  char msg[512];
} wf_dev_local;

/* The group facts (n <= WF_MAX_WORLD) and the kernels' timeout. */
void wf_dev_setup(wf_dev *d, const wf_dev_names *names, const wf_dev_group *gi, int timeout_ms);
/* This rank's SM count; 0 (a rank without CUDA votes 0 SMs) with l holding why. */
int wf_dev_sm_count(wf_dev_local *l);
/* The error when the agreed SM count is 0: this rank's reason from
 * wf_dev_sm_count, else that another rank has no usable device. */
int wf_dev_no_device(const wf_dev_local *l, const char *op);
/* The kernels' timeout in ms: the caller's (> 0), else env, else the
 * group's, else 300000. */
int wf_dev_timeout(long asked_ms, const char *env, int group_ms);
/* Agreement at create (collective): vmin[0] is this rank's SM count from
 * wf_dev_sm_count (l); vmin becomes the group's minimum, vmax (nmax may be 0)
 * its maximum. Errors carry op; an agreed SM count of 0 is wf_dev_no_device. */
int wf_dev_agree(weft_cpugroup *g, const wf_dev_local *l, int64_t *vmin, int nmin, int64_t *vmax,
                int nmax, const char *op);
/* Preflight: *ok = 1 when this device has more than bytes free (0 without
 * a usable device; never an error). */
void wf_dev_fits_free_memory(int64_t bytes, int *ok);
/* The workspace: bytes on every rank (collective), mapped into every peer. */
int wf_dev_workspace(wf_dev *d, weft_cpugroup *g, size_t bytes, const char *op);
void *wf_dev_peer(const wf_dev *d, int i);
/* Allocates and maps the host words; 0, or the error (recorded). Once
 * mapped, the handle is in the registry that host waits poll
 * (wf_dev_poll_all, installed as the CUDA layer's done-wait check) until
 * wf_dev_release. */
int wf_dev_map_host(wf_dev *d);
/* Reads the error words of every live handle (the custom all-reduce, fusion
 * workspaces): 0, or the first failed kernel's report (group, rank, peer,
 * wait site, call) under op. Sticky until the handle is destroyed. */
int wf_dev_poll_all(const char *op);
/* After the workspace's init zeroed it (stream s, before the ready vote):
 * write every rank's agreement area address (off: its offset in each
 * workspace) into this rank's area; from then on wf_dev_agreement fills
 * the kernels' wf_agree. 0, or the CUDA error. */
int wf_dev_agree_init(wf_dev *d, uint64_t off, cudaStream_t s);
/* The call-independent part of a kernel's wf_agree (area NULL before init). */
wf_agree wf_dev_agreement(const wf_dev *d);

/* The vote after this rank's workspace init (local_rc: its outcome, its
 * message still in weft_last_error()), so that no peer pushes into a
 * workspace before its owner initialised it: 0 when every rank is ready,
 * else the error for op (the caller frees). */
int wf_dev_vote_ready(weft_cpugroup *g, int local_rc, const char *op);
/* destroy: leave the registry, let our own last call finish before its memory goes (bounded:
 * kernels give up at their deadline; skipped while that stream captures),
 * then free the workspace and the host words (local, never collective). */
void wf_dev_release(wf_dev *d, const char *op);
/* run, first: ESTATE when the handle failed earlier (reads the error word).
 * verb names the call: "<verb> (group 'G', rank R): ..." */
int wf_dev_usable(wf_dev *d, const char *verb);
/* run, before the launch: one host thread at a time, and a stream other
 * than the last call's only when that one is done with us. On 0 the caller
 * holds the handle until wf_dev_end. */
int wf_dev_begin(wf_dev *d, cudaStream_t s, const char *verb);
void wf_dev_end(wf_dev *d, cudaStream_t s, int launched);
/* check_error: 0, or the report of the kernels' first failure (sticky). */
int wf_dev_check_error(wf_dev *d);
/* abort: raises the host abort word; every later call refuses. */
void wf_dev_abort(wf_dev *d);

#endif /* WEFT_HAVE_CUDA */
#endif
