#!/usr/bin/env python
"""Replay recorded full-width trees under tree-sizing rules: what auto's sizing is worth at one
request, by its own cost model, with the acceptances the target really gave.

    .venv/bin/python benchmarks/tree_replay.py [--budget 24]
        [--first-prompt 0] [--num-prompts 32] [--max-tokens 64] [--trees PATH] [--out PATH]

Record (skipped when ``--trees`` names an existing file): vLLM with ddtree "auto" at maximum
budget B whose every proposal step drafts the full-width tree (its exploration trees, every
step), greedy, one held-out prompt of ``budget_policy.py`` at a time; every verified tree that
was the drafter's proposal is kept (each node's path log-probability and depth, and which
nodes the walk accepted), with the engine's step cost model and its learned drafting overhead.
Then ``--trees`` holds them.

Replay: each rule sizes every recorded tree in order, keeping a prefix of its best-first nodes
(a subtree: the walk of the kept nodes accepts the recorded path's nodes among them). auto's
rules learn their calibration (``vllm_ddtree.budget.Calibration``) from the nodes they kept,
as the engine does, and take a full-width tree every ``EXPLORE_TREE_EVERY``-th step. A step
emits 1 + its accepted kept nodes and costs the cost model's verify time of 1 + k rows plus
the drafter's time and the overhead. With ``node scale`` s every row past the first costs s
times what the recorded model says, for the rules' model and for the clock alike: the start-up
measurement of the verify curve differs between engine starts on the CPU (a node cost 21-31 us
in two starts here), and where nodes are cheap every rule keeps them all. Prints tokens per
second by that clock and the mean kept nodes per rule, and for auto's rules how often the
nodes they cut were accepted against how often they predicted (by the calibration of the
moment); writes them (JSON, with this command).

The rules: ``full`` (B nodes), ``B=b`` (the first b), ``auto, tie 0`` (auto's best tree) and
``auto, tie t`` (the largest tree within t of the best's modelled rate, ``policy.TREE_TIE``).
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
NODE_SCALES = (1.0, 1.5, 2.0)


def record(args) -> dict:
    import torch
    from vllm import SamplingParams
    from vllm_utils import close, ddtree_state, make_llm

    from vllm_ddtree.plugin import policy
    from vllm_ddtree.plugin.state import TreeState

    explore_every, policy.EXPLORE_TREE_EVERY = policy.EXPLORE_TREE_EVERY, 1  # full width
    trees = []
    finish_verify = TreeState.finish_verify

    @functools.wraps(finish_verify)
    def recording(self, verdict, *rest, **kwargs):
        tree = self.verify.tree
        if (tree.max_budget == args.budget and bool(self.verify.matched.all())
                and bool((tree.depths > 0).all())):  # a full-width proposal
            trees.append((tree.scores[0].clone(), tree.depths[0].clone(),
                          verdict.accepted_nodes[0].clone()))
        return finish_verify(self, verdict, *rest, **kwargs)

    TreeState.finish_verify = recording
    spec = {"method": "ddtree", "model": args.drafter, "num_speculative_tokens": args.budget,
            "ddtree_budget_policy": "auto"}
    llm = make_llm(spec, model=args.target, max_num_seqs=8, kv_cache_memory_bytes=1 << 28)
    controller = ddtree_state(llm).budgets
    prompt_args = budget_policy.parse_args(["--target", args.target, "--prompt-len", "64"])
    prompts = budget_policy.prompts_for(prompt_args, args.first_prompt + args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for prompt in prompts[args.first_prompt:]:
        llm.generate([prompt], params, use_tqdm=False)
    policy.EXPLORE_TREE_EVERY = explore_every  # the replay's auto explores as the engine does
    data = {"trees": trees, "cost": controller.cost.to_dict(),
            "on_overhead": controller.on_overhead, "budget": args.budget}
    close(llm)
    torch.save(data, args.trees)
    return data


def replay(data: dict, tie: float) -> list[dict]:
    import torch

    from vllm_ddtree.budget import Calibration, CostModel, budget_function, node_gains
    from vllm_ddtree.plugin import policy

    recorded = {name: tuple(values) for name, values in data["cost"].items()}
    width, on_overhead = data["budget"], data["on_overhead"]
    depth = max(int(d.max()) for _, d, _ in data["trees"])
    greedy = torch.zeros(1, dtype=torch.bool)

    def run(rule, scale: float) -> tuple[float, float, float, float]:
        first = recorded["verify_seconds"][0]
        cost = CostModel(**{**recorded, "verify_seconds": tuple(
            first + scale * (t - first) for t in recorded["verify_seconds"])})
        calibration = Calibration(depth, torch.device("cpu"))
        tokens = seconds = kept = 0.0
        cut_accepted = cut_predicted = 0.0  # auto's cut nodes: accepted, and its prediction
        base = cost.verify_time_host(1) + cost.draft_time(1) + on_overhead
        for step, (scores, depths, accepted) in enumerate(data["trees"]):
            if isinstance(rule, int):
                k = rule
            elif step % policy.EXPLORE_TREE_EVERY == 0:
                k = width
            else:
                fn = budget_function(cost, calibration, greedy, on_overhead=on_overhead,
                                     versus_plain=False, tie=rule[1])
                k = int(fn(scores[None], depths[None])[0])
                gains = node_gains(scores[None], depths[None], calibration.factors(), greedy)
                cut_predicted += float(gains[0, k:].sum())
                cut_accepted += sum(1 for n in accepted if n >= k)
            path = [int(n) for n in accepted if 0 <= n < k]  # the walk of the kept nodes
            if not isinstance(rule, int) and k:
                calibration.observe(scores[None, :k], depths[None, :k],
                                    torch.tensor([path + [-1] * (depth + 1 - len(path))]),
                                    torch.ones(1, dtype=torch.bool), greedy)
            tokens += 1 + len(path)
            seconds += base + cost.verify_time_host(1 + k) - cost.verify_time_host(1)
            kept += k
        cut = len(data["trees"]) * width - kept
        return (tokens / seconds, kept / len(data["trees"]), cut_accepted / max(cut, 1),
                cut_predicted / max(cut, 1))

    rules = [("full", width), *((f"B={b}", b) for b in (16, 20) if b < width),
             ("auto, tie 0", ("auto", 0.0)), (f"auto, tie {tie:g}", ("auto", tie))]
    rows = []
    for scale in NODE_SCALES:
        for name, rule in rules:
            rate, kept, accepted, predicted = run(rule, scale)
            rows.append({"rule": name, "node_scale": scale, "tokens_per_s": round(rate, 2),
                         "mean_nodes": round(kept, 2),
                         "cut_nodes_accepted_each": round(accepted, 4),
                         "cut_nodes_predicted_each": round(predicted, 4)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=os.path.join(PAIR, "target"))
    parser.add_argument("--drafter", default=os.path.join(PAIR, "drafter"))
    parser.add_argument("--budget", type=int, default=24)
    parser.add_argument("--first-prompt", type=int, default=0)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--trees", default="/tmp/ddtree_replay_trees.pt")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "tree_replay_cpu.json"))
    args = parser.parse_args()

    import torch

    from vllm_ddtree.plugin.policy import TREE_TIE

    if os.path.exists(args.trees):
        data = torch.load(args.trees)
        args.budget = data["budget"]
    else:
        data = record(args)
    rows = replay(data, TREE_TIE)
    print(f"{len(data['trees'])} full-width trees of B = {args.budget}")
    for scale in NODE_SCALES:
        print(f"node scale {scale}:")
        for r in (r for r in rows if r["node_scale"] == scale):
            print(f"  {r['rule']:14s} {r['tokens_per_s']:8.2f} tokens/s  "
                  f"{r['mean_nodes']:5.2f} nodes  cut nodes: accepted "
                  f"{r['cut_nodes_accepted_each']:.4f} each, predicted "
                  f"{r['cut_nodes_predicted_each']:.4f}")
    with open(args.out, "w") as f:
        json.dump({"device": "cpu", "command": "python benchmarks/tree_replay.py "
                   + " ".join(sys.argv[1:]), "trees": len(data["trees"]),
                   "budget": args.budget, "calibrated_trees": True,
                   "first_prompt": args.first_prompt, "num_prompts": args.num_prompts,
                   "recorded_cost_model": data["cost"],
                   "recorded_on_overhead_s": data["on_overhead"], "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
