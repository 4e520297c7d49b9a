/* cpugroup.c — control-plane collectives over the store: barrier, broadcast,
 * all-gather of bytes, int64 all-reduce (votes), mailbox send/recv.
 *
 * Keys: "<name>@<h>/<gen>.<seq>/<op>/<index>" for collectives, where seq
 * counts this group's collectives (all members call them in the same order),
 * h is a hash of the member list (two groups that share a name but not their
 * members never share keys) and gen counts how often this rank has created
 * this group (store counter "<name>@<h>/gen/<index>"), so a re-created group
 * never meets an older one's keys. Point-to-point:
 * "<name>@<h>/<gen>.p/<src>.<dst>/<k>" with a counter k per ordered pair.
 *
 * Cleanup (keys must not grow without bound): every key is written with a
 * read budget equal to the number of members that will read it (all n for a
 * barrier/all-gather, n-1 for a broadcast, 1 for a message), and readers ask
 * the server to consume. The server deletes a key when its budget reaches 0,
 * i.e. right when the last member has it — no extra round trip and no
 * "delete seq-2" bookkeeping. Only keys of an operation that timed out (a
 * member never came) stay behind; the group is broken then anyway.
 *
 * Liveness (store_live.c): every wait names the global rank that sets each
 * key it waits for, so a registered store fails it within ~200 ms when that
 * rank is gone; "<name>@<h>/<gen>/abort", set by a member that was
 * interrupted, ends every member's wait. A group whose wait was aborted or
 * lost a member refuses further use: its members may disagree on how many
 * collectives they completed, and the next one would pair a stale key with
 * a fresh one.
 *
 * Giving up (give_up below): a member whose collective failed after it took
 * its sequence number (a timeout above all) takes back its own key of that
 * collective, publishes the abort key and refuses further use. A stopped
 * member that resumes can then never complete the failed collective from
 * the keys left behind, nor pair its call k with the others' retry k+1
 * (issue 24: that silently shifted every later result); its wait ends with
 * the abort within a slice, and weft.recover() rebuilds the groups.
 *
 * Round trips: barrier and all-gather are ONE request each (set own key +
 * wait for / multi-get all keys, answered by the server when the last member
 * arrives); broadcast is one per member; send and recv one each.
 */
#include "cpugroup.h"
#include "shm.h"
#include "core/internal.h"
#include "store/store_proto.h"
#include "store/store_share.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct weft_cpugroup {
  weft_store *s;
  char *name;
  char prefix[232];        /* "<name>@<hash of ranks>" */
  int *ranks;
  int size, me;
  int timeout_ms;
  uint64_t gen, seq;
  uint64_t *sseq, *rseq;   /* per-peer message counters */
  char **keys;             /* size key strings, rebuilt per operation */
  char *keybuf;
  size_t stride;
  const void **vals;
  size_t *lens;            /* store reply lengths */
  int *missing;
  uint8_t *out;            /* results handed to the caller */
  size_t outcap;
  size_t *outlens;         /* all-gather lengths handed to the caller */
  uint8_t *tmp;            /* all-reduce encoding */
  size_t tmpcap;
  char op[320];            /* "cpugroup '<name>' <op>" for messages */
  char abort_key[300];     /* "<prefix>/<gen>/abort" */
  char broken[1024];       /* why this group refuses work, "" while usable */
  char pending[1100];      /* an abort the store did not take (unreachable), published by
                            * weft_cpugroup_publish_abort once it answers; "" if none */
  _Atomic int busy;        /* one operation at a time (enter/leave below) */
  weft_shm *shm;           /* the same group's shm communicator (cpugroup.h), or NULL */
};

/* One operation at a time per group. The sequence number, the key strings
 * and the result buffers are the group's: two threads in it at once (an
 * async worker running a queued operation while the caller's thread makes a
 * blocking call on the same group) took interleaved sequence numbers and
 * overwrote each other's keys, and every rank silently got another call's
 * sums (issue 24 item 4, store route). The second caller is refused, as the
 * shm, Gloo and message-queue handles refuse it. */
static int enter(weft_cpugroup *g, const char *what) {
  int zero = 0;
  if (atomic_compare_exchange_strong(&g->busy, &zero, 1)) return 0;
  return wf_error(WEFT_ESTATE, "cpugroup '%s' %s: another operation is in flight on this group "
                  "(one at a time: an async operation of the group may still run; wait for its "
                  "handle first)", g->name, what);
}
static int leave(weft_cpugroup *g, int rc) {
  atomic_store(&g->busy, 0);
  return rc;
}

static int grow(uint8_t **p, size_t *cap, size_t need) {
  if (need <= *cap) return 0;
  size_t c = *cap ? *cap : 256;
  while (c < need) c *= 2;
  void *q = realloc(*p, c);
  if (!q) return -1;
  *p = q;
  *cap = c;
  return 0;
}

static const char *opname(weft_cpugroup *g, const char *what) {
  snprintf(g->op, sizeof g->op, "cpugroup '%s' %s", g->name, what);
  return g->op;
}

/* A collective's keys name only its sequence number, not its kind: calls
 * that differ (a barrier on one rank, an all-gather on another) meet at the
 * same keys and are told apart by the agreement word in front of each
 * value (below), at once, instead of each waiting for keys the other never
 * sets. */
