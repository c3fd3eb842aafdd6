#!/usr/bin/env python
"""Throughput of tree-budget policies through vLLM, side by side in one run.

Configurations: plain decoding, vLLM's own DFlash chain (L drafts), ddtree with a static budget
B in ``--budgets``, ddtree with ``ddtree_budget_policy: "auto"`` (maximum budget = the
largest B), each of these with each ``--trees`` kind (calibrated, the default, and/or ``raw``:
DDTree's trees from the drafter's stated probabilities, ``ddtree_calibrate_trees`` false, a
name ending in ``_raw``), and ``ddtree_paused`` (the table ``[[1, 0]]``: the
drafter never drafts), the floor of any budget policy inside vLLM's speculative engine: its
steps carry the speculative bookkeeping and the drafter's context pass, which plain decoding
does not.

Workload (``--workload``), at concurrency c, over the ``--num-prompts`` held-out prompts
(``--max-tokens`` output tokens each with ``ignore_eos``), so every concurrency does the same
work over the same prompts:

- ``waves`` (the default): waves of c requests, one ``generate`` call each, all submitted at
  once; tokens/s = all output tokens / wall time. Plain decoding finishes a wave's requests in
  the same step; drafting finishes them at different steps, so each wave's last steps run with
  fewer requests (``wave_steps.py`` counts them).
- ``steady``: c requests in flight at all times, as a server with a queue keeps them: a request
  that finishes is replaced by the next in the same step (``LLMEngine.add_request`` /
  ``step``, outputs streamed as deltas). tokens/s = the output tokens emitted from the start
  until the last request is admitted / that time: the steady state, without the final drain
  (a cell runs at least 2c requests, so the window holds at least half of them).

Side by side: every configuration's engine is started first and they stay up together; then
one warm-up round and ``--repeats`` timed rounds. A round runs every concurrency's waves one at a
time, each wave on every configuration in turn (the order rotated from wave to wave), and a
configuration's time at c is the sum of its waves' times: a drift of the machine's speed
(another tenant of a shared box) then hits every configuration alike, even within a round.
(``steady`` runs a configuration's whole cell at once, the order rotated from round to round.) A
short cell is noisy (32 requests at once finish in a third of a second on the CPU), so each
round runs the prompts ``passes[c]`` times: enough for the fastest configuration's warm-up time
at c to reach ``--min-cell-seconds`` (the same count for every configuration, so each does the
same work). Each cell is the median of its rounds; the ratios of auto and of "never drafting"
to their rivals are also given paired, as the median over rounds of the ratio within a round
(the better estimate on a noisy machine: a round's drift cancels in its ratio). On a GPU the
engines share its memory (``--gpu-memory-utilization`` split between them): with a large model,
pick fewer configurations with ``--only``.

Prints a table (tokens/s and the ratio to the best configuration at each concurrency), writes
JSON (with the machine, versions and this command) and a PNG to benchmarks/results/. The same
script runs on a GPU box with CUDA vLLM (``--target``/``--drafter`` for another pair; the
plugin's CUDA path needs VLLM_DDTREE_EXPERIMENTAL_CUDA=1).

Usage::

    .venv/bin/python benchmarks/budget_policy.py                      # the tiny pair, CPU
    .venv/bin/python benchmarks/budget_policy.py --concurrency 1 --repeats 1 --num-prompts 4 \
        --max-tokens 16 --only plain ddtree_auto
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
PAIR = os.path.join(REPO, "vllm_ddtree", "assets", "tiny_pair")
RESULTS = os.path.join(REPO, "benchmarks", "results")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=f"{PAIR}/target")
    p.add_argument("--drafter", default=f"{PAIR}/drafter")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--workload", choices=["waves", "steady"], default="waves",
                   help="waves of c requests, or c requests in flight at all times")
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--num-prompts", type=int, default=32,
                   help="requests per round at every concurrency (in waves of c)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--min-cell-seconds", type=float, default=1.5,
                   help="passes over the prompts per timed cell: enough for the fastest "
                        "configuration's warm-up time at each concurrency to reach this "
                        "(1 pass: 0)")
    p.add_argument("--only", nargs="+", default=None,
                   help="configuration names to run (plain, dflash, ddtree_B<b>, ddtree_auto, "
                        "ddtree_paused; ddtree_B<b>_raw, ddtree_auto_raw)")
    p.add_argument("--trees", nargs="+", choices=["calibrated", "raw"], default=["calibrated"],
                   help="the static and auto configurations' trees: calibrated (the default, "
                        "ddtree_calibrate_trees) and/or raw (DDTree's; a name ends in _raw)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="GPU: the share of its memory for all engines together")
    p.add_argument("--cpu-kv-cache-gib", type=float, default=0.25,
                   help="CPU: K/V cache per engine")
    p.add_argument("--enforce-eager", action="store_true",
                   help="default: eager on the CPU, CUDA graphs on a GPU")
    p.add_argument("--out", default=None, help="JSON path (default: budget_policy_<device>.json)")
    return p.parse_args(argv)


def configurations(args, depth: int) -> list[tuple[str, dict | None]]:
    top = max(args.budgets)
    configs = [("plain", None),
               ("dflash", {"method": "dflash", "model": args.drafter,
                           "num_speculative_tokens": depth})]
    for kind in args.trees:
        suffix, extra = "", {}
        if kind == "raw":  # DDTree's trees, from the drafter's stated probabilities
            suffix, extra = "_raw", {"ddtree_calibrate_trees": False}
        configs += [(f"ddtree_B{b}{suffix}", {"method": "ddtree", "model": args.drafter,
                                               "num_speculative_tokens": b,
                                               "ddtree_budget_policy": "static", **extra})
                    for b in args.budgets]
        configs.append((f"ddtree_auto{suffix}", {"method": "ddtree", "model": args.drafter,
                                                  "num_speculative_tokens": top,
                                                  "ddtree_budget_policy": "auto", **extra}))
    # the floor of every policy inside vLLM's speculative engine: the drafter never drafts
    # (only its context pass runs), every step samples like plain decoding
    configs.append(("ddtree_paused", {"method": "ddtree", "model": args.drafter,
                                       "num_speculative_tokens": top,
                                       "ddtree_budget_policy": [[1, 0]]}))
    if args.only:
        configs = [c for c in configs if c[0] in args.only]
    return configs


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU {platform.processor() or platform.machine()} x{os.cpu_count()}"


def device_tag(device: str) -> str:
    """A result file's device suffix: "cpu", or the GPU's name (``device_name``) in lower case
    with underscores."""
    return "cpu" if device.startswith("CPU") else device.lower().replace(" ", "_")


def prompts_for(args, count: int) -> list[dict]:
    from transformers import AutoTokenizer

    from vllm_ddtree.hf.evaluate import heldout_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    ids = heldout_prompts(tokenizer, count, args.prompt_len)
    if len(ids) < count:  # fewer held-out files than requests: reuse them
        ids = [ids[i % len(ids)] for i in range(count)]
    return [{"prompt_token_ids": p} for p in ids]


def ddtree_auto_stats(llm) -> dict | None:
    try:
        runner = (llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
                  .model_runner)
    except AttributeError:
        return None  # multiprocessing engine: the runner is in another process
    state = getattr(runner, "ddtree_state", None)
    controller = getattr(state, "budgets", None)
    return None if controller is None else controller.summary()


def start_engine(args, spec: dict | None, num_engines: int):
    import torch
    from vllm import LLM

    budget = (spec or {}).get("num_speculative_tokens", 0)
    top = max(args.concurrency)
    memory = ({"gpu_memory_utilization": args.gpu_memory_utilization / num_engines}
              if torch.cuda.is_available()
              else {"kv_cache_memory_bytes": int(args.cpu_kv_cache_gib * (1 << 30))})
    return LLM(
        model=args.target,
        speculative_config=spec,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager or not torch.cuda.is_available(),
        max_model_len=args.max_model_len,
        max_num_seqs=top,
        # a wave's prompts in one step for every configuration: vLLM's scheduler charges each
        # request it schedules the drafter's query slots too (L for ddtree and dflash,
        # SpeculativeConfig.max_num_new_slots_for_drafting), so a budget that fits c prompts
        # for plain decoding (2048 for 32 x 64) made the speculative engines prefill every
        # wave of 32 in two steps (65 steps a wave against 64)
        max_num_batched_tokens=max(2048, top * (args.prompt_len + budget + 16)),
        seed=0,
        disable_log_stats=False,
        # acceptance per request in the outputs: vLLM's Prometheus counters are one set per
        # process, which only the engine started last writes to
        per_request_spec_decode_metrics="summary" if spec else "none",
        **memory,
    )


def start_engines(args, configs: list[tuple[str, dict | None]]) -> dict:
    """Every configuration's engine, by name, up at once (they share the device)."""
    return {name: start_engine(args, spec, len(configs)) for name, spec in configs}


