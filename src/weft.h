/* weft.h — the single contract between the C core and the Lua layer.
 *
 * lua/weft/internal/ffi.lua feeds the text between the FFI BEGIN/END markers to
 * ffi.cdef verbatim, so that region holds plain C declarations only: no
 * macros, no attributes, no by-value structs in signatures. The build exports
 * exactly the functions declared there (build/weft.map is generated from it).
 *
 * Conventions (docs/architecture.md, "Conventions in one place"):
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
  WEFT_EABORT = -13,   /* aborted (abort flag, dead peer in a kernel) */
  WEFT_EMISMATCH = -14 /* the ranks called different collectives (op, dtype, count,
                        * root...): every rank fails alike, naming each rank's call */
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

/* ---- store: TCP key-value rendezvous (src/store/store.c) ----
 * Calls on one handle are serialized by its mutex: a blocking get holds the
 * handle, so a thread that sets what another thread waits for needs its own
 * handle; returned buffers stay valid until the next call from any thread.
 * Env: WEFT_STORE_SECRET, WEFT_STORE_MAX_VALUE (bytes, default 256 MiB),
 * WEFT_STORE_READ_TIMEOUT_MS (server drops a stalled frame, default 10000). */
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
/* Liveness (src/store/store_live.c): this handle speaks for `rank` of a world of
 * `world` ranks. The server remembers which connection did; when that
 * connection ends without weft_store_close (the process exited or was
 * killed), it writes "weft/rank/<rank>/gone". Waits of a registered handle
 * (cpu group collectives, get, multi_get, wait) look every ~200 ms whether
 * a rank they wait for is gone, and then fail with WEFT_ECLOSED naming it:
 * "rank R (pid P, host H) died". get/wait cannot know who would set a key,
 * so any gone rank of the world ends them. */
int weft_store_register_rank(weft_store *s, int rank, int world);
/* This rank has finished its part (weft.shutdown): when its handle closes,
 * its tombstone says "finished", which ends only the waits for this rank's
 * own keys. Closing a registered handle without it (a script that ends or
 * raises: its finalizers close the handle) writes "left", which ends every
 * wait as a death does, naming the rank as left. */
int weft_store_finish(weft_store *s);
/* Waits up to timeout_ms (<0: the store's default) until the store's server
 * closes this handle's connection (its rank shut down). 0 once it did;
 * WEFT_ETIMEOUT while it still answers; WEFT_ECLOSED naming a rank that is
 * gone. From the call on, the handle never connects again (a new connection
 * to that port could reach whatever holds it next): only close is left. */
int weft_store_wait_closed(weft_store *s, int timeout_ms);
/* The ranks of the world that are gone (tombstones), polled up to wait_ms
 * until one appears: *n of them, described in buf ("rank R (pid P, host H),
 * ..."). With none gone (*n == 0), buf lists the ranks whose host the
 * store's host gets no TCP acknowledgement from (a partition), or is "".
 * For callers whose own wait failed elsewhere (a peer's connection, another
 * group) and who want to name the first cause. The whole call ends within
 * wait_ms + ~300 ms; WEFT_ECLOSED when the store itself did not answer
 * ("the store at ADDR ... is unreachable"). */
int weft_store_gone_ranks(weft_store *s, int wait_ms, char *buf, size_t len, int *n);
/* Both lists at once, bounded the same: the gone ranks (*n_gone, described
 * in gone) and the ranks whose host the store's host cannot reach (*n_cut,
 * in cut: a partition). After a timeout the gone ones may have failed on
 * the cut-off ones and exited (docs/faults.md). */
int weft_store_diagnose(weft_store *s, int wait_ms, char *gone, size_t gone_len, int *n_gone,
                        char *cut, size_t cut_len, int *n_cut);

/* ---- interrupt (src/core/interrupt.c) ----
 * While armed, weft's blocking host waits (cpu group and store waits, shm
 * barriers and collectives, the mq broadcaster) end within ~200 ms with
 * WEFT_EABORT "interrupted" once fd is readable (e.g. a signalfd; weft polls
 * it, never reads it) or timeout_ms have passed since arming. A cpu group or
 * shm communicator so interrupted is aborted on every member (the others
 * fail with "aborted by rank R: interrupted") and refuses further use: its
 * ranks may disagree on how many collectives they completed. fd < 0 and
 * timeout_ms <= 0: disarm. */
int weft_interrupt_arm(int fd, int timeout_ms);

/* ---- cpu group: control-plane collectives over the store (src/host/cpugroup.c) ----
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
/* This rank gives up on the group: every member's current and later waits
 * on it fail with WEFT_EABORT "aborted: why" (e.g. a node leader whose own
 * node failed tells the other leaders what happened). */
int weft_cpugroup_abort(weft_cpugroup *g, const char *why);
/* An abort this rank could not publish when it gave up on a collective (the
 * store did not answer) goes out now; weft.recover() calls it for every
 * group first, so a member that completed that collective is told. 0 when
 * none was pending or it went out. */
int weft_cpugroup_publish_abort(weft_cpugroup *g);

/* ---- host data plane: shared-memory communicator (src/host/shm.c) ----
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
/* A barrier on c: its descriptor (kind barrier) is compared with the peers'
 * calls like every collective's, so a rank at a barrier and a rank in
 * another collective on c both fail at once. */
int weft_shm_barrier(weft_shm *c);
/* The shape of this rank's next collective on c (weft_shape_word) and its
 * other arguments (weft_args_word: a v-collective's sizes, a gathered
 * reduction's op), 0: none, compared with the peers' with the rest of the
 * call: ranks whose calls differ there all fail, naming both. Taken by the
 * next collective, which then clears them. */
int weft_shm_set_call(weft_shm *c, uint64_t shape_word, uint64_t args_word);
/* A shape (ndim dims) as the word the shm and Gloo calls compare: exact
 * (and printed) up to 3 dims below 2^20 each, else ndim and a hash. */
uint64_t weft_shape_word(int ndim, const int64_t *dims);
/* A call's other arguments as text (n bytes) as the word they compare:
 * exact up to 7 bytes, else a hash. */
uint64_t weft_args_word(const char *s, size_t n);
/* This rank gives up on the communicator (e.g. its part of a larger
 * collective failed elsewhere): every member's current and later calls fail
 * with WEFT_EABORT "aborted by rank R: why" (why: up to ~100 bytes kept). */
int weft_shm_abort(weft_shm *c, const char *why);
/* The bound of this rank's later waits (the group's timeout at create). */
int weft_shm_set_timeout(weft_shm *c, int timeout_ms);
/* Zero-copy: when the buffers a collective reads from peers are weft host
 * memory (weft_host_alloc, weft_host_is_shared) on every rank (broadcast:
 * the root's) and it moves at least zero_copy_min bytes, ranks read each
 * other's buffers in place (no copy through the segment). zero_copy: the peers' arenas are mapped (all ranks
 * agree; WEFT_SHM_ZEROCOPY=0 turns it off). Counters: calls on each path. */
