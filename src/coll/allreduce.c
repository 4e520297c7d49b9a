/* allreduce.c — host side of weft's own all-reduce (kernels/allreduce.cu):
 * the workspace (one VMM allocation per rank, src/cuda/vmm.c), its layout and
 * initialisation, the host-mapped abort/error words, validation before
 * launch, algorithm resolution, and the error report.
 *
 * Everything that decides the grid or the layout (SM count, blocks per SM,
 * buffer sizes) is agreed by all ranks at create (cpu group MIN), because
 * the kernels' flag protocol needs the same grid on every rank. */
#include "ar_internal.h"
#include "devcoll.h"
#include "quick_codec.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KIB ((size_t)1024)
#define MIB (KIB * KIB)

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

static const char *kind_name(int kind) {
  switch (kind) {
    case WF_AR_LAMPORT: return "oneshot";
    case WF_AR_TWOSHOT: return "twoshot";
    case WF_AR_ONESHOT_FLAG: return "oneshot-flag";
    case WF_AR_QUICK_FP: return "quick-fp";
    case WF_AR_QUICK_INT8: return "quick-int8";
    case WF_AR_QUICK_INT4: return "quick-int4";
    case WF_AR_QUICK_FP8: return "quick-fp8";
    default: return "?";
  }
}

/* create's refusals of bad input, the same with and without CUDA (a
 * host-only build answers a bad world size as a CUDA build does, before
 * "no CUDA device"); gi is filled for the caller. */
static int check_create(weft_cpugroup *g, size_t max_bytes, weft_ar **out, wf_dev_group *gi) {
  WF_CHECK_ARG(out, "allreduce create: NULL out-parameter");
  *out = NULL;
  int rc = wf_dev_group_info(g, "allreduce create", gi);
  if (rc) return rc;
  const char *op = gi->op;
  const int n = gi->n;
  WF_CHECK_ARG(n == 2 || n == 4 || n == 6 || n == 8, "%s: world size %d not supported (2, 4, 6, 8)", op, n);
  WF_CHECK_ARG(max_bytes >= 16 && max_bytes <= ((size_t)1 << 40), "%s: max_bytes %zu out of range", op, max_bytes);
  return 0;
}

/* weft_qr_codec_step's arguments (checked the same way with or without CUDA). */
static int qr_step_check(int step, int codec, int dtype, int world, const void *in, const void *wire,
                         const void *out, size_t count) {
  WF_CHECK_ARG(step >= 0 && step <= 3, "quick codec step: step %d is not 0 (quantize), 1 (reduce), 2 or 3", step);
  WF_CHECK_ARG(codec >= 0 && codec < WF_QR_NCODECS, "quick codec step: codec %d unknown (0 fp, 1 int8, 2 int4, 3 fp8)", codec);
  WF_CHECK_ARG(dtype == WEFT_BF16 || dtype == WEFT_F16, "quick codec step: dtype %s is not bf16 or f16",
               wf_dev_dtype_name(dtype));
  WF_CHECK_ARG(step % 2 == 0 || world == 2 || world == 4 || world == 6 || world == 8,
               "quick codec step: world %d is not 2, 4, 6 or 8", world);
  WF_CHECK_ARG(count > 0 && in && wire && (step % 2 == 0 || out), "quick codec step: empty call or NULL buffer");
  WF_CHECK_ARG((((uintptr_t)in | (uintptr_t)wire | (uintptr_t)out) & 15) == 0,
               "quick codec step: buffers must be 16-byte aligned");
  return 0;
}

#if !WEFT_HAVE_CUDA

