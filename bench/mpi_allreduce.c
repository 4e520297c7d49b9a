/* mpi_allreduce.c — Open MPI's MPI_Allreduce as the peer of weft's host
 * all-reduce (scripts/bench-host.lua runs both side by side).
 *
 * Same method as the weft side: f32 sum in place, for each size fresh random
 * data before every call, a barrier, one timed call; per call the slowest
 * rank's time counts; the median over the calls is reported. Values are small
 * integers stored as floats, so the sum is exact in any order and the result
 * is checked element by element on the first and last call of every size.
 *
 * usage: mpi_allreduce [--min BYTES] [--max BYTES] [--factor F] [--iters N]
 *                      [--warmup N]
 * Rank 0 prints one line per size:
 *   mpi world=W bytes=B iters=N us=MEDIAN min_us=MIN busbw_gbs=BW check=ok
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
  if (factor < 2 || min_b < 4 || max_b < min_b) {
    if (rank == 0) fprintf(stderr, "mpi_allreduce: bad arguments\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  float *buf = malloc(max_b);
  float *tmp = malloc(2 * max_b);
  double *times = malloc(sizeof(double) * (size_t)(iters_max + warmup));
  double *tmax = malloc(sizeof(double) * (size_t)(iters_max + warmup));
  if (!buf || !tmp || !times || !tmax) MPI_Abort(MPI_COMM_WORLD, 3);
  int failed = 0;
  for (size_t bytes = min_b; bytes <= max_b; bytes *= (size_t)factor) {
    size_t n = bytes / sizeof(float);
    /* fewer calls for large sizes: about 256 MiB of payload per size */
    long iters = (long)((256L << 20) / (long)bytes);
    if (iters > iters_max) iters = iters_max;
    if (iters < 10) iters = 10;
    long total = iters + warmup;
    int bad = 0;
    for (long c = 0; c < total; c++) {
      fill(buf, n, rank, (int)c, bytes);
      MPI_Barrier(MPI_COMM_WORLD);
      double t0 = MPI_Wtime();
      MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      times[c] = MPI_Wtime() - t0;
      if ((c == warmup || c == total - 1) && !bad) {
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
      printf("mpi world=%d bytes=%zu iters=%ld us=%.3f min_us=%.3f busbw_gbs=%.4f check=%s\n",
             world, bytes, iters, med * 1e6, tmax[warmup] * 1e6, busbw, anybad ? "FAILED" : "ok");
      fflush(stdout);
      failed |= anybad;
    }
  }
  free(buf); free(tmp); free(times); free(tmax);
  MPI_Finalize();
  return failed ? 1 : 0;
}
