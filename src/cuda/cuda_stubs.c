/* cuda_stubs.c — the device API of a build without CUDA (no nvcc): every call
 * reports "no CUDA device", except the device count, which is 0 and ok. */
#include "cuda_internal.h"

#if !WEFT_HAVE_CUDA

static int nodev(void) {
  return wf_error(WEFT_ENODEV, "no CUDA device (weft built without CUDA)");
}

int wf_cuda_init(void) { return nodev(); }
int wf_cuda_device(int *dev) { (void)dev; return nodev(); }
int wf_cuda_timeout_ms(void) { return 300000; }

int weft_cuda_device_count(int *n) {
  WF_CHECK_ARG(n, "cuda device_count: NULL out-parameter");
  *n = 0;
  return 0;
}
int weft_cuda_set_device(int dev) { (void)dev; return nodev(); }
int weft_cuda_get_device(int *dev) { (void)dev; return nodev(); }
int weft_cuda_device_name(int dev, char *buf, size_t len) { (void)dev; (void)buf; (void)len; return nodev(); }
int weft_cuda_synchronize(void) { return nodev(); }
int weft_cuda_pointer_device(const void *p, int *dev) { (void)p; (void)dev; return nodev(); }
int weft_cuda_malloc(void **p, size_t bytes, int dev) {
  if (p) *p = NULL;
  (void)bytes; (void)dev;
  return nodev();
}
int weft_cuda_free(void *p) { return p ? nodev() : 0; }
int weft_cuda_pool_stats_get(int dev, weft_cuda_pool_stats *out) { (void)dev; (void)out; return nodev(); }
int weft_cuda_pool_trim(int dev) { (void)dev; return nodev(); }
int weft_cuda_memcpy(void *dst, const void *src, size_t bytes) { (void)dst; (void)src; (void)bytes; return nodev(); }
int weft_cuda_memcpy_async(void *dst, const void *src, size_t bytes, void *stream) {
  (void)dst; (void)src; (void)bytes; (void)stream;
  return nodev();
}
int weft_cuda_memset(void *p, int value, size_t bytes, void *stream) {
  (void)p; (void)value; (void)bytes; (void)stream;
  return nodev();
}
int weft_cuda_fill_random(void *p, size_t count, int dtype, uint64_t seed, int dist, void *stream) {
  (void)p; (void)count; (void)dtype; (void)seed; (void)dist; (void)stream;
  return nodev();
}
int weft_cuda_nan_mask(const void *x, uint8_t *mask, size_t count, int dtype, void *stream) {
  (void)x; (void)mask; (void)count; (void)dtype; (void)stream;
  return nodev();
}
int weft_cuda_nan_fixup(void *x, const uint8_t *mask, size_t count, int dtype, void *stream) {
  (void)x; (void)mask; (void)count; (void)dtype; (void)stream;
  return nodev();
}
int weft_cuda_stream_create(int nonblocking, void **out) {
  (void)nonblocking;
  if (out) *out = NULL;
  return nodev();
}
int weft_cuda_stream_destroy(void *stream) { return stream ? nodev() : 0; }
int weft_cuda_stream_synchronize(void *stream) { (void)stream; return nodev(); }
int weft_cuda_stream_wait_stream(void *stream, void *other) { (void)stream; (void)other; return nodev(); }
int weft_cuda_stream_set_current(void *stream) { (void)stream; return nodev(); }
int weft_cuda_stream_get_current(void **stream) { (void)stream; return nodev(); }
int weft_cuda_event_create(int timing, void **out) {
  (void)timing;
  if (out) *out = NULL;
  return nodev();
}
int weft_cuda_event_destroy(void *event) { return event ? nodev() : 0; }
int weft_cuda_event_record(void *event, void *stream) { (void)event; (void)stream; return nodev(); }
int weft_cuda_event_synchronize(void *event) { (void)event; return nodev(); }
int weft_cuda_event_elapsed(void *start, void *end, float *ms) { (void)start; (void)end; (void)ms; return nodev(); }
int weft_cuda_stream_wait_event(void *stream, void *event) { (void)stream; (void)event; return nodev(); }
int weft_cuda_graph_begin(void *stream) { (void)stream; return nodev(); }
int weft_cuda_graph_end(void *stream, weft_cuda_graph **out) {
  (void)stream;
  if (out) *out = NULL;
  return nodev();
}
int weft_cuda_graph_launch(weft_cuda_graph *g, void *stream) { (void)g; (void)stream; return nodev(); }
int weft_cuda_graph_destroy(weft_cuda_graph *g) { return g ? nodev() : 0; }
int weft_cuda_stream_capturing(void *stream, int *capturing) {
  (void)stream;
  if (capturing) *capturing = 0;
  return nodev();
}
int weft_cuda_rmsnorm(const void *x, const void *residual, const void *weight, void *out,
                      void *residual_out, int64_t tokens, int64_t hidden, int dtype, float eps,
                      int flags, void *stream) {
  (void)x; (void)residual; (void)weight; (void)out; (void)residual_out; (void)tokens;
  (void)hidden; (void)dtype; (void)eps; (void)flags; (void)stream;
  return nodev();
}

