/* shm_seg.c — the shared segment of a shm communicator: unguessable names,
 * create/attach/map, unlink, and local teardown. No collectives here: the
 * cpu group (shm.c) or a test harness decides who creates and when to unlink. */
#include "shm.h"
#include "cpugroup.h"
#include "core/futex.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* "/weft-<prefix>-<creator pid>-<32 random hex>": unguessable, and the pid
 * lets wf_shm_sweep recognise names whose creator died before unlinking. */
int wf_shm_random_name(const char *prefix, char *buf, size_t n) {
  uint8_t r[16];
  size_t got = 0;
  while (got < sizeof r) {
    ssize_t k = getrandom(r + got, sizeof r - got, 0);
    if (k < 0) {
      if (errno == EINTR) continue;
      return wf_error_errno(WEFT_ESYS, "shm: getrandom for a segment name");
    }
    got += (size_t)k;
  }
  char hex[33];
  for (int i = 0; i < 16; i++) snprintf(hex + 2 * i, 3, "%02x", r[i]);
  int k = snprintf(buf, n, "/weft-%s-%d-%s", prefix, (int)getpid(), hex);
  if (k < 0 || (size_t)k >= n) return wf_error(WEFT_EINVAL, "shm: segment name too long");
  return 0;
}

/* "weft-<letters>-<pid>-<32 hex>" -> pid, or 0 when the name is not ours. */
static pid_t creator_of(const char *name) {
  if (strncmp(name, "weft-", 5) != 0) return 0;
  const char *p = name + 5;
  while (*p >= 'a' && *p <= 'z') p++;
  if (p == name + 5 || *p != '-') return 0;
  char *end;
  long pid = strtol(p + 1, &end, 10);
  if (end == p + 1 || *end != '-' || pid <= 0 || pid > INT32_MAX) return 0;
  size_t h = strspn(end + 1, "0123456789abcdef");
  return h == 32 && end[1 + h] == '\0' ? (pid_t)pid : 0;
}

/* A creator killed between shm_open and its unlink (a launcher stopping every
 * rank while one waits for the others) leaves a name behind. Creators call
 * this first: names of ours whose creator no longer exists and that are older
 * than min_age_s (longer than any creation can wait) are removed. */
void wf_shm_sweep(int min_age_s) {
  DIR *d = opendir("/dev/shm");
  if (!d) return;
  time_t now = time(NULL);
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    pid_t pid = creator_of(e->d_name);
    if (!pid || kill(pid, 0) == 0 || errno != ESRCH) continue;
    struct stat st;
    if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (st.st_uid != geteuid() || now - st.st_mtime < min_age_s) continue;
    char path[300];
    snprintf(path, sizeof path, "/%s", e->d_name);
    if (shm_unlink(path) == 0) wf_log(1, "shm: removed %s (creator %d is gone)", path, (int)pid);
  }
  closedir(d);
}

/* Whole pages, at least 4 KiB and 128 bytes per rank (reduce_scatter splits
 * a slot into one cache-line-aligned piece per rank). */
size_t wf_shm_round_slot(size_t bytes_per_rank, int world) {
  size_t s = bytes_per_rank < WF_SHM_MIN_SLOT ? WF_SHM_MIN_SLOT : bytes_per_rank;
  if (world > 0 && s < (size_t)world * 128) s = (size_t)world * 128;
  return (s + 4095) & ~(size_t)4095;
}

size_t wf_shm_segment_bytes(int world, size_t slot) {
  size_t ctl = WF_SHM_HDR + (size_t)world * WF_SHM_RANK;
  size_t data_off = (ctl + 4095) & ~(size_t)4095;
  return data_off + 2 * (size_t)world * slot;
}

int wf_shm_group_info(weft_cpugroup *g, wf_group_info *gi, const char *op) {
  memset(gi, 0, sizeof *gi);
  int rc = wf_cpugroup_info(g, &gi->name, &gi->size, &gi->index, &gi->ranks, &gi->timeout_ms);
  if (rc) return wf_error_context(rc, "%s", op);
  if (!gi->name) gi->name = "?";
  return 0;
}

/* What each rank reports after trying to attach. */
typedef struct {
  int32_t rc, pid;
  char err[200];
} attach_status;

int wf_shm_announce(weft_cpugroup *g, int index, void *m, size_t len, char *name, size_t name_cap,
                    const int32_t *ok, int *my_rc, const char *op, const char *gname) {
  const void *bv;
  size_t blen;
  int rc = weft_cpugroup_broadcast(g, 0, m, len, &bv, &blen);
  if (rc) return wf_error_context(rc, "%s: group '%s': sharing the segment name", op, gname);
  if (index == 0) return 0;
  if (blen != len) {
    *my_rc = wf_error(WEFT_EPROTO, "%s: group '%s': bad announcement", op, gname);
  } else {
    memcpy(m, bv, len);
    name[name_cap - 1] = '\0';
    if (!*ok)
      *my_rc = wf_error(WEFT_ESYS, "%s: group '%s': group index 0 could not create the segment",
                        op, gname);
  }
  return 0;
}