static void coll_key(weft_cpugroup *g, int i, uint64_t seq) {
  snprintf(g->keys[i], g->stride, "%s/%llu.%llu/c/%d", g->prefix, (unsigned long long)g->gen,
           (unsigned long long)seq, i);
}

/* ---- the agreement word (docs/faults.md, "Every call agreed") ----
 * Every member's value of a collective starts with CG_HDR bytes: a mark,
 * the kind of collective, its reduction op and its root (index). All members
 * read every member's value, so each compares all words and, when they
 * differ, all fail alike with the same message naming every rank's call;
 * the exchange itself completed on every member, so the group stays usable.
 * What the caller asks above the bytes (a tensor's dtype and shape) it puts
 * in the payload (weft.group's call frame). */
enum { CG_BARRIER = 1, CG_ALLGATHER = 2, CG_BROADCAST = 3, CG_ALLREDUCE = 4 };
#define CG_HDR 8
#define CG_MARK 0xC9

static void hdr_put(uint8_t *h, int kind, int op, int root) {
  h[0] = CG_MARK;
  h[1] = (uint8_t)kind;
  h[2] = (uint8_t)op;
  h[3] = 0;
  wf_put_u32(h + 4, (uint32_t)root);
}

static const char *op_word(int op) {
  switch (op) {
  case WEFT_SUM: return "sum";
  case WEFT_MAX: return "max";
  case WEFT_MIN: return "min";
  case WEFT_AND: return "and";
  case WEFT_PROD: return "prod";
  default: return "?";
  }
}

/* "broadcast from rank 3" (global ranks) */
static void hdr_describe(const weft_cpugroup *g, const uint8_t *h, size_t len, char *buf, size_t n) {
  if (len < CG_HDR || h[0] != CG_MARK) { snprintf(buf, n, "something else (not a cpu group collective)"); return; }
  uint32_t root = wf_get_u32(h + 4);
  switch (h[1]) {
  case CG_BARRIER: snprintf(buf, n, "barrier"); break;
  case CG_ALLGATHER: snprintf(buf, n, "allgather"); break;
  case CG_BROADCAST:
    if (root < (uint32_t)g->size) snprintf(buf, n, "broadcast from rank %d", g->ranks[root]);
    else snprintf(buf, n, "broadcast from index %u", root);
    break;
  case CG_ALLREDUCE: snprintf(buf, n, "allreduce_i64 (%s) of %zu values", op_word(h[2]), (len - CG_HDR) / 8); break;
  default: snprintf(buf, n, "an unknown collective (%d)", h[1]); break;
  }
}

/* Compares every member's word with this rank's (and, for allreduce_i64,
 * the count): 0 when all agree, else a WEFT_EMISMATCH error naming every
 * rank's call, the same text on every member ("rank 1: barrier; ranks 0, 2:
 * allgather"). */
static int hdr_check(weft_cpugroup *g, const char *what, uint64_t seq) {
  const uint8_t *mine = g->vals[g->me];
  size_t mlen = g->lens[g->me];
  int bad = 0;
  for (int i = 0; i < g->size && !bad; i++) {
    const uint8_t *v = g->vals[i];
    if (g->lens[i] < CG_HDR || memcmp(v, mine, CG_HDR) ||
        (mine[1] == CG_ALLREDUCE && g->lens[i] != mlen))
      bad = 1;
  }
  if (!bad) return 0;
  /* group ranks by what they called, in order of the first rank of each */
  char msg[1400];
  size_t len = 0;
  int *seen = g->missing;  /* scratch: 1 once described */
  for (int i = 0; i < g->size; i++) seen[i] = 0;
  for (int i = 0; i < g->size && len < sizeof msg - 1; i++) {
    if (seen[i]) continue;
    char desc[160], who[400];
    hdr_describe(g, g->vals[i], g->lens[i], desc, sizeof desc);
    size_t wl = 0;
    int cnt = 0;
    for (int j = i; j < g->size; j++) {
      char dj[160];
      if (seen[j]) continue;
      hdr_describe(g, g->vals[j], g->lens[j], dj, sizeof dj);
      if (strcmp(dj, desc)) continue;
      seen[j] = 1;
      if (wl < sizeof who - 16) {
        int w = snprintf(who + wl, sizeof who - wl, "%s%d", cnt ? ", " : "", g->ranks[j]);
        if (w > 0) wl += (size_t)w;
      }
      cnt++;
    }
    int w = snprintf(msg + len, sizeof msg - len, "%s%s %s: %s", len ? "; " : "",
                     cnt > 1 ? "ranks" : "rank", who, desc);
    if (w > 0) len += (size_t)w;
  }
  return wf_error(WEFT_EMISMATCH, "cpugroup '%s' %s #%llu: the ranks called different collectives: %s "
                  "(every rank fails alike; the group stays usable)", g->name, what,
                  (unsigned long long)seq, msg);
}

static void p2p_key(weft_cpugroup *g, char *buf, int src, int dst, uint64_t k) {
  snprintf(buf, g->stride, "%s/%llu.p/%d.%d/%llu", g->prefix, (unsigned long long)g->gen, src, dst,
           (unsigned long long)k);
}

static int cmp_int(const void *a, const void *b) {
  int x = *(const int *)a, y = *(const int *)b;
  return (x > y) - (x < y);
}

