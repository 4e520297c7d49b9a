/* vmm.c — Driver-API workspaces shared by the ranks of one node.
 *
 * Every rank cuMemCreate's one allocation of the same size (rounded up to
 * the recommended granularity), exports it as a POSIX file descriptor (or a
 * FABRIC handle with WEFT_VMM_FABRIC), and hands the descriptor to every
 * peer over a Unix-domain socket with SCM_RIGHTS.  Each rank then maps all
 * n allocations into one reserved address range (rank i at i * size) and
 * grants its own device read/write access, so a kernel reaches peer i's
 * workspace at base + i * size.
 *
 * Sockets (src/cuda/vmm_fdx.c): one listener per rank in the abstract namespace, named
 * "weft-vmm-<32 random hex>" (16 bytes from getrandom, shared only through
 * the store), so nothing is left in the file system and the name cannot be
 * guessed.  Both ends check the other's SO_PEERCRED: same uid, and the pid
 * the peer announced through the cpu group; the sender also proves its
 * random nonce.  Every step is bounded by the group's timeout.
 *
 * Collective steps, in order (all ranks take all of them, so nobody is left
 * waiting when another fails):
 *   1. all-gather {local probe ok, size, granularity, pid, uid, nonce}
 *      (probe: CUDA up, granularity known, listener bound);
 *   2. local cuMemCreate + export + reserve + map of the own allocation,
 *      then the preflight vote (cpu group all-reduce AND): all proceed or
 *      all fail together and the caller falls back to NCCL;
 *   3. descriptor exchange, import, map, set access; a second AND vote.
 * Destroy is local (never collective): unmap, release the handles, free the
 * address range; descriptors are closed as soon as they are imported.
 * Peers' imported handles keep an allocation's memory alive until they
 * release it, so destroying one rank never pulls memory from under another.
 * Never creates a multicast object. */
#include "cuda_internal.h"
#include "host/cpugroup.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int64_t g_live, g_live_bytes, g_created;

int weft_vmm_stats(int64_t *live, int64_t *live_bytes, int64_t *created) {
  if (live) *live = __atomic_load_n(&g_live, __ATOMIC_RELAXED);
  if (live_bytes) *live_bytes = __atomic_load_n(&g_live_bytes, __ATOMIC_RELAXED);
  if (created) *created = __atomic_load_n(&g_created, __ATOMIC_RELAXED);
  return 0;
}

#if !WEFT_HAVE_CUDA

int weft_vmm_create(weft_cpugroup *g, size_t bytes, int flags, weft_vmm **out) {
  (void)g; (void)bytes; (void)flags;
  if (out) *out = NULL;
  return wf_error(WEFT_ENODEV, "vmm create: no CUDA device (weft built without CUDA)");
}
int weft_vmm_destroy(weft_vmm *w) { (void)w; return 0; }
int weft_vmm_ptr(weft_vmm *w, int peer, void **ptr) {
  (void)w; (void)peer;
  if (ptr) *ptr = NULL;
  return wf_error(WEFT_ENODEV, "vmm ptr: no CUDA device (weft built without CUDA)");
}
int weft_vmm_size(weft_vmm *w, size_t *bytes) {
  (void)w;
  if (bytes) *bytes = 0;
  return wf_error(WEFT_ENODEV, "vmm size: no CUDA device (weft built without CUDA)");
}

#else

#include "vmm_fdx.h"

#include <unistd.h>

struct weft_vmm {
  int n, me, dev, fabric;
  size_t size;                       /* per rank */
  CUdeviceptr base;                  /* reservation of n * size, 0 if none */
  CUmemGenericAllocationHandle *h;   /* per rank, 0 if none */
  unsigned char *mapped;             /* per rank */
  char group[64];
};

/* What every rank announces in step 1. */
typedef struct vmm_hello {
  int32_t ok;
  uint32_t pad;
  uint64_t size, gran;
  wf_fdx_id id;   /* pid, uid, nonce of its descriptor listener */
} vmm_hello;