int weft_cuda_moe_reduce(const void *input, const void *scales, int scales_dtype,
                         const int32_t *perm, int64_t expert_rows, const void *shared, void *out,
                         const void *residual, const void *weight, void *residual_out,
                         void *norm_out, int64_t tokens, int64_t hidden, int top_k, int dtype,
                         float eps, int flags, void *stream) {
  (void)input; (void)scales; (void)scales_dtype; (void)perm; (void)expert_rows; (void)shared;
  (void)out; (void)residual; (void)weight; (void)residual_out; (void)norm_out; (void)tokens;
  (void)hidden; (void)top_k; (void)dtype; (void)eps; (void)flags; (void)stream;
  return nodev();
}

int weft_nccl_version(int *version) {
  if (version) *version = 0;
  return nodev();
}
int weft_nccl_create(weft_cpugroup *g, int blocking, weft_nccl **out) {
  (void)g; (void)blocking;
  if (out) *out = NULL;
  return nodev();
}
int weft_nccl_set_timeout(weft_nccl *c, int timeout_ms) { (void)c; (void)timeout_ms; return nodev(); }
int weft_nccl_destroy(weft_nccl *c) { return c ? nodev() : 0; }
int weft_nccl_abort(weft_nccl *c) { return c ? nodev() : 0; }
int weft_nccl_info(weft_nccl *c, int *rank, int *size, int *device) {
  (void)c; (void)rank; (void)size; (void)device;
  return nodev();
}
int weft_nccl_blocking(weft_nccl *c, int *blocking) {
  (void)c;
  if (blocking) *blocking = 0;
  return nodev();
}
int weft_nccl_synchronize(weft_nccl *c, void *stream) { (void)c; (void)stream; return nodev(); }
int weft_nccl_all_reduce(weft_nccl *c, const void *in, void *out, size_t count, int dtype, int op,
                         void *stream) {
  (void)c; (void)in; (void)out; (void)count; (void)dtype; (void)op; (void)stream;
  return nodev();
}
int weft_nccl_all_gather(weft_nccl *c, const void *in, void *out, size_t count, int dtype,
                         void *stream) {
  (void)c; (void)in; (void)out; (void)count; (void)dtype; (void)stream;
  return nodev();
}
int weft_nccl_all_gatherv(weft_nccl *c, const void *in, void *out, const size_t *counts,
                          int dtype, void *stream) {
  (void)c; (void)in; (void)out; (void)counts; (void)dtype; (void)stream;
  return nodev();
}
int weft_nccl_reduce_scatter(weft_nccl *c, const void *in, void *out, size_t count_out,
                             int dtype, int op, void *stream) {
  (void)c; (void)in; (void)out; (void)count_out; (void)dtype; (void)op; (void)stream;
  return nodev();
}
int weft_nccl_reduce_scatterv(weft_nccl *c, const void *in, void *out, const size_t *counts,
                              int dtype, int op, void *stream) {
  (void)c; (void)in; (void)out; (void)counts; (void)dtype; (void)op; (void)stream;
  return nodev();
}
int weft_nccl_broadcast(weft_nccl *c, const void *in, void *out, size_t count, int dtype,
                        int root, void *stream) {
  (void)c; (void)in; (void)out; (void)count; (void)dtype; (void)root; (void)stream;
  return nodev();
}
int weft_nccl_gather(weft_nccl *c, const void *in, void *out, size_t count, int dtype, int root,
                     void *stream) {
  (void)c; (void)in; (void)out; (void)count; (void)dtype; (void)root; (void)stream;
  return nodev();
}
int weft_nccl_send(weft_nccl *c, const void *buf, size_t count, int dtype, int peer,
                   void *stream) {
  (void)c; (void)buf; (void)count; (void)dtype; (void)peer; (void)stream;
  return nodev();
}
int weft_nccl_recv(weft_nccl *c, void *buf, size_t count, int dtype, int peer, void *stream) {
  (void)c; (void)buf; (void)count; (void)dtype; (void)peer; (void)stream;
  return nodev();
}
int weft_nccl_all_to_all(weft_nccl *c, const void *in, void *out, size_t count,
                         const size_t *send_counts, const size_t *recv_counts, int dtype,
                         void *stream) {
  (void)c; (void)in; (void)out; (void)count; (void)send_counts; (void)recv_counts; (void)dtype;
  (void)stream;
  return nodev();
}
int weft_nccl_group_start(void) { return nodev(); }
int weft_nccl_group_end(void) { return nodev(); }

#endif /* !WEFT_HAVE_CUDA */
