/* shm_bench.c — quick all_reduce timing of the shm core with fork()ed ranks
 * (no cpu group, no Lua), next to single-thread memcpy bandwidth.
 *   shm_bench [-n ranks] [-s slot_bytes] [-d f32|bf16] [-o sum|max|min] [--min B] [--max B]
 * Per size: 3 warm-up calls, then calls back to back for ~0.3 s (at least 8);
 * prints the median and minimum µs per call seen by rank 0 (medians resist a
 * loaded machine's preemptions better than means) and the bus bandwidth
 * 2(n-1)/n * bytes / median, like nccl-tests. */
#include "host/shm.h"

#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cpugroup_stubs.h" /* shm.c's create path needs the cpu group; not linked here */

static size_t minb = 1024, maxb = 64u << 20;
static int dtype = WEFT_F32, redop = WEFT_SUM;

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

static int64_t times[1 << 20];

static void body(weft_shm *c) {
  uint8_t *buf = malloc(maxb), *cp = malloc(maxb);
  memset(buf, 0, maxb);
  memset(cp, 0, maxb);
  if (c->me == 0)
    printf("%10s %10s %10s %10s %10s %11s\n", "bytes", "median us", "min us", "busbw GB/s",
           "memcpy us", "memcpy GB/s");
  for (size_t b = minb; b <= maxb; b *= 4) {
    size_t count = b / weft_dtype_size(dtype);
    for (int i = 0; i < 3; i++) weft_shm_all_reduce(c, buf, buf, count, dtype, redop);
    /* everyone runs the same number of calls: rank 0 decides and broadcasts */
    int64_t t0 = wf_now_ns();
    int iters = 0;
    int32_t go = 1;
    while (go) {
      int64_t t1 = wf_now_ns();
      int rc = weft_shm_all_reduce(c, buf, buf, count, dtype, redop);
      if (rc) { fprintf(stderr, "all_reduce: %s\n", weft_last_error()); exit(1); }
      times[iters++] = wf_now_ns() - t1;
      if ((iters & 3) == 0) {
        go = c->me != 0 || ((iters < 8 || wf_now_ns() - t0 < 300000000LL) &&
                            iters < (int)(sizeof times / sizeof times[0]) - 8);
        weft_shm_broadcast(c, &go, sizeof go, 0);
      }
    }
    qsort(times, (size_t)iters, sizeof times[0], cmp_i64);
    double us = (double)times[iters / 2] / 1e3, umin = (double)times[0] / 1e3;
    if (c->me == 0) {
      int64_t m0 = wf_now_ns();
      int mi = 0;
      while (mi < 5 || wf_now_ns() - m0 < 100000000LL) { memcpy(cp, buf, b); mi++; }
      double mus = (double)(wf_now_ns() - m0) / 1e3 / mi;
      double bus = 2.0 * (c->world - 1) / c->world * (double)b / (us * 1e3);
      printf("%10zu %10.2f %10.2f %10.2f %10.2f %11.2f\n", b, us, umin, bus, mus,
             (double)b / (mus * 1e3));
    }
  }
  free(buf);
  free(cp);
}

int main(int argc, char **argv) {
  int world = 2;
  size_t slot = 1u << 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "-n")) world = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "-s")) slot = strtoull(argv[i + 1], NULL, 0);
    else if (!strcmp(argv[i], "-d")) dtype = strcmp(argv[i + 1], "bf16") ? WEFT_F32 : WEFT_BF16;
    else if (!strcmp(argv[i], "-o"))
      redop = !strcmp(argv[i + 1], "max") ? WEFT_MAX : !strcmp(argv[i + 1], "min") ? WEFT_MIN : WEFT_SUM;
    else if (!strcmp(argv[i], "--min")) minb = strtoull(argv[i + 1], NULL, 0);
    else if (!strcmp(argv[i], "--max")) maxb = strtoull(argv[i + 1], NULL, 0);
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  char name[64];
  wf_shm_random_name("bench", name, sizeof name);
  slot = wf_shm_round_slot(slot, world);
  int go[2];
  if (pipe(go)) return 1;
  for (int r = 1; r < world; r++)
    if (fork() == 0) {
      close(go[1]);
      char b;
      if (read(go[0], &b, 1) != 1) _exit(1);
      weft_shm *c;
      if (wf_shm_attach(name, 0, r, world, slot, 60000, "bench", NULL, &c)) _exit(1);
      body(c);
      weft_shm_destroy(c);
      _exit(0);
    }
  weft_shm *c;
  if (wf_shm_attach(name, 1, 0, world, slot, 60000, "bench", NULL, &c)) {
    fprintf(stderr, "%s\n", weft_last_error());
    return 1;
  }
  char ones[256];
  memset(ones, 1, sizeof ones);
  if (write(go[1], ones, (size_t)world - 1) < 0) return 1;
  wf_shm_wait_attached(c);
  wf_shm_unlink(name);
  printf("# shm all_reduce %s %s in place, %d ranks, slot %zu bytes, one-shot up to %zu bytes\n",
         dtype == WEFT_F32 ? "f32" : "bf16",
         redop == WEFT_MAX ? "max" : redop == WEFT_MIN ? "min" : "sum", world, slot, c->oneshot_max);
  body(c);
  weft_shm_destroy(c);
  while (wait(NULL) > 0) {}
  return 0;
}
