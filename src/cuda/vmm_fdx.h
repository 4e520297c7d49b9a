/* vmm_fdx.h — hand one file descriptor to every other process of a group
 * on this node, over Unix-domain sockets with SCM_RIGHTS (src/cuda/vmm_fdx.c).
 * No CUDA here: src/cuda/vmm.c exchanges cuMem POSIX-fd handles with it, and
 * tests/c/ar_fdx_test.c tests it with memfds. */
#ifndef WEFT_VMM_FDX_H
#define WEFT_VMM_FDX_H

#include <stdint.h>

#define WF_FDX_NONCE 16

/* What every process announces to the others (through the cpu group) before
 * the exchange: its pid and uid (checked with SO_PEERCRED on both ends) and a
 * random nonce that names its listener and that it proves when it sends. */
typedef struct wf_fdx_id {
  int32_t pid;
  uint32_t uid;
  unsigned char nonce[WF_FDX_NONCE];
} wf_fdx_id;

/* Fill id (pid, uid, 16 bytes from getrandom) and open this process's
 * listener "weft-vmm-<hex nonce>" in the abstract namespace (nothing in the
 * file system; the name is only known through the store). */
int wf_fdx_listen(wf_fdx_id *id, int backlog, int *listen_fd);

/* Send myfd to every other index of ids[0..n) and receive one descriptor
 * from each: fds[r] for r != me (the caller closes them). Connections that
 * fail a check (uid, pid, nonce, index, duplicate) are dropped and waiting
 * goes on. Bounded by deadline_ms (wf_now_ms clock): WEFT_ETIMEOUT names the
 * peers that sent nothing. op prefixes messages. On error every descriptor
 * received so far is closed and fds[] is reset to -1. */
int wf_fdx_exchange(const wf_fdx_id *ids, int n, int me, int listen_fd, int myfd, int *fds,
                    int64_t deadline_ms, const char *op);

#endif
