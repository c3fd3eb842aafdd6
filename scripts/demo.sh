#!/usr/bin/env bash
# Sets up .venv/ if needed, then serves the committed tiny pair with DDTree through vLLM's
# OpenAI-compatible server on 127.0.0.1, asks it one chat question, prints the answer and the
# acceptance figures from /metrics, and stops the server.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_venv.sh"
cd "$root"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$root/.venv/bin/python" "$root/scripts/demo.py" "$@"
