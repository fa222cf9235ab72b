#!/usr/bin/env bash
# The Mooncake transport on one GPU machine, in one call: online training with a GPU vLLM producer
# process beside the trainer (bench/online.py --layout split --same-gpu --producer vllm), through
# Mooncake and through the /dev/shm directory, bf16 and fp8 states, one after the other (each run
# starts its own engine and master).
#
# Setup it expects (the GPU machine has no network; machines.md): GPU vLLM's archive parts in /tmp/v
# (bash ../shared/gpu/prepare_vllm.sh .gpu, one part per earlier call), the dependency wheels in WHEELS
# (default: /tmp/dd and .gpu/d*), the slimmed Mooncake wheel as .gpu/mooncake/mooncake-slim.tar.xz (the
# wheel's files without its transfer-engine bench and client binaries) with the Debian packages its
# libraries link (.gpu/mooncake/*.deb, used only when the machine lacks libibverbs).
#
#   OUT=... bash bench/online_mooncake_gpu.sh [RUN_SECONDS]     # RUN_SECONDS: each online run's limit (170)
#   RUNS="mooncake auto,dir auto" bash bench/online_mooncake_gpu.sh   # some of the runs
#   (WINDOW: train.online.window_bytes, default 256 MiB; STEPS: optimizer steps, default 24)
set -uo pipefail
LIMIT=${1:-170}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" "$SITE"
t0=$(date +%s)
if [[ ! -d $SITE/vllm ]]; then cat /tmp/v/vllm.tar.xz.part-* | xz -dc | tar -x -C "$SITE" || exit 1; fi
for d in /tmp/dd .gpu/d1 .gpu/d2 .gpu/d3 .gpu_wheels; do
    ls "$d"/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
        --target "$SITE" "$d"/*.whl 2>&1 | grep -v "WARNING: Target directory" | tail -2
done
[[ -d $SITE/mooncake ]] || xz -dc .gpu/mooncake/mooncake-slim.tar.xz | tar -x -C "$SITE"
if ! ldconfig -p | grep -q libibverbs.so.1; then
    mkdir -p /tmp/debs && for f in .gpu/mooncake/*.deb; do dpkg -x "$f" /tmp/debs; done
    export LD_LIBRARY_PATH=/tmp/debs/usr/lib/x86_64-linux-gnu:/tmp/debs/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
    echo "libibverbs from the carried Debian packages"
fi
export PYTHONPATH=$SITE:$PWD VLLM_USE_V2_MODEL_RUNNER=0 VLLM_USE_FLASHINFER_SAMPLER=0 GLOG_minloglevel=1
echo "setup $(( $(date +%s) - t0 )) s"; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -c "import mooncake.store, vllm, torch; print('mooncake ok; vllm', vllm.__version__, 'torch', torch.__version__)" \
    || exit 1
# steady state: a window of 4 samples (256 MiB of bf16 states) that the producer cannot fill ahead of the trainer
IFS=, read -ra RUNS <<< "${RUNS:-mooncake auto,dir auto,mooncake fp8,dir fp8}"
for run in "${RUNS[@]}"; do
    set -- $run
    echo "=== online, $1 transport, store dtype $2 ($(( $(date +%s) - t0 )) s in)"
    rm -rf /dev/shm/eagle3-online-bench*
    OUT=$OUT timeout "$LIMIT" python3 bench/online.py --layout split --same-gpu --producer vllm --transport "$1" \
        --store-dtype "$2" --steps "${STEPS:-24}" --log-every 4 --forward-reps 8 --window-bytes "${WINDOW:-268435456}" \
        > "/tmp/online_$1_$2.log" 2>&1
    echo "exit $?"; tail -17 "/tmp/online_$1_$2.log"
done
echo "total $(( $(date +%s) - t0 )) s"
