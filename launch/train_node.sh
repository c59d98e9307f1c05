#!/usr/bin/env bash
# One node, all its GPUs (8 by default): preflight, then cipher-train under torchrun, one process per GPU.
#
#   PERSIST=/mnt/persist launch/train_node.sh examples/configs/h100.yaml [section.key=value ...]
#
# Checkpoints go to the run directory and are mirrored to $PERSIST/<name of $OUT>/checkpoints (training.persistent_dir).
# Run the same command again after a preemption, on this machine or a fresh one: it resumes from the newest complete
# checkpoint, local or on the persistent volume.
# Environment: PERSIST (required), NPROC (GPUs, default 8), RUN_NAME (default <preset>-<date>; reuse it to resume),
# OUT (default runs/$RUN_NAME), PREFLIGHT_ARGS (e.g. --min-disk-gb 500), DRY_RUN=1 (print the commands only).
source "$(dirname "$0")/common.sh"
CONFIG="${1:?give a preset, e.g. examples/configs/h100.yaml}"; shift
need PERSIST "the persistent volume for checkpoints (the cipher-training runbook: never checkpoint only to local disk)"
NPROC="${NPROC:-8}"
RUN_NAME="${RUN_NAME:-$(basename "$CONFIG" .yaml)-$(date +%Y%m%d-%H%M%S)}"
OUT="${OUT:-runs/$RUN_NAME}"
SETTINGS=("$@" "training.persistent_dir=$PERSIST" "training.run_name=$RUN_NAME")
TOKENIZER="$(tokenizer_setting "$CONFIG" "$PERSIST" "$@")"  # token-level presets: train the tokenizer once
if [ -n "$TOKENIZER" ]; then SETTINGS+=("$TOKENIZER"); fi
SHARDED="$(shards_settings "$CONFIG" "$PERSIST" "${SETTINGS[@]}")"  # tokenized once, then read as shards
if [ -n "$SHARDED" ]; then mapfile -t -O "${#SETTINGS[@]}" SETTINGS <<< "$SHARDED"; fi

run "$PY" "$HERE/preflight.py" "$CONFIG" "${SETTINGS[@]}" --gpus "$NPROC" --out "$OUT" ${PREFLIGHT_ARGS:-}
# the checkpointer mirrors RUN_DIR/checkpoints to PERSIST/<name of RUN_DIR>/checkpoints
RESUME="$(resume_source "$OUT" "$PERSIST/$(basename "$OUT")")"
launch_torchrun "$OUT" --standalone --nproc_per_node="$NPROC" --no-python \
  cipher-train "$CONFIG" "${SETTINGS[@]}" --out "$OUT" --resume "$RESUME" --quiet
