/* fused_ws.c — the workspace and lifecycle the fused kernel families share
 * (fused_ws.h). What decides the grid or the layout (SM count, sizes, the
 * one-shot limit) is agreed by all ranks at create (cpu group MIN/MAX),
 * because a peer waits for the block of the same index and writes at the
 * same offsets. */
#include "fused_ws.h"
#include "core/internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int64_t wf_fws_os_tokens(const weft_fusion_opts *o) {
  return o->oneshot_max_tokens < 0 ? 0
         : o->oneshot_max_tokens == 0 || o->oneshot_max_tokens > o->max_tokens ? o->max_tokens
                                                                              : o->oneshot_max_tokens;
}

int wf_fws_check_size(const weft_fusion_opts *o, int world, int64_t max_hidden, const char *op) {
  WF_CHECK_ARG(o, "%s: NULL options", op);
  WF_CHECK_ARG(world >= 2 && world <= WF_MAX_WORLD, "%s: world size %d not supported (2..%d)", op, world,
               WF_MAX_WORLD);
  WF_CHECK_ARG(o->hidden >= 8 && o->hidden <= max_hidden && o->hidden % 8 == 0,
               "%s: hidden %lld must be a multiple of 8 in [8, %lld]", op, (long long)o->hidden,
               (long long)max_hidden);
  WF_CHECK_ARG(o->max_tokens >= 1 && o->max_tokens <= ((int64_t)1 << 24),
               "%s: max_tokens %lld out of range [1, 2^24]", op, (long long)o->max_tokens);
  return 0;
}

/* "<family> <verb>" into op; the out-parameter and the options checked */
static int entry(const wf_fws_family *fam, const weft_fusion_opts *opts, int world, const void *out,
                 const char *verb, char *op, size_t n) {
  snprintf(op, n, "%s %s", fam->what, verb);
  WF_CHECK_ARG(out, "%s: NULL out-parameter", op);
  return fam->check_opts(opts, world, op);
}

int wf_fws_workspace_bytes(const wf_fws_family *fam, const weft_fusion_opts *opts, int world, size_t *bytes) {
  char op[64];
  int rc = entry(fam, opts, world, bytes, "workspace_bytes", op, sizeof op);
  if (!rc) *bytes = (size_t)fam->workspace_bytes(opts, world);
  return rc;
}

int wf_fws_preflight(const wf_fws_family *fam, const weft_fusion_opts *opts, int world, int *ok) {
  char op[64];
  if (ok) *ok = 0;
  int rc = entry(fam, opts, world, ok, "preflight", op, sizeof op);
#if WEFT_HAVE_CUDA
  if (!rc) wf_dev_fits_free_memory(fam->workspace_bytes(opts, world), ok);
#endif
  return rc;
}

int wf_fws_fits(const wf_fws *w, int64_t tokens, int64_t hidden, int dtype, int algo) {
  if (tokens < 0 || tokens > w->opts.max_tokens || hidden > w->opts.hidden ||
      wf_dev_esize(dtype) > wf_dev_esize(w->opts.dtype))
    return 0;
  return algo != WEFT_FUSION_ONESHOT || tokens <= w->os_tokens;
}

int wf_fws_choose(const wf_fws *w, int asked, int64_t tokens, int64_t hidden, int dtype, int64_t bytes,
                  const char *op, int *algo, const char **why) {
  const int os_fit = wf_fws_fits(w, tokens, hidden, dtype, WEFT_FUSION_ONESHOT);
  switch (asked) {
    case WEFT_FUSION_ONESHOT:
      WF_CHECK_ARG(os_fit, "%s: one-shot of %lld tokens exceeds the workspace's one-shot capacity "
                   "(%lld tokens)", op, (long long)tokens, (long long)w->os_tokens);
      *algo = WEFT_FUSION_ONESHOT;
      *why = "one-shot requested";
      break;
    case WEFT_FUSION_TWOSHOT:
      *algo = WEFT_FUSION_TWOSHOT;
      *why = "two-shot requested";
      break;
    default:
      if (os_fit && bytes <= w->oneshot_max_bytes) {
        *algo = WEFT_FUSION_ONESHOT;
        *why = "auto: at most the one-shot limit (latency path)";
      } else {
        *algo = WEFT_FUSION_TWOSHOT;
        *why = os_fit ? "auto: above the one-shot limit (bandwidth path)"
                      : "auto: above the one-shot capacity of the workspace";
      }
  }
  return 0;
}

/* create's checks before anything is allocated: the group's facts (gi), the options */
static int create_checks(const wf_fws_family *fam, weft_cpugroup *g, const weft_fusion_opts *opts, wf_fws **out,
                         wf_dev_group *gi) {
  char verb[64];
  snprintf(verb, sizeof verb, "%s create", fam->what);
  WF_CHECK_ARG(out, "%s: NULL out-parameter", verb);
  *out = NULL;
  int rc = wf_dev_group_info(g, verb, gi);
  return rc ? rc : fam->check_opts(opts, gi->n, gi->op);
}

#if !WEFT_HAVE_CUDA

