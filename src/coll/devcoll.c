/* devcoll.c — the host plumbing weft's own device collectives share
 * (src/coll/devcoll.h; users: src/coll/allreduce.c, src/coll/fusion.c,
 * src/coll/fusion_ext.c). */
#include "devcoll.h"

#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { SPIN_STATUS_TIMEOUT = 2 }; /* kernels/common.cuh SPIN_TIMEOUT */

const char *wf_dev_dtype_name(int dtype) {
  switch (dtype) {
    case WEFT_F32: return "f32"; case WEFT_F16: return "f16"; case WEFT_BF16: return "bf16";
    case WEFT_I32: return "i32"; case WEFT_I64: return "i64"; case WEFT_U8: return "u8";
    case WEFT_F64: return "f64"; case WEFT_F8E4M3: return "f8e4m3";
    default: return "unknown";
  }
}

int wf_dev_nodev(const char *op) {
  return wf_error(WEFT_ENODEV, "%s: no CUDA device (weft built without CUDA)", op);
}

int wf_dev_group_info(weft_cpugroup *g, const char *verb, wf_dev_group *gi) {
  int rc = wf_cpugroup_info(g, &gi->name, &gi->n, &gi->me, &gi->ranks, &gi->timeout_ms);
  if (rc) return rc;
  snprintf(gi->op, sizeof gi->op, "%s (group '%s', rank %d of %d)", verb, gi->name, gi->me, gi->n);
  return 0;
}

#if WEFT_HAVE_CUDA

/* Live handles (host words mapped, not yet released): every host wait on
 * the device (src/cuda/cuda.c, nccl synchronize) reads their error words, so a
 * kernel that gave up is reported where its wrong output would be read. */
static pthread_mutex_t g_live_mu = PTHREAD_MUTEX_INITIALIZER;
static wf_dev *g_live;

/* weft destroys stream s (src/cuda/cuda.c): a handle whose last call ran on
 * it lets that call finish now and forgets the stream, so that no later
 * begin or destroy asks a destroyed stream about itself. At the end of a
 * Lua state the finalizers run in no set order: the graph runner's capture
 * stream went before the all-reduce handle whose destroy then asked it,
 * and the process died of SIGSEGV at exit. */
static void forget_stream(void *stream) {
  const cudaStream_t s = (cudaStream_t)stream;
  int used = 0, timeout_ms = 0;
  pthread_mutex_lock(&g_live_mu);
  for (wf_dev *d = g_live; d; d = d->next_live)
    if (d->have_last && d->last == s) {
      used = 1;
      d->have_last = 0;
      if (d->timeout_ms > timeout_ms) timeout_ms = d->timeout_ms;
    }
  pthread_mutex_unlock(&g_live_mu);
  if (!used) return;
  enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &cs) == cudaSuccess && cs == cudaStreamCaptureStatusNone)
    wf_cuda_wait_stream(s, timeout_ms + 5000, "stream destroy");   /* outside the lock: it polls the handles */
  cudaGetLastError();
  wf_clear_error();
}

static void live_add(wf_dev *d) {
  wf_cuda_set_wait_checks(NULL, wf_dev_poll_all);   /* every host wait reads the error words */
  wf_cuda_set_stream_destroy_hook(forget_stream);
  pthread_mutex_lock(&g_live_mu);
  d->next_live = g_live;
  g_live = d;
  d->live = 1;
  pthread_mutex_unlock(&g_live_mu);
}

static void live_remove(wf_dev *d) {
  pthread_mutex_lock(&g_live_mu);
  for (wf_dev **pp = &g_live; *pp; pp = &(*pp)->next_live)
    if (*pp == d) {
      *pp = d->next_live;
      break;
    }
  d->live = 0;
  pthread_mutex_unlock(&g_live_mu);
}

/* Sticky: a failed handle is reported at every host wait until it is
 * destroyed (its output, and the ranks' agreement, are gone; a report
 * consumed by one thread's wait must not let another read quietly). */
int wf_dev_poll_all(const char *op) {
  int rc = 0;
  pthread_mutex_lock(&g_live_mu);
  for (wf_dev *d = g_live; d && !rc; d = d->next_live) {
    if (!d->host || !d->host->err) continue;
    rc = wf_dev_check_error(d);
    if (rc)
      wf_error_context(rc, "%s: a weft %s kernel on this device failed, so the data it wrote is wrong",
                       op, d->names->what);
  }
  pthread_mutex_unlock(&g_live_mu);
  return rc;
}

