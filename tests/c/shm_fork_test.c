/* shm_fork_test.c — the shm data plane with real processes, without the cpu
 * group: the parent is group index 0 and creates the segment, fork()ed
 * children attach by name (wf_shm_attach), the parent unlinks once all are
 * attached. Every collective, every dtype and op, 1..8 ranks, sizes from 0 to
 * several MiB (several chunks), checked against an f64 (or exact integer)
 * reference and for bit-identical results on all ranks; then the failure
 * paths: mismatched calls, bad arguments, a late rank (timeout), a killed
 * rank, a rank that destroyed its handle.
 *
 * Prints "FAIL ..." per failed check and a closing "shm_fork: N passed, M
 * failed"; exit status 0 only when nothing failed.
 * Build and run: make shm-test-c   (mk/shm.mk) */
#include "core/fpconv.h"
#include "host/shm.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cpugroup_stubs.h" /* shm.c's create path needs the cpu group; not linked here */

typedef struct {
  _Atomic int passed, failed;
} stats_t;
static stats_t *stats; /* MAP_SHARED: children count into it too */

#define CHECK(cond, ...)                                                        \
  do {                                                                          \
    if (cond) atomic_fetch_add(&stats->passed, 1);                              \
    else {                                                                      \
      atomic_fetch_add(&stats->failed, 1);                                      \
      printf("FAIL [pid %d] ", (int)getpid());                                  \
      printf(__VA_ARGS__);                                                      \
      printf("\n");                                                             \
      fflush(stdout);                                                           \
    }                                                                           \
  } while (0)

/* ------------------------------------------------------------------ data */
static uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

static const int DTYPES[] = {WEFT_F32, WEFT_F16, WEFT_BF16, WEFT_F64, WEFT_I32, WEFT_I64};
static const char *DTN[] = {"f32", "f16", "bf16", "i32", "i64", "u8", "f64"};
static const char *OPN[] = {"sum", "max", "min", "and", "prod"};

static int is_float(int dt) { return dt == WEFT_F32 || dt == WEFT_F16 || dt == WEFT_BF16 || dt == WEFT_F64; }

/* Element i of rank r's input for a test with this seed, written to dst.
 * Easy values (k/8, ±0) are exact in every format; hard ones span magnitudes. */
static void gen(int dt, uint64_t seed, int r, size_t i, void *dst) {
  uint64_t h = mix(seed * 0x100000001b3ULL ^ mix(((uint64_t)r << 40) + i));
  if (!is_float(dt)) {
    if (dt == WEFT_I32) { int32_t v = (int32_t)(uint32_t)h; memcpy(dst, &v, 4); }
    else { int64_t v = (int64_t)h; memcpy(dst, &v, 8); }
    return;
  }
  double v;
  if (seed & 1) { /* hard */
    v = ((double)(h >> 11) * 0x1p-53 * 2.0 - 1.0) * ldexp(1.0, (int)(h % 13) - 6);
  } else {
    v = (double)((int)(h % 65) - 32) / 8.0;
    if (h % 37 == 0) v = (h & 64) ? -0.0 : 0.0;
  }
  switch (dt) {
  case WEFT_F32: { float f = (float)v; memcpy(dst, &f, 4); break; }
  case WEFT_F64: memcpy(dst, &v, 8); break;
  case WEFT_F16: { uint16_t b = wf_f64_to_f16(v); memcpy(dst, &b, 2); break; }
  default: { uint16_t b = wf_f64_to_bf16(v); memcpy(dst, &b, 2); break; }
  }
}

static double load_d(int dt, const void *p) {
  switch (dt) {
  case WEFT_F32: { float f; memcpy(&f, p, 4); return f; }
  case WEFT_F64: { double d; memcpy(&d, p, 8); return d; }
  case WEFT_F16: { uint16_t b; memcpy(&b, p, 2); return wf_f16_to_f32(b); }
  case WEFT_BF16: { uint16_t b; memcpy(&b, p, 2); return wf_bf16_to_f32(b); }
  case WEFT_I32: { int32_t v; memcpy(&v, p, 4); return v; }
  default: { int64_t v; memcpy(&v, p, 8); return (double)v; }
  }
}

