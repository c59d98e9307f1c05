#!/usr/bin/env bash
# Keep a single-process run going: run the command, and when it crashes run it again, up to MAX_RESTARTS times.
# The command must continue its own run when started again, i.e. cipher-train with --out RUN_DIR --resume auto
# (on a fresh run directory that starts at step 0, so the same command serves the first attempt and the restarts).
#
#   MAX_RESTARTS=3 launch/supervise.sh cipher-train PRESET --out runs/a --resume auto [section.key=value ...]
#
# It follows cipher-train's exit codes: 0 (finished, or stopped cleanly by SIGTERM / SIGINT) ends the supervisor;
# 1 (the run failed, a full disk included) and a kill by a signal (status 128 + the signal's number) restart it;
# 2 (a usage or config error, or a run directory another live process is writing) and 3 (out of memory: the same
# step at the same shapes runs out again) end it at once, as does any other status, since the same command would
# fail the same way. The supervisor leaves with the last attempt's status. Environment: MAX_RESTARTS (3), RESTART_DELAY (seconds, 0).
set -uo pipefail
[ $# -gt 0 ] || { echo "usage: launch/supervise.sh COMMAND [ARGS...]" >&2; exit 2; }
MAX_RESTARTS="${MAX_RESTARTS:-3}"; RESTART_DELAY="${RESTART_DELAY:-0}"
child=""
# a SIGTERM / SIGINT to the supervisor goes to the run (which saves and stops cleanly), and no restart follows
stop() { [ -n "$child" ] && kill -TERM "$child" 2>/dev/null; wait "$child"; exit $?; }
trap stop TERM INT

attempt=0
while true; do
  "$@" &
  child=$!
  wait "$child"; rc=$?
  child=""
  case "$rc" in
    0) exit 0 ;;
    1) why="exit status $rc" ;;
    3) echo "supervise: out of memory (exit status 3): the same run would run out again; not restarting" >&2
       exit 3 ;;
    *) if [ "$rc" -gt 128 ]; then why="killed by signal $((rc - 128))"
       else echo "supervise: exit status $rc is not a crash (2: usage or config error): not restarting" >&2
            exit "$rc"; fi ;;
  esac
  if [ "$attempt" -ge "$MAX_RESTARTS" ]; then
    echo "supervise: $why, and all $MAX_RESTARTS restarts are spent: giving up" >&2
    exit "$rc"
  fi
  attempt=$((attempt + 1))
  echo "supervise: $why: restart $attempt of $MAX_RESTARTS" >&2
  sleep "$RESTART_DELAY"
done
