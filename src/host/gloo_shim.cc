// gloo_shim.cc — weft_gloo_*: host collectives across nodes on Gloo's TCP
// transport (weft.h has the contract). Built only where Gloo's headers are
// (mk/gloo.mk). Rendezvous goes through weft's own store (a
// gloo::rendezvous::Store over weft_store_*), so the store's secret, limits
// and liveness apply; reductions are weft_host_reduce, the one definition
// every backend shares. Nothing throws across the C boundary: every entry
// point catches everything and turns it into weft_last_error(). The
// agreement word every collective sends first is gloo_agree.cc's; the
// communicator's state, gloo_internal.h.
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/buffer.h>
#include <gloo/transport/pair.h>
#include <gloo/transport/unbound_buffer.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <cerrno>
#include <ctime>
#include <sched.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <stdexcept>
#include <string>
#include <sys/random.h>
#include <unistd.h>
#include <vector>

extern "C" {
#include "core/internal.h"
#include "host/cpugroup.h"
#include "core/wait.h"
#include "core/shape_word.h"
}
#include "store/store_proto.h"
#include "store/store_share.h"
#include "host/gloo_internal.h"

using namespace wf_gloo;

namespace {

// An error already recorded with wf_error, thrown through Gloo: the code and
// the message, taken when thrown (cleanup on the way out, e.g. forget()'s
// store calls, may overwrite the thread's last error before guarded() reads it).
struct Recorded {
  int code;
  std::string msg;
  explicit Recorded(int c) : code(c), msg(weft_last_error()) {}
};

// a + b without std::operator+ (a weak template instance that a CUDA build's
// link would export from the .so: check-exports)
std::string cat(const std::string &a, const std::string &b) {
  std::string r(a);
  r.append(b);
  return r;
}

// gloo::rendezvous::Store over weft's store: keys under a per-context
// prefix; every wait bounded by the group's timeout, and its failure says
// whose address did not arrive.
class WeftStore : public gloo::rendezvous::Store {
 public:
  WeftStore(weft_store *s, std::string prefix, const std::string &group, const int *ranks,
            int size, int timeout_ms)
      : s_(s), prefix_(std::move(prefix)), group_(group), ranks_(ranks), size_(size),
        timeout_ms_(timeout_ms) {}

  void set(const std::string &key, const std::vector<char> &data) override {
    std::string k = cat(prefix_, key);
    int rc = weft_store_set(s_, k.c_str(), data.data(), data.size());
    if (rc) throw Recorded(wf_error_context(rc, "publishing this rank's Gloo address"));
    mine_.push_back(k);
  }

  std::vector<char> get(const std::string &key) override {
    std::string k = cat(prefix_, key);
    const void *v = nullptr;
    size_t len = 0;
    int rc = weft_store_get(s_, k.c_str(), timeout_ms_, &v, &len);
    if (rc) throw Recorded(wf_error_context(rc, "waiting for %s", who(key).c_str()));
    const char *p = static_cast<const char *>(v);
    return std::vector<char>(p, p + len);
  }

  void wait(const std::vector<std::string> &keys) override { wait(keys, ms(timeout_ms_)); }

  void wait(const std::vector<std::string> &keys, const ms &timeout) override {
    std::vector<std::string> full;
    std::vector<const char *> arr;
    for (const auto &k : keys) full.push_back(cat(prefix_, k));
    for (const auto &k : full) arr.push_back(k.c_str());
    int t = (int)timeout.count();
    if (t <= 0 || t > timeout_ms_) t = timeout_ms_;
    int rc = weft_store_wait(s_, arr.data(), (int)arr.size(), t);
    if (rc) throw Recorded(wf_error_context(rc, "waiting for %s", who(keys.empty() ? "" : keys[0]).c_str()));
  }

  // the keys this rank published (deleted once every rank is connected);
  // best effort, and the thread's last error (the cause of a failed
  // connect, on the error path) is left as it was
  void forget() {
    std::string keep = weft_last_error();
    for (const auto &k : mine_) weft_store_delete(s_, k.c_str(), nullptr);
    mine_.clear();
    wf_error(0, "%s", keep.c_str());
  }

 private:
  // Gloo's address keys are the group index as a decimal string
  std::string who(const std::string &key) const {
    char *end = nullptr;
    long i = strtol(key.c_str(), &end, 10);
    char buf[160];
    if (!key.empty() && end && *end == '\0' && i >= 0 && i < size_)
      snprintf(buf, sizeof buf, "the Gloo address of rank %d (index %ld of group '%s')", ranks_[i],
               i, group_.c_str());
    else
      snprintf(buf, sizeof buf, "Gloo key '%s' of group '%s'", key.c_str(), group_.c_str());
    return buf;
  }

