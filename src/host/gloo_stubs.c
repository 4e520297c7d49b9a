/* gloo_stubs.c — the Gloo API of a build without Gloo's headers: available
 * says 0, everything else reports WEFT_ENODEV (the Lua layer then keeps the
 * store path across nodes, with a warning). */
#include "core/internal.h"

#if !WEFT_HAVE_GLOO

static int nogloo(void) {
  return wf_error(WEFT_ENODEV, "weft_gloo: weft was built without Gloo "
                  "(install libgloo-dev and rebuild: make lib)");
}

int weft_gloo_available(void) { return 0; }
size_t weft_gloo_small_max(void) { return 0; }
int weft_gloo_create(weft_cpugroup *g, const char *host, weft_gloo **out) {
  (void)g; (void)host;
  if (out) *out = NULL;
  return nogloo();
}
int weft_gloo_destroy(weft_gloo *c) { (void)c; return 0; }
int weft_gloo_set_timeout(weft_gloo *c, int t) { (void)c; (void)t; return nogloo(); }
int weft_gloo_all_reduce(weft_gloo *c, const void *in, void *out, size_t n, int dt, int op) {
  (void)c; (void)in; (void)out; (void)n; (void)dt; (void)op;
  return nogloo();
}
int weft_gloo_all_gather(weft_gloo *c, const void *in, void *out, size_t b) {
  (void)c; (void)in; (void)out; (void)b;
  return nogloo();
}
int weft_gloo_reduce_scatter(weft_gloo *c, const void *in, void *out, size_t n, int dt, int op) {
  (void)c; (void)in; (void)out; (void)n; (void)dt; (void)op;
  return nogloo();
}
int weft_gloo_broadcast(weft_gloo *c, void *buf, size_t b, int root) {
  (void)c; (void)buf; (void)b; (void)root;
  return nogloo();
}
int weft_gloo_barrier(weft_gloo *c) { (void)c; return nogloo(); }
int weft_gloo_set_call(weft_gloo *c, uint64_t w, uint64_t a) { (void)c; (void)w; (void)a; return nogloo(); }
int weft_gloo_refuse(weft_gloo *c, int ms) { (void)c; (void)ms; return nogloo(); }
int weft_gloo_send(weft_gloo *c, const void *buf, size_t b, int dst) {
  (void)c; (void)buf; (void)b; (void)dst;
  return nogloo();
}
int weft_gloo_recv(weft_gloo *c, void *buf, size_t b, int src) {
  (void)c; (void)buf; (void)b; (void)src;
  return nogloo();
}

#else
typedef int wf_gloo_stubs_unused; /* ISO C: a translation unit is not empty */
#endif
