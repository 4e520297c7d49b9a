/* env.c — configuration from the environment (WEFT_*), read in one place,
 * plus the clock and backoff helpers every bounded wait uses. */
#include "internal.h"

#include <stdlib.h>
#include <time.h>

const char *wf_env_str(const char *name) {
  const char *v = getenv(name);
  return (v && *v) ? v : NULL;
}

long wf_env_long(const char *name, long dflt) {
  const char *v = wf_env_str(name);
  if (!v) return dflt;
  char *end;
  long x = strtol(v, &end, 10);
  return (*end == '\0') ? x : dflt;
}

void wf_env_rank(int *rank, int *world) {
  long r = wf_env_long("RANK", -1), w = wf_env_long("WORLD_SIZE", -1);
  int ok = r >= 0 && w > 0 && r < w && w <= (1L << 20);
  *rank = ok ? (int)r : -1;
  *world = ok ? (int)w : -1;
}

void wf_env_store_limits(wf_store_limits *l) {
  l->max_conns = wf_env_long("WEFT_STORE_MAX_CONNS", 0);
  l->max_preauth = wf_env_long("WEFT_STORE_MAX_PREAUTH", 256);
  l->read_ms = wf_env_long("WEFT_STORE_READ_TIMEOUT_MS", 10000);
  l->idle_ms = wf_env_long("WEFT_STORE_IDLE_MS", 0);
  l->max_total = wf_env_long("WEFT_STORE_MAX_TOTAL", 0);
  if (l->max_total < 0) l->max_total = 0;
  if (l->max_conns < 0) l->max_conns = 0;
  if (l->max_preauth <= 0) l->max_preauth = 256;
  if (l->read_ms <= 0) l->read_ms = 10000;
  if (l->idle_ms < 0) l->idle_ms = 0;
}

int64_t wf_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int64_t wf_now_ms(void) { return wf_now_ns() / 1000000LL; }

void wf_backoff(int *us, int max_us) {
  if (*us <= 0) *us = 20;
  struct timespec ts = {.tv_sec = *us / 1000000, .tv_nsec = (long)(*us % 1000000) * 1000};
  nanosleep(&ts, NULL);
  *us = (*us * 2 > max_us) ? max_us : *us * 2;
}
