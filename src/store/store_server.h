/* store_server.h — what the store server's files share: its limits, the key
 * table's entry, a connection, the server's state, and the calls between
 * store_server.c and its parts (store_table.c, store_waiters.c,
 * store_server_live.c, store_frame_reader.c). All on the server's thread. */
#ifndef WF_STORE_SERVER_H
#define WF_STORE_SERVER_H

#include "store_internal.h"

#include <poll.h>
#include <stddef.h>
#include <stdint.h>

#define FRAME_MS_PER_KIB 1     /* whole-frame deadline: read timeout + 1 ms per KiB (~1 MB/s) */
/* The total cap (WEFT_STORE_MAX_TOTAL) refuses big values first: frames of
 * up to SMALL_FRAME bytes (the control plane: registrations, tombstones,
 * abort keys, votes) may go CONTROL_RESERVE past it, so a store filled with
 * data still lets the ranks fail and name why. */
#define SMALL_FRAME (64u << 10)
#define CONTROL_RESERVE (64ull << 20)

typedef struct entry {
  struct entry *next;
  uint64_t h;
  uint8_t *key;
  uint32_t klen;
  uint32_t reads;     /* >0: consume-reads left before the key is deleted */
  uint8_t *val;
  size_t vlen;
} entry;

enum { C_AUTH, C_READY, C_PARKED };

typedef struct conn {
  int fd, state, dead, close_after;
  uint8_t hdr[WF_ST_HDR];
  size_t hgot;
  int have_hdr;
  int op;
  unsigned flags;
  uint64_t plen;
  wf_store_wbuf in;    /* payload of the frame being read (kept while parked) */
  wf_store_kref pkey;  /* parked with WF_GET_PUT: the key it set (points into in) */
  int has_pkey;
  int64_t rdeadline;   /* incomplete frame / handshake must progress by then */
  wf_store_wbuf out;
  size_t out_off;
  int64_t wdeadline;
  wf_store_kref *keys; /* GET keys, pointing into in */
  int nkeys, capkeys;
  int cursor;          /* keys before it were present at the last look */
  unsigned gflags;
  int64_t pdeadline;   /* parked GET answers ETIMEOUT then */
  uint8_t snonce[WF_ST_NONCE];
  char peer[64];       /* the client's address, for messages */
  wf_store_claim claim;/* who it says it is (AUTH); rank -1 when unknown */
  int64_t t_active;    /* accept or last complete frame: idle policy, LRU */
  uint8_t *live_key;   /* WF_SET_LIVE: the key naming this connection's rank */
  uint32_t live_klen;
  int lost;            /* ended from the client's side (EOF, reset) */
  uint64_t held;       /* what its buffers count in inflight (account below) */
  int discard;         /* the frame is over the total cap: read, dropped, refused */
  uint64_t dgot;       /* payload bytes dropped so far */
  int unreach;         /* "<live key>/unreachable" is set for it */
} conn;

/* The server's state; wf_store_srv outside the server's files. */
typedef struct wf_store_srv {
  int lfd, wake[2];
  pthread_t th;
  int started;
  int stop;                     /* atomic */
  entry **tab;
  size_t nb, nent;
  conn **c;
  int nc, capc;
  struct pollfd *pfd;
  int cap_pfd;
  size_t max_value;
  uint64_t max_total;           /* WEFT_STORE_MAX_TOTAL */
  uint64_t stored;              /* what the table's entries cost (entry_cost) */
  uint64_t inflight;            /* connections' buffers: frames being read, parked GETs */
  int64_t read_to;
  long max_conns, max_preauth;  /* admission caps (resolved at start) */
  int64_t idle_ms;              /* 0: idle authenticated connections stay */
  const char *secret;           /* owned by the weft_store */
  size_t slen;
  int64_t accept_pause_until;
  char where[300];
  uint64_t instance;            /* sent in HELLO: reconnects detect a new server */
  /* Rejections for a wrong secret, for the waiting ranks' messages. */
  int nrej;
  int64_t rej_t;
  char rej_text[480];           /* the last one */
  wf_store_claim rej_claim;
  int world;                    /* from the first authenticated claim; 0 unknown */
  uint8_t *joined;              /* [world]: ranks that authenticated */
  int blocked_rank;             /* a never-joined rank was rejected: waits fail */
  char block_msg[640];
  int64_t reach_next;           /* the next reachability look (live_reach) */
  int nothers;                  /* atomic: registered connections of other processes */
} srv;

/* The calls between the server's files keep the names they had as statics of
 * one file: unprefixed, so never declared outside the server (hidden by
 * -fvisibility=hidden like every internal symbol). */

/* ---- store_table.c: the key table and what the total cap counts ---- */
entry *tab_find(srv *v, wf_store_kref k);
int tab_set(srv *v, wf_store_kref k, const void *val, size_t vlen, uint32_t reads);
int tab_del(srv *v, wf_store_kref k);
void entry_free(entry *e);
int over_total(const srv *v, uint64_t add);
int over_total_frame(const srv *v, uint64_t plen, uint64_t add);
void account(srv *v, conn *c);
void shed(conn *c);

/* ---- store_server.c: replies, claims, requests, admission, the loop ---- */
void conn_close(conn *c, const char *why);
void resp_begin(conn *c, int32_t status);
void frame_end(srv *v, conn *c, int op);
void resp_error(srv *v, conn *c, int32_t status, const char *msg);
void refuse_full(srv *v, conn *c, uint64_t bytes);
void set_refused(srv *v, conn *c, int rc);
void put_rejection_note(srv *v, conn *c);
int handle_frame(srv *v, conn *c);

/* ---- store_waiters.c: a GET answered now, or parked until its keys come ---- */
int handle_get(srv *v, conn *c, wf_rd *r);
void get_missing_answer(srv *v, conn *c, int32_t status);
void fail_parked(srv *v, conn *c);
void wake_waiters(srv *v);

/* ---- store_server_live.c: a rank's key, its tombstone, its reachability ---- */
void live_bind(srv *v, conn *c, wf_store_kref k);
void live_unmark(srv *v, conn *c);
void live_reach(srv *v, int64_t now);
void live_gone(srv *v, conn *c);

/* ---- store_frame_reader.c: a connection's frames, read whole ---- */
void conn_read(srv *v, conn *c);

#endif
