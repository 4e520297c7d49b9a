/* fusion.c — host side of the fused all-reduce + residual add + RMSNorm
 * (kernels/fused_norm.cu): the workspace (one VMM allocation per rank,
 * src/cuda/vmm.c) and its layout, the host-mapped abort/error words, validation
 * before launch, the one-shot/two-shot choice, and the error report.
 *
 * The workspace's lifecycle and its agreement at create are fused_ws.c's,
 * shared with the other patterns (fusion_ext.c); here: its layout and init,
 * the call's checks and the launch. */
#include "fusion_internal.h"
#include "fused_ws.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *algo_name(int algo) {
  return algo == WEFT_FUSION_ONESHOT ? "one-shot" : algo == WEFT_FUSION_TWOSHOT ? "two-shot" : "auto";
}

/* Layout of one rank's workspace; a pure function of agreed numbers. */
typedef struct layout {
  int64_t off_state, off_flags, off_rs, off_ag, off_lamport, lamport_buf, total;
} layout;

static layout layout_of(const weft_fusion_opts *o, int world) {
  layout l;
  const int64_t row = wf_fws_row_bytes(o), rows_per = wf_fws_rows_per(o, world);
  const int64_t inbox = wf_fws_align((int64_t)world * rows_per * row, 4096);
  l.off_state = 0;
  l.off_flags = wf_fws_align((int64_t)sizeof(wf_fused_state), 4096);
  l.off_rs = wf_fws_align(l.off_flags + WF_FWS_FLAG_BYTES, 4096);
  l.off_ag = l.off_rs + inbox;
  l.off_lamport = l.off_ag + inbox;
  l.lamport_buf = wf_fws_align((int64_t)world * wf_fws_os_tokens(o) * row, 4096);
  l.total = l.off_lamport + 3 * l.lamport_buf;
  return l;
}
static int64_t layout_bytes(const weft_fusion_opts *o, int world) { return layout_of(o, world).total; }

static int check_opts(const weft_fusion_opts *o, int world, const char *op) {
  int rc = wf_fws_check_size(o, world, WF_FUSED_MAX_HIDDEN, op);
  if (rc) return rc;
  WF_CHECK_ARG(wf_dev_esize(o->dtype), "%s: dtype %s (%d) not supported (f32, f16, bf16)", op,
               wf_dev_dtype_name(o->dtype), o->dtype);
  return 0;
}

/* AUTO's one-shot limit. Two ranks: none (one-shot whenever the workspace
 * holds it). There both kernels move the same bytes per link direction (the
 * one-shot the whole tensor once, the two-shot half of it twice), and the
 * one-shot needs no barrier; measured on 2 x H200 (bench/results/
 * fused-nvidia-h200-x2-2026-11-30.md) the two-shot was ahead only at 8 MiB
 * (4 %) and 16 MiB (1.4 %) and behind by 7-12 % at 32, 64 and 128 MiB, so
 * no single switch point beats "never". More ranks: the one-shot moves
 * (W-1) times the bytes per rank; 2 MiB up to 4 ranks, 512 KiB beyond
 * (not yet measured). */
static int64_t default_oneshot_max(int world) {
  return world == 2 ? WF_FWS_NO_LIMIT : world <= 4 ? 2 * WF_FWS_MIB : 512 * WF_FWS_KIB;
}

WF_FWS_HANDLE_STRUCT(weft_fusion, wf_fused_args);

#if WEFT_HAVE_CUDA

static const char *site_name(unsigned site) {
  switch (site) {
    case WF_FUSED_SITE_LAMPORT: return "one-shot data poll";
    case WF_FUSED_SITE_RS: return "two-shot reduce-scatter flag";
    case WF_FUSED_SITE_AG: return "two-shot all-gather flag";
    case WF_FUSED_SITE_ROW: return "one-shot row exchange among this rank's blocks";
    case WF_FUSED_SITE_AGREE: return "agreement check (the peer's announcement of the call)";
    default: return "unknown wait";
  }
}

