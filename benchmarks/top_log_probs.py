#!/usr/bin/env python
"""The tree build's input on CUDA: torch's log-softmax + top-k against the Triton top-k lists.

    python benchmarks/top_log_probs.py [--out PATH]

For the drafter's logits of a DFlash b16 drafter on Qwen3 (L = 15 rows per request, vocab
151936, bf16), R in {1, 8, 32} requests and k = B in {16, 64, 256}: the time of
``vllm_ddtree.tree._top_log_probs`` (float32 log-softmax, then ``torch.topk``, in memory-bounded
chunks of rows) and of ``kernels/verify_steps.top_log_probs_triton`` (two launches, no
vocabulary-sized temporary), side by side on one GPU (CUDA events, median of 50 after 5
warm-ups), and the GPU kernels each runs (``torch.profiler``). Needs torch + Triton and a
GPU, no vLLM (``ln -sfn ../kernels vllm_ddtree/kernels``, ``PYTHONPATH=<repo root>``). Writes
``benchmarks/results/top_log_probs_<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def time_ms(fn, repeats: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gpu_kernels(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from vllm_ddtree.kernels.verify_steps import top_log_probs_triton
    from vllm_ddtree.tree import _top_log_probs

    device = torch.device("cuda")
    name = torch.cuda.get_device_name()
    rows = []
    with torch.inference_mode():
        for requests in (1, 8, 32):
            logits = (torch.randn(requests, 15, 151936, device=device) * 8).to(torch.bfloat16)
            for k in (16, 64, 256):
                torch_fn = lambda: _top_log_probs(logits, k)  # noqa: E731
                triton_fn = lambda: top_log_probs_triton(logits, k)  # noqa: E731
                want, got = torch_fn(), triton_fn()
                row = dict(requests=requests, k=k,
                           torch_ms=round(time_ms(torch_fn), 4),
                           triton_ms=round(time_ms(triton_fn), 4),
                           torch_gpu_kernels=gpu_kernels(torch_fn),
                           triton_gpu_kernels=gpu_kernels(triton_fn),
                           max_value_diff=float((want[0].sort(-1).values
                                                 - got[0].sort(-1).values).abs().max()))
                row["speedup"] = round(row["torch_ms"] / row["triton_ms"], 2)
                print(json.dumps(row), flush=True)
                rows.append(row)
    out = args.out or os.path.join(ROOT, "benchmarks", "results",
                                   f"top_log_probs_{name.replace(' ', '_')}.json")
    with open(out, "w") as f:
        json.dump({"command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
                   "device": name, "torch": torch.__version__, "rows": rows}, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