def spec_counts(outputs) -> collections.Counter:
    """Verify steps, proposed and accepted drafts of ``outputs`` (vLLM's per-request
    speculative-decoding metrics: a histogram of accepted drafts per step)."""
    counts = collections.Counter()
    for out in outputs:
        metrics = out.outputs[0].spec_decode_metrics
        if metrics is not None:
            counts["steps"] += sum(metrics.histogram)
            counts["accepted"] += sum(j * n for j, n in enumerate(metrics.histogram))
            counts["drafted"] += metrics.num_draft_tokens
    return counts


def timed_round(args, llms: dict, prompts: list[dict], concurrency: int, passes: int = 1,
                counted: dict | None = None, round_: int = 0) -> dict[str, tuple[float, int]]:
    """(seconds, output tokens) per configuration for every prompt run ``passes`` times at
    ``concurrency`` in ``args.workload``; adds each configuration's own speculative-decoding
    counts to ``counted[name]``.

    ``waves``: the configurations take turns wave by wave (the order rotated); ``steady``: each
    runs its whole cell in turn (the order rotated by ``round_``)."""
    from vllm import SamplingParams

    names = list(llms)
    if args.workload == "steady":
        out = {}
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            out[name] = steady_cell(llms[name], prompts * passes, concurrency, args.max_tokens,
                                    None if counted is None else counted[name])
        return out
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    waves = [prompts[i:i + concurrency] for i in range(0, len(prompts), concurrency)] * passes
    seconds = dict.fromkeys(names, 0.0)
    for j, wave in enumerate(waves):
        for name in names[j % len(names):] + names[:j % len(names)]:
            start = time.perf_counter()
            outs = llms[name].generate(wave, params, use_tqdm=False)
            seconds[name] += time.perf_counter() - start
            if counted is not None:
                counted[name].update(spec_counts(outs))
            assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
    tokens = passes * len(prompts) * args.max_tokens
    return {name: (seconds[name], tokens) for name in names}


