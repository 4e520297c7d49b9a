/* store_waiters.c — GET on the server: answered at once when its keys are
 * there, else parked until they come, its deadline passes or a rejected rank
 * makes the wait hopeless; a key set wakes the parked GETs it completes.
 * Part of the server (store_server.h). */
#include "store_server.h"

#include <stdlib.h>

/* ---- GET: answer now, or park until the keys exist ---- */

static int get_missing(srv *v, conn *c) {
  int m = 0;
  for (int i = 0; i < c->nkeys; i++) if (!tab_find(v, c->keys[i])) m++;
  return m;
}

/* Whether every key is present. The cursor makes re-checks on each wake-up
 * O(1) amortized per waiter (a barrier of n ranks costs O(n) per set, not
 * O(n^2)); a full pass confirms before answering, as keys can be deleted. */
static int get_complete(srv *v, conn *c) {
  while (c->cursor < c->nkeys && tab_find(v, c->keys[c->cursor])) c->cursor++;
  if (c->cursor < c->nkeys) return 0;
  for (int i = 0; i < c->nkeys; i++)
    if (!tab_find(v, c->keys[i])) { c->cursor = i; return 0; }
  return 1;
}

static void get_answer(srv *v, conn *c) {
  resp_begin(c, 0);
  if (!(c->gflags & WF_GET_NOVALUES)) {
    wf_store_wb_u32(&c->out, (uint32_t)c->nkeys);
    for (int i = 0; i < c->nkeys; i++) {
      entry *e = tab_find(v, c->keys[i]);
      wf_store_wb_val(&c->out, e->val, e->vlen);
    }
  }
  if (c->gflags & WF_GET_CONSUME)
    for (int i = 0; i < c->nkeys; i++) {
      entry *e = tab_find(v, c->keys[i]);
      if (e && e->reads > 0 && --e->reads == 0) tab_del(v, c->keys[i]);
    }
  int was_parked = c->state == C_PARKED;
  c->state = C_READY;
  frame_end(v, c, WF_OP_RESP);
  if (was_parked) { shed(c); account(v, c); }
}

void get_missing_answer(srv *v, conn *c, int32_t status) {
  int was_parked = c->state == C_PARKED;
  resp_begin(c, status);
  wf_store_wb_u32(&c->out, (uint32_t)get_missing(v, c));
  for (int i = 0; i < c->nkeys; i++) if (!tab_find(v, c->keys[i])) wf_store_wb_u32(&c->out, (uint32_t)i);
  put_rejection_note(v, c);
  c->state = C_READY;
  frame_end(v, c, WF_OP_RESP);
  if (was_parked) { shed(c); account(v, c); }
}

/* A wait that cannot complete: a rank of the world was rejected (above). */
void fail_parked(srv *v, conn *c) {
  int was_parked = c->state == C_PARKED;
  c->state = C_READY;
  resp_error(v, c, WEFT_EAUTH, v->block_msg);
  if (was_parked) { shed(c); account(v, c); }
}

/* A key appeared: answer every parked GET that is now complete. */
void wake_waiters(srv *v) {
  for (int i = 0; i < v->nc; i++) {
    conn *c = v->c[i];
    if (!c->dead && c->state == C_PARKED && get_complete(v, c)) get_answer(v, c);
  }
}

int handle_get(srv *v, conn *c, wf_rd *r) {
  int32_t timeout = (int32_t)wf_rd_u32(r);
  int put = (c->flags & WF_GET_PUT) != 0;
  wf_store_kref pk = {0};
  const uint8_t *pv = NULL;
  size_t pn = 0;
  uint32_t preads = 0;
  if (put) {
    preads = wf_rd_u32(r);
    if (wf_store_rd_key(r, &pk) || wf_store_rd_val(r, v->max_value, &pv, &pn)) return -1;
  }
  uint32_t n = wf_rd_u32(r);
  if (r->bad || n == 0 || n > WF_ST_MAX_NKEYS) return -1;
  if ((int)n > c->capkeys) {
    wf_store_kref *k = realloc(c->keys, n * sizeof *k);
    if (!k) return -1;
    c->keys = k;
    c->capkeys = (int)n;
  }
  for (uint32_t i = 0; i < n; i++) if (wf_store_rd_key(r, &c->keys[i])) return -1;
  if (r->pos != r->len) return -1;
  c->nkeys = (int)n;
  c->cursor = 0;
  c->gflags = c->flags;
  int giveup = put && (c->flags & WF_GET_GIVEUP);
  if (put && !giveup) {
    int rc = tab_set(v, pk, pv, pn, preads);
    if (rc) { set_refused(v, c, rc); return 0; }
    wake_waiters(v);
  }
  if (get_complete(v, c)) get_answer(v, c);
  else if (giveup) {
    /* the collective's keys go and its abort key comes in one step: no
     * member arriving later completes it (WF_GET_GIVEUP) */
    for (int i = 0; i < c->nkeys; i++) tab_del(v, c->keys[i]);
    int rc = tab_set(v, pk, pv, pn, preads);
    if (rc) { set_refused(v, c, rc); return 0; }
    wake_waiters(v);
    get_missing_answer(v, c, WEFT_EAGAIN);
  }
  else if (timeout <= 0) get_missing_answer(v, c, WEFT_EAGAIN);
  else if (v->blocked_rank >= 0) fail_parked(v, c);
  else {
    c->state = C_PARKED;
    c->pdeadline = wf_now_ms() + timeout;
    c->pkey = pk;
    c->has_pkey = put;
  }
  return 0;
}
