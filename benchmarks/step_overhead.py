#!/usr/bin/env python
"""Where a paused drafter's step goes: the plugin's own host work per step, timed in place.

Starts one ddtree engine with ``"auto"`` budgets kept cold (its first "do not draft" answer
pauses it for good, so every decode step after the first few is a cold step: the steady state
of a drafter that does not pay) and runs waves of c requests on it. Per-method timers wrap the
plugin's patches of vLLM's runner (each patch's own work = its time minus the time of the vLLM
method it wraps) and the plugin methods they call, so the numbers are the costs inside the
running engine, cache misses and all (several times a micro-benchmark's on the CPU). Prints
microseconds per step; compare with the step time it also prints, and with plain decoding's
(``benchmarks/budget_policy.py``).

Usage::

    .venv/bin/python benchmarks/step_overhead.py --concurrency 32
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PATCHED = ["_prepare_inputs", "_sample", "sample_tokens", "propose_draft_token_ids",
           "take_draft_token_ids", "_input_fits_in_drafter"]


def timing(func, key: str, totals: collections.Counter, calls: collections.Counter):
    """``func`` with its wall time added to ``totals[key]`` and its calls to ``calls[key]``."""
    def timed(*args, **kwargs):
        start = time.perf_counter_ns()
        try:
            return func(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter_ns() - start
            calls[key] += 1

    return timed


def time_method(owner, name: str, totals: collections.Counter,
                calls: collections.Counter) -> None:
    """Replace ``owner.name`` by a timed copy (key: ``name``)."""
    setattr(owner, name, timing(getattr(owner, name), name, totals, calls))


def time_wrapped_original(patch, name: str, totals: collections.Counter,
                          calls: collections.Counter) -> None:
    """Time the vLLM method a plugin patch wraps (its ``original``, a closure variable; key:
    ``"vllm " + name``)."""
    cell = patch.__closure__[patch.__code__.co_freevars.index("original")]
    cell.cell_contents = timing(cell.cell_contents, "vllm " + name, totals, calls)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--waves", type=int, default=6, help="timed waves of c requests")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the runner in this process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import budget_policy
    import vllm.v1.worker.gpu_model_runner as runner_module
    from vllm import SamplingParams

    import vllm_ddtree.plugin.policy as policy
    from vllm_ddtree.plugin.proposer import DDTreeProposer
    from vllm_ddtree.plugin.state import TreeState

    policy.FIRST_PAUSE = policy.MAX_PAUSE = 10**9  # one pause, for good: cold steps
    totals, calls = collections.Counter(), collections.Counter()
    for owner, names in ((TreeState, ["plan_step", "forget_finished", "went_cold",
                                      "no_drafts"]),
                         (policy.BudgetController, ["step_started"]),
                         (DDTreeProposer, ["skip_context", "flush_context", "_step_slots"])):
        for name in names:
            time_method(owner, name, totals, calls)
    bench = budget_policy.parse_args([])
    spec = dict(budget_policy.configurations(bench, depth=0))["ddtree_auto"]
    prompts = budget_policy.prompts_for(bench, args.concurrency)
    llm = budget_policy.start_engine(bench, spec, 1)
    cls = runner_module.GPUModelRunner
    for name in PATCHED:
        patch = getattr(cls, name)
        time_wrapped_original(patch, name, totals, calls)
        time_method(cls, name, totals, calls)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for _ in range(2):  # warm-up, and the policy's first answers
        llm.generate(prompts, params, use_tqdm=False)
    totals.clear()
    calls.clear()
    start = time.perf_counter()
    for _ in range(args.waves):
        llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    steps = calls["_prepare_inputs"]
    stats = budget_policy.ddtree_auto_stats(llm) or {}
    print(f"{args.concurrency} requests, {steps} steps, {1e3 * seconds / steps:.3f} ms per step, "
          f"drafter cold in {100 * stats.get('drafter_cold_fraction', 0):.0f}% of all steps")
    print("own work of each patch (its time minus the vLLM method it wraps), us per step:")
    for name in PATCHED:
        own = totals[name] - totals["vllm " + name]
        print(f"  {name:28s} {own / steps / 1e3:7.1f}")
    print("plugin methods inside them (calls), us per step:")
    for name in sorted(n for n in calls if n not in PATCHED and not n.startswith("vllm ")):
        print(f"  {name:28s} {totals[name] / steps / 1e3:7.1f}  ({calls[name]})")
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