/* "ranks 3, 5 did not arrive" with global ranks, ascending; the first few
 * described from their registration (pid, host, stopped, never connected). */
static int timeout_error(weft_cpugroup *g, weft_store *s, const char *what, int nmissing, const char *verb) {
  char note[600];  /* the server's note on the wait, before the lookups below replace it */
  snprintf(note, sizeof note, "%s", wf_store_note(s));  /* e.g. a client rejected for a wrong secret */
  int *gr = g->missing;
  for (int i = 0; i < nmissing; i++) gr[i] = g->ranks[gr[i]];
  qsort(gr, (size_t)nmissing, sizeof *gr, cmp_int);
  char list[1200];
  size_t len = 0;
  list[0] = '\0';
  for (int i = 0; i < nmissing && len < sizeof list - 1; i++) {
    char who[300];
    if (i < 4) wf_store_live_describe(s, g->op, gr[i], who, sizeof who);
    else snprintf(who, sizeof who, "%d", gr[i]);
    if (i < 4 && !strncmp(who, "rank ", 5)) memmove(who, who + 5, strlen(who + 5) + 1);
    int w = (i == 24) ? snprintf(list + len, sizeof list - len, " and %d more", nmissing - 24)
                      : snprintf(list + len, sizeof list - len, "%s%s", i ? ", " : "", who);
    if (w < 0 || i == 24) break;
    len += (size_t)w;
  }
  /* what the store saw, in the words of every other route: ranks cut off
   * from its host (a partition), or the store itself out of reach; one
   * round trip at most (a timeout waits for no tombstone) */
  wf_store_diag d;
  char seen[sizeof d.unreach_who + sizeof d.store_why + 128];
  wf_store_diagnose_locked(s, 0, &d);
  wf_store_diag_note(&d, seen, sizeof seen);
  return wf_error(WEFT_ETIMEOUT, "cpugroup '%s' %s: timed out after %d ms; %s %s %s%s%s%s", g->name,
                  what, g->timeout_ms, nmissing == 1 ? "rank" : "ranks", list, verb, seen,
                  note[0] ? "; " : "", note);
}

/* After a failed wait: an abort or a lost member breaks the group for good. */
static int note_failure(weft_cpugroup *g, int rc) {
  if (rc != WEFT_EABORT && !(rc == WEFT_ECLOSED && strstr(weft_last_error(), " died ")) &&
      !(rc == WEFT_ECLOSED && strstr(weft_last_error(), "without weft.shutdown")))
    return rc;
  if (!g->broken[0]) snprintf(g->broken, sizeof g->broken, "%s", weft_last_error());
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", weft_last_error());
  if (rc == WEFT_EABORT)
    return wf_error(rc, "%s. The group cannot be used any more: rebuild the groups on every rank "
                    "with weft.recover() (docs/faults.md)", msg);
  return wf_error(rc, "%s. The job cannot go on without that rank (docs/faults.md)", msg);
}

/* This rank gives up on collective #seq after its request failed with rc
 * (message set): the group is broken here and, when the store answered
 * (reachable), on every member: the abort key is published and own_key
 * (this rank's key of the collective, NULL: none) taken back, so nobody
 * completes that collective later. q: the wait that failed (NULL: a root's
 * SET); when its keys turn out all set, the collective completed after all
 * and 0 is returned (its values in q). Called with the store locked. */
static int give_up(weft_cpugroup *g, weft_store *s, int rc, const char *what, uint64_t seq,
                   wf_get_req *q, const char *own_key, int reachable) {
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", weft_last_error());
  if (reachable) {
    char pre[300], why[1200];
    int pl = snprintf(pre, sizeof pre, "cpugroup '%s' %s: ", g->name, what);
    const char *cause = (pl > 0 && !strncmp(msg, pre, (size_t)pl)) ? msg + pl : msg;
    int len = snprintf(why, sizeof why, "seq=%llu,rank=%d;rank %d gave up on cpugroup '%s' "
                       "(communicator aborted): its %s #%llu failed: %s", (unsigned long long)seq,
                       g->ranks[g->me], g->ranks[g->me], g->name, what, (unsigned long long)seq, cause);
    if (len < 0) len = 0;
    if ((size_t)len >= sizeof why) len = (int)sizeof why - 1;
    int grc = WEFT_EPROTO;
    if (q) {
      /* One request decides: every key there now (the last member came
       * after this rank's wait ended) -> the collective completed, here as
       * on the members it answered; else its keys go and the abort comes in
       * the same step. Two requests (abort, then delete) let a member that
       * came in between complete it while this rank failed: with the
       * store's host stopped, 1 of 4 ranks then counted one call fewer, and
       * a retrying loop paired its retry with the others' next call. */
      wf_get_req gq = *q;
      gq.timeout_ms = 0;
      gq.flags = (q->flags & WF_GET_NOVALUES) | WF_GET_CONSUME | WF_GET_PUT | WF_GET_GIVEUP;
      gq.put_key = g->abort_key;
      gq.put_hdr = NULL;  /* the abort key's value is the text alone */
      gq.put_hlen = 0;
      gq.put_val = why;
      gq.put_len = (size_t)len;
      gq.put_reads = 0;
      gq.owners = NULL;
      gq.abort_key = NULL;
      grc = wf_store_get_locked(s, g->op, &gq);
      if (grc == 0) {
        q->nmissing = 0;
        wf_clear_error();
        return 0;
      }
    }
    if (grc != WEFT_EAGAIN) {  /* no atomic give-up: abort, then take the own key back */
      if (wf_store_set_locked(s, g->op, g->abort_key, why, (size_t)len, 0) != 0) {
        snprintf(g->pending, sizeof g->pending, "%.1000s", why);  /* the store went meanwhile */
        reachable = 0;
      } else if (own_key) {
        wf_store_delete_locked(s, g->op, own_key);
      }
    }
  } else {
    /* The store did not answer (its host stopped, a partition): whether the
     * collective completed on the others is unknown here. The abort goes
     * out once the store answers again (publish_pending: the next use of
     * the group, or weft.recover()), so a member that completed it learns,
     * at its next wait on the group, that this one did not. */
    snprintf(g->pending, sizeof g->pending, "seq=%llu,rank=%d;rank %d gave up on cpugroup '%s' "
             "(communicator aborted): its %s #%llu failed, and the store did not answer then: %.700s",
             (unsigned long long)seq, g->ranks[g->me], g->ranks[g->me], g->name, what,
             (unsigned long long)seq, msg);
  }
  if (!g->broken[0]) snprintf(g->broken, sizeof g->broken, "%s", msg);
  return wf_error(rc, "%s. The group is aborted%s (no member may pair this call with a later "
                  "one): rebuild the groups on every rank with weft.recover() (docs/faults.md)",
                  msg, reachable ? " on every member" : " here");
}