/* wf_agree_d0(FUSED or QFUSED, algo or codec, dtype, pattern, grid, threads, flags), d1 = tokens << 32 | hidden */
static void describe(uint64_t d0, uint64_t d1, char *buf, size_t n) {
  static const char *const pattern[] = {"all_reduce", "all_reduce + rmsnorm", "all_reduce + rmsnorm + fp8"};
  static const char *const codec[] = {"fp", "int8", "int4", "fp8"};
  const unsigned fam = (unsigned)(d0 >> 56), algo = (unsigned)(d0 >> 48) & 0xff,
                 dt = (unsigned)(d0 >> 40) & 0xff, pat = (unsigned)(d0 >> 32) & 0xff,
                 grid = (unsigned)(d0 >> 16) & 0xffff, thr = (unsigned)(d0 >> 6) & 0x3ff, fl = (unsigned)d0 & 0x3f;
  char how[48];
  if (fam == WF_AGREE_QFUSED) snprintf(how, sizeof how, "quick-%s two-shot", algo < 4 ? codec[algo] : "?");
  else snprintf(how, sizeof how, "%s", algo == WF_FUSED_ONESHOT ? "one-shot" : algo == WF_FUSED_TWOSHOT ? "two-shot" : "?");
  if (fam != WF_AGREE_FUSED && fam != WF_AGREE_QFUSED) {
    snprintf(buf, n, "an unknown call (%#llx %#llx)", (unsigned long long)d0, (unsigned long long)d1);
    return;
  }
  char shape[40] = "";
  if (grid) snprintf(shape, sizeof shape, ", grid %u x %u", grid, thr);
  snprintf(buf, n, "%s %s %s, %u tokens x %u%s%s%s%s", pat < 3 ? pattern[pat] : "?", how, wf_dev_dtype_name((int)dt),
           (unsigned)(d1 >> 32), (unsigned)d1, shape, fl & WF_FUSED_GEMMA ? ", gemma" : "",
           fl & WF_FUSED_FP32_ACC ? ", fp32 accumulation" : "", fl & WF_FUSED_DETERMINISTIC ? ", deterministic" : "");
}

static const wf_dev_names FUSION_NAMES = {
  .what = "fusion", .unit = "workspace",
  .refuse_hint = "destroy it and recreate it (or use the unfused path)",
  .timeout_hint = "destroy and recreate it", .site = site_name, .describe = describe,
};

/* State and flags zeroed, Lamport buffers filled with the sentinel. */
static int clear(wf_fws *w, cudaStream_t s) {
  const layout l = layout_of(&w->opts, w->world);
  return wf_fused_init(wf_dev_peer(&w->dc, w->me), (uint64_t)l.off_lamport, 3u * (uint64_t)l.lamport_buf,
                       (uint64_t)l.off_rs, w->opts.dtype, s);
}

static void bind(wf_fws *w) {
  weft_fusion *f = (weft_fusion *)w;
  const layout l = layout_of(&w->opts, w->world);
  wf_fused_args *a = &f->base;
  a->rank = w->me;
  a->world = w->world;
  a->num_sms = w->num_sms;
  a->off_state = (uint64_t)l.off_state;
  a->off_flags = (uint64_t)l.off_flags;
  a->off_rs = (uint64_t)l.off_rs;
  a->off_ag = (uint64_t)l.off_ag;
  a->off_lamport = (uint64_t)l.off_lamport;
  a->lamport_buf_bytes = (uint64_t)l.lamport_buf;
  for (int i = 0; i < w->world; i++) a->peer[i] = wf_dev_peer(&w->dc, i);
  a->err_dev = &((wf_fused_state *)((char *)a->peer[w->me] + l.off_state))->err_dev;
  a->abort_host = w->dc.abort_dev;
  a->err_host = w->dc.err_dev;
  a->agree = wf_dev_agreement(&w->dc);
}

#endif

static const wf_fws_family FAMILY = {
  .what = "fusion", .oneshot_env = "WEFT_FUSION_ONESHOT_MAX", .default_oneshot_max = default_oneshot_max,
  .check_opts = check_opts, .workspace_bytes = layout_bytes,
#if WEFT_HAVE_CUDA
  .names = &FUSION_NAMES, .clear = clear, .agree_offset = offsetof(wf_fused_state, agree), .bind = bind,
#endif
};

WF_FWS_HANDLE_API(weft_fusion, weft_fusion, FAMILY, "fusion")

