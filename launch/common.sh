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
# A preset whose hub sources are not all pinned to a commit (after the overrides $3...): print the path of its copy
# pinned to the commits the local hub cache resolved them to (`cipher-data pin`), written once into the folder $2 under
# the preset's own name (so its tokenizer and shards keep their names); a relaunch finds the copy and pins nothing
# again, so every stage of a run reads the same data. PIN_API=1 asks the Hub for a source the cache lacks; without it
# such a source fails the pin, one line and exit 2. Any other preset: its own path. A dry run prints the pin and goes
# on with the preset as given.
pinned_preset() {
  local config="$1" dir="$2"; shift 2
  "$PY" -c 'import sys; from cipher_nb.config.load import load_config; from cipher_nb.data.sources import is_commit, source_specs
specs = source_specs(load_config(sys.argv[1], sys.argv[2:]).data).values()
sys.exit(0 if any(s.source == "hub" and not is_commit(s.revision) for s in specs) else 1)' "$config" "$@" \
    || { echo "$config"; return 0; }
  local out="$dir/$(basename "$config")"
  if [ -n "${DRY_RUN:-}" ]; then run cipher-data pin "$config" --out "$out" ${PIN_API:+--api} >&2; echo "$config"; return; fi
  [ -f "$out" ] || { mkdir -p "$dir" && cipher-data pin "$config" --out "$out" ${PIN_API:+--api} >&2; } || return
  echo "$out"
}
# A token-level preset with no data.tokenizer: print the data.tokenizer=... setting of its tokenizer, trained once on
# the preset's own data into $2/tokenizers (every node of a job can run this: the file is written whole, then renamed).
tokenizer_setting() {
  local config="$1" dir="$2"; shift 2
  "$PY" -c 'import sys; from cipher_nb.config.load import load_config; c = load_config(sys.argv[1], sys.argv[2:])
sys.exit(0 if c.data.codec == "tokenizer" and not c.data.tokenizer else 1)' "$config" "$@" || return 0
  local tok="$dir/tokenizers/$(basename "$config" .yaml).json"
  [ -f "$tok" ] || run cipher-tokenizer "$config" "$@" --out "$tok" >&2 || return  # a failure: its exit code
  echo "data.tokenizer=$tok"
}
# A preset that reads its documents as it trains: print, one a line, the settings that read them instead from shards
# tokenized once into $2/shards/<preset> (`cipher-data prepare --wait`: every node of a job can run this; one prepares
# while the others wait for its lock and then find it finished; a relaunch finds its manifest, written last, and
# prepares nothing). One source: data.source=shards data.path=DIR. A curriculum (data.sources with data.phases) is
# prepared into one directory whose manifest names each document's source: each source reads its own
# (data.sources.NAME.source=shards, data.sources.NAME.path=DIR), and the phases mix them as before. A preset already on
# shards, or SHARDS=0, prints nothing: it reads as it trains.
shards_settings() {
  local config="$1" dir="$2" names; shift 2
  [ "${SHARDS:-1}" != 0 ] || return 0
  names="$("$PY" -c 'import sys; from cipher_nb.config.load import load_config
d = load_config(sys.argv[1], sys.argv[2:]).data
kinds = {s.get("source") for s in d.sources.values()} if d.sources else {d.source}
print(" ".join(d.sources) if d.sources else "-")
sys.exit(1 if kinds == {"shards"} else 0)' "$config" "$@")" || return 0
  local out="$dir/shards/$(basename "$config" .yaml)"
  # prepared already: the run checks every shard against the manifest before step 0, so hashing them here is not needed
  [ -f "$out/manifest.json" ] \
    || run cipher-data prepare "$config" "$@" --out "$out" --procs "$(nproc)" --wait --quiet >&2 || return
  if [ "$names" = - ]; then printf '%s\n' data.source=shards "data.path=$out"; return; fi
  for n in $names; do printf '%s\n' "data.sources.$n.source=shards" "data.sources.$n.path=$out"; done
}
# torchrun, with a stop signal passed on once and a clean stop exiting 0. The launcher takes SIGTERM, SIGINT and SIGHUP
# and passes each to torchrun, which runs in a session of its own: a signal to the launcher's process group (a
# scheduler's, Ctrl-C) would otherwise reach every worker twice, from the group and from torchrun, and a second signal
# makes cipher-train exit at once instead of saving. torchrun passes it to each worker and then exits 1 with a
# traceback however they ended; when the run saved its stop checkpoint during this launch (launch/stopped_cleanly.py),
# the launch exits 0, as cipher-train alone does. torchrun exits 1 whatever code its workers exited with; the root
# cause of its failure report names the first failed worker's, and the launch exits with it when it is 2 (bad input)
# or 3 (out of memory), as cipher-train alone would. Any other exit keeps torchrun's code.
# $1: the run directory; the rest: torchrun's arguments.
launch_torchrun() {
  local out="$1"; shift
  if [ -n "${DRY_RUN:-}" ]; then run torchrun "$@"; return; fi
  local before rc=0 found code log filter err
  before="$("$PY" "$HERE/stopped_cleanly.py" "$out")"
  log="$(mktemp)"
  # torchrun's stderr passes through, and the root cause's exit code is noted in $log; the filter ignores the stop
  # signals (one sent to the launcher's group reaches it too), so that torchrun can still write after one
  exec {err}> >(trap '' TERM INT HUP; exec awk -v f="$log" '{ print > "/dev/stderr"; fflush("/dev/stderr") }
    /^Root Cause/ { r = 1 } r && $1 == "exitcode" { print $3 > f; close(f); r = 0 }')
  filter=$!
  STOP_SIGNAL=""
  setsid torchrun "$@" 2>&"$err" &
  TORCHRUN=$!
  for s in TERM INT HUP; do trap "STOP_SIGNAL=$s; kill -$s \$TORCHRUN 2>/dev/null" "$s"; done
  while true; do  # a trapped signal ends `wait` early: wait again until torchrun has exited
    rc=0; wait "$TORCHRUN" || rc=$?
    kill -0 "$TORCHRUN" 2>/dev/null || break
  done
  trap - TERM INT HUP
  exec {err}>&-
  wait "$filter" 2>/dev/null || true  # until the filter has read the last line
  code="$(cat "$log")"; rm -f "$log"
  if [ "$rc" -ne 0 ] && [ -n "$STOP_SIGNAL" ] && found="$("$PY" "$HERE/stopped_cleanly.py" "$out" "$before")"; then
    echo "launch: torchrun exited $rc after SIG$STOP_SIGNAL, and the run stopped cleanly ($found): exit 0" >&2
    return 0
  fi
  if [ "$rc" -ne 0 ] && { [ "$code" = 2 ] || [ "$code" = 3 ]; }; then
    echo "launch: torchrun exited $rc, its first failed worker $code: exit $code" >&2
    return "$code"
  fi
  return "$rc"
}