/* The abort key's value into why (cut to n), when it is set: a poll. */
static int abort_seen(weft_cpugroup *g, weft_store *s, char *why, size_t n) {
  const char *akey[1] = {g->abort_key};
  const void *v = NULL;
  size_t len = 0;
  int miss;  /* not g->missing: it holds the timed-out wait's list */
  wf_get_req q = {.keys = akey, .n = 1, .timeout_ms = 0, .vals = &v, .lens = &len, .missing = &miss};
  if (wf_store_get_locked(s, g->op, &q) != 0) { wf_clear_error(); return 0; }
  size_t l = len < n - 1 ? len : n - 1;
  memcpy(why, v, l);
  why[l] = '\0';
  return 1;
}

/* This rank's collective ends because another member aborted the group
 * (why: the abort key's value): own_key is taken back. A member that gave
 * up on an earlier collective than this rank's current one (its abort came
 * late: the store did not answer it then) failed a collective this rank
 * completed: the results from there on differ between the ranks, and the
 * message says so. */
static int aborted(weft_cpugroup *g, weft_store *s, const char *why, const char *own_key) {
  if (own_key) wf_store_delete_locked(s, g->op, own_key);
  unsigned long long k = 0;
  int who = -1, used = 0;
  if (sscanf(why, "seq=%llu,rank=%d;%n", &k, &who, &used) == 2 && used > 0) {
    why += used;
    if (k + 1 < g->seq) {
      wf_error(WEFT_EABORT, "%s: aborted: %s; this rank (rank %d) completed collective #%llu of "
               "cpugroup '%s' (generation %llu), which rank %d aborted: the results from #%llu on "
               "cannot be trusted on any rank", g->op, why, g->ranks[g->me], k, g->name,
               (unsigned long long)g->gen, who, k);
      return note_failure(g, WEFT_EABORT);
    }
  }
  wf_error(WEFT_EABORT, "%s: aborted: %s", g->op, why);
  return note_failure(g, WEFT_EABORT);
}

/* Publishes an abort the store did not take when it was made (give_up with
 * the store unreachable); 0 when there is none or it went out. */
static int publish_pending(weft_cpugroup *g) {
  if (!g->pending[0] || !g->s) return 0;
  weft_store *s;
  int rc = wf_store_here(g->s, "cpugroup publish abort", &s);
  if (rc || (rc = wf_store_lock(s, "cpugroup publish abort"))) return rc;
  rc = wf_store_set_locked(s, opname(g, "publish abort"), g->abort_key, g->pending, strlen(g->pending), 0);
  wf_store_unlock(s);
  if (rc == 0) g->pending[0] = '\0';
  return rc;
}

int weft_cpugroup_publish_abort(weft_cpugroup *g) {
  WF_CHECK_ARG(g, "cpugroup publish_abort: group is NULL");
  return publish_pending(g);
}

/* A failed request of collective #seq: the error that ends it, the group
 * broken. missing_verb: how a missing member is described on a timeout. */
static int failed(weft_cpugroup *g, weft_store *s, int rc, const char *what, uint64_t seq, wf_get_req *q,
                  const char *own_key, const char *missing_verb) {
  if (rc == WEFT_EABORT || (rc == WEFT_ECLOSED && (strstr(weft_last_error(), " died ") ||
                            strstr(weft_last_error(), "without weft.shutdown"))))
    return note_failure(g, rc);  /* the abort is out already (own key taken back), or a rank died */
  /* the store answered (a refusal: a wrong secret, the store full), or nothing was sent */
  int reachable = rc == WEFT_EINVAL || rc == WEFT_EAUTH || rc == WEFT_ENOMEM;
  if (rc == WEFT_ETIMEOUT && q && q->nmissing > 0) {
    /* a member that timed out a moment earlier took its key back: its
     * abort names who really did not arrive */
    char why[600];
    opname(g, what);
    if (abort_seen(g, s, why, sizeof why)) return aborted(g, s, why, own_key);
    rc = timeout_error(g, s, what, q->nmissing, missing_verb);
    reachable = 1;
  }
  opname(g, what);
  return give_up(g, s, rc, what, seq, q, own_key, reachable);
}

