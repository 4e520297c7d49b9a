/* store_server_live.c — the server's half of liveness (store_live.c is the
 * client's): the connection that speaks for a rank, the tombstone when it
 * ends uncleanly, the "unreachable" mark while its TCP stays silent.
 * Part of the server (store_server.h). */
#include "store_server.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

/* Reachability of registered ranks (live_reach): their connections carry
 * TCP keepalive probes every second of silence, which the far kernel
 * acknowledges even when the process is stopped or busy; no acknowledgement
 * for REACH_SILENT_MS means its host is cut off. Looked at every
 * REACH_CHECK_MS. */
#define REACH_CHECK_MS 250
#define REACH_SILENT_MS 1500

/* ---- liveness (store_live.c): a rank's key and its tombstone ---- */

/* Removes c's "<live key>/unreachable" mark. */
void live_unmark(srv *v, conn *c) {
  uint8_t key[WF_ST_MAX_KEY + 16];
  if (!c->live_key || c->live_klen + 12 > sizeof key) return;
  memcpy(key, c->live_key, c->live_klen);
  memcpy(key + c->live_klen, "/unreachable", 12);
  tab_del(v, (wf_store_kref){key, c->live_klen + 12});
}

/* c now speaks for the rank that key names (a reconnect takes it over). */
void live_bind(srv *v, conn *c, wf_store_kref k) {
  for (int i = 0; i < v->nc; i++) {
    conn *o = v->c[i];
    if (o != c && o->live_key && o->live_klen == k.len && !memcmp(o->live_key, k.p, k.len)) {
      free(o->live_key);
      o->live_key = NULL;
    }
  }
  uint8_t *copy = malloc(k.len + 5);
  if (!copy) return;  /* only costs the early death report */
  memcpy(copy, k.p, k.len);
  memcpy(copy + k.len, "/gone", 5);
  tab_del(v, (wf_store_kref){copy, k.len + 5});  /* alive again */
  free(c->live_key);
  c->live_key = copy;
  c->live_klen = k.len;
  live_unmark(v, c);
  c->unreach = 0;
  /* probes on every second of silence; given up only after ~2 minutes,
   * when the kernel ends the connection (then a tombstone) */
  int one = 1, idle = 1, intvl = 1, cnt = 120;
  setsockopt(c->fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  setsockopt(c->fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  setsockopt(c->fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
  setsockopt(c->fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
}

/* The rank of c is cut off from this host: "<key>/unreachable" holds its
 * registration value while no acknowledgement comes (store_live.c reads it
 * for messages; nothing waits on it). */
void live_reach(srv *v, int64_t now) {
  if (now < v->reach_next) return;
  v->reach_next = now + REACH_CHECK_MS;
  for (int i = 0; i < v->nc; i++) {
    conn *c = v->c[i];
    if (c->dead || !c->live_key) continue;
    struct tcp_info ti;
    socklen_t len = sizeof ti;
    if (getsockopt(c->fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0) continue;
    int silent = ti.tcpi_last_ack_recv > REACH_SILENT_MS;
    if (silent == c->unreach) continue;
    if (!silent) { live_unmark(v, c); c->unreach = 0; continue; }
    entry *e = tab_find(v, (wf_store_kref){c->live_key, c->live_klen});
    if (!e) continue;  /* left cleanly */
    uint8_t key[WF_ST_MAX_KEY + 16];
    if (c->live_klen + 12 > sizeof key) continue;
    memcpy(key, c->live_key, c->live_klen);
    memcpy(key + c->live_klen, "/unreachable", 12);
    wf_log(1, "store server: no TCP acknowledgement from the rank of '%.*s' (%.*s, %s) for %u ms",
           (int)c->live_klen, c->live_key, (int)e->vlen, e->val, c->peer, ti.tcpi_last_ack_recv);
    uint8_t *val = malloc(e->vlen ? e->vlen : 1);
    if (!val) continue;
    memcpy(val, e->val, e->vlen);
    if (!tab_set(v, (wf_store_kref){key, c->live_klen + 12}, val, e->vlen, 0)) c->unreach = 1;
    free(val);
  }
}

/* c ended from the rank's side while its key exists (a clean close deletes
 * the key first): the rank is gone; "<key>/gone" tells every waiter. */
void live_gone(srv *v, conn *c) {
  entry *e = tab_find(v, (wf_store_kref){c->live_key, c->live_klen});
  if (!e) return;
  wf_log(1, "store server: the rank of '%.*s' is gone (%.*s)", (int)c->live_klen, c->live_key,
         (int)e->vlen, e->val);
  uint8_t *val = malloc(e->vlen ? e->vlen : 1);
  if (!val) return;
  memcpy(val, e->val, e->vlen);
  size_t vlen = e->vlen;
  if (!tab_set(v, (wf_store_kref){c->live_key, c->live_klen + 5}, val, vlen, 0)) wake_waiters(v);
  free(val);
  /* liveness waits look at the tombstones now, not at the end of their slice
   * (the store's host may fail and close the store right after) */
  for (int i = 0; i < v->nc; i++) {
    conn *o = v->c[i];
    if (!o->dead && o->state == C_PARKED && (o->gflags & WF_GET_LIVE)) get_missing_answer(v, o, WEFT_EAGAIN);
  }
}
