/* cpugroup.h — internal accessors of the cpu group for other C modules
 * (shm.c, shm_node.c, gloo_shim.cc); implemented in cpugroup.c. */
#ifndef WF_CPUGROUP_H
#define WF_CPUGROUP_H

#include "weft.h"

/* Any out-pointer may be NULL. name/ranks stay valid while g lives.
 * ranks: global ranks in group order; timeout_ms: the group's current bound. */
int wf_cpugroup_info(weft_cpugroup *g, const char **name, int *size, int *index,
                     const int **ranks, int *timeout_ms);
/* the store the group runs on (the Gloo shim's rendezvous) */
weft_store *wf_cpugroup_store(weft_cpugroup *g);

/* A recv against a collective: the shm communicator of the same group
 * (weft_shm_create links it) learns which message a peer waits for in a
 * recv (wf_shm_note_recv, published in the segment) and how many this rank
 * has sent to each peer, so a rank waiting at a barrier for a peer that
 * waits in a recv for a message this rank never sent fails at once, both of
 * them (shm_sync.c). Linked and unlinked by the create/destroy of either. */
void wf_cpugroup_link_shm(weft_cpugroup *g, weft_shm *c);
void wf_cpugroup_unlink_shm(weft_cpugroup *g, weft_shm *c);
/* messages this rank has sent to the group's index dst */
uint64_t wf_cpugroup_sent(const weft_cpugroup *g, int dst);

#endif
