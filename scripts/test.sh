#!/usr/bin/env bash
# Sets up .venv/ if needed, then runs the whole test suite on the CPU.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_venv.sh"
cd "$root"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
# --durations: the slowest tests in every log (CI must stay under 30 minutes)
exec "$root/.venv/bin/python" -m pytest -q -ra --durations=25 "$@"