static int refuse_broken(weft_cpugroup *g, const char *what) {
  if (!g->broken[0]) return 0;
  if (g->pending[0]) { publish_pending(g); wf_clear_error(); }
  return wf_error(WEFT_EABORT, "cpugroup '%s' %s: this group cannot be used any more (its members "
                  "may disagree on how many collectives they completed): an earlier wait ended "
                  "with: %s. Rebuild the groups on every rank with weft.recover(), or restart "
                  "the job if a rank died (docs/faults.md)", g->name, what, g->broken);
}

int weft_cpugroup_create(weft_store *s, const char *name, const int *ranks, int size,
                         int my_index, int timeout_ms, weft_cpugroup **out) {
  WF_CHECK_ARG(out, "cpugroup create: out must not be NULL");
  *out = NULL;
  WF_CHECK_ARG(s, "cpugroup create: store is NULL");
  WF_CHECK_ARG(name && *name && strlen(name) <= 200,
               "cpugroup create: name must be 1..200 characters");
  WF_CHECK_ARG(ranks && size >= 1 && size <= 65536,
               "cpugroup create '%s': need 1..65536 ranks, got %d", name, ranks ? size : 0);
  WF_CHECK_ARG(my_index >= 0 && my_index < size,
               "cpugroup create '%s': my_index %d outside 0..%d", name, my_index, size - 1);
  for (int i = 0; i < size; i++) {
    WF_CHECK_ARG(ranks[i] >= 0, "cpugroup create '%s': negative rank %d", name, ranks[i]);
    for (int j = 0; j < i; j++)
      WF_CHECK_ARG(ranks[i] != ranks[j], "cpugroup create '%s': rank %d listed twice", name, ranks[i]);
  }
  weft_cpugroup *g = calloc(1, sizeof *g);
  if (!g) return wf_error(WEFT_ENOMEM, "cpugroup create '%s': out of memory", name);
  size_t n = (size_t)size;
  g->stride = strlen(name) + 128;
  g->name = strdup(name);
  g->ranks = malloc(n * sizeof *g->ranks);
  g->sseq = calloc(n, sizeof *g->sseq);
  g->rseq = calloc(n, sizeof *g->rseq);
  g->keys = malloc(n * sizeof *g->keys);
  g->keybuf = malloc(n * g->stride);
  g->vals = malloc(n * sizeof *g->vals);
  g->lens = malloc(n * sizeof *g->lens);
  g->missing = malloc(n * sizeof *g->missing);
  g->outlens = malloc(n * sizeof *g->outlens);
  g->size = size;
  g->me = my_index;
  g->s = s;
  if (!g->name || !g->ranks || !g->sseq || !g->rseq || !g->keys || !g->keybuf || !g->vals ||
      !g->lens || !g->missing || !g->outlens) {
    g->s = NULL;
    weft_cpugroup_destroy(g);
    return wf_error(WEFT_ENOMEM, "cpugroup create '%s': out of memory", name);
  }
  memcpy(g->ranks, ranks, n * sizeof *ranks);
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < n; i++)
    for (int b = 0; b < 32; b += 8) h = (h ^ (uint8_t)((unsigned)ranks[i] >> b)) * 16777619u;
  snprintf(g->prefix, sizeof g->prefix, "%s@%08x", name, h);
  for (size_t i = 0; i < n; i++) g->keys[i] = g->keybuf + i * g->stride;
  const char *op = opname(g, "create");
  int rc = wf_store_lock(s, op);
  if (rc) { g->s = NULL; weft_cpugroup_destroy(g); return rc; }
  g->timeout_ms = timeout_ms > 0 ? timeout_ms : wf_store_default_timeout(s);
  char key[300];
  int64_t gen = 0;
  snprintf(key, sizeof key, "%s/gen/%d", g->prefix, my_index);
  rc = wf_store_add_locked(s, op, key, 1, &gen);
  if (!rc) wf_store_ref(s);
  wf_store_unlock(s);
  if (rc) { g->s = NULL; weft_cpugroup_destroy(g); return rc; }
  g->gen = (uint64_t)gen;
  snprintf(g->abort_key, sizeof g->abort_key, "%s/%llu/abort", g->prefix, (unsigned long long)g->gen);
  *out = g;
  return 0;
}

void wf_cpugroup_link_shm(weft_cpugroup *g, weft_shm *c) { g->shm = c; }
void wf_cpugroup_unlink_shm(weft_cpugroup *g, weft_shm *c) {
  if (g->shm == c) g->shm = NULL;
}
uint64_t wf_cpugroup_sent(const weft_cpugroup *g, int dst) {
  return dst >= 0 && dst < g->size ? g->sseq[dst] : 0;
}