  weft_store *s_;
  std::string prefix_, group_;
  const int *ranks_;
  int size_, timeout_ms_;
  std::vector<std::string> mine_;
};

// Gloo's messages start with "[/build/path/file.cc:123] ": keep the rest.
std::string gloo_text(const char *what) {
  std::string m = what ? what : "unknown error";
  if (!m.empty() && m[0] == '[') {
    size_t e = m.find("] ");
    if (e != std::string::npos) m = m.substr(e + 2);
  }
  return m;
}

constexpr uint64_t kSlotRs = 0xE0ull << 56;   // our own ring reduce-scatter
constexpr uint64_t kSlotP2p = 0xE1ull << 56;  // send / recv (Gloo's own use prefixes < 0x20)
                                               // (0xE2: the agreement words, gloo_agree.cc)

// A failure inside a call: name the group and the op, the ranks the store
// saw die or cannot reach, or the store itself when it cannot be reached,
// and close this rank's connections so the peers fail now, not at their
// timeout. The handle is unusable afterwards. The diagnosis is bounded as
// a whole (wf_store_diagnose): a timeout waits for no tombstone (a death
// would have closed a connection before it), a lost connection up to 1 s
// for the server to notice the death behind it.
constexpr int kLingerMs = 200;
int failed(weft_gloo *c, const char *op, int code, const std::string &cause0) {
  // every error names its cause: an empty one is a bug of ours, said as such
  const std::string cause = cause0.empty() ? std::string("no message was recorded (a bug: please report)") : cause0;
  const bool timed_out = cause.find("imed out") != std::string::npos ||
                         cause.find("timeout") != std::string::npos;
  wf_store_diag d;
  int gone = wf_store_diagnose(c->s, timed_out ? 0 : 1000, &d);
  // what else the store can tell: ranks cut off from its host, or the store itself
  char note[sizeof d.unreach_who + sizeof d.store_why + 128];
  wf_store_diag_note(&d, note, sizeof note);
  std::string also(note);
  // Gloo names the peer by address ("[10.1.2.3]:port"): say which ranks are there
  std::string at;
  size_t b = cause.find('['), e = cause.find(']');
  if (b != std::string::npos && e != std::string::npos && e > b) {
    std::string a = cause.substr(b + 1, e - b - 1);
    for (int i = 0; i < c->size; i++)
      if (i != c->me && i < (int)c->addrs.size() && c->addrs[i] == a)
        at.append(at.empty() ? "" : ", ").append(std::to_string(c->ranks[i]));
    if (!at.empty()) at = std::string("rank(s) ").append(at).append(" at ").append(a);
  }
  int rc;
  if (timed_out) {
    // a death during the wait would have closed a connection: one seen now
    // came after (a rank that failed first and exited), or elsewhere
    if (gone > 0)
      also.append("; gone from the job meanwhile (exited or killed without weft.shutdown()): ")
          .append(d.gone_who);
    rc = wf_error(WEFT_ETIMEOUT, "weft_gloo_%s: group '%s': no progress within the %d ms "
                  "timeout%s%s%s (gloo: %s)", op, c->name.c_str(), c->timeout_ms,
                  at.empty() ? "" : ", waiting for ", at.c_str(), also.c_str(), cause.c_str());
  } else if (gone > 0)
    rc = wf_error(WEFT_ECLOSED, "weft_gloo_%s: group '%s': %s died (exited or was killed "
                  "without weft.shutdown()) during the call (gloo: %s)", op, c->name.c_str(), d.gone_who,
                  cause.c_str());
  else
    rc = wf_error(code, "weft_gloo_%s: group '%s': %s%s%s%s%s", op, c->name.c_str(),
                  at.empty() ? "" : "lost the connection to ", at.c_str(),
                  at.empty() || !also.empty() ? "" : " (no death seen by the store, or the store is gone with rank 0)",
                  also.c_str(), (std::string(at.empty() && also.empty() ? "" : ": ") + cause).c_str());
  // the store's host stays a moment after a timeout: the group's other
  // ranks time out at about the same time, and their diagnosis needs the
  // store (this rank's process may exit right after this error)
  if (timed_out && wf_store_serves(c->s)) usleep(kLingerMs * 1000);
  c->broken = true;
  char msg[2048];
  snprintf(msg, sizeof msg, "%s", weft_last_error());
  c->broken_why = msg;
  try {
    if (c->ctx) c->ctx->closeConnections();
    if (c->sctx) c->sctx->closeConnections();
  } catch (...) {
  }
  wf_error(rc, "%s", msg);   // closeConnections may have touched the message
  return rc;
}

// Gloo writes to its sockets with writev(), without MSG_NOSIGNAL: a peer that
// closed its end (it failed at its timeout while this rank was stopped)
// raises SIGPIPE, whose default action kills the process. So every call into
// Gloo runs with SIGPIPE blocked on the calling thread (Gloo's loop thread,
// made inside create, inherits that mask and keeps it); a SIGPIPE raised
// meanwhile is consumed before the mask is restored, unless one was already
// pending (the application's own). The process's disposition of SIGPIPE is
// never touched, so an embedding application keeps its own; the failed write
// itself ends as EPIPE, which Gloo reports and failed() turns into an error.
class NoSigpipe {
 public:
  NoSigpipe() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pend;
    was_pending_ = sigpending(&pend) == 0 && sigismember(&pend, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  }
  ~NoSigpipe() {
    sigset_t pend;
    if (!was_pending_ && sigpending(&pend) == 0 && sigismember(&pend, SIGPIPE) == 1) {
      struct timespec zero = {0, 0};
      while (sigtimedwait(&pipe_, nullptr, &zero) < 0 && errno == EINTR) {
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }
  NoSigpipe(const NoSigpipe &) = delete;
  NoSigpipe &operator=(const NoSigpipe &) = delete;

 private:
  sigset_t pipe_, old_;
  bool was_pending_;
};

// Runs f with the handle's checks; turns every exception into a status.
template <typename F>
int guarded(weft_gloo *c, const char *op, F &&f) {
  if (!c) return wf_error(WEFT_EINVAL, "weft_gloo_%s: NULL handle", op);
  NoSigpipe no_sigpipe;  // also over failed(): closing connections may write
  std::unique_lock<std::mutex> lk(c->busy, std::try_to_lock);
  if (!lk.owns_lock())
    return wf_error(WEFT_ESTATE, "weft_gloo_%s: group '%s': another call is in flight on this "
                    "handle (one at a time)", op, c->name.c_str());
  if (c->broken)
    return wf_error(WEFT_ESTATE, "weft_gloo_%s: group '%s': unusable after an earlier failure "
                    "(%s)", op, c->name.c_str(), c->broken_why.c_str());
  try {
    f();
    return 0;
  } catch (const Mismatch &m) {
    return wf_error(WEFT_EMISMATCH, "weft_gloo_%s: group '%s': the ranks called different collectives: "
                    "%s (every rank fails alike; the group stays usable)", op, c->name.c_str(), m.msg.c_str());
  } catch (const Recorded &r) {
    return failed(c, op, r.code, r.msg);
  } catch (const std::bad_alloc &) {
    return failed(c, op, WEFT_ENOMEM, "out of memory");
  } catch (const std::exception &e) {
    return failed(c, op, WEFT_ECLOSED, gloo_text(e.what()));
  } catch (...) {
    return failed(c, op, WEFT_ECLOSED, "unknown C++ exception");
  }
}

bool reducible(int dtype) {
  return dtype == WEFT_F32 || dtype == WEFT_F16 || dtype == WEFT_BF16 || dtype == WEFT_F64 ||
         dtype == WEFT_I32 || dtype == WEFT_I64 || dtype == WEFT_U8;
}
bool known_op(int op) { return op == WEFT_SUM || op == WEFT_MAX || op == WEFT_MIN || op == WEFT_PROD; }

// weft's reduction as Gloo's element-wise function: out = a op b
gloo::AllreduceOptions::Func reduce_fn(int dtype, int op) {
  return [dtype, op](void *out, const void *a, const void *b, size_t n) {
    const void *srcs[2] = {a, b};
    if (weft_host_reduce(out, srcs, 2, n, dtype, op))
      throw Recorded(wf_error_context(WEFT_EINVAL, "reduction"));
  };
}

// Gloo sizes elements by type: one of the unsigned types of the dtype's width.
template <typename T>
void run_allreduce(weft_gloo *c, const void *in, void *out, size_t count, int dtype, int op) {
  gloo::AllreduceOptions o(c->ctx);
  if (in != out) o.setInput(static_cast<T *>(const_cast<void *>(in)), count);
  o.setOutput(static_cast<T *>(out), count);
  o.setReduceFunction(reduce_fn(dtype, op));
  o.setTag(c->tag++);
  o.setTimeout(ms(c->timeout_ms));
  gloo::allreduce(o);
}

// The largest all-reduce of the synchronous small path (WEFT_GLOO_SMALL_MAX,
// bytes; 0 turns it off). 16 MiB: on 2 simulated nodes x 2 ranks it beat
// Gloo's ring at every size up to there (1.4 against 4.2 ms at 1 MiB, 30-34
// against 48 ms at 16 MiB; bench/results/host-allreduce-nodes-*). A rank
// keeps a receive buffer per partner (log2 W of them) as large as its
// largest small all-reduce so far.
size_t small_max() {
  static const size_t v = [] {
    const char *e = getenv("WEFT_GLOO_SMALL_MAX");
    return e && *e ? (size_t)strtoull(e, nullptr, 0) : (size_t)16 << 20;
  }();
  return v;
}

// The synchronous mesh's slots, one per direction: lower rank -> higher on
// kSyncUp, higher -> lower on kSyncDown. A send buffer is made per call and,
// when destroyed, Gloo forgets whatever buffer of this rank has its slot;
// with a slot per direction that is never this rank's receive buffer.
constexpr int kSyncUp = 0x5e, kSyncDown = 0x5f;
int sync_slot(int from, int to) { return from < to ? kSyncUp : kSyncDown; }

// An exchange with a partner moves chunks of at most this many bytes, each
// side writing one chunk, then reading the partner's: a chunk fits in the
// socket's send buffer (safe_chunk caps it at what the kernel grants), so
// neither blocking write waits for a reader and both directions move at
// once (WEFT_GLOO_CHUNK). 60 KiB: a chunk and Gloo's header stay under 64
// KiB; at 64 KiB and above back-to-back exchanges stall (2 nodes, 1 MiB
// all-reduce in a loop: 0.52 ms with 60 KiB chunks, 0.69 with 32 KiB, 4.3
// with 64 KiB, 1.5 with 128 KiB, 1.0 with 1 MiB).
size_t chunk_bytes() {
  static const size_t v = [] {
    const char *e = getenv("WEFT_GLOO_CHUNK");
    const size_t n = e && *e ? (size_t)strtoull(e, nullptr, 0) : (size_t)60 << 10;
    return n < 4096 ? (size_t)4096 : n & ~(size_t)63;
  }();
  return v;
}

// From this many bytes the small path reduce-scatters by recursive halving
// and all-gathers by recursive doubling (each rank sends 2(W-1)/W of the
// message instead of log2(W) times it; twice the rounds), below it recursive
// doubling of the whole message (WEFT_GLOO_HALVING_MIN; 256 KiB, measured).
size_t halving_min() {
  static const size_t v = [] {
    const char *e = getenv("WEFT_GLOO_HALVING_MIN");
    return e && *e ? (size_t)strtoull(e, nullptr, 0) : (size_t)256 << 10;
  }();
  return v;
}

// How a small all-reduce waits for its partner's socket before it blocks
// in Gloo's read (a blocked reader costs a wake-up per message, tens of µs
// on a VM whose idle vCPU has halted): the adaptive wait of src/core/wait.c
// (docs/host-waits.md). When the group's ranks that share this kernel have
// a CPU each, it polls for a budget of 10-200 µs that follows how soon the
// partner's data came, never yielding (a yield hands a busy process on the
// same core its whole slice, ~3-4 ms), and stops once this thread lost its
// CPU while polling (then blocking is cheaper: a woken reader preempts the
// busy process). When they outnumber their CPUs (simulated nodes, or many
// ranks per node) it does not spin (a spinner burns the core a late rank
// needs) but yields for up to 100 µs, held off once a yield fed a stranger.
// WEFT_GLOO_SPIN_US fixes the spin (0 blocks at once), WEFT_GLOO_YIELD_US
// the yield phase (0: none).
//
// Who shares this kernel: every rank publishes its boot id and where it may
// run (an all-gather on the main context, at the sync mesh's making; the
// boot id is the same in every network namespace of one machine). A rank
// without a boot id counts as alone.
struct CpuShare {
  char boot[40];
  wf_cpu_note note;
};

void init_sync_wait(weft_gloo *c) {
  CpuShare mine;
  memset(&mine, 0, sizeof mine);
  if (FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r")) {
    if (!fgets(mine.boot, sizeof mine.boot, f)) mine.boot[0] = 0;
    fclose(f);
  }
  mine.note = wf_cpu_note_self();
  std::vector<CpuShare> all(c->size);
  gloo::AllgatherOptions a(c->ctx);
  a.setInput(reinterpret_cast<uint8_t *>(&mine), sizeof mine);
  a.setOutput(reinterpret_cast<uint8_t *>(all.data()), sizeof mine * all.size());
  a.setTag(c->tag++);
  a.setTimeout(ms(c->timeout_ms));
  gloo::allgather(a);
  std::vector<wf_cpu_note> here;
  for (const CpuShare &r : all)
    if (mine.boot[0] && memcmp(r.boot, mine.boot, sizeof mine.boot) == 0) here.push_back(r.note);
  const int n = (int)here.size();
  const int crowded = n > 1 && wf_cpu_crowded(here.data(), n, sizeof(wf_cpu_note));
  wf_wait_init(&c->sync_wait, "WEFT_GLOO_SPIN_US", "WEFT_GLOO_YIELD_US", crowded);
}

// Gloo keeps a pair's socket to itself (and Debian's headers for its tcp
// pair are incomplete); the small path only polls it, never reads it. A
// connected pair's address is its socket's local name: the one open socket
// with that name is the pair's. None, or more than one: -1 (no polling).
int pair_fd(gloo::transport::Pair &pair) {
  const auto &want = static_cast<const gloo::transport::tcp::Address &>(pair.address()).getSockaddr();
  const socklen_t wlen = want.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  int found = -1, n = 0;
  while (struct dirent *e = readdir(d)) {
    char *end;
    const long fd = strtol(e->d_name, &end, 10);
    if (*end || end == e->d_name || fd == dirfd(d)) continue;
    sockaddr_storage ss;
    socklen_t len = sizeof ss;
    if (getsockname((int)fd, (sockaddr *)&ss, &len) != 0 || len != wlen) continue;
    if (memcmp(&ss, &want, wlen) == 0) { found = (int)fd; n++; }
  }
  closedir(d);
  return n == 1 ? found : -1;
}

int readable(void *fd) {
  struct pollfd p = {*static_cast<int *>(fd), POLLIN, 0};
  return poll(&p, 1, 0) != 0;   // data, an error or a hang-up: Gloo's read reports it
}

// The largest chunk a blocking write of this socket hands to the kernel
// without a reader: half the send buffer it reports once sized (the kernel
// doubles what is asked, for its own bookkeeping), whole elements of every
// dtype. Unknown socket: 64 KiB, well under the default buffers.
uint64_t safe_chunk(int fd) {
  uint64_t want = chunk_bytes();
  if (fd < 0) return std::min<uint64_t>(want, 64 << 10);
  int v = (int)std::min<uint64_t>(want, 1u << 30);
  socklen_t len = sizeof v;
  if (setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, len) != 0 || getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &v, &len) != 0)
    return std::min<uint64_t>(want, 64 << 10);
  const uint64_t half = ((uint64_t)v / 2) & ~(uint64_t)63;
  return std::max<uint64_t>(4096, std::min(want, half));
}

// The synchronous mesh (see weft_gloo): the second full mesh through the
// store; the log2(size) pairs recursive doubling uses (partner me ^ mask)
// switched to synchronous mode, each with a receive buffer (grown on
// demand: sync_room). Collective (the first small all-reduce).
void make_sync_mesh(weft_gloo *c) {
  const size_t cap = std::min<size_t>(small_max(), 64 << 10);
  auto ctx = std::make_shared<gloo::rendezvous::Context>(c->me, c->size);
  ctx->setTimeout(ms(c->timeout_ms));
  WeftStore store(c->s, c->prefix + "sync/", c->name, c->ranks.data(), c->size, c->timeout_ms);
  try {
    ctx->connectFullMesh(store, c->dev);
  } catch (...) {
    store.forget();
    throw;
  }
  c->sync_in.assign(c->size, std::vector<uint8_t>());
  c->sync_recv.clear();
  c->sync_recv.resize(c->size);
  c->sync_fd.assign(c->size, -1);
  uint64_t chunk = chunk_bytes();
  for (int mask = 1; mask < c->size; mask <<= 1) {
    const int i = c->me ^ mask;
    auto &pair = ctx->getPair(i);
    c->sync_in[i].assign(cap, 0);
    c->sync_recv[i] = pair->createRecvBuffer(sync_slot(i, c->me), c->sync_in[i].data(), cap);
    pair->setSync(true, false);   // blocking reads in the caller, bounded by the context's timeout
    c->sync_fd[i] = pair_fd(*pair);
    chunk = std::min(chunk, safe_chunk(c->sync_fd[i]));
  }
  // both sides of a pair must count the same chunks: the group's smallest
  gloo::AllreduceOptions a(c->ctx);
  a.setInput(&chunk, 1);
  a.setOutput(&chunk, 1);
  a.setReduceFunction(static_cast<void (*)(void *, const void *, const void *, size_t)>(&gloo::min<uint64_t>));
  a.setTag(c->tag++);
  a.setTimeout(ms(c->timeout_ms));
  gloo::allreduce(a);
  init_sync_wait(c);
  // every rank has read every address once all are connected: a barrier on
  // the main context, then the keys can go
  gloo::BarrierOptions b(c->ctx);
  b.setTag(c->tag++);
  b.setTimeout(ms(c->timeout_ms));
  gloo::barrier(b);
  store.forget();
  c->sctx = ctx;
  c->sync_cap = cap;
  c->sync_chunk = chunk;
}

// One exchange with the partner over the synchronous mesh: this rank's
// bytes [soff, soff + sn) of the accumulator go to the same offsets of the
// partner's receive buffer, and the partner's bytes [roff, roff + rn) (it
// sends them to its own offsets) arrive in ours. Chunk by chunk, each side
// writes its chunk k, then reads the partner's and hands it to got(off, n)
// (a reduction or a copy) while the partner's next chunk is on its way. The
// sizes are known on both sides, so both count chunks alike.
template <class Got>
void exchange(weft_gloo *c, int peer, gloo::transport::Buffer *sb, size_t soff, size_t sn, size_t roff, size_t rn,
              Got got) {
  auto &rb = c->sync_recv[peer];
  const size_t ch = c->sync_chunk;
  for (size_t o = 0; o < sn || o < rn; o += ch) {
    if (o < sn) {
      sb->send(soff + o, sn - o < ch ? sn - o : ch, soff + o);
      sb->waitSend();
    }
    if (o < rn) {
      // the read below stays bounded by the context's timeout; the spin and
      // the yield phase add at most their budgets (200 + 100 µs unless fixed
      // by the environment; a yield that fed a stranger, up to its slice)
      int fd = c->sync_fd[peer];
      if (fd >= 0 && !wf_wait_spin_on(&c->sync_wait, readable, &fd)) wf_wait_yield_on(&c->sync_wait, readable, &fd);
      rb->waitRecv();
      if (fd >= 0) wf_wait_end(&c->sync_wait);
      got(roff + o, rn - o < ch ? rn - o : ch);
    }
  }
}

// acc[off, off + n) (bytes) = reduce(lower rank's, higher rank's) of the
// pair, so every rank computes the same tree: ((r0 + r1) + (r2 + r3)) ... in
// rank order within each half, whichever algorithm below ran.
void reduce_pair(weft_gloo *c, int peer, uint8_t *acc, size_t off, size_t n, size_t es, int dtype, int op) {
  uint8_t *mine = acc + off;
  const uint8_t *theirs = c->sync_in[peer].data() + off;
  const void *srcs[2] = {c->me < peer ? mine : theirs, c->me < peer ? theirs : mine};
  if (weft_host_reduce(mine, srcs, 2, n / es, dtype, op))
    throw Recorded(wf_error_context(WEFT_EINVAL, "reduction"));
}

// Receive buffers of at least `bytes` for every partner: a larger one (the
// next power of two, at most small_max) replaces a smaller one. Local: in
// synchronous mode this rank's thread alone reads its sockets, so nothing
// lands in a buffer before the call that waits for it.
void sync_room(weft_gloo *c, size_t bytes) {
  if (bytes <= c->sync_cap) return;
  size_t cap = c->sync_cap;
  while (cap < bytes) cap <<= 1;
  cap = std::min(cap, small_max());
  for (int mask = 1; mask < c->size; mask <<= 1) {
    const int i = c->me ^ mask;
    c->sync_recv[i].reset();   // unregisters the slot before the new buffer takes it
    c->sync_in[i].assign(cap, 0);
    c->sync_recv[i] = c->sctx->getPair(i)->createRecvBuffer(sync_slot(i, c->me), c->sync_in[i].data(), cap);
  }
  c->sync_cap = cap;
}

// The small path (power-of-two groups): partners me ^ mask, mask = 1, 2, 4...
// Below halving_min(): recursive doubling, the whole message each round.
// From it: recursive halving (the rank without the mask bit keeps the lower
// half of its range, sends the upper), then recursive doubling of the owned
// ranges in reverse order. Both give every rank the same bits. The result
// is built in `out` itself: the send buffers are views of it, made per call
// (a send buffer is local to this rank: nothing to register with the peer),
// so nothing is copied in or out. Chunks are whole elements (sync_chunk is
// a multiple of every dtype's size).
void sync_allreduce(weft_gloo *c, const void *in, void *out, size_t count, int dtype, int op) {
  const size_t es = weft_dtype_size(dtype), bytes = count * es;
  if (!c->sctx) make_sync_mesh(c);
  sync_room(c, bytes);
  uint8_t *acc = static_cast<uint8_t *>(out);
  if (in != out) memmove(acc, in, bytes);
  std::vector<std::unique_ptr<gloo::transport::Buffer>> sends;
  for (int mask = 1; mask < c->size; mask <<= 1)
    sends.push_back(c->sctx->getPair(c->me ^ mask)->createSendBuffer(sync_slot(c->me, c->me ^ mask), acc, bytes));
  auto reduce = [&](int peer) {
    return [c, peer, acc, es, dtype, op](size_t off, size_t n) { reduce_pair(c, peer, acc, off, n, es, dtype, op); };
  };
  if (bytes < halving_min()) {
    for (int mask = 1, k = 0; mask < c->size; mask <<= 1, k++) {
      const int peer = c->me ^ mask;
      exchange(c, peer, sends[k].get(), 0, bytes, 0, bytes, reduce(peer));
    }
    return;
  }
  size_t lo = 0, hi = count;
  std::vector<std::pair<size_t, size_t>> owned;   // the range before each halving
  for (int mask = 1, k = 0; mask < c->size; mask <<= 1, k++) {
    const int peer = c->me ^ mask;
    const size_t mid = lo + (hi - lo) / 2;
    owned.emplace_back(lo, hi);
    const bool low = (c->me & mask) == 0;
    const size_t klo = low ? lo : mid, khi = low ? mid : hi;   // kept
    const size_t glo = low ? mid : lo, ghi = low ? hi : mid;   // given away
    exchange(c, peer, sends[k].get(), glo * es, (ghi - glo) * es, klo * es, (khi - klo) * es, reduce(peer));
    lo = klo;
    hi = khi;
  }
  for (int k = (int)owned.size() - 1; k >= 0; k--) {
    const int peer = c->me ^ (1 << k);
    const auto whole = owned[k];
    // the partner owns the rest of `whole`
    const size_t plo = lo == whole.first ? hi : whole.first, phi = lo == whole.first ? whole.second : lo;
    const uint8_t *from = c->sync_in[peer].data();
    exchange(c, peer, sends[k].get(), lo * es, (hi - lo) * es, plo * es, (phi - plo) * es,
             [acc, from](size_t off, size_t n) { memcpy(acc + off, from + off, n); });
    lo = whole.first;
    hi = whole.second;
  }
}

bool sync_applies(const weft_gloo *c, size_t bytes) {
  return c->size > 1 && (c->size & (c->size - 1)) == 0 && bytes <= small_max();
}

}  // namespace