int weft_fusion_sufficient(weft_fusion *f, int64_t tokens, int64_t hidden, int dtype, int algo,
                           int *ok) {
  WF_CHECK_ARG(f && ok, "fusion sufficient: NULL argument");
  *ok = hidden >= 8 && hidden % 8 == 0 && wf_dev_esize(dtype) && wf_fws_fits(&f->ws, tokens, hidden, dtype, algo);
  return 0;
}

int weft_fusion_get_info(weft_fusion *f, weft_fusion_info *info) {
  WF_CHECK_ARG(f && info, "fusion get_info: NULL argument");
  info->rank = f->ws.me;
  info->world = f->ws.world;
  info->dtype = f->ws.opts.dtype;
  info->max_tokens = f->ws.opts.max_tokens;
  info->hidden = f->ws.opts.hidden;
  info->oneshot_max_tokens = f->ws.os_tokens;
  info->oneshot_max_bytes = f->ws.oneshot_max_bytes;
  info->workspace_bytes = f->ws.ws_bytes;
  return 0;
}

#if !WEFT_HAVE_CUDA

int weft_fusion_run(weft_fusion *f, const weft_fusion_params *p) {
  (void)f; (void)p; (void)algo_name;
  return wf_dev_nodev("fusion run");
}
int weft_fusion_resolve(weft_fusion *f, const weft_fusion_params *p, int *algo, const char **why) {
  (void)f; (void)p; (void)algo; (void)why;
  return wf_dev_nodev("fusion resolve");
}
int wf_fusion_geometry(weft_fusion *f, const weft_fusion_params *p, int *algo, int *blocks,
                       int *threads, int *cluster) {
  (void)f; (void)p; (void)algo; (void)blocks; (void)threads; (void)cluster;
  return wf_dev_nodev("fusion geometry");
}

#else