int weft_cpugroup_destroy(weft_cpugroup *g) {
  if (!g) return 0;
  if (g->shm) wf_shm_forget_cpugroup(g->shm, g);
  if (g->s) wf_store_unref(g->s);  /* local only: no network, no collective */
  free(g->name);
  free(g->ranks);
  free(g->sseq);
  free(g->rseq);
  free(g->keys);
  free(g->keybuf);
  free(g->vals);
  free(g->lens);
  free(g->missing);
  free(g->out);
  free(g->outlens);
  free(g->tmp);
  free(g);
  return 0;
}

int wf_cpugroup_info(weft_cpugroup *g, const char **name, int *size, int *index,
                     const int **ranks, int *timeout_ms) {
  WF_CHECK_ARG(g, "cpugroup info: group is NULL");
  if (name) *name = g->name;
  if (size) *size = g->size;
  if (index) *index = g->me;
  if (ranks) *ranks = g->ranks;
  if (timeout_ms) *timeout_ms = g->timeout_ms;
  return 0;
}

int weft_cpugroup_set_timeout(weft_cpugroup *g, int timeout_ms) {
  WF_CHECK_ARG(g, "cpugroup set_timeout: group is NULL");
  g->timeout_ms = timeout_ms > 0 ? timeout_ms : wf_store_default_timeout(g->s);
  return 0;
}

/* Sets this member's key of collective `seq` (the agreement word, then
 * `in`) and waits for every member's key: one round trip. The words are
 * compared (hdr_check) before anything is handed out: on a mismatch the
 * caller's outputs stay untouched. Out (g->out, g->outlens): every member's
 * payload for an all-gather or all-reduce, the root's for a broadcast,
 * nothing for a barrier. */
static int exchange(weft_cpugroup *g, const char *what, int kind, int opc, int root,
                    const void *in, size_t len) {
  const char *op = opname(g, what);
  int rc = refuse_broken(g, what);
  if (rc) return rc;
  weft_store *s;
  if ((rc = wf_store_here(g->s, op, &s))) return rc;
  uint64_t seq = g->seq++;
  for (int i = 0; i < g->size; i++) coll_key(g, i, seq);
  rc = wf_store_lock(s, op);
  if (rc) return rc;
  uint8_t hdr[CG_HDR];
  hdr_put(hdr, kind, opc, root);
  wf_get_req q = {.keys = (const char *const *)g->keys, .n = g->size, .timeout_ms = g->timeout_ms,
                  .flags = WF_GET_PUT | WF_GET_CONSUME,
                  .put_key = g->keys[g->me], .put_hdr = hdr, .put_hlen = CG_HDR,
                  .put_val = in, .put_len = len,
                  .put_reads = (uint32_t)g->size, .vals = g->vals, .lens = g->lens,
                  .missing = g->missing, .owners = g->ranks, .abort_key = g->abort_key};
  rc = wf_store_get_locked(s, op, &q);
  if (rc) {
    if (rc == WEFT_ETIMEOUT && q.nmissing > 0 && kind == CG_BROADCAST && g->me != root)
      for (int i = 0; i < q.nmissing; i++) if (q.missing[i] == root) { q.missing[0] = root; q.nmissing = 1; break; }
    rc = failed(g, s, rc, what, seq, &q, g->keys[g->me],
                kind == CG_BROADCAST && q.nmissing == 1 && q.missing[0] == root && g->me != root
                  ? "(the root) did not arrive" : "did not arrive");
  }
  if (rc == 0) rc = hdr_check(g, what, seq);
  if (rc == 0 && kind != CG_BARRIER) {
    /* Copy out while the store's reply buffer is still ours. */
    int lo = kind == CG_BROADCAST ? root : 0, hi = kind == CG_BROADCAST ? root + 1 : g->size;
    size_t total = 0;
    for (int i = lo; i < hi; i++) total += g->lens[i] - CG_HDR;  /* each < the store's value limit */
    if (grow(&g->out, &g->outcap, total ? total : 1))
      rc = wf_error(WEFT_ENOMEM, "%s: out of memory for %zu bytes", op, total);
    if (!rc) {
      size_t off = 0;
      for (int i = lo; i < hi; i++) {
        size_t l = g->lens[i] - CG_HDR;
        if (l) memcpy(g->out + off, (const uint8_t *)g->vals[i] + CG_HDR, l);
        g->outlens[i - lo] = l;
        off += l;
      }
    }
  }
  wf_store_unlock(s);
  return rc;
}

/* Store round trips block the host: inside a CUDA-graph capture they would
 * not be recorded, and ranks would diverge at replay. Refuse them clearly. */
static int refuse_in_capture(const weft_cpugroup *g, const char *what) {
  if (!wf_capture_active()) return 0;
  return wf_error(WEFT_ESTATE,
                  "cpugroup '%s' %s: refused while this thread captures a CUDA graph "
                  "(control-plane collectives cannot be captured)", g->name, what);
}

static int barrier_one(weft_cpugroup *g) {
  WF_CHECK_ARG(g, "cpugroup barrier: group is NULL");
  { int grc = refuse_in_capture(g, "barrier"); if (grc) return grc; }
  if (g->size == 1) { g->seq++; return 0; }
  return exchange(g, "barrier", CG_BARRIER, 0, -1, NULL, 0);
}

int weft_cpugroup_barrier(weft_cpugroup *g) {
  if (!g) return barrier_one(g);  /* refused there, naming the NULL */
  int rc = enter(g, "barrier");
  return rc ? rc : leave(g, barrier_one(g));
}

