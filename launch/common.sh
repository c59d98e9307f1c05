# Shared by the launch scripts: `run` prints a command instead of running it when DRY_RUN=1 (see what a launch
# would do before paying for it), `need` stops with a message when a setting is missing.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PY:-python}"
run() { if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "$@"; echo; else "$@"; fi; }
need() { [ -n "${!1:-}" ] || { echo "set $1: $2" >&2; exit 2; }; }
# The checkpoint to resume from: the newest complete one in the local run or its persistent mirror, else `auto`.
resume_source() {
  if [ -n "${DRY_RUN:-}" ]; then run "$PY" "$HERE/resume_from.py" "$@" >&2; echo auto
  else "$PY" "$HERE/resume_from.py" "$@"; fi
}
# A token-level preset with no data.tokenizer: print the data.tokenizer=... setting of its tokenizer, trained once on
# the preset's own data into $2/tokenizers (every node of a job can run this: the file is written whole, then renamed).
tokenizer_setting() {
  local config="$1" dir="$2"; shift 2
  "$PY" -c 'import sys; from cipher_nb.config.load import load_config; c = load_config(sys.argv[1], sys.argv[2:])
sys.exit(0 if c.data.codec == "tokenizer" and not c.data.tokenizer else 1)' "$config" "$@" || return 0
  local tok="$dir/tokenizers/$(basename "$config" .yaml).json"
  [ -f "$tok" ] || run cipher-tokenizer "$config" "$@" --out "$tok" >&2
  echo "data.tokenizer=$tok"
}
# A preset that reads one source of documents as it trains: print the directory its documents are tokenized into once,
# $2/shards/<preset> (`cipher-data prepare --wait`: every node of a job can run this; one prepares while the others
# wait for its lock and then find it finished; a relaunch finds its manifest, written last, and prepares nothing). A
# curriculum (data.phases), a preset already on shards, or SHARDS=0 prints nothing: those read as they train.
shards_dir() {
  local config="$1" dir="$2"; shift 2
  [ "${SHARDS:-1}" != 0 ] || return 0
  "$PY" -c 'import sys; from cipher_nb.config.load import load_config; d = load_config(sys.argv[1], sys.argv[2:]).data
sys.exit(0 if d.source != "shards" and not d.phases else 1)' "$config" "$@" || return 0
  local out="$dir/shards/$(basename "$config" .yaml)"
  # prepared already: the run checks every shard against the manifest before step 0, so hashing them here is not needed
  [ -f "$out/manifest.json" ] || run cipher-data prepare "$config" "$@" --out "$out" --procs "$(nproc)" --wait --quiet >&2
  echo "$out"
}
# torchrun, with a stop signal passed on once and a clean stop exiting 0. The launcher takes SIGTERM, SIGINT and SIGHUP
# and passes each to torchrun, which runs in a session of its own: a signal to the launcher's process group (a
# scheduler's, Ctrl-C) would otherwise reach every worker twice, from the group and from torchrun, and a second signal
# makes cipher-train exit at once instead of saving. torchrun passes it to each worker and then exits 1 with a
# traceback however they ended; when the run saved its stop checkpoint during this launch (launch/stopped_cleanly.py),
# the launch exits 0, as cipher-train alone does. Any other exit, or a stop that saved nothing, keeps torchrun's code.
# $1: the run directory; the rest: torchrun's arguments.
launch_torchrun() {
  local out="$1"; shift
  if [ -n "${DRY_RUN:-}" ]; then run torchrun "$@"; return; fi
  local before rc=0 found
  before="$("$PY" "$HERE/stopped_cleanly.py" "$out")"
  STOP_SIGNAL=""
  setsid torchrun "$@" &
  TORCHRUN=$!
  for s in TERM INT HUP; do trap "STOP_SIGNAL=$s; kill -$s \$TORCHRUN 2>/dev/null" "$s"; done
  while true; do  # a trapped signal ends `wait` early: wait again until torchrun has exited
    rc=0; wait "$TORCHRUN" || rc=$?
    kill -0 "$TORCHRUN" 2>/dev/null || break
  done
  trap - TERM INT HUP
  if [ "$rc" -ne 0 ] && [ -n "$STOP_SIGNAL" ] && found="$("$PY" "$HERE/stopped_cleanly.py" "$out" "$before")"; then
    echo "launch: torchrun exited $rc after SIG$STOP_SIGNAL, and the run stopped cleanly ($found): exit 0" >&2
    return 0
  fi
  return "$rc"
}