/* Everything run checks before it launches; also picks the kernel. */
static int validate(const weft_fusion *f, const weft_fusion_params *p, const char *op, int *algo,
                    const char **why) {
  WF_CHECK_ARG(p, "%s: NULL params", op);
  WF_CHECK_ARG(p->pattern >= WEFT_FUSION_AR && p->pattern <= WEFT_FUSION_AR_RMSNORM_FP8,
               "%s: unknown pattern %d (0 AR, 1 AR+RMSNorm, 2 AR+RMSNorm+FP8)", op, p->pattern);
  WF_CHECK_ARG(p->algo >= WEFT_FUSION_AUTO && p->algo <= WEFT_FUSION_TWOSHOT,
               "%s: unknown algorithm %d (0 auto, 1 one-shot, 2 two-shot)", op, p->algo);
  WF_CHECK_ARG((p->flags & ~31) == 0, "%s: unknown flags 0x%x", op, (unsigned)p->flags);
  WF_CHECK_ARG(!(p->flags & WEFT_FUSION_DETERMINISTIC) || (p->flags & WEFT_FUSION_FP32_ACC),
               "%s: deterministic mode needs f32 accumulation (FUSION_FP32_ACC)", op);
  const int es = wf_dev_esize(p->dtype);
  WF_CHECK_ARG(es, "%s: dtype %s (%d) not supported (f32, f16, bf16)", op, wf_dev_dtype_name(p->dtype),
               p->dtype);
  WF_CHECK_ARG(es <= wf_dev_esize(f->ws.opts.dtype),
               "%s: dtype %s is wider than the workspace's %s (recreate it for %s)", op,
               wf_dev_dtype_name(p->dtype), wf_dev_dtype_name(f->ws.opts.dtype), wf_dev_dtype_name(p->dtype));
  WF_CHECK_ARG(p->tokens >= 0, "%s: tokens %lld < 0", op, (long long)p->tokens);
  WF_CHECK_ARG(p->hidden >= 8 && p->hidden % 8 == 0 && p->hidden <= WF_FUSED_MAX_HIDDEN,
               "%s: hidden %lld must be a multiple of 8 in [8, %d]", op, (long long)p->hidden,
               WF_FUSED_MAX_HIDDEN);
  WF_CHECK_ARG(p->hidden <= f->ws.opts.hidden, "%s: hidden %lld exceeds the workspace's %lld", op,
               (long long)p->hidden, (long long)f->ws.opts.hidden);
  WF_CHECK_ARG(p->tokens <= f->ws.opts.max_tokens,
               "%s: %lld tokens exceed the declared maximum of %lld (grow the workspace)", op,
               (long long)p->tokens, (long long)f->ws.opts.max_tokens);
  const int norm = p->pattern != WEFT_FUSION_AR, fp8 = p->pattern == WEFT_FUSION_AR_RMSNORM_FP8;
  WF_CHECK_ARG(p->input, "%s: input is NULL", op);
  WF_CHECK_ARG(norm || p->out, "%s: AR pattern needs out", op);
  WF_CHECK_ARG(!norm || (p->residual && p->weight && p->residual_out),
               "%s: RMSNorm patterns need residual, weight and residual_out", op);
  WF_CHECK_ARG(!norm || fp8 || p->norm_out, "%s: AR+RMSNorm needs norm_out", op);
  WF_CHECK_ARG(!fp8 || (p->quant_out && p->scale), "%s: FP8 pattern needs quant_out and scale", op);
  WF_CHECK_ARG(!norm || (p->eps >= 0.f && p->eps == p->eps), "%s: eps %g must be >= 0", op,
               (double)p->eps);
  const size_t tb = (size_t)p->tokens * (size_t)p->hidden * (size_t)es;
  struct { const char *name; const void *ptr; size_t len; } buf[] = {
      {"input", p->input, tb},
      {"residual", norm ? p->residual : NULL, tb},
      {"weight", norm ? p->weight : NULL, (size_t)p->hidden * (size_t)es},
      {"out", norm ? NULL : p->out, tb},
      {"residual_out", norm ? p->residual_out : NULL, tb},
      {"norm_out", norm ? p->norm_out : NULL, tb},
      {"quant_out", fp8 ? p->quant_out : NULL, (size_t)p->tokens * (size_t)p->hidden},
      {"scale", fp8 ? (const void *)p->scale : NULL, sizeof(float)},
  };
  const int nb = (int)(sizeof buf / sizeof buf[0]);
  for (int i = 0; i < nb; i++) {
    const size_t al = i == 7 ? 4 : i == 6 ? 8 : 16;
    WF_CHECK_ARG(((uintptr_t)buf[i].ptr & (al - 1)) == 0, "%s: %s (%p) must be %zu-byte aligned",
                 op, buf[i].name, buf[i].ptr, al);
  }
  /* outputs (index >= 3, bar scale) against everything else; in-place pairs allowed */
  for (int i = 3; i < 7; i++)
    for (int j = 0; j < nb; j++) {
      if (i == j || !wf_fws_overlaps(buf[i].ptr, buf[i].len, buf[j].ptr, buf[j].len)) continue;
      const int inplace = buf[i].ptr == buf[j].ptr && buf[i].len == buf[j].len &&
                          ((i == 3 && j == 0) || (i == 4 && j == 1) || (i == 5 && j == 0));
      WF_CHECK_ARG(inplace, "%s: %s overlaps %s (only out == input, residual_out == residual "
                   "and norm_out == input are allowed)", op, buf[i].name, buf[j].name);
    }
  /* the quick two-shot (kernels/quick_fused.cu): a compressed wire, opted in by the caller */
  if (p->quick) {
    WF_CHECK_ARG(p->quick == WEFT_QR_INT8 || p->quick == WEFT_QR_INT4 || p->quick == WEFT_QR_FP8,
                 "%s: quick codec %d unknown (0 exact, 1 int8, 2 int4, 3 fp8)", op, p->quick);
    WF_CHECK_ARG(p->pattern == WEFT_FUSION_AR_RMSNORM, "%s: the quick codec serves the AR + RMSNorm pattern "
                 "only (pattern %d: use the exact kernel, or the quick all-reduce for a plain sum)", op, p->pattern);
    WF_CHECK_ARG(p->dtype == WEFT_BF16 || p->dtype == WEFT_F16, "%s: the quick codec takes bf16 or f16, not %s",
                 op, wf_dev_dtype_name(p->dtype));
    WF_CHECK_ARG(f->ws.dc.n == 2 || f->ws.dc.n == 4 || f->ws.dc.n == 6 || f->ws.dc.n == 8,
                 "%s: the quick codec has kernels for 2, 4, 6 or 8 ranks, not %d", op, f->ws.dc.n);
    WF_CHECK_ARG(p->algo != WEFT_FUSION_ONESHOT, "%s: the quick codec is a two-shot (one-shot requested)", op);
    *algo = WEFT_FUSION_TWOSHOT;
    *why = "quick two-shot (compressed wire) requested";
    return 0;
  }
  /* the kernel */
  return wf_fws_choose(&f->ws, p->algo, p->tokens, p->hidden, p->dtype, (int64_t)tb, op, algo, why);
}

