/* capture.c — the calling thread's CUDA-graph capture depth: set by the
 * capture calls (src/cuda/graph.c), read by every layer that must refuse
 * work a graph could not replay (store collectives, synchronizing calls).
 * In core so the control plane can ask without depending on the CUDA layer. */
#include "internal.h"

__thread int wf_tl_capture_depth;

int wf_capture_active(void) { return wf_tl_capture_depth > 0; }