typedef struct {
  int32_t world, zero_copy;
  uint64_t zero_copy_min, zero_copy_calls, segment_calls;
} weft_shm_info;
int weft_shm_get_info(weft_shm *c, weft_shm_info *out);
/* in_the_same_node_as: flags[i] = 1 when group rank i shares memory with root */
int weft_same_node(weft_cpugroup *g, int root, uint8_t *flags);

/* ---- gloo: host collectives across nodes on Gloo's TCP transport
 *      (src/host/gloo_shim.cc; src/host/gloo_stubs.c in a build without Gloo) ----
 * Built where Gloo's headers are (mk/gloo.mk); otherwise weft_gloo_available
 * says 0 and every other call fails with WEFT_ENODEV "built without Gloo".
 * create is collective over g: each rank listens on `host` (NULL or "": the
 * local address of its store connection, the interface that reaches rank
 * 0), the ranks meet through g's store (weft's own: its secret and limits
 * apply; keys under "weft/gloo/<group>/<nonce>/", deleted once connected)
 * and connect a full mesh, all bounded by g's timeout. Every call is bounded
 * by the handle's timeout (g's at create; set_timeout changes it) and names
 * the group and the operation when it fails; a rank that died is named
 * ("rank R (pid P, host H) died") when the store saw it go. A failed call
 * closes this rank's connections (so its peers fail at once instead of at
 * their timeout) and leaves the handle unusable (WEFT_ESTATE). Reductions are
 * weft_host_reduce's (integer wrap, NaN propagation; dtypes f32 f16 bf16 f64
 * i32 i64 u8); in == out: in place. Counts in elements, sizes in bytes;
 * roots and peers are indices in g. One call at a time per handle; destroy
 * is local and idempotent on the handle's side. */
typedef struct weft_gloo weft_gloo;
int weft_gloo_available(void);
int weft_gloo_create(weft_cpugroup *g, const char *host, weft_gloo **out);
int weft_gloo_destroy(weft_gloo *c);
int weft_gloo_set_timeout(weft_gloo *c, int timeout_ms);
int weft_gloo_all_reduce(weft_gloo *c, const void *in, void *out, size_t count, int dtype,
                         int op);
/* all_reduce of at most this many bytes in a group of a power-of-two size
 * takes the small path: a second mesh whose pairs run in Gloo's synchronous
 * mode (the caller reads its socket), made at the first such call; recursive
 * doubling below 256 KiB, recursive halving + doubling from it, full-duplex
 * chunked exchanges; every rank gets the same bits. WEFT_GLOO_SMALL_MAX
 * (default 16 MiB; 0: off). 0 without Gloo. */
size_t weft_gloo_small_max(void);
/* out: world * bytes, rank i's bytes at i * bytes */
int weft_gloo_all_gather(weft_gloo *c, const void *in, void *out, size_t bytes);
/* in: world chunks of count_out elements; out: this rank's reduced chunk */
int weft_gloo_reduce_scatter(weft_gloo *c, const void *in, void *out, size_t count_out,
                             int dtype, int op);
int weft_gloo_broadcast(weft_gloo *c, void *buf, size_t bytes, int root);
int weft_gloo_barrier(weft_gloo *c);
/* as weft_shm_set_call: the shape and args words of the next collective */
int weft_gloo_set_call(weft_gloo *c, uint64_t shape_word, uint64_t args_word);
/* This member makes no call where the others make one (its node's ranks
 * disagreed): it takes part in that call's agreement round with its word
 * marked refused, so they fail at once naming it. Waits at most wait_ms
 * for their words; returns the mismatch (or that wait's failure). */
int weft_gloo_refuse(weft_gloo *c, int wait_ms);
/* exactly `bytes` each way: a size that differs from the peer's fails */
int weft_gloo_send(weft_gloo *c, const void *buf, size_t bytes, int dst);
int weft_gloo_recv(weft_gloo *c, void *buf, size_t bytes, int src);

/* ---- host tensor helpers (src/host/hostops.c, src/host/norm_host.c) ---- */
/* 64-byte aligned, zeroed; NULL on failure. From 64 KiB on, the memory comes
 * from the process's shared host arena (src/host/host_arena.c): peers of a shm
 * communicator can read it in place. */
void *weft_host_alloc(size_t bytes);
void weft_host_free(void *p);
/* 1 when [p, p + bytes) is shared host arena memory, else 0 */
int weft_host_is_shared(const void *p, size_t bytes);
/* dist 0: uniform [-1, 1); 1: standard normal. Deterministic in seed. */
int weft_host_fill_random(void *p, size_t count, int dtype, uint64_t seed, int dist);
int weft_host_convert(const void *src, int src_dtype, void *dst, int dst_dtype,
                      size_t count);
int weft_host_compare(const void *a, const void *b, size_t count, int dtype,
                      double *max_abs, double *max_rel);
/* dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[n-1][i], in that order,
 * with the shm engine's kernels (src/host/shm_reduce.c): the one definition of a
 * reduction on every backend. Integers wrap (two's complement; u8 mod 256);
 * f16/bf16 accumulate in f32 and round once; float max/min propagate NaN
 * (like torch). dtype: f32, f16, bf16, f64, i32, i64, u8; op: WEFT_SUM,
 * WEFT_MAX, WEFT_MIN, WEFT_PROD. dst may be one of the sources (the same
 * address); n >= 1. */
int weft_host_reduce(void *dst, const void *const *srcs, int n, size_t count, int dtype,
                     int op);
/* out = rmsnorm(x + residual) * w; residual_out = x + residual (f32 math).
 * residual/residual_out may be NULL (plain RMSNorm). flags: 1 = Gemma (1 + w). */
int weft_host_rmsnorm(const void *x, const void *residual, const void *weight,
                      void *out, void *residual_out, int64_t tokens,
                      int64_t hidden, int dtype, float eps, int flags);

/* ---- CUDA runtime: devices, pool, copies, streams, events, graphs
 *      (src/cuda/cuda.c, src/cuda/cuda_pool.c, src/cuda/graph.c, kernels/devops.cu) ----
 * Resolved lazily on first use. With no driver/device (or a build without
 * CUDA) every call fails with WEFT_ENODEV "no CUDA device", except
 * weft_cuda_device_count, which reports 0 and succeeds.
 * Streams are raw cudaStream_t values as void* (an embedding program may
 * pass its own); NULL means the calling thread's current weft stream, which
 * starts as the legacy default stream. Events likewise (cudaEvent_t).
 * The default device is WEFT_DEVICE, else LOCAL_RANK (mod device count), else 0;
 * each thread starts on it. Waits (synchronize, copy) are bounded by
 * WEFT_CUDA_TIMEOUT_MS (default 300000) and refused while capturing. */
