#!/usr/bin/env python
"""Acceptance (tau = mean tokens per target forward, bonus included) on held-out prompts.

Methods: the DFlash argmax chain, DDTree at budgets {2, ..., 128} (and at each
``--tree-temperatures`` t: trees from softmax(drafter logits / t), a hand-set correction the
plugin's calibrated trees replace), the sampled chain verified by capped HSD vs token-wise, at
temperatures 0 and 1, through the transformers engine; with
``--vllm`` also vLLM's own ``dflash`` and (when the plugin registers it) ``ddtree`` on the CPU.
Prints a table, writes JSON and a PNG (tau vs budget) to benchmarks/results/.

Usage::

    .venv/bin/python benchmarks/acceptance.py                    # ~2-5 min on 2 CPU cores (8 prompts x 48 tokens)
    .venv/bin/python benchmarks/acceptance.py --num-prompts 4 --max-new-tokens 32 --budgets 4 64
    .venv/bin/python benchmarks/acceptance.py --vllm             # adds the vLLM rows
    .venv/bin/python benchmarks/acceptance.py --temperatures 0 --tree-temperatures 0.8 0.9 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
PAIR = os.path.join(REPO, "vllm_ddtree", "assets", "tiny_pair")
RESULTS = os.path.join(REPO, "benchmarks", "results")


def run_hf(args) -> list[dict]:
    import torch

    from vllm_ddtree.hf.evaluate import heldout_prompts, load_pair, measure_tau

    torch.set_num_threads(args.threads)
    target, drafter, tokenizer = load_pair(f"{args.pair}/target", f"{args.pair}/drafter")
    prompts = heldout_prompts(tokenizer, args.num_prompts, args.prompt_len)
    rows = []
    L = drafter.block_size - 1
    for temperature in args.temperatures:
        configs = [("chain", L, 1.0)]
        configs += [("ddtree", b, t) for t in args.tree_temperatures for b in args.budgets]
        configs += [("chain_hsd", L, 1.0), ("chain_tokenwise", L, 1.0)]
        for method, budget, tree_temperature in configs:
            t0 = time.time()
            r = measure_tau(target, drafter, prompts, method, budget=budget, temperature=temperature,
                            max_new_tokens=args.max_new_tokens, seed=args.seed,
                            tree_temperature=tree_temperature)
            r.update(engine="hf", seconds=time.time() - t0)
            rows.append(r)
            print(f"  hf   T={temperature:g} t={tree_temperature:g} {method:16s} B={budget:4d} "
                  f"tau={r['tau']:.3f} ({r['rounds']} rounds, {r['seconds']:.1f}s)", flush=True)
    return rows


def vllm_tau(args, method: str, num_spec: int, temperature: float) -> dict:
    """tau from vLLM's spec-decode counters: 1 + accepted / drafts."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_ddtree.hf.evaluate import heldout_prompts

    tok = AutoTokenizer.from_pretrained(f"{args.pair}/target")
    prompts = [{"prompt_token_ids": p} for p in heldout_prompts(tok, args.num_prompts, args.prompt_len)]
    spec = {"method": method, "model": f"{args.pair}/drafter", "num_speculative_tokens": num_spec}
    if method == "ddtree":
        spec["ddtree_budget_policy"] = "static"  # tau at budget B in every step
    llm = LLM(
        model=f"{args.pair}/target", dtype="float32", enforce_eager=True, max_model_len=512,
        gpu_memory_utilization=0.3, seed=args.seed, disable_log_stats=False,
        speculative_config=spec,
    )
    params = SamplingParams(temperature=temperature, max_tokens=args.max_new_tokens, ignore_eos=True, seed=args.seed)
    t0 = time.time()
    llm.generate(prompts, params)
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    drafts = counters.get("vllm:spec_decode_num_drafts") or 0
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens") or 0
    del llm
    return {"engine": "vllm", "method": method, "budget": num_spec, "temperature": temperature,
            "tau": 1 + accepted / max(drafts, 1), "rounds": drafts, "seconds": time.time() - t0}


