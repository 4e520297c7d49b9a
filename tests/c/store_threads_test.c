/* store_threads_test.c — the store from C with threads:
 *  1. 8 threads share ONE handle (its mutex serializes them): counters add up;
 *  2. 8 threads with their own handles pass a token around a chain of
 *     server-side waits (each waits for the previous thread's key);
 *  3. 64 parked waiters on one barrier-like key set are all released.
 * Prints "store_threads: N passed, M failed"; exit 0 only when all pass.
 * Build: cc -O2 -Isrc tests/c/store_threads_test.c -Lbuild -lweft -pthread */
#include "weft.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define T 8
#define ITERS 300

static weft_store *shared;
static int port, passed, failed;

#define CHECK(cond, ...) do { if (cond) passed++; else { failed++; printf("FAIL: " __VA_ARGS__); \
  printf(" (%s)\n", weft_last_error()); } } while (0)

static void *adder(void *arg) {
  long id = (long)arg;
  char key[64];
  snprintf(key, sizeof key, "own/%ld", id);
  for (int i = 0; i < ITERS; i++) {
    int64_t r;
    if (weft_store_add(shared, "total", 1, &r) || weft_store_add(shared, key, 2, &r)) return (void *)1;
    if (r != 2 * (i + 1)) return (void *)2;
  }
  return NULL;
}

static weft_store *open_client(void) {
  weft_store_opts o = {.host = "127.0.0.1", .port = port, .timeout_ms = 5000};
  weft_store *s = NULL;
  return weft_store_open(&o, &s) == 0 ? s : NULL;
}

static void *chain(void *arg) {
  long id = (long)arg;
  weft_store *s = open_client();
  if (!s) return (void *)1;
  char prev[32], mine[32];
  snprintf(prev, sizeof prev, "chain/%ld", id);
  snprintf(mine, sizeof mine, "chain/%ld", id + 1);
  const void *v;
  size_t n;
  long rc = 0;
  if (weft_store_get(s, prev, 10000, &v, &n)) rc = 3;
  else {
    char val[32];
    snprintf(val, sizeof val, "token-%ld", id + 1);
    if (weft_store_set(s, mine, val, strlen(val))) rc = 4;
  }
  weft_store_close(s);
  return (void *)rc;
}

static void *waiter(void *arg) {
  (void)arg;
  weft_store *s = open_client();
  if (!s) return (void *)1;
  const char *keys[2] = {"gate/a", "gate/b"};
  long rc = weft_store_wait(s, keys, 2, 10000) ? 5 : 0;
  weft_store_close(s);
  return (void *)rc;
}

int main(void) {
  weft_store_opts o = {.port = 0, .is_server = 1, .timeout_ms = 5000};
  CHECK(weft_store_open(&o, &shared) == 0, "open server");
  if (!shared) return 1;
  weft_store_port(shared, &port);

  pthread_t th[64];
  for (long i = 0; i < T; i++) pthread_create(&th[i], NULL, adder, (void *)i);
  for (int i = 0; i < T; i++) {
    void *r;
    pthread_join(th[i], &r);
    CHECK(r == NULL, "adder %d returned %ld", i, (long)r);
  }
  int64_t total = 0;
  CHECK(weft_store_add(shared, "total", 0, &total) == 0 && total == T * ITERS,
        "shared-handle total %lld, want %d", (long long)total, T * ITERS);

  for (long i = 0; i < T; i++) pthread_create(&th[i], NULL, chain, (void *)i);
  CHECK(weft_store_set(shared, "chain/0", "go", 2) == 0, "start chain");
  for (int i = 0; i < T; i++) {
    void *r;
    pthread_join(th[i], &r);
    CHECK(r == NULL, "chain link %d returned %ld", i, (long)r);
  }
  const void *v;
  size_t n;
  char last[32];
  snprintf(last, sizeof last, "chain/%d", T);
  CHECK(weft_store_get(shared, last, 1000, &v, &n) == 0 && n == 7 && memcmp(v, "token-8", 7) == 0,
        "chain end");

  for (long i = 0; i < 64; i++) pthread_create(&th[i], NULL, waiter, (void *)i);
  CHECK(weft_store_set(shared, "gate/a", "1", 1) == 0, "gate a");
  CHECK(weft_store_set(shared, "gate/b", "1", 1) == 0, "gate b");
  int ok = 0;
  for (int i = 0; i < 64; i++) {
    void *r;
    pthread_join(th[i], &r);
    ok += r == NULL;
  }
  CHECK(ok == 64, "%d of 64 waiters released", ok);

  CHECK(weft_store_close(shared) == 0, "close");
  printf("store_threads: %d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
