#!/usr/bin/env python
"""Engines compared step by step: throughput ratios that this machine's drift cannot move.

    .venv/bin/python benchmarks/lockstep.py [--concurrency 32] [--waves 12]
        [--only plain ddtree_cold ddtree_paused] [--decode-steps 0] [--out PATH]

``budget_policy.py`` times whole waves one configuration after another; on this 2-core machine
the speed drifts by 10-25 % between rounds, so effects of a few per cent (what the plugin's
bookkeeping costs a step that drafts nothing: auto's floor) are below its resolution. Here every
engine is up at once and they advance together, one ``LLMEngine.step`` each in turn (the order
rotated every step), each timed on its own: a drift lasts many steps, so it hits every engine's
next step alike, and the ratios of the summed step times resolve well under 1 %.

Each engine runs the same ``--waves`` waves of ``--concurrency`` requests (the held-out prompts
of ``budget_policy.py``, ``--max-tokens`` tokens each, greedy); a wave is submitted when the
engine's previous one has finished, so prefills count as in ``budget_policy.py``'s waves.
tokens/s = output tokens / the engine's summed step times (``first_step_seconds``: the part
spent in each wave's first step, its prefill). With ``--decode-steps N`` each
engine instead holds ``--concurrency`` long requests and N decode steps are timed (no prefill):
the cost of a decode step alone, as median and mean.

Configurations: ``budget_policy.py``'s names (plain, dflash, ddtree_B<b>[_t<t>],
ddtree_auto[_t<t>], ddtree_paused) and ``ddtree_cold``: auto whose first pause lasts for
good, so that after its first answer every step is a cold one (no drafts and no context pass
for running requests: auto's floor where drafting does not pay). auto times its steps by the
scheduler's clock stamps (``SchedulerOutput.ddtree_clock``), whose gaps here would hold the
other engines' steps too; so each engine's stamps read its own clock (:class:`EngineClocks`):
the wall time of its own steps only, as if it ran alone. (ddtree_auto and ddtree_cold share
the policy module's constants, so they do not run in the same process.)

Writes JSON (with the machine and this command) to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# budget_policy first: launches drops this directory from sys.path (see stage_times.py)
import budget_policy  # noqa: E402
import launches  # noqa: E402, F401  (the engine's environment)


class EngineClocks:
    """Stands in for the ``time`` module of ``vllm_ddtree.plugin.patches`` (the scheduler's
    stamps): ``perf_counter()`` is the active engine's own clock, the sum of its earlier steps'
    wall time plus the time since its current step began."""

    def __init__(self):
        self.elapsed: dict[str, float] = {}
        self.active: str | None = None
        self._since = 0.0

    def begin(self, name: str) -> None:
        self.active = name
        self._since = time.perf_counter()
        # an engine's clock goes on from the wall time of its first timed step, so that its
        # stamps never run backwards from those of the untimed warm-up
        self.elapsed.setdefault(name, self._since)

    def end(self) -> float:
        """The active step's wall time, added to its engine's clock."""
        seconds = time.perf_counter() - self._since
        self.elapsed[self.active] = self.elapsed.get(self.active, 0.0) + seconds
        self.active = None
        return seconds

    def perf_counter(self) -> float:
        if self.active is None:  # outside the timed steps (warm-up): the wall clock
            return time.perf_counter()
        return self.elapsed.get(self.active, 0.0) + time.perf_counter() - self._since

    def __getattr__(self, name):  # everything else is the time module's
        return getattr(time, name)


CLOCKS = EngineClocks()


def timed_step(name: str, llm) -> tuple[float, list]:
    """One engine step of ``llm`` on its own clock: (its wall time, its outputs)."""
    CLOCKS.begin(name)
    try:
        outputs = llm.llm_engine.step()
    finally:
        seconds = CLOCKS.end()
    return seconds, outputs


def configurations(args) -> list[tuple[str, dict | None]]:
    bench = budget_policy.parse_args(
        ["--budgets", *map(str, args.budgets), "--concurrency", str(args.concurrency)])
    known = dict(budget_policy.configurations(bench, budget_policy.drafter_depth(bench.drafter)))
    auto = next(spec for name, spec in known.items() if name.startswith("ddtree_auto"))
    known["ddtree_cold"] = auto
    if "ddtree_cold" in args.only and any(n.startswith("ddtree_auto") for n in args.only):
        raise SystemExit("ddtree_cold changes auto's pauses for every engine of the process: "
                         "run it and ddtree_auto in separate runs")
    configs = []
    for name in args.only:
        if name not in known:
            raise SystemExit(f"unknown configuration {name}; known: {', '.join(known)}")
        configs.append((name, known[name]))
    return configs


def keep_cold() -> None:
    """auto's first "do not draft" answer pauses it for good (ddtree_cold)."""
    import vllm_ddtree.plugin.policy as policy

    policy.FIRST_PAUSE = policy.MAX_PAUSE = 10**9


def submit(llm, prompts: list[dict], max_tokens: int) -> None:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(llm._preprocess_cmpl(prompts)):  # rendered as generate does
        llm.llm_engine.add_request(f"lockstep-{time.perf_counter_ns()}-{i}", prompt, params)


