/* limits.h — the limits every device collective shares, defined once: the
 * largest group (flag rows, agreement slots and peer tables are sized by it)
 * and the most blocks of a grid (epoch slots and flag rows per workspace).
 * Plain C: gcc and nvcc read it. */
#ifndef WEFT_COLL_LIMITS_H
#define WEFT_COLL_LIMITS_H

#define WF_MAX_WORLD 8
#define WF_MAX_GRID 1024

#endif
