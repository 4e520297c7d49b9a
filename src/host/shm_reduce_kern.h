/* shm_reduce_kern.h — reduction kernels, compiled once per target by
 * shm_reduce.c (no include guard; KN(x) names this copy). Included by
 * shm_vec_kern.h. Every element is combined in source order 0..n-1, by the
 * same IEEE operations in the vector body and the scalar tail, so all ranks
 * get bit-identical results. dst may alias a source: each block is loaded
 * completely before it is stored.
 *
 * One definition for every backend (weft_host_reduce serves the Lua paths):
 * integers wrap (two's complement: sums and products are done unsigned);
 * floats max/min propagate NaN like torch (the first NaN in source order
 * wins), branch-free: take b where b > a or b is NaN, so a NaN in a is
 * kept because neither holds. For integers b != b is constant false and
 * folds away. */

/* float-like storage (f32/f16/bf16), f32 arithmetic */
WF_AI VF KN(vcomb)(VF a, VF b, int op) {
  if (op == WEFT_SUM) return a + b;
  if (op == WEFT_PROD) return a * b;
#ifdef WF_KERN_F16C
  /* AVX2 copy: vmaxps(b, a) is exactly b > a ? b : a; one blend brings b's
   * NaN in. Two steps on the accumulator's chain instead of four. */
  __m256 r = op == WEFT_MAX ? _mm256_max_ps((__m256)b, (__m256)a) : _mm256_min_ps((__m256)b, (__m256)a);
  return (VF)_mm256_blendv_ps(r, (__m256)b, _mm256_cmp_ps((__m256)b, (__m256)b, _CMP_UNORD_Q));
#else
  VU m = (VU)(op == WEFT_MAX ? (b > a) : (b < a)) | (VU)(b != b);
  return (VF)((m & (VU)b) | (~m & (VU)a));
#endif
}
WF_AI float KN(scomb)(float a, float b, int op) {
  if (op == WEFT_SUM) return a + b;
  if (op == WEFT_PROD) return a * b;
  return ((op == WEFT_MAX ? (b > a) : (b < a)) || b != b) ? b : a;
}

WF_AI void KN(red_flt)(void *dst, const void *const *src, int n, size_t count,
                      const int dt, const int op) {
  const size_t es = dt == WEFT_F32 ? 4 : 2;
  size_t i = 0;
  const size_t w = LF * es; /* bytes per vector */
  for (; i + 4 * LF <= count; i += 4 * LF) {
    const uint8_t *s = (const uint8_t *)src[0] + i * es;
    VF a0 = KN(vload)(s, dt), a1 = KN(vload)(s + w, dt);
    VF a2 = KN(vload)(s + 2 * w, dt), a3 = KN(vload)(s + 3 * w, dt);
    for (int j = 1; j < n; j++) {
      s = (const uint8_t *)src[j] + i * es;
      a0 = KN(vcomb)(a0, KN(vload)(s, dt), op);
      a1 = KN(vcomb)(a1, KN(vload)(s + w, dt), op);
      a2 = KN(vcomb)(a2, KN(vload)(s + 2 * w, dt), op);
      a3 = KN(vcomb)(a3, KN(vload)(s + 3 * w, dt), op);
    }
    uint8_t *d = (uint8_t *)dst + i * es;
    KN(vstore)(d, a0, dt);
    KN(vstore)(d + w, a1, dt);
    KN(vstore)(d + 2 * w, a2, dt);
    KN(vstore)(d + 3 * w, a3, dt);
  }
  for (; i < count; i++) {
    float a = KN(sload)(src[0], i, dt);
    for (int j = 1; j < n; j++) a = KN(scomb)(a, KN(sload)(src[j], i, dt), op);
    KN(sstore)(dst, i, a, dt);
  }
}

/* Types stored as they are computed: V vector type, U its unsigned twin (for
 * masks), VA/SA the vector/scalar type sums are done in (unsigned for
 * integers, so they wrap instead of overflowing), S the scalar type. */