static uint64_t load_u(int dt, const void *p) {
  if (dt == WEFT_I32) { uint32_t v; memcpy(&v, p, 4); return v; }
  uint64_t v; memcpy(&v, p, 8); return v;
}
static int64_t load_i(int dt, const void *p) {
  if (dt == WEFT_I32) { int32_t v; memcpy(&v, p, 4); return v; }
  int64_t v; memcpy(&v, p, 8); return v;
}

static double mant_eps(int dt) {
  switch (dt) {
  case WEFT_F32: return 0x1p-24;
  case WEFT_F16: return 0x1p-11;
  case WEFT_BF16: return 0x1p-8;
  default: return 0x1p-53;
  }
}

/* Is got (dtype storage) the reduction over ranks 0..n-1 of element idx(r)? */
typedef size_t (*index_fn)(int r, size_t i, void *ctx);

static int check_elem(int dt, int op, uint64_t seed, int n, const void *got, index_fn idx,
                      size_t i, void *ctx, double *err_out) {
  uint8_t e[8];
  if (is_float(dt)) {
    double ref = 0, sabs = 0;
    for (int r = 0; r < n; r++) {
      gen(dt, seed, r, idx(r, i, ctx), e);
      double v = load_d(dt, e);
      if (r == 0) ref = v;
      else if (op == WEFT_SUM) ref += v;
      else if (op == WEFT_MAX) ref = v > ref ? v : ref;
      else ref = v < ref ? v : ref;
      sabs += fabs(v);
    }
    double g = load_d(dt, got);
    double acc_eps = dt == WEFT_F64 ? 0x1p-53 : 0x1p-24; /* accumulation in f32 / f64 */
    double tol = op == WEFT_SUM ? sabs * n * acc_eps + fabs(ref) * mant_eps(dt) + 0x1p-24 : 0;
    *err_out = fabs(g - ref);
    return fabs(g - ref) <= tol;
  }
  uint64_t su = 0;
  int64_t m = 0;
  for (int r = 0; r < n; r++) {
    gen(dt, seed, r, idx(r, i, ctx), e);
    int64_t v = load_i(dt, e);
    su += load_u(dt, e);
    if (r == 0 || (op == WEFT_MAX && v > m) || (op == WEFT_MIN && v < m)) m = v;
  }
  *err_out = 0;
  if (op == WEFT_SUM) {
    uint64_t g = load_u(dt, got);
    return dt == WEFT_I32 ? (uint32_t)g == (uint32_t)su : g == su;
  }
  return load_i(dt, got) == m;
}

static size_t idx_same(int r, size_t i, void *ctx) { (void)r; (void)ctx; return i; }
typedef struct { size_t cout; int me; } rs_ctx;
static size_t idx_rs(int r, size_t i, void *ctx) {
  (void)r;
  rs_ctx *c = ctx;
  return (size_t)c->me * c->cout + i;
}

static uint64_t fnv(const void *p, size_t n) {
  const uint8_t *b = p;
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
  return h;
}

/* Every rank got the same bytes (all_gather of a hash through the shm itself). */
static void check_identical(weft_shm *c, const void *buf, size_t n, const char *what) {
  uint64_t h = fnv(buf, n), all[64];
  int rc = weft_shm_all_gather(c, &h, all, 8);
  int same = rc == 0;
  for (int j = 0; same && j < c->world; j++) same = all[j] == h;
  CHECK(same, "%s: results differ between ranks (rc %d %s)", what, rc, rc ? weft_last_error() : "");
}

/* ------------------------------------------------------------------ collectives */
static void t_all_reduce(weft_shm *c, int dt, int op, size_t count, uint64_t seed, int inplace) {
  size_t es = weft_dtype_size(dt);
  uint8_t *in = malloc(count * es + 1), *out = inplace ? in : malloc(count * es + 1);
  for (size_t i = 0; i < count; i++) gen(dt, seed, c->me, i, in + i * es);
  int rc = weft_shm_all_reduce(c, in, out, count, dt, op);
  char what[160];
  snprintf(what, sizeof what, "all_reduce %s %s count %zu world %d%s seed %llu", DTN[dt],
           OPN[op], count, c->world, inplace ? " in place" : "", (unsigned long long)seed);
  CHECK(rc == 0, "%s: rc %d: %s", what, rc, weft_last_error());
  if (rc == 0) {
    size_t bad = 0, first = 0;
    double worst = 0, err;
    for (size_t i = 0; i < count; i++)
      if (!check_elem(dt, op, seed, c->world, out + i * es, idx_same, i, NULL, &err)) {
        if (!bad++) first = i;
        if (err > worst) worst = err;
      }
    CHECK(bad == 0, "%s: %zu wrong elements, first %zu, worst error %g", what, bad, first, worst);
    check_identical(c, out, count * es, what);
  }
  if (!inplace) free(out);
  free(in);
}

