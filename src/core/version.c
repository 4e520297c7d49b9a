/* version.c — ABI version and build description. */
#include "internal.h"

#ifndef WEFT_BUILD_INFO
#define WEFT_BUILD_INFO "cuda=no"
#endif

int weft_abi_version(void) { return 4; }

const char *weft_build_info(void) { return WEFT_BUILD_INFO; }

size_t weft_dtype_size(int dtype) {
  switch (dtype) {
  case WEFT_F32: case WEFT_I32: return 4;
  case WEFT_F16: case WEFT_BF16: return 2;
  case WEFT_I64: case WEFT_F64: return 8;
  case WEFT_U8: case WEFT_F8E4M3: return 1;
  default: return 0;
  }
}
