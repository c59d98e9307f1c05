#!/usr/bin/env bash
# A short smoke run before an expensive job, on the job's own preset and GPUs (a few minutes):
#   1. preflight;
#   2. train SMOKE_STEPS (20) steps on every GPU with a checkpoint half way, mirrored to the persistent volume, and
#      kill the job right after that checkpoint, as a preemption would;
#   3. resume from the mirror into an empty run directory, as a replacement machine would, and finish;
#   4. check that the export is complete and the metrics reach the last step; print the gate, write the plots.
#
#   PERSIST=/mnt/persist launch/smoke.sh examples/configs/h100.yaml [section.key=value ...]
#
# Environment: PERSIST (required), NPROC (8), SMOKE_STEPS (20), OUT (runs/smoke-<date>), PREFLIGHT_ARGS, DRY_RUN=1.
source "$(dirname "$0")/common.sh"
CONFIG="${1:?give a preset, e.g. examples/configs/h100.yaml}"; shift
need PERSIST "the persistent volume for checkpoints"
NPROC="${NPROC:-8}"; STEPS="${SMOKE_STEPS:-20}"; HALF=$((STEPS / 2))
NAME="smoke-$(date +%Y%m%d-%H%M%S)"; OUT="${OUT:-runs/$NAME}"
# the save is synchronous here, so the kill lands after a complete checkpoint and its mirror copy
SETTINGS=("$@" "schedule.max_steps=$STEPS" "schedule.warmup_steps=$((STEPS / 4))" "training.checkpoint_every=$HALF"
          "training.eval_every=$HALF" "training.log_every=$((HALF > 5 ? 5 : 1))" "training.eval_batches=2"
          "training.background_save=false" "training.persistent_dir=$PERSIST" "training.run_name=$NAME")
TORCHRUN=(torchrun --standalone --nproc_per_node="$NPROC" --no-python cipher-train "$CONFIG" "${SETTINGS[@]}" --quiet)
expect() {   # expect WHAT PYTHON-CONDITION: fail the smoke run with WHAT when the condition is false
  [ -n "${DRY_RUN:-}" ] && return 0
  "$PY" -c "import sys; from pathlib import Path; from cipher_nb.persist.files import *; from cipher_nb.persist.marker import *; sys.exit(0 if ($2) else 1)" \
    || { echo "smoke FAIL: $1" >&2; exit 1; }
  echo "ok: $1"
}

echo "== 1. preflight"
run "$PY" "$HERE/preflight.py" "$CONFIG" "${SETTINGS[@]}" --gpus "$NPROC" --out "$OUT" ${PREFLIGHT_ARGS:-}
echo "== 2. $STEPS steps, killed after the checkpoint at step $HALF"
run "${TORCHRUN[@]}" --out "$OUT" --fault "kill@$HALF" || echo "(the job died after step $HALF, as planned)"
expect "step $HALF's checkpoint reached the persistent volume" \
  "(p := latest_checkpoint('$PERSIST/$(basename "$OUT")')) is not None and checkpoint_step(p) == $HALF"
echo "== 3. resume from the persistent mirror into an empty run directory"
# the checkpointer mirrors RUN_DIR/checkpoints to PERSIST/<name of RUN_DIR>/checkpoints
RESUME="$(resume_source "$OUT-resumed" "$PERSIST/$(basename "$OUT")")"
run "${TORCHRUN[@]}" --out "$OUT-resumed" --resume "$RESUME"
expect "the resumed run finished and exported" "is_complete(Path('$OUT-resumed/final'))"
expect "its metrics reach step $STEPS" \
  "max(__import__('json').loads(l)['step'] for l in open('$OUT-resumed/metrics.jsonl')) == $STEPS"
echo "== 4. gate (informative after $STEPS steps) and plots"
run cipher-gate "$OUT-resumed" || true
run cipher-plot "$OUT-resumed"
echo "smoke PASS: $OUT-resumed (plots in $OUT-resumed/plots)"