#define nodev wf_dev_nodev
int weft_ar_create(weft_cpugroup *g, size_t max_bytes, weft_ar **out) {
  wf_dev_group gi;
  int rc = check_create(g, max_bytes, out, &gi);
  return rc ? rc : nodev("allreduce create");
}
int weft_ar_destroy(weft_ar *ar) { (void)ar; return 0; }
int weft_ar_run(weft_ar *ar, const void *in, void *out, size_t count, int dtype, int algo,
                void *stream) {
  (void)ar; (void)in; (void)out; (void)count; (void)dtype; (void)algo; (void)stream;
  return nodev("allreduce run");
}
int weft_ar_check_error(weft_ar *ar) { (void)ar; return nodev("allreduce check_error"); }
int weft_ar_abort(weft_ar *ar) { (void)ar; return nodev("allreduce abort"); }
int weft_ar_set_timeout(weft_ar *ar, int timeout_ms) { (void)ar; (void)timeout_ms; return nodev("allreduce set_timeout"); }
int weft_ar_resolve(weft_ar *ar, size_t count, int dtype, int algo, int *kind, const char **why) {
  (void)ar; (void)count; (void)dtype; (void)algo; (void)kind; (void)why;
  (void)kind_name; (void)align_up;
  return nodev("allreduce resolve");
}
int weft_ar_info(weft_ar *ar, int *rank, int *world, size_t *max_bytes, size_t *lamport_bytes,
                 size_t *oneshot_max) {
  (void)ar; (void)rank; (void)world; (void)max_bytes; (void)lamport_bytes; (void)oneshot_max;
  return nodev("allreduce info");
}
int weft_ar_set_param(weft_ar *ar, const char *name, int64_t value) {
  (void)ar; (void)name; (void)value;
  return nodev("allreduce set_param");
}
int weft_ar_shape(weft_ar *ar, size_t count, int dtype, int algo, int *grid, int *threads) {
  (void)ar; (void)count; (void)dtype; (void)algo; (void)grid; (void)threads;
  return nodev("allreduce shape");
}
int weft_qr_codec_step(int step, int codec, int dtype, int world, const void *in, void *wire, void *out,
                       size_t count, void *stream) {
  (void)stream;
  int rc = qr_step_check(step, codec, dtype, world, in, wire, out, count);
  return rc ? rc : nodev("quick codec step");
}

#else

#define esize wf_dev_esize
#define dtype_name wf_dev_dtype_name

static const char *site_name(unsigned site) {
  switch (site) {
    case WF_AR_SITE_LAMPORT: return "one-shot data poll";
    case WF_AR_SITE_ONESHOT: return "one-shot round flag";
    case WF_AR_SITE_RS: return "two-shot reduce-scatter flag";
    case WF_AR_SITE_AG: return "two-shot all-gather flag";
    case WF_AR_SITE_PUSHER: return "split one-shot's wait for its own pusher block";
    case WF_AR_SITE_QRS: return "quick all-reduce reduce-scatter flag";
    case WF_AR_SITE_QAG: return "quick all-reduce all-gather flag";
    case WF_AR_SITE_AGREE: return "agreement check (the peer's announcement of the call)";
    default: return "unknown wait";
  }
}

/* wf_agree_d0(family, kind, dtype, 0, grid, threads, sub | split << 4 | determ << 5), d1 = count */
static void describe(uint64_t d0, uint64_t d1, char *buf, size_t n) {
  const unsigned fam = (unsigned)(d0 >> 56), kind = (unsigned)(d0 >> 48) & 0xff,
                 dt = (unsigned)(d0 >> 40) & 0xff, grid = (unsigned)(d0 >> 16) & 0xffff,
                 thr = (unsigned)(d0 >> 6) & 0x3ff, bits = (unsigned)d0 & 0x3f;
  if (fam != WF_AGREE_AR && fam != WF_AGREE_QUICK) {
    snprintf(buf, n, "an unknown call (%#llx %#llx)", (unsigned long long)d0, (unsigned long long)d1);
    return;
  }
  snprintf(buf, n, "all_reduce %s %s x%llu (grid %u x %u%s)", kind_name((int)kind), dtype_name((int)dt),
           (unsigned long long)d1, grid, thr, bits & 32 ? ", deterministic" : "");
}

static const wf_dev_names AR_NAMES = {
  .what = "allreduce", .unit = "handle", .refuse_hint = "destroy it and fall back to NCCL",
  .timeout_hint = "destroy it and fall back to NCCL", .site = site_name, .describe = describe,
};