int weft_fusion_resolve(weft_fusion *f, const weft_fusion_params *p, int *algo, const char **why) {
  WF_CHECK_ARG(f && algo, "fusion resolve: NULL argument");
  char op[128];
  snprintf(op, sizeof op, "fusion (group '%s', rank %d)", f->ws.dc.group, f->ws.dc.me);
  const char *w;
  int rc = validate(f, p, op, algo, &w);
  if (!rc && why) *why = w;
  return rc;
}

int wf_fusion_geometry(weft_fusion *f, const weft_fusion_params *p, int *algo, int *blocks,
                       int *threads, int *cluster) {
  WF_CHECK_ARG(f && p && algo && blocks && threads && cluster, "fusion geometry: NULL argument");
  const char *why;
  int rc = validate(f, p, "fusion geometry", algo, &why);
  if (rc) return rc;
  wf_fused_args a = f->base;
  a.tokens = (int32_t)(p->tokens > 0 ? p->tokens : 1);
  a.hidden = (int32_t)p->hidden;
  a.pattern = p->pattern;
  a.flags = p->flags;
  a.dtype = p->dtype;
  int e;
  if (p->quick) {
    *cluster = 1;
    e = wf_qr_fused_grid(&a, p->quick, blocks, threads);
  } else {
    e = wf_fused_grid(&a, *algo, blocks, threads, cluster);
  }
  return e ? wf_cuda_err(__FILE__, __LINE__, "fusion geometry", (cudaError_t)e) : 0;
}

int weft_fusion_run(weft_fusion *f, const weft_fusion_params *p) {
  WF_CHECK_ARG(f, "fusion run: handle is NULL");
  int rc = wf_dev_usable(&f->ws.dc, "fusion run");
  if (rc) return rc;
  char op[128];
  snprintf(op, sizeof op, "fusion run (group '%s', rank %d)", f->ws.dc.group, f->ws.dc.me);
  int algo;
  const char *why;
  rc = validate(f, p, op, &algo, &why);
  if (rc) return rc;
  if (p->tokens == 0) return 0; /* same on every rank: nothing launched anywhere */
  cudaStream_t s = p->stream ? (cudaStream_t)p->stream : wf_cuda_current_stream();
  rc = wf_dev_begin(&f->ws.dc, s, "fusion run");
  if (rc) return rc;
  wf_fused_args a = f->base;
  a.in = p->input;
  a.res_in = p->residual;
  a.gamma = p->weight;
  a.out = p->out;
  a.res_out = p->residual_out;
  a.norm_out = p->pattern == WEFT_FUSION_AR ? NULL : p->norm_out;
  a.quant_out = p->quant_out;
  a.scale = p->scale;
  a.eps = p->eps;
  a.tokens = (int32_t)p->tokens;
  a.hidden = (int32_t)p->hidden;
  a.pattern = p->pattern;
  a.flags = p->flags;
  a.dtype = p->dtype;
  a.timeout_ns = (uint64_t)f->ws.dc.timeout_ms * 1000000u;
  int e = p->quick ? wf_qr_fused_launch(&a, p->quick, s) : wf_fused_launch(&a, algo, s);
  if (e) rc = wf_cuda_err(__FILE__, __LINE__, "fused kernel launch", (cudaError_t)e);
  wf_dev_end(&f->ws.dc, s, !e);
  if (rc) wf_error_context(rc, "%s: %s%s, %lld x %lld %s", op, p->quick ? "quick " : "", algo_name(algo),
                           (long long)p->tokens, (long long)p->hidden, wf_dev_dtype_name(p->dtype));
  return rc;
}

#endif /* WEFT_HAVE_CUDA */
