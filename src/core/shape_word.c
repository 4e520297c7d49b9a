/* shape_word.c — weft_shape_word and weft_args_word for the Lua layer (the encoding is in
 * shape_word.h, shared with the shm and Gloo paths that print it). */
#include "shape_word.h"
#include "weft.h"

uint64_t weft_shape_word(int ndim, const int64_t *dims) { return wf_shape_word(ndim, dims); }
uint64_t weft_args_word(const char *s, size_t n) { return wf_args_word(s, n); }