static void free_all(weft_vmm *w) {
  if (!w) return;
  for (int i = 0; i < w->n; i++) {
    if (w->mapped && w->mapped[i]) wf_cu.cuMemUnmap(w->base + (CUdeviceptr)i * w->size, w->size);
    if (w->h && w->h[i]) wf_cu.cuMemRelease(w->h[i]);
  }
  if (w->base) wf_cu.cuMemAddressFree(w->base, (size_t)w->n * w->size);
  free(w->h);
  free(w->mapped);
  free(w);
}

static int cu(CUresult r, const char *call) {
  return r == CUDA_SUCCESS ? 0 : wf_cu_err(__FILE__, __LINE__, call, r);
}

/* Step 2, local: create, export, reserve, map own. */
static int make_own(weft_vmm *w, const CUmemAllocationProp *prop, size_t gran, int *fd,
                    CUmemFabricHandle *fh) {
  int rc = cu(wf_cu.cuMemCreate(&w->h[w->me], w->size, prop, 0), "cuMemCreate");
  if (!rc) {
    if (w->fabric)
      rc = cu(wf_cu.cuMemExportToShareableHandle(fh, w->h[w->me], CU_MEM_HANDLE_TYPE_FABRIC, 0),
              "cuMemExportToShareableHandle(FABRIC)");
    else
      rc = cu(wf_cu.cuMemExportToShareableHandle(fd, w->h[w->me],
                                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
              "cuMemExportToShareableHandle(POSIX_FD)");
  }
  if (!rc) rc = cu(wf_cu.cuMemAddressReserve(&w->base, (size_t)w->n * w->size, gran, 0, 0),
                   "cuMemAddressReserve");
  if (!rc) {
    rc = cu(wf_cu.cuMemMap(w->base + (CUdeviceptr)w->me * w->size, w->size, 0, w->h[w->me], 0),
            "cuMemMap(own)");
    if (!rc) w->mapped[w->me] = 1;
  }
  return rc;
}

/* Step 3, local: import each peer's handle, map it, grant access to all. */
static int map_peers(weft_vmm *w, int *fds, const CUmemFabricHandle *fhs) {
  for (int r = 0; r < w->n; r++) {
    if (r == w->me) continue;
    int rc;
    if (w->fabric)
      rc = cu(wf_cu.cuMemImportFromShareableHandle(&w->h[r], (void *)&fhs[r], CU_MEM_HANDLE_TYPE_FABRIC),
              "cuMemImportFromShareableHandle(FABRIC)");
    else {
      rc = cu(wf_cu.cuMemImportFromShareableHandle(&w->h[r], (void *)(intptr_t)fds[r],
                                                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
              "cuMemImportFromShareableHandle(POSIX_FD)");
      close(fds[r]);
      fds[r] = -1;
    }
    if (rc) return wf_error_context(rc, "import of peer %d", r);
    rc = cu(wf_cu.cuMemMap(w->base + (CUdeviceptr)r * w->size, w->size, 0, w->h[r], 0), "cuMemMap(peer)");
    if (rc) return wf_error_context(rc, "map of peer %d", r);
    w->mapped[r] = 1;
  }
  CUmemAccessDesc d;
  memset(&d, 0, sizeof d);
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.location.id = w->dev;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return cu(wf_cu.cuMemSetAccess(w->base, (size_t)w->n * w->size, &d, 1),
            "cuMemSetAccess (peer access over NVLink/PCIe)");
}

/* Collective vote: returns 0 when every rank's ok is 1. */
static int vote(weft_cpugroup *g, int ok, int *all_ok) {
  int64_t v = ok ? 1 : 0;
  int rc = weft_cpugroup_allreduce_i64(g, &v, 1, WEFT_AND);
  *all_ok = rc == 0 && v == 1;
  return rc;
}

int weft_vmm_create(weft_cpugroup *g, size_t bytes, int flags, weft_vmm **out) {
  WF_CHECK_ARG(out, "vmm create: NULL out-parameter");
  *out = NULL;
  const char *gname = NULL;
  int n = 0, me = 0, tmo = 0;
  int rc = wf_cpugroup_info(g, &gname, &n, &me, NULL, &tmo);
  if (rc) return rc;
  WF_CHECK_ARG(bytes > 0, "vmm create (group '%s'): size 0", gname);
  WF_CHECK_ARG((flags & ~1) == 0, "vmm create (group '%s'): unknown flags 0x%x", gname, flags);
  char op[160];
  snprintf(op, sizeof op, "vmm create (group '%s', rank %d of %d)", gname, me, n);
  const int64_t deadline = wf_now_ms() + (tmo > 0 ? tmo : 300000);

  weft_vmm *w = calloc(1, sizeof *w);
  if (!w) return wf_error(WEFT_ENOMEM, "%s: out of memory", op);
  w->n = n;
  w->me = me;
  w->fabric = flags & 1;
  snprintf(w->group, sizeof w->group, "%s", gname);
  w->h = calloc((size_t)n, sizeof *w->h);
  w->mapped = calloc((size_t)n, 1);
  int *fds = malloc((size_t)n * sizeof *fds);
  CUmemFabricHandle *fhs = calloc((size_t)n, sizeof *fhs);
  int ls = -1, myfd = -1, all_ok = 0, local_rc = 0;
  char local_msg[512] = "";
  if (!w->h || !w->mapped || !fds || !fhs) {
    free(fds); free(fhs); free(w->h); free(w->mapped); free(w);
    return wf_error(WEFT_ENOMEM, "%s: out of memory", op);
  }
  for (int i = 0; i < n; i++) fds[i] = -1;

  /* Step 1: local probe, then everyone learns everyone's facts. */
  vmm_hello mine;
  memset(&mine, 0, sizeof mine);
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  size_t gran = 0;
  local_rc = wf_cuda_device(&w->dev);
  if (!local_rc) {
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = w->dev;
    prop.requestedHandleTypes =
        w->fabric ? CU_MEM_HANDLE_TYPE_FABRIC : CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    local_rc = cu(wf_cu.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                  "cuMemGetAllocationGranularity");
  }
  if (!local_rc && !w->fabric) local_rc = wf_fdx_listen(&mine.id, n, &ls);
  if (!local_rc) {
    mine.ok = 1;
    mine.gran = gran;
    mine.size = (bytes + gran - 1) / gran * gran;
  } else {
    snprintf(local_msg, sizeof local_msg, "%s", weft_last_error());
  }
  const void *gv;
  const size_t *gl;
  rc = weft_cpugroup_allgather(g, &mine, sizeof mine, &gv, &gl);
  if (rc) { wf_error_context(rc, "%s: hello", op); goto fail; }
  vmm_hello *all = malloc((size_t)n * sizeof *all);
  if (!all) { rc = wf_error(WEFT_ENOMEM, "%s: out of memory", op); goto fail; }
  memcpy(all, gv, (size_t)n * sizeof *all);
  size_t size = 0, maxgran = 1;
  for (int r = 0; r < n; r++) {
    if (gl[r] != sizeof mine) {
      rc = wf_error(WEFT_EPROTO, "%s: malformed hello from rank %d", op, r);
      free(all);
      goto fail;
    }
    if (!all[r].ok) {
      rc = local_rc ? wf_error(local_rc, "%s: local probe failed: %s", op, local_msg)
                    : wf_error(WEFT_ENODEV, "%s: rank %d cannot create a VMM workspace (its own "
                               "message says why); all ranks fall back", op, r);
      free(all);
      goto fail;
    }
    if (all[r].size > size) size = all[r].size;
    if (all[r].gran > maxgran) maxgran = all[r].gran;
  }
  w->size = (size + maxgran - 1) / maxgran * maxgran;

  /* Step 2: allocate for real, then the preflight vote. */
  local_rc = make_own(w, &prop, maxgran, &myfd, &fhs[me]);
  if (local_rc) snprintf(local_msg, sizeof local_msg, "%s", weft_last_error());
  rc = vote(g, local_rc == 0, &all_ok);
  if (rc) { wf_error_context(rc, "%s: preflight vote", op); free(all); goto fail; }
  if (!all_ok) {
    rc = local_rc ? wf_error(local_rc, "%s: preflight failed here (%zu bytes): %s; all ranks fall back",
                             op, w->size, local_msg)
                  : wf_error(WEFT_ENOMEM, "%s: preflight failed on another rank (%zu bytes); all "
                             "ranks fall back", op, w->size);
    free(all);
    goto fail;
  }

  /* Step 3: exchange, import, map, access; second vote. */
  if (w->fabric) {
    rc = weft_cpugroup_allgather(g, &fhs[me], sizeof fhs[me], &gv, &gl);
    if (!rc) memcpy(fhs, gv, (size_t)n * sizeof *fhs);
    if (rc) { wf_error_context(rc, "%s: fabric handles", op); free(all); goto fail; }
    local_rc = 0;
  } else {
    wf_fdx_id *ids = malloc((size_t)n * sizeof *ids);
    if (!ids) local_rc = wf_error(WEFT_ENOMEM, "%s: out of memory", op);
    else {
      for (int r = 0; r < n; r++) ids[r] = all[r].id;
      local_rc = wf_fdx_exchange(ids, n, me, ls, myfd, fds, deadline, op);
      free(ids);
    }
  }
  free(all);
  if (!local_rc) local_rc = map_peers(w, fds, fhs);
  if (local_rc) snprintf(local_msg, sizeof local_msg, "%s", weft_last_error());
  rc = vote(g, local_rc == 0, &all_ok);
  if (rc) { wf_error_context(rc, "%s: mapping vote", op); goto fail; }
  if (!all_ok) {
    rc = local_rc ? wf_error(local_rc, "%s: %s; all ranks fall back", op, local_msg)
                  : wf_error(WEFT_ECUDA, "%s: exchange or mapping failed on another rank; all "
                             "ranks fall back", op);
    goto fail;
  }
  if (ls >= 0) close(ls);
  if (myfd >= 0) close(myfd);
  free(fds);
  free(fhs);
  __atomic_add_fetch(&g_live, 1, __ATOMIC_RELAXED);
  __atomic_add_fetch(&g_live_bytes, (int64_t)w->size, __ATOMIC_RELAXED);
  __atomic_add_fetch(&g_created, 1, __ATOMIC_RELAXED);
  wf_log(2, "%s: %zu bytes per rank at %p", op, w->size, (void *)(uintptr_t)w->base);
  *out = w;
  return 0;

fail:
  if (ls >= 0) close(ls);
  if (myfd >= 0) close(myfd);
  for (int i = 0; i < n; i++)
    if (fds[i] >= 0) close(fds[i]);
  free(fds);
  free(fhs);
  free_all(w);
  return rc;
}

int weft_vmm_destroy(weft_vmm *w) {
  if (!w) return 0;
  __atomic_sub_fetch(&g_live, 1, __ATOMIC_RELAXED);
  __atomic_sub_fetch(&g_live_bytes, (int64_t)w->size, __ATOMIC_RELAXED);
  free_all(w);
  return 0;
}

int weft_vmm_ptr(weft_vmm *w, int peer, void **ptr) {
  WF_CHECK_ARG(w && ptr, "vmm ptr: NULL argument");
  WF_CHECK_ARG(peer >= 0 && peer < w->n, "vmm ptr (group '%s'): peer %d not in 0..%d", w->group,
               peer, w->n - 1);
  *ptr = (void *)(uintptr_t)(w->base + (CUdeviceptr)peer * w->size);
  return 0;
}

int weft_vmm_size(weft_vmm *w, size_t *bytes) {
  WF_CHECK_ARG(w && bytes, "vmm size: NULL argument");
  *bytes = w->size;
  return 0;
}

#endif /* WEFT_HAVE_CUDA */