int weft_cuda_device_count(int *n);
int weft_cuda_set_device(int dev);
int weft_cuda_get_device(int *dev);
int weft_cuda_device_name(int dev, char *buf, size_t len);
int weft_cuda_synchronize(void);          /* the current device, bounded */
/* Device that owns p (-1: host memory, pageable or pinned). */
int weft_cuda_pointer_device(const void *p, int *dev);

/* Caching pool: per-device size-class free lists; steady state never calls
 * cudaMalloc. dev < 0: current device. A freed block is reused in stream
 * order, so free only what no other stream still reads. */
typedef struct weft_cuda_pool_stats {
  int64_t in_use_bytes, in_use_blocks, cached_bytes, cached_blocks, peak_bytes;
  int64_t device_allocs, device_frees, hits, misses;
} weft_cuda_pool_stats;
int weft_cuda_malloc(void **p, size_t bytes, int dev);
int weft_cuda_free(void *p);              /* NULL: no-op */
int weft_cuda_pool_stats_get(int dev, weft_cuda_pool_stats *out);
int weft_cuda_pool_trim(int dev);         /* cudaFree the cached blocks */

/* Synchronous copy (cudaMemcpyDefault, ordered after the current stream). */
int weft_cuda_memcpy(void *dst, const void *src, size_t bytes);
int weft_cuda_memcpy_async(void *dst, const void *src, size_t bytes, void *stream);
int weft_cuda_memset(void *p, int value, size_t bytes, void *stream);
/* Same distributions as weft_host_fill_random (not the same values):
 * dist 0 uniform [-1, 1), 1 standard normal; deterministic in seed. */
int weft_cuda_fill_random(void *p, size_t count, int dtype, uint64_t seed,
                          int dist, void *stream);

/* Streams. nonblocking=1: no implicit sync with the legacy stream (what a
 * capture stream needs). */
int weft_cuda_stream_create(int nonblocking, void **out);
int weft_cuda_stream_destroy(void *stream);
int weft_cuda_stream_synchronize(void *stream);
int weft_cuda_stream_wait_stream(void *stream, void *other); /* stream waits for other's work so far */
int weft_cuda_stream_set_current(void *stream);               /* per thread */
int weft_cuda_stream_get_current(void **stream);

/* Events. timing=0 gives a lighter event that elapsed() refuses. */
int weft_cuda_event_create(int timing, void **out);
int weft_cuda_event_destroy(void *event);
int weft_cuda_event_record(void *event, void *stream);
int weft_cuda_event_synchronize(void *event);
int weft_cuda_event_elapsed(void *start, void *end, float *ms);
int weft_cuda_stream_wait_event(void *stream, void *event);

/* Graphs: capture on a (non-legacy) stream in thread-local mode, end gives
 * an instantiated graph. Capture is refused on the legacy stream; while the
 * calling thread captures, synchronizing calls and store collectives fail
 * with WEFT_ESTATE instead of invalidating the capture. */
typedef struct weft_cuda_graph weft_cuda_graph;
int weft_cuda_graph_begin(void *stream);
int weft_cuda_graph_end(void *stream, weft_cuda_graph **out);
int weft_cuda_graph_launch(weft_cuda_graph *g, void *stream);
int weft_cuda_graph_destroy(weft_cuda_graph *g);
int weft_cuda_stream_capturing(void *stream, int *capturing);

/* ---- residual add + RMSNorm on device (kernels/norm.cu) ----
 * Same contract as weft_host_rmsnorm (f32 math): v = x + residual,
 * residual_out = v rounded to dtype, out = residual_out * rsqrt(mean(v^2) +
 * eps) * w (flags 1 = Gemma, 1 + w). residual and residual_out may be NULL;
 * out may alias x and residual_out may alias residual. dtype: f32, f16,
 * bf16. Async on stream. flags | WEFT_RMSNORM_DETERMINISTIC: the fused
 * kernel's arithmetic instead (the sum of squares of the rounded
 * residual_out in its one fixed order, kernels/common.cuh; w + (-0.0)), so
 * all-reduce + this equals the fused kernel with WEFT_FUSION_DETERMINISTIC
 * bit for bit; needs 16-byte aligned rows (hidden * size % 16 == 0). */
enum { WEFT_RMSNORM_GEMMA = 1, WEFT_RMSNORM_DETERMINISTIC = 2 };
int weft_cuda_rmsnorm(const void *x, const void *residual, const void *weight,
                      void *out, void *residual_out, int64_t tokens,
                      int64_t hidden, int dtype, float eps, int flags,
                      void *stream);

/* ---- NaN propagation around NCCL's float max/min (kernels/devops.cu) ----
 * NCCL's max/min use fmaxf/fminf and __hmax/__hmin: NaN is dropped unless
 * every rank holds one. weft's device max/min follow torch instead (any
 * rank's NaN makes the element NaN): mask the input, NCCL max of the u8 mask,
 * NCCL max/min of the data, fix up the output. nan_mask: mask[i] = 1 where
 * x[i] is NaN, else 0. nan_fixup: x[i] = the dtype's quiet NaN (f32
 * 0x7fc00000, f64 0x7ff8000000000000, f16 0x7e00, bf16 0x7fc0) where
 * mask[i] != 0, other elements untouched. count elements; dtype f32, f64,
 * f16, bf16. Async on stream (NULL: the thread's current stream);
 * capturable. */
int weft_cuda_nan_mask(const void *x, uint8_t *mask, size_t count, int dtype, void *stream);
int weft_cuda_nan_fixup(void *x, const uint8_t *mask, size_t count, int dtype, void *stream);

/* ---- NCCL: device collectives per group (src/coll/nccl.c) ----
 * libnccl.so.2 is loaded on first use (WEFT_NCCL_LIB overrides the path).
 * Create is collective over the cpu group: index 0 makes the unique id and
 * broadcasts it through the group; a non-blocking communicator is created on
 * the current device (init bounded by the group's timeout) and, by default,
 * a blocking one split from it. Every wait is bounded by the group's timeout;
 * on timeout or error the communicator is aborted and the error names the
 * group and the op.
 * Counts are elements; buffers must be on the communicator's device (checked
 * before anything is enqueued). stream NULL: the thread's current stream.
 * NCCL_NVLS_ENABLE is forced to 0 unless WEFT_ALLOW_MULTICAST=1. */
