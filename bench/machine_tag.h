/* machine_tag.h — the machine part of a results file's name, from the GPU
 * the benchmark ran on (cudaGetDeviceProperties' name) and the number of
 * GPUs: "NVIDIA H100 80GB HBM3", 1 -> "nvidia-h100"; "NVIDIA H200", 2 ->
 * "nvidia-h200-x2"; "NVIDIA A100-SXM4-80GB" -> "nvidia-a100". The rule: the
 * first two words, lower case, the second cut at its first '-' (memory and
 * form factor are not the GPU), joined by '-', then "-xN" for N > 1 GPUs.
 * Pure (no CUDA): lua/weft/tools/bench.lua's device_tag is the same rule, and
 * tests/unit/bench_names_spec.lua checks both on the CPU. */
#ifndef WEFT_BENCH_MACHINE_TAG_H
#define WEFT_BENCH_MACHINE_TAG_H

#include <ctype.h>
#include <stdio.h>
#include <string.h>

static inline void weft_machine_tag(const char *device_name, int ndev, char *out, size_t cap) {
  if (cap == 0) return;
  size_t n = 0;
  int word = 0;
  const char *p = device_name ? device_name : "";
  while (*p && word < 2) {
    while (*p == ' ' || *p == '\t') p++;
    if (!*p) break;
    if (word == 1 && n + 1 < cap) out[n++] = '-';
    while (*p && *p != ' ' && *p != '\t') {
      if (word == 1 && *p == '-') { while (*p && *p != ' ' && *p != '\t') p++; break; }
      unsigned char c = (unsigned char)*p++;
      if (!isalnum(c)) c = '-';
      if (n + 1 < cap) out[n++] = (char)tolower(c);
    }
    word++;
  }
  if (n == 0) {
    snprintf(out, cap, "unknown");
    n = strlen(out);
  } else {
    out[n] = '\0';
  }
  if (ndev > 1 && n < cap) snprintf(out + n, cap - n, "-x%d", ndev);
}

#endif