void wf_dev_setup(wf_dev *d, const wf_dev_names *names, const wf_dev_group *gi, int timeout_ms) {
  d->names = names;
  snprintf(d->group, sizeof d->group, "%s", gi->name);
  d->n = gi->n;
  d->me = gi->me;
  for (int i = 0; i < gi->n && i < WF_MAX_WORLD; i++) d->ranks[i] = gi->ranks[i];
  d->timeout_ms = timeout_ms;
}

int wf_dev_sm_count(wf_dev_local *l) {
  int dev = -1, sms = 0;
  l->rc = wf_cuda_device(&dev);
  l->msg[0] = 0;
  if (!l->rc) {
    cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) l->rc = wf_cuda_err(__FILE__, __LINE__, "cudaDeviceGetAttribute", e);
  }
  if (l->rc) { snprintf(l->msg, sizeof l->msg, "%s", weft_last_error()); sms = 0; }
  return sms;
}

int wf_dev_no_device(const wf_dev_local *l, const char *op) {
  return l->rc ? wf_error(l->rc, "%s: %s", op, l->msg)
               : wf_error(WEFT_ENODEV, "%s: another rank has no usable CUDA device", op);
}

int wf_dev_timeout(long asked_ms, const char *env, int group_ms) {
  const long t = asked_ms > 0 ? asked_ms : wf_env_long(env, group_ms > 0 ? group_ms : 300000);
  return t > 0 && t <= INT_MAX ? (int)t : 300000;
}

int wf_dev_agree(weft_cpugroup *g, const wf_dev_local *l, int64_t *vmin, int nmin, int64_t *vmax,
                int nmax, const char *op) {
  int rc = weft_cpugroup_allreduce_i64(g, vmin, nmin, WEFT_MIN);
  if (!rc && nmax > 0) rc = weft_cpugroup_allreduce_i64(g, vmax, nmax, WEFT_MAX);
  if (rc) return wf_error_context(rc, "%s: agreement", op), rc;
  return vmin[0] <= 0 ? wf_dev_no_device(l, op) : 0;
}

void wf_dev_fits_free_memory(int64_t bytes, int *ok) {
  size_t free_b = 0, total_b = 0;
  *ok = 0;
  if (wf_cuda_init()) { wf_clear_error(); return; }
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) { cudaGetLastError(); return; }
  *ok = (int64_t)free_b > bytes;
}

int wf_dev_workspace(wf_dev *d, weft_cpugroup *g, size_t bytes, const char *op) {
  int rc = weft_vmm_create(g, bytes, 0, &d->vmm);
  if (rc) wf_error_context(rc, "%s", op);
  return rc;
}

void *wf_dev_peer(const wf_dev *d, int i) {
  void *p = NULL;
  weft_vmm_ptr(d->vmm, i, &p);
  return p;
}

int wf_dev_map_host(wf_dev *d) {
  void *hp = NULL;
  cudaError_t e = cudaHostAlloc(&hp, sizeof(wf_dev_host), cudaHostAllocMapped | cudaHostAllocPortable);
  if (e != cudaSuccess) return wf_cuda_err(__FILE__, __LINE__, "cudaHostAlloc(mapped)", e);
  d->host = hp;
  memset(hp, 0, sizeof(wf_dev_host));
  void *dp = NULL;
  e = cudaHostGetDevicePointer(&dp, hp, 0);
  if (e != cudaSuccess) return wf_cuda_err(__FILE__, __LINE__, "cudaHostGetDevicePointer", e);
  d->abort_dev = (const uint32_t *)&((wf_dev_host *)dp)->abort;
  d->err_dev = (unsigned long long *)&((wf_dev_host *)dp)->err;
  live_add(d);
  return 0;
}

