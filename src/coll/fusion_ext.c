/* fusion_ext.c — host side of the fusion patterns beyond AR + residual +
 * RMSNorm (kernels/fused_ext.cu): MoE reduction / MoE finalize + all-reduce
 * + residual + RMSNorm, pre/post norm, reduce-scatter + residual + RMSNorm
 * (+ all-gather). Its own workspace (layout: fusion_ext_internal.h) whose
 * lifecycle is fused_ws.c's, as src/coll/fusion.c's is (devcoll.h: VMM
 * mapping, host words, bounded waits, error reports, one call in flight).
 * Everything a call needs is validated before anything is enqueued. */
#include "fusion_ext_internal.h"
#include "fused_ws.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct layout {
  int64_t off_flags, off_os, off_rs, off_ag, os_slot, rs_slot, total;
} layout;

static layout layout_of(const weft_fusion_opts *o, int world) {
  layout l;
  const int64_t row = wf_fws_row_bytes(o), rows_per = wf_fws_rows_per(o, world);
  l.os_slot = wf_fws_os_tokens(o) * row;
  l.rs_slot = rows_per * row;
  l.off_flags = wf_fws_align((int64_t)sizeof(wfx_state), 4096);
  l.off_os = wf_fws_align(l.off_flags + WF_FWS_FLAG_BYTES, 4096);
  l.off_rs = l.off_os + wf_fws_align(2 * (int64_t)world * l.os_slot, 4096);
  l.off_ag = l.off_rs + wf_fws_align(2 * (int64_t)world * l.rs_slot, 4096);
  l.total = l.off_ag + wf_fws_align(2 * (int64_t)world * l.rs_slot, 4096);
  return l;
}
static int64_t layout_bytes(const weft_fusion_opts *o, int world) { return layout_of(o, world).total; }

static int check_opts(const weft_fusion_opts *o, int world, const char *op) {
  int rc = wf_fws_check_size(o, world, WFX_MAX_HIDDEN, op);
  if (rc) return rc;
  WF_CHECK_ARG(o->dtype == WEFT_BF16 || o->dtype == WEFT_F16,
               "%s: dtype %s (%d) not supported (bf16, f16)", op, wf_dev_dtype_name(o->dtype), o->dtype);
  return 0;
}

/* AUTO's one-shot limit (bytes of the call): not measured for these kernels
 * yet; the AR + RMSNorm kernel's rule for more than 2 ranks (2 MiB up to 4
 * ranks, 512 KiB beyond), and 2 MiB at 2 ranks (the flag one-shot waits
 * once per block, unlike the Lamport one). WEFT_FUSION_EXT_ONESHOT_MAX. */
static int64_t default_oneshot_max(int world) { return world <= 4 ? 2 * WF_FWS_MIB : 512 * WF_FWS_KIB; }

static const char *pattern_name(int p) {
  switch (p) {
    case WEFT_FX_MOE_AR_RMSNORM: return "MoE + all-reduce + RMSNorm";
    case WEFT_FX_MOE_FINALIZE_AR_RMSNORM: return "MoE finalize + all-reduce + RMSNorm";
    case WEFT_FX_AR_PREPOST_RMSNORM: return "all-reduce + pre/post RMSNorm";
    case WEFT_FX_RS_RMSNORM: return "reduce-scatter + RMSNorm";
    default: return "unknown pattern";
  }
}