int wf_shm_confirm_attach(weft_cpugroup *g, int index, int size, const int *granks, int my_rc,
                          const char *my_err, const char *name, const char *op,
                          const char *gname) {
  attach_status st;
  memset(&st, 0, sizeof st);
  st.rc = my_rc;
  st.pid = (int32_t)getpid();
  snprintf(st.err, sizeof st.err, "%s", my_err);
  const void *all;
  const size_t *lens;
  int rc = weft_cpugroup_allgather(g, &st, sizeof st, &all, &lens);
  if (index == 0 && name) wf_shm_unlink(name);
  if (rc) return wf_error_context(rc, "%s: group '%s': confirming the attachment", op, gname);
  char msg[900], prefix[128];
  int plen = snprintf(prefix, sizeof prefix, "%s: group '%s': ", op, gname);
  if (plen < 0 || plen >= (int)sizeof prefix) plen = 0;
  size_t k = 0;
  int first_rc = 0;
  msg[0] = '\0';
  for (int i = 0; i < size; i++) {
    attach_status s;
    if (lens[i] != sizeof s) { if (!first_rc) first_rc = WEFT_EPROTO; continue; }
    memcpy(&s, (const uint8_t *)all + sizeof s * (size_t)i, sizeof s);
    if (s.rc == 0 || k + 1 >= sizeof msg) continue;
    s.err[sizeof s.err - 1] = '\0';
    if (!first_rc) first_rc = s.rc;
    const char *e = s.err;
    if (plen && !strncmp(e, prefix, (size_t)plen)) e += plen; /* said once, in front */
    int w = snprintf(msg + k, sizeof msg - k, "%srank %d (global %d): %s", k ? "; " : "", i,
                     granks ? granks[i] : i, e);
    if (w > 0) k += (size_t)w;
  }
  if (first_rc)
    return wf_error(my_rc ? my_rc : first_rc, "%s: group '%s': %s", op, gname,
                    msg[0] ? msg : "bad attach report");
  return 0;
}

int wf_shm_unlink(const char *name) {
  if (shm_unlink(name) != 0 && errno != ENOENT)
    return wf_error_errno(WEFT_ESYS, "shm: shm_unlink(%s)", name);
  return 0;
}

void wf_shm_close(weft_shm *c) {
  if (!c) return;
  if (c->base) munmap(c->base, c->map_len);
  free(c->ranks);
  free(c->srcs);
  free(c);
}

int wf_shm_map(const char *name, int create, int reserve, size_t total, const char *who,
               const char *gname, const char *attach_hint, const char *size_hint, uint8_t **base) {
  int fd = create ? shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600)
                  : shm_open(name, O_RDWR, 0);
  if (fd < 0)
    return wf_error_errno(WEFT_ESYS, "%s: group '%s': shm_open(%s)%s", who, gname, name,
                          create ? "" : attach_hint);
  int rc = 0;
  if (create && reserve) {
    /* Reserve the pages now: on a full /dev/shm (containers often give it
     * 64 MiB) this fails cleanly here instead of SIGBUS on first touch. */
    int e = posix_fallocate(fd, 0, (off_t)total);
    if (e == EINTR) e = posix_fallocate(fd, 0, (off_t)total);
    if (e == EOPNOTSUPP || e == EINVAL) e = ftruncate(fd, (off_t)total) == 0 ? 0 : errno;
    if (e) {
      errno = e;
      rc = wf_error_errno(WEFT_ESYS, "%s: group '%s': reserving %zu bytes for %s (is /dev/shm "
                          "large enough? containers: --shm-size)", who, gname, total, name);
    }
  } else if (create) {
    if (ftruncate(fd, (off_t)total) != 0)
      rc = wf_error_errno(WEFT_ESYS, "%s: group '%s': sizing %s to %zu bytes", who, gname, name,
                          total);
  } else {
    struct stat st;
    if (fstat(fd, &st) != 0)
      rc = wf_error_errno(WEFT_ESYS, "%s: group '%s': fstat(%s)", who, gname, name);
    else if ((size_t)st.st_size != total)
      rc = wf_error(WEFT_EPROTO, "%s: group '%s': segment %s has %lld bytes, expected %zu%s", who,
                    gname, name, (long long)st.st_size, total, size_hint);
  }
  if (rc == 0) {
    /* MAP_POPULATE: page faults happen here, not inside the first call. */
    void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (p == MAP_FAILED)
      rc = wf_error_errno(WEFT_ESYS, "%s: group '%s': mapping %zu bytes of %s", who, gname,
                          total, name);
    else
      *base = p;
  }
  close(fd);
  if (rc && create) shm_unlink(name);
  return rc;
}