typedef struct weft_nccl weft_nccl;
int weft_nccl_version(int *version);      /* WEFT_ENODEV when NCCL cannot load */
/* Name, index, size and timeout come from g (the timeout can be changed
 * later with weft_nccl_set_timeout). blocking: 1 = calls go to a blocking
 * communicator split from the non-blocking one (inline enqueue; a call that
 * waits on a peer inside NCCL is ended by a watchdog after the timeout),
 * 0 = calls go to the non-blocking one (NCCL hands every call to a helper
 * thread: tens of µs more per eager call), -1 = WEFT_NCCL_BLOCKING (default
 * 1). Init and every wait are bounded either way. */
int weft_nccl_create(weft_cpugroup *g, int blocking, weft_nccl **out);
/* *blocking = 1 when calls on c go to a blocking communicator. */
int weft_nccl_blocking(weft_nccl *c, int *blocking);
int weft_nccl_set_timeout(weft_nccl *c, int timeout_ms);
int weft_nccl_destroy(weft_nccl *c);      /* frees; aborts if a wait failed */
int weft_nccl_abort(weft_nccl *c);        /* later calls fail with WEFT_ESTATE */
int weft_nccl_info(weft_nccl *c, int *rank, int *size, int *device);
/* Waits (bounded by the group timeout) for stream, polling the communicator. */
int weft_nccl_synchronize(weft_nccl *c, void *stream);
int weft_nccl_all_reduce(weft_nccl *c, const void *in, void *out, size_t count,
                         int dtype, int op, void *stream);
/* out holds size * count, rank-major */
int weft_nccl_all_gather(weft_nccl *c, const void *in, void *out, size_t count,
                         int dtype, void *stream);
/* counts[size]: rank i contributes counts[i]; out holds them concatenated */
int weft_nccl_all_gatherv(weft_nccl *c, const void *in, void *out,
                          const size_t *counts, int dtype, void *stream);
/* in holds size * count_out; out gets this rank's reduced slice */
int weft_nccl_reduce_scatter(weft_nccl *c, const void *in, void *out,
                             size_t count_out, int dtype, int op, void *stream);
/* in holds sum(counts); rank i gets counts[i] reduced elements */
int weft_nccl_reduce_scatterv(weft_nccl *c, const void *in, void *out,
                              const size_t *counts, int dtype, int op, void *stream);
int weft_nccl_broadcast(weft_nccl *c, const void *in, void *out, size_t count,
                        int dtype, int root, void *stream);
/* out (root only, NULL elsewhere) holds size * count, rank-major */
int weft_nccl_gather(weft_nccl *c, const void *in, void *out, size_t count,
                     int dtype, int root, void *stream);
int weft_nccl_send(weft_nccl *c, const void *buf, size_t count, int dtype,
                   int peer, void *stream);
int weft_nccl_recv(weft_nccl *c, void *buf, size_t count, int dtype,
                   int peer, void *stream);
/* send_counts/recv_counts NULL: equal splits of count (total elements, which
 * size must divide); else per-peer counts, packed contiguously in peer order. */
int weft_nccl_all_to_all(weft_nccl *c, const void *in, void *out, size_t count,
                         const size_t *send_counts, const size_t *recv_counts,
                         int dtype, void *stream);
/* Batch the calls between them (this thread); end waits for the enqueue. */
int weft_nccl_group_start(void);
int weft_nccl_group_end(void);

/* ---- allreduce: VMM workspaces + custom one/two-shot all-reduce
 *      (src/cuda/vmm.c, src/coll/allreduce.c, kernels/allreduce.cu) ----
 * VMM workspace: every rank of the group allocates `bytes` (rounded up to the
 * granularity; the same size on all ranks) with cuMemCreate, exports a POSIX
 * fd (flags WEFT_VMM_FABRIC: a FABRIC handle), exchanges it over Unix-domain
 * sockets (SCM_RIGHTS, uid/pid checked), imports and maps all of them.
 * Collective; a preflight vote makes all ranks succeed or all fail (then fall
 * back to NCCL). ptr(peer) is this process's address of peer's allocation.
 * Destroy is local and releases everything (stats: live workspaces/bytes). */
typedef struct weft_vmm weft_vmm;
enum { WEFT_VMM_FABRIC = 1 };
int weft_vmm_create(weft_cpugroup *g, size_t bytes, int flags, weft_vmm **out);
int weft_vmm_destroy(weft_vmm *w);
int weft_vmm_ptr(weft_vmm *w, int peer, void **ptr);
int weft_vmm_size(weft_vmm *w, size_t *bytes);
int weft_vmm_stats(int64_t *live, int64_t *live_bytes, int64_t *created);

/* Custom all-reduce (sum) for ranks of one node with peer access: world 2,
 * 4, 6, 8; dtypes f32, f16, bf16 (f32 accumulation); any count; in and out
 * 16-byte aligned (in == out allowed); results bitwise identical on every
 * rank. create is collective (owns a VMM workspace for calls of up to
 * max_bytes). run is asynchronous on stream (NULL: the thread's current
 * stream) and CUDA-graph safe (inputs are read inside the kernel, epochs live
 * in device memory: replays with new input data are correct); every rank
 * must make the same calls in the same order. Kernels never hang: a peer
 * that does not arrive within the timeout (default: the group's) or an abort
 * makes the kernel return, and check_error then reports WEFT_ETIMEOUT /
 * WEFT_EABORT naming the group and the late peer; the handle is then
 * unusable (destroy, recreate, or use NCCL). One operation in flight per
 * handle: a call from a second stream while the first is busy is refused.
 * algo: WEFT_AR_AUTO, ONESHOT (Lamport push one-shot; flag one-shot above
 * its buffer), TWOSHOT (reduce-scatter + all-gather), ONESHOT_FLAG.
 * Environment (read at create): WEFT_AR_LAMPORT_MAX (bytes of the Lamport
 * buffers, default min(max_bytes, 16 MiB)), WEFT_AR_ONESHOT_MAX (auto's
 * one-shot limit), WEFT_AR_TWOSHOT_MIN (auto, 2 ranks: flag one-shot between
 * the one-shot limit and this size, two-shot from it; default: two-shot right
 * above the limit), WEFT_AR_BLOCKS_PER_SM, WEFT_AR_TIMEOUT_MS, WEFT_AR_PDL
 * (default 1: kernels use programmatic dependent launch). */
typedef struct weft_ar weft_ar;
enum { WEFT_AR_AUTO = 0, WEFT_AR_ONESHOT = 1, WEFT_AR_TWOSHOT = 2, WEFT_AR_ONESHOT_FLAG = 3,
       /* the quick all-reduce (kernels/quick_allreduce.cu, docs/quick-allreduce.md): two-shot
        * whose wire is a codec; bf16/f16 only; every rank gets the same bits; lossy except FP */
       WEFT_AR_QUICK_FP = 4, WEFT_AR_QUICK_INT8 = 5, WEFT_AR_QUICK_INT4 = 6, WEFT_AR_QUICK_FP8 = 7,
       WEFT_AR_NO_PDL = 256, /* or'ed into algo: launch without programmatic dependent launch */
       WEFT_AR_DETERMINISTIC = 512 /* or'ed into algo: every kernel sums the same sanitised inputs
                                      (-0.0 -> +0.0 as the one-shot's Lamport buffers need), so
                                      one-shot, flag one-shot and two-shot agree bit for bit */ };
