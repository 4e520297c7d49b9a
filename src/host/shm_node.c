/* shm_node.c — weft_same_node: which ranks of a group share memory with the
 * root (SGLang's in_the_same_node_as). The root creates a small segment with
 * a random name and a random magic and broadcasts both; the others open it
 * read-only and compare; the verdicts are all-gathered; the root unlinks the
 * name once everybody has answered (and on every failure path). */
#include "shm.h"

#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <unistd.h>

#define NODE_BYTES 4096

typedef struct {
  int32_t ok;
  uint8_t magic[28];
  char name[64];
} node_msg;

static int check_segment(const node_msg *m) {
  int fd = shm_open(m->name, O_RDONLY, 0);
  if (fd < 0) return 0; /* another node, or another /dev/shm */
  void *p = mmap(NULL, NODE_BYTES, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return 0;
  int same = memcmp(p, m->magic, sizeof m->magic) == 0;
  munmap(p, NODE_BYTES);
  return same;
}

static int make_segment(node_msg *m) {
  if (wf_shm_random_name("node", m->name, sizeof m->name)) return 0;
  if (getrandom(m->magic, sizeof m->magic, 0) != (ssize_t)sizeof m->magic) return 0;
  int fd = shm_open(m->name, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return 0;
  int ok = 0;
  if (ftruncate(fd, NODE_BYTES) == 0) {
    void *p = mmap(NULL, NODE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p != MAP_FAILED) {
      memcpy(p, m->magic, sizeof m->magic);
      munmap(p, NODE_BYTES);
      ok = 1;
    }
  }
  close(fd);
  if (!ok) shm_unlink(m->name);
  return ok;
}

int weft_same_node(weft_cpugroup *g, int root, uint8_t *flags) {
  static const char op[] = "weft_same_node";
  WF_CHECK_ARG(g && flags, "%s: NULL group or flags", op);
  wf_group_info gi;
  int rc = wf_shm_group_info(g, &gi, op);
  if (rc) return rc;
  const char *gname = gi.name ? gi.name : "?";
  WF_CHECK_ARG(root >= 0 && root < gi.size, "%s: group '%s': root %d out of range [0, %d)",
               op, gname, root, gi.size);
  node_msg m;
  memset(&m, 0, sizeof m);
  if (gi.index == root) {
    wf_shm_sweep(2 * (gi.timeout_ms / 1000) + 60);
    m.ok = make_segment(&m);
  }
  const void *bv;
  size_t blen;
  rc = weft_cpugroup_broadcast(g, root, &m, sizeof m, &bv, &blen);
  if (rc) {
    if (m.ok) shm_unlink(m.name);
    return wf_error_context(rc, "%s: group '%s': sharing the segment name", op, gname);
  }
  uint8_t mine = 0;
  if (gi.index == root) {
    mine = (uint8_t)m.ok; /* like SGLang: a root that could not create says 0 */
  } else if (blen == sizeof m) {
    node_msg r;
    memcpy(&r, bv, sizeof r);
    r.name[sizeof r.name - 1] = '\0';
    mine = (uint8_t)(r.ok && check_segment(&r));
  }
  const void *all;
  const size_t *lens;
  rc = weft_cpugroup_allgather(g, &mine, 1, &all, &lens);
  if (gi.index == root && m.ok) shm_unlink(m.name);
  if (rc) return wf_error_context(rc, "%s: group '%s': gathering the answers", op, gname);
  for (int i = 0; i < gi.size; i++) flags[i] = lens[i] == 1 ? ((const uint8_t *)all)[i] : 0;
  return 0;
}
