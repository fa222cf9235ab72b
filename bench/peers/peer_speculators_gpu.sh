#!/usr/bin/env bash
# Peer baseline on experiment=smollm2_large, on the GPU machine (one H200, no vLLM): speculators
# 0.9.0's default EAGLE-3 recipe trained from the same prepare and extract runs as
# bench/peers/draft31_gpu.sh's eagle3 arms (same workspace), with only the preset's budget (8 epochs, TTT
# 7, lr 5e-4, 8192 tokens per optimizer step), the prepare run's draft vocabulary (d2t/t2d) and the
# extract run's aux layers, and scored by the same offline evaluator (k = 1..5, the same 32 held-out
# prompts x 128 tokens) into the same results.jsonl. Run it in the same device call(s) as
# draft31_gpu.sh, after it or before it (it runs prepare and extract itself; no-ops when done).
#
# Per arm: bench/peers/peer_speculators.py convert (once: eagle3's store -> speculators' offline data
# layout, $WS/spec_data), train (speculators' trainer in its own python path, $SPECSITE; resumes
# from its last epoch checkpoint when a call ran out of time), `python -m eagle3 stage=eval
# export.from=<final checkpoint>`, row (appends to $OUT/results.jsonl). Resumable like
# draft31_gpu.sh: arms listed in $OUT/done_arms are skipped.
#
# Before the first call on a fresh machine, the wheels (.wt/specwheels, carried with the call) are
# installed once into $SPECSITE (only the trainer sees them; eagle3's /tmp/site is untouched).
#
# Usage: bash bench/peers/peer_speculators_gpu.sh GGUF_FILE [SECONDS] [ARMS]
#   ARMS: space-separated NAME:SEED[:FLAG=VALUE,...] with speculators train flags (no leading --),
#   default "spec:0 spec:1"; e.g. "specadamw:0:optimizer=adamw".
# Environment: WS (workspace, default /tmp/e3d31), OUT (results.jsonl, done_arms; default $WS),
#   SERVE ("all", or arms as NAME:SEED, e.g. "spec:0": after the offline evaluator, the export stage serves the
#   draft in GPU vLLM, export.verify at k = 1..5 on the same prompts, and the row gets its figures),
#   SPECSITE (default /tmp/specsite), SPEC_TRAIN_OPTS (peer_speculators.py train options,
#   default "--loss eager": flex attention with the eager loss, the pair that runs under torch 2.11).
#   For a CPU smoke test of this script only: EXPERIMENT, PEER_COMMON (the stages' overrides instead
#   of smollm2_large_gpu_setup's), SPEC_DEVICE, SPEC_PYTHON, EVAL_OVERRIDES.
set -uo pipefail
GGUF=${1:?usage: bench/peers/peer_speculators_gpu.sh GGUF_FILE [SECONDS] [ARMS]}
BUDGET=${2:-3600}
ARMS=${3:-"spec:0 spec:1"}
WS=${WS:-/tmp/e3d31}
OUT=${OUT:-$WS}
SPECSITE=${SPECSITE:-/tmp/specsite}
read -ra TRAIN_OPTS <<< "${SPEC_TRAIN_OPTS:---loss eager}"
EXPERIMENT=${EXPERIMENT:-smollm2_large}
SPEC_DEVICE=${SPEC_DEVICE:-cuda}
SPEC_PYTHON=${SPEC_PYTHON:-python3}
# the eval settings of bench/peers/draft31_gpu.sh
read -ra EVAL <<< "${EVAL_OVERRIDES:-export.num_speculative_tokens=5 export.eval_ks=[1,2,3,4,5] export.eval_prompts=32 export.eval_max_tokens=128}"
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../stage_step.sh"
smollm2_large_gpu_setup
if [[ -n ${PEER_COMMON:-} ]]; then read -ra common <<< "$PEER_COMMON"; fi

if [[ ! -f $SPECSITE/.installed ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SPECSITE" \
        "$HERE"/../../.wt/specwheels/*.whl && touch "$SPECSITE/.installed" || exit 1
fi

# `peer NAME CMD ARGS...`: bench/peers/peer_speculators.py CMD ARGS on this workspace within the time
# left (exits as step does: the command's code, 124 when no time is left)
peer() {
    local left=$(( deadline - $(date +%s) ))
    if (( left < 20 )); then echo "out of time before $1"; exit 124; fi
    local t0=$(date +%s)
    echo "== $1 ($(date -u +%H:%M:%S), ${left} s left)"
    timeout --signal=TERM --kill-after=15 "$left" python3 "$HERE/peer_speculators.py" "$2" \
        --workspace "$WS" --experiment "$EXPERIMENT" --data "$WS/spec_data" --out "$WS/spec_runs" "${@:3}"
    local rc=$?
    echo "== $1: rc=$rc in $(( $(date +%s) - t0 )) s"
    if (( rc != 0 )); then exit "$rc"; fi
}

step prepare stage=prepare
step extract stage=extract
for arm in $ARMS; do
    if grep -qxF "$arm" "$OUT/done_arms" 2>/dev/null; then echo "== $arm: done before"; continue; fi
    IFS=: read -r name seed opts <<< "$arm"
    extra=()
    IFS=, read -ra kv <<< "${opts:-}"
    for o in "${kv[@]}"; do [[ -n $o ]] && extra+=("--${o%%=*}" "${o#*=}"); done
    run="${name}_s${seed}"
    peer convert convert
    peer "train $arm" train --name "$run" --seed "$seed" --device "$SPEC_DEVICE" --resume --deadline "$deadline" \
        --spec-python "$SPEC_PYTHON" --spec-path "$SPECSITE:${PYTHONPATH:-}" "${TRAIN_OPTS[@]}" \
        ${extra[@]+-- "${extra[@]}"}
    ckpt=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["checkpoint"])' \
        "$WS/spec_runs/$run/train_result.json") || exit 1
    step "eval $arm" stage=eval "export.from=$ckpt" "${EVAL[@]}"
    served=()
    if serve_arm "$arm"; then
        step "export $arm" stage=export "export.from=$ckpt" "${EVAL[@]}"
        served=(--served)
    fi
    peer "row $arm" row --name "$run" --arm "$arm" --results "$OUT/results.jsonl" "${served[@]}"
    echo "$arm" >> "$OUT/done_arms"
done

python3 "$HERE/peer_speculators.py" table --results "$OUT/results.jsonl"