int wf_dev_agree_init(wf_dev *d, uint64_t off, cudaStream_t s) {
  /* WEFT_DEVICE_AGREE=0: no announcements (to measure what they cost, and
   * to show what the checks find without them); the area stays zero */
  if (wf_env_long("WEFT_DEVICE_AGREE", 1) == 0) return 0;
  uint64_t rows[WF_MAX_WORLD] = {0};
  for (int i = 0; i < d->n; i++) rows[i] = (uint64_t)(uintptr_t)((char *)wf_dev_peer(d, i) + off);
  wf_agree_area *mine = (wf_agree_area *)(uintptr_t)rows[d->me];
  cudaError_t e = cudaMemcpyAsync(mine->peer_row, rows, sizeof rows, cudaMemcpyHostToDevice, s);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  if (e != cudaSuccess) return wf_cuda_err(__FILE__, __LINE__, "agreement area init", e);
  d->agree = mine;
  return 0;
}

wf_agree wf_dev_agreement(const wf_dev *d) {
  wf_agree a;
  memset(&a, 0, sizeof a);
  a.area = d->agree;
  a.me = d->me;
  a.world = d->n;
  return a;
}

int wf_dev_vote_ready(weft_cpugroup *g, int local_rc, const char *op) {
  char local_msg[512] = "";
  if (local_rc) snprintf(local_msg, sizeof local_msg, "%s", weft_last_error());
  int64_t ok = local_rc == 0;
  int rc = weft_cpugroup_allreduce_i64(g, &ok, 1, WEFT_AND);
  if (rc) return wf_error_context(rc, "%s: init vote", op);
  if (ok) return 0;
  if (local_rc) return wf_error(local_rc, "%s: %s", op, local_msg);
  return wf_error(WEFT_ECUDA, "%s: workspace init failed on another rank", op);
}

void wf_dev_release(wf_dev *d, const char *op) {
  if (d->live) live_remove(d);   /* first: its host words go below */
  pthread_mutex_lock(&g_live_mu);   /* a stream going away (forget_stream) clears last */
  const int have_last = d->have_last;
  const cudaStream_t last = d->last;
  d->have_last = 0;
  pthread_mutex_unlock(&g_live_mu);
  if (have_last) {
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(last, &cs) == cudaSuccess && cs == cudaStreamCaptureStatusNone)
      wf_cuda_wait_stream(last, d->timeout_ms + 5000, op);
    cudaGetLastError();
  }
  if (d->vmm) weft_vmm_destroy(d->vmm);
  if (d->host) cudaFreeHost((void *)d->host);
  d->vmm = NULL;
  d->host = NULL;
}

int wf_dev_usable(wf_dev *d, const char *verb) {
  if (!d->failed && !d->host->err) return 0;
  /* Name the first failure (which peer, where, which call) when the kernel
   * left it in the error word: "a peer did not arrive" alone does not say
   * which rank is gone. */
  char first[384] = "";
  if (d->host->err && wf_dev_check_error(d)) snprintf(first, sizeof first, ": %s", weft_last_error());
  else snprintf(first, sizeof first, " (%s)", d->failed == WEFT_EABORT ? "aborted" : "a peer did not arrive");
  return wf_error(WEFT_ESTATE, "%s (group '%s', rank %d): this %s failed earlier%s; %s", verb,
                  d->group, d->me, d->names->unit, first, d->names->refuse_hint);
}

int wf_dev_begin(wf_dev *d, cudaStream_t s, const char *verb) {
  if (__atomic_exchange_n(&d->busy, 1, __ATOMIC_ACQUIRE))
    return wf_error(WEFT_ESTATE, "%s (group '%s', rank %d): used by another thread at the same time "
                    "(one operation in flight)", verb, d->group, d->me);
  if (d->have_last && s != d->last) {
    /* A different stream: only when the previous one is done with us.
     * (While s itself captures, nothing runs now: no check.) */
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    cudaError_t e = cudaStreamIsCapturing(s, &cs);
    int busy = 0;
    if (e == cudaSuccess && cs == cudaStreamCaptureStatusNone) {
      e = cudaStreamIsCapturing(d->last, &cs);
      if (e == cudaSuccess && cs == cudaStreamCaptureStatusNone)
        busy = cudaStreamQuery(d->last) == cudaErrorNotReady;
      else if (e == cudaSuccess)
        busy = cs == cudaStreamCaptureStatusActive;
    }
    cudaGetLastError();
    if (busy) {
      __atomic_store_n(&d->busy, 0, __ATOMIC_RELEASE);
      return wf_error(WEFT_ESTATE, "%s (group '%s', rank %d): a previous call on another stream (%p) "
                      "is still in flight or capturing; one operation in flight per %s", verb,
                      d->group, d->me, (void *)d->last, d->names->unit);
    }
  }
  return 0;
}