static void t_reduce_scatter(weft_shm *c, int dt, int op, size_t cout, uint64_t seed) {
  size_t es = weft_dtype_size(dt), n = cout * (size_t)c->world;
  uint8_t *in = malloc(n * es + 1), *out = malloc(cout * es + 1);
  for (size_t i = 0; i < n; i++) gen(dt, seed, c->me, i, in + i * es);
  int rc = weft_shm_reduce_scatter(c, in, out, cout, dt, op);
  char what[160];
  snprintf(what, sizeof what, "reduce_scatter %s %s count_out %zu world %d", DTN[dt], OPN[op],
           cout, c->world);
  CHECK(rc == 0, "%s: rc %d: %s", what, rc, weft_last_error());
  if (rc == 0) {
    rs_ctx ctx = {cout, c->me};
    size_t bad = 0, first = 0;
    double err;
    for (size_t i = 0; i < cout; i++)
      if (!check_elem(dt, op, seed, c->world, out + i * es, idx_rs, i, &ctx, &err) && !bad++)
        first = i;
    CHECK(bad == 0, "%s: %zu wrong elements, first %zu", what, bad, first);
  }
  free(in);
  free(out);
}

static void t_all_gather(weft_shm *c, size_t bytes, uint64_t seed, int inplace) {
  size_t total = bytes * (size_t)c->world;
  uint8_t *out = malloc(total + 1), *in = inplace ? out + (size_t)c->me * bytes : malloc(bytes + 1);
  memset(out, 0xee, total);
  for (size_t i = 0; i < bytes; i++) in[i] = (uint8_t)mix(seed + ((uint64_t)c->me << 40) + i);
  int rc = weft_shm_all_gather(c, in, out, bytes);
  CHECK(rc == 0, "all_gather %zu bytes world %d: rc %d: %s", bytes, c->world, rc, weft_last_error());
  size_t bad = 0;
  for (int r = 0; r < c->world && rc == 0; r++)
    for (size_t i = 0; i < bytes; i++)
      bad += out[(size_t)r * bytes + i] != (uint8_t)mix(seed + ((uint64_t)r << 40) + i);
  CHECK(bad == 0, "all_gather %zu bytes world %d%s: %zu wrong bytes", bytes, c->world,
        inplace ? " in place" : "", bad);
  if (!inplace) free(in);
  free(out);
}

static void t_broadcast(weft_shm *c, size_t bytes, int root, uint64_t seed) {
  uint8_t *buf = malloc(bytes + 1);
  for (size_t i = 0; i < bytes; i++)
    buf[i] = c->me == root ? (uint8_t)mix(seed + i) : 0x5a;
  int rc = weft_shm_broadcast(c, buf, bytes, root);
  CHECK(rc == 0, "broadcast %zu bytes root %d world %d: rc %d: %s", bytes, root, c->world, rc,
        weft_last_error());
  size_t bad = 0;
  for (size_t i = 0; i < bytes && rc == 0; i++) bad += buf[i] != (uint8_t)mix(seed + i);
  CHECK(bad == 0, "broadcast %zu bytes root %d world %d: %zu wrong bytes", bytes, root,
        c->world, bad);
  free(buf);
}

/* ------------------------------------------------------------------ bodies */
typedef void (*body_fn)(weft_shm *c, void *arg);

