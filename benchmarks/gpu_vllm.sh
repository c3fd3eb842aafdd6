#!/usr/bin/env bash
# ddtree inside vLLM on a lent GPU box, from the thin bundle (docs/platforms.md, "vLLM on the GPU
# boxes"): the box has torch 2.11.0+cu130 and no network; vLLM comes in two part folders made by
#   python3 scripts/offline_bundle.py pack --thin --python 3.12 --platform manylinux_2_39_x86_64 \
#       --out build/gpu-bundle
# one part per device call (each call carries the working tree plus one part, under 64 MiB),
# the calls back to back (the box keeps /tmp while warm, 30 s):
#   call 1, carry ["build/gpu-bundle/part-001"]:  bash benchmarks/gpu_vllm.sh receive
#   call 2, carry ["build/gpu-bundle/part-002"]:  bash benchmarks/gpu_vllm.sh run [vllm_gpu.py args]
# `receive` copies the carried part folders to $STORE; `run` receives too, then verifies, joins
# and installs the bundle into $SITE (once per bundle), imports what a run imports and loads the
# kept extensions (benchmarks/vllm_imports.py, ~20 s: a missing module stops here, named), then
# runs benchmarks/vllm_gpu.py (default --time-budget 420; keep it under 480: the command limit is
# 600 s). $OUT (the device tool's return folder, at most 8 files) gets the result JSON and PNG
# and one archive of every log and the import report, vllm_gpu_logs.tar.gz.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
store="${STORE:-/tmp/gpu-bundle}"
site="${SITE:-/tmp/vllm-site}"
carried="$root/build/gpu-bundle"
out="${OUT:-$root/benchmarks/results}"

receive() {
    mkdir -p "$store"
    local found=0
    for part in "$carried"/part-*; do
        [ -d "$part" ] || continue
        cp -r "$part" "$store"/ && found=1
    done
    [ "$found" = 1 ] || { echo "no part folder under $carried: name build/gpu-bundle/part-NNN in carry"; exit 2; }
    echo "parts in $store: $(cd "$store" && ls -d part-* | tr '\n' ' ')"
}

case "${1:-}" in
    receive)
        receive
        ;;
    run)
        shift
        receive
        stamp="$site/.bundle-manifest.sha256"
        want="$(sha256sum "$store"/part-001/manifest.json | cut -c1-64)"
        if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
            rm -rf "$site"
            timeout 240 "$py" scripts/offline_bundle.py unpack "$store" --prefix "$site" || exit 3
            echo "$want" > "$stamp"
        fi
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
        logs="$(mktemp -d)"
        mkdir -p "$out"
        trap 'tar czf "$out/vllm_gpu_logs.tar.gz" -C "$logs" .' EXIT
        nvidia-smi -L || true
        timeout 180 "$py" benchmarks/vllm_imports.py --out "$logs/vllm_imports.json" 2>&1 \
            | grep -v "^INFO" | tee "$logs/vllm_imports.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "imports failed: see vllm_imports.log in the archive"; exit 4; }
        budget=()
        [[ " $* " == *" --time-budget "* ]] || budget=(--time-budget 420)
        OUT="$logs" timeout 540 "$py" benchmarks/vllm_gpu.py "${budget[@]}" "$@" 2>&1 | tee "$logs/vllm_gpu.log"
        status="${PIPESTATUS[0]}"
        cp "$logs"/vllm_gpu_*.json "$logs"/vllm_gpu_*.png "$out"/ 2>/dev/null
        exit "$status"
        ;;
    *)
        echo "usage: bash benchmarks/gpu_vllm.sh receive | run [benchmarks/vllm_gpu.py arguments]"
        exit 2
        ;;
esac