/* All-gather into g->out / g->outlens; `what` names the operation. */
static int gather(weft_cpugroup *g, const char *what, int kind, int opc, const void *in, size_t len) {
  if (g->size > 1) return exchange(g, what, kind, opc, -1, in, len);
  g->seq++;
  if (grow(&g->out, &g->outcap, len ? len : 1))
    return wf_error(WEFT_ENOMEM, "cpugroup '%s' %s: out of memory", g->name, what);
  if (len) memcpy(g->out, in, len);
  g->outlens[0] = len;
  return 0;
}

static int allgather_one(weft_cpugroup *g, const void *in, size_t len, const void **out,
                            const size_t **lens) {
  WF_CHECK_ARG(g && out && lens, "cpugroup allgather: NULL argument");
  { int grc = refuse_in_capture(g, "allgather"); if (grc) return grc; }
  WF_CHECK_ARG(in || !len, "cpugroup '%s' allgather: input is NULL with length %zu", g->name, len);
  int rc = gather(g, "allgather", CG_ALLGATHER, 0, in, len);
  if (rc) return rc;
  *out = g->out;
  *lens = g->outlens;
  return 0;
}

int weft_cpugroup_allgather(weft_cpugroup *g, const void *in, size_t len, const void **out,
                            const size_t **lens) {
  if (!g) return allgather_one(g, in, len, out, lens);  /* refused there, naming the NULL */
  int rc = enter(g, "allgather");
  return rc ? rc : leave(g, allgather_one(g, in, len, out, lens));
}

static int broadcast_one(weft_cpugroup *g, int root, const void *in, size_t len,
                            const void **out, size_t *out_len) {
  WF_CHECK_ARG(g && out && out_len, "cpugroup broadcast: NULL argument");
  { int grc = refuse_in_capture(g, "broadcast"); if (grc) return grc; }
  WF_CHECK_ARG(root >= 0 && root < g->size, "cpugroup '%s' broadcast: root %d outside 0..%d",
               g->name, root, g->size - 1);
  WF_CHECK_ARG(g->me != root || in || !len,
               "cpugroup '%s' broadcast: root input is NULL with length %zu", g->name, len);
  if (g->size == 1) {
    g->seq++;
    if (grow(&g->out, &g->outcap, len ? len : 1))
      return wf_error(WEFT_ENOMEM, "cpugroup '%s' broadcast: out of memory", g->name);
    if (len) memcpy(g->out, in, len);
    *out = g->out;
    *out_len = len;
    return 0;
  }
  /* an exchange in which only the root's value carries bytes: every member,
   * the root too, returns once all have called, and a member that named
   * another root (or called something else) fails with all the others */
  int rc = exchange(g, "broadcast", CG_BROADCAST, 0, root, g->me == root ? in : NULL,
                    g->me == root ? len : 0);
  if (rc) return rc;
  *out = g->out;
  *out_len = g->outlens[0];
  return 0;
}

int weft_cpugroup_broadcast(weft_cpugroup *g, int root, const void *in, size_t len,
                            const void **out, size_t *out_len) {
  if (!g) return broadcast_one(g, root, in, len, out, out_len);  /* refused there, naming the NULL */
  int rc = enter(g, "broadcast");
  return rc ? rc : leave(g, broadcast_one(g, root, in, len, out, out_len));
}

static int allreduce_i64_one(weft_cpugroup *g, int64_t *vals, int n, int op) {
  WF_CHECK_ARG(g, "cpugroup allreduce_i64: group is NULL");
  { int grc = refuse_in_capture(g, "allreduce_i64"); if (grc) return grc; }
  WF_CHECK_ARG(n >= 0 && (vals || n == 0), "cpugroup '%s' allreduce_i64: bad buffer (n=%d)", g->name, n);
  WF_CHECK_ARG(op == WEFT_SUM || op == WEFT_MAX || op == WEFT_MIN || op == WEFT_AND || op == WEFT_PROD,
               "cpugroup '%s' allreduce_i64: unknown op %d", g->name, op);
  size_t bytes = (size_t)n * 8;
  if (grow(&g->tmp, &g->tmpcap, bytes ? bytes : 1))
    return wf_error(WEFT_ENOMEM, "cpugroup '%s' allreduce_i64: out of memory", g->name);
  for (int i = 0; i < n; i++) wf_put_u64(g->tmp + 8 * i, (uint64_t)vals[i]);
  int rc = gather(g, "allreduce_i64", CG_ALLREDUCE, op, g->tmp, bytes);
  if (rc) return rc;
  const uint8_t *p = g->out;
  const size_t *lens = g->outlens;
  for (int r = 0; r < g->size; r++)
    if (lens[r] != bytes)
      return wf_error(WEFT_EINVAL, "cpugroup '%s' allreduce_i64: ranks disagree on the count: "
                                   "rank %d has %d values, rank %d has %zu",
                      g->name, g->ranks[g->me], n, g->ranks[r], lens[r] / 8);
  for (int i = 0; i < n; i++) {
    uint64_t acc = wf_get_u64(p + 8 * i);  /* unsigned: sums/products wrap, no UB */
    for (int r = 1; r < g->size; r++) {
      uint64_t x = wf_get_u64(p + bytes * (size_t)r + 8 * (size_t)i);
      switch (op) {
      case WEFT_SUM: acc += x; break;
      case WEFT_PROD: acc *= x; break;
      case WEFT_AND: acc &= x; break;
      case WEFT_MAX: if ((int64_t)x > (int64_t)acc) acc = x; break;
      case WEFT_MIN: if ((int64_t)x < (int64_t)acc) acc = x; break;
      }
    }
    vals[i] = (int64_t)acc;
  }
  return 0;
}

