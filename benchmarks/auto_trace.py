#!/usr/bin/env python
"""What auto's steps did, round by round, next to plain decoding, in ``budget_policy.py``'s
steady workload (c requests in flight at all times).

    .venv/bin/python benchmarks/auto_trace.py [--concurrency 8] [--budget 24]
        [--rounds 4] [--out PATH]

Plain decoding and auto (maximum tree ``--budget``) run side by side, round by round, each
round one steady cell per engine (``--passes`` x 32 prompts). For each round: both engines'
tokens/s, and auto's steps by kind: decode-only or with a prefill, drafting (it verified
drafts) or plain, each with its count, ms per step, emitted tokens per step and scheduled
tokens per step (1 + the nodes of each request's tree). The times are the scheduler's clock
stamps that auto itself reads (``BudgetController.step_started``): a step's time is the gap
to the next stamp. A diagnostic, not a throughput table: one engine runs a round at a time, so
the machine's drift between rounds moves both columns, and a round's auto and plain are only
comparable with each other.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# budget_policy first: launches drops this directory from sys.path (see stage_times.py)
import budget_policy  # noqa: E402
import launches  # noqa: E402
from vllm_utils import ddtree_state  # noqa: E402  (tests/, put on sys.path by launches)

GAP_S = 0.5  # a gap between stamps this long is the other engine's turn, not a step


def record_steps(controller) -> list[tuple]:
    """Wrap ``controller.step_started`` (the instance: vLLM's own methods stay unpatched) to
    record, per step, (stamp, requests, scheduled tokens, decode only, verified), and the
    tokens the previous step emitted."""
    steps = []
    started = controller.step_started

    def recorded(now, num_reqs, num_tokens, decode_only, verified, grammar_s=0.0):
        steps.append((now, num_reqs, num_tokens, decode_only, verified, controller._emitted))
        return started(now, num_reqs, num_tokens, decode_only, verified, grammar_s)

    controller.step_started = recorded
    return steps


def step_kinds(steps: list[tuple]) -> dict:
    """Per kind of step ("decode" / "prefill", "drafting" / "plain"): steps, ms per step,
    emitted and scheduled tokens per step, tokens/s."""
    kinds: dict[str, list] = {}
    for (start, reqs, tokens, decode, verified, _), (end, *_, emitted) in zip(steps, steps[1:]):
        if end - start >= GAP_S:
            continue
        kind = f"{'decode' if decode else 'prefill'}, {'drafting' if verified else 'plain'}"
        kinds.setdefault(kind, []).append((end - start, emitted or 0, tokens, reqs))
    out = {}
    for kind, rows in sorted(kinds.items()):
        seconds = sum(r[0] for r in rows)
        out[kind] = {"steps": len(rows), "ms_per_step": round(1000 * seconds / len(rows), 2),
                     "emitted_per_step": round(sum(r[1] for r in rows) / len(rows), 2),
                     "scheduled_per_step": round(sum(r[2] for r in rows) / len(rows), 1),
                     "requests_per_step": round(sum(r[3] for r in rows) / len(rows), 2),
                     "tokens_per_s": round(sum(r[1] for r in rows) / seconds, 1)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--budget", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "auto_trace_cpu.json"))
    args = parser.parse_args()
    auto = "ddtree_auto"
    policy_args = budget_policy.parse_args(
        ["--concurrency", str(args.concurrency), "--budgets", str(args.budget),
         "--only", "plain", auto])
    configs = budget_policy.configurations(policy_args, budget_policy.drafter_depth(
        policy_args.drafter))
    llms = budget_policy.start_engines(policy_args, configs)
    controller = ddtree_state(llms[auto]).budgets
    steps = record_steps(controller)
    prompts = budget_policy.prompts_for(policy_args, policy_args.num_prompts) * args.passes
    results = []
    for round_ in range(args.rounds):
        row = {"round": round_}
        first = len(steps)
        for name, llm in llms.items():
            seconds, tokens = budget_policy.steady_cell(llm, prompts, args.concurrency,
                                                        policy_args.max_tokens)
            row[f"{name}_tokens_per_s"] = round(tokens / seconds, 1)
        row["auto_steps"] = step_kinds(steps[first:])
        results.append(row)
        print(row, flush=True)
    results.append({"auto_summary": controller.summary()})
    launches.write_results(args.out, __file__, results)


if __name__ == "__main__":
    main()
