#!/usr/bin/env python
"""What structured outputs cost a ddtree step: a batch of ``json_schema`` requests against the
same batch of unconstrained requests and a half-and-half batch, at B = 16, 64, 256 (the static
policy and "auto", which counts the grammar's cost per node) and without speculation
(issue 24).

A structured-output request verifies the grammar-valid subtree of its tree (the plugin's
``grammar.py``: the scheduler accepts and rolls back each node's token along the tree, prunes
what the grammar rejects, and fills one bitmask row per kept node), so its grammar work per
step grows with the nodes it keeps. This measures, side by side in one run (each
configuration in its own process, the tiny pair, CPU, T = 0, xgrammar without free
whitespace): tokens per second of each batch, the scheduler's grammar time per step (the
check of the drafts, ``Scheduler.update_draft_token_ids``, plus the bitmask,
``StructuredOutputManager.grammar_bitmask``, each timed by wrapping the plugin's patched
method), the mean acceptance length of each batch and the drafts sent per request and step
for structured and unconstrained requests (auto's budgets).

Usage::

    .venv/bin/python benchmarks/structured_cost.py            # writes results/structured_cost_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from launches import run_child, write_results  # noqa: E402

PAIR = os.path.join(ROOT, "vllm_ddtree", "assets", "tiny_pair")
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "id": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "id", "tags"]}
PROMPTS = ["def parse(record):\n", "class Config:\n    ", "import json\n\n", "# settings\n",
           "    return {", "x = ", "def main():\n    data = ", "CONFIG = "]


def run_one(budget: int, policy: str, num_requests: int, max_tokens: int, repeats: int) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.plugins import load_general_plugins
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    load_general_plugins()  # the plugin's patches first: the timers wrap them
    timers = {"check": [0.0, 0], "bitmask": [0.0, 0]}  # seconds, calls (one per step each)
    sent = {"structured": [0, 0], "unconstrained": [0, 0]}  # drafts, request-steps

    def timed(original, timer):
        def run(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                timer[0] += time.perf_counter() - start
                timer[1] += 1
        return run

    def counted(original):
        def run(self, draft_token_ids):
            for req_id, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
                request = self.requests.get(req_id)
                if request is not None:
                    kind = sent["structured" if request.use_structured_output else "unconstrained"]
                    kind[0] += len(drafts)
                    kind[1] += 1
            return original(self, draft_token_ids)
        return run

    StructuredOutputManager.grammar_bitmask = timed(StructuredOutputManager.grammar_bitmask,
                                                    timers["bitmask"])
    Scheduler.update_draft_token_ids = timed(counted(Scheduler.update_draft_token_ids),
                                             timers["check"])
    spec = None
    if budget:
        spec = {"method": "ddtree", "model": os.path.join(PAIR, "drafter"),
                "num_speculative_tokens": budget, "ddtree_budget_policy": policy}
    llm = LLM(model=os.path.join(PAIR, "target"), dtype="float32", enforce_eager=True,
              gpu_memory_utilization=0.3, max_model_len=1024, seed=0,
              max_num_seqs=num_requests, max_num_batched_tokens=max(512, num_requests * (budget + 16)),
              speculative_config=spec, disable_log_stats=False,
              structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num_requests)]
    structured = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                structured_outputs=StructuredOutputsParams(json=SCHEMA))
    unconstrained = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    batches = {  # every request alike, and half of each
        "json_schema": [structured] * num_requests,
        "unconstrained": [unconstrained] * num_requests,
        "mixed": [structured, unconstrained] * (num_requests // 2),
    }

    def counters():
        out = {}
        for metric in llm.get_metrics():
            if metric.name in ("vllm:spec_decode_num_drafts",
                               "vllm:spec_decode_num_accepted_tokens"):
                out[metric.name] = metric.value
        return out

    llm.generate(prompts, batches["unconstrained"], use_tqdm=False)  # warm-up
    llm.generate(prompts, batches["json_schema"], use_tqdm=False)
    result = {"budget": budget, "policy": policy if budget else "plain",
              "requests": num_requests}
    for name, params in batches.items():
        best, grammar = None, None
        before = counters()
        for kind in sent.values():
            kind[:] = [0, 0]
        for _ in range(repeats):
            for timer in timers.values():
                timer[:] = [0.0, 0]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            if best is None or tokens / elapsed > best[0]:
                best = (tokens / elapsed, tokens, elapsed)
                grammar = {name: round(1e3 * t / max(n, 1), 3) for name, (t, n) in timers.items()}
                grammar["steps"] = timers["bitmask"][1]
        after = counters()
        drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get(
            "vllm:spec_decode_num_drafts", 0)
        accepted = after.get("vllm:spec_decode_num_accepted_tokens", 0) - before.get(
            "vllm:spec_decode_num_accepted_tokens", 0)
        result[name] = {
            "tokens_per_s": round(best[0], 1), "tokens": best[1],
            "grammar_check_ms_per_step": grammar["check"],
            "grammar_bitmask_ms_per_step": grammar["bitmask"], "bitmask_steps": grammar["steps"],
            "mean_acceptance_length": round(1 + accepted / drafts, 2) if drafts else None,
            "drafts_per_request_step": {kind: round(n / steps, 2)
                                        for kind, (n, steps) in sent.items() if steps},
        }
        if name != "unconstrained":
            valid = 0
            for o, p in zip(outs, params):
                if p.structured_outputs is None:
                    continue
                try:
                    json.loads(o.outputs[0].text)
                    valid += 1
                except ValueError:
                    pass
            result[name]["valid_json"] = \
                f"{valid}/{sum(p.structured_outputs is not None for p in params)}"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 16, 64, 256],
                        help="0: no speculation")
    parser.add_argument("--policies", nargs="+", default=["static", "auto"])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "structured_cost_cpu.json"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one configuration as JSON
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(**json.loads(args.one))), flush=True)
        return
    if args.requests % 2:
        parser.error("--requests must be even (the mixed batch is half structured)")
    results = []
    for budget in args.budgets:
        for policy in args.policies if budget else ["static"]:
            one = json.dumps(dict(budget=budget, policy=policy, num_requests=args.requests,
                                  max_tokens=args.max_tokens, repeats=args.repeats))
            results.append(run_child(os.path.abspath(__file__), one, []))
            print(json.dumps(results[-1]), flush=True)
    write_results(args.out, __file__, results)


if __name__ == "__main__":
    main()
