/* weft.h — the single contract between the C core and the Lua layer.
 *
 * lua/weft/ffi.lua feeds the text between the FFI BEGIN/END markers to
 * ffi.cdef verbatim, so that region holds plain C declarations only: no
 * macros, no attributes, no by-value structs in signatures. The build exports
 * exactly the functions declared there (build/weft.map is generated from it).
 *
 * Conventions (DESIGN.md §3):
 *  - every call returns int: 0 ok, negative WEFT_E* kind; weft_last_error()
 *    gives a thread-local message naming the operation, the group and cause;
 *  - opaque handles, create/destroy pairs; destroy(NULL) is a no-op and never
 *    runs a collective by itself;
 *  - out-parameters are pointers; returned buffers (const void **) belong to
 *    the handle and stay valid until the next call on that handle.
 */
#ifndef WEFT_H
#define WEFT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Built with -fvisibility=hidden: what this header declares is the API. */
#pragma GCC visibility push(default)

/* ===== FFI BEGIN ===== */

enum {
  WEFT_OK = 0,
  WEFT_EINVAL = -1,    /* bad argument (dtype, shape, alignment, size, rank) */
  WEFT_ETIMEOUT = -2,  /* a bounded wait ran out; message names who is missing */
  WEFT_ESYS = -3,      /* a system call failed; message carries errno text */
  WEFT_ECLOSED = -4,   /* peer or server went away */
  WEFT_ENOMEM = -5,
  WEFT_ENODEV = -6,    /* no CUDA driver/device (or built without CUDA) */
  WEFT_ECUDA = -7,
  WEFT_ENCCL = -8,
  WEFT_EPROTO = -9,    /* malformed or oversized frame */
  WEFT_EAUTH = -10,    /* store secret mismatch */
  WEFT_EAGAIN = -11,   /* non-blocking poll: not ready yet */
  WEFT_ESTATE = -12,   /* wrong state: destroyed, capturing, busy */
  WEFT_EABORT = -13    /* aborted (abort flag, dead peer in a kernel) */
};

enum {
  WEFT_F32 = 0, WEFT_F16 = 1, WEFT_BF16 = 2, WEFT_I32 = 3, WEFT_I64 = 4,
  WEFT_U8 = 5, WEFT_F64 = 6, WEFT_F8E4M3 = 7
};

enum { WEFT_SUM = 0, WEFT_MAX = 1, WEFT_MIN = 2, WEFT_AND = 3, WEFT_PROD = 4 };

/* ---- library ---- */
int weft_abi_version(void);               /* bumped on any change below */
const char *weft_last_error(void);        /* thread-local, never NULL */
const char *weft_build_info(void);        /* "cuda=yes arch=sm_90 ..." */
size_t weft_dtype_size(int dtype);        /* 0 for an unknown dtype */

/* ---- store: TCP key-value rendezvous (src/store.c) ---- */
typedef struct weft_store weft_store;
typedef struct weft_store_opts {
  const char *host;       /* where the server is (connect address) */
  const char *bind_host;  /* server bind address; NULL: host (loopback default) */
  int port;               /* server with port 0: pick a free one */
  int is_server;          /* start the server thread in this process */
  int timeout_ms;         /* connect retries and default wait bound */
  const char *secret;     /* NULL: WEFT_STORE_SECRET, or none */
} weft_store_opts;

int weft_store_open(const weft_store_opts *opts, weft_store **out);
int weft_store_close(weft_store *s);
int weft_store_port(weft_store *s, int *port);
int weft_store_set(weft_store *s, const char *key, const void *val, size_t len);
/* Waits up to timeout_ms (<0: the store's default; 0: poll, WEFT_EAGAIN if absent). */
int weft_store_get(weft_store *s, const char *key, int timeout_ms,
                   const void **val, size_t *len);
int weft_store_multi_get(weft_store *s, const char *const *keys, int n,
                         int timeout_ms, const void **vals, size_t *lens);
