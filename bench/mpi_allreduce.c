/* mpi_allreduce.c — Open MPI's MPI_Allreduce as the peer of weft's host
 * all-reduce (scripts/bench-host.lua runs both side by side).
 *
 * Same method as the weft side: sum in place, for each size fresh random
 * data before every call, a barrier, one timed call; per call the slowest
 * rank's time counts; the median and the 99th percentile over the calls are
 * reported. Values are small integers, so the sum is exact in any order (in
 * bf16 too: |sum| <= 8 * ranks < 256) and the result is checked element by
 * element on the first and last call of every size. bf16: MPI has no such
 * type, so it is a 2-byte type with a user-defined sum (what a framework on
 * MPI does: f32 accumulation, rounded to nearest even).
 *
 * --settle: an untimed barrier after every timed call, so no rank starts
 * the next call's fill while a peer sharing its CPU has not yet returned
 * from the timed one (ranks outnumbering CPUs: without it a rank's time
 * also holds its CPU-mates' fills; scripts/bench-host.lua says more).
 *
 * usage: mpi_allreduce [--min BYTES] [--max BYTES] [--factor F] [--iters N]
 *                      [--warmup N] [--dtype f32|bf16] [--settle]
 * Rank 0 prints one line per size:
 *   mpi world=W bytes=B iters=N us=MEDIAN p99_us=P99 min_us=MIN busbw_gbs=BW dtype=D check=ok
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t mix(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

/* integer-valued floats in [-8, 8] from (rank, call, size) */
static void fill(float *p, size_t n, int rank, int call, size_t bytes) {
  uint64_t s = mix(((uint64_t)rank << 48) ^ ((uint64_t)call << 32) ^ bytes);
  for (size_t i = 0; i < n; i++) {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    p[i] = (float)((int)((s >> 33) % 17) - 8);
  }
}

static float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even (no NaNs here) */
  return (uint16_t)(u >> 16);
}

static void bf16_sum(void *in, void *inout, int *len, MPI_Datatype *dt) {
  (void)dt;
  const uint16_t *a = in;
  uint16_t *b = inout;
  for (int i = 0; i < *len; i++) b[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}

static void to_bf16(const float *src, uint16_t *dst, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

static int check(const float *p, size_t n, int world, int call, size_t bytes, float *tmp) {
  float *ref = tmp;
  memset(ref, 0, n * sizeof(float));
  float *one = tmp + n;
  for (int r = 0; r < world; r++) {
    fill(one, n, r, call, bytes);
    for (size_t i = 0; i < n; i++) ref[i] += one[i];
  }
  for (size_t i = 0; i < n; i++)
    if (p[i] != ref[i]) return (int)(i + 1);
  return 0;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static long arg_long(int argc, char **argv, const char *name, long dflt) {
  for (int i = 1; i + 1 < argc; i++)
    if (strcmp(argv[i], name) == 0) return strtol(argv[i + 1], NULL, 0);
  return dflt;
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int rank, world;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  size_t min_b = (size_t)arg_long(argc, argv, "--min", 1024);
  size_t max_b = (size_t)arg_long(argc, argv, "--max", 64L << 20);
  long factor = arg_long(argc, argv, "--factor", 4);
  long iters_max = arg_long(argc, argv, "--iters", 200);
  long warmup = arg_long(argc, argv, "--warmup", 3);
  int bf16 = 0, settle = 0;
  for (int i = 1; i + 1 < argc; i++)
    if (strcmp(argv[i], "--dtype") == 0) bf16 = strcmp(argv[i + 1], "bf16") == 0;
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--settle") == 0) settle = 1;
  const size_t es = bf16 ? 2 : 4;
  MPI_Datatype type = MPI_FLOAT;
  MPI_Op op = MPI_SUM;
  if (bf16) {
    MPI_Type_contiguous(2, MPI_BYTE, &type);
    MPI_Type_commit(&type);
    MPI_Op_create(bf16_sum, 1, &op);
  }
  if (factor < 2 || min_b < 4 || max_b < min_b) {
    if (rank == 0) fprintf(stderr, "mpi_allreduce: bad arguments\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  float *buf = malloc(max_b * 2); /* bf16: f32 values first, then converted */
  uint16_t *hbuf = malloc(max_b);
  float *tmp = malloc(4 * max_b);
  double *times = malloc(sizeof(double) * (size_t)(iters_max + warmup));
  double *tmax = malloc(sizeof(double) * (size_t)(iters_max + warmup));
  if (!buf || !hbuf || !tmp || !times || !tmax) MPI_Abort(MPI_COMM_WORLD, 3);
  int failed = 0;
  for (size_t bytes = min_b; bytes <= max_b; bytes *= (size_t)factor) {
    size_t n = bytes / es;
    /* fewer calls for large sizes: about 256 MiB of payload per size */
    long iters = (long)((256L << 20) / (long)bytes);
    if (iters > iters_max) iters = iters_max;
    if (iters < 10) iters = 10;
    long total = iters + warmup;
    int bad = 0;
    for (long c = 0; c < total; c++) {
      fill(buf, n, rank, (int)c, bytes);
      if (bf16) to_bf16(buf, hbuf, n);
      void *data = bf16 ? (void *)hbuf : (void *)buf;
      MPI_Barrier(MPI_COMM_WORLD);
      double t0 = MPI_Wtime();
      MPI_Allreduce(MPI_IN_PLACE, data, (int)n, type, op, MPI_COMM_WORLD);
      times[c] = MPI_Wtime() - t0;
      if (settle) MPI_Barrier(MPI_COMM_WORLD);
      if ((c == warmup || c == total - 1) && !bad) {
        if (bf16)
          for (size_t i = 0; i < n; i++) buf[i] = bf16_to_f32(hbuf[i]);
        int at = check(buf, n, world, (int)c, bytes, tmp);
        if (at) {
          fprintf(stderr, "mpi_allreduce: rank %d: wrong sum at element %d for %zu bytes\n",
                  rank, at - 1, bytes);
          bad = 1;
        }
      }
    }
    MPI_Reduce(times, tmax, (int)total, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    int anybad = 0;
    MPI_Reduce(&bad, &anybad, 1, MPI_INT, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) {
      qsort(tmax + warmup, (size_t)iters, sizeof(double), cmp_double);
      double med = tmax[warmup + iters / 2];
      if (iters % 2 == 0) med = 0.5 * (tmax[warmup + iters / 2 - 1] + tmax[warmup + iters / 2]);
      double busbw = (double)bytes / med * 2.0 * (world - 1) / world / 1e9;
      long k99 = (long)((double)iters * 0.99 + 0.5) - 1; /* nearest rank */
      if (k99 < 0) k99 = 0;
      if (k99 >= iters) k99 = iters - 1;
      printf("mpi world=%d bytes=%zu iters=%ld us=%.3f p99_us=%.3f min_us=%.3f busbw_gbs=%.4f "
             "dtype=%s check=%s\n", world, bytes, iters, med * 1e6, tmax[warmup + k99] * 1e6,
             tmax[warmup] * 1e6, busbw, bf16 ? "bf16" : "f32", anybad ? "FAILED" : "ok");
      fflush(stdout);
      failed |= anybad;
    }
  }
  free(buf); free(hbuf); free(tmp); free(times); free(tmax);
  if (bf16) { MPI_Op_free(&op); MPI_Type_free(&type); }
  MPI_Finalize();
  return failed ? 1 : 0;
}
