// fused_reference.inc.cu — part of bench/fused_bench.cu (included there, one
// translation unit): the inputs every rank generates for every rank, the f64
// reference and its tolerances, the device buffers, and one call checked
// against the reference and across ranks (run_and_check).

/* ------------------------------------------------------- host test data */

struct HostData {
  int64_t T = 0, H = 0;
  int dtype = WEFT_BF16;
  std::vector<std::vector<uint8_t>> in; /* per rank */
  std::vector<uint8_t> res, gamma;
  float scale = 0.004f;                 /* FP8 dequant scale: some values saturate */
};

static void put_zero(uint8_t *p, int64_t i, int dt, bool neg) {
  if (dt == WEFT_F32) { uint32_t v = neg ? 0x80000000u : 0; memcpy(p + 4 * i, &v, 4); }
  else { uint16_t v = neg ? 0x8000u : 0; memcpy(p + 2 * i, &v, 2); }
}

/* Uniform [-1, 1) in chunks of 64 rows (seeded per chunk: identical on every
 * rank whatever the thread count), ~3% +0 and ~3% -0, and zero rows (every
 * rank and the residual) at row % 29 == 7. */
static void fill(std::vector<uint8_t> &v, int64_t T, int64_t H, int dt, uint64_t seed, int role) {
  const int es = esize(dt);
  v.assign((size_t)(T * H * es), 0);
  const int64_t chunks = (T + 63) / 64;
  parallel_for(chunks, [&](int64_t c) {
    const int64_t r0 = c * 64, r1 = std::min(T, r0 + 64);
    uint8_t *p = v.data() + r0 * H * es;
    if (weft_host_fill_random(p, (size_t)((r1 - r0) * H), dt, seed_of(seed, c), 0))
      fatal("weft_host_fill_random", -1, __LINE__);
    for (int64_t r = r0; r < r1; r++)
      for (int64_t j = 0; j < H; j++) {
        const int64_t i = r * H + j;
        const uint64_t h = mix64(seed ^ (uint64_t)i * 0x9E3779B97F4A7C15ULL);
        if (r % 29 == 7 && role >= 0) put_zero(v.data(), i, dt, ((r + role) & 1) != 0);
        else if (h % 100 < 3) put_zero(v.data(), i, dt, false);
        else if (h % 100 < 6) put_zero(v.data(), i, dt, true);
      }
  });
}

static void gen(HostData &d, int64_t T, int64_t H, int dt, uint64_t seed) {
  d.T = T; d.H = H; d.dtype = dt;
  d.in.resize(g_world);
  for (int s = 0; s < g_world; s++) fill(d.in[s], T, H, dt, seed_of(seed, 1, s), s);
  fill(d.res, T, H, dt, seed_of(seed, 2), 0);
  fill(d.gamma, 1, H, dt, seed_of(seed, 3), -1);
}

/* -------------------------------------------------- reference and compare */

struct Want { int pattern, flags; float eps; bool norm_out, quant_out; };
struct Got { std::vector<uint8_t> out, res_out, norm_out, quant; };
struct Score { int64_t bad = 0, fp8_1ulp = 0, fp8_bad = 0, fp8_n = 0, n = 0; double worst = 0; };

/* Tolerances. Every rounding to the output dtype T obeys the standard model
 * with underflow: fl(v) = v(1 + d) + h, |d| <= u, |h| <= eta (half the
 * smallest subnormal of T: 2^-25 f16, 2^-134 bf16, 2^-150 f32), and the f32
 * arithmetic before it is covered by K ue (|value| + the sum of magnitudes
 * of its terms). So, with x the exact sum, S the sum of |terms|, n the
 * exact norm and w the weight:
 *   residual_out (out): |y - x| <= K ue (|x| + S) + eta
 *   norm_out:           |m - n| <= K ue (|n| + |w| rstd S) + eta (1 + 2 rstd |w|)
 * (the eta rstd |w| term: y's own underflow carried through the norm; the 2
 * covers the device's rstd against the exact one). The eta terms matter only
 * where a value is a T subnormal (f16 below 6.1e-5: a weight of 1.8e-6
 * makes every norm of its column one). FP8: the device quantises its f32
 * norm n' (|n' - n| within the norm_out bound, which also covers n''s final
 * rounding to T) times fl(1/scale) (relative error <= 2^-23, taken as 2^-22);
 * e4m3 RNE with saturation is monotone, so its code must lie between the
 * quantisations of the two ends of that interval. */