_steady_ids = itertools.count()


def steady_cell(llm, prompts: list[dict], concurrency: int, max_tokens: int,
                counted: collections.Counter | None = None) -> tuple[float, int]:
    """Run ``prompts`` through ``llm``'s engine with ``concurrency`` requests in flight (a
    finished request is replaced at once); (seconds, output tokens) from the start until the
    last request is admitted (all of the run if they all fit in the first batch). The engine
    is drained before returning."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    engine = llm.llm_engine
    queue = list(llm._preprocess_cmpl(prompts))  # rendered as ``generate`` does, untimed
    emitted = collections.Counter()
    finished = []
    window = None

    def admit() -> None:
        engine.add_request(f"steady-{next(_steady_ids)}", queue.pop(0), params)

    start = time.perf_counter()
    for _ in range(min(concurrency, len(queue))):
        admit()
    while engine.has_unfinished_requests():
        for out in engine.step():
            emitted[out.request_id] += len(out.outputs[0].token_ids)
            if not out.finished:
                continue
            finished.append(out)
            if queue:
                admit()
                if not queue:
                    window = (time.perf_counter() - start, sum(emitted.values()))
    if window is None:
        window = (time.perf_counter() - start, sum(emitted.values()))
    assert len(finished) == len(prompts)
    assert all(n == max_tokens for n in emitted.values())
    if counted is not None:
        counted.update(spec_counts(finished))
    return window


def engine_summary(llm, counts: collections.Counter) -> dict:
    """Acceptance over the engine's timed outputs (``counts``: :func:`spec_counts`), and the
    auto policy's own summary."""
    out = {}
    if counts["steps"]:
        out["mean_acceptance_length"] = 1 + counts["accepted"] / counts["steps"]
        out["mean_nodes_per_draft"] = counts["drafted"] / counts["steps"]
    auto = ddtree_auto_stats(llm)
    if auto is not None:
        out["auto"] = auto
    return out