struct weft_ar {
  wf_dev dc;                     /* group, workspace, host words, in-flight state */
  size_t ws_bytes, max_bytes, oneshot_max;
  size_t twoshot_min;           /* auto, 2 ranks, above oneshot_max: two-shot from here */
  wf_ar_args base;              /* launch arguments without the call's part */
  int pdl;                      /* WEFT_AR_PDL */
};

static size_t env_bytes(const char *name, size_t dflt) {
  long v = wf_env_long(name, -1);
  return v > 0 ? (size_t)v : dflt;
}

/* Release everything local (never collective). */
static void ar_free(weft_ar *ar) {
  if (!ar) return;
  wf_dev_release(&ar->dc, "allreduce destroy");
  free(ar);
}

/* Zero the header/flags, fill the Lamport buffers with the sentinel. */
static int init_workspace(weft_ar *ar) {
  cudaStream_t s;
  WF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  char *mine = ar->base.ws[ar->dc.me];
  cudaError_t e = cudaMemsetAsync(mine, 0, ar->base.off_lamport, s);
  const uint64_t lam = 3u * (uint64_t)(ar->dc.n - 1) * ar->base.lamport_slot;
  if (e == cudaSuccess) e = (cudaError_t)wf_ar_fill_empty(mine + ar->base.off_lamport, lam, s);
  int rc = e == cudaSuccess ? wf_cuda_wait_stream(s, ar->dc.timeout_ms, "allreduce create: init")
                            : wf_cuda_err(__FILE__, __LINE__, "workspace init", e);
  if (!rc) rc = wf_dev_agree_init(&ar->dc, WF_AR_OFF_AGREE, s);
  if (!rc) ar->base.agree = wf_dev_agreement(&ar->dc);
  cudaStreamDestroy(s);
  return rc;
}

