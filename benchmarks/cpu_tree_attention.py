"""The CPU backend's tree-row attention (the fused ``tree_attention_`` op) per layer call.

Tiny-pair shapes (6 query heads, 2 K/V heads, head size 32, float32, vLLM's ``vec`` cache
layout written by vLLM's own writer), ~100 or ~2000 context positions per request, R requests
with m nodes each (and their roots); every result is checked against the torch twin
(``tree_rows_attention`` over the layout's gathers) before it is timed. Microseconds per call,
best of 3 x 200 calls.

    python benchmarks/cpu_tree_attention.py --label after
    python benchmarks/cpu_tree_attention.py --label after_aten --aten  # the op's ATen path
    # another version of the op's source, side by side in the same file (its own build):
    git show HEAD~1:kernels/csrc/ddtree_cpu.cpp > /tmp/old/ddtree_cpu.cpp
    TORCH_EXTENSIONS_DIR=/tmp/old_build python benchmarks/cpu_tree_attention.py \\
        --label before --source /tmp/old/ddtree_cpu.cpp

Each run is appended to ``--out`` (default ``benchmarks/results/cpu_tree_attention_cpu.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# this folder's kernels.py must not shadow the repository's kernels package
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.join(ROOT, "benchmarks")]
# (requests, nodes per request, context positions of the first request)
CASES = [(1, 7, 100), (1, 16, 100), (8, 7, 100), (8, 16, 100), (32, 7, 100), (1, 16, 2000),
         (8, 16, 2000)]


def one_case(ops, num_reqs: int, nodes: int, context: int, vectorized: bool = True) -> float:
    from vllm_ddtree.plugin.cpu_attention import (
        _write_with_vllm, cpu_kv_layout, tree_attention_info, tree_rows_attention)
    from vllm_ddtree.tree import build_tree

    isa, dtype, bs, nkv, d, group = "vec", torch.float32, 16, 2, 32, 3
    gen = torch.Generator().manual_seed(3)
    ctx, num_draft = [context + 3 * r for r in range(num_reqs)], [nodes] * num_reqs
    per = (max(ctx) + nodes + 1 + bs - 1) // bs
    num_blocks = num_reqs * per + 4
    tree = build_tree(torch.randn(num_reqs, 7, 50, generator=gen), torch.tensor(num_draft),
                      max_budget=nodes)
    seq_lens = [c + m + 1 for c, m in zip(ctx, num_draft)]
    table = torch.randperm(num_blocks, generator=gen)[:num_reqs * per].view(num_reqs, per)
    table = table.to(torch.int32)
    starts = list(np.cumsum([0] + [m + 1 for m in num_draft[:-1]]))
    num_rows = int(starts[-1]) + num_draft[-1] + 1
    slots = torch.cat([table[r, p // bs].long() * bs + p % bs
                       for r, p in enumerate(torch.arange(n) for n in seq_lens)])
    k = torch.randn(sum(seq_lens), nkv, d, generator=gen).to(dtype)
    v = torch.randn(sum(seq_lens), nkv, d, generator=gen).to(dtype)
    cache = _write_with_vllm(isa, dtype, num_blocks, bs, nkv, d, k, v, slots)
    q = torch.randn(num_rows, nkv * group, d, generator=gen).to(dtype)
    requests = [(r, int(starts[r]), m) for r, m in enumerate(num_draft)]
    info = tree_attention_info(tree.dense_mask(), requests, seq_lens, table, bs)
    layout = cpu_kv_layout(cache, isa)
    flat = cache.view(-1)
    k_index, v_index = layout.index(info.slots)
    want = tree_rows_attention(q[info.rows], flat[k_index], flat[v_index], info.mask, 0.3, isa)
    out = torch.zeros_like(q)

    def call():
        ops.tree_attention_(out, q, flat, layout.offsets, layout.slot_stride, info.rows,
                            info.valid, info.slots, info.mask, 0.3, False, vectorized)

    call()
    torch.testing.assert_close(out[info.rows[info.valid]], want[info.valid], atol=2e-6,
                               rtol=1e-5)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(200):
            call()
        best = min(best, (time.perf_counter() - start) / 200)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True, help="names this run in the file")
    parser.add_argument("--source", default=None,
                        help="build the op from this ddtree_cpu.cpp instead of the checkout's "
                             "(set TORCH_EXTENSIONS_DIR to a folder of its own)")
    parser.add_argument("--aten", action="store_true",
                        help="the op's ATen path (CPUs without AVX2) instead of its AVX2 loop")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "cpu_tree_attention_cpu.json"))
    args = parser.parse_args()
    from vllm_ddtree.kernels import native

    if args.source:
        native.SOURCE = os.path.abspath(args.source)
    ops = native.cpu_ops("cpu")
    if ops is None:
        raise SystemExit("the fused CPU kernels are not built here")
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    source = args.source or f"{commit}:kernels/csrc/ddtree_cpu.cpp"
    print(f"{args.label}: the op built from {source}", flush=True)
    rows = []
    for num_reqs, nodes, context in CASES:
        us = one_case(ops, num_reqs, nodes, context, not args.aten)
        rows.append({"requests": num_reqs, "nodes": nodes, "context": context,
                     "us_per_call": round(us, 1)})
        print(f"{args.label}: {num_reqs} requests x {nodes} nodes, context {context}: "
              f"{us:.1f} us", flush=True)
    runs = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            runs = [r for r in json.load(f)["runs"] if r["label"] != args.label]
    runs.append({"label": args.label, "source": source, "threads": torch.get_num_threads(),
                 "path": "aten" if args.aten else "avx2 where the CPU has it",
                 "command": "python benchmarks/cpu_tree_attention.py " + " ".join(sys.argv[1:]),
                 "rows": rows})
    with open(args.out, "w") as f:
        json.dump({"device": "cpu", "runs": runs}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