/* The checks that need no workspace: the call itself. */
static int check_call(const weft_fusion_ext_params *p, int world, const char *op) {
  WF_CHECK_ARG(p, "%s: NULL params", op);
  WF_CHECK_ARG(p->pattern >= WEFT_FX_MOE_AR_RMSNORM && p->pattern <= WEFT_FX_RS_RMSNORM,
               "%s: unknown pattern %d (1 MoE, 2 MoE finalize, 3 pre/post norm, 4 reduce-scatter)",
               op, p->pattern);
  WF_CHECK_ARG(p->algo >= WEFT_FUSION_AUTO && p->algo <= WEFT_FUSION_TWOSHOT,
               "%s: unknown algorithm %d (0 auto, 1 one-shot, 2 two-shot)", op, p->algo);
  WF_CHECK_ARG((p->flags & ~(WEFT_FX_GEMMA | WEFT_FX_PDL | WEFT_FX_SCALES_DTYPE)) == 0,
               "%s: unknown flags 0x%x", op, (unsigned)p->flags);
  WF_CHECK_ARG(p->dtype == WEFT_BF16 || p->dtype == WEFT_F16,
               "%s: dtype %s (%d) not supported by the fused kernels (bf16, f16)", op,
               wf_dev_dtype_name(p->dtype), p->dtype);
  WF_CHECK_ARG(p->tokens >= 0, "%s: tokens %lld < 0", op, (long long)p->tokens);
  WF_CHECK_ARG(p->hidden >= 8 && p->hidden % 8 == 0 && p->hidden <= WFX_MAX_HIDDEN,
               "%s: hidden %lld must be a multiple of 8 in [8, %d]", op, (long long)p->hidden,
               WFX_MAX_HIDDEN);
  const int moe = p->pattern <= WEFT_FX_MOE_FINALIZE_AR_RMSNORM;
  const int fin = p->pattern == WEFT_FX_MOE_FINALIZE_AR_RMSNORM;
  const int rs = p->pattern == WEFT_FX_RS_RMSNORM, pp = p->pattern == WEFT_FX_AR_PREPOST_RMSNORM;
  WF_CHECK_ARG(!moe || (p->top_k >= 1 && p->top_k <= WFX_MAX_TOPK), "%s: top_k %d out of range [1, %d]",
               op, p->top_k, WFX_MAX_TOPK);
  WF_CHECK_ARG(!rs || p->tokens % world == 0,
               "%s: %lld tokens do not divide among %d ranks (reduce-scatter by tokens: pad the batch)",
               op, (long long)p->tokens, world);
  WF_CHECK_ARG(!rs || p->algo != WEFT_FUSION_ONESHOT,
               "%s: reduce-scatter has one kernel (two-shot's first half); one-shot refused", op);
  WF_CHECK_ARG(p->input && p->residual && p->weight && p->residual_out && p->norm_out,
               "%s: needs input, residual, weight, residual_out and norm_out", op);
  WF_CHECK_ARG(!moe || p->scales, "%s: MoE patterns need scales", op);
  WF_CHECK_ARG(!fin || (p->permutation && p->expert_rows >= 1),
               "%s: MoE finalize needs the permutation and expert_rows >= 1", op);
  WF_CHECK_ARG(!pp || p->weight_pre, "%s: pre/post norm needs weight_pre", op);
  WF_CHECK_ARG(p->eps >= 0.f && p->eps == p->eps && (!pp || (p->eps_pre >= 0.f && p->eps_pre == p->eps_pre)),
               "%s: eps must be >= 0", op);
  const size_t es = 2, row = (size_t)p->hidden * es, tb = (size_t)p->tokens * row;
  const size_t sl = rs ? tb / (size_t)world : tb;
  const size_t in_b = fin ? (size_t)p->expert_rows * row : moe ? tb * (size_t)p->top_k : tb;
  const size_t sc_b = (size_t)p->tokens * (size_t)(moe ? p->top_k : 0) *
                      ((p->flags & WEFT_FX_SCALES_DTYPE) ? es : 4);
  struct { const char *name; const void *ptr; size_t len; size_t al; } buf[] = {
      {"input", p->input, in_b, 16},
      {"scales", moe ? p->scales : NULL, sc_b, (p->flags & WEFT_FX_SCALES_DTYPE) ? 2 : 4},
      {"permutation", fin ? (const void *)p->permutation : NULL, (size_t)p->tokens * (size_t)p->top_k * 4, 4},
      {"shared_output", moe ? p->shared_output : NULL, tb, 16},
      {"residual", p->residual, sl, 16},
      {"weight", p->weight, row, 16},
      {"weight_pre", pp ? p->weight_pre : NULL, row, 16},
      {"residual_out", p->residual_out, sl, 16},
      {"norm_out", p->norm_out, sl, 16},
      {"gathered_out", rs ? p->gathered_out : NULL, tb, 16},
  };
  const int nb = (int)(sizeof buf / sizeof buf[0]);
  for (int i = 0; i < nb; i++)
    WF_CHECK_ARG(((uintptr_t)buf[i].ptr & (buf[i].al - 1)) == 0, "%s: %s (%p) must be %zu-byte aligned",
                 op, buf[i].name, buf[i].ptr, buf[i].al);
  /* outputs (index >= 7) against everything; only residual_out == residual in place */
  for (int i = 7; i < nb; i++)
    for (int j = 0; j < nb; j++) {
      if (i == j || !wf_fws_overlaps(buf[i].ptr, buf[i].len, buf[j].ptr, buf[j].len)) continue;
      const int inplace = i == 7 && j == 4 && buf[i].ptr == buf[j].ptr;
      WF_CHECK_ARG(inplace, "%s: %s overlaps %s (only residual_out == residual is allowed)", op,
                   buf[i].name, buf[j].name);
    }
  return 0;
}

