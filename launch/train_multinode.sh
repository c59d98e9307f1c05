#!/usr/bin/env bash
# Several nodes: run this same command on every node; torchrun's c10d rendezvous at $MASTER_ADDR:$MASTER_PORT
# gathers them into one job of NNODES x NPROC processes (no node ranks to hand out: ranks follow the join order).
#
#   NNODES=4 MASTER_ADDR=10.0.0.1 JOB_ID=h100-a SHARED=/mnt/shared launch/train_multinode.sh examples/configs/h100.yaml
#
# The run directory must be on storage every node mounts ($SHARED): rank 0 writes the checkpoints of a DDP run and
# every rank reads them on resume, and under FSDP each rank writes its own shard. $SHARED/persist (or PERSIST)
# receives the mirror. A lost rank (a process killed, a node's worker gone) makes torchrun stop the group and start
# it again, up to MAX_RESTARTS times; every rank of the new group resumes from the newest complete checkpoint of the
# run directory (`--resume auto`). Re-run the same command on all nodes after a failure that outlasts the restarts.
# Environment: NNODES, MASTER_ADDR, JOB_ID, SHARED (required); MASTER_PORT (29500), NPROC (8), MAX_RESTARTS (3),
# PERSIST ($SHARED/persist), RUN_NAME ($JOB_ID), TRAIN_ARGS (more cipher-train options, e.g. --max-steps 100),
# PREFLIGHT_ARGS (e.g. --skip-gpu), DRY_RUN=1.
source "$(dirname "$0")/common.sh"
CONFIG="${1:?give a preset, e.g. examples/configs/h100.yaml}"; shift
need NNODES "the number of nodes"; need MASTER_ADDR "the address of one node every node can reach (the rendezvous host)"
need JOB_ID "an id shared by the nodes of this job (also the run name)"; need SHARED "a folder every node mounts"
NPROC="${NPROC:-8}"; MASTER_PORT="${MASTER_PORT:-29500}"; MAX_RESTARTS="${MAX_RESTARTS:-3}"
RUN_NAME="${RUN_NAME:-$JOB_ID}"; PERSIST="${PERSIST:-$SHARED/persist}"; OUT="$SHARED/runs/$RUN_NAME"
SETTINGS=("$@" "training.persistent_dir=$PERSIST" "training.run_name=$RUN_NAME")
TOKENIZER="$(tokenizer_setting "$CONFIG" "$PERSIST" "$@")"  # token-level presets: train the tokenizer once
if [ -n "$TOKENIZER" ]; then SETTINGS+=("$TOKENIZER"); fi
SHARDED="$(shards_settings "$CONFIG" "$PERSIST" "${SETTINGS[@]}")"  # tokenized once, then read as shards
if [ -n "$SHARDED" ]; then mapfile -t -O "${#SETTINGS[@]}" SETTINGS <<< "$SHARDED"; fi
read -r -a EXTRA <<< "${TRAIN_ARGS:-}"
# Each restart needs a fresh store for the workers' process group. torchrun's default shares the rendezvous store
# and separates attempts by a restart count that each node keeps for itself, so after a lost rank the nodes can
# disagree on it and the new group meets stale addresses (pytorch/pytorch#135712); a store per round avoids that.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

run "$PY" "$HERE/preflight.py" "$CONFIG" "${SETTINGS[@]}" --gpus "$NPROC" --out "$OUT" ${PREFLIGHT_ARGS:-}
# the checkpointer mirrors RUN_DIR/checkpoints to PERSIST/<name of RUN_DIR>/checkpoints; `auto` unless only the
# mirror holds the newest checkpoint (a fresh shared volume)
RESUME="$(resume_source "$OUT" "$PERSIST/$(basename "$OUT")")"
launch_torchrun "$OUT" --nnodes="$NNODES" --nproc_per_node="$NPROC" --max-restarts="$MAX_RESTARTS" \
  --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$JOB_ID" --no-python \
  cipher-train "$CONFIG" "${SETTINGS[@]}" --out "$OUT" --resume "$RESUME" --quiet ${EXTRA[@]+"${EXTRA[@]}"}
