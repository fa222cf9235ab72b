#!/usr/bin/env bash
# speculators' arms of the peer comparison on experiment=smollm2_large: its trainer on the same
# prepare and extract runs as draft31_gpu.sh's arms, scored by the same offline evaluator into the
# same results.jsonl; resumable. Arms, environment and what each step runs: bench/peers/README.md.
# Usage: [SERVE=ARMS] bash bench/peers/peer_speculators_gpu.sh GGUF_FILE [SECONDS] [ARMS]
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
