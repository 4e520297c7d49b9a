/* shape_word.h — a tensor's shape folded into one 64-bit word, compared with
 * the rest of a call on the shm and Gloo paths, so ranks that pass the same
 * element count in different shapes all fail (docs/faults.md, "Every call
 * agreed"). 0: no shape given (matches only 0). Up to 3 dims (one below
 * 2^60, two below 2^30 each, three below 2^20 each) the word holds the shape
 * exactly and messages print it; beyond, the number of dims and a 56-bit
 * hash of them. */
#ifndef WEFT_SHAPE_WORD_H
#define WEFT_SHAPE_WORD_H

#include <stdint.h>
#include <stdio.h>

#define WF_SW_EXACT (1ull << 62) /* bits 60-61: ndim; dims in 60 / ndim bits each */
#define WF_SW_HASH (2ull << 62)  /* bits 56-61: ndim (mod 64); bits 0-55: hash */

static inline uint64_t wf_shape_word(int ndim, const int64_t *dims) {
  if (ndim < 0 || (ndim > 0 && !dims)) return 0;
  const int bits = ndim > 0 && ndim <= 3 ? 60 / ndim : 0;
  int exact = ndim <= 3;
  for (int i = 0; i < ndim && exact; i++) exact = dims[i] >= 0 && (uint64_t)dims[i] < (1ull << bits);
  if (exact) {
    uint64_t w = WF_SW_EXACT | (uint64_t)ndim << 60;
    for (int i = 0; i < ndim; i++) w |= (uint64_t)dims[i] << (bits * (ndim - 1 - i));
    return w;
  }
  uint64_t h = 1469598103934665603ull; /* FNV-1a over ndim and every dim's bytes */
  for (int i = -1; i < ndim; i++) {
    uint64_t v = i < 0 ? (uint64_t)ndim : (uint64_t)dims[i];
    for (int b = 0; b < 8; b++) { h ^= (v >> (8 * b)) & 0xff; h *= 1099511628211ull; }
  }
  return WF_SW_HASH | ((uint64_t)ndim & 63) << 56 | (h & ((1ull << 56) - 1));
}

/* " [2,4]", " [5 dims #0a1b...]", or "" for 0; like snprintf */
static inline int wf_shape_word_text(uint64_t w, char *buf, size_t n) {
  if (!w) return snprintf(buf, n, "%s", "");
  if ((w >> 62) == 1) {
    const int nd = (int)(w >> 60 & 3), bits = nd ? 60 / nd : 0;
    int k = snprintf(buf, n, " [");
    for (int i = 0; i < nd; i++)
      k += snprintf(buf + (k < (int)n ? k : (int)n), k < (int)n ? n - k : 0, "%s%llu", i ? "," : "",
                    (unsigned long long)(w >> (bits * (nd - 1 - i)) & ((1ull << bits) - 1)));
    return k + snprintf(buf + (k < (int)n ? k : (int)n), k < (int)n ? n - k : 0, "]");
  }
  return snprintf(buf, n, " [%d dims #%014llx]", (int)(w >> 56 & 63),
                  (unsigned long long)(w & ((1ull << 56) - 1)));
}

/* The args word: what else the caller's call names, as weft.group's call
 * descriptions write it ("{2,3}" for the sizes of a v-collective, "dim=1",
 * "max" for the reduction of a gathered reduction): up to 7 bytes held as
 * they are (bit 63; bits 56-58: length), else a 56-bit hash (bit 62). */
static inline uint64_t wf_args_word(const char *s, size_t n) {
  if (!s || n == 0) return 0;
  if (n <= 7) {
    uint64_t w = 1ull << 63 | (uint64_t)n << 56;
    for (size_t i = 0; i < n; i++) w |= (uint64_t)(unsigned char)s[i] << (8 * i);
    return w;
  }
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) { h ^= (unsigned char)s[i]; h *= 1099511628211ull; }
  return 1ull << 62 | (h & ((1ull << 56) - 1));
}

/* " (max)", " (#0a1b...)", or "" for 0; like snprintf */
static inline int wf_args_word_text(uint64_t w, char *buf, size_t n) {
  if (!w) return snprintf(buf, n, "%s", "");
  if (w >> 63) {
    char s[8];
    int len = (int)(w >> 56 & 7);
    for (int i = 0; i < len; i++) s[i] = (char)(w >> (8 * i) & 0xff);
    return snprintf(buf, n, " (%.*s)", len, s);
  }
  return snprintf(buf, n, " (#%014llx)", (unsigned long long)(w & ((1ull << 56) - 1)));
}

#endif