def run_all(args, configs: list[tuple[str, dict | None]], prompts: list[dict]) -> list[dict]:
    """Every engine up at once, then a warm-up round and ``args.repeats`` timed rounds."""
    llms = start_engines(args, configs)
    # round 0 warms every engine up at every batch size, and sizes the cells
    passes = {}
    for c in args.concurrency:
        # steady: at least 2c requests a cell, so its window holds at least half of them
        least = math.ceil(2 * c / len(prompts)) if args.workload == "steady" else 1
        warm = timed_round(args, llms, prompts, c, least)
        fastest = min(seconds / least for seconds, _ in warm.values())
        passes[c] = max(least, math.ceil(args.min_cell_seconds / fastest))
    print(f"passes over the prompts per cell: {passes}", flush=True)
    rates = {(name, c): [] for name, _ in configs for c in args.concurrency}
    counted = {name: collections.Counter() for name in llms}  # the timed rounds' counts
    for round_ in range(1, args.repeats + 1):
        for c in args.concurrency:
            for name, (seconds, tokens) in timed_round(args, llms, prompts, c, passes[c],
                                                       counted, round_).items():
                rates[name, c].append(tokens / seconds)
                print(f"  round {round_} {name:14s} c={c:3d}: {seconds:6.2f} s, "
                      f"{tokens / seconds:8.1f} tokens/s", flush=True)
    rows = []
    for name, spec in configs:
        row = {"name": name, "speculative_config": spec,
               "tokens_per_s": {c: statistics.median(rates[name, c])
                                for c in args.concurrency},
               "passes": passes,
               "runs_tokens_per_s": {c: rates[name, c] for c in args.concurrency}}
        row.update(engine_summary(llms[name], counted[name]))
        rows.append(row)
    for llm in llms.values():
        llm.llm_engine.engine_core.shutdown()
    return rows


def plot(rows: list[dict], concurrency: list[int], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        xs = [j + i * width for j in range(len(concurrency))]
        ax.bar(xs, [row["tokens_per_s"][c] for c in concurrency], width, label=row["name"])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(concurrency))])
    ax.set_xticklabels([f"concurrency {c}" for c in concurrency])
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def git_commit() -> str | None:
    """The checkout's commit, with "+changes" if its tracked files differ from it (results
    files aside: a run that rewrites an earlier run's results is still at the commit)."""
    import subprocess

    def git(*cmd):
        return subprocess.run(["git", "-C", REPO, *cmd], capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return None  # not a git checkout (a copied tree on a GPU box)
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                ":(exclude)benchmarks/results").stdout.strip()
    return head.stdout.strip() + ("+changes" if dirty else "")


