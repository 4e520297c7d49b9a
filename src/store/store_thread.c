/* store_thread.c — a connection of its own for each progress worker.
 *
 * A handle has one connection, and a wait holds it (with the handle's mutex)
 * until the server answers: a group's all-gather is parked at the server
 * until every member has arrived. When an async worker (src/async.c) waited
 * on one group through the caller's handle while the caller's thread waited
 * on another, each rank's second wait queued behind its first, and ranks
 * that had started them in different orders waited for each other until the
 * timeout (issue 24 item 4). So a thread marked private here never uses the
 * handles it is given: the first time it uses one, it gets a sibling, its
 * own connection to the same server (same address, secret, timeout, server
 * instance and view of the registered ranks), and uses that from then on.
 * A sibling never speaks for the rank (no registration, no leave, no
 * rebind): its connection closing is no death. The siblings of a thread are
 * closed when it ends its private use (the worker's exit). */
#include "store_internal.h"
#include "store_share.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define WF_SIBLINGS 8   /* handles one worker may use at once (one per store) */

typedef struct { weft_store *orig, *sib; } pair;

static __thread int tl_private;
static __thread pair tl_pairs[WF_SIBLINGS];

void wf_store_thread_private(void) { tl_private = 1; }

static void sib_close(pair *p) {
  weft_store_close(p->sib);
  wf_store_unref(p->orig);
  p->orig = p->sib = NULL;
}

void wf_store_thread_release(void) {
  for (int i = 0; i < WF_SIBLINGS; i++)
    if (tl_pairs[i].orig) sib_close(&tl_pairs[i]);
  tl_private = 0;
}

/* Reads only what is fixed once the handle is open and its rank registered
 * (weft.init registers before any group exists): never s's mutex, which
 * the caller's thread may hold for a whole wait. */
static int sib_open(weft_store *s, const char *op, weft_store **out) {
  weft_store *c = calloc(1, sizeof *c);
  if (!c) return wf_error(WEFT_ENOMEM, "%s: out of memory for a worker's store connection", op);
  pthread_mutex_init(&c->mu, NULL);
  c->refs = 1;
  c->fd = -1;
  c->sibling = 1;
  memcpy(c->host, s->host, sizeof c->host);
  c->port = s->port;
  memcpy(c->where, s->where, sizeof c->where);
  c->timeout_ms = s->timeout_ms;
  c->max_value = s->max_value;
  c->instance = s->instance;  /* meet the server the handle knows, or fail */
  memcpy(c->rank0, s->rank0, sizeof c->rank0);
  c->live_rank = s->live_rank;
  c->live_world = s->live_world;
  int rc = 0;
  if (s->secret && !(c->secret = strdup(s->secret))) rc = WEFT_ENOMEM;
  if (!rc && c->live_rank >= 0 && !(c->live_reg = calloc((size_t)c->live_world, sizeof *c->live_reg)))
    rc = WEFT_ENOMEM;
  if (rc) rc = wf_error(rc, "%s: out of memory for a worker's store connection", op);
  if (!rc) {
    c->t0 = wf_now_ms();
    rc = wf_store_cl_connect(c, op, c->t0 + c->timeout_ms, 0);
  }
  if (rc) { weft_store_close(c); return rc; }
  *out = c;
  return 0;
}

int wf_store_here(weft_store *s, const char *op, weft_store **out) {
  *out = s;
  if (!tl_private || !s) return 0;
  pair *slot = NULL;
  for (int i = 0; i < WF_SIBLINGS; i++) {
    if (tl_pairs[i].orig == s) {
      if (!__atomic_load_n(&s->closed, __ATOMIC_ACQUIRE)) { *out = tl_pairs[i].sib; return 0; }
      sib_close(&tl_pairs[i]);  /* the handle was closed: so is its sibling */
      return wf_error(WEFT_ESTATE, "%s: the store was closed", op);
    }
    if (!tl_pairs[i].orig && !slot) slot = &tl_pairs[i];
  }
  if (__atomic_load_n(&s->closed, __ATOMIC_ACQUIRE))
    return wf_error(WEFT_ESTATE, "%s: the store was closed", op);
  if (!slot)
    return wf_error(WEFT_ESTATE, "%s: this worker thread already uses %d stores", op, WF_SIBLINGS);
  weft_store *c = NULL;
  int rc = sib_open(s, op, &c);
  if (rc) return rc;
  wf_store_ref(s);  /* s stays a valid key for this slot while the sibling lives */
  slot->orig = s;
  slot->sib = c;
  *out = c;
  return 0;
}