def run_vllm(args) -> list[dict]:
    rows = []
    L = json.load(open(f"{args.pair}/drafter/config.json"))["block_size"] - 1
    for method, num_spec in [("dflash", L)] + [("ddtree", b) for b in args.vllm_budgets]:
        for temperature in args.temperatures:
            try:
                r = vllm_tau(args, method, num_spec, temperature)
            except Exception as exc:  # noqa: BLE001 - report and go on (e.g. plugin not installed)
                r = {"engine": "vllm", "method": method, "budget": num_spec, "temperature": temperature,
                     "error": f"{type(exc).__name__}: {exc}"[:300]}
            rows.append(r)
            print(f"  vllm T={temperature:g} {method:16s} B={num_spec:4d} "
                  + (f"tau={r['tau']:.3f}" if "tau" in r else r["error"]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'engine':6s} {'T':>3s} {'t':>4s} {'method':16s} {'B':>5s} {'tau':>7s}"]
    for r in rows:
        tau = f"{r['tau']:7.3f}" if "tau" in r else "  error"
        lines.append(f"{r['engine']:6s} {r['temperature']:3g} {r.get('tree_temperature', 1.0):4g} "
                     f"{r['method']:16s} {r['budget']:5d} {tau}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    tree_temperatures = sorted({r.get("tree_temperature", 1.0) for r in rows})
    for i, temperature in enumerate(sorted({r["temperature"] for r in rows})):
        color = f"C{i}"
        for j, t in enumerate(tree_temperatures):
            pts = sorted((r["budget"], r["tau"]) for r in rows
                         if r["engine"] == "hf" and r["method"] == "ddtree"
                         and r["temperature"] == temperature
                         and r.get("tree_temperature", 1.0) == t)
            if pts:
                ax.plot(*zip(*pts), "os^vd"[j % 5] + "-", color=color,
                        label=f"DDTree T={temperature:g}" + (f" t={t:g}" if t != 1.0 else ""))
        for r in rows:
            if r["engine"] == "hf" and r["temperature"] == temperature and r["method"] != "ddtree":
                style = {"chain": "--", "chain_hsd": ":", "chain_tokenwise": "-."}[r["method"]]
                ax.axhline(r["tau"], color=color, linestyle=style, linewidth=1,
                           label=f"{r['method']} T={temperature:g}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree budget B (draft tokens verified per step)")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title("Tiny pair, held-out stdlib prompts")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default=PAIR)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--budgets", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--tree-temperatures", type=float, nargs="+", default=[1.0],
                    help="ddtree_tree_temperature values for the DDTree rows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm", action="store_true", help="also measure through vLLM on the CPU")
    ap.add_argument("--vllm-budgets", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--no-hf", action="store_true", help="only the vLLM rows")
    ap.add_argument("--out", default=os.path.join(RESULTS, "acceptance.json"))
    args = ap.parse_args()

    rows = [] if args.no_hf else run_hf(args)
    if args.vllm:
        rows += run_vllm(args)
    print(table(rows))
    summary = {}
    for temperature in args.temperatures:
        chain = [r["tau"] for r in rows if r["engine"] == "hf" and r["method"] == "chain" and r["temperature"] == temperature]
        b64 = [r["tau"] for r in rows if r["engine"] == "hf" and r["method"] == "ddtree"
               and r["budget"] == 64 and r["temperature"] == temperature
               and r.get("tree_temperature", 1.0) == 1.0]
        if chain and b64:
            summary[f"ddtree_B64_over_chain_T{temperature:g}"] = b64[0] / chain[0]
    print("summary:", json.dumps(summary))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        command = " ".join(["python benchmarks/acceptance.py", *sys.argv[1:]])
        json.dump({"command": command, "args": vars(args), "summary": summary, "rows": rows}, f,
                  indent=2)
    if any(r["engine"] == "hf" for r in rows):
        plot(rows, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