int weft_ar_create(weft_cpugroup *g, size_t max_bytes, weft_ar **out) {
  wf_dev_group gi;
  int rc = check_create(g, max_bytes, out, &gi);
  if (rc) return rc;
  const char *op = gi.op;
  const int n = gi.n, me = gi.me, tmo = gi.timeout_ms;

  weft_ar *ar = calloc(1, sizeof *ar);
  if (!ar) return wf_error(WEFT_ENOMEM, "%s: out of memory", op);
  wf_dev_setup(&ar->dc, &AR_NAMES, &gi, wf_dev_timeout(0, "WEFT_AR_TIMEOUT_MS", tmo));
  ar->pdl = wf_env_long("WEFT_AR_PDL", 1) != 0;

  /* Local facts, then agreement (a rank without CUDA votes 0 SMs). */
  wf_dev_local local;
  const int sms = wf_dev_sm_count(&local);
  size_t mb = align_up(max_bytes, 16);
  int64_t v[4] = {sms, wf_env_long("WEFT_AR_BLOCKS_PER_SM", 2),
                  (int64_t)align_up(env_bytes("WEFT_AR_LAMPORT_MAX", 16 * MIB), 16), (int64_t)mb};
  if (v[1] < 1) v[1] = 1;
  if (v[1] > 8) v[1] = 8;
  if ((size_t)v[2] > mb) v[2] = (int64_t)mb;
  rc = wf_dev_agree(g, &local, v, 4, NULL, 0, op);
  if (rc) { ar_free(ar); return rc; }
  ar->max_bytes = (size_t)v[3];
  const uint64_t mvec = ar->max_bytes / 16;

  /* Layout (identical on all ranks: computed from agreed numbers only). */
  wf_ar_args *a = &ar->base;
  a->rank = me;
  a->world = n;
  a->sms = (int)v[0];
  a->blocks_per_sm = (int)v[1];
  a->lamport_slot = (uint64_t)v[2];
  a->off_lamport = align_up(WF_AR_OFF_FLAGS + WF_AR_FLAGS_BYTES, 4096);
  a->off_data = align_up(a->off_lamport + 3u * (uint64_t)(n - 1) * a->lamport_slot, 4096);
  uint64_t par = wf_ar_data_need(WF_AR_TWOSHOT, mvec, n);
  if (n == 2 && wf_ar_data_need(WF_AR_ONESHOT_FLAG, mvec, n) > par)
    par = wf_ar_data_need(WF_AR_ONESHOT_FLAG, mvec, n);
  a->data_par = align_up(par, 4096);
  ar->ws_bytes = a->off_data + 2u * a->data_par;
  /* auto: Lamport one-shot up to oneshot_max. W = 2 (2 x H200, 2026-11-30,
   * graph us, Lamport / flag one-shot / two-shot): 4 MiB 16.6 / 18.2 / 18.9,
   * 16 MiB 58.1 / 57.1 / 55.6, 64 MiB 224 / 199 / 199: Lamport wins up to
   * 4 MiB by 9-12 %, loses by 4 % at 16 MiB; 8 MiB (not measured yet) by log
   * interpolation still Lamport. Above it two-shot (best or tied at 16 and
   * 64 MiB). Larger worlds: one-shot moves (W-1) x the bytes over each link,
   * so they stop earlier. bench/ar_bench --bench prints the measured
   * crossovers next to these. */
  size_t dflt_os = n == 2 ? 8 * MIB : n == 4 ? 1 * MIB : 256 * KIB;
  ar->oneshot_max = env_bytes("WEFT_AR_ONESHOT_MAX", dflt_os);
  if (ar->oneshot_max > a->lamport_slot) ar->oneshot_max = a->lamport_slot;
  ar->twoshot_min = env_bytes("WEFT_AR_TWOSHOT_MIN", 0); /* 0: two-shot right above oneshot_max */

  rc = wf_dev_workspace(&ar->dc, g, ar->ws_bytes, op);
  if (rc) { ar_free(ar); return rc; }
  for (int i = 0; i < n; i++) a->ws[i] = wf_dev_peer(&ar->dc, i);

  /* Host-mapped abort/error words, workspace init; then a vote, so that no
   * peer pushes into a workspace before its owner initialised it. */
  int local_rc = wf_dev_map_host(&ar->dc);
  a->abort_host = ar->dc.abort_dev;
  a->err_host = ar->dc.err_dev;
  if (!local_rc) local_rc = init_workspace(ar);
  rc = wf_dev_vote_ready(g, local_rc, op);
  if (rc) {
    ar_free(ar);
    return rc;
  }
  wf_log(1, "%s: workspace %zu bytes (lamport %llu per slot, data %llu per parity), %d SMs x %d",
         op, ar->ws_bytes, (unsigned long long)a->lamport_slot, (unsigned long long)a->data_par,
         a->sms, a->blocks_per_sm);
  *out = ar;
  return 0;
}

int weft_ar_destroy(weft_ar *ar) {
  ar_free(ar); /* waits (bounded) for our own last call first */
  return 0;
}

int weft_ar_info(weft_ar *ar, int *rank, int *world, size_t *max_bytes, size_t *lamport_bytes,
                 size_t *oneshot_max) {
  WF_CHECK_ARG(ar, "allreduce info: handle is NULL");
  if (rank) *rank = ar->dc.me;
  if (world) *world = ar->dc.n;
  if (max_bytes) *max_bytes = ar->max_bytes;
  if (lamport_bytes) *lamport_bytes = ar->base.lamport_slot;
  if (oneshot_max) *oneshot_max = ar->oneshot_max;
  return 0;
}

int weft_ar_set_timeout(weft_ar *ar, int timeout_ms) {
  WF_CHECK_ARG(ar, "allreduce set_timeout: handle is NULL");
  WF_CHECK_ARG(timeout_ms > 0, "allreduce set_timeout (group '%s'): timeout %d ms must be > 0",
               ar->dc.group, timeout_ms);
  ar->dc.timeout_ms = timeout_ms;
  return 0;
}

/* Validation and algorithm choice shared by run and resolve: the one place
 * "auto" becomes a kernel (weft_ar_resolve's answer, which the Lua rule asks
 * for and hands back named); a named kernel is only checked to fit, and a
 * kernel this returns maps to itself when passed back. */
