#!/usr/bin/env python
"""Where a paused drafter's step goes, block by block, against plain decoding's same blocks.

Starts plain decoding and ``ddtree_cold`` (auto whose first "do not draft" answer pauses it for
good: every step after it is a cold one, the steady state of a drafter that does not pay;
``lockstep.py``) and runs the same waves of c requests on both in lockstep, one engine step
each in turn. Timers wrap the engine's blocks (the scheduler's ``schedule`` and
``update_from_output``, the runner's ``_prepare_inputs``, forward, ``_sample``,
``sample_tokens``, the drafter hand-off) and the plugin's methods inside them; each is keyed by
the engine whose step is running, so both engines' blocks are timed in place, cache misses and
all (several times a micro-benchmark's on the CPU). ``own`` rows are a plugin patch's time less
the vLLM method it wraps. Prints microseconds per step for both engines and their difference,
with the wave's first step (the prefill) apart from the decode steps.

Usage::

    .venv/bin/python benchmarks/step_overhead.py --concurrency 8 --waves 32
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# budget_policy first: launches drops this directory from sys.path (see stage_times.py)
import budget_policy  # noqa: E402
import lockstep  # noqa: E402

# (owner's import path, attribute): vLLM's blocks of an engine step
VLLM_BLOCKS = [
    ("vllm.v1.core.sched.scheduler.Scheduler", "schedule"),
    ("vllm.v1.core.sched.scheduler.Scheduler", "update_from_output"),
    ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "_prepare_inputs"),
    ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "_model_forward"),
    ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "_sample"),
    ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "sample_tokens"),
    ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "propose_draft_token_ids"),
    ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "take_draft_token_ids"),
    ("vllm.v1.engine.output_processor.OutputProcessor", "process_outputs"),
]
# the plugin's patches whose own work is their time less the vLLM method they wrap
OWN = ["schedule", "_prepare_inputs", "propose_draft_token_ids"]
PLUGIN_METHODS = [
    ("vllm_ddtree.plugin.state.TreeState", ["plan_step", "went_cold", "no_drafts"]),
    ("vllm_ddtree.plugin.policy.BudgetController", ["step_started"]),
    ("vllm_ddtree.plugin.proposer.DDTreeProposer", ["skip_context", "flush_context"]),
]


class Timers:
    """Seconds per (engine, key), split into the waves' first steps and the others."""

    def __init__(self):
        self.seconds = collections.Counter()
        self.first_step = False  # whether the running step is a wave's first

    def wrap(self, func, key: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                part = "first" if self.first_step else "decode"
                self.seconds[(lockstep.CLOCKS.active, key, part)] += time.perf_counter() - start

        return timed


def owner_of(path: str):
    import importlib

    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def install(timers: Timers) -> None:
    """Timed copies of every block and plugin method (installed after the engines started:
    the plugin's version check reads vLLM's methods at start-up)."""
    for path, name in VLLM_BLOCKS:
        owner = owner_of(path)
        patch = getattr(owner, name)
        if name in OWN:  # the vLLM method the plugin's patch wraps (a closure variable)
            cell = patch.__closure__[patch.__code__.co_freevars.index("original")]
            cell.cell_contents = timers.wrap(cell.cell_contents, "vllm " + name)
        setattr(owner, name, timers.wrap(patch, name))
    for path, names in PLUGIN_METHODS:
        owner = owner_of(path)
        for name in names:
            setattr(owner, name, timers.wrap(getattr(owner, name), "ddtree " + name))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--waves", type=int, default=32, help="timed waves of c requests")
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the runner in this process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ls = argparse.Namespace(concurrency=args.concurrency, waves=args.waves,
                            max_tokens=args.max_tokens, decode_steps=0, max_model_len=512,
                            budgets=[16], only=["plain", "ddtree_cold"])
    engines, prompts = lockstep.start_warm(lockstep.configurations(ls), ls)
    timers = Timers()
    install(timers)
    step = lockstep.timed_step

    def timed_step(name, llm):  # a wave's first step: the engine holds no running request
        timers.first_step = not llm.llm_engine.engine_core.engine_core.scheduler.running
        return step(name, llm)

    lockstep.timed_step = timed_step
    results = lockstep.run_waves(engines, prompts, ls)
    for name, r in results.items():  # lockstep's own split of the step times
        timers.seconds[(name, "engine step", "first")] = r["first_step_seconds"]
        timers.seconds[(name, "engine step", "decode")] = r["seconds"] - r["first_step_seconds"]
    steps = {"first": args.waves, "decode": results["plain"]["steps"] - args.waves}
    assert results["plain"]["steps"] == results["ddtree_cold"]["steps"], results
    cold = budget_policy.ddtree_auto_stats(engines["ddtree_cold"]) or {}
    print(f"{args.concurrency} requests, {args.waves} waves of {args.max_tokens} tokens; "
          f"ddtree_cold / plain throughput "
          f"{results['ddtree_cold']['tokens_per_s'] / results['plain']['tokens_per_s']:.4f}; "
          f"drafter cold in {100 * cold.get('drafter_cold_fraction', 0):.0f}% of its steps")
    keys = ["engine step"] + [name for _, name in VLLM_BLOCKS] \
        + ["own " + name for name in OWN] \
        + ["ddtree " + n for _, names in PLUGIN_METHODS for n in names]
    for part in ("decode", "first"):
        n = steps[part]
        print(f"{part} steps ({n} each), us per step: plain, ddtree_cold, difference")
        for key in keys:
            def per_step(name):
                s = timers.seconds
                if key.startswith("own "):
                    base = key[4:]
                    total = s[(name, base, part)] - s[(name, "vllm " + base, part)]
                else:
                    total = s[(name, key, part)]
                return 1e6 * total / max(n, 1)

            a, b = per_step("plain"), per_step("ddtree_cold")
            if a or b:
                print(f"  {key:34s} {a:9.1f} {b:9.1f} {b - a:+8.1f}")
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