WF_FWS_HANDLE_STRUCT(weft_fusion_ext, wfx_args);

#if WEFT_HAVE_CUDA

/* The kernel reports the wait in the low 4 bits of the error word's site
 * byte and the call's pattern in the high 4 (kernels/fused_ext.cu), so the
 * error names the operation that a late peer left waiting. */
static const char *site_name(unsigned site) {
  static const char *const names[5][2] = {
    {"flag after the peers' pushes (one-shot / reduce-scatter)", "all-gather flag (two-shot)"},
    {"flag after the peers' pushes of the MoE + all-reduce + RMSNorm kernel (fused_moe_allreduce_rmsnorm)",
     "all-gather flag of the MoE + all-reduce + RMSNorm kernel (fused_moe_allreduce_rmsnorm, two-shot)"},
    {"flag after the peers' pushes of the MoE finalize + all-reduce + RMSNorm kernel "
     "(fused_moe_finalize_allreduce_rmsnorm)",
     "all-gather flag of the MoE finalize + all-reduce + RMSNorm kernel (fused_moe_finalize_allreduce_rmsnorm, "
     "two-shot)"},
    {"flag after the peers' pushes of the all-reduce + pre/post RMSNorm kernel (fused_allreduce_prepost_rmsnorm)",
     "all-gather flag of the all-reduce + pre/post RMSNorm kernel (fused_allreduce_prepost_rmsnorm, two-shot)"},
    {"flag after the peers' pushes of the reduce-scatter + RMSNorm kernel (fused_reduce_scatter_rmsnorm)",
     "all-gather flag of the reduce-scatter + RMSNorm kernel (fused_reduce_scatter_rmsnorm)"},
  };
  const unsigned wait = site & 15u, pat = site >> 4;
  if (wait == WFX_SITE_AGREE) return "agreement check (the peer's announcement of the call)";
  if (wait != WFX_SITE_PUSH && wait != WFX_SITE_GATHER) return "unknown wait";
  return names[pat <= 4 ? pat : 0][wait - 1];
}

/* wf_agree_d0(EXT, algo, dtype, pattern, grid, threads, flags), d1 = tokens << 32 | hidden */
static void describe(uint64_t d0, uint64_t d1, char *buf, size_t n) {
  static const char *const pattern[] = {"?", "moe + all_reduce + rmsnorm", "moe finalize + all_reduce + rmsnorm",
                                        "all_reduce + pre/post rmsnorm", "reduce_scatter + rmsnorm"};
  const unsigned fam = (unsigned)(d0 >> 56), algo = (unsigned)(d0 >> 48) & 0xff,
                 dt = (unsigned)(d0 >> 40) & 0xff, pat = (unsigned)(d0 >> 32) & 0xff,
                 grid = (unsigned)(d0 >> 16) & 0xffff, thr = (unsigned)(d0 >> 6) & 0x3ff;
  if (fam != WF_AGREE_EXT) {
    snprintf(buf, n, "an unknown call (%#llx %#llx)", (unsigned long long)d0, (unsigned long long)d1);
    return;
  }
  snprintf(buf, n, "%s %s %s, %u tokens x %u, grid %u x %u", pat < 5 ? pattern[pat] : "?",
           algo == WFX_ONESHOT ? "one-shot" : algo == WFX_TWOSHOT ? "two-shot" : "?", wf_dev_dtype_name((int)dt),
           (unsigned)(d1 >> 32), (unsigned)d1, grid, thr);
}

