# Sourced by the GPU scripts (bench/smollm2_large_gpu.sh and bench/peers/: draft31_gpu.sh, peer_speculators_gpu.sh, arms_concurrent_gpu.sh): `step NAME OVERRIDES...`
# runs one stage, `python -m eagle3 OVERRIDES... ${common[@]}`, within the time left before $deadline
# (epoch seconds); exits with the stage's code if it fails, 124 when no time is left.
step() {
    local left=$(( deadline - $(date +%s) ))
    if (( left < 20 )); then echo "out of time before $1"; exit 124; fi
    local t0=$(date +%s)
    echo "== $1 ($(date -u +%H:%M:%S), ${left} s left)"
    timeout --signal=TERM --kill-after=15 "$left" python3 -m eagle3 "${@:2}" "${common[@]}"
    local rc=$?
    echo "== $1: rc=$rc in $(( $(date +%s) - t0 )) s"
    if (( rc != 0 )); then exit "$rc"; fi
}

# `smollm2_large_gpu_setup`: what every experiment=smollm2_large script for a GPU machine starts with,
# from its GGUF, BUDGET (seconds), WS, OUT, BACKEND and EXTRA: $OUT made, $deadline set, and ${common[@]}, the
# overrides each of its stages runs with: regeneration and extraction through transformers
# (BACKEND=hf, the default: a GPU machine without vLLM) or through GPU vLLM (BACKEND=vllm).
smollm2_large_gpu_setup() {
    mkdir -p "$OUT"
    deadline=$(( $(date +%s) + BUDGET ))
    local backend=${BACKEND:-hf}
    common=(experiment=smollm2_large "workspace=$WS" "target.gguf=$GGUF" "prepare.regen.backend=$backend"
            "extract.backend=$backend" logger=jsonl progress=false)
    # EXTRA: more overrides for every stage (e.g. the engines' memory shares when other GPU work runs beside)
    if [[ -n ${EXTRA:-} ]]; then read -ra extra_common <<< "$EXTRA"; common+=("${extra_common[@]}"); fi
}

# `serve_arm ARM`: whether $SERVE ("all", or arms: NAME:SEED, or whole arm strings) names ARM
# (NAME:SEED[:OPTIONS]); the GPU scripts' arms that the export stage serves in GPU vLLM
serve_arm() {
    local s
    [[ ${SERVE:-} == all ]] && return 0
    for s in ${SERVE:-}; do
        [[ $1 == "$s" || $1 == "$s":* ]] && return 0
    done
    return 1
}
