"""Batched tree builder vs the heap reference (DDTree Algorithm 1), and build + verify.

The reference pays what the official implementation pays: log-softmax and top-k on the device,
the device-to-host copy, and the Python heap (:func:`vllm_ddtree.tree.reference_build_tree`).
For build + verify, the reference samples the target on the device with the same sampler,
copies the samples to the host and walks the tree in Python (the official ``follow the
children dict`` loop); ours is ``verify_tree(build_tree(...))`` with no host sync. Both sides
run in the same process on the same inputs; ratios are reference / ours (higher = faster).

    python benchmarks/tree_build.py                          # CPU -> results/tree_build_cpu.json
    python benchmarks/tree_build.py --device cuda            # GPU -> results/tree_build_cuda.json
    python benchmarks/tree_build.py --device cuda --cuda-graph   # ours replayed from a CUDA graph

Columns: ``build`` = tree only; ``bv T=0`` / ``bv T=1`` = build + verify, greedy / temperature 1.
Build + verify is skipped (``-``) where the target logits ``[batch, B + 1, vocab]`` float32
would exceed ``--max-target-gib``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from vllm_ddtree.sampling import SamplingBatch, sample_tokens
from vllm_ddtree.tree import build_tree, reference_build_tree
from vllm_ddtree.walk import verify_tree


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, repeats: int, warmup: int) -> float:
    """Median wall time of ``fn()`` in seconds, the device synchronised around each call."""
    for _ in range(warmup):  # also fills the candidate-pair cache and the allocator
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _as_cuda_graph(fn):
    """Capture ``fn`` (fixed shapes, no host sync) once; return a replay closure.

    Inputs are the tensors ``fn`` closes over; they must not be reallocated between replays.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def reference_walk(trees: list[dict], sampled: torch.Tensor) -> list[list[int]]:
    """Host walk of the official implementation: ``[batch, B + 1]`` samples -> output tokens.

    Example: nodes (token, parent) = [(5, -1), (7, -1), (9, 0)] and samples [5, 1, 9, 2] at
    rows [root, node 0, node 1, node 2]: 5 -> node 0, y[node 0] = 1 matches nothing, so the
    output is [5, 1].
    """
    sampled = sampled.cpu().tolist()  # the device-to-host copy (a sync on a GPU)
    outputs = []
    for tree, y in zip(trees, sampled):
        children = {(p, t): k for k, (p, t) in enumerate(zip(tree["parents"], tree["token_ids"]))}
        node, out = -1, []
        while (node, y[node + 1]) in children:
            node = children[(node, y[node + 1])]
            out.append(tree["token_ids"][node])
        outputs.append(out + [y[node + 1]])
    return outputs


def _check_same_result(logits, budget, target, sampling) -> None:
    """Greedy outputs of both paths agree (a benchmark that computes the wrong thing is void)."""
    verdict = verify_tree(build_tree(logits, budget), target, sampling)
    ref = reference_walk(reference_build_tree(logits, budget), sample_tokens(target, sampling))
    ours = [[t for t in row if t >= 0] for row in verdict.output_tokens.cpu().tolist()]
    if ours != ref:
        raise RuntimeError(f"batched and reference outputs differ at budget {budget}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-verify-gb", type=float, default=4.0,
                        help="skip build+verify where the target logits would exceed this size")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--max-target-gib", type=float, default=None,
                        help="skip build+verify above this target-logits size "
                             "(default 1.5 on CPU, 16 on GPU)")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="time our build (+verify) as CUDA graph replays")
    parser.add_argument("--out", default=None, help="JSON path (default results/tree_build_<device>.json)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.cuda_graph and device.type != "cuda":
        parser.error(f"--cuda-graph needs a CUDA device, got --device {args.device}")
    max_gib = args.max_target_gib if args.max_target_gib is not None else (
        16.0 if device.type == "cuda" else 1.5)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)

    def timed(fn, reference: bool = False) -> float:
        if args.cuda_graph and not reference:
            fn = _as_cuda_graph(fn)
        return _time(fn, device, args.repeats, args.warmup)

    rows = []
    header = (f"{'batch':>5} {'B':>5} | {'build ref':>9} {'ours':>8} {'ratio':>7} | "
              f"{'bv T=0 ref':>10} {'ours':>8} {'ratio':>7} | {'bv T=1 ref':>10} {'ours':>8} {'ratio':>7}")
    print(f"device {device}, vocab {args.vocab}, depth {args.depth}, {args.dtype}, times in ms (median of "
          f"{args.repeats})")
    print(header)
    for batch in args.batches:
        logits = (torch.randn(batch, args.depth, args.vocab, device=device, generator=gen) * 4).to(dtype)
        greedy = None  # all-greedy batches pass None (vLLM's all_greedy): argmax only
        random = SamplingBatch(temperature=torch.ones(batch, device=device))
        for budget in args.budgets:
            row = {"batch": batch, "budget": budget}
            row["build_reference_ms"] = timed(lambda: reference_build_tree(logits, budget), True) * 1e3
            row["build_ms"] = timed(lambda: build_tree(logits, budget)) * 1e3
            row["build_speedup"] = row["build_reference_ms"] / row["build_ms"]
            target_gib = batch * (budget + 1) * args.vocab * 4 / 2**30
            if target_gib <= max_gib:
                target = torch.randn(batch, budget + 1, args.vocab, device=device, generator=gen)
                _check_same_result(logits, budget, target, greedy)
                for name, sampling in (("t0", greedy), ("t1", random)):
                    ref = timed(lambda: reference_walk(reference_build_tree(logits, budget),
                                                       sample_tokens(target, sampling)), True)
                    ours = timed(lambda: verify_tree(build_tree(logits, budget), target, sampling))
                    row[f"bv_{name}_reference_ms"] = ref * 1e3
                    row[f"bv_{name}_ms"] = ours * 1e3
                    row[f"bv_{name}_speedup"] = ref / ours
                del target
            rows.append(row)
            cells = [f"{batch:>5} {budget:>5} | {row['build_reference_ms']:>9.2f} {row['build_ms']:>8.2f} "
                     f"{row['build_speedup']:>6.1f}x"]
            for name in ("t0", "t1"):
                if f"bv_{name}_ms" in row:
                    cells.append(f"{row[f'bv_{name}_reference_ms']:>10.2f} {row[f'bv_{name}_ms']:>8.2f} "
                                 f"{row[f'bv_{name}_speedup']:>6.1f}x")
                else:
                    cells.append(f"{'-':>10} {'-':>8} {'-':>7}")
            print(" | ".join(cells), flush=True)

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
    result = {
        "command": " ".join(["python", "benchmarks/tree_build.py"] + sys.argv[1:]),
        "device": name,
        "device_type": device.type,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "vocab": args.vocab,
        "depth": args.depth,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "cuda_graph": args.cuda_graph,
        "rows": rows,
    }
    default = f"tree_build_{device.type}{'_graph' if args.cuda_graph else ''}.json"
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / default
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
