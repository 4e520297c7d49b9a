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

#endif