static void body_correctness(weft_shm *c, void *arg) {
  int big = *(int *)arg;
  static const size_t small[] = {0, 1, 2, 7, 31, 32, 33, 100, 1023, 4097};
  uint64_t seed = 10;
  for (size_t d = 0; d < sizeof DTYPES / sizeof DTYPES[0]; d++)
    for (int op = 0; op < 3; op++)
      for (size_t s = 0; s < sizeof small / sizeof small[0]; s++) {
        t_all_reduce(c, DTYPES[d], op, small[s], seed++, (int)(s & 1));
        t_reduce_scatter(c, DTYPES[d], op, small[s], seed++);
      }
  /* above the one-shot limit and across chunks: every dtype with sum, some max/min */
  static const size_t mid[] = {20000, 70001};
  for (size_t d = 0; d < sizeof DTYPES / sizeof DTYPES[0]; d++)
    for (size_t s = 0; s < 2; s++) {
      t_all_reduce(c, DTYPES[d], WEFT_SUM, mid[s], seed++, (int)s);
      t_all_reduce(c, DTYPES[d], (int)(1 + s), mid[s], seed++, 0);
      t_reduce_scatter(c, DTYPES[d], WEFT_SUM, mid[s] / 4, seed++);
    }
  static const size_t gb[] = {0, 1, 5, 64, 4095, 4096, 4097, 300000};
  for (size_t s = 0; s < sizeof gb / sizeof gb[0]; s++) {
    t_all_gather(c, gb[s], seed++, (int)(s & 1));
    t_broadcast(c, gb[s], (int)(s % (size_t)c->world), seed++);
  }
  if (big) { /* several MiB: many chunks */
    t_all_reduce(c, WEFT_F32, WEFT_SUM, 1536 * 1024 + 3, seed++, 1);
    t_all_reduce(c, WEFT_BF16, WEFT_SUM, 3 * 1024 * 1024 + 1, seed++, 0);
    t_all_reduce(c, WEFT_I64, WEFT_MAX, 600 * 1024, seed++, 0);
    t_reduce_scatter(c, WEFT_F32, WEFT_SUM, 1024 * 1024 + 5, seed++);
    t_all_gather(c, 5 * 1024 * 1024 + 1, seed++, 0);
    t_broadcast(c, 9 * 1024 * 1024 + 7, c->world - 1, seed++);
  }
}

/* SHM_TEST_VERBOSE=1 shows the error messages the failure tests provoke. */
static void note(const char *what, int rc, const char *msg) {
  if (getenv("SHM_TEST_VERBOSE")) printf("[pid %d] %s -> rc %d: %s\n", (int)getpid(), what, rc, msg);
}

static int expect_err(int rc, int code, const char *msg, const char *needle, const char *what) {
  note(what, rc, msg);
  int ok = rc == code && strstr(msg, needle) != NULL;
  CHECK(ok, "%s: want rc %d with '%s', got rc %d: %s", what, code, needle, rc, msg);
  return ok;
}

static void body_mismatch(weft_shm *c, void *arg) {
  (void)arg;
  float x[64] = {0}, y[64 * 8];
  int last = c->me == c->world - 1;
  /* count */
  int rc = weft_shm_all_reduce(c, x, x, last ? 33 : 32, WEFT_F32, WEFT_SUM);
  expect_err(rc, WEFT_EINVAL, weft_last_error(), "different", "count mismatch");
  /* dtype, op */
  rc = weft_shm_all_reduce(c, x, x, 16, last ? WEFT_I32 : WEFT_F32, WEFT_SUM);
  expect_err(rc, WEFT_EINVAL, weft_last_error(), "i32", "dtype mismatch");
  rc = weft_shm_all_reduce(c, x, x, 16, WEFT_F32, last ? WEFT_MAX : WEFT_SUM);
  expect_err(rc, WEFT_EINVAL, weft_last_error(), "max", "op mismatch");
  /* kind and root */
  rc = last ? weft_shm_all_gather(c, x, y, 16) : weft_shm_broadcast(c, x, 16, 0);
  expect_err(rc, WEFT_EINVAL, weft_last_error(), "all_gather", "kind mismatch");
  rc = weft_shm_broadcast(c, x, 16, last ? 1 : 0);
  expect_err(rc, WEFT_EINVAL, weft_last_error(), "root=1", "root mismatch");
  /* large sizes differing (two-shot path on some ranks) */
  float *big = calloc(100000, 4);
  rc = weft_shm_all_reduce(c, big, big, last ? 100000 : 99999, WEFT_F32, WEFT_SUM);
  expect_err(rc, WEFT_EINVAL, weft_last_error(), "count=99999", "large count mismatch");
  free(big);
  /* one rank with a bad dtype: every rank fails, none hangs */
  rc = weft_shm_all_reduce(c, x, x, 16, last ? WEFT_U8 : WEFT_F32, WEFT_SUM);
  CHECK(rc == WEFT_EINVAL, "bad dtype on one rank: rc %d: %s", rc, weft_last_error());
  rc = weft_shm_reduce_scatter(c, last ? NULL : x, y, 4, WEFT_F32, WEFT_SUM);
  CHECK(rc == WEFT_EINVAL, "NULL buffer on one rank: rc %d: %s", rc, weft_last_error());
  /* and the communicator still works */
  t_all_reduce(c, WEFT_F32, WEFT_SUM, 1000, 77, 0);
  t_all_reduce(c, WEFT_BF16, WEFT_SUM, 50000, 79, 1);
}

