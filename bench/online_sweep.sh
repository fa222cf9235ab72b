#!/usr/bin/env bash
# Online training on one host of N GPUs: every split into P producer GPUs and N-P trainer GPUs
# (bench/online.py --layout split), one row each: the draft's tokens/s online, against the train-only
# rate of the same trainer GPUs (the offline rate once a store exists) and the peak disk.
#   bash bench/online_sweep.sh 8            # P = 1..4 on an 8-GPU host
#   bash bench/online_sweep.sh 4 --steps 20 # extra arguments go to bench/online.py
set -euo pipefail
N=${1:?usage: bench/online_sweep.sh NUM_GPUS [bench/online.py args]}
shift
cd "$(dirname "$0")/.."
out=$(mktemp -d)
for P in $(seq 1 $((N / 2))); do
  T=$((N - P))
  OUT=$out python3 bench/online.py --layout split --producers "$P" --trainers "$T" "$@" >"$out/log-$P" 2>&1 \
    || { echo "P=$P T=$T failed: see $out/log-$P"; continue; }
  cp "$out/bench_online_split.json" "$out/split-$P.json"
done
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path
rows = [json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("split-*.json"))]
print("| producers | trainers | train alone (tokens/s) | online (tokens/s) | online / train alone | peak disk / window (MiB) |")
print("| ---: | ---: | ---: | ---: | ---: | --- |")
for r in rows:
    print(f"| {r['producers']} | {r['trainers']} | {r['train_only']['tokens_per_s']:.0f} | {r['online']['tokens_per_s']:.0f} "
          f"| {r['ratio']:.3f} | {r['peak_disk_bytes'] / 2**20:.0f} / {r['window_bytes'] / 2**20:.0f} |")
if rows:
    best = max(rows, key=lambda r: r["online"]["tokens_per_s"])
    print(f"most draft tokens/s online: {best['producers']} producer(s), {best['trainers']} trainer(s): "
          f"{best['online']['tokens_per_s']:.0f} tokens/s")
PY