#define OPFMT "allreduce (group '%s', rank %d)"
#define OPARGS ar->dc.group, ar->dc.me

static int resolve(weft_ar *ar, size_t count, int dtype, int algo, int *kind, const char **why) {
  const int es = esize(dtype);
  WF_CHECK_ARG(es, OPFMT ": dtype %s (%d) not supported (f32, f16, bf16)", OPARGS, dtype_name(dtype), dtype);
  WF_CHECK_ARG(count > 0, OPFMT ": count is 0 (nothing to reduce)", OPARGS);
  WF_CHECK_ARG(count <= ar->max_bytes / (size_t)es,
               OPFMT ": %zu elements of %s (%zu bytes) exceed the workspace's %zu bytes", OPARGS, count,
               dtype_name(dtype), count * (size_t)es, ar->max_bytes);
  const uint64_t bytes = (uint64_t)count * es, nvec = wf_ar_nvec(count, es);
  const int fits_l = nvec * 16 <= ar->base.lamport_slot;
  const int n = ar->dc.n;
  const int fits_o = wf_ar_data_need(WF_AR_ONESHOT_FLAG, nvec, n) <= ar->base.data_par;
  const int fits_t = wf_ar_data_need(WF_AR_TWOSHOT, nvec, n) <= ar->base.data_par;
  switch (algo) {
    case WEFT_AR_AUTO:
      if (fits_l && bytes <= ar->oneshot_max) { *kind = WF_AR_LAMPORT; *why = "auto: at most the one-shot limit"; }
      else if (n == 2 && fits_o && bytes < ar->twoshot_min) { *kind = WF_AR_ONESHOT_FLAG; *why = "auto: 2 ranks, between the one-shot limit and the two-shot minimum (flag one-shot moves the same bytes as two-shot, in one phase)"; }
      else if (fits_t) { *kind = WF_AR_TWOSHOT; *why = "auto: above the one-shot limit"; }
      else if (fits_o) { *kind = WF_AR_ONESHOT_FLAG; *why = "auto: above the one-shot limit; two-shot does not fit the workspace"; }
      else if (fits_l) { *kind = WF_AR_LAMPORT; *why = "auto: only the Lamport buffers fit"; }
      else return wf_error(WEFT_EINVAL, OPFMT ": %llu bytes fit no algorithm's buffers", OPARGS, (unsigned long long)bytes);
      break;
    case WEFT_AR_ONESHOT:
      if (fits_l) { *kind = WF_AR_LAMPORT; *why = "one-shot requested; fits the Lamport buffers"; }
      else if (fits_o) { *kind = WF_AR_ONESHOT_FLAG; *why = "one-shot requested; above the Lamport buffers"; }
      else return wf_error(WEFT_EINVAL, OPFMT ": one-shot of %llu bytes does not fit the workspace "
                           "(Lamport %llu bytes; flag one-shot needs %llu of %llu)", OPARGS,
                           (unsigned long long)bytes, (unsigned long long)ar->base.lamport_slot,
                           (unsigned long long)wf_ar_data_need(WF_AR_ONESHOT_FLAG, nvec, n),
                           (unsigned long long)ar->base.data_par);
      break;
    case WEFT_AR_TWOSHOT:
      if (!fits_t) return wf_error(WEFT_EINVAL, OPFMT ": two-shot of %llu bytes does not fit the workspace", OPARGS,
                                   (unsigned long long)bytes);
      *kind = WF_AR_TWOSHOT; *why = "two-shot requested";
      break;
    case WEFT_AR_ONESHOT_FLAG:
      if (!fits_o) return wf_error(WEFT_EINVAL, OPFMT ": flag one-shot of %llu bytes does not fit the "
                                   "workspace (needs %llu of %llu per parity)", OPARGS,
                                   (unsigned long long)bytes,
                                   (unsigned long long)wf_ar_data_need(WF_AR_ONESHOT_FLAG, nvec, n),
                                   (unsigned long long)ar->base.data_par);
      *kind = WF_AR_ONESHOT_FLAG; *why = "flag one-shot requested";
      break;
    case WEFT_AR_QUICK_FP: case WEFT_AR_QUICK_INT8: case WEFT_AR_QUICK_INT4: case WEFT_AR_QUICK_FP8: {
      static const char *const whys[] = {
        "quick all-reduce requested: two-shot, wire = the input dtype (no compression)",
        "quick all-reduce requested: two-shot, wire = int8 + one f32 scale per 32 elements",
        "quick all-reduce requested: two-shot, wire = int4 + one f32 scale per 32 elements",
        "quick all-reduce requested: two-shot, wire = fp8 e4m3 + one f32 scale per 32 elements"};
      const int codec = algo - WEFT_AR_QUICK_FP;
      WF_CHECK_ARG(dtype == WEFT_BF16 || dtype == WEFT_F16,
                   OPFMT ": the quick all-reduce (%s) takes bf16 or f16, not %s", OPARGS,
                   kind_name(WF_AR_QUICK_FP + codec), dtype_name(dtype));
      const uint64_t need = wf_qr_data_need(codec, nvec, n);
      if (need > ar->base.data_par)
        return wf_error(WEFT_EINVAL, OPFMT ": %s of %llu bytes does not fit the workspace (needs %llu of %llu "
                        "per parity)", OPARGS, kind_name(WF_AR_QUICK_FP + codec), (unsigned long long)bytes,
                        (unsigned long long)need, (unsigned long long)ar->base.data_par);
      *kind = WF_AR_QUICK_FP + codec;
      *why = whys[codec];
      break;
    }
    default:
      return wf_error(WEFT_EINVAL, OPFMT ": unknown algorithm %d (0 auto, 1 oneshot, 2 twoshot, 3 oneshot-flag, "
                      "4-7 quick fp/int8/int4/fp8)", OPARGS, algo);
  }
  return 0;
}

