/* mq.h — internals of the message-queue broadcaster (src/host/mq.c).
 *
 * One writer, world-1 readers, a ring of `chunks` slots of `chunk` bytes in
 * one POSIX shm object (unlinked as soon as every rank mapped it):
 *   [0, 256)                         header: magic, geometry, abort word
 *   [256 + 256*i, +256)              rank i: pid, departure flag, why it gave up
 *   [ctl_off + s*(1+world)*128, ...) slot s control: the written line (seq,
 *                                    fragment length/number, message length),
 *                                    then one read line per rank (only readers'
 *                                    are used), each on its own 128-byte line
 *   [data_off + s*stride, +chunk)    slot s bytes
 *
 * Positions count fragments from 0 on every rank alike; position p lives in
 * slot p % chunks. Flags are sequence numbers, not booleans, so nothing is
 * ever reset: written.seq = p+1 publishes position p; read[r].seq = p+1 says
 * reader r is done with it. The writer may fill position p once every reader
 * released p - chunks (read.seq reached p+1-chunks). 32-bit words compared
 * modulo 2^32 (the writer is never more than `chunks` ahead of any reader).
 */
#ifndef WF_MQ_H
#define WF_MQ_H

#include "core/internal.h"
#include "core/wait.h"

#include <stdatomic.h>

#define WF_MQ_MAGIC 0x31712d6d2d746677ULL /* "wft-mq-1" */
#define WF_MQ_VERSION 1u
#define WF_MQ_HDR 256u
#define WF_MQ_RANK 256u
#define WF_MQ_LINE 128u
#define WF_MQ_MAX_WORLD 1024
#define WF_MQ_MAX_CHUNKS 65536
#define WF_MQ_MAX_CHUNK ((size_t)1 << 30)
#define WF_MQ_MAX_DATA ((size_t)16 << 30)

typedef struct {
  uint64_t magic;
  uint32_t version, world, writer, chunks;
  uint64_t chunk, stride, ctl_off, data_off, total;
  _Atomic uint32_t attached; /* ranks that mapped the segment */
  _Atomic uint32_t abort;    /* 0, or 1 + index of the first rank that gave up */
} wf_mq_hdr;
_Static_assert(sizeof(wf_mq_hdr) <= WF_MQ_HDR, "header fits");

typedef struct {
  _Atomic int32_t pid;
  _Atomic uint32_t left;    /* set by destroy: waiting on this rank is futile */
  uint64_t pidns;           /* pid namespace inode: liveness checks only if equal */
  char why[160];            /* reason, written before this rank raises the abort word */
  wf_cpu_note cpus;         /* where this rank may run (core/wait.h): who may spin */
  uint8_t pad[WF_MQ_RANK - 180];
} wf_mq_rank;
_Static_assert(sizeof(wf_mq_rank) == WF_MQ_RANK, "rank block is 256 bytes");

/* Written line of a slot: the writer stores the fragment's metadata, then
 * seq (release); a reader loads seq (acquire), then the metadata. */
typedef struct {
  _Atomic uint32_t seq;     /* 1 + position now in the slot */
  _Atomic uint32_t waiters; /* readers sleeping on seq: FUTEX_WAKE only when > 0 */
  uint32_t frag_len, frag_no;
  uint64_t total;           /* bytes of the whole message */
  uint8_t pad[WF_MQ_LINE - 24];
} wf_mq_wline;
_Static_assert(sizeof(wf_mq_wline) == WF_MQ_LINE, "one line");

/* Read line of one reader in one slot. */
typedef struct {
  _Atomic uint32_t seq;     /* 1 + last position of this slot the reader released */
  _Atomic uint32_t waiters; /* the writer sleeping on seq */
  uint8_t pad[WF_MQ_LINE - 8];
} wf_mq_rline;
_Static_assert(sizeof(wf_mq_rline) == WF_MQ_LINE, "one line");

struct weft_mq {
  uint8_t *base;
  size_t map_len;
  wf_mq_hdr *hdr;
  wf_mq_rank *rk;
  uint8_t *ctl, *data;
  size_t chunk, stride;
  uint32_t chunks;
  int world, me, writer, timeout_ms, check_pids;
  wf_wait wait;             /* the adaptive wait (core/wait.h) */
  uint64_t pos;             /* next position to write (writer) or read (reader) */
  uint64_t msgs;            /* messages moved: named in errors */
  int held;                 /* reader: position pos-1 is still lent to the caller */
  int pending;              /* reader: a split message is half reassembled */
  uint32_t pend_frag;
  uint64_t pend_total, pend_off;
  uint8_t *buf;             /* reader: reassembly of split messages */
  size_t cap;
  _Atomic int busy;         /* one call in flight per handle */
  int *ranks;               /* global ranks, for messages */
  char group[64];
};

#endif
