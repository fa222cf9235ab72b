#!/usr/bin/env bash
# experiment=smollm2_large on GPU vLLM: the draft on the layer probe's aux layers (extract.layer_ids=auto)
# against the draft on the default layers, from one prepare run, side by side on the GPU, each trained
# the preset's steps and served; and the draft vocabulary size prepare.draft_vocab_size=auto chooses
# from that prepare run's token frequencies. Copies the manifest and the logs to $OUT, prints a table.
# Usage: BACKEND=vllm [WS=/tmp/cfd OUT=DIR EXTRA=...] bash bench/choose_from_data_gpu.sh GGUF_FILE SECONDS
set -uo pipefail
GGUF=${1:?usage: bench/choose_from_data_gpu.sh GGUF_FILE SECONDS}
BUDGET=${2:-1500}
WS=${WS:-/tmp/cfd}
OUT=${OUT:-$WS.out}
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/stage_step.sh"
smollm2_large_gpu_setup

step prepare stage=prepare
python3 - "${common[@]}" <<'EOF' | tee "$OUT/vocab_choice.txt"
import sys
import numpy as np
from safetensors.numpy import load_file
from eagle3.compose import compose_config
from eagle3.contracts import vocab_choice_line
from eagle3.artifacts import TOKEN_FREQ_FILE
from eagle3.data.vocab_choice import choose_for_target
from eagle3.manifest import Manifest
from eagle3.target import resolve
cfg = compose_config(["stage=prepare", *sys.argv[1:]])
prep = Manifest(cfg.experiment_dir).current("prepare")
freq = load_file(f"{prep.out_dir}/{TOKEN_FREQ_FILE}")["freq"].astype(np.int64)
print("prepare.draft_vocab_size=auto would choose:", vocab_choice_line(
    choose_for_target(freq, resolve(cfg.target, cfg.workspace).config, cfg.prepare.vocab_choice)))
EOF

arm() {  # arm NAME OVERRIDES...: extract, train and export (served) with these overrides
    local name=$1
    ( for s in extract train export; do step "$name $s" "stage=$s" "${@:2}"; done ) > "$OUT/$name.log" 2>&1
    echo "== arm $name: rc=$?"
}
arm default & arm probe extract.layer_ids=auto & wait
cp "$WS/smollm2_large/manifest.json" "$OUT/manifest.json"
python3 - "$OUT/manifest.json" <<'EOF'
import json, sys
stages = json.load(open(sys.argv[1]))["stages"]
trains = {tuple(r["facts"]["layer_ids"]): r for r in stages.get("train", {}).get("runs", {}).values() if r.get("facts")}
print("| layers | held-out acc per TTT step | served acceptance, k = 1..5 | offline at k | lossless |")
print("| --- | --- | --- | --- | --- |")
for r in stages.get("export", {}).get("runs", {}).values():
    f = r.get("facts") or {}
    t = trains.get(tuple(f.get("layer_ids", ())))
    acc = " ".join(f"{a:.3f}" for a in t["facts"]["eval"]["acc_per_step"]) if t else "?"
    served = " ".join(str(v) for _, v in sorted((f.get("acceptance_by_k") or {}).items()))
    print(f"| {f.get('layer_ids')} | {acc} | {served} | {(f.get('offline') or {}).get('acceptance_length')} "
          f"| {f.get('lossless')} |")
EOF