#define WF_RED_PLAIN(NAME, V, U, VA, S, SA)                                        \
  WF_AI V KN(NAME##_vc)(V a, V b, int op) {                                        \
    if (op == WEFT_SUM) return (V)((VA)a + (VA)b);                                 \
    if (op == WEFT_PROD) return (V)((VA)a * (VA)b);                                \
    U m = (U)(op == WEFT_MAX ? (b > a) : (b < a)) | (U)(b != b);                   \
    return (V)((m & (U)b) | (~m & (U)a));                                          \
  }                                                                                \
  WF_AI S KN(NAME##_sc)(S a, S b, int op) {                                        \
    if (op == WEFT_SUM) return (S)((SA)a + (SA)b);                                 \
    if (op == WEFT_PROD) return (S)((SA)a * (SA)b);                                \
    return ((op == WEFT_MAX ? (b > a) : (b < a)) || b != b) ? b : a;               \
  }                                                                                \
  WF_AI void KN(NAME)(void *dst, const void *const *src, int n, size_t count,     \
                      const int op) {                                              \
    const size_t L = sizeof(V) / sizeof(S);                                        \
    size_t i = 0;                                                                  \
    for (; i + 4 * L <= count; i += 4 * L) {                                       \
      const S *s = (const S *)src[0] + i;                                          \
      V a0, a1, a2, a3, b;                                                         \
      memcpy(&a0, s, sizeof(V)); memcpy(&a1, s + L, sizeof(V));                                  \
      memcpy(&a2, s + 2 * L, sizeof(V)); memcpy(&a3, s + 3 * L, sizeof(V));                      \
      for (int j = 1; j < n; j++) {                                                \
        s = (const S *)src[j] + i;                                                 \
        memcpy(&b, s, sizeof(V)); a0 = KN(NAME##_vc)(a0, b, op);                          \
        memcpy(&b, s + L, sizeof(V)); a1 = KN(NAME##_vc)(a1, b, op);                      \
        memcpy(&b, s + 2 * L, sizeof(V)); a2 = KN(NAME##_vc)(a2, b, op);                  \
        memcpy(&b, s + 3 * L, sizeof(V)); a3 = KN(NAME##_vc)(a3, b, op);                  \
      }                                                                            \
      S *d = (S *)dst + i;                                                         \
      memcpy(d, &a0, sizeof(V)); memcpy(d + L, &a1, sizeof(V));                                  \
      memcpy(d + 2 * L, &a2, sizeof(V)); memcpy(d + 3 * L, &a3, sizeof(V));                      \
    }                                                                              \
    for (; i < count; i++) {                                                       \
      S a = ((const S *)src[0])[i];                                                \
      for (int j = 1; j < n; j++) a = KN(NAME##_sc)(a, ((const S *)src[j])[i], op); \
      ((S *)dst)[i] = a;                                                           \
    }                                                                              \
  }

WF_RED_PLAIN(red_f64, VD, VUL, VD, double, double)
WF_RED_PLAIN(red_i32, VI, VU, VU, int32_t, uint32_t)
WF_RED_PLAIN(red_i64, VL, VUL, VUL, int64_t, uint64_t)
/* u8: sums and products wrap mod 256 (the promotion to int is cut back) */
WF_RED_PLAIN(red_u8, VB8, VB8, VB8, uint8_t, uint8_t)

#define WF_RED_INST(OPNAME, OP)                                                        \
  static void KN(f32_##OPNAME)(void *d, const void *const *s, int n, size_t c) {       \
    KN(red_flt)(d, s, n, c, WEFT_F32, OP); }                                           \
  static void KN(f16_##OPNAME)(void *d, const void *const *s, int n, size_t c) {       \
    KN(red_flt)(d, s, n, c, WEFT_F16, OP); }                                           \
  static void KN(bf16_##OPNAME)(void *d, const void *const *s, int n, size_t c) {      \
    KN(red_flt)(d, s, n, c, WEFT_BF16, OP); }                                          \
  static void KN(f64_##OPNAME)(void *d, const void *const *s, int n, size_t c) {       \
    KN(red_f64)(d, s, n, c, OP); }                                                     \
  static void KN(i32_##OPNAME)(void *d, const void *const *s, int n, size_t c) {       \
    KN(red_i32)(d, s, n, c, OP); }                                                     \
  static void KN(i64_##OPNAME)(void *d, const void *const *s, int n, size_t c) {       \
    KN(red_i64)(d, s, n, c, OP); }                                                     \
  static void KN(u8_##OPNAME)(void *d, const void *const *s, int n, size_t c) {        \
    KN(red_u8)(d, s, n, c, OP); }

WF_RED_INST(sum, WEFT_SUM)
WF_RED_INST(max, WEFT_MAX)
WF_RED_INST(min, WEFT_MIN)
WF_RED_INST(prod, WEFT_PROD)

/* table[dtype][op] for dtypes F32..F64 and ops SUM, MAX, MIN, PROD (AND,
 * op 3, is the cpu group's and stays NULL) */
static void KN(fill_table)(wf_red_fn t[WF_RED_DTYPES][WF_RED_OPS]) {
#define WF_ROW(DT, P) t[DT][WEFT_SUM] = KN(P##_sum); t[DT][WEFT_MAX] = KN(P##_max); \
  t[DT][WEFT_MIN] = KN(P##_min); t[DT][WEFT_PROD] = KN(P##_prod);
  WF_ROW(WEFT_F32, f32) WF_ROW(WEFT_F16, f16) WF_ROW(WEFT_BF16, bf16)
  WF_ROW(WEFT_F64, f64) WF_ROW(WEFT_I32, i32) WF_ROW(WEFT_I64, i64)
  WF_ROW(WEFT_U8, u8)
#undef WF_ROW
}

#undef WF_RED_INST
#undef WF_RED_PLAIN
