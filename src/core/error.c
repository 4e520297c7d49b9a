/* error.c — thread-local last error and stderr logging gated by WEFT_LOG. */
#include "internal.h"

#include <stdio.h>
#include <string.h>

#define WF_ERR_CAP 1024

static __thread char tl_msg[WF_ERR_CAP];

const char *weft_last_error(void) { return tl_msg; }

void wf_clear_error(void) { tl_msg[0] = '\0'; }

static int vset(int code, const char *suffix, const char *fmt, va_list ap) {
  int n = vsnprintf(tl_msg, WF_ERR_CAP, fmt, ap);
  if (suffix && n >= 0 && n < WF_ERR_CAP)
    snprintf(tl_msg + n, (size_t)(WF_ERR_CAP - n), ": %s", suffix);
  wf_log(2, "error %d: %s", code, tl_msg);
  return code;
}

int wf_error(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vset(code, NULL, fmt, ap);
  va_end(ap);
  return code;
}

int wf_error_errno(int code, const char *fmt, ...) {
  char buf[128];
  int e = errno;
  const char *s = strerror_r(e, buf, sizeof buf);
  va_list ap;
  va_start(ap, fmt);
  vset(code, s, fmt, ap);
  va_end(ap);
  return code;
}

int wf_error_context(int code, const char *fmt, ...) {
  char prev[WF_ERR_CAP], ctx[256];
  va_list ap;
  memcpy(prev, tl_msg, WF_ERR_CAP);
  va_start(ap, fmt);
  vsnprintf(ctx, sizeof ctx, fmt, ap);
  va_end(ap);
  snprintf(tl_msg, WF_ERR_CAP, "%s: %s", ctx, prev);
  return code;
}

int wf_log_level(void) {
  static int level = -1;
  if (level < 0) level = (int)wf_env_long("WEFT_LOG", 0);
  return level;
}

void wf_log(int level, const char *fmt, ...) {
  if (wf_log_level() < level) return;
  char line[1200];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  fprintf(stderr, "[weft] %s\n", line);
}