int wf_fws_create(const wf_fws_family *fam, weft_cpugroup *g, const weft_fusion_opts *opts, size_t size,
                  wf_fws **out) {
  (void)size;
  wf_dev_group gi;
  const int rc = create_checks(fam, g, opts, out, &gi);
  return rc ? rc : wf_dev_nodev(gi.op);
}
void wf_fws_destroy(wf_fws *w) { (void)w; }
int wf_fws_check_error(wf_fws *w, const char *verb) { (void)w; return wf_dev_nodev(verb); }
int wf_fws_abort(wf_fws *w, const char *verb) { (void)w; return wf_dev_nodev(verb); }

#else

void wf_fws_destroy(wf_fws *w) {
  if (!w) return;
  char verb[64];
  snprintf(verb, sizeof verb, "%s destroy", w->fam->what);
  wf_dev_release(&w->dc, verb); /* waits (bounded) for our own last call first */
  free(w);
}

/* State and flags of this rank's workspace initialised, its agreement area
 * addressed (before the ready vote: no peer pushes into it before). */
static int init_workspace(wf_fws *w, const char *op) {
  cudaStream_t s;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
    return wf_cuda_err(__FILE__, __LINE__, op, cudaGetLastError());
  const int e = w->fam->clear(w, s);
  int rc = e == 0 ? wf_cuda_wait_stream(s, w->dc.timeout_ms, op) : wf_cuda_err(__FILE__, __LINE__, op, (cudaError_t)e);
  if (!rc) rc = wf_dev_agree_init(&w->dc, w->fam->agree_offset, s);
  cudaStreamDestroy(s);
  return rc;
}

int wf_fws_create(const wf_fws_family *fam, weft_cpugroup *g, const weft_fusion_opts *opts, size_t size,
                  wf_fws **out) {
  wf_dev_group gi;
  int rc = create_checks(fam, g, opts, out, &gi);
  if (rc) return rc;
  const char *op = gi.op;
  const int n = gi.n;

  wf_fws *w = calloc(1, size);
  if (!w) return wf_error(WEFT_ENOMEM, "%s: out of memory", op);
  w->fam = fam;
  w->me = gi.me;
  w->world = n;
  wf_dev_setup(&w->dc, fam->names, &gi, wf_dev_timeout(opts->timeout_ms, "WEFT_FUSION_TIMEOUT_MS", gi.timeout_ms));

  /* Local facts, then agreement: the smallest SM count (same grid
   * everywhere), the largest sizes (every rank sizes for the largest
   * request: the grow-only manager asks the same everywhere, this keeps the
   * offsets equal even if it did not) and the smallest one-shot limit. A
   * rank without CUDA votes 0 SMs. */
  wf_dev_local local;
  const int sms = wf_dev_sm_count(&local);
  const int64_t os_env = wf_env_long(fam->oneshot_env, -1);
  int64_t vmin[2] = {sms, os_env > 0 ? os_env : fam->default_oneshot_max(n)};
  int64_t vmax[4] = {opts->max_tokens, opts->hidden, wf_dev_esize(opts->dtype), wf_fws_os_tokens(opts)};
  rc = wf_dev_agree(g, &local, vmin, 2, vmax, 4, op);
  if (rc) { wf_fws_destroy(w); return rc; }
  w->opts = *opts;
  w->opts.max_tokens = vmax[0];
  w->opts.hidden = vmax[1];
  w->opts.dtype = vmax[2] == 4 ? WEFT_F32 : (wf_dev_esize(opts->dtype) == 2 ? opts->dtype : WEFT_BF16);
  w->opts.oneshot_max_tokens = vmax[3] > 0 ? vmax[3] : -1;
  w->os_tokens = wf_fws_os_tokens(&w->opts);
  w->oneshot_max_bytes = vmin[1];
  w->num_sms = (int)vmin[0];
  w->ws_bytes = (size_t)fam->workspace_bytes(&w->opts, n);

  rc = wf_dev_workspace(&w->dc, g, w->ws_bytes, op);
  if (rc) { wf_fws_destroy(w); return rc; }
  /* host-mapped words, workspace init; then a vote, so that no peer pushes
   * into a workspace before its owner initialised it */
  int local_rc = wf_dev_map_host(&w->dc);
  if (!local_rc) local_rc = init_workspace(w, op);
  rc = wf_dev_vote_ready(g, local_rc, op);
  if (rc) { wf_fws_destroy(w); return rc; }
  fam->bind(w);
  char lim[40] = "any size";
  if (w->oneshot_max_bytes != WF_FWS_NO_LIMIT)
    snprintf(lim, sizeof lim, "<= %lld bytes", (long long)w->oneshot_max_bytes);
  wf_log(1, "%s: %zu bytes per rank (max %lld tokens x %lld %s, one-shot up to %lld tokens, "
         "auto one-shot at %s), %d SMs", op, w->ws_bytes, (long long)w->opts.max_tokens,
         (long long)w->opts.hidden, wf_dev_dtype_name(w->opts.dtype), (long long)w->os_tokens, lim, w->num_sms);
  *out = w;
  return 0;
}

int wf_fws_check_error(wf_fws *w, const char *verb) {
  WF_CHECK_ARG(w, "%s: handle is NULL", verb);
  return wf_dev_check_error(&w->dc);
}

int wf_fws_abort(wf_fws *w, const char *verb) {
  WF_CHECK_ARG(w, "%s: handle is NULL", verb);
  wf_dev_abort(&w->dc);
  return 0;
}

#endif /* WEFT_HAVE_CUDA */
