/* store_table.c — the store server's key table (chained hashing) and the
 * total cap's accounting (WEFT_STORE_MAX_TOTAL): what an entry costs, what
 * connections' buffers hold for frames in flight, the test before anything
 * grows. Part of the server (store_server.h). */
#include "store_server.h"

#include <stdlib.h>
#include <string.h>

/* What an entry really costs the server, the figure the total cap counts:
 * its key and value plus the entry itself, the malloc chunks of all three
 * (16-byte steps, 32 at least) and its share of the bucket table. Counting
 * only key and value bytes let a client hold ten times the cap in small
 * keys (5 M one-byte values under a 64 MiB cap: 690 MB). */
static uint64_t chunk_cost(size_t n) {
  uint64_t c = ((uint64_t)(n ? n : 1) + 8 + 15) & ~(uint64_t)15;
  return c < 32 ? 32 : c;
}
static uint64_t entry_cost(size_t klen, size_t vlen) {
  return chunk_cost(sizeof(entry)) + chunk_cost(klen) + chunk_cost(vlen) + 2 * sizeof(entry *);
}

static uint64_t key_hash(const uint8_t *k, size_t n) {
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < n; i++) { h ^= k[i]; h *= 1099511628211ULL; }
  return h;
}

static entry **tab_slot(srv *v, const uint8_t *k, uint32_t n, uint64_t h) {
  entry **pp = &v->tab[h & (v->nb - 1)];
  for (; *pp; pp = &(*pp)->next)
    if ((*pp)->h == h && (*pp)->klen == n && memcmp((*pp)->key, k, n) == 0) break;
  return pp;
}

entry *tab_find(srv *v, wf_store_kref k) {
  return *tab_slot(v, k.p, k.len, key_hash(k.p, k.len));
}

void entry_free(entry *e) {
  free(e->key);
  free(e->val);
  free(e);
}

static int tab_grow(srv *v) {
  size_t nb = v->nb * 2;
  entry **t = calloc(nb, sizeof *t);
  if (!t) return -1;
  for (size_t i = 0; i < v->nb; i++)
    for (entry *e = v->tab[i], *nx; e; e = nx) {
      nx = e->next;
      e->next = t[e->h & (nb - 1)];
      t[e->h & (nb - 1)] = e;
    }
  free(v->tab);
  v->tab = t;
  v->nb = nb;
  return 0;
}

/* Whether holding `add` more bytes would pass the total cap (small frames
 * may use the control reserve). */
int over_total(const srv *v, uint64_t add) {
  uint64_t cap = v->max_total + (add <= SMALL_FRAME ? CONTROL_RESERVE : 0);
  return v->stored + v->inflight + add > cap;
}

/* The same for `add` more bytes of buffer for a frame of plen bytes (the
 * reserve is the small frames', whatever the step). */
int over_total_frame(const srv *v, uint64_t plen, uint64_t add) {
  uint64_t cap = v->max_total + (plen <= SMALL_FRAME ? CONTROL_RESERVE : 0);
  return v->stored + v->inflight + add > cap;
}

/* The total cap counts every buffer a connection holds for a frame, not
 * only the table (issue 37): the body of a frame being read as it arrives
 * (never what its header claims: a header alone holds nothing), and a
 * parked GET's request and key list for as long as it waits. Between
 * frames a connection keeps at most SMALL_FRAME bytes of request buffer
 * and 1024 key slots (shed), bounded by the connection caps. */
void account(srv *v, conn *c) {
  uint64_t now = (c->state == C_PARKED || c->have_hdr)
                     ? (uint64_t)c->in.cap + (uint64_t)c->capkeys * sizeof *c->keys : 0;
  v->inflight = v->inflight - c->held + now;
  c->held = now;
}

/* A request is done with (answered, or parked no more): drop big buffers. */
void shed(conn *c) {
  if (c->in.cap > SMALL_FRAME) wf_store_wb_free(&c->in);
  else wf_store_wb_trim(&c->in);
  if (c->capkeys > 1024) { free(c->keys); c->keys = NULL; c->capkeys = 0; c->nkeys = 0; }
  c->has_pkey = 0;
}

/* Sets key to a copy of val; 0 ok, -1 out of memory, -2 over the total cap. */
int tab_set(srv *v, wf_store_kref k, const void *val, size_t vlen, uint32_t reads) {
  uint64_t h = key_hash(k.p, k.len);
  entry **pp = tab_slot(v, k.p, k.len, h);
  /* a new key is always checked, an empty value included: its key and
   * entry are held too */
  uint64_t old = *pp ? entry_cost((*pp)->klen, (*pp)->vlen) : 0, cost = entry_cost(k.len, vlen);
  if (cost > old && over_total(v, cost - old)) return -2;
  uint8_t *copy = malloc(vlen ? vlen : 1);
  if (!copy) return -1;
  if (vlen) memcpy(copy, val, vlen);
  if (*pp) {
    free((*pp)->val);
    (*pp)->val = copy;
    (*pp)->vlen = vlen;
    (*pp)->reads = reads;
    v->stored = v->stored - old + cost;
    return 0;
  }
  entry *e = calloc(1, sizeof *e);
  uint8_t *kc = malloc(k.len);
  if (!e || !kc) { free(e); free(kc); free(copy); return -1; }
  memcpy(kc, k.p, k.len);
  e->h = h; e->key = kc; e->klen = k.len; e->val = copy; e->vlen = vlen; e->reads = reads;
  e->next = NULL;
  *pp = e;
  v->nent++;
  v->stored += cost;
  if (v->nent > v->nb) tab_grow(v);  /* failure only costs speed */
  return 0;
}

int tab_del(srv *v, wf_store_kref k) {
  entry **pp = tab_slot(v, k.p, k.len, key_hash(k.p, k.len));
  if (!*pp) return 0;
  entry *e = *pp;
  *pp = e->next;
  v->stored -= entry_cost(e->klen, e->vlen);
  entry_free(e);
  v->nent--;
  return 1;
}
