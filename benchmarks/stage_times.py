#!/usr/bin/env python
"""Where a verify step's time goes: wall time per stage, in place, for ddtree and vLLM's dflash.

    .venv/bin/python benchmarks/stage_times.py [--target T --drafter D] [--budgets 16]
        [--auto 24] [--requests 1] [--max-tokens 64] [--rounds 2]
        [--out PATH]

Every engine runs in one process, side by side: dflash (L drafts) and ddtree (static budget)
at each of ``--budgets`` (add L to compare a tree as wide as the chain's rows) and with the auto
policy at each of ``--auto``, greedy, on the
held-out prompts of ``budget_policy.py``. After a warm-up, each prompt wave (``--requests``
prompts at once) runs on every engine in turn, the order reversed every round, so a drift of
the machine's speed hits every engine alike (engines run one after the other in separate
processes drifted by 15 % here). Each engine has its own stage clock; the one of the engine
that runs is active.

The stages are ``benchmarks/launches.py``'s (the plugin's own work between the forwards, and
vLLM's rejection sampler and draft argmax for ``dflash``) plus vLLM's own: the target forward
(``_model_forward`` less the attention kernels), the attention kernels (every attention layer's
``forward``: the target's, the tree rows included, and the drafter's), the attention metadata
(``_build_attention_metadata``: ddtree's tree mask included) and the rest of vLLM's step
(``vllm``: scheduling, input preparation, the drafter's forward, the lm_heads). Each stage's
time excludes the stages nested in it. Prints and writes milliseconds per engine step and per
emitted token per stage, and the tokens per step. ``--target``/``--drafter``: another pair
(``benchmarks/oracle_pair.py`` makes one whose drafter is always right).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
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

    def resume(self) -> float:
        """Its engine runs from now (the time since :meth:`pause` was another engine's)."""
        self._since[-1] = time.perf_counter()
        return self._since[-1]

    def pause(self) -> float:
        """Its engine stopped now: the time since the last stage boundary is vLLM's."""
        now = time.perf_counter()
        self.seconds[self.stack[-1]] += now - self._since[-1]
        self._since[-1] = now
        return now

    def reset(self) -> None:
        self.seconds.clear()
        self.stack[:] = ["vllm"]
        self._since[:] = [time.perf_counter()]


class EngineClocks:
    """The stage clock of the engine that runs now (``active``): what ``launches``' labels see."""

    def __init__(self, names: list[str]):
        self.clocks = {name: StageClock() for name in names}
        self.active = names[0]
        self.steps = collections.Counter()  # engine steps per engine

    def stage(self, name: str):
        return self.clocks[self.active].stage(name)

    @property
    def verify_steps(self) -> int:
        return self.clocks[self.active].verify_steps

    @verify_steps.setter
    def verify_steps(self, value: int) -> None:
        self.clocks[self.active].verify_steps = value


def instrument(clocks: EngineClocks) -> None:
    """``launches``' stages of both methods (they patch different classes), vLLM's own, and an
    engine-step count per engine."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_ddtree.plugin.cpu_attention import DDTreeCPUImpl

    launches.instrument_ddtree(clocks)
    launches.instrument_dflash(clocks)
    launches.label(clocks, GPUModelRunner, "_model_forward", "target forward")
    launches.label(clocks, GPUModelRunner, "_build_attention_metadata", "attention metadata")
    # the stock kernel (DDTreeCPUImpl calls it through super() in mixed steps) and the tree rows
    launches.label(clocks, CPUAttentionBackendImpl, "forward", "attention kernels")
    launches.label(clocks, DDTreeCPUImpl, "forward", "attention kernels")
    step = EngineCore.step

    def counted_step(self, *args, **kwargs):
        clocks.steps[clocks.active] += 1
        return step(self, *args, **kwargs)

    EngineCore.step = counted_step


def run(configs: list[tuple[str, str, dict]], target: str, num_requests: int, max_tokens: int,
        rounds: int, num_prompts: int) -> list[dict]:
    import budget_policy
    from vllm import SamplingParams
    from vllm_utils import make_llm

    clocks = EngineClocks([name for name, _, _ in configs])
    instrument(clocks)
    engines = {name: make_llm(spec, model=target, max_num_seqs=max(8, num_requests),
                              kv_cache_memory_bytes=1 << 28) for name, _, spec in configs}
    prompt_args = budget_policy.parse_args(["--target", target, "--prompt-len", "64"])
    prompts = budget_policy.prompts_for(prompt_args, num_prompts)
    waves = [prompts[i:i + num_requests] for i in range(0, len(prompts), num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for name, llm in engines.items():  # warm-up: first-call paths
        clocks.active = name
        llm.generate(waves[0], params, use_tqdm=False)
        clocks.clocks[name].reset()
        clocks.clocks[name].verify_steps = 0
    clocks.steps.clear()
    wall, tokens = collections.Counter(), collections.Counter()
    names = list(engines)
    for round_ in range(rounds):
        for wave in waves:
            for name in (names if round_ % 2 == 0 else names[::-1]):
                clocks.active = name
                start = clocks.clocks[name].resume()
                outputs = engines[name].generate(wave, params, use_tqdm=False)
                wall[name] += clocks.clocks[name].pause() - start
                tokens[name] += sum(len(o.outputs[0].token_ids) for o in outputs)
    results = []
    for name, method, spec in configs:
        steps, clock = clocks.steps[name], clocks.clocks[name]
        ordered = sorted(clock.seconds.items(), key=lambda kv: -kv[1])
        results.append({
            "method": method, "budget": spec["num_speculative_tokens"],
            "requests": num_requests, "tokens_per_s": round(tokens[name] / wall[name], 1),
            "engine_steps": steps, "verify_steps": clock.verify_steps,
            "tokens_per_step": round(tokens[name] / steps, 3),
            "ms_per_step": {stage: round(s * 1e3 / steps, 3) for stage, s in ordered},
            "us_per_token": {stage: round(s * 1e6 / tokens[name], 1) for stage, s in ordered},
        })
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=os.path.join(PAIR, "target"))
    parser.add_argument("--drafter", default=os.path.join(PAIR, "drafter"))
    parser.add_argument("--budgets", type=int, nargs="+", default=[16],
                        help="ddtree's static budgets B (dflash drafts L)")
    parser.add_argument("--auto", type=int, nargs="*", default=[],
                        help="ddtree engines with ddtree_budget_policy auto, at these B")
    parser.add_argument("--requests", type=int, default=1, help="prompts per wave")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "stage_times_cpu.json"))
    args = parser.parse_args()
    depth = drafter_depth(args.drafter)
    configs = [("dflash", "dflash", {"method": "dflash", "model": args.drafter,
                                     "num_speculative_tokens": depth})]
    configs += [(f"ddtree_{'auto' if auto else 'B'}{b}", f"ddtree{' auto' if auto else ''}",
                 {"method": "ddtree", "model": args.drafter, "num_speculative_tokens": b,
                  "ddtree_budget_policy": "auto" if auto else "static"})
                for auto, budgets in ((False, args.budgets), (True, args.auto)) for b in budgets]
    results = run(configs, args.target, args.requests, args.max_tokens, args.rounds,
                  args.num_prompts)
    base = results[0]
    for r in results:
        print(f"{r['method']} B={r['budget']}: {r['tokens_per_s']} tokens/s "
              f"({r['tokens_per_s'] / base['tokens_per_s']:.2f}x dflash), "
              f"{r['tokens_per_step']} tokens/step, {sum(r['ms_per_step'].values()):.2f} ms/step")
        for stage, ms in r["ms_per_step"].items():
            more = ms - base["ms_per_step"].get(stage, 0.0)
            print(f"    {stage:22s} {ms:7.3f} ms/step ({more:+.3f} against dflash)")
    launches.write_results(args.out, __file__, results)


if __name__ == "__main__":
    main()