def paired(base: dict, other: dict, c: int) -> float:
    """Median over rounds of ``other``'s throughput / ``base``'s in the same round: both ran
    side by side, so a round's drift cancels in its ratio."""
    return statistics.median(o / b for b, o in zip(base["runs_tokens_per_s"][c],
                                                   other["runs_tokens_per_s"][c]))


def drafter_depth(drafter: str) -> int:
    """L, the drafting depth of the DFlash drafter in directory ``drafter`` (block_size - 1)."""
    with open(os.path.join(drafter, "config.json")) as f:
        config = json.load(f)
    return ((config.get("dflash_config") or {}).get("block_size") or config["block_size"]) - 1


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    prompts = prompts_for(args, args.num_prompts)
    device = device_name()
    print(f"device: {device}; {len(prompts)} prompts x {args.max_tokens} tokens, T=0, "
          f"workload {args.workload}", flush=True)
    rows = run_all(args, configurations(args, drafter_depth(args.drafter)), prompts)
    import torch
    import vllm

    best = {c: max(r["tokens_per_s"][c] for r in rows) for c in args.concurrency}
    print(f"\n{'config':18s} " + " ".join(f"{'c=' + str(c):>16s}" for c in args.concurrency))
    for r in rows:
        cells = [f"{r['tokens_per_s'][c]:8.1f} ({r['tokens_per_s'][c] / best[c]:.2f}x)"
                 for c in args.concurrency]
        print(f"{r['name']:18s} " + " ".join(f"{cell:>16s}" for cell in cells))
    summary = {}
    # auto (the first of --trees) against the best of everything a user could pick instead:
    # plain decoding, dflash and every static budget (with every kind of tree)
    auto = next((r for r in rows if r["name"].startswith("ddtree_auto")), None)
    if auto is not None:
        others = [r for r in rows
                  if not r["name"].startswith("ddtree_auto") and r["name"] != "ddtree_paused"]
        for c in args.concurrency:
            rival = max(others, key=lambda r: r["tokens_per_s"][c]) if others else None
            if rival is not None:
                summary[c] = {"auto": auto["name"], "best_of_the_others": rival["name"],
                              "auto_over_it": auto["tokens_per_s"][c] / rival["tokens_per_s"][c],
                              "auto_over_it_paired": paired(rival, auto, c)}
            paused = next((r for r in rows if r["name"] == "ddtree_paused"), None)
            plain = next((r for r in rows if r["name"] == "plain"), None)
            if paused is not None and plain is not None and c in summary:
                summary[c]["paused_over_plain"] = (paused["tokens_per_s"][c]
                                                   / plain["tokens_per_s"][c])
                summary[c]["paused_over_plain_paired"] = paired(plain, paused, c)
        print(f"\n{auto['name']} / best of plain, dflash and static B (ratio of medians; "
              "median of per-round ratios): " + ", ".join(
                  f"c={c}: {v['auto_over_it']:.3f}; {v['auto_over_it_paired']:.3f} "
                  f"(vs {v['best_of_the_others']})" for c, v in summary.items()))
        if all("paused_over_plain" in v for v in summary.values()):
            print("never drafting (the floor of any policy) / plain: " + ", ".join(
                f"c={c}: {v['paused_over_plain']:.3f}; {v['paused_over_plain_paired']:.3f}"
                for c, v in summary.items()))
    out = args.out or os.path.join(RESULTS, f"budget_policy_{device_tag(device)}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    record = {
        "command": " ".join([os.path.relpath(sys.argv[0], REPO)] + (argv or sys.argv[1:])),
        "commit": git_commit(),
        "device": device,
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": rows,
        "auto_vs_best_of_the_others": summary,
    }
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    plot(rows, args.concurrency, out.replace(".json", ".png"),
         f"{device}: tiny pair, T=0, {args.max_tokens} tokens/request, {args.workload}")
    print(f"wrote {out} and its .png")


if __name__ == "__main__":
    main()