int weft_store_add(weft_store *s, const char *key, int64_t delta, int64_t *result);
int weft_store_check(weft_store *s, const char *const *keys, int n, int *all_present);
int weft_store_compare_set(weft_store *s, const char *key,
                           const void *expected, size_t elen,
                           const void *desired, size_t dlen,
                           const void **current, size_t *clen);
int weft_store_delete(weft_store *s, const char *key, int *deleted);
int weft_store_wait(weft_store *s, const char *const *keys, int n, int timeout_ms);
int weft_store_num_keys(weft_store *s, int64_t *n);

/* ---- cpu group: control-plane collectives over the store (src/cpugroup.c) ----
 * ranks[] are global ranks (used in messages); my_index is this rank's
 * position in ranks[]. Roots/peers below are indices in the group. */
typedef struct weft_cpugroup weft_cpugroup;
int weft_cpugroup_create(weft_store *s, const char *name, const int *ranks,
                         int size, int my_index, int timeout_ms,
                         weft_cpugroup **out);
int weft_cpugroup_destroy(weft_cpugroup *g);
int weft_cpugroup_set_timeout(weft_cpugroup *g, int timeout_ms);
int weft_cpugroup_barrier(weft_cpugroup *g);
int weft_cpugroup_broadcast(weft_cpugroup *g, int root, const void *in,
                            size_t len, const void **out, size_t *out_len);
/* out: every rank's bytes concatenated in group order; lens[i]: rank i's size */
int weft_cpugroup_allgather(weft_cpugroup *g, const void *in, size_t len,
                            const void **out, const size_t **lens);
int weft_cpugroup_allreduce_i64(weft_cpugroup *g, int64_t *vals, int n, int op);
int weft_cpugroup_send(weft_cpugroup *g, int dst, const void *buf, size_t len);
int weft_cpugroup_recv(weft_cpugroup *g, int src, const void **out, size_t *len);

/* ---- host data plane: shared-memory communicator (src/shm.c) ----
 * Collective create among ranks of one node; the segment is unlinked as soon
 * as every rank has mapped it, so nothing is left behind if a rank dies. */
typedef struct weft_shm weft_shm;
int weft_shm_create(weft_cpugroup *g, size_t bytes_per_rank, weft_shm **out);
int weft_shm_destroy(weft_shm *c);
int weft_shm_all_reduce(weft_shm *c, const void *in, void *out, size_t count,
                        int dtype, int op);
int weft_shm_all_gather(weft_shm *c, const void *in, void *out, size_t bytes);
int weft_shm_reduce_scatter(weft_shm *c, const void *in, void *out,
                            size_t count_out, int dtype, int op);
int weft_shm_broadcast(weft_shm *c, void *buf, size_t bytes, int root);
/* in_the_same_node_as: flags[i] = 1 when group rank i shares memory with root */
int weft_same_node(weft_cpugroup *g, int root, uint8_t *flags);

/* ---- host tensor helpers (src/hostops.c, src/norm_host.c) ---- */
void *weft_host_alloc(size_t bytes);      /* 64-byte aligned, zeroed; NULL on failure */
void weft_host_free(void *p);
/* dist 0: uniform [-1, 1); 1: standard normal. Deterministic in seed. */
int weft_host_fill_random(void *p, size_t count, int dtype, uint64_t seed, int dist);
int weft_host_convert(const void *src, int src_dtype, void *dst, int dst_dtype,
                      size_t count);
int weft_host_compare(const void *a, const void *b, size_t count, int dtype,
                      double *max_abs, double *max_rel);
/* out = rmsnorm(x + residual) * w; residual_out = x + residual (f32 math).
 * residual/residual_out may be NULL (plain RMSNorm). flags: 1 = Gemma (1 + w). */
int weft_host_rmsnorm(const void *x, const void *residual, const void *weight,
                      void *out, void *residual_out, int64_t tokens,
                      int64_t hidden, int dtype, float eps, int flags);

/* ===== FFI END ===== */

/* The FFI region above as one string (embedded at build time), so the Lua
 * side declares exactly what this library was built with. */
const char *weft_ffi_cdef(void);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif
#endif /* WEFT_H */
