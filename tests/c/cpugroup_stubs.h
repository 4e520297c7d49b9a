/* cpugroup_stubs.h — the cpu-group entry points src/shm*.c call, for C tests
 * that link the shm core without the cpu group (ranks are fork()ed and attach
 * by segment name): every one refuses, so the set-up that needs a group
 * (weft_shm_create, zero-copy) is never reached. Include once, in the test. */
#ifndef WF_TEST_CPUGROUP_STUBS_H
#define WF_TEST_CPUGROUP_STUBS_H

#include "core/internal.h"

#define WF_NO_GROUP() wf_error(WEFT_ESTATE, "no cpu group in this test")

int wf_cpugroup_info(weft_cpugroup *g, const char **n, int *s, int *i, const int **r, int *t) {
  (void)g; (void)n; (void)s; (void)i; (void)r; (void)t;
  return WF_NO_GROUP();
}
int weft_cpugroup_broadcast(weft_cpugroup *g, int root, const void *in, size_t len,
                            const void **out, size_t *out_len) {
  (void)g; (void)root; (void)in; (void)len; (void)out; (void)out_len;
  return WF_NO_GROUP();
}
int weft_cpugroup_allgather(weft_cpugroup *g, const void *in, size_t len, const void **out,
                            const size_t **lens) {
  (void)g; (void)in; (void)len; (void)out; (void)lens;
  return WF_NO_GROUP();
}
int weft_cpugroup_barrier(weft_cpugroup *g) {
  (void)g;
  return WF_NO_GROUP();
}
int weft_cpugroup_allreduce_i64(weft_cpugroup *g, int64_t *vals, int n, int op) {
  (void)g; (void)vals; (void)n; (void)op;
  return WF_NO_GROUP();
}
/* no group, so no store: shm.c asks whether rank 0 of the group serves it */
weft_store *wf_cpugroup_store(weft_cpugroup *g) {
  (void)g;
  return NULL;
}
int wf_store_live_registered(weft_store *s) { return s != NULL; }
/* a recv against a barrier (cpugroup.h): no group, no recvs, no sends */
void wf_cpugroup_link_shm(weft_cpugroup *g, weft_shm *c) { (void)g; (void)c; }
void wf_cpugroup_unlink_shm(weft_cpugroup *g, weft_shm *c) { (void)g; (void)c; }
uint64_t wf_cpugroup_sent(const weft_cpugroup *g, int dst) { (void)g; (void)dst; return 0; }
int weft_cpugroup_abort(weft_cpugroup *g, const char *why) {
  (void)g; (void)why;
  return WF_NO_GROUP();
}

#endif