static const wf_dev_names NAMES = {
  .what = "fusion_ext", .unit = "workspace",
  .refuse_hint = "destroy it and recreate it (or use the unfused path)",
  .timeout_hint = "destroy and recreate it", .site = site_name, .describe = describe,
};

/* state and flags zeroed (the inboxes need nothing: flags say when they hold data) */
static int clear(wf_fws *w, cudaStream_t s) {
  return (int)cudaMemsetAsync(wf_dev_peer(&w->dc, w->me), 0, (size_t)layout_of(&w->opts, w->world).off_os, s);
}

static void bind(wf_fws *w) {
  weft_fusion_ext *f = (weft_fusion_ext *)w;
  const layout l = layout_of(&w->opts, w->world);
  wfx_args *a = &f->base;
  a->rank = w->me;
  a->world = w->world;
  a->num_sms = w->num_sms;
  const char *sh = getenv("WEFT_ALLOW_SHARED_GPU");
  a->shared_gpu = sh && !strcmp(sh, "1");
  a->off_flags = (uint64_t)l.off_flags;
  a->off_os = (uint64_t)l.off_os;
  a->off_rs = (uint64_t)l.off_rs;
  a->off_ag = (uint64_t)l.off_ag;
  a->os_slot = (uint64_t)l.os_slot;
  a->rs_slot = (uint64_t)l.rs_slot;
  for (int i = 0; i < w->world; i++) a->peer[i] = wf_dev_peer(&w->dc, i);
  a->err_dev = &((wfx_state *)a->peer[w->me])->err_dev;
  a->abort_host = w->dc.abort_dev;
  a->err_host = w->dc.err_dev;
  a->agree = wf_dev_agreement(&w->dc);
}

#endif

static const wf_fws_family FAMILY = {
  .what = "fusion_ext", .oneshot_env = "WEFT_FUSION_EXT_ONESHOT_MAX",
  .default_oneshot_max = default_oneshot_max, .check_opts = check_opts, .workspace_bytes = layout_bytes,
#if WEFT_HAVE_CUDA
  .names = &NAMES, .clear = clear, .agree_offset = offsetof(wfx_state, agree), .bind = bind,
#endif
};

WF_FWS_HANDLE_API(weft_fusion_ext, weft_fusion_ext, FAMILY, "fusion_ext")

int weft_fusion_ext_sufficient(weft_fusion_ext *f, int64_t tokens, int64_t hidden, int dtype,
                               int algo, int *ok) {
  WF_CHECK_ARG(f && ok, "fusion_ext sufficient: NULL argument");
  *ok = hidden >= 8 && hidden % 8 == 0 && (dtype == WEFT_BF16 || dtype == WEFT_F16) &&
        wf_fws_fits(&f->ws, tokens, hidden, dtype, algo);
  return 0;
}

#if !WEFT_HAVE_CUDA

int weft_fusion_ext_run(weft_fusion_ext *f, const weft_fusion_ext_params *p) {
  (void)f; (void)p; (void)pattern_name; (void)check_call;
  return wf_dev_nodev("fusion_ext run");
}
int weft_fusion_ext_resolve(weft_fusion_ext *f, const weft_fusion_ext_params *p, int *algo,
                            const char **why) {
  (void)f; (void)p; (void)algo; (void)why;
  return wf_dev_nodev("fusion_ext resolve");
}

#else

