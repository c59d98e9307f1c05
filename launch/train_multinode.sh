#!/usr/bin/env bash
# Several nodes: run this same command on every node; torchrun's c10d rendezvous at $MASTER_ADDR:$MASTER_PORT
# gathers them into one job of NNODES x NPROC processes (no node ranks to hand out).
#
#   NNODES=4 MASTER_ADDR=10.0.0.1 JOB_ID=h100-a SHARED=/mnt/shared launch/train_multinode.sh examples/configs/h100.yaml
#
# The run directory must be on storage every node mounts ($SHARED): rank 0 writes the checkpoints of a DDP run and
# every rank reads them on resume, and under FSDP each rank writes its own shard. $SHARED/persist (or PERSIST)
# receives the mirror. Re-run the same command on all nodes after a failure: it resumes from the newest complete
# checkpoint. Environment: NNODES, MASTER_ADDR, JOB_ID, SHARED (required); MASTER_PORT (29500), NPROC (8),
# PERSIST ($SHARED/persist), RUN_NAME ($JOB_ID), PREFLIGHT_ARGS, DRY_RUN=1.
source "$(dirname "$0")/common.sh"
CONFIG="${1:?give a preset, e.g. examples/configs/h100.yaml}"; shift
need NNODES "the number of nodes"; need MASTER_ADDR "the address of one node every node can reach (the rendezvous host)"
need JOB_ID "an id shared by the nodes of this job (also the run name)"; need SHARED "a folder every node mounts"
NPROC="${NPROC:-8}"; MASTER_PORT="${MASTER_PORT:-29500}"
RUN_NAME="${RUN_NAME:-$JOB_ID}"; PERSIST="${PERSIST:-$SHARED/persist}"; OUT="$SHARED/runs/$RUN_NAME"
SETTINGS=("$@" "training.persistent_dir=$PERSIST" "training.run_name=$RUN_NAME")

run "$PY" "$HERE/preflight.py" "$CONFIG" "${SETTINGS[@]}" --gpus "$NPROC" --out "$OUT" ${PREFLIGHT_ARGS:-}
# the checkpointer mirrors RUN_DIR/checkpoints to PERSIST/<name of RUN_DIR>/checkpoints
RESUME="$(resume_source "$OUT" "$PERSIST/$(basename "$OUT")")"
run torchrun --nnodes="$NNODES" --nproc_per_node="$NPROC" \
  --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$JOB_ID" --no-python \
  cipher-train "$CONFIG" "${SETTINGS[@]}" --out "$OUT" --resume "$RESUME" --quiet
