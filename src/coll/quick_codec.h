/* quick_codec.h — the wire formats of the quick (compressed two-shot)
 * all-reduce, shared by kernels/quick_allreduce.cu, its CPU reference
 * (src/coll/quick_ref.c) and the host side (src/coll/allreduce.c).  Plain C.
 *
 * A codec turns a block of WF_QR_BLOCK consecutive elements (bf16 or f16,
 * the block aligned to the start of the buffer) into one f32 scale s and
 * WF_QR_BLOCK codes:
 *   int8: q = rint(x * r) in [-127, 127], stored as int8
 *   int4: q = rint(x * r) in [-7, 7], stored as a two's-complement nibble
 *   fp8:  q = e4m3(x * r) (round to nearest even, saturating at 448)
 * with a = max |x| over the block, r = QMAX / a (QMAX 127, 7, 448) and
 * s = a / QMAX; the value it stands for is q * s.  (Blocks whose a is below
 * 2^-60 are scaled by 2^64 first, exactly, so r never overflows.)  a = 0:
 * s = 0 and q = 0.  Any NaN or ±Inf in the block: s = NaN, so every element
 * of that block decodes to NaN, and no other block is touched.
 * fp ("no compression"): the wire is the input dtype itself.
 *
 * Every f32 operation is one IEEE operation rounded to nearest (no fused
 * multiply-add), so the CPU reference reproduces the kernel's bits.
 *
 * Wire layout of one part (WF_QR_PART vectors of 16 bytes = 8 elements):
 * the codes of vector l at l * code_bytes, then the part's scales (one f32
 * per block of 4 vectors) at WF_QR_PART * code_bytes. */
#ifndef WEFT_QUICK_CODEC_H
#define WEFT_QUICK_CODEC_H

#include <stdint.h>

enum { WF_QR_FP = 0, WF_QR_INT8 = 1, WF_QR_INT4 = 2, WF_QR_FP8 = 3, WF_QR_NCODECS = 4 };

#define WF_QR_BLOCK 32                /* elements per scale */
#define WF_QR_VEC_PER_BLOCK 4         /* 16-byte vectors (8 elements) per block */
#define WF_QR_THREADS 512             /* threads per block of the kernel: one vector each */
#define WF_QR_PART WF_QR_THREADS      /* vectors in one rank's part of a chunk */

/* Largest code magnitude (fp8: e4m3's largest finite value). */
static inline float wf_qr_qmax(int codec) {
  return codec == WF_QR_INT8 ? 127.0f : codec == WF_QR_INT4 ? 7.0f : 448.0f;
}
/* Bytes of code per 16-byte input vector (8 elements). */
static inline int wf_qr_code_bytes(int codec) {
  return codec == WF_QR_INT8 ? 8 : codec == WF_QR_INT4 ? 4 : codec == WF_QR_FP8 ? 8 : 16;
}
/* Bytes of one part on the wire (codes, then scales). */
static inline uint64_t wf_qr_part_bytes(int codec) {
  uint64_t b = (uint64_t)WF_QR_PART * (uint64_t)wf_qr_code_bytes(codec);
  if (codec != WF_QR_FP) b += (uint64_t)WF_QR_PART / WF_QR_VEC_PER_BLOCK * 4u;
  return b;
}
/* Chunks of world parts that cover nvec vectors. */
static inline uint64_t wf_qr_chunks(uint64_t nvec, int world) {
  const uint64_t cw = (uint64_t)WF_QR_PART * (uint64_t)world;
  return (nvec + cw - 1) / cw;
}
/* Bytes of one data parity region a quick call needs: (world-1) slots for
 * the reduce-scatter, (world-1) for the all-gather. */
static inline uint64_t wf_qr_data_need(int codec, uint64_t nvec, int world) {
  return 2u * (uint64_t)(world - 1) * wf_qr_chunks(nvec, world) * wf_qr_part_bytes(codec);
}
/* Wire bytes for count elements in the codec-step layout (parts of
 * WF_QR_PART vectors, the last one full): what weft_qr_codec_step uses. */
static inline uint64_t wf_qr_wire_bytes(int codec, uint64_t nvec) {
  return (nvec + WF_QR_PART - 1) / WF_QR_PART * wf_qr_part_bytes(codec);
}

#endif