int weft_ar_resolve(weft_ar *ar, size_t count, int dtype, int algo, int *kind, const char **why) {
  WF_CHECK_ARG(ar && kind, "allreduce resolve: NULL argument");
  const char *w;
  int rc = resolve(ar, count, dtype, algo & ~(WEFT_AR_NO_PDL | WEFT_AR_DETERMINISTIC), kind, &w);
  if (!rc && why) *why = w;
  return rc;
}

int weft_ar_set_param(weft_ar *ar, const char *name, int64_t value) {
  WF_CHECK_ARG(ar && name, "allreduce set_param: NULL argument");
  wf_ar_args *a = &ar->base;
  const int64_t v = value;
#define RANGE(lo, hi) WF_CHECK_ARG(v >= (lo) && v <= (hi), OPFMT ": set_param %s = %lld out of range [%lld, %lld]", \
                                   OPARGS, name, (long long)v, (long long)(lo), (long long)(hi))
  if (!strcmp(name, "grid")) { RANGE(0, WF_MAX_GRID); a->grid = (int)v; }
  else if (!strcmp(name, "threads")) {
    RANGE(0, WF_AR_FLAG_THREADS);
    WF_CHECK_ARG(v % 32 == 0, OPFMT ": set_param threads = %lld is not a multiple of 32", OPARGS, (long long)v);
    a->threads = (int)v;
  }
  else if (!strcmp(name, "sub")) { RANGE(0, 64); a->sub = (int)v; }
  else if (!strcmp(name, "split")) { RANGE(0, 1); a->split = (int)v; }
  else if (!strcmp(name, "blocks_per_sm")) { RANGE(1, 8); a->blocks_per_sm = (int)v; }
  else if (!strcmp(name, "oneshot_max")) {
    RANGE(0, (int64_t)a->lamport_slot);
    ar->oneshot_max = (size_t)v;
  }
  else if (!strcmp(name, "twoshot_min")) { RANGE(0, (int64_t)1 << 40); ar->twoshot_min = (size_t)v; }
  else return wf_error(WEFT_EINVAL, OPFMT ": set_param: unknown parameter '%s' (grid, threads, sub, split, "
                       "blocks_per_sm, oneshot_max, twoshot_min)", OPARGS, name);
#undef RANGE
  return 0;
}