int weft_cpugroup_allreduce_i64(weft_cpugroup *g, int64_t *vals, int n, int op) {
  if (!g) return allreduce_i64_one(g, vals, n, op);  /* refused there, naming the NULL */
  int rc = enter(g, "allreduce_i64");
  return rc ? rc : leave(g, allreduce_i64_one(g, vals, n, op));
}

static int send_one(weft_cpugroup *g, int dst, const void *buf, size_t len) {
  WF_CHECK_ARG(g, "cpugroup send: group is NULL");
  { int grc = refuse_in_capture(g, "send"); if (grc) return grc; }
  WF_CHECK_ARG(dst >= 0 && dst < g->size, "cpugroup '%s' send: destination %d outside 0..%d",
               g->name, dst, g->size - 1);
  WF_CHECK_ARG(buf || !len, "cpugroup '%s' send: buffer is NULL with length %zu", g->name, len);
  p2p_key(g, g->keys[0], g->me, dst, g->sseq[dst]);
  const char *op = opname(g, "send");
  weft_store *s;
  int rc = wf_store_here(g->s, op, &s);
  if (rc || (rc = wf_store_lock(s, op))) return rc;
  rc = wf_store_set_locked(s, op, g->keys[0], buf, len, 1);
  wf_store_unlock(s);
  if (!rc) g->sseq[dst]++;
  return rc;
}

int weft_cpugroup_send(weft_cpugroup *g, int dst, const void *buf, size_t len) {
  if (!g) return send_one(g, dst, buf, len);  /* refused there, naming the NULL */
  int rc = enter(g, "send");
  return rc ? rc : leave(g, send_one(g, dst, buf, len));
}

static int recv_one(weft_cpugroup *g, int src, const void **out, size_t *len) {
  WF_CHECK_ARG(g && out && len, "cpugroup recv: NULL argument");
  { int grc = refuse_in_capture(g, "recv"); if (grc) return grc; }
  WF_CHECK_ARG(src >= 0 && src < g->size, "cpugroup '%s' recv: source %d outside 0..%d",
               g->name, src, g->size - 1);
  p2p_key(g, g->keys[0], src, g->me, g->rseq[src]);
  const char *op = opname(g, "recv");
  int rc = refuse_broken(g, "recv");
  weft_store *s;
  if (rc || (rc = wf_store_here(g->s, op, &s)) || (rc = wf_store_lock(s, op))) return rc;
  const char *key[1] = {g->keys[0]};
  wf_get_req q = {.keys = key, .n = 1, .timeout_ms = g->timeout_ms, .flags = WF_GET_CONSUME,
                  .vals = g->vals, .lens = g->lens, .missing = g->missing,
                  .owners = &g->ranks[src], .abort_key = g->abort_key};
  if (g->shm) wf_shm_note_recv(g->shm, src, g->rseq[src]);  /* a peer at a barrier sees it */
  rc = note_failure(g, wf_store_get_locked(s, op, &q));
  if (g->shm) wf_shm_note_recv(g->shm, -1, 0);
  if (rc == WEFT_ETIMEOUT && q.nmissing > 0) {
    char verb[64];
    snprintf(verb, sizeof verb, "did not send (message #%llu)", (unsigned long long)g->rseq[src]);
    g->missing[0] = src;
    rc = timeout_error(g, s, "recv", 1, verb);
  }
  if (!rc) {
    if (grow(&g->out, &g->outcap, g->lens[0] ? g->lens[0] : 1))
      rc = wf_error(WEFT_ENOMEM, "%s: out of memory", op);
    else {
      if (g->lens[0]) memcpy(g->out, g->vals[0], g->lens[0]);
      *out = g->out;
      *len = g->lens[0];
      g->rseq[src]++;  /* only on success: a retried recv still gets a late message */
    }
  }
  wf_store_unlock(s);
  return rc;
}

int weft_cpugroup_recv(weft_cpugroup *g, int src, const void **out, size_t *len) {
  if (!g) return recv_one(g, src, out, len);  /* refused there, naming the NULL */
  int rc = enter(g, "recv");
  return rc ? rc : leave(g, recv_one(g, src, out, len));
}

weft_store *wf_cpugroup_store(weft_cpugroup *g) { return g ? g->s : NULL; }

int weft_cpugroup_abort(weft_cpugroup *g, const char *why) {
  WF_CHECK_ARG(g, "cpugroup abort: group is NULL");
  char msg[600];
  snprintf(msg, sizeof msg, "rank %d gave up on cpugroup '%s': %s", g->ranks[g->me], g->name,
           why && *why ? why : "aborted by its caller");
  weft_store *s;
  int rc = wf_store_here(g->s, "cpugroup abort", &s);
  return rc ? rc : weft_store_set(s, g->abort_key, msg, strlen(msg));
}
