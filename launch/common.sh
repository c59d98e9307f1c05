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
