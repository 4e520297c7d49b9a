/* store_proto.c — the store's frames in code: growable write buffers with
 * the big-endian field encoders, the frame header, the key/value field
 * decoders, the client's claim, and the limits and address text both
 * sides use. The format itself: store_proto.h. */
#include "store_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define DEFAULT_MAX_VALUE (256L << 20)
#define BIG_BUFFER (16u << 20)      /* buffers above this are released between calls */

void wf_store_wb_reserve(wf_store_wbuf *b, size_t extra) {
  if (b->err) return;
  if (extra > SIZE_MAX / 2 - b->len) { b->err = 1; return; }
  size_t need = b->len + extra;
  if (need <= b->cap) return;
  size_t cap = b->cap ? b->cap : 256;
  while (cap < need) cap *= 2;
  void *q = realloc(b->p, cap);
  if (!q) { b->err = 1; return; }
  b->p = q;
  b->cap = cap;
}
void wf_store_wb_put(wf_store_wbuf *b, const void *d, size_t n) {
  wf_store_wb_reserve(b, n);
  if (b->err) return;
  if (n) memcpy(b->p + b->len, d, n);
  b->len += n;
}
void wf_store_wb_u8(wf_store_wbuf *b, uint8_t v) { wf_store_wb_put(b, &v, 1); }
void wf_store_wb_u32(wf_store_wbuf *b, uint32_t v) {
  uint8_t t[4];
  wf_put_u32(t, v);
  wf_store_wb_put(b, t, 4);
}
void wf_store_wb_u64(wf_store_wbuf *b, uint64_t v) {
  uint8_t t[8];
  wf_put_u64(t, v);
  wf_store_wb_put(b, t, 8);
}
void wf_store_wb_key(wf_store_wbuf *b, const void *k, size_t n) {
  wf_store_wb_u32(b, (uint32_t)n);
  wf_store_wb_put(b, k, n);
}
void wf_store_wb_val(wf_store_wbuf *b, const void *v, size_t n) {
  wf_store_wb_u64(b, n);
  wf_store_wb_put(b, v, n);
}
void wf_store_wb_free(wf_store_wbuf *b) { free(b->p); memset(b, 0, sizeof *b); }
void wf_store_wb_trim(wf_store_wbuf *b) {
  if (b->cap > BIG_BUFFER) wf_store_wb_free(b);
  b->len = 0;
  b->err = 0;
}

void wf_store_hdr_fill(uint8_t *h, int op, unsigned flags, uint64_t len) {
  wf_put_u32(h, WF_ST_MAGIC);
  h[4] = WF_ST_VERSION;
  h[5] = (uint8_t)op;
  h[6] = (uint8_t)(flags >> 8);
  h[7] = (uint8_t)flags;
  wf_put_u64(h + 8, len);
}

int wf_store_rd_key(wf_rd *r, wf_store_kref *k) {
  k->len = wf_rd_u32(r);
  if (r->bad || k->len == 0 || k->len > WF_ST_MAX_KEY) return -1;
  k->p = wf_rd_take(r, k->len);
  return k->p ? 0 : -1;
}

int wf_store_rd_val(wf_rd *r, size_t max, const uint8_t **p, size_t *n) {
  uint64_t len = wf_rd_u64(r);
  if (r->bad || len > max) return -1;
  *n = (size_t)len;
  *p = wf_rd_take(r, *n);
  return (*p || *n == 0) && !r->bad ? 0 : -1;
}

void wf_store_claim_self(wf_store_claim *c) {
  wf_env_rank(&c->rank, &c->world);
  c->pid = (uint32_t)getpid();
  if (gethostname(c->host, sizeof c->host) != 0 || !c->host[0]) snprintf(c->host, sizeof c->host, "?");
  c->host[WF_ST_MAX_HOST] = '\0';
}

void wf_store_wb_claim(wf_store_wbuf *b, const wf_store_claim *c) {
  wf_store_wb_u32(b, (uint32_t)c->rank);
  wf_store_wb_u32(b, (uint32_t)c->world);
  wf_store_wb_u32(b, c->pid);
  wf_store_wb_key(b, c->host, strlen(c->host));
}

int wf_store_rd_claim(wf_rd *r, wf_store_claim *c) {
  c->rank = (int32_t)wf_rd_u32(r);
  c->world = (int32_t)wf_rd_u32(r);
  c->pid = wf_rd_u32(r);
  uint32_t n = wf_rd_u32(r);
  const uint8_t *h = (n >= 1 && n <= WF_ST_MAX_HOST) ? wf_rd_take(r, n) : NULL;
  if (r->bad || !h) return -1;
  for (uint32_t i = 0; i < n; i++) c->host[i] = (h[i] >= 0x20 && h[i] < 0x7f) ? (char)h[i] : '?';
  c->host[n] = '\0';
  if (c->world <= 0 || c->rank < 0 || c->rank >= c->world) c->rank = c->world = -1;
  return 0;
}

void wf_store_fmt_claim(char *out, size_t cap, const wf_store_claim *c) {
  if (c->rank >= 0)
    snprintf(out, cap, "rank %d of %d, pid %u on %s", c->rank, c->world, (unsigned)c->pid, c->host);
  else
    snprintf(out, cap, "pid %u on %s", (unsigned)c->pid, c->host);
}

size_t wf_store_env_max_value(void) {
  long v = wf_env_long("WEFT_STORE_MAX_VALUE", DEFAULT_MAX_VALUE);
  if (v <= 0) v = DEFAULT_MAX_VALUE;
  if ((unsigned long)v > (1UL << 40)) v = (long)(1UL << 40);
  return (size_t)v;
}

void wf_store_fmt_where(char *out, size_t cap, const char *host, int port) {
  if (strchr(host, ':')) snprintf(out, cap, "[%s]:%d", host, port);
  else snprintf(out, cap, "%s:%d", host, port);
}
