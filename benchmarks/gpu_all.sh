#!/usr/bin/env bash
# Everything of the kernels and stages that needs a GPU, in ONE device call (under 10 minutes):
#   1. tests/test_kernels_*.py, tests/test_verify_steps.py and tests/test_no_sync.py natively on
#      CUDA (fp32 at 1e-5, fp16, bf16 at 2e-2; the Triton tree build, walk and finish_verify
#      against their torch path; the tree build, walk and HSD verify with no host sync; the
#      periodic unmatched-row report's pinned copy),
#   2. benchmarks/cuda_stages.py (the verify step's stages on CUDA: equal to the CPU, launches,
#      host syncs, CUDA graph capture) -> benchmarks/results/cuda_stages_<device>.json,
#   3. benchmarks/kernels.py (tree_attention vs SDPA + dense mask vs FlexAttention vs causal,
#      compact_kv vs a per-layer loop) -> benchmarks/results/kernels_<device>.json.
# Runs on the lent GPU machine (torch + Triton, no vLLM, project not installed): the package
# is reached through a symlink shim, so nothing is pip-installed. Logs and JSON are copied to
# $OUT when that is set (the device tool's return folder).
#   bash benchmarks/gpu_all.sh [extra benchmarks/kernels.py arguments]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
shim="$(mktemp -d)"
mkdir -p "$shim/vllm_ddtree"
for f in "$root"/vllm_ddtree/*; do ln -s "$f" "$shim/vllm_ddtree/"; done
ln -sfn "$root/kernels" "$shim/vllm_ddtree/kernels"
# PYTHONSAFEPATH: no working directory first on sys.path (python -m, python -c in tests'
# subprocesses), where vllm_ddtree without its kernels folder would shadow the shim's
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
logs="${OUT:-$root/benchmarks/results}"
mkdir -p "$logs"
nvidia-smi -L || true
"$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

marker="$(mktemp)"  # results newer than this one are this run's
status=0
timeout 200 "$py" -m pytest -q -ra --noconftest -p no:cacheprovider \
    tests/test_kernels_attention.py tests/test_kernels_compact.py tests/test_verify_steps.py \
    tests/test_no_sync.py \
    tests/test_plugin_state.py::test_unmatched_rows_are_reported_one_period_late_without_reading_the_device \
    2>&1 | tee "$logs/gpu_kernel_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

timeout 120 "$py" benchmarks/cuda_stages.py 2>&1 | tee "$logs/gpu_cuda_stages.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

timeout 420 "$py" benchmarks/kernels.py "$@" 2>&1 | tee "$logs/gpu_kernel_bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if [ -n "${OUT:-}" ]; then
    find benchmarks/results -maxdepth 1 -name '*.json' -newer "$marker" -exec cp {} "$OUT"/ \;
fi
exit $status
