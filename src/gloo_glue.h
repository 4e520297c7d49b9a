/* gloo_glue.h — what the Gloo shim (a C++ file) needs from the C core: the
 * store under a cpu group, the address that reaches the store, and whether a
 * rank is gone. Implemented in cpugroup.c, store_client.c, store_live.c. */
#ifndef WF_GLOO_GLUE_H
#define WF_GLOO_GLUE_H

#include "weft.h"
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

weft_store *wf_cpugroup_store(weft_cpugroup *g);
/* the store's reference count (store.c): a handle that keeps it holds one */
void wf_store_ref(weft_store *s);
void wf_store_unref(weft_store *s);
int wf_store_local_addr(weft_store *s, char *buf, size_t n);
/* how many ranks of the world (ranks[]: the group, a subset) have a store
 * tombstone, polled up to wait_ms (all described in who: "rank R (pid P,
 * host H), ..."); 0: none */
int wf_store_gone_among(weft_store *s, const int *ranks, int n, int wait_ms, char *who,
                        size_t whon);

#ifdef __cplusplus
}
#endif
#endif