int weft_ar_create(weft_cpugroup *g, size_t max_bytes, weft_ar **out);
int weft_ar_destroy(weft_ar *ar);
/* run: checks the contract (a usable handle, buffers 16-byte aligned, dtype,
 * count, the workspace's size), then runs `algo`: WEFT_AR_AUTO is resolved
 * here as weft_ar_resolve does (for C callers); a named kernel is only checked
 * to fit. weft's Lua path always names the kernel, which its custom_ar rule
 * got from weft_ar_resolve: the algorithm is chosen once. */
int weft_ar_run(weft_ar *ar, const void *in, void *out, size_t count, int dtype, int algo,
                void *stream);
/* 0, or the first kernel failure (reads a host-mapped word; no sync). */
int weft_ar_check_error(weft_ar *ar);
int weft_ar_abort(weft_ar *ar);            /* in-flight kernels return; handle unusable */
int weft_ar_set_timeout(weft_ar *ar, int timeout_ms);  /* for calls launched later */
/* The kernel a call would use (WEFT_AR_ONESHOT / _TWOSHOT / _ONESHOT_FLAG,
 * or the quick kind asked), after the same validation as run (less the
 * buffers'); why (may be NULL): a short static reason. The one place "auto"
 * becomes a kernel: by size and what fits the workspace. Passing the kind it
 * returns back to run or resolve gives the same kind. */
int weft_ar_resolve(weft_ar *ar, size_t count, int dtype, int algo, int *kind, const char **why);
int weft_ar_info(weft_ar *ar, int *rank, int *world, size_t *max_bytes, size_t *lamport_bytes,
                 size_t *oneshot_max);
/* Launch-shape and policy knobs for experiments and tuning (bench/ar_bench
 * --sweep), for calls launched later; every rank must set the same values.
 * "grid" blocks, "threads" per block (Lamport <= 256, flag one-shot <= 512),
 * 0 = chosen by size; "sub": flag one-shot round = threads x 2 x sub 16-byte
 * vectors; "split" 1: flag one-shot with separate pusher and reducer blocks;
 * "blocks_per_sm"; "oneshot_max": auto uses Lamport up to these bytes;
 * "twoshot_min": auto, 2 ranks, above oneshot_max: flag one-shot below this
 * size, two-shot from it. Unknown name or value out of range: WEFT_EINVAL. */
int weft_ar_set_param(weft_ar *ar, const char *name, int64_t value);
/* The grid and block size a call would launch with (after run's validation). */
int weft_ar_shape(weft_ar *ar, size_t count, int dtype, int algo, int *grid, int *threads);

/* ---- quick all-reduce codec (docs/quick-allreduce.md) ----
 * codec: WEFT_QR_FP (none), _INT8, _INT4, _FP8 (e4m3), one f32 scale per 32
 * elements. reference: the whole quick all-reduce of `world` host arrays of
 * count bf16/f16 elements (inputs[r] = rank r's), computed on the CPU with the
 * kernel's exact operations: the kernel's output must equal it bit for bit
 * (NaNs aside). codec_step: the kernel's codec alone on one GPU (benchmarks,
 * checks): step 0 quantizes in (count elements) into wire; step 1 reads
 * `world` wires of weft_qr_wire_bytes each, back to back at in, sums them in
 * rank order, quantizes the sum once into wire and writes it decoded to out;
 * steps 2 and 3: their probes, the same loads and stores without the codec's
 * work (wire and out hold no meaning; scripts/bench-quick-codec.lua).
 * Asynchronous on stream (NULL: the current one); 16-byte aligned buffers. */
enum { WEFT_QR_FP = 0, WEFT_QR_INT8 = 1, WEFT_QR_INT4 = 2, WEFT_QR_FP8 = 3 };
int weft_qr_reference(int codec, int dtype, int world, const void *const *inputs, void *out, size_t count);
int weft_qr_wire_bytes(int codec, size_t count, size_t *bytes);
/* The fused quick two-shot (weft_fusion_params.quick) on the CPU: inputs[r]
 * rank r's [tokens][hidden], blocks of 32 from each row's start; writes
 * residual_out (the kernel's bits) and, when norm_out is not NULL, the norm
 * of residual_out in f64 rounded to dtype (the kernel's norm differs from it by
 * its f32 roundings only; its bits are weft_cuda_rmsnorm's of residual_out).
 * gemma: weight + 1. sum_out (optional): the all-reduced value (dtype). */
int weft_qr_fused_reference(int codec, int dtype, int world, const void *const *inputs, const void *residual,
                            const void *weight, float eps, int gemma, int64_t tokens, int64_t hidden,
                            void *sum_out, void *residual_out, void *norm_out);
int weft_qr_codec_step(int step, int codec, int dtype, int world, const void *in, void *wire, void *out,
                       size_t count, void *stream);

/* ---- fusion: all-reduce + residual add + RMSNorm (+ FP8 quant) in one kernel
 *      (src/coll/fusion.c, kernels/fused_norm.cu) ----
 * A workspace per group (one VMM allocation per rank, mapped by every peer),
 * created collectively for calls of up to max_tokens x hidden of dtype (or a
 * narrower dtype). Patterns: AR (out = sum over ranks), AR_RMSNORM
 * (residual_out = sum + residual, rounded; norm_out = rmsnorm(residual_out) *
 * w), AR_RMSNORM_FP8 (the same, plus quant_out = e4m3 satfinite of norm /
 * *scale; norm_out optional). w = weight, or 1 + weight with FUSION_GEMMA.
 * Algorithms: ONESHOT (Lamport push, streaming; latency) and TWOSHOT (token
 * ranges, reduce-scatter + all-gather with the norm fused; bandwidth); AUTO
 * picks one-shot up to WEFT_FUSION_ONESHOT_MAX bytes (default by world
 * size). Both give bit-identical results on every rank and with each other.
 * In-place is allowed (out == input, residual_out == residual, norm_out ==
 * input); other overlaps are refused. run validates everything before it
 * launches (a refused call changes nothing), is asynchronous on stream (NULL:
 * the thread's current stream) and CUDA-graph safe (epochs in device memory);
 * every rank must make the same calls in the same order. A peer that does
 * not arrive within the timeout, or an abort, makes the kernel return;
 * check_error then reports WEFT_ETIMEOUT / WEFT_EABORT naming the group and
 * the late peer, and the workspace is unusable (destroy, recreate).
 * FUSION_PDL launches with programmatic dependent launch (the kernel starts
 * with griddepcontrol.wait); FUSION_TRIGGER_AT_END then lets dependents
 * launch only after the kernel's last store, else right after its pushes.
 * Environment: WEFT_FUSION_TIMEOUT_MS, WEFT_FUSION_ONESHOT_MAX. */
