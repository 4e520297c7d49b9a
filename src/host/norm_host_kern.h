/* norm_host_kern.h — one row of residual add + RMSNorm, compiled once per
 * target by norm_host.c (no include guard; KN(x) names this copy). Included by
 * shm_vec_kern.h (which defines VF, LF, vload/vstore, ...).
 *
 * Pass 1 forms v = x + residual in f32, stores residual_out (in the storage
 * dtype) and accumulates sum(v^2) from the unrounded v; pass 2 reads the
 * stored residual back (FlashInfer/vLLM semantics: the output is computed from
 * the residual as the next layer will see it), or recomputes v when no
 * residual_out is kept, and writes v * rstd * w. The row stays in L1/L2 between
 * the passes. */

WF_AI void KN(norm_row)(const void *x, const void *res, const void *w, void *out,
                        void *rout, size_t h, float eps, int gemma, const int dt) {
  const size_t es = dt == WEFT_F32 ? 4 : 2, vw = LF * es;
  const uint8_t *xp = x, *rp = res, *wp = w;
  uint8_t *op = out, *rop = rout;
  VF acc0 = {0}, acc1 = {0};
  size_t i = 0;
  for (; i + 2 * LF <= h; i += 2 * LF) {
    size_t b = i * es;
    VF v0 = KN(vload)(xp + b, dt), v1 = KN(vload)(xp + b + vw, dt);
    if (rp) { v0 += KN(vload)(rp + b, dt); v1 += KN(vload)(rp + b + vw, dt); }
    if (rop) { KN(vstore)(rop + b, v0, dt); KN(vstore)(rop + b + vw, v1, dt); }
    acc0 += v0 * v0;
    acc1 += v1 * v1;
  }
  float tail = 0.0f;
  for (; i < h; i++) {
    float v = KN(sload)(xp, i, dt) + (rp ? KN(sload)(rp, i, dt) : 0.0f);
    if (rop) KN(sstore)(rop, i, v, dt);
    tail += v * v;
  }
  acc0 += acc1;
  float ss = tail;
  for (int l = 0; l < LF; l++) ss += acc0[l];
  const float rstd = 1.0f / sqrtf(ss / (float)h + eps);
  const float wb = gemma ? 1.0f : 0.0f;
  const uint8_t *src = rop ? rop : xp;
  const uint8_t *add = rop ? NULL : rp;
  for (i = 0; i + LF <= h; i += LF) {
    size_t b = i * es;
    VF v = KN(vload)(src + b, dt);
    if (add) v += KN(vload)(add + b, dt);
    VF ww = KN(vload)(wp + b, dt) + wb;
    KN(vstore)(op + b, (v * rstd) * ww, dt);
  }
  for (; i < h; i++) {
    float v = KN(sload)(src, i, dt) + (add ? KN(sload)(add, i, dt) : 0.0f);
    KN(sstore)(op, i, (v * rstd) * (KN(sload)(wp, i, dt) + wb), dt);
  }
}

static void KN(norm_rows)(const void *x, const void *res, const void *w, void *out, void *rout,
                          int64_t tokens, size_t h, float eps, int gemma, int dt) {
  const size_t row = h * (dt == WEFT_F32 ? 4 : 2);
  for (int64_t t = 0; t < tokens; t++) {
    size_t o = (size_t)t * row;
    const uint8_t *r = res ? (const uint8_t *)res + o : NULL;
    uint8_t *ro = rout ? (uint8_t *)rout + o : NULL;
    const void *xi = (const uint8_t *)x + o;
    void *oi = (uint8_t *)out + o;
    if (dt == WEFT_F32) KN(norm_row)(xi, r, w, oi, ro, h, eps, gemma, WEFT_F32);
    else if (dt == WEFT_F16) KN(norm_row)(xi, r, w, oi, ro, h, eps, gemma, WEFT_F16);
    else KN(norm_row)(xi, r, w, oi, ro, h, eps, gemma, WEFT_BF16);
  }
}
