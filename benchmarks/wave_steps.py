#!/usr/bin/env python
"""How many requests each decode step of ``budget_policy.py``'s waves runs, per configuration.

    .venv/bin/python benchmarks/wave_steps.py [--concurrency 8 32] [--budgets 16]
        [--out PATH]

``budget_policy.py`` runs its prompts in waves of c requests of exactly ``--max-tokens`` tokens.
Plain decoding finishes a wave's requests in the same step; drafting finishes them at different
steps, so the end of each wave runs with fewer requests. auto measures its rates per step and
per batch size, which cannot see that. This counts, for plain decoding and each static budget
(greedy, the same prompts and waves), the decode steps by their number of requests: a
histogram, the steps in all and the request-steps (requests summed over steps), so the share of
a wave's steps and of its batch capacity that the ragged end takes can be read off. Counts, not
times: they do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# budget_policy first: launches drops this directory from sys.path (see stage_times.py)
import budget_policy  # noqa: E402
import launches  # noqa: E402


def count_steps(llm, prompts: list[dict], concurrency: int, max_tokens: int) -> dict:
    """Decode steps of ``llm`` by batch size over ``prompts`` in waves of ``concurrency``."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    spec = llm.llm_engine.vllm_config.speculative_config
    budget = 0 if spec is None else spec.num_speculative_tokens
    sizes: collections.Counter = collections.Counter()
    schedule = Scheduler.schedule  # patched only now: the plugin checks vLLM's own at start

    def counted(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        per_request = out.num_scheduled_tokens
        # decode steps only (a prefill schedules the prompt's tokens)
        if per_request and max(per_request.values()) <= budget + 1:
            sizes[len(per_request)] += 1
        return out

    Scheduler.schedule = counted
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i in range(0, len(prompts), concurrency):
            llm.generate(prompts[i:i + concurrency], params, use_tqdm=False)
    finally:
        Scheduler.schedule = schedule
    steps = sum(sizes.values())
    request_steps = sum(n * count for n, count in sizes.items())
    return {"decode_steps": steps, "request_steps": request_steps,
            "steps_below_concurrency": steps - sizes[concurrency],
            "unused_batch_share": round(1 - request_steps / max(concurrency * steps, 1), 3),
            "steps_by_batch_size": dict(sorted(sizes.items()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "wave_steps_cpu.json"))
    args = parser.parse_args()
    policy_args = budget_policy.parse_args(
        ["--concurrency", *map(str, args.concurrency), "--max-tokens", str(args.max_tokens),
         "--budgets", *map(str, args.budgets),
         "--only", "plain", *(f"ddtree_B{b}" for b in args.budgets)])
    configs = budget_policy.configurations(policy_args, budget_policy.drafter_depth(
        policy_args.drafter))
    llms = budget_policy.start_engines(policy_args, configs)
    prompts = budget_policy.prompts_for(policy_args, args.num_prompts)
    results = []
    for c in args.concurrency:
        for name, llm in llms.items():
            counts = count_steps(llm, prompts, c, args.max_tokens)
            results.append({"name": name, "concurrency": c, **counts})
            print(f"c={c:3d} {name:17s} {counts['decode_steps']:4d} decode steps, "
                  f"{counts['steps_below_concurrency']:4d} with fewer than {c} requests, "
                  f"{100 * counts['unused_batch_share']:.0f} % of the batch unused: "
                  f"{counts['steps_by_batch_size']}", flush=True)
    launches.write_results(args.out, __file__, results)


if __name__ == "__main__":
    main()