typedef struct weft_fusion weft_fusion;
enum { WEFT_FUSION_AR = 0, WEFT_FUSION_AR_RMSNORM = 1, WEFT_FUSION_AR_RMSNORM_FP8 = 2 };
enum { WEFT_FUSION_AUTO = 0, WEFT_FUSION_ONESHOT = 1, WEFT_FUSION_TWOSHOT = 2 };
enum {
  WEFT_FUSION_GEMMA = 1, WEFT_FUSION_FP32_ACC = 2, WEFT_FUSION_PDL = 4,
  WEFT_FUSION_TRIGGER_AT_END = 8,
  WEFT_FUSION_DETERMINISTIC = 16 /* residual_out = round(round(sum) + residual): as all-reduce then
                                    weft_cuda_rmsnorm(WEFT_RMSNORM_DETERMINISTIC), bit for bit;
                                    needs FP32_ACC */
};
typedef struct weft_fusion_opts {
  int64_t max_tokens;          /* most tokens of one call */
  int64_t hidden;              /* largest hidden size: multiple of 8, <= 16384 */
  int dtype;                   /* widest dtype of the calls: f32, f16, bf16 */
  int timeout_ms;              /* kernel wait bound; <= 0: env, else the group's */
  int64_t oneshot_max_tokens;  /* one-shot (Lamport) capacity; 0: max_tokens; < 0: none */
} weft_fusion_opts;
typedef struct weft_fusion_params {
  int pattern;                 /* WEFT_FUSION_AR, _AR_RMSNORM, _AR_RMSNORM_FP8 */
  int algo;                    /* WEFT_FUSION_AUTO, _ONESHOT, _TWOSHOT */
  int flags;                   /* WEFT_FUSION_GEMMA | _FP32_ACC | _PDL | _TRIGGER_AT_END | _DETERMINISTIC */
  int dtype;                   /* of input, residual, weight and the outputs */
  int64_t tokens, hidden;      /* tokens 0: nothing to do */
  const void *input;           /* [tokens][hidden] this rank's partial sums */
  const void *residual;        /* [tokens][hidden] (RMSNORM patterns) */
  const void *weight;          /* [hidden] (RMSNORM patterns) */
  void *out;                   /* AR: [tokens][hidden] */
  void *residual_out;          /* RMSNORM patterns */
  void *norm_out;              /* AR_RMSNORM; optional with FP8 */
  void *quant_out;             /* FP8: [tokens][hidden] e4m3 */
  const float *scale;          /* FP8: device pointer to the dequantisation scale */
  float eps;
  void *stream;
  int quick;                   /* 0: exact; WEFT_QR_INT8, _INT4, _FP8: the quick two-shot
                                  (kernels/quick_fused.cu, docs/quick-allreduce.md): AR_RMSNORM,
                                  bf16/f16, worlds 2/4/6/8; the sum travels in that codec (32-element
                                  blocks from each row's start), residual_out = round(round(decoded
                                  sum) + residual): weft_qr_fused_reference's bits */
} weft_fusion_params;
typedef struct weft_fusion_info {
  int rank, world, dtype;
  int64_t max_tokens, hidden, oneshot_max_tokens;
  int64_t oneshot_max_bytes;   /* AUTO's one-shot limit */
  size_t workspace_bytes;      /* per rank */
} weft_fusion_info;
int weft_fusion_create(weft_cpugroup *g, const weft_fusion_opts *opts, weft_fusion **out);
int weft_fusion_destroy(weft_fusion *f);
int weft_fusion_run(weft_fusion *f, const weft_fusion_params *p);
/* Same validation as run; *algo: the kernel run would use; *why: static text. */
int weft_fusion_resolve(weft_fusion *f, const weft_fusion_params *p, int *algo, const char **why);
/* *ok = 1 when calls of this size fit (algo AUTO: either kernel); no error recorded. */
int weft_fusion_sufficient(weft_fusion *f, int64_t tokens, int64_t hidden, int dtype, int algo,
                           int *ok);
int weft_fusion_get_info(weft_fusion *f, weft_fusion_info *info);
int weft_fusion_check_error(weft_fusion *f); /* 0 or the first kernel failure; no sync */
int weft_fusion_abort(weft_fusion *f);       /* waiting kernels return; workspace unusable */
/* Local, no collective: bytes a workspace would take per rank, and whether
 * this device has that much free (the manager votes on it before create). */
int weft_fusion_workspace_bytes(const weft_fusion_opts *opts, int world, size_t *bytes);
int weft_fusion_preflight(const weft_fusion_opts *opts, int world, int *ok);

/* ---- more fusion patterns (src/coll/fusion_ext.c, kernels/fused_ext.cu;
 *      local pieces: src/host/moe_host.c, kernels/moe_reduce.cu) ----
 * FlashInfer's AllReduceFusionOp patterns beyond AR + residual + RMSNorm:
 *   MOE_AR_RMSNORM          x_t = shared_t + sum_k scales[k][t] * input[k][t]
 *                           (input [top_k][tokens][hidden], scales [top_k][tokens]),
 *                           then all-reduce + residual + RMSNorm;
 *   MOE_FINALIZE_AR_RMSNORM x_t = shared_t + sum_k scales[t][k] * input[perm[t][k]]
 *                           (input [expert_rows][hidden] in permuted order,
 *                           perm and scales [tokens][top_k]), then the same;
 *   AR_PREPOST_RMSNORM      residual_out = rmsnorm(sum x) * weight_pre + residual,
 *                           norm_out = rmsnorm(residual_out) * weight;
 *   RS_RMSNORM              reduce-scatter by tokens (tokens % world == 0): this
 *                           rank's slice s = [rank * T/W, (rank+1) * T/W):
 *                           residual_out = (sum x)[s] + residual, norm_out =
 *                           rmsnorm(residual_out) * weight ([T/W][hidden] each),
 *                           gathered_out (optional, [T][hidden]) = all-gather of norm_out.
 * f32 accumulation everywhere; a rank's MoE partial x_t is rounded to the dtype
 * once (as the unfused path stores it); ranks summed in rank order; the norms'
 * sums of squares in one order fixed by hidden alone, so every rank and both
 * algorithms give bit-identical outputs. Scales are f32, or the input dtype
 * with FX_SCALES_DTYPE. A permutation entry outside [0, expert_rows) makes its
 * token's rows NaN (device data cannot be checked before the launch).
 * dtypes bf16, f16; hidden a multiple of 8, <= 16384; top_k 1..16. Same
 * workspace rules, waits, errors and graph safety as weft_fusion; one-shot
 * (every rank reduces every row) and two-shot (token ranges); RS_RMSNORM is
 * one algorithm of its own (TWOSHOT; ONESHOT refused). */
