#!/usr/bin/env bash
# eagle3's arms of the peer comparison on experiment=smollm2_large (draft options, optimizer, seeds):
# one prepare and one extract run, then per arm a train run and the offline evaluator; resumable.
# Arms, environment and what each step runs: bench/peers/README.md.
# Usage: [BACKEND=vllm SERVE=ARMS] bash bench/peers/draft31_gpu.sh GGUF_FILE [SECONDS] [ARMS]
set -uo pipefail
GGUF=${1:?usage: bench/peers/draft31_gpu.sh GGUF_FILE [SECONDS] [ARMS]}
BUDGET=${2:-3600}
E31=norm_before_fc=true,fc_norm=true,norm_output=true
ARMS=${3:-"e3:0 e3:1 e31:0:$E31 e31:1:$E31"}
WS=${WS:-/tmp/e3d31}
OUT=${OUT:-$WS}
source "$(dirname "$0")/../stage_step.sh"
smollm2_large_gpu_setup

step prepare stage=prepare
step extract stage=extract
for arm in $ARMS; do
    IFS=: read -r name seed opts <<< "$arm"
    over=("train.seed=$seed")
    IFS=, read -ra kv <<< "${opts:-}"
    for o in "${kv[@]}"; do
        [[ -z $o ]] && continue
        if [[ $o == train.* ]]; then over+=("$o"); else over+=("train.model.$o"); fi
    done
    if grep -qxF "$arm" "$OUT/done_arms" 2>/dev/null; then echo "== $arm: done before"; continue; fi
    step "train $arm" stage=train "${over[@]}"
    EVALK=(export.num_speculative_tokens=5 "export.eval_ks=[1,2,3,4,5]" export.eval_prompts=32 export.eval_max_tokens=128)
    step "eval $arm" stage=eval "${over[@]}" "${EVALK[@]}"
    serve=0
    if serve_arm "$arm"; then
        step "export $arm" stage=export "${over[@]}" "${EVALK[@]}"
        serve=1
    fi
    python3 - "$WS" "$OUT" "$arm" "$serve" "$(cd "$(dirname "$0")" && pwd)" <<'PY'
import dataclasses, json, sys
from pathlib import Path
from eagle3.manifest import Manifest

ws, out, arm = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
m = Manifest(ws / "smollm2_large")
tr, ev = m.current("train"), m.current("eval")
row = {"arm": arm, "train_run": tr.config_hash[:12],
       "train_eval": dataclasses.asdict(tr.facts.eval) if tr.facts.eval else None, "steps": tr.facts.steps,
       "acceptance_by_k": ev.facts.acceptance_by_k, "acceptance_per_position": ev.facts.acceptance_per_position,
       "num_prompts": ev.facts.num_prompts, "max_tokens": ev.facts.max_tokens}
if sys.argv[4] == "1":  # served by GPU vLLM too (SERVE)
    sys.path.insert(0, sys.argv[5])
    from peer_speculators import served
    row.update(served(ws / "smollm2_large"))
print(json.dumps(row))
with open(out / "results.jsonl", "a") as f:
    f.write(json.dumps(row) + "\n")
PY
    echo "$arm" >> "$OUT/done_arms"
done

python3 "$(dirname "$0")/peer_speculators.py" table --results "$OUT/results.jsonl"