def run_waves(engines: dict, prompts: list[dict], args) -> dict:
    """Every engine runs ``args.waves`` waves, one step each in turn; per engine the summed step
    time, the steps and the output tokens."""
    c = args.concurrency
    waves = [[prompts[(w * c + j) % len(prompts)] for j in range(c)] for w in range(args.waves)]
    done = {name: 0 for name in engines}  # waves submitted
    stats = {name: {"seconds": 0.0, "steps": 0, "tokens": 0, "first_step_seconds": 0.0}
             for name in engines}
    fresh = {name: True for name in engines}  # the engine's next step is a wave's first
    for name, llm in engines.items():
        submit(llm, waves[0], args.max_tokens)
        done[name] = 1
    names, turn = list(engines), 0
    while any(engines[n].llm_engine.has_unfinished_requests() for n in names):
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            engine = engines[name].llm_engine
            if not engine.has_unfinished_requests():
                continue
            seconds, outputs = timed_step(name, engines[name])
            stats[name]["seconds"] += seconds
            stats[name]["steps"] += 1
            if fresh[name]:
                stats[name]["first_step_seconds"] += seconds
                fresh[name] = False
            stats[name]["tokens"] += sum(len(o.outputs[0].token_ids) for o in outputs
                                         if o.finished)
            if not engine.has_unfinished_requests() and done[name] < args.waves:
                submit(engines[name], waves[done[name]], args.max_tokens)
                done[name] += 1
                fresh[name] = True
        turn += 1
    for s in stats.values():
        assert s["tokens"] == args.waves * c * args.max_tokens, s
        s["tokens_per_s"] = s["tokens"] / s["seconds"]
    return stats


def run_decode(engines: dict, prompts: list[dict], args) -> dict:
    """``args.decode_steps`` decode steps of ``args.concurrency`` long requests per engine, one
    step each in turn; per engine the median and mean step time. For configurations that emit
    about one token per step (plain, ddtree_cold, ddtree_paused): drafting ones finish their
    requests sooner (checked: every request must still run at the end)."""
    times = {name: [] for name in engines}
    for llm in engines.values():
        submit(llm, prompts[: args.concurrency], args.max_model_len - 100)
    for name, llm in engines.items():
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        while scheduler.waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
            timed_step(name, llm)  # the prefills, on the engine's clock but not counted
    names = list(engines)
    for step in range(args.decode_steps):
        for name in names[step % len(names):] + names[:step % len(names)]:
            times[name].append(timed_step(name, engines[name])[0])
    for name, llm in engines.items():
        running = llm.llm_engine.engine_core.engine_core.scheduler.running
        if len(running) != args.concurrency:
            raise SystemExit(f"{name}: requests finished during the timed steps; use fewer "
                             "--decode-steps or a configuration that does not draft")
        llm.llm_engine.abort_request([r.request_id for r in running])
    return {name: {"median_ms": 1e3 * statistics.median(t), "mean_ms": 1e3 * statistics.mean(t),
                   "steps": len(t)} for name, t in times.items()}


def start_warm(configs: list[tuple[str, dict | None]], args) -> tuple[dict, list[dict]]:
    """Every configuration's engine (by name) on its own clock, warmed up with two waves (the
    first-call paths; ddtree_cold answers and pauses for good), and the prompts of the waves."""
    import vllm_ddtree.plugin.patches as patches

    patches.time = CLOCKS  # the scheduler's stamps: each engine's own clock
    if any(name == "ddtree_cold" for name, _ in configs):
        keep_cold()
    bench = budget_policy.parse_args(["--concurrency", str(args.concurrency),
                                      "--max-model-len", str(args.max_model_len)])
    engines = {name: budget_policy.start_engine(bench, spec, len(configs))
               for name, spec in configs}
    # at least budget_policy.py's 32 prompts: at one request, 4 prompts made one bad prompt a
    # quarter of the run
    prompts = budget_policy.prompts_for(bench, max(32, 4 * args.concurrency))
    from vllm import SamplingParams

    warm = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in engines.values():
        for _ in range(2):
            llm.generate(prompts[: args.concurrency], warm, use_tqdm=False)
    return engines, prompts


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--waves", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=0,
                   help="time N decode steps of long requests instead of waves")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 24])
    p.add_argument("--only", nargs="+", default=["plain", "ddtree_cold", "ddtree_paused"],
                   help="configurations; the first is the reference of the ratios")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    configs = configurations(args)
    engines, prompts = start_warm(configs, args)
    results = (run_decode if args.decode_steps else run_waves)(engines, prompts, args)
    reference = configs[0][0]
    for name, llm in engines.items():
        auto = budget_policy.ddtree_auto_stats(llm)
        if auto is not None:
            results[name]["drafter_on_fraction"] = round(auto["drafter_on_fraction"], 4)
            results[name]["drafter_cold_fraction"] = round(auto["drafter_cold_fraction"], 4)
        if args.decode_steps:
            results[name]["step_time_over_reference"] = (results[name]["median_ms"]
                                                         / results[reference]["median_ms"])
        else:
            results[name]["throughput_over_reference"] = (results[name]["tokens_per_s"]
                                                          / results[reference]["tokens_per_s"])
    for name, r in results.items():
        print(f"{name:22s} " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in r.items()))
    kind = f"decode{args.decode_steps}" if args.decode_steps else f"waves{args.waves}"
    device = budget_policy.device_name()
    out = args.out or os.path.join(
        ROOT, "benchmarks", "results",
        f"lockstep_{args.concurrency}req_{kind}_{budget_policy.device_tag(device)}.json")
    record = {"command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + (argv or sys.argv[1:])),
              "commit": budget_policy.git_commit(), "device": device,
              "reference": reference, "results": results}
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {out}")
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