typedef struct weft_fusion_ext weft_fusion_ext;
enum {
  WEFT_FX_MOE_AR_RMSNORM = 1, WEFT_FX_MOE_FINALIZE_AR_RMSNORM = 2,
  WEFT_FX_AR_PREPOST_RMSNORM = 3, WEFT_FX_RS_RMSNORM = 4
};
enum { WEFT_FX_GEMMA = 1, WEFT_FX_PDL = 4, WEFT_FX_SCALES_DTYPE = 32 };
typedef struct weft_fusion_ext_params {
  int pattern;                 /* WEFT_FX_* */
  int algo;                    /* WEFT_FUSION_AUTO, _ONESHOT, _TWOSHOT */
  int flags;                   /* WEFT_FX_GEMMA | _PDL | _SCALES_DTYPE */
  int dtype;                   /* bf16 or f16: input, shared, residual, weights, outputs */
  int64_t tokens, hidden;      /* tokens of the whole batch (RS: before the scatter); 0: nothing */
  int32_t top_k;               /* MoE patterns: 1..16 */
  int64_t expert_rows;         /* FINALIZE: rows of input */
  const void *input;           /* see the patterns above */
  const void *scales;          /* MoE patterns */
  const int32_t *permutation;  /* FINALIZE: [tokens][top_k] row of input */
  const void *shared_output;   /* MoE patterns, optional: [tokens][hidden] */
  const void *residual;        /* [tokens][hidden] (RS: [tokens / world][hidden]) */
  const void *weight;          /* [hidden]: the norm (PREPOST: the one after the add) */
  const void *weight_pre;      /* PREPOST: [hidden], the norm before the add */
  void *residual_out;          /* like residual */
  void *norm_out;              /* like residual */
  void *gathered_out;          /* RS, optional: [tokens][hidden] */
  float eps, eps_pre;          /* eps_pre: PREPOST's first norm */
  void *stream;
} weft_fusion_ext_params;
int weft_fusion_ext_create(weft_cpugroup *g, const weft_fusion_opts *opts, weft_fusion_ext **out);
int weft_fusion_ext_destroy(weft_fusion_ext *f);
int weft_fusion_ext_run(weft_fusion_ext *f, const weft_fusion_ext_params *p);
/* Same validation as run; *algo: the kernel run would use; *why: static text. */
int weft_fusion_ext_resolve(weft_fusion_ext *f, const weft_fusion_ext_params *p, int *algo,
                            const char **why);
int weft_fusion_ext_sufficient(weft_fusion_ext *f, int64_t tokens, int64_t hidden, int dtype,
                               int algo, int *ok);
int weft_fusion_ext_check_error(weft_fusion_ext *f);
int weft_fusion_ext_abort(weft_fusion_ext *f);
int weft_fusion_ext_workspace_bytes(const weft_fusion_opts *opts, int world, size_t *bytes);
int weft_fusion_ext_preflight(const weft_fusion_opts *opts, int world, int *ok);

/* The local MoE reduction (one rank, no communication), f32 accumulation in
 * k order after the shared output, rounded once to dtype:
 *   out_t = round(shared_t + sum_k scale(t, k) * expert(t, k))
 * perm == NULL: expert(t, k) = input[k][t], scale(t, k) = scales[k][t] (MOE layout);
 * else expert(t, k) = input[perm[t][k]], scale(t, k) = scales[t][k] (FINALIZE layout).
 * scales_dtype: WEFT_F32 or dtype. shared may be NULL. dtype f32, f16, bf16.
 * Host: a permutation entry outside [0, expert_rows) is refused (EINVAL, nothing
 * written); device: that token's row is NaN. */
int weft_host_moe_reduce(const void *input, const void *scales, int scales_dtype,
                         const int32_t *perm, int64_t expert_rows, const void *shared, void *out,
                         int64_t tokens, int64_t hidden, int top_k, int dtype);
/* Device twin of weft_host_moe_reduce; with weight != NULL also the single-rank
 * fused end of an MoE layer in one kernel: residual_out = round(out + residual),
 * norm_out = rmsnorm(residual_out) * w (out may then be NULL: not stored).
 * flags: WEFT_RMSNORM_GEMMA. hidden * esize % 16 == 0. Async on stream. */
int weft_cuda_moe_reduce(const void *input, const void *scales, int scales_dtype,
                         const int32_t *perm, int64_t expert_rows, const void *shared, void *out,
                         const void *residual, const void *weight, void *residual_out,
                         void *norm_out, int64_t tokens, int64_t hidden, int top_k, int dtype,
                         float eps, int flags, void *stream);

/* ---- mq: message-queue broadcaster, one writer to the node's other ranks
 *      (src/host/mq.c) ----
 * A shared-memory ring of `chunks` slots of `chunk_bytes` (0: defaults
 * WEFT_MQ_CHUNK_BYTES = 1 MiB, WEFT_MQ_CHUNKS = 8). create is collective over
 * g (every rank passes the same writer index and sizes; all ranks on one
 * node); the segment is unlinked once every rank mapped it. Messages larger
 * than a slot are split across consecutive slots and reassembled. The writer
 * waits for a free slot (every reader done with it), readers for the next
 * slot; waits spin briefly (WEFT_MQ_SPIN_US), then sleep on a futex, bounded
 * by the group's timeout (set_timeout changes it); errors name the group and
 * the ranks that did not read / the writer that did not write. A peer that
 * died or destroyed its queue while awaited aborts the queue on every rank
 * (WEFT_EABORT afterwards, naming who gave up and why).
 * dequeue: timeout_ms < 0 the queue's timeout, 0 poll (WEFT_EAGAIN); *out
 * stays valid until the next call on the handle (a one-slot message is lent
 * in place: release hands its slot back early). try_dequeue never waits: it
 * takes what fragments are there and keeps a split message's progress.
 * One call in flight per handle; destroy is local. */
typedef struct weft_mq weft_mq;
int weft_mq_create(weft_cpugroup *g, int writer, size_t chunk_bytes, int chunks, weft_mq **out);
int weft_mq_destroy(weft_mq *mq);
int weft_mq_enqueue(weft_mq *mq, const void *buf, size_t len);        /* writer */
int weft_mq_dequeue(weft_mq *mq, int timeout_ms, const void **out, size_t *len);
int weft_mq_try_dequeue(weft_mq *mq, const void **out, size_t *len);  /* WEFT_EAGAIN: none yet */
int weft_mq_release(weft_mq *mq);         /* reader: hand back the lent slot now */
int weft_mq_set_timeout(weft_mq *mq, int timeout_ms);
int weft_mq_info(weft_mq *mq, int *writer, int *index, int *world, size_t *chunk_bytes,
                 int *chunks);