static double eta_of(int dt) { return dt == WEFT_BF16 ? 0x1p-134 : dt == WEFT_F16 ? 0x1p-25 : 0x1p-150; }

static Score check(const HostData &d, const Want &w, const Got &g) {
  const int64_t T = d.T, H = d.H;
  const int dt = d.dtype, W = g_world;
  const double u = dt == WEFT_BF16 ? 0x1p-8 : dt == WEFT_F16 ? 0x1p-11 : 0x1p-24;
  const double ue = std::max(u, 0x1p-20); /* f32: rsqrtf and f32 sums of 16384 squares */
  const double eta = eta_of(dt);
  const double K = (w.flags & WEFT_FUSION_FP32_ACC) ? 4.0 : 4.0 + 2.0 * W;
  const bool gemma = (w.flags & WEFT_FUSION_GEMMA) != 0;
  std::vector<double> gam(H);
  WK(weft_host_convert(d.gamma.data(), dt, gam.data(), WEFT_F64, (size_t)H));
  std::vector<Score> part((size_t)T);
  parallel_for(T, [&](int64_t r) {
    Score &sc = part[(size_t)r];
    std::vector<double> x(H, 0.0), S(H, 0.0), t(H), n(H), o(H), ab(H, eta);
    const size_t off = (size_t)(r * H * esize(dt));
    for (int s = 0; s < W; s++) {
      weft_host_convert(d.in[s].data() + off, dt, t.data(), WEFT_F64, (size_t)H);
      for (int64_t j = 0; j < H; j++) { x[j] += t[j]; S[j] += std::fabs(t[j]); }
    }
    auto cmp = [&](const std::vector<uint8_t> &dev, const std::vector<double> &ref,
                   const std::vector<double> &mag, const std::vector<double> &abs_tol) {
      weft_host_convert(dev.data() + off, dt, o.data(), WEFT_F64, (size_t)H);
      for (int64_t j = 0; j < H; j++) {
        const double tol = K * ue * (std::fabs(ref[j]) + mag[j]) + abs_tol[j] + 1e-300;
        const double e = std::fabs(o[j] - ref[j]) / tol;
        if (!(e <= 1.0)) sc.bad++;
        if (e > sc.worst || e != e) sc.worst = e != e ? 1e30 : e;
        sc.n++;
      }
    };
    if (w.pattern == WEFT_FUSION_AR) { cmp(g.out, x, S, ab); return; }
    weft_host_convert(d.res.data() + off, dt, t.data(), WEFT_F64, (size_t)H);
    double ss = 0;
    for (int64_t j = 0; j < H; j++) { x[j] += t[j]; S[j] += std::fabs(t[j]); ss += x[j] * x[j]; }
    cmp(g.res_out, x, S, ab);
    const double rstd = 1.0 / std::sqrt(ss / (double)H + (double)w.eps);
    std::vector<double> nm(H), na(H), tn(H);
    for (int64_t j = 0; j < H; j++) {
      const double wj = gemma ? 1.0 + gam[j] : gam[j];
      n[j] = x[j] * rstd * wj;
      nm[j] = std::fabs(n[j]) + std::fabs(wj) * rstd * S[j];
      na[j] = eta * (1.0 + 2.0 * rstd * std::fabs(wj));
      tn[j] = K * ue * nm[j] + na[j]; /* the norm_out bound, as in cmp */
    }
    if (w.norm_out) cmp(g.norm_out, n, nm, na);
    if (w.quant_out) {
      /* (1) the device code lies between the quantisations of the ends of
       * the interval the norm bound allows (see the tolerance note above);
       * (2) the quantisation of the device's own residual_out, normalised
       * in f64, must match exactly bar f32-vs-f64 ties (counted, rare). */
      std::vector<uint8_t> qlo(H), qhi(H), qe(H);
      std::vector<double> lo(H), hi(H), b(H), y(H);
      const double rho = 0x1p-22;
      for (int64_t j = 0; j < H; j++) {
        const double l = (n[j] - tn[j]) / (double)d.scale, h = (n[j] + tn[j]) / (double)d.scale;
        lo[j] = l - rho * std::fabs(l);
        hi[j] = h + rho * std::fabs(h);
      }
      weft_host_convert(lo.data(), WEFT_F64, qlo.data(), WEFT_F8E4M3, (size_t)H);
      weft_host_convert(hi.data(), WEFT_F64, qhi.data(), WEFT_F8E4M3, (size_t)H);
      weft_host_convert(qlo.data(), WEFT_F8E4M3, lo.data(), WEFT_F64, (size_t)H);
      weft_host_convert(qhi.data(), WEFT_F8E4M3, hi.data(), WEFT_F64, (size_t)H);
      weft_host_convert(g.quant.data() + (size_t)(r * H), WEFT_F8E4M3, b.data(), WEFT_F64, (size_t)H);
      for (int64_t j = 0; j < H; j++)
        if (!(lo[j] <= b[j] && b[j] <= hi[j])) sc.fp8_bad++;
      weft_host_convert(g.res_out.data() + off, dt, y.data(), WEFT_F64, (size_t)H);
      double ssy = 0;
      for (int64_t j = 0; j < H; j++) ssy += y[j] * y[j];
      const double ry = 1.0 / std::sqrt(ssy / (double)H + (double)w.eps);
      for (int64_t j = 0; j < H; j++) t[j] = y[j] * ry * (gemma ? 1.0 + gam[j] : gam[j]) / (double)d.scale;
      weft_host_convert(t.data(), WEFT_F64, qe.data(), WEFT_F8E4M3, (size_t)H);
      for (int64_t j = 0; j < H; j++) sc.fp8_1ulp += qe[j] != g.quant[(size_t)(r * H + j)];
      sc.fp8_n += H;
    }
  });
  Score tot;
  for (auto &p : part) {
    tot.bad += p.bad; tot.n += p.n; tot.fp8_1ulp += p.fp8_1ulp; tot.fp8_bad += p.fp8_bad;
    tot.fp8_n += p.fp8_n;
    tot.worst = std::max(tot.worst, p.worst);
  }
  return tot;
}

