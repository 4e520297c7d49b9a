/* host_arena.h — where weft's large host tensors live (src/host/host_arena.c).
 *
 * Allocations of at least WF_ARENA_MIN bytes come from one memfd per
 * process, mapped MAP_SHARED, so that the peers of a shm communicator can
 * map it read-only and read a rank's tensors in place (zero-copy host
 * collectives, src/host/shm.c). Smaller ones, and everything when the arena is
 * off (WEFT_HOST_ARENA=0) or full, come from posix_memalign. */
#ifndef WF_HOST_ARENA_H
#define WF_HOST_ARENA_H

#include <stddef.h>
#include <stdint.h>

#define WF_ARENA_MIN (64u << 10)   /* smaller allocations stay on the heap */
#define WF_ARENA_GRAIN (64u << 10) /* arena blocks are multiples of this */

/* A zeroed block of at least bytes (>= WF_ARENA_MIN) from the arena, or NULL
 * when the arena cannot serve it (the caller then uses the heap; no error
 * is recorded). */
void *wf_arena_alloc(size_t bytes);
/* 1 when p came from the arena (now freed), 0 when it did not (heap). */
int wf_arena_free(void *p);
/* the length of the live arena allocation that starts at p; 0 when p is none */
size_t wf_arena_len(const void *p);
/* 1 when [p, p + len) lies in this process's arena (off: its offset). */
int wf_arena_lookup(const void *p, size_t len, uint64_t *off);
/* This process's arena descriptor and reserved size, creating it when
 * needed; an error when there is none (off, or the system refused). */
int wf_arena_export(int32_t *fd, uint64_t *bytes);
/* Map process pid's arena (its descriptor fd, size bytes) read-only into
 * this process, through /proc/<pid>/fd/<fd>; NULL and an error when it
 * cannot be opened or is not a weft arena of that size. Mappings of the same
 * arena are shared and counted: each map is undone by one unmap. */
const uint8_t *wf_arena_map_peer(int32_t pid, int32_t fd, uint64_t bytes);
void wf_arena_unmap_peer(const uint8_t *base, uint64_t bytes);

#endif
