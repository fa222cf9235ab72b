#!/usr/bin/env bash
# Export verification on one GPU, its designs side by side on one trained draft: an earlier commit's tree
# (OLD, e.g. `git archive ec85a0a`: seven engine starts, the offline evaluator decoding in transformers first)
# against this tree's arms of bench/export_verify.py (per_k, two, one). Each arm runs in a process of its own
# with empty vLLM, inductor and Triton caches, so that no arm compiles less because another ran before it.
# Usage, GPU vLLM importable from /tmp/site (machines.md; VLLM_USE_V2_MODEL_RUNNER=0 and
# VLLM_USE_FLASHINFER_SAMPLER=0 are set here):
#   OLD=/tmp/old ARMS="old one" OUT=DIR bash bench/export_verify_gpu.sh    # then ARMS="two per_k" in a 2nd call
set -uo pipefail
WS=${WS:-/tmp/evw}
OUT=${OUT:-$WS.out}
ARMS=${ARMS:-old one two per_k}
HERE=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1 VLLM_USE_V2_MODEL_RUNNER=0 VLLM_USE_FLASHINFER_SAMPLER=0
common=(--tiny-llama 4 debug=fast logger=jsonl "workspace=$WS")
# the earlier tree's embedded default names bf16 where this one says native (bf16 on a GPU either way): named
# as it did, both trees' stages have the same config hashes, and every arm verifies the same trained draft
same=(prepare.regen.dtype=bfloat16 train.mixed_precision=bf16)
mkdir -p "$OUT"
cold() {  # cold DIR ARGS...: python3 ARGS in DIR with empty compile caches
    local c
    c=$(mktemp -d)
    (cd "$1" && VLLM_CACHE_ROOT=$c/vllm TORCHINDUCTOR_CACHE_DIR=$c/inductor TRITON_CACHE_DIR=$c/triton \
        PYTHONPATH=/tmp/site:$1 python3 "${@:2}")
}
for arm in $ARMS; do
    echo "== arm $arm ($(date -u +%H:%M:%S))"
    if [[ $arm == old ]]; then
        cold "${OLD:?OLD: the tree of the earlier commit}" bench/export_verify.py --arms false --out "$OUT/old" "${common[@]}" \
            2>&1 | tee "$OUT/old.log" | grep -E "^export verification|^\||fastest|Error|error" || true
    else
        cold "$HERE" bench/export_verify.py --arms "$arm" --out "$OUT/new" "${common[@]}" "${same[@]}" \
            2>&1 | tee "$OUT/$arm.log" | grep -E "^export verification|^\||fastest|Error|error" || true
    fi
done
python3 - "$OUT" <<'EOF'
import glob, json, sys
rows = []
for f in sorted(glob.glob(f"{sys.argv[1]}/*/results_*.json")):
    for r in json.load(open(f))["rows"]:
        r.setdefault("arm", "old (seven starts, the evaluator decoding first)" if "shared_engines" in r else "?")
        rows.append(r)
print("| arm | engine starts | their wall s | verification wall s | acceptance k=1..5 | prompt lookup tokens/step | lossless | hf greedy = vLLM greedy |")
print("| --- | ---: | ---: | ---: | --- | ---: | --- | --- |")
for r in rows:
    f = r["figures"]
    acc = " ".join(f"{float(v):.3f}" for _, v in sorted(f["acceptance_by_k"].items(), key=lambda kv: int(kv[0])))
    print(f"| {r['arm']} | {r['engine_starts']} | {r['engine_start_seconds']:.1f} | {r['seconds']:.1f} | {acc} | "
          f"{f['ngram']['tokens_per_step']:.3f} | {f['lossless']} | {f.get('hf_greedy_equals_vllm_greedy')} |")
EOF
