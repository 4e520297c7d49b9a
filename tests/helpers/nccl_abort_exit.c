/* Does a process whose NCCL communicator was ended by ncclCommAbort die at
 * exit, with NCCL alone (no weft)? One rank, one GPU.
 *   nccl_abort_exit <abort|destroy|finalize_abort|revoke> <blocking 0|1> <ops> [exit|_exit|return]
 * libnccl.so.2 is dlopen'ed RTLD_LOCAL, as weft does. scripts/gpu-nccl-exit
 * builds and runs it: cc -O1 -g -I/usr/local/cuda/include -o nae
 * tests/helpers/nccl_abort_exit.c -L/usr/local/cuda/lib64 -lcudart -ldl */
#define _GNU_SOURCE
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define F(name) static __typeof__(&name) p_##name
F(ncclGetUniqueId); F(ncclCommInitRankConfig); F(ncclAllReduce); F(ncclCommAbort);
F(ncclCommDestroy); F(ncclCommFinalize); F(ncclCommGetAsyncError);
/* not in every nccl.h (2.28.3 has none): looked up, NULL where absent */
static ncclResult_t (*p_ncclCommRevoke)(ncclComm_t, int);

static void wait_ready(ncclComm_t c) {
  ncclResult_t r;
  do { p_ncclCommGetAsyncError(c, &r); } while (r == ncclInProgress);
  if (r != ncclSuccess) { fprintf(stderr, "async error %d\n", r); exit(3); }
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "abort";
  int blocking = argc > 2 ? atoi(argv[2]) : 0, ops = argc > 3 ? atoi(argv[3]) : 64;
  const char *how = argc > 4 ? argv[4] : "return";
  void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (!h) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 2; }
#define S(name) p_##name = (__typeof__(p_##name))dlsym(h, #name)
  S(ncclGetUniqueId); S(ncclCommInitRankConfig); S(ncclAllReduce); S(ncclCommAbort);
  S(ncclCommDestroy); S(ncclCommFinalize); S(ncclCommGetAsyncError); S(ncclCommRevoke);
  cudaSetDevice(0);
  ncclUniqueId id;
  p_ncclGetUniqueId(&id);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = blocking;
  ncclComm_t c;
  ncclResult_t r = p_ncclCommInitRankConfig(&c, 1, id, 0, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) { fprintf(stderr, "init %d\n", r); return 2; }
  wait_ready(c);
  float *x;
  cudaMalloc((void **)&x, 4 << 20);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  for (int i = 0; i < ops; i++) { p_ncclAllReduce(x, x, 1 << 20, ncclFloat, ncclSum, c, s); wait_ready(c); }
  if (!strcmp(mode, "abort")) p_ncclCommAbort(c);
  else if (!strcmp(mode, "destroy")) { p_ncclCommFinalize(c); wait_ready(c); p_ncclCommDestroy(c); }
  else if (!strcmp(mode, "revoke")) {
    if (!p_ncclCommRevoke) { fprintf(stderr, "nccl_abort_exit: no ncclCommRevoke in this NCCL\n"); return 4; }
    ncclResult_t rr = p_ncclCommRevoke(c, 0);
    fprintf(stderr, "revoke -> %d\n", rr);
    wait_ready(c);
    p_ncclCommDestroy(c);
  } else { p_ncclCommFinalize(c); wait_ready(c); p_ncclCommAbort(c); }
  fprintf(stderr, "nccl_abort_exit: %s blocking=%d ops=%d: ended, now %s\n", mode, blocking, ops, how);
  if (!strcmp(how, "_exit")) _exit(0);
  if (!strcmp(how, "exit")) exit(0);
  return 0;
}
