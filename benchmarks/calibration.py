#!/usr/bin/env python
"""How often a drafter's tree nodes are accepted against how often it says, per depth and
score bin: the data behind auto's calibration (``vllm_ddtree.budget.Calibration``).

    .venv/bin/python benchmarks/calibration.py [--budget 24]
        [--target T --drafter D] [--num-prompts 32] [--max-tokens 64] [--out PATH]

Runs vLLM with ddtree at a static budget B, greedy, one held-out prompt at a time (the prompts
of ``budget_policy.py``), and records every verified tree that was the drafter's proposal: each
real node's depth, its path log-probability s (under ``softmax(logits / t)``, the law the tree
is built from) and whether the walk accepted it. Prints and writes, per depth and per score bin
(``budget.score_bins``: unit-wide bins of s, the last one everything below -5), the ratio of
accepted nodes to their predicted acceptances (the sum of exp(s)), summed by auto's own
``Calibration`` without decay or prior, and the number of nodes, and per depth the ratio over
all bins (what a per-depth calibration sees). A ratio above 1: the drafter accepts more often
than it says. Cells of fewer than 20 nodes are left out.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# budget_policy first: launches drops this directory from sys.path (and sets the engine's
# environment, and puts the tests' helpers on sys.path)
import budget_policy  # noqa: E402
import launches  # noqa: E402, F401

PAIR = os.path.join(ROOT, "vllm_ddtree", "assets", "tiny_pair")
MIN_NODES = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=os.path.join(PAIR, "target"))
    parser.add_argument("--drafter", default=os.path.join(PAIR, "drafter"))
    parser.add_argument("--budget", type=int, default=24)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "calibration_cpu.json"))
    args = parser.parse_args()

    import torch
    from vllm import SamplingParams
    from vllm_utils import close, make_llm

    from vllm_ddtree.budget import SCORE_BINS, Calibration, score_bins
    from vllm_ddtree.plugin.state import TreeState

    records = []
    finish_verify = TreeState.finish_verify

    @functools.wraps(finish_verify)
    def recording(self, verdict, *rest, **kwargs):
        verify = self.verify
        records.append((verify.tree.scores.clone(), verify.tree.depths.clone(),
                        verdict.accepted_nodes.clone(), verify.matched.clone()))
        return finish_verify(self, verdict, *rest, **kwargs)

    TreeState.finish_verify = recording
    spec = {"method": "ddtree", "model": args.drafter, "num_speculative_tokens": args.budget,
            "ddtree_budget_policy": "static"}
    llm = make_llm(spec, model=args.target, max_num_seqs=8, kv_cache_memory_bytes=1 << 28)
    prompt_args = budget_policy.parse_args(["--target", args.target, "--prompt-len", "64"])
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for prompt in budget_policy.prompts_for(prompt_args, args.num_prompts):
        llm.generate([prompt], params, use_tqdm=False)
    close(llm)

    # auto's own accounting (decay 1, no prior: plain sums per cell), greedy row, plus the
    # number of nodes per cell
    depth = budget_policy.drafter_depth(args.drafter)
    calibration = Calibration(depth, torch.device("cpu"), decay=1.0, prior=0.0)
    nodes = torch.zeros(depth * SCORE_BINS, dtype=torch.int64)
    for tree_scores, tree_depths, accepted_nodes, matched in records:
        calibration.observe(tree_scores, tree_depths, accepted_nodes, matched,
                            torch.zeros_like(matched))
        real = matched[:, None] & (tree_depths > 0)
        nodes += torch.bincount((tree_depths[real] - 1) * SCORE_BINS
                                + score_bins(tree_scores[real]), minlength=nodes.numel())
    nodes = nodes.view(depth, SCORE_BINS)
    predicted, observed = calibration.predicted[0], calibration.observed[0]
    rows = []
    header = "depth  all     " + "  ".join(f"bin {b} [{-b - 1},{-b})" if b < SCORE_BINS - 1
                                           else f"bin {b} (< {-b})" for b in range(SCORE_BINS))
    print(f"{int(nodes.sum())} nodes, B = {args.budget}, calibrated trees")
    print(header)
    for d in range(depth):
        if not nodes[d].sum():
            continue
        cells = []
        for b in range(SCORE_BINS):
            n = int(nodes[d, b])
            ratio = float(observed[d, b] / predicted[d, b]) if n >= MIN_NODES else None
            cells.append({"bin": b, "nodes": n, "ratio": None if ratio is None
                          else round(ratio, 3)})
        overall = float(observed[d].sum() / predicted[d].sum())
        rows.append({"depth": d + 1, "nodes": int(nodes[d].sum()), "ratio": round(overall, 3),
                     "bins": cells})
        print(f"{d + 1:5d}  {overall:5.2f}  " + "  ".join(
            "      -       " if c["ratio"] is None else f"{c['ratio']:5.2f} ({c['nodes']:5d})"
            for c in cells))
    with open(args.out, "w") as f:
        json.dump({"device": "cpu", "command": "python benchmarks/calibration.py "
                   + " ".join(sys.argv[1:]), "budget": args.budget,
                   "calibrated_trees": True, "nodes": int(nodes.sum()),
                   "depths": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