/* fp8_1ulp: codes that differ from the f64 quantisation of the device's own
 * residual_out (f32-vs-f64 ties only: expected around 1e-5 of them). */
static bool score_ok(const Score &s) {
  return s.bad == 0 && s.fp8_bad == 0 && s.fp8_1ulp * 1000 <= s.fp8_n + 2000;
}

/* ------------------------------------------------------- device buffers */

struct Dev {
  void *in = nullptr, *res = nullptr, *gamma = nullptr, *out = nullptr, *res_out = nullptr,
       *norm_out = nullptr, *quant = nullptr, *copy = nullptr;
  float *scale = nullptr;
  size_t bytes = 0, qbytes = 0;
  void alloc(int64_t T, int64_t H, int dt) {
    bytes = (size_t)(T * H * esize(dt)) + 256;
    qbytes = (size_t)(T * H) + 256;
    CU(cudaMalloc(&in, bytes)); CU(cudaMalloc(&res, bytes)); CU(cudaMalloc(&gamma, (size_t)H * 4 + 256));
    CU(cudaMalloc(&out, bytes)); CU(cudaMalloc(&res_out, bytes)); CU(cudaMalloc(&norm_out, bytes));
    CU(cudaMalloc(&quant, qbytes)); CU(cudaMalloc(&copy, bytes)); CU(cudaMalloc((void **)&scale, 256));
  }
  /* allocated for d's shape and loaded with its data */
  static Dev with(const HostData &d) {
    Dev v;
    v.alloc(d.T, d.H, d.dtype);
    v.upload(d);
    return v;
  }
  void release() {
    for (void *p : {in, res, gamma, out, res_out, norm_out, quant, copy, (void *)scale}) cudaFree(p);
    *this = Dev();
  }
  void upload(const HostData &d) {
    const size_t b = (size_t)(d.T * d.H * esize(d.dtype));
    CU(cudaMemcpyAsync(in, d.in[g_rank].data(), b, cudaMemcpyHostToDevice, g_stream));
    CU(cudaMemcpyAsync(res, d.res.data(), b, cudaMemcpyHostToDevice, g_stream));
    CU(cudaMemcpyAsync(gamma, d.gamma.data(), (size_t)d.H * esize(d.dtype), cudaMemcpyHostToDevice, g_stream));
    CU(cudaMemcpyAsync(scale, &d.scale, 4, cudaMemcpyHostToDevice, g_stream));
    /* outputs start as garbage, so a kernel that skips an element is caught */
    CU(cudaMemsetAsync(out, 0x7b, b, g_stream));
    CU(cudaMemsetAsync(res_out, 0x7b, b, g_stream));
    CU(cudaMemsetAsync(norm_out, 0x7b, b, g_stream));
    CU(cudaMemsetAsync(quant, 0x7b, (size_t)(d.T * d.H), g_stream));
  }
  Got download(const HostData &d, const Want &w) const {
    Got g;
    const size_t b = (size_t)(d.T * d.H * esize(d.dtype));
    CU(cudaStreamSynchronize(g_stream));
    auto get = [&](std::vector<uint8_t> &v, const void *p, size_t n) {
      v.resize(n);
      CU(cudaMemcpy(v.data(), p, n, cudaMemcpyDeviceToHost));
    };
    if (w.pattern == WEFT_FUSION_AR) get(g.out, out, b);
    else get(g.res_out, res_out, b);
    if (w.norm_out) get(g.norm_out, norm_out, b);
    if (w.quant_out) get(g.quant, quant, (size_t)(d.T * d.H));
    return g;
  }
};

