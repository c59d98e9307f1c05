#!/usr/bin/env bash
# The whole release chain on one node, from a preset and nothing else: its hub sources pinned to their commits (a copy
# of the preset in runs/$RUN_NAME-pinned/, read by every later step), the tokenizer (a token-level preset's), the
# shards, the plan, pretraining to the preset's horizon, refinement (one pass, from pretraining's final/), SFT (the
# training-stage guide's schedule, from refinement's final/), each stage run by train_node.sh (preflight, then
# cipher-train under torchrun), then the evaluation of the SFT export and its mirror to $PERSIST. The gate checks
# pretraining before anything is built on it (its lines are a pretraining's: the loss and the routers learning, the
# expert loads); the later stages have their own checks (refinement's data identity, SFT's data manifest).
#
#   PERSIST=/mnt/persist RUN_NAME=h100-a launch/chain.sh examples/configs/h100.yaml [section.key=value ...]
#
# The overrides go to every stage; PRETRAIN_ARGS, REFINE_ARGS and SFT_ARGS (space separated) to one stage only (a
# stage keeps a horizon or a learning rate given to it, so give those per stage). The stages write
# runs/$RUN_NAME-pretrain, -refinement and -sft. The chain stops at the first step that fails, says which, and exits
# with that step's code (1 failed, 2 bad input or config, 3 out of memory); the stages before it are kept. Run the same
# command again (same RUN_NAME) to go on: a stage whose final/ is complete is not trained again, an unfinished one
# resumes. A stop signal to the group ends the chain with 0 once the running step has stopped (a stage saves first).
# Environment: PERSIST (required), NPROC (GPUs, 8), RUN_NAME (<preset>-<date>), RUNS (runs), PRETRAIN_ARGS,
# REFINE_ARGS, SFT_ARGS, MC (a multiple-choice jsonl for cipher-eval), EVAL_DOCS (held-out documents, 32), PLAN_ARGS
# (cipher-plan's, e.g. --gpu h200), PREFLIGHT_ARGS, PIN_API=1 (pin a hub source the local cache lacks by asking the
# Hub), DRY_RUN=1 (print the commands only).
source "$(dirname "$0")/common.sh"
CONFIG="${1:?give a preset, e.g. examples/configs/h100.yaml}"; shift
need PERSIST "the persistent volume for checkpoints, tokenizer, shards and the released export"
NPROC="${NPROC:-8}"
RUN_NAME="${RUN_NAME:-$(basename "$CONFIG" .yaml)-$(date +%Y%m%d-%H%M%S)}"
RUNS="${RUNS:-runs}"

stop() {  # stop NAME CODE [HINT]: the chain ends at step NAME with its exit code (anything but 2 or 3 is a failure, 1)
  local code="$2"
  case "$code" in 2 | 3) ;; *) code=1 ;; esac
  echo "chain: step '$1' failed (exit $2${3:+: $3}): stopped, exit $code; the stages before it are kept in $RUNS/$RUN_NAME-*" >&2
  exit "$code"
}
# A stop signal (a scheduler's, Ctrl-C) sent to the group reaches the running step too, which stops cleanly (a stage
# saves a checkpoint); bash runs this trap once the step has ended, and the chain ends there with the step's code.
STOPPED=""
for s in TERM INT HUP; do trap "STOPPED=$s" "$s"; done
step() {  # step NAME COMMAND...: one step of the chain, stopping it on failure or after a stop signal
  local name="$1" rc=0; shift
  echo "== chain: $name" >&2
  "$@" || rc=$?
  [ "$rc" = 0 ] || stop "$name" "$rc"
  if [ -n "$STOPPED" ]; then
    echo "chain: stopped by SIG$STOPPED during '$name': the same command (same RUN_NAME) goes on from there" >&2
    exit 0
  fi
}
stage() {  # stage NAME ARGS...: train one stage with train_node.sh into $RUNS/$RUN_NAME-NAME
  local name="$1" out="$RUNS/$RUN_NAME-$1"; shift
  if [ -z "${DRY_RUN:-}" ] && [ -f "$out/final/COMPLETE" ]; then
    echo "== chain: $name finished already ($out/final): not trained again" >&2
  else
    # the data settings are resolved once above: train_node.sh prepares nothing again
    step "$name" env RUN_NAME="$RUN_NAME-$name" OUT="$out" NPROC="$NPROC" PERSIST="$PERSIST" SHARDS=0 \
      bash "$HERE/train_node.sh" "$CONFIG" "${SETTINGS[@]}" "$@"
  fi
}

SETTINGS=("$@")
# first: the tokenizer and the shards are made from the data every stage reads
echo "== chain: pin" >&2
CONFIG="$(pinned_preset "$CONFIG" "$RUNS/$RUN_NAME-pinned" "$@")" \
  || stop pin $? "the pin reads the local hub cache; PIN_API=1 asks the Hub for a source it lacks"
echo "== chain: tokenizer" >&2
TOKENIZER="$(tokenizer_setting "$CONFIG" "$PERSIST" "$@")" || stop tokenizer $?
if [ -n "$TOKENIZER" ]; then SETTINGS+=("$TOKENIZER"); fi
echo "== chain: shards" >&2
SHARDED="$(shards_settings "$CONFIG" "$PERSIST" "${SETTINGS[@]}")" || stop shards $?
if [ -n "$SHARDED" ]; then mapfile -t -O "${#SETTINGS[@]}" SETTINGS <<< "$SHARDED"; fi
read -r -a PRETRAIN <<< "${PRETRAIN_ARGS:-}"
read -r -a REFINE <<< "${REFINE_ARGS:-}"
read -r -a SFT <<< "${SFT_ARGS:-}"

# the steps and tokens pretraining plans at NPROC ranks, then its memory per GPU (exit 2 when it does not fit)
step plan run cipher-config "$CONFIG" "${SETTINGS[@]}" ${PRETRAIN[@]+"${PRETRAIN[@]}"} --gpus "$NPROC"
step "memory plan" run cipher-plan "$CONFIG" "${SETTINGS[@]}" ${PRETRAIN[@]+"${PRETRAIN[@]}"} --gpus "$NPROC" \
  ${PLAN_ARGS:-}
stage pretrain ${PRETRAIN[@]+"${PRETRAIN[@]}"}
step gate run cipher-gate "$RUNS/$RUN_NAME-pretrain"  # its verdict also goes into the pretraining export's card
stage refinement stage.name=refinement "stage.init=$RUNS/$RUN_NAME-pretrain/final" ${REFINE[@]+"${REFINE[@]}"}
stage sft stage.name=sft "stage.init=$RUNS/$RUN_NAME-refinement/final" ${SFT[@]+"${SFT[@]}"}

SFT_RUN="$RUNS/$RUN_NAME-sft"
MC_ARGS=()
if [ -n "${MC:-}" ]; then MC_ARGS=(--mc "$MC" --record); fi  # the score and its protocol kept in the record and card
step evaluation run cipher-eval "$SFT_RUN/final" --docs "${EVAL_DOCS:-32}" ${MC_ARGS[@]+"${MC_ARGS[@]}"}
# last: the mirrored export carries the scores; each file is read back from $PERSIST
step mirror run cipher-export "$SFT_RUN" --mirror "$PERSIST"
echo "chain: done: $SFT_RUN/final, mirrored to $PERSIST/$(basename "$SFT_RUN")/final" >&2
