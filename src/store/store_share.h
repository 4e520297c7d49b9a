/* store_share.h — the store's calls for the layers above it that weft.h does
 * not carry (cpugroup.c, the Gloo shim: C and C++): references that keep a
 * handle's memory past close(), the local address that reaches the server,
 * which ranks are gone, and worker threads' own connections. Implemented in
 * store.c, store_client.c, store_live.c, store_thread.c. */
#ifndef WF_STORE_SHARE_H
#define WF_STORE_SHARE_H

#include "weft.h"
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* References held by cpu groups and Gloo contexts (store.c). */
void wf_store_ref(weft_store *s);
void wf_store_unref(weft_store *s);
/* The local address of this handle's connection to the server: what a
 * peer on another node can reach (store_client.c). */
int wf_store_local_addr(weft_store *s, char *buf, size_t n);
/* How many ranks of the world (ranks[]: the group, a subset; NULL: all) have
 * a store tombstone, polled up to wait_ms; all described in who: "rank R
 * (pid P, host H), ..." (store_live.c). 0: none. */
int wf_store_gone_among(weft_store *s, const int *ranks, int n, int wait_ms, char *who,
                        size_t whon);
/* Worker threads (src/async.c) (store_thread.c): after
 * wf_store_thread_private(), wf_store_here(s) gives this thread's own
 * connection to s's server (made on first use), so that its waits never
 * queue behind the caller's thread's waits on s; on any other thread it
 * gives s. wf_store_thread_release() closes the thread's connections. */
void wf_store_thread_private(void);
void wf_store_thread_release(void);
int wf_store_here(weft_store *s, const char *op, weft_store **out);
/* The same, with the rest of what the store can tell: ranks whose host the
 * store's host gets no TCP acknowledgement from (a partition), and whether
 * the store itself could not be asked. Ends within wait_ms + ~300 ms in
 * all (store_live.c). Returns d->gone. */
typedef struct wf_store_diag {
  int gone, unreachable, store_lost;
  char gone_who[1200];      /* "rank R (pid P, host H), ..." */
  char unreach_who[1200];
  char store_why[700];      /* "...: the store at ADDR (rank 0 ...) is unreachable: ..." */
} wf_store_diag;
int wf_store_diagnose(weft_store *s, int wait_ms, wf_store_diag *d);
/* The same with s already locked by the caller. */
int wf_store_diagnose_locked(weft_store *s, int wait_ms, wf_store_diag *d);
/* What a diagnosis adds to a failure's message, the same on every route:
 * "; unreachable from the store's host (no TCP acknowledgement, a
 * partition?): rank 2 (pid P, host H), ..." and "; <the store's own
 * failure>"; "" when it found neither. */
void wf_store_diag_note(const wf_store_diag *d, char *buf, size_t n);
/* 1 when this handle's ranks registered their liveness (weft.init's world
 * store, which global rank 0 hosts) (store_live.c). */
int wf_store_live_registered(weft_store *s);
/* 1 when this handle's process serves the store (store.c). */
int wf_store_serves(weft_store *s);

#ifdef __cplusplus
}
#endif
#endif
