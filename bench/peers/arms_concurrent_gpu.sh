#!/usr/bin/env bash
# Both kinds of arms of the peer comparison side by side on one GPU, each in its own process, from
# one prepare and one extract run; waits for them (or SECONDS) and prints the table of every arm; run
# again with the same WS to wait for or restart arms. Arms and environment: bench/peers/README.md.
# Usage: [BACKEND=vllm SERVE=ARMS] bash bench/peers/arms_concurrent_gpu.sh GGUF_FILE SECONDS "E3_ARMS" "SPEC_ARMS"
set -uo pipefail
GGUF=${1:?usage: bench/peers/arms_concurrent_gpu.sh GGUF_FILE SECONDS "E3_ARMS" "SPEC_ARMS"}
BUDGET=${2:-1500}
E3_ARMS=${3:-}
SPEC_ARMS=${4:-}
WS=${WS:-/tmp/e3d31}
OUT=${OUT:-$WS.arms}
ARM_BUDGET=${ARM_BUDGET:-1500}
SPECSITE=${SPECSITE:-/tmp/specsite}
export SPEC_TRAIN_OPTS=${SPEC_TRAIN_OPTS:---loss eager}
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../stage_step.sh"
t_start=$(date +%s)
smollm2_large_gpu_setup

step prepare stage=prepare
step extract stage=extract
if [[ -n $SPEC_ARMS ]]; then
    # once, before the arms start: the wheels and the converted data every spec arm reads
    if [[ ! -f $SPECSITE/.installed ]]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SPECSITE" \
            "$HERE"/../../.wt/specwheels/*.whl && touch "$SPECSITE/.installed" || exit 1
    fi
    python3 "$HERE/peer_speculators.py" convert --workspace "$WS" --experiment smollm2_large \
        --data "$WS/spec_data" --out "$WS/spec_runs" || exit 1
fi

# `arm_dir ARM`: the arm's folder name (letters, digits, '.', '_' and '-')
arm_dir() { printf '%s' "$1" | tr -c 'A-Za-z0-9._-' '_'; }
alive() { [[ -f $1/pid ]] && kill -0 "$(cat "$1/pid")" 2>/dev/null; }
done_arm() { grep -qxF "$2" "$1/done_arms" 2>/dev/null; }

names=()
launch() {  # launch KIND ARM
    local kind=$1 arm=$2 d
    d="$OUT/$(arm_dir "$arm")"
    names+=("$arm")
    if done_arm "$d" "$arm"; then echo "== $arm: done before"; return; fi
    if alive "$d"; then echo "== $arm: still running (pid $(cat "$d/pid"))"; return; fi
    local ws="$WS.arm_$(arm_dir "$arm")"
    if [[ ! -d $ws ]]; then cp -al "$WS" "$ws" || exit 1; fi
    mkdir -p "$d"
    local script=draft31_gpu.sh
    [[ $kind == spec ]] && script=peer_speculators_gpu.sh
    WS=$ws OUT=$d setsid nohup bash "$HERE/$script" "$GGUF" "$ARM_BUDGET" "$arm" >> "$d/run.log" 2>&1 < /dev/null &
    echo $! > "$d/pid"
    echo "== $arm: started ($script, pid $!, workspace $ws)"
}
for a in $E3_ARMS; do launch e3 "$a"; done
for a in $SPEC_ARMS; do launch spec "$a"; done

while :; do
    running=0
    for a in "${names[@]}"; do alive "$OUT/$(arm_dir "$a")" && running=$((running + 1)); done
    (( running == 0 )) && break
    if (( $(date +%s) - t_start >= BUDGET - 10 )); then
        echo "== $running arm(s) still running after $(( $(date +%s) - t_start )) s: run this again with the same WS to wait for them"
        break
    fi
    sleep 10
done

: > "$OUT/results.jsonl"
for a in "${names[@]}"; do
    d="$OUT/$(arm_dir "$a")"
    if done_arm "$d" "$a"; then
        cat "$d/results.jsonl" >> "$OUT/results.jsonl"
        grep -E "^== (train|eval) .*rc=" "$d/run.log" | sed "s/^/   /"
    elif ! alive "$d"; then
        echo "== $a: FAILED (not done, not running); the end of $d/run.log:"; tail -5 "$d/run.log"
    fi
done
[[ -s $OUT/results.jsonl ]] && python3 "$HERE/peer_speculators.py" table --results "$OUT/results.jsonl"