static weft_fusion_params params(const Dev &v, const HostData &d, int pattern, int algo, int flags,
                                 float eps, bool with_norm_out = true) {
  weft_fusion_params p;
  memset(&p, 0, sizeof p);
  p.pattern = pattern; p.algo = algo; p.flags = flags; p.dtype = d.dtype;
  p.tokens = d.T; p.hidden = d.H;
  p.input = v.in; p.residual = v.res; p.weight = v.gamma;
  p.out = v.out; p.residual_out = v.res_out;
  p.norm_out = (pattern == WEFT_FUSION_AR_RMSNORM || with_norm_out) ? v.norm_out : nullptr;
  p.quant_out = v.quant; p.scale = v.scale;
  p.eps = eps; p.stream = g_stream;
  return p;
}

static Want want_of(const weft_fusion_params &p) {
  Want w;
  w.pattern = p.pattern; w.flags = p.flags; w.eps = p.eps;
  w.norm_out = p.pattern != WEFT_FUSION_AR && p.norm_out;
  w.quant_out = p.pattern == WEFT_FUSION_AR_RMSNORM_FP8;
  return w;
}

static uint64_t hash_got(const Got &g) {
  uint64_t h = fnv(g.out.data(), g.out.size());
  h = fnv(g.res_out.data(), g.res_out.size(), h);
  h = fnv(g.norm_out.data(), g.norm_out.size(), h);
  return fnv(g.quant.data(), g.quant.size(), h);
}

static void sync_and_check_error(weft_fusion *ws, const char *what) {
  CU(cudaStreamSynchronize(g_stream));
  int rc = weft_fusion_check_error(ws);
  if (rc) fatal(what, rc, __LINE__);
}

/* One call: run, check against the reference, all ranks bit-equal. */
static Got run_and_check(weft_fusion *ws, const Dev &v, const HostData &d, const weft_fusion_params &p,
                         const char *tag) {
  WK(weft_fusion_run(ws, &p));
  sync_and_check_error(ws, tag);
  const Want w = want_of(p);
  Got g = v.download(d, w);
  const Score s = check(d, w, g);
  const bool same = same_everywhere(hash_got(g));
  verdict(score_ok(s) && same,
          "%s: %lldx%lld %s %s %s flags=%d: %lld/%lld outside tolerance (worst %.3g of tol)%s%s",
          tag, (long long)d.T, (long long)d.H, dname(d.dtype), pname(p.pattern), aname(p.algo),
          p.flags, (long long)s.bad, (long long)s.n, s.worst,
          w.quant_out ? (", fp8 " + std::to_string(s.fp8_bad) + " bad, " +
                         std::to_string(s.fp8_1ulp) + " of " + std::to_string(s.fp8_n) +
                         " off the device-residual quantisation").c_str() : "",
          same ? "" : ", ranks DIFFER");
  return g;
}