static int validate(const weft_fusion_ext *f, const weft_fusion_ext_params *p, const char *op, int *algo,
                    const char **why) {
  int rc = check_call(p, f->ws.world, op);
  if (rc) return rc;
  WF_CHECK_ARG(p->hidden <= f->ws.opts.hidden, "%s: hidden %lld exceeds the workspace's %lld", op,
               (long long)p->hidden, (long long)f->ws.opts.hidden);
  WF_CHECK_ARG(p->tokens <= f->ws.opts.max_tokens,
               "%s: %lld tokens exceed the declared maximum of %lld (grow the workspace)", op,
               (long long)p->tokens, (long long)f->ws.opts.max_tokens);
  if (p->pattern == WEFT_FX_RS_RMSNORM) {
    *algo = WEFT_FUSION_TWOSHOT;
    *why = "reduce-scatter: token ranges (the two-shot's first half)";
    return 0;
  }
  return wf_fws_choose(&f->ws, p->algo, p->tokens, p->hidden, p->dtype, p->tokens * p->hidden * 2, op, algo, why);
}

int weft_fusion_ext_resolve(weft_fusion_ext *f, const weft_fusion_ext_params *p, int *algo,
                            const char **why) {
  WF_CHECK_ARG(f && algo, "fusion_ext resolve: NULL argument");
  char op[160];
  snprintf(op, sizeof op, "fusion_ext (group '%s', rank %d)", f->ws.dc.group, f->ws.dc.me);
  const char *w;
  int rc = validate(f, p, op, algo, &w);
  if (!rc && why) *why = w;
  return rc;
}

int weft_fusion_ext_run(weft_fusion_ext *f, const weft_fusion_ext_params *p) {
  WF_CHECK_ARG(f, "fusion_ext run: handle is NULL");
  int rc = wf_dev_usable(&f->ws.dc, "fusion_ext run");
  if (rc) return rc;
  char op[160];
  snprintf(op, sizeof op, "fusion_ext run (group '%s', rank %d, %s)", f->ws.dc.group, f->ws.dc.me,
           p ? pattern_name(p->pattern) : "?");
  int algo;
  const char *why;
  rc = validate(f, p, op, &algo, &why);
  if (rc) return rc;
  if (p->tokens == 0) return 0; /* the same on every rank: nothing launched anywhere */
  cudaStream_t s = p->stream ? (cudaStream_t)p->stream : wf_cuda_current_stream();
  rc = wf_dev_begin(&f->ws.dc, s, "fusion_ext run");
  if (rc) return rc;
  wfx_args a = f->base;
  a.input = p->input;
  a.scales = p->scales;
  a.perm = p->pattern == WEFT_FX_MOE_FINALIZE_AR_RMSNORM ? p->permutation : NULL;
  a.shared = p->pattern <= WEFT_FX_MOE_FINALIZE_AR_RMSNORM ? p->shared_output : NULL;
  a.expert_rows = p->expert_rows;
  a.top_k = p->top_k;
  a.scales_f32 = !(p->flags & WEFT_FX_SCALES_DTYPE);
  a.residual = p->residual;
  a.weight = p->weight;
  a.weight_pre = p->weight_pre;
  a.residual_out = p->residual_out;
  a.norm_out = p->norm_out;
  a.gathered_out = p->pattern == WEFT_FX_RS_RMSNORM ? p->gathered_out : NULL;
  a.eps = p->eps;
  a.eps_pre = p->eps_pre;
  a.tokens = (int32_t)p->tokens;
  a.hidden = (int32_t)p->hidden;
  a.pattern = p->pattern;
  a.flags = p->flags;
  a.dtype = p->dtype;
  a.timeout_ns = (uint64_t)f->ws.dc.timeout_ms * 1000000u;
  int e = wfx_launch(&a, algo, s);
  if (e) rc = wf_cuda_err(__FILE__, __LINE__, "fusion_ext kernel launch", (cudaError_t)e);
  wf_dev_end(&f->ws.dc, s, !e);
  if (rc) wf_error_context(rc, "%s: %s, %lld x %lld %s", op, algo == WEFT_FUSION_ONESHOT ? "one-shot" : "two-shot",
                           (long long)p->tokens, (long long)p->hidden, wf_dev_dtype_name(p->dtype));
  return rc;
}

#endif /* WEFT_HAVE_CUDA */