/* ---- async: non-blocking collectives through a progress worker (src/async.c) ----
 * A queue belongs to one group (its communicators); its worker thread is
 * created on the first submit (never at load time, with every signal
 * blocked) and runs the submitted operations in order, one at a time, by
 * calling the functions above: ranks that submit the same sequence meet in
 * the same order. Each operation is bounded by its communicator's own timeout.
 * Buffers (in/out) must stay valid until the operation is done; the queue
 * copies key strings and results (broadcast, allgather, recv, dequeue, get).
 * test never blocks: 0 done, WEFT_EAGAIN not yet, or the operation's error,
 * whose message (captured on the worker) is copied into the caller's
 * weft_last_error(). wait blocks on a timed condvar (timeout_ms < 0: until
 * done; the operation is bounded anyway) and gives WEFT_ETIMEOUT when it is
 * still running. A queue made before fork() refuses submits in the child.
 * Use a communicator either through its queue or directly, never both at
 * once (the Lua layer drains a group's queue before a blocking call). */
typedef struct weft_async_queue weft_async_queue;
typedef struct weft_async weft_async;
enum {
  WEFT_ASYNC_NOP = 0,                /* nothing (measures the queue's own cost) */
  WEFT_ASYNC_SLEEP = 1,              /* count = milliseconds (tests: a slow step) */
  WEFT_ASYNC_SHM_ALL_REDUCE = 10,    /* comm weft_shm: in, out, count, dtype, op */
  WEFT_ASYNC_SHM_ALL_GATHER = 11,    /* in, out, count = bytes per rank */
  WEFT_ASYNC_SHM_REDUCE_SCATTER = 12,/* in, out, count = count_out, dtype, op */
  WEFT_ASYNC_SHM_BROADCAST = 13,     /* out = buffer, count = bytes, root */
  WEFT_ASYNC_SHM_BARRIER = 14,       /* comm weft_shm */
  WEFT_ASYNC_CPU_BARRIER = 20,       /* comm weft_cpugroup */
  WEFT_ASYNC_CPU_BROADCAST = 21,     /* root: in/count bytes; result: root's bytes */
  WEFT_ASYNC_CPU_ALLGATHER = 22,     /* in/count bytes; result: concatenation + lens */
  WEFT_ASYNC_CPU_ALLREDUCE_I64 = 23, /* out = int64_t[count], in place; op */
  WEFT_ASYNC_CPU_SEND = 24,          /* in/count bytes to index root */
  WEFT_ASYNC_CPU_RECV = 25,          /* from index root; result: bytes */
  WEFT_ASYNC_NCCL_ALL_REDUCE = 30,   /* comm weft_nccl, then synchronize(stream) */
  WEFT_ASYNC_NCCL_ALL_GATHER = 31,   /* count per rank */
  WEFT_ASYNC_NCCL_REDUCE_SCATTER = 32,
  WEFT_ASYNC_NCCL_BROADCAST = 33,    /* in -> out, count, root */
  WEFT_ASYNC_NCCL_SYNC = 34,         /* synchronize(stream) only */
  WEFT_ASYNC_MQ_ENQUEUE = 40,        /* comm weft_mq: in/count bytes (writer) */
  WEFT_ASYNC_MQ_DEQUEUE = 41,        /* timeout_ms; result: the message (reader) */
  WEFT_ASYNC_STORE_GET = 50          /* comm weft_store: key, timeout_ms; result: value */
};
typedef struct weft_async_desc {
  int kind;                /* WEFT_ASYNC_* */
  void *comm;              /* the handle the kind names */
  const void *in;
  void *out;
  size_t count;            /* elements, bytes or ms, as the kind says */
  int dtype, op, root;
  int timeout_ms;          /* MQ_DEQUEUE, STORE_GET: < 0 the handle's own */
  int device;              /* NCCL kinds: set this device first; < 0 leave */
  void *stream;            /* NCCL kinds: cudaStream_t (NULL: the worker's legacy stream) */
  const char *key;         /* STORE_GET (copied) */
  uint64_t shape, args;    /* SHM kinds: the call's shape and args words (weft_shm_set_call) */
  void *announce;          /* CPU_ALLGATHER: a weft_shm whose barrier, marked with args, it
                              passes first (an object collective on a group whose host
                              collectives run there), NULL: none */
} weft_async_desc;
typedef struct weft_async_stats {
  int64_t submitted, completed, failed;
  int pending;             /* queued or running */
  int started;             /* the worker thread exists */
} weft_async_stats;
int weft_async_queue_create(const char *name, weft_async_queue **out);
/* Fails what is still queued (WEFT_ESTATE), waits for the running operation
 * (bounded by its own timeout), joins the worker. Handles stay valid. */
int weft_async_queue_destroy(weft_async_queue *q);
int weft_async_queue_stats(weft_async_queue *q, weft_async_stats *out);
int weft_async_submit(weft_async_queue *q, const weft_async_desc *d, weft_async **out);
int weft_async_test(weft_async *h);
int weft_async_wait(weft_async *h, int timeout_ms);
/* After success: the result bytes (NULL/0 if the kind has none) and, for
 * CPU_ALLGATHER, *nlens per-rank lengths; valid until release. */
int weft_async_result(weft_async *h, const void **data, size_t *len, const size_t **lens,
                      int *nlens);
/* Queued/run/end times (ns, CLOCK_MONOTONIC; 0 when not reached). */
int weft_async_times(weft_async *h, int64_t *submit_ns, int64_t *start_ns, int64_t *end_ns);
int weft_async_release(weft_async *h);   /* the caller's reference; NULL: no-op */

/* ---- integration: strided device copy for the group layer (src/cuda/copy2d.c) ----
 * cudaMemcpy2DAsync (cudaMemcpyDefault): `height` rows of `width` bytes from
 * src (rows `spitch` apart) to dst (rows `dpitch` apart), async on stream
 * (NULL: the thread's current stream); capturable. The dim permutes of
 * all_gather / reduce_scatter / gather along an inner dim take one call per
 * rank instead of one copy per row. */
int weft_cuda_memcpy2d_async(void *dst, size_t dpitch, const void *src, size_t spitch,
                             size_t width, size_t height, void *stream);

/* ===== FFI END ===== */

/* The FFI region above as one string (embedded at build time), so the Lua
 * side declares exactly what this library was built with. */
const char *weft_ffi_cdef(void);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif
#endif /* WEFT_H */
