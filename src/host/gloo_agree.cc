// gloo_agree.cc — the agreement word every Gloo collective sends before its
// data (docs/faults.md, "Every call agreed"): one round of fixed-size direct
// messages, compared on every rank.
#include "host/gloo_internal.h"

extern "C" {
#include "core/shape_word.h"
}
#include "store/store_proto.h"

#include <cstdio>
#include <cstring>

namespace wf_gloo {
namespace {

constexpr uint64_t kSlotAgree = 0xE2ull << 56;  // the agreement words (agree below)

// ---- the agreement word (docs/faults.md, "Every call agreed") ----
// Before its data moves, every collective sends a fixed 48-byte word (the
// kind, dtype, op, root and byte count of this rank's call, and its shape
// and args words: core/shape_word.h) to every other member and reads theirs: one round of direct
// messages of one size, which no call can mismatch. Ranks whose calls
// differ then all fail at once with the same message, naming every rank's
// call, instead of Gloo pairing buffers of different sizes (its enforce
// fails in its I/O thread and ends the process), or pairing a broadcast
// with another root until the timeout, or reducing f16 with bf16 bits. The
// data step is skipped on every rank, so the communicator stays usable.
constexpr uint32_t kAgreeMark = 0x57414732u;  // "WAG2" (2: the shape and args words at 32, 40)
constexpr size_t kWord = 48;                  // bytes of one member's word

const char *agree_kind(uint32_t k) {
  switch (k) {
    case kAgreeAllReduce: return "all_reduce";
    case kAgreeAllGather: return "all_gather";
    case kAgreeReduceScatter: return "reduce_scatter";
    case kAgreeBroadcast: return "broadcast";
    case kAgreeBarrier: return "barrier";
    case kAgreeRefused: return "refused";
    default: return "?";
  }
}
const char *agree_dtype(int32_t d) {
  switch (d) {
    case WEFT_F32: return "f32"; case WEFT_F16: return "f16"; case WEFT_BF16: return "bf16";
    case WEFT_I32: return "i32"; case WEFT_I64: return "i64"; case WEFT_U8: return "u8";
    case WEFT_F64: return "f64"; case WEFT_F8E4M3: return "f8e4m3"; default: return "bytes";
  }
}
const char *agree_op(int32_t o) {
  switch (o) {
    case WEFT_SUM: return "sum"; case WEFT_MAX: return "max"; case WEFT_MIN: return "min";
    case WEFT_PROD: return "prod"; default: return "?";
  }
}

std::string agree_describe(const weft_gloo *c, const uint8_t *w) {
  if (wf_get_u32(w) != kAgreeMark) return "something else (not a weft Gloo collective)";
  uint32_t kind = wf_get_u32(w + 4);
  int32_t dtype = (int32_t)wf_get_u32(w + 8), op = (int32_t)wf_get_u32(w + 12), root = (int32_t)wf_get_u32(w + 16);
  uint64_t bytes = wf_get_u64(w + 24);
  char buf[260], sh[96];
  int k = wf_shape_word_text(wf_get_u64(w + 32), sh, sizeof sh);
  if (k < 0 || k >= (int)sizeof sh) k = 0;
  wf_args_word_text(wf_get_u64(w + 40), sh + k, sizeof sh - k);
  size_t es = weft_dtype_size(dtype);
  switch (kind) {
    case kAgreeAllReduce: case kAgreeReduceScatter:
      snprintf(buf, sizeof buf, "%s %s x%llu (%s)%s", agree_kind(kind), agree_dtype(dtype),
               (unsigned long long)(es ? bytes / es : bytes), agree_op(op), sh);
      break;
    case kAgreeBroadcast:
      snprintf(buf, sizeof buf, "broadcast of %llu bytes from rank %d%s", (unsigned long long)bytes,
               root >= 0 && root < c->size ? c->ranks[root] : root, sh);
      break;
    case kAgreeAllGather:
      snprintf(buf, sizeof buf, "all_gather of %llu bytes%s", (unsigned long long)bytes, sh);
      break;
    case kAgreeRefused:
      snprintf(buf, sizeof buf, "no call: it refused this one (its node's ranks called different collectives)");
      break;
    default: snprintf(buf, sizeof buf, "%s", agree_kind(kind));
  }
  return buf;
}

}  // namespace

void agree(weft_gloo *c, uint32_t kind, int dtype, int op, int root, uint64_t bytes, const uint64_t *words) {
  const int W = c->size;
  c->agree_buf.assign((size_t)W * kWord, 0);
  uint8_t *mine = c->agree_buf.data() + (size_t)c->me * kWord;
  wf_put_u32(mine, kAgreeMark);
  wf_put_u32(mine + 4, kind);
  wf_put_u32(mine + 8, (uint32_t)dtype);
  wf_put_u32(mine + 12, (uint32_t)op);
  wf_put_u32(mine + 16, (uint32_t)root);
  wf_put_u64(mine + 24, bytes);
  wf_put_u64(mine + 32, words ? words[0] : 0);
  wf_put_u64(mine + 40, words ? words[1] : 0);
  const uint64_t slot = kSlotAgree | c->agree_seq++;
  auto ub = c->ctx->createUnboundBuffer(c->agree_buf.data(), c->agree_buf.size());
  for (int i = 0; i < W; i++) {
    if (i == c->me) continue;
    ub->recv(i, slot, (size_t)i * kWord, kWord);
    ub->send(i, slot, (size_t)c->me * kWord, kWord);
  }
  // a failure names the members not heard from (a peer that failed first
  // resets its connections: the missing ones are the news, not that reset)
  std::vector<bool> heard(W, false);
  heard[c->me] = true;
  try {
    for (int i = 0; i < W - 1; i++) {
      int src = -1;
      if (!ub->waitRecv(&src, ms(c->timeout_ms))) throw std::runtime_error("recv aborted");
      if (src >= 0 && src < W) heard[src] = true;
    }
    for (int i = 0; i < W - 1; i++) wait_send(c, *ub);
  } catch (const std::exception &ex) {
    std::string missing;
    for (int i = 0; i < W; i++)
      if (!heard[i]) missing.append(missing.empty() ? "" : ", ").append(std::to_string(c->ranks[i]));
    if (missing.empty()) throw;
    throw std::runtime_error(std::string(ex.what()) + " (this call's agreement words from rank(s) " + missing +
                             " had not arrived)");
  }
  bool bad = false;
  for (int i = 0; i < W && !bad; i++) bad = memcmp(c->agree_buf.data() + (size_t)i * kWord, mine, kWord) != 0;
  if (!bad) return;
  // every rank's call, ranks grouped by call in order of their first rank
  std::vector<std::string> what(W);
  for (int i = 0; i < W; i++) what[i] = agree_describe(c, c->agree_buf.data() + (size_t)i * kWord);
  std::vector<bool> seen(W, false);
  std::string msg;
  for (int i = 0; i < W; i++) {
    if (seen[i]) continue;
    std::string who;
    int n = 0;
    for (int j = i; j < W; j++)
      if (!seen[j] && what[j] == what[i]) {
        seen[j] = true;
        who.append(n++ ? ", " : "").append(std::to_string(c->ranks[j]));
      }
    msg.append(msg.empty() ? "" : "; ").append(n > 1 ? "ranks " : "rank ").append(who).append(": ").append(what[i]);
  }
  throw Mismatch{msg};
}

}  // namespace wf_gloo