void wf_dev_end(wf_dev *d, cudaStream_t s, int launched) {
  if (launched) {
    d->last = s;
    d->have_last = 1;
  }
  __atomic_store_n(&d->busy, 0, __ATOMIC_RELEASE);
}

int wf_dev_check_error(wf_dev *d) {
  const wf_dev_names *nm = d->names;
  const unsigned long long e = d->host->err;
  if (!e) {
    if (d->failed == WEFT_EABORT)
      return wf_error(WEFT_EABORT, "%s (group '%s', rank %d): aborted", nm->what, d->group, d->me);
    return 0;
  }
  const unsigned status = (unsigned)(e >> 56) & 0xff, peer = (unsigned)(e >> 48) & 0xff,
                 site = (unsigned)(e >> 40) & 0xff, epoch = (unsigned)(e & 0xffffffffu);
  const int grank = peer < (unsigned)d->n ? d->ranks[peer] : -1;
  if (status == WF_SPIN_MISMATCH) {
    char mine[192] = "?", theirs[192] = "?";
    if (nm->describe) {
      nm->describe(d->host->desc[0], d->host->desc[1], mine, sizeof mine);
      nm->describe(d->host->desc[2], d->host->desc[3], theirs, sizeof theirs);
    }
    d->failed = WEFT_EMISMATCH;
    return wf_error(WEFT_EMISMATCH, "%s (group '%s', rank %d of %d): call %u differs between ranks: "
                    "rank %d called %s; rank %d called %s; %s unusable: %s", nm->what, d->group, d->me,
                    d->n, epoch, grank, theirs, d->ranks[d->me], mine, nm->unit, nm->timeout_hint);
  }
  if (status == WF_SPIN_PEER_FAILED) {
    /* site: the peer's status; epoch: the rank it named, this rank's own wait site above */
    const unsigned why = site, named = epoch & 0xff, own = (epoch >> 8) & 0xff;
    const int gnamed = named < (unsigned)d->n ? d->ranks[named] : -1;
    char at[200] = "";
    if (own && nm->site) snprintf(at, sizeof at, " at the %s", nm->site(own));
    char reason[160];
    if (why == WF_SPIN_MISMATCH)
      snprintf(reason, sizeof reason, "its call differed from rank %d's", gnamed);
    else if (why == SPIN_STATUS_TIMEOUT)
      snprintf(reason, sizeof reason, "rank %d did not arrive within its timeout", gnamed);
    else if (why == WF_SPIN_PEER_FAILED)
      snprintf(reason, sizeof reason, "rank %d gave up before it", gnamed);
    else
      snprintf(reason, sizeof reason, "it was aborted");
    d->failed = WEFT_EABORT;
    return wf_error(WEFT_EABORT, "%s (group '%s', rank %d of %d): rank %d gave up its call (%s), so this "
                    "rank's call cannot complete (it waited%s); %s unusable: %s", nm->what, d->group, d->me, d->n,
                    grank, reason, at[0] ? at : " for it", nm->unit, nm->timeout_hint);
  }
  if (status == 1) {
    d->failed = WEFT_EABORT;
    return wf_error(WEFT_EABORT, "%s (group '%s', rank %d of %d): aborted while waiting for peer %u "
                    "(global rank %d) at the %s of call %u; %s unusable", nm->what, d->group, d->me,
                    d->n, peer, grank, nm->site(site), epoch, nm->unit);
  }
  d->failed = WEFT_ETIMEOUT;
  return wf_error(WEFT_ETIMEOUT, "%s (group '%s', rank %d of %d): peer %u (global rank %d) did not "
                  "arrive within %d ms at the %s of call %u (dead, late, or making different calls); "
                  "%s unusable: %s", nm->what, d->group, d->me, d->n, peer, grank, d->timeout_ms,
                  nm->site(site), epoch, nm->unit, nm->timeout_hint);
}

void wf_dev_abort(wf_dev *d) {
  d->host->abort = 1;
  __sync_synchronize();
  if (!d->failed) d->failed = WEFT_EABORT;
}

#endif /* WEFT_HAVE_CUDA */