/* timeout: the last rank arrives late */
static void body_late(weft_shm *c, void *arg) {
  int timeout_ms = *(int *)arg;
  float x[16] = {0};
  if (c->me == c->world - 1) {
    usleep((useconds_t)(timeout_ms + 1500) * 1000);
    int rc = weft_shm_all_reduce(c, x, x, 16, WEFT_F32, WEFT_SUM);
    expect_err(rc, WEFT_EABORT, weft_last_error(), "aborted by rank", "late rank sees abort");
    return;
  }
  int64_t t0 = wf_now_ms();
  int rc = weft_shm_all_reduce(c, x, x, 16, WEFT_F32, WEFT_SUM);
  int64_t dt = wf_now_ms() - t0;
  char want[64];
  snprintf(want, sizeof want, "rank %d (global %d", c->world - 1, c->world - 1);   /* then ", pid P, host H)" */
  const char *msg = weft_last_error();
  note("late rank", rc, msg);
  /* the first to time out aborts the rest: ETIMEOUT there, EABORT elsewhere */
  CHECK((rc == WEFT_ETIMEOUT || rc == WEFT_EABORT) && strstr(msg, want) &&
        strstr(msg, "weft_shm_all_reduce"),
        "late rank: rc %d: %s", rc, msg);
  if (getenv("SHM_TEST_VERBOSE")) printf("[pid %d] late rank: failed after %lld ms\n", (int)getpid(), (long long)dt);
  CHECK(dt < timeout_ms + 2000, "late rank: failed after %lld ms (timeout %d)", (long long)dt,
        timeout_ms);
  rc = weft_shm_all_reduce(c, x, x, 16, WEFT_F32, WEFT_SUM);
  CHECK(rc == WEFT_EABORT, "after a timeout the communicator stays aborted: rc %d", rc);
}

/* a rank dies (SIGKILL) before the collective */
static void body_killed(weft_shm *c, void *arg) {
  int timeout_ms = *(int *)arg;
  float x[4096] = {0};
  int rc = weft_shm_all_reduce(c, x, x, 4096, WEFT_F32, WEFT_SUM);
  CHECK(rc == 0, "before the kill: rc %d %s", rc, weft_last_error());
  if (c->me == c->world - 1) kill(getpid(), SIGKILL);
  int64_t t0 = wf_now_ms();
  rc = weft_shm_all_reduce(c, x, x, 4096, WEFT_F32, WEFT_SUM);
  int64_t dt = wf_now_ms() - t0;
  char want[64];
  snprintf(want, sizeof want, "rank %d (global %d, pid", c->world - 1, c->world - 1);
  const char *msg = weft_last_error();
  note("killed rank", rc, msg);
  CHECK((rc == WEFT_ECLOSED || rc == WEFT_EABORT) && strstr(msg, want) && strstr(msg, "died"),
        "killed rank: rc %d: %s", rc, msg);
  if (getenv("SHM_TEST_VERBOSE")) printf("[pid %d] killed rank: failed after %lld ms\n", (int)getpid(), (long long)dt);
  CHECK(dt < timeout_ms + 2000, "killed rank: failed after %lld ms (timeout %d)", (long long)dt,
        timeout_ms);
}

