// gloo_internal.h — what the Gloo shim's files share (gloo_shim.cc: the
// communicator and its collectives; gloo_agree.cc: the agreement word every
// collective sends first). C++ only, inside the library.
#ifndef WEFT_GLOO_INTERNAL_H
#define WEFT_GLOO_INTERNAL_H

#include <gloo/rendezvous/context.h>
#include <gloo/transport/buffer.h>
#include <gloo/transport/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

extern "C" {
#include "core/internal.h"
#include "core/wait.h"
}

using ms = std::chrono::milliseconds;

struct weft_gloo {
  weft_store *s = nullptr;             // one reference held
  std::string name;                    // the cpu group's name
  std::vector<int> ranks;              // global ranks in group order
  int me = 0, size = 0, timeout_ms = 0;
  std::shared_ptr<gloo::transport::Device> dev;
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  uint32_t tag = 1;                    // collectives: every rank counts alike
  uint64_t agree_seq = 0;              // agreement words sent (agree below)
  uint64_t next_shape = 0, next_args = 0;  // weft_gloo_set_call: the next call's words
  std::vector<uint8_t> agree_buf;      // every member's word of the current call
  std::vector<uint64_t> sent, recvd;   // point to point: per-peer message counters
  std::vector<uint8_t> scratch;        // reduce_scatter
  std::vector<std::string> addrs;      // every rank's address, for messages
  std::mutex busy;
  bool broken = false;
  std::string broken_why;
  std::string prefix;                  // this context's store keys

  // Small all-reduces (power-of-two groups, up to sync_cap bytes): a second
  // mesh whose pairs run in Gloo's synchronous mode, so the calling thread
  // reads its socket itself (one wake-up per message, not the loop thread's
  // and then the caller's). Made at the first such call, on every rank alike.
  std::shared_ptr<gloo::rendezvous::Context> sctx;
  std::vector<std::vector<uint8_t>> sync_in;             // per partner: what arrives
  std::vector<std::unique_ptr<gloo::transport::Buffer>> sync_recv;   // per partner, over sync_in
  std::vector<int> sync_fd;                              // per partner: its socket, polled only
  wf_wait sync_wait;                                     // how long to poll it before blocking
  size_t sync_cap = 0;
  size_t sync_chunk = 0;                                 // agreed by the group (see exchange)
};

namespace wf_gloo {

// Ranks whose calls differ (agree below): every rank fails the call alike,
// and the communicator stays usable.
struct Mismatch {
  std::string msg;
};

inline void wait_send(weft_gloo *c, gloo::transport::UnboundBuffer &b) {
  if (!b.waitSend(ms(c->timeout_ms))) throw std::runtime_error("send aborted");
}
inline void wait_recv(weft_gloo *c, gloo::transport::UnboundBuffer &b) {
  if (!b.waitRecv(ms(c->timeout_ms))) throw std::runtime_error("recv aborted");
}

// The agreement word's call kinds (gloo_agree.cc)
enum { kAgreeAllReduce = 1, kAgreeAllGather, kAgreeReduceScatter, kAgreeBroadcast, kAgreeBarrier, kAgreeRefused };

// Sends this rank's word for its call (kind, dtype, op, root, bytes, and
// words[2]: the shape and args words, or NULL) to every member and reads
// theirs; throws Mismatch, alike on every rank, when they differ, or the
// transport's failure naming the members not heard from.
void agree(weft_gloo *c, uint32_t kind, int dtype, int op, int root, uint64_t bytes, const uint64_t *words);

}  // namespace wf_gloo

#endif
