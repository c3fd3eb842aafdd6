#!/usr/bin/env python
"""Where a verify step's time goes: wall time per stage, in place, for ddtree and vLLM's dflash.

    .venv/bin/python benchmarks/stage_times.py [--target T --drafter D] [--budget 16]
        [--requests 1] [--max-tokens 64] [--out benchmarks/results/stage_times_cpu.json]

One in-process engine per method (the committed tiny pair unless ``--target``/``--drafter``:
``benchmarks/oracle_pair.py`` makes a pair whose drafter is always right), greedy, a warm-up,
then five timed ``generate`` rounds. The stages are ``benchmarks/launches.py``'s (the plugin's
own work between the forwards, and vLLM's rejection sampler and draft argmax for ``dflash``)
plus three of vLLM's own: the target forward (``_model_forward``: the tree rows' attention
included), the attention metadata (``_build_attention_metadata``: ddtree's tree mask included)
and the rest of vLLM's step (``vllm``: scheduling, input preparation, the drafter's forward).
Each stage's time excludes the stages nested in it. Prints and writes microseconds per emitted
token per stage (a verify step emits ``tau`` tokens: multiply by it for a step).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# budget_policy first: launches drops this directory from sys.path (and sets the engine's
# environment, and puts the tests' helpers on sys.path)
from budget_policy import drafter_depth  # noqa: E402
import launches  # noqa: E402

PAIR = os.path.join(ROOT, "vllm_ddtree", "assets", "tiny_pair")


class StageClock(launches.Counter):
    """``launches.Counter``'s stage stack, timing each stage exclusive of the ones inside it."""

    def __init__(self):
        super().__init__()
        self.seconds: collections.Counter = collections.Counter()
        self._since = [time.perf_counter()]

    @contextlib.contextmanager
    def stage(self, name: str):
        now = time.perf_counter()
        self.seconds[self.stack[-1]] += now - self._since[-1]
        self.stack.append(name)
        self._since.append(now)
        try:
            yield
        finally:
            now = time.perf_counter()
            self.seconds[self.stack.pop()] += now - self._since.pop()
            self._since[-1] = now

    def reset(self) -> None:
        self.seconds.clear()
        self.stack[:] = ["vllm"]
        self._since[:] = [time.perf_counter()]


def run_one(method: str, budget: int, num_requests: int, target: str, drafter: str,
            max_tokens: int) -> dict:
    from vllm import SamplingParams
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm_utils import close, make_llm

    clock = StageClock()
    if method == "ddtree":
        spec = {"method": "ddtree", "model": drafter, "num_speculative_tokens": budget,
                "ddtree_budget_policy": "static"}
        launches.instrument_ddtree(clock)
    else:
        spec = {"method": "dflash", "model": drafter, "num_speculative_tokens": budget}
        launches.instrument_dflash(clock)
    launches.label(clock, GPUModelRunner, "_model_forward", "target forward")
    launches.label(clock, GPUModelRunner, "_build_attention_metadata", "attention metadata")
    llm = make_llm(spec, model=target, max_num_seqs=max(8, num_requests))
    prompts = (launches.PROMPTS * num_requests)[:num_requests]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(2):  # warm-up: first-call paths
        llm.generate(prompts, params, use_tqdm=False)
    clock.reset()
    start, tokens = time.perf_counter(), 0
    for _ in range(5):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    wall = time.perf_counter() - start
    close(llm)
    per_token = {stage: round(s * 1e6 / tokens, 1)
                 for stage, s in sorted(clock.seconds.items(), key=lambda kv: -kv[1])}
    return {"method": method, "budget": budget, "requests": num_requests,
            "tokens_per_s": round(tokens / wall, 1), "us_per_token": per_token}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=os.path.join(PAIR, "target"))
    parser.add_argument("--drafter", default=os.path.join(PAIR, "drafter"))
    parser.add_argument("--budget", type=int, default=16, help="ddtree's B (dflash drafts L)")
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "stage_times_cpu.json"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one method as JSON
    args = parser.parse_args()
    if args.one:
        result = run_one(**json.loads(args.one), target=args.target, drafter=args.drafter,
                         max_tokens=args.max_tokens)
        print("RESULT " + json.dumps(result), flush=True)
        return
    results = []
    for method, budget in (("dflash", drafter_depth(args.drafter)), ("ddtree", args.budget)):
        one = json.dumps({"method": method, "budget": budget, "num_requests": args.requests})
        results.append(launches.run_child(__file__, one, [
            "--target", args.target, "--drafter", args.drafter,
            "--max-tokens", str(args.max_tokens)]))
        print(json.dumps(results[-1]), flush=True)
    launches.write_results(args.out, __file__, results)


if __name__ == "__main__":
    main()
