#!/bin/bash
# stall_procs.sh PATTERN SECONDS: for SECONDS, stops the processes whose
# command line matches PATTERN (pgrep -f; write it so that it does not match
# this script's own line, e.g. "^luajit [t]ests/...") for 25-60 ms at a time,
# one after another, 10-60 ms apart: a rank descheduled at any point of its
# work, as on a loaded machine. Every stopped process is continued on exit.
pat=$1
end=$((SECONDS + ${2:-30}))
stopped=""
cont_all() { [ -n "$stopped" ] && kill -CONT $stopped 2>/dev/null; }
trap 'cont_all; exit 0' EXIT TERM INT
while [ $SECONDS -lt $end ]; do
  for p in $(pgrep -f "$pat"); do
    stopped=$p
    kill -STOP "$p" 2>/dev/null
    sleep "0.0$((25 + RANDOM % 35))"
    kill -CONT "$p" 2>/dev/null
    stopped=""
  done
  sleep "0.0$((10 + RANDOM % 50))"
done