int wf_shm_attach(const char *name, int create, int index, int world, size_t slot,
                  int timeout_ms, const char *group, const int *ranks, weft_shm **out) {
  *out = NULL;
  const char *gname = group ? group : "?";
  WF_CHECK_ARG(world >= 1 && world <= WF_SHM_MAX_WORLD, "shm: group '%s': bad size %d",
               gname, world);
  WF_CHECK_ARG(index >= 0 && index < world, "shm: group '%s': bad index %d of %d", gname,
               index, world);
  WF_CHECK_ARG(slot == wf_shm_round_slot(slot, world),
               "shm: group '%s': slot of %zu bytes is not page-rounded (wf_shm_round_slot)", gname, slot);
  size_t total = wf_shm_segment_bytes(world, slot);
  weft_shm *c = calloc(1, sizeof *c);
  if (!c) return wf_error(WEFT_ENOMEM, "shm: group '%s': out of memory", gname);
  c->ranks = malloc(sizeof(int) * (size_t)world);
  c->srcs = malloc(sizeof(void *) * (size_t)world);
  if (!c->ranks || !c->srcs) {
    wf_shm_close(c);
    return wf_error(WEFT_ENOMEM, "shm: group '%s': out of memory", gname);
  }
  for (int i = 0; i < world; i++) c->ranks[i] = ranks ? ranks[i] : i;
  snprintf(c->group, sizeof c->group, "%s", gname);
  snprintf(c->name, sizeof c->name, "%s", name);
  c->world = world;
  c->me = index;
  c->slot = slot;
  c->timeout_ms = timeout_ms > 0 ? timeout_ms : 1;
  /* crowded until every rank's CPU note is known (after the first barrier,
   * shm_sync.c): the machine's CPUs against the group size */
  wf_wait_init(&c->wait, "WEFT_SHM_SPIN_US", "WEFT_SHM_YIELD_US",
               sysconf(_SC_NPROCESSORS_ONLN) < world);
  long os = wf_env_long("WEFT_SHM_ONESHOT_MAX", -1);
  c->oneshot_max = os >= 0 ? (size_t)os : 32 * 1024;

  int rc = wf_shm_map(name, create, 1, total, "shm", gname, "",
                      " (ranks disagree on the size per rank or the group size)", &c->base);
  if (rc != 0) {
    wf_shm_close(c);
    return rc;
  }
  c->map_len = total;
  c->hdr = (wf_shm_hdr *)c->base;
  c->rk = (wf_shm_rank *)(c->base + WF_SHM_HDR);
  c->data = c->base + (wf_shm_segment_bytes(world, slot) - 2 * (size_t)world * slot);
  if (create) {
    c->hdr->version = WF_SHM_VERSION;
    c->hdr->world = (uint32_t)world;
    c->hdr->slot = slot;
    c->hdr->data_off = (size_t)(c->data - c->base);
    c->hdr->total = total;
    __atomic_store_n(&c->hdr->magic, WF_SHM_MAGIC, __ATOMIC_RELEASE);
  } else if (__atomic_load_n(&c->hdr->magic, __ATOMIC_ACQUIRE) != WF_SHM_MAGIC ||
             c->hdr->version != WF_SHM_VERSION || c->hdr->world != (uint32_t)world ||
             c->hdr->slot != slot) {
    rc = wf_error(WEFT_EPROTO, "shm: group '%s': segment %s is not a weft segment of %d x "
                  "%zu bytes", gname, name, world, slot);
    wf_shm_close(c);
    return rc;
  }
  wf_shm_rank *r = &c->rk[index];
  r->pidns = wf_pidns();
  r->cpus = wf_cpu_note_self();
  atomic_store(&r->pid, (int32_t)getpid());
  atomic_fetch_add(&c->hdr->attached, 1);
  *out = c;
  return 0;
}

int wf_shm_wait_attached(weft_shm *c) {
  int64_t deadline = wf_now_ms() + c->timeout_ms;
  int us = 0;
  while ((int)atomic_load(&c->hdr->attached) < c->world) {
    if (wf_now_ms() > deadline)
      return wf_error(WEFT_ETIMEOUT, "shm: group '%s': only %u of %d ranks attached within "
                      "%d ms", c->group, atomic_load(&c->hdr->attached), c->world,
                      c->timeout_ms);
    wf_backoff(&us, 2000);
  }
  return 0;
}