extern "C" {

int weft_gloo_available(void) { return 1; }

size_t weft_gloo_small_max(void) { return small_max(); }

int weft_gloo_create(weft_cpugroup *g, const char *host, weft_gloo **out) {
  static const char op[] = "weft_gloo_create";
  WF_CHECK_ARG(g && out, "%s: NULL group or out-parameter", op);
  *out = nullptr;
  const char *name = nullptr;
  const int *ranks = nullptr;
  int size = 0, me = 0, timeout = 0;
  int rc = wf_cpugroup_info(g, &name, &size, &me, &ranks, &timeout);
  if (rc) return rc;
  weft_store *s = wf_cpugroup_store(g);
  WF_CHECK_ARG(s, "%s: group '%s' has no store", op, name);
  char addr[256];
  if (host && *host) {
    snprintf(addr, sizeof addr, "%s", host);
  } else if ((rc = wf_store_local_addr(s, addr, sizeof addr))) {
    return wf_error_context(rc, "%s: group '%s': finding this rank's address", op, name);
  }
  // one nonce per context, from index 0: keys never meet an earlier context's
  uint64_t nonce = 0;
  if (me == 0 && getrandom(&nonce, sizeof nonce, 0) != (ssize_t)sizeof nonce) nonce = (uint64_t)wf_now_ns();
  const void *bv = nullptr;
  size_t blen = 0;
  rc = weft_cpugroup_broadcast(g, 0, &nonce, sizeof nonce, &bv, &blen);
  if (rc) return wf_error_context(rc, "%s: group '%s': agreeing on a rendezvous name", op, name);
  if (blen != sizeof nonce) return wf_error(WEFT_EPROTO, "%s: group '%s': bad rendezvous name", op, name);
  memcpy(&nonce, bv, sizeof nonce);
  char prefix[400];
  snprintf(prefix, sizeof prefix, "weft/gloo/%s/%016llx/", name, (unsigned long long)nonce);

  weft_gloo *c = nullptr;
  try {
    c = new weft_gloo();
    c->s = s;
    wf_store_ref(s);
    c->name = name;
    c->ranks.assign(ranks, ranks + size);
    c->me = me;
    c->size = size;
    c->timeout_ms = timeout;
    c->sent.assign(size, 0);
    c->recvd.assign(size, 0);
    c->prefix = prefix;
  } catch (...) {
    if (c) { wf_store_unref(s); delete c; }
    return wf_error(WEFT_ENOMEM, "%s: group '%s': out of memory", op, name);
  }
  rc = guarded(c, "create", [&] {
    gloo::transport::tcp::attr attr;
    attr.hostname = addr;
    try {
      c->dev = gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception &e) {
      throw Recorded(wf_error(WEFT_ESYS, "cannot listen on %s: %s", addr, gloo_text(e.what()).c_str()));
    }
    c->ctx = std::make_shared<gloo::rendezvous::Context>(me, size);
    c->ctx->setTimeout(ms(timeout));
    WeftStore store(s, prefix, c->name, c->ranks.data(), size, timeout);
    try {
      c->ctx->connectFullMesh(store, c->dev);
    } catch (...) {
      store.forget();
      throw;
    }
    // every rank has read every address: the keys can go; the addresses
    // stay here for messages
    const void *all = nullptr;
    const size_t *lens = nullptr;
    int brc = weft_cpugroup_allgather(g, addr, strlen(addr), &all, &lens);
    store.forget();
    if (brc) throw Recorded(wf_error_context(brc, "after connecting"));
    const char *p = static_cast<const char *>(all);
    for (int i = 0; i < size; i++) { c->addrs.emplace_back(p, lens[i]); p += lens[i]; }
  });
  if (rc) {
    weft_gloo_destroy(c);
    return rc;
  }
  wf_log(1, "gloo: group '%s' index %d of %d connected from %s", name, me, size, addr);
  *out = c;
  return 0;
}

int weft_gloo_destroy(weft_gloo *c) {
  if (!c) return 0;
  NoSigpipe no_sigpipe;  // tearing down pairs may flush to closed peers
  try {
    c->sync_recv.clear();
    c->sctx.reset();
    c->ctx.reset();
    c->dev.reset();
  } catch (...) {
  }
  if (c->s) wf_store_unref(c->s);
  delete c;
  return 0;
}

int weft_gloo_set_timeout(weft_gloo *c, int timeout_ms) {
  WF_CHECK_ARG(c && timeout_ms > 0, "weft_gloo_set_timeout: NULL handle or timeout %d <= 0", timeout_ms);
  c->timeout_ms = timeout_ms;
  return 0;
}

// the words set for this call (weft_gloo_set_call), cleared
static void take_words(weft_gloo *c, uint64_t words[2]) {
  words[0] = c->next_shape;
  words[1] = c->next_args;
  c->next_shape = c->next_args = 0;
}

int weft_gloo_set_call(weft_gloo *c, uint64_t shape_word, uint64_t args_word) {
  WF_CHECK_ARG(c, "weft_gloo_set_call: NULL handle");
  c->next_shape = shape_word;
  c->next_args = args_word;
  return 0;
}

int weft_gloo_all_reduce(weft_gloo *c, const void *in, void *out, size_t count, int dtype,
                         int op) {
  WF_CHECK_ARG(c, "weft_gloo_all_reduce: NULL handle");
  uint64_t words[2];
  take_words(c, words);
  WF_CHECK_ARG(reducible(dtype) && known_op(op), "weft_gloo_all_reduce: group '%s': dtype %d / op %d "
               "cannot be reduced", c->name.c_str(), dtype, op);
  WF_CHECK_ARG(count == 0 || (in && out), "weft_gloo_all_reduce: NULL buffer");
  if (count == 0) return 0;
  size_t es = weft_dtype_size(dtype);
  WF_CHECK_ARG(count <= SIZE_MAX / es, "weft_gloo_all_reduce: group '%s': %zu elements of %zu "
               "bytes overflows the address space", c->name.c_str(), count, es);
  return guarded(c, "all_reduce", [&] {
    if (c->size == 1) { if (in != out) memcpy(out, in, count * es); return; }
    agree(c, kAgreeAllReduce, dtype, op, -1, count * es, words);
    if (sync_applies(c, count * es)) { sync_allreduce(c, in, out, count, dtype, op); return; }
    switch (es) {
      case 1: run_allreduce<uint8_t>(c, in, out, count, dtype, op); break;
      case 2: run_allreduce<uint16_t>(c, in, out, count, dtype, op); break;
      case 4: run_allreduce<uint32_t>(c, in, out, count, dtype, op); break;
      default: run_allreduce<uint64_t>(c, in, out, count, dtype, op); break;
    }
  });
}

int weft_gloo_all_gather(weft_gloo *c, const void *in, void *out, size_t bytes) {
  WF_CHECK_ARG(c, "weft_gloo_all_gather: NULL handle");
  uint64_t words[2];
  take_words(c, words);
  WF_CHECK_ARG(bytes == 0 || (in && out), "weft_gloo_all_gather: NULL buffer");
  if (bytes == 0) return 0;
  WF_CHECK_ARG(bytes <= SIZE_MAX / (size_t)c->size, "weft_gloo_all_gather: group '%s': %zu bytes "
               "from each of %d ranks overflows the address space", c->name.c_str(), bytes, c->size);
  return guarded(c, "all_gather", [&] {
    uint8_t *o = static_cast<uint8_t *>(out);
    if (c->size == 1) { if (in != out) memmove(o, in, bytes); return; }
    agree(c, kAgreeAllGather, -1, -1, -1, bytes, words);
    gloo::AllgatherOptions a(c->ctx);
    if (in != o + (size_t)c->me * bytes) a.setInput(static_cast<uint8_t *>(const_cast<void *>(in)), bytes);
    a.setOutput(o, bytes * (size_t)c->size);
    a.setTag(c->tag++);
    a.setTimeout(ms(c->timeout_ms));
    gloo::allgather(a);
  });
}

// Ring reduce-scatter (world - 1 steps, each moving one chunk): bandwidth
// optimal, where an all-reduce would move the whole buffer twice.
int weft_gloo_reduce_scatter(weft_gloo *c, const void *in, void *out, size_t count_out,
                             int dtype, int op) {
  WF_CHECK_ARG(c, "weft_gloo_reduce_scatter: NULL handle");
  uint64_t words[2];
  take_words(c, words);
  WF_CHECK_ARG(reducible(dtype) && known_op(op), "weft_gloo_reduce_scatter: group '%s': dtype %d / "
               "op %d cannot be reduced", c->name.c_str(), dtype, op);
  WF_CHECK_ARG(count_out == 0 || (in && out), "weft_gloo_reduce_scatter: NULL buffer");
  if (count_out == 0) return 0;
  WF_CHECK_ARG(count_out <= SIZE_MAX / weft_dtype_size(dtype) / 2 / (size_t)c->size,
               "weft_gloo_reduce_scatter: group '%s': %zu elements of %zu bytes from each of %d "
               "ranks overflows the address space", c->name.c_str(), count_out,
               weft_dtype_size(dtype), c->size);
  size_t cb = count_out * weft_dtype_size(dtype);
  return guarded(c, "reduce_scatter", [&] {
    const int W = c->size, me = c->me;
    const uint8_t *src = static_cast<const uint8_t *>(in);
    if (W == 1) { memmove(out, src, cb); return; }
    agree(c, kAgreeReduceScatter, dtype, op, -1, cb, words);
    // acc: this rank's running chunk; the chunk that ends here is index me
    c->scratch.resize(2 * cb);
    uint8_t *acc = c->scratch.data(), *tmp = acc + cb;
    int next = (me + 1) % W, prev = (me + W - 1) % W;
    uint64_t slot = kSlotRs | c->tag++;
    auto sb = c->ctx->createUnboundBuffer(acc, cb);
    auto rb = c->ctx->createUnboundBuffer(tmp, cb);
    // step s: send my partial of chunk (me - s - 1), receive prev's partial of (me - s - 2)
    memcpy(acc, src + (size_t)((me + W - 1) % W) * cb, cb);
    for (int s = 0; s < W - 1; s++) {
      rb->recv(prev, slot);
      sb->send(next, slot);
      wait_recv(c, *rb);
      wait_send(c, *sb);
      int chunk = ((me - s - 2) % W + 2 * W) % W;
      const void *srcs[2] = {tmp, src + (size_t)chunk * cb};
      if (weft_host_reduce(acc, srcs, 2, count_out, dtype, op))
        throw Recorded(wf_error_context(WEFT_EINVAL, "reduction"));
    }
    memcpy(out, acc, cb);
  });
}

int weft_gloo_broadcast(weft_gloo *c, void *buf, size_t bytes, int root) {
  WF_CHECK_ARG(c, "weft_gloo_broadcast: NULL handle");
  uint64_t words[2];
  take_words(c, words);
  WF_CHECK_ARG(root >= 0 && root < c->size, "weft_gloo_broadcast: group '%s': root %d out of range "
               "[0, %d)", c->name.c_str(), root, c->size);
  WF_CHECK_ARG(bytes == 0 || buf, "weft_gloo_broadcast: NULL buffer");
  if (bytes == 0) return 0;
  return guarded(c, "broadcast", [&] {
    if (c->size == 1) return;
    agree(c, kAgreeBroadcast, -1, -1, root, bytes, words);
    gloo::BroadcastOptions b(c->ctx);
    b.setOutput(static_cast<uint8_t *>(buf), bytes);
    b.setRoot(root);
    b.setTag(c->tag++);
    b.setTimeout(ms(c->timeout_ms));
    gloo::broadcast(b);
  });
}

// A member that cannot make its call (its node's ranks disagreed, on the
// node hierarchy) still takes part in the call's agreement round, its word
// marked refused: the members waiting in that round fail at once naming it,
// instead of at the timeout. The round waits at most wait_ms for their
// words (they may be in another route's exchange); this member's result is
// the mismatch, or that wait's failure.
int weft_gloo_refuse(weft_gloo *c, int wait_ms) {
  WF_CHECK_ARG(c && wait_ms > 0, "weft_gloo_refuse: NULL handle or wait %d <= 0", wait_ms);
  uint64_t words[2];
  take_words(c, words);
  const int saved = c->timeout_ms;
  c->timeout_ms = wait_ms < saved ? wait_ms : saved;
  int rc = guarded(c, "refuse", [&] {
    if (c->size > 1) agree(c, kAgreeRefused, -1, -1, -1, 0, nullptr);
  });
  c->timeout_ms = saved;
  return rc;
}

int weft_gloo_barrier(weft_gloo *c) {
  return guarded(c, "barrier", [&] {
    if (c->size == 1) return;
    // the agreement words' exchange is itself a barrier: every member sent
    // its word before any returns, and a member that called something else
    // fails with the others
    agree(c, kAgreeBarrier, -1, -1, -1, 0, nullptr);
  });
}

int weft_gloo_send(weft_gloo *c, const void *buf, size_t bytes, int dst) {
  WF_CHECK_ARG(c, "weft_gloo_send: NULL handle");
  WF_CHECK_ARG(dst >= 0 && dst < c->size && dst != c->me, "weft_gloo_send: group '%s': dst %d is "
               "not a peer (group of %d, this index %d)", c->name.c_str(), dst, c->size, c->me);
  WF_CHECK_ARG(bytes > 0 && buf, "weft_gloo_send: NULL or empty buffer");
  return guarded(c, "send", [&] {
    auto b = c->ctx->createUnboundBuffer(const_cast<void *>(buf), bytes);
    b->send(dst, kSlotP2p | (c->sent[dst]++ & 0xffffffffffffull));
    wait_send(c, *b);
  });
}

int weft_gloo_recv(weft_gloo *c, void *buf, size_t bytes, int src) {
  WF_CHECK_ARG(c, "weft_gloo_recv: NULL handle");
  WF_CHECK_ARG(src >= 0 && src < c->size && src != c->me, "weft_gloo_recv: group '%s': src %d is "
               "not a peer (group of %d, this index %d)", c->name.c_str(), src, c->size, c->me);
  WF_CHECK_ARG(bytes > 0 && buf, "weft_gloo_recv: NULL or empty buffer");
  return guarded(c, "recv", [&] {
    auto b = c->ctx->createUnboundBuffer(buf, bytes);
    b->recv(src, kSlotP2p | (c->recvd[src]++ & 0xffffffffffffull));
    wait_recv(c, *b);
  });
}

}  // extern "C"
