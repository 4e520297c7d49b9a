/* in_use.c — "is this memory or handle in use by a worker thread right now?",
 * asked before it is freed. Core cannot know the async workers (src/async.c
 * sits above it), so they register the answer here when the first queue is
 * made; until then nothing can be in use. */
#include "internal.h"

#include <stdatomic.h>

static _Atomic(wf_in_use_fn) g_hook;
int wf_in_use_running;

void wf_in_use_register(wf_in_use_fn fn) { atomic_store(&g_hook, fn); }

int wf_wait_unused(const void *lo, size_t len, const void *handle) {
  if (!wf_in_use_any()) return 0;
  wf_in_use_fn fn = atomic_load_explicit(&g_hook, memory_order_acquire);
  return fn ? fn(lo, len, handle) : 0;
}