/* a rank destroys its handle while the others wait */
static void body_left(weft_shm *c, void *arg) {
  (void)arg;
  float x[8] = {0};
  if (c->me == 1) return; /* the harness destroys it right away */
  int rc = weft_shm_all_reduce(c, x, x, 8, WEFT_F32, WEFT_SUM);
  const char *msg = weft_last_error();
  note("left rank", rc, msg);
  CHECK((rc == WEFT_ECLOSED || rc == WEFT_EABORT) && strstr(msg, "rank 1 (global 1)") &&
        strstr(msg, "destroyed"), "left rank: rc %d: %s", rc, msg);
}

/* ------------------------------------------------------------------ kernels */
static int is_nan16(int dt, uint16_t h) {
  return dt == WEFT_F16 ? ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu)) : ((h & 0x7f80u) == 0x7f80u && (h & 0x7fu));
}
static float to32(int dt, uint16_t h) { return dt == WEFT_F16 ? wf_f16_to_f32(h) : wf_bf16_to_f32(h); }
static uint16_t to16(int dt, float f) { return dt == WEFT_F16 ? wf_f32_to_f16(f) : wf_f32_to_bf16(f); }

/* The vector conversions against fpconv.h: every f16/bf16 bit pattern through
 * a one-source reduction (exact round trip), and sums/max/min/products of
 * random pairs (f32 math, one rounding) at every position of the vector body
 * and tail, bit for bit (NaN included). */
static void test_kernels(void) {
  enum { N = 65536 };
  static uint16_t a[N], b[N], out[N];
  const int dts[2] = {WEFT_F16, WEFT_BF16};
  for (int k = 0; k < 2; k++) {
    int dt = dts[k];
    for (int i = 0; i < N; i++) a[i] = (uint16_t)i;
    const void *one[1] = {a};
    wf_reduce(out, one, 1, N, dt, WEFT_SUM);
    int bad = 0;
    for (int i = 0; i < N; i++)
      bad += is_nan16(dt, a[i]) ? !is_nan16(dt, out[i]) : out[i] != a[i];
    CHECK(bad == 0, "kernels %s: %d bit patterns do not round-trip", DTN[dt], bad);
    const int ops[4] = {WEFT_SUM, WEFT_MAX, WEFT_MIN, WEFT_PROD};
    for (int oi = 0; oi < 4; oi++) {
      const int op = ops[oi];
      bad = 0;
      for (int rep = 0; rep < 16; rep++) {
        for (int i = 0; i < N; i++) {
          uint64_t h = mix(((uint64_t)rep << 32) + (uint64_t)i + 977 * (uint64_t)op);
          a[i] = (uint16_t)h;
          b[i] = (uint16_t)(h >> 16);
          if (rep & 1) b[i] = (uint16_t)((a[i] & 0x8000u) ^ (b[i] & 0x83ffu) ^ (a[i] & 0x7c00u)); /* near */
        }
        const void *two[2] = {a, b};
        size_t n = N - (size_t)rep; /* tails of every length */
        wf_reduce(out, two, 2, n, dt, op);
        for (size_t i = 0; i < n; i++) {
          float x = to32(dt, a[i]), y = to32(dt, b[i]);
          /* max/min propagate NaN (the first one wins), like torch */
          float r = op == WEFT_SUM ? x + y : op == WEFT_PROD ? x * y
                    : op == WEFT_MAX ? ((y > x || y != y) ? y : x) : ((y < x || y != y) ? y : x);
          uint16_t want = to16(dt, r);
          /* max/min pick an operand: bit for bit, NaN included (the same
           * quieted payload as fpconv.h); which NaN a sum or product of two
           * NaNs returns is the compiler's choice of operand order */
          bad += (op == WEFT_SUM || op == WEFT_PROD) && is_nan16(dt, want) ? !is_nan16(dt, out[i])
                                                                            : out[i] != want;
        }
      }
      CHECK(bad == 0, "kernels %s %s: %d results differ from fpconv.h", DTN[dt], OPN[op], bad);
    }
  }
}

