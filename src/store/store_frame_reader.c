/* store_frame_reader.c — a connection's frames on the server: the header
 * checked against its op's limit, the body read within its deadline and the
 * total cap (a frame over it is read, dropped and refused), then run unless
 * its client gave up meanwhile. Part of the server (store_server.h). */
#include "store_server.h"

#include <stdlib.h>
#include <sys/socket.h>

/* A request that changes the table, from a client that has closed its
 * connection by now (its end of file is queued behind the frame): the
 * client gave up on it (no reply within its bound: this server was stopped
 * or starved) and told its caller it failed, so running it now would make
 * that failure a lie. A cpu group member that gave up so while the store's
 * host was stopped had its key of the collective set when the server
 * resumed, and the others completed the collective it failed (issue 24).
 * Every client waits for the reply of each request, so a closed connection
 * never carries one that is still wanted. A DELETE still runs: it only
 * takes back (a rank's leave, a member's own key), which stays right late,
 * and a leave dropped would mark a rank that shut down as dead. */
static int left_before_run(conn *c) {
  int mutating = c->op == WF_OP_SET || c->op == WF_OP_ADD || c->op == WF_OP_CAS ||
                 (c->op == WF_OP_GET && (c->flags & WF_GET_PUT));
  if (!mutating) return 0;
  char b;
  return recv(c->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

/* Largest payload each op may declare; anything above closes the connection
 * before a byte of it is buffered. */
static uint64_t op_limit(srv *v, int state, int op) {
  uint64_t key = 4 + WF_ST_MAX_KEY, keys = 4 + WF_ST_MAX_KEYBYTES + 4ull * WF_ST_MAX_NKEYS;
  uint64_t claim = 12 + 4 + WF_ST_MAX_HOST;
  if (state == C_AUTH && op == WF_OP_AUTH) return (v->slen ? 2 * WF_ST_NONCE : 0) + claim;
  if (state == C_AUTH && v->slen) return 0;  /* nothing but AUTH before the proof */
  switch (op) {
  case WF_OP_SET: return 4 + key + 8 + v->max_value;
  case WF_OP_GET: return 4 + 4 + key + 8 + v->max_value + keys;
  case WF_OP_ADD: return key + 8;
  case WF_OP_CHECK: return keys;
  case WF_OP_CAS: return key + 16 + 2ull * v->max_value;
  case WF_OP_DELETE: return key;
  case WF_OP_NUM_KEYS: return 0;
  default: return UINT64_MAX;  /* not a request op */
  }
}

/* A frame must arrive whole by its deadline, set when its first byte comes
 * (plen 0) and extended once the header tells the size: a sender trickling
 * 1 byte/s does not move it. Pre-auth connections keep the handshake's. */
static void frame_deadline(srv *v, conn *c, uint64_t plen) {
  if (plen == 0) c->rdeadline = wf_now_ms() + v->read_to;
  else c->rdeadline += (int64_t)(plen >> 10) * FRAME_MS_PER_KIB;
}

void conn_read(srv *v, conn *c) {
  if (c->out.len) return;  /* a reply is still going out */
  if (c->state == C_PARKED) {
    /* A parked client only waits; bytes or EOF here end the connection. */
    uint8_t b;
    ssize_t n = recv(c->fd, &b, 1, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (n <= 0) c->lost = 1;
    /* It gave up on its collective (no reply within its bound: this server
     * was stopped or starved) and told its caller so: the key it set goes
     * too, or a member arriving later would complete that collective. */
    if (c->has_pkey) tab_del(v, c->pkey);
    c->has_pkey = 0;
    conn_close(c, n > 0 ? "data from a client that is waiting" : NULL);
    return;
  }
  size_t budget = 8u << 20;  /* fairness between connections */
  while (!c->dead && budget > 0) {
    if (!c->have_hdr) {
      ssize_t n = recv(c->fd, c->hdr + c->hgot, WF_ST_HDR - c->hgot, MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) { c->lost = 1; conn_close(c, c->hgot ? "connection ended inside a frame" : NULL); return; }
      if (c->hgot == 0 && c->state == C_READY) frame_deadline(v, c, 0);
      c->hgot += (size_t)n;
      if (c->hgot < WF_ST_HDR) continue;
      c->op = c->hdr[5];
      c->flags = (unsigned)c->hdr[6] << 8 | c->hdr[7];
      c->plen = wf_get_u64(c->hdr + 8);
      if (wf_get_u32(c->hdr) != WF_ST_MAGIC || c->hdr[4] != WF_ST_VERSION) {
        conn_close(c, "bad magic or version (not a weft store client?)");
        return;
      }
      uint64_t lim = op_limit(v, c->state, c->op);
      if (lim == UINT64_MAX || (c->state == C_AUTH && c->op != WF_OP_AUTH && v->slen)) {
        conn_close(c, "unexpected frame type");
        return;
      }
      /* Without a secret a request may come first: a client without a claim. */
      if (c->state == C_AUTH && c->op != WF_OP_AUTH) c->state = C_READY;
      if (c->plen > lim) {
        wf_log(1, "store server: frame of %llu bytes over the limit of %llu (WEFT_STORE_MAX_VALUE)",
               (unsigned long long)c->plen, (unsigned long long)lim);
        conn_close(c, "oversized frame");
        return;
      }
      c->have_hdr = 1;
      c->in.len = 0;
      c->in.err = 0;
      if (c->state == C_READY) frame_deadline(v, c, c->plen);
      /* a big frame that would pass the total cap is read and dropped, then
       * refused: the client gets a clear answer, the server holds nothing */
      if (c->state == C_READY && c->plen > SMALL_FRAME && over_total(v, c->plen)) {
        c->discard = 1;
        c->dgot = 0;
      }
    }
    if (c->discard) {
      if (c->dgot < c->plen) {
        uint8_t junk[16384];
        size_t room = sizeof junk;
        if (room > c->plen - c->dgot) room = (size_t)(c->plen - c->dgot);
        if (room > budget) room = budget;
        ssize_t n = recv(c->fd, junk, room, MSG_DONTWAIT);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (n <= 0) { c->lost = 1; conn_close(c, "connection ended inside a frame"); return; }
        c->dgot += (uint64_t)n;
        budget -= (size_t)n;
        if (c->dgot < c->plen) continue;
      }
      c->discard = 0;
      c->have_hdr = 0;
      c->hgot = 0;
      account(v, c);
      c->t_active = wf_now_ms();
      c->rdeadline = 0;
      refuse_full(v, c, c->plen);
      return;
    }
    if (c->in.len < c->plen) {
      size_t want = (size_t)c->plen - c->in.len;
      if (c->in.cap - c->in.len < want) {
        /* Grow with what arrives, not with what the header claims. */
        size_t step = c->in.cap > (64u << 10) ? c->in.cap : (64u << 10);
        size_t grow = want < step ? want : step;
        /* the cap counts the buffer as it grows: another frame, or a
         * sender that never finishes, may have taken the room the header
         * check saw; then the rest is read and dropped, and refused */
        size_t target = c->in.len + grow;  /* exactly: never past the frame's size */
        if (c->state == C_READY && over_total_frame(v, c->plen, target - c->in.cap)) {
          c->discard = 1;
          c->dgot = c->in.len;
          wf_store_wb_free(&c->in);
          account(v, c);
          continue;
        }
        uint8_t *q = realloc(c->in.p, target);
        if (!q) { conn_close(c, "out of memory for a frame"); return; }
        c->in.p = q;
        c->in.cap = target;
        account(v, c);
      }
      size_t room = c->in.cap - c->in.len;
      if (room > want) room = want;
      if (room > budget) room = budget;
      ssize_t n = recv(c->fd, c->in.p + c->in.len, room, MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      if (n <= 0) { c->lost = 1; conn_close(c, "connection ended inside a frame"); return; }
      c->in.len += (size_t)n;
      budget -= (size_t)n;
      if (c->in.len < c->plen) continue;
    }
    c->have_hdr = 0;
    c->hgot = 0;
    c->t_active = wf_now_ms();
    if (c->state == C_READY) c->rdeadline = 0;
    account(v, c);  /* the frame is whole: from here the table counts what it keeps */
    if (left_before_run(c)) {
      c->lost = 1;
      conn_close(c, "the client gave up and closed its connection before its request ran: dropped");
      return;
    }
    if (handle_frame(v, c) < 0) { conn_close(c, "malformed frame"); return; }
    if (c->state != C_PARKED) shed(c);
    account(v, c);  /* a parked GET holds its request and keys while it waits */
    if (c->dead || c->state == C_PARKED || c->out.len) return;
  }
}