int weft_ar_shape(weft_ar *ar, size_t count, int dtype, int algo, int *grid, int *threads) {
  WF_CHECK_ARG(ar && grid && threads, "allreduce shape: NULL argument");
  int kind;
  const char *why;
  int rc = resolve(ar, count, dtype, algo & ~(WEFT_AR_NO_PDL | WEFT_AR_DETERMINISTIC), &kind, &why);
  if (rc) return rc;
  wf_ar_args a = ar->base;
  a.count = count;
  a.dtype = dtype;
  a.kind = kind;
  a.determ = (algo & WEFT_AR_DETERMINISTIC) != 0;
  int e = kind >= WF_AR_QUICK_FP ? wf_qr_shape(&a, grid, threads) : wf_ar_shape(&a, grid, threads);
  return e ? wf_cuda_err(__FILE__, __LINE__, "allreduce shape", (cudaError_t)e) : 0;
}

int weft_ar_run(weft_ar *ar, const void *in, void *out, size_t count, int dtype, int algo,
                void *stream) {
  WF_CHECK_ARG(ar, "allreduce run: handle is NULL");
  int rc = wf_dev_usable(&ar->dc, "allreduce");
  if (rc) return rc;
  WF_CHECK_ARG(in && out, OPFMT ": NULL buffer", OPARGS);
  /* the contract's own check, for C callers (and a last guard): weft's Lua
   * path sent a misaligned buffer to NCCL in its custom_ar rule already */
  WF_CHECK_ARG(((uintptr_t)in & 15) == 0 && ((uintptr_t)out & 15) == 0,
               OPFMT ": buffers must be 16-byte aligned (in %p, out %p)", OPARGS, in, out);
  int kind;
  const char *why;
  const int pdl = ar->pdl && !(algo & WEFT_AR_NO_PDL);
  rc = resolve(ar, count, dtype, algo & ~(WEFT_AR_NO_PDL | WEFT_AR_DETERMINISTIC), &kind, &why);
  if (rc) return rc;
  cudaStream_t s = stream ? (cudaStream_t)stream : wf_cuda_current_stream();
  rc = wf_dev_begin(&ar->dc, s, "allreduce");
  if (rc) return rc;
  wf_ar_args a = ar->base;
  a.in = in;
  a.out = out;
  a.count = count;
  a.dtype = dtype;
  a.kind = kind;
  a.timeout_ns = (uint64_t)ar->dc.timeout_ms * 1000000u;
  a.pdl = pdl;
  a.determ = (algo & WEFT_AR_DETERMINISTIC) != 0;
  int e = kind >= WF_AR_QUICK_FP ? wf_qr_launch(&a, s) : wf_ar_launch(&a, s);
  if (e) rc = wf_cuda_err(__FILE__, __LINE__, "allreduce kernel launch", (cudaError_t)e);
  wf_dev_end(&ar->dc, s, !e);
  if (rc) wf_error_context(rc, OPFMT ": %s, %zu x %s", OPARGS, kind_name(kind), count, dtype_name(dtype));
  return rc;
}

int weft_ar_check_error(weft_ar *ar) {
  WF_CHECK_ARG(ar, "allreduce check_error: handle is NULL");
  return wf_dev_check_error(&ar->dc);
}

int weft_ar_abort(weft_ar *ar) {
  WF_CHECK_ARG(ar, "allreduce abort: handle is NULL");
  wf_dev_abort(&ar->dc);
  return 0;
}

int weft_qr_codec_step(int step, int codec, int dtype, int world, const void *in, void *wire, void *out,
                       size_t count, void *stream) {
  int rc = qr_step_check(step, codec, dtype, world, in, wire, out, count);
  if (rc) return rc;
  cudaStream_t s = stream ? (cudaStream_t)stream : wf_cuda_current_stream();
  int e = wf_qr_step(step, codec, dtype, world, in, wire, out, count, s);
  return e ? wf_cuda_err(__FILE__, __LINE__, "quick codec step launch", (cudaError_t)e) : 0;
}

#endif /* WEFT_HAVE_CUDA */