/* ------------------------------------------------------------------ harness */
static int run(int world, size_t bytes_per_rank, int timeout_ms, body_fn body, void *arg,
               const char *label) {
  char name[64];
  if (wf_shm_random_name("test", name, sizeof name)) return 1;
  size_t slot = wf_shm_round_slot(bytes_per_rank, world);
  int go[2];
  if (pipe(go) != 0) return 1;
  pid_t pids[64];
  for (int r = 1; r < world; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      close(go[1]);
      char b;
      if (read(go[0], &b, 1) != 1) _exit(100);
      weft_shm *c;
      int rc = wf_shm_attach(name, 0, r, world, slot, timeout_ms, "test", NULL, &c);
      CHECK(rc == 0, "%s: attach rank %d: %s", label, r, weft_last_error());
      if (rc == 0) {
        body(c, arg);
        weft_shm_destroy(c);
      }
      fflush(stdout);
      _exit(0);
    }
  }
  close(go[0]);
  weft_shm *c;
  int rc = wf_shm_attach(name, 1, 0, world, slot, timeout_ms, "test", NULL, &c);
  CHECK(rc == 0, "%s: create: %s", label, weft_last_error());
  char ones[64];
  memset(ones, 1, sizeof ones);
  if (world > 1 && write(go[1], ones, (size_t)world - 1) != world - 1) return 1;
  close(go[1]);
  if (rc == 0) {
    rc = wf_shm_wait_attached(c);
    CHECK(rc == 0, "%s: wait attached: %s", label, weft_last_error());
    wf_shm_unlink(name); /* from here nothing can leak */
    if (rc == 0) body(c, arg);
    weft_shm_destroy(c);
  }
  int bad_exit = 0;
  for (int r = 1; r < world; r++) {
    int st;
    waitpid(pids[r], &st, 0);
    int killed_ok = body == body_killed && r == world - 1;
    if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0) && !killed_ok) bad_exit++;
  }
  CHECK(bad_exit == 0, "%s: %d children exited badly", label, bad_exit);
  return 0;
}

/* The child of body_left with index 1 returns at once, so its destroy runs
 * while the others wait. */

/* Segments this test created and that still have a name: every run() made
 * its name as "/weft-test-<this pid>-<hex>" (the parent is always the creator). */
static int count_dev_shm(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "ls /dev/shm 2>/dev/null | grep -c '^weft-test-%d-'", (int)getpid());
  FILE *p = popen(cmd, "r");
  int n = -1;
  if (p) {
    if (fscanf(p, "%d", &n) != 1) n = -1;
    pclose(p);
  }
  return n;
}

int main(int argc, char **argv) {
  stats = mmap(NULL, sizeof *stats, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (stats == MAP_FAILED) return 2;
  setvbuf(stdout, NULL, _IOLBF, 0);
  int quick = 0, errors_only = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--quick") == 0) quick = 1;
    else if (strcmp(argv[i], "--errors-only") == 0) errors_only = 1;
    else { fprintf(stderr, "usage: shm_fork_test [--quick] [--errors-only]\n"); return 2; }
  }

  test_kernels();
  static const int worlds[] = {1, 2, 3, 4, 8};
  for (size_t w = 0; !errors_only && w < sizeof worlds / sizeof worlds[0]; w++) {
    int world = worlds[w];
    int big = !quick;
    char label[64];
    snprintf(label, sizeof label, "correctness world %d slot 256K", world);
    run(world, 256 * 1024, 30000, body_correctness, &big, label);
    int nobig = 0;
    snprintf(label, sizeof label, "correctness world %d slot 4K", world);
    if (!quick || world == 3) run(world, 4096, 30000, body_correctness, &nobig, label);
  }
  run(4, 64 * 1024, 30000, body_mismatch, NULL, "mismatch world 4");
  run(2, 64 * 1024, 30000, body_mismatch, NULL, "mismatch world 2");
  int t_late = 500, t_kill = 5000;
  run(3, 4096, t_late, body_late, &t_late, "late rank world 3");
  run(4, 4096, t_kill, body_killed, &t_kill, "killed rank world 4");
  run(3, 4096, 5000, body_left, NULL, "left rank world 3");

  int left = count_dev_shm();
  CHECK(left == 0, "/dev/shm: %d segments of this test left behind", left);
  int p = atomic_load(&stats->passed), f = atomic_load(&stats->failed);
  printf("shm_fork: %d passed, %d failed\n", p, f);
  return f ? 1 : 0;
}
