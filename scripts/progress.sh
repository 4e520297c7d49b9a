# progress.sh — progress lines for the GPU shell scripts (sourced by
# scripts/gpu-ar and scripts/gpu-fusion; the Lua tools have weft.internal.progress):
# what runs, step k of n, the time so far, and while a long phase runs, a
# line every PROGRESS_EVERY seconds (default 30) with its time against its
# budget and the last line of its log. On a terminal that line is rewritten
# in place; piped, one line each time. PROGRESS_QUIET=1 (the scripts' -q):
# none of it (results and failures are printed as before).
#
#   progress_init NAME                 the clock starts; lines begin "NAME: "
#   progress_step K N WHAT             "NAME: [K/N] WHAT (42 s so far)"
#   progress_run BUDGET LOG WHAT CMD...  runs CMD (a shell function too) in the
#                                      background until it ends; its status
progress_init() {
  PROGRESS_NAME=$1
  PROGRESS_T0=$(date +%s)
  PROGRESS_QUIET=${PROGRESS_QUIET:-0}
}

progress_secs() { echo $(( $(date +%s) - PROGRESS_T0 )); }

progress_step() {
  [ "${PROGRESS_QUIET:-0}" = 1 ] && return 0
  echo "$PROGRESS_NAME: [$1/$2] $3 ($(progress_secs) s so far)"
}

progress_run() {
  local budget=$1 log=$2 what=$3 pid rc t0 n=0 every=${PROGRESS_EVERY:-30} tty=0 line
  shift 3
  "$@" &
  pid=$!
  t0=$(date +%s)
  [ -t 1 ] && tty=1
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    n=$((n + 1))
    if [ "${PROGRESS_QUIET:-0}" != 1 ] && [ $((n % every)) = 0 ] && kill -0 "$pid" 2>/dev/null; then
      line="$PROGRESS_NAME: $what: $(( $(date +%s) - t0 )) s of at most $budget s; last: $(tail -n 1 "$log" 2>/dev/null | tr -d '\r' | cut -c1-100)"
      if [ $tty = 1 ]; then printf '\r\033[K%s' "$(echo "$line" | cut -c1-$(( ${COLUMNS:-80} - 1 )))"
      else echo "$line"; fi
    fi
  done
  wait "$pid"
  rc=$?
  [ $tty = 1 ] && [ "${PROGRESS_QUIET:-0}" != 1 ] && [ $n -ge "$every" ] && printf '\r\033[K'
  return $rc
}
