"""Kernel-launching ops per verify step, per stage, of ddtree's plugin and of vLLM's ``dflash``.

    .venv/bin/python benchmarks/launches.py [--budgets 16 64 256] [--requests 1 8]
        [--policy static|auto] [--out benchmarks/results/launches_cpu.json]

On a GPU every op below is a kernel launch; on this CPU each is part of a step's fixed cost.
One ``TorchDispatchMode`` sees every aten op while ``LLM.generate`` runs (in-process engine,
the committed tiny pair, float32, eager); each op is charged to the innermost *stage* running
when it was dispatched. Stages are the plugin's own methods (and vLLM's for ``dflash``);
vLLM's shared work inside them (its ``_prepare_inputs``, the drafter's input preparation and
forward, the target forward, the lm_head) is charged to the uncounted stages "vllm" and
"model", so a stage holds exactly the ops its own code adds. Not counted: views (an op that
may return a view, such as ``to``, ``contiguous`` or ``reshape``, counts when it copied),
``empty*``,
``detach`` / ``alias`` and scalar reads to the host (``_local_scalar_dense``: a
synchronisation, not a kernel). ``host tensors`` counts tensors made from host data
(``lift_fresh``, i.e. ``torch.tensor(...)`` / ``as_tensor``): each is a host-to-device copy on
a GPU. Triton launches: none on the CPU (the CUDA path's kernels run only there).

Stages (ddtree): draft post-processing (the drafter's logits to the recorded proposal, without
the tree build), tree build (``build_tree``, auto's budget function included), verify batch
(the verify trees and depth positions, ``_prepare_inputs`` less vLLM's own), sampler and walk
(``TreeRejectionSampler``), finish verify (``_sample`` less the samplers, vLLM's included: it
samples the steps without drafts, as it does for ``dflash``; finish_verify, the
calibration), compaction (``KVCompactor.compact``), hand-off (draft ids to the scheduler,
``take_draft_token_ids`` / ``propose_draft_token_ids`` / ``sample_tokens`` less vLLM's own).
Stages (dflash): sampler (vLLM's ``RejectionSampler``), draft post-processing (its
``_sample_draft_tokens`` less the lm_head). Counts are per verify step (steps in which the
tree sampler, or vLLM's rejection sampler, verified drafts), averaged over the run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# benchmarks/kernels.py must not shadow the project's kernels package
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.join(ROOT, "benchmarks")]
sys.path.insert(0, os.path.join(ROOT, "tests"))

UNCOUNTED = ("vllm", "model")
SKIPPED = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach",
           "alias", "_local_scalar_dense", "lift_fresh", "lift_fresh_copy", "set_"}
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(",
           "class Stack:\n    def __init__(self):\n", "    for i in range(",
           "# Copyright (c) Python Software Foundation\n", "def parse_args(argv):\n",
           "    return self.", "x = [i for i in range("]


class Counter:
    """The dispatch mode's bookkeeping: a stack of stage names, ops per stage."""

    def __init__(self):
        self.stack: list[str] = ["vllm"]
        self.ops: collections.Counter = collections.Counter()
        self.host_tensors: collections.Counter = collections.Counter()
        self.by_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.verify_steps = 0

    @contextlib.contextmanager
    def stage(self, name: str):
        self.stack.append(name)
        try:
            yield
        finally:
            self.stack.pop()

    def record(self, func, args, out) -> None:
        stage = self.stack[-1]
        if stage in UNCOUNTED:
            return
        name = func.overloadpacket.__name__
        if name in ("lift_fresh", "lift_fresh_copy"):
            self.host_tensors[stage] += 1
            return
        if name in SKIPPED or (func.is_view and not _copied(args, out)):
            return
        self.ops[stage] += 1
        self.by_op[stage][name] += 1


def _copied(args, out) -> bool:
    """Whether an op that may return a view (``to``, ``contiguous``, ``reshape``: under
    inference mode they reach the dispatcher whole, marked as views) made a copy instead."""
    import torch

    if not (args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor)):
        return False
    return out.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr()


def counting_mode(counter: Counter):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            counter.record(func, args, out)
            return out

    return Mode()


def label(counter: Counter, owner, name: str, stage: str) -> None:
    """Run ``owner.name`` (a method, maybe inherited) inside ``stage``."""
    original = getattr(owner, name)

    @functools.wraps(original)  # the plugin's install checks vLLM's signatures through it
    def staged(*args, **kwargs):
        with counter.stage(stage):
            return original(*args, **kwargs)

    setattr(owner, name, staged)


def label_wrapper(counter: Counter, owner, name: str, stage: str, inner: str = "vllm") -> None:
    """A plugin wrapper (``patches.py``: ``functools.wraps`` over vLLM's method) inside
    ``stage``, the vLLM method it wraps inside ``inner``."""
    wrapper = owner.__dict__[name]
    original = wrapper.__wrapped__
    cell = next(c for c in wrapper.__closure__ if c.cell_contents is original)

    def staged_original(*args, **kwargs):
        with counter.stage(inner):
            return original(*args, **kwargs)

    cell.cell_contents = staged_original
    label(counter, owner, name, stage)


def instrument_ddtree(counter: Counter) -> None:
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.dflash import DFlashProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_ddtree.plugin import proposer, sampler
    from vllm_ddtree.plugin.compaction import KVCompactor
    from vllm_ddtree.plugin.patches import install
    from vllm_ddtree.plugin.state import TreeState

    install()  # the plugin's wrappers first (vLLM would install them at engine start)

    label(counter, proposer.DDTreeProposer, "propose", "draft post-processing")
    label(counter, DFlashProposer, "propose", "vllm")  # the drafter's inputs and forward
    label(counter, proposer.DDTreeProposer, "_sample_draft_tokens", "draft post-processing")
    label(counter, proposer.DDTreeProposer, "set_inputs_first_pass", "draft post-processing")
    label(counter, DFlashProposer, "set_inputs_first_pass", "vllm")
    build_tree = proposer.build_tree

    def staged_build_tree(*args, **kwargs):
        with counter.stage("tree build"):
            return build_tree(*args, **kwargs)

    proposer.build_tree = staged_build_tree
    label_wrapper(counter, GPUModelRunner, "_prepare_inputs", "verify batch")
    label_wrapper(counter, GPUModelRunner, "_sample", "finish verify")
    # vLLM's own sampler (steps without drafts, e.g. prefills) is vLLM's work, as for dflash
    label(counter, Sampler, "forward", "vllm")
    label(counter, sampler.TreeRejectionSampler, "forward", "sampler and walk")
    label(counter, KVCompactor, "compact", "compaction")
    for name in ("take_draft_token_ids", "propose_draft_token_ids", "sample_tokens"):
        label_wrapper(counter, GPUModelRunner, name, "hand-off")
    begin_verify = TreeState.begin_verify

    def counted_begin_verify(self, *args, **kwargs):
        counter.verify_steps += 1
        return begin_verify(self, *args, **kwargs)

    TreeState.begin_verify = counted_begin_verify


def instrument_dflash(counter: Counter) -> None:
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    forward = RejectionSampler.forward

    def counted_forward(self, *args, **kwargs):
        counter.verify_steps += 1
        with counter.stage("sampler"):
            return forward(self, *args, **kwargs)

    RejectionSampler.forward = counted_forward
    label(counter, SpecDecodeBaseProposer, "_sample_draft_tokens", "draft post-processing")


def label_lm_heads(counter: Counter, llm) -> None:
    """The drafter's lm_head (compute_logits) is model work: uncounted."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    model = runner.drafter.model
    compute_logits = model.compute_logits

    def staged(*args, **kwargs):
        with counter.stage("model"):
            return compute_logits(*args, **kwargs)

    model.compute_logits = staged


def run_one(method: str, budget: int, num_requests: int, temperature: float,
            max_tokens: int, policy: str = "static") -> dict:
    """One configuration in this process (the instrumentation patches classes: one per process)."""
    from vllm import SamplingParams
    from vllm_utils import DRAFTER, close, ddtree_spec, make_llm

    counter = Counter()
    if method == "ddtree":
        # static: every verify step has trees of B nodes; auto: its budget function and
        # calibration count too (steps it pauses verify nothing and are not counted)
        spec = ddtree_spec(budget, ddtree_budget_policy=policy)
        instrument_ddtree(counter)
    else:
        spec = {"method": "dflash", "model": DRAFTER, "num_speculative_tokens": budget}
        instrument_dflash(counter)
    llm = make_llm(spec, max_num_seqs=max(8, num_requests))
    label_lm_heads(counter, llm)
    # T > 0: top-k 50 and top-p 0.9; vLLM 0.32's dflash fails on the CPU with any top-k (an
    # empty max() in its rejection sampler, without this plugin), so it gets top-p alone
    filters = {"top_p": 0.9} if method == "dflash" else {"top_k": 50, "top_p": 0.9}
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True,
                            **(filters if temperature > 0 else {}))
    prompts = (PROMPTS * num_requests)[:num_requests]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: first-call paths
    counter.ops.clear()
    counter.host_tensors.clear()
    counter.by_op.clear()
    counter.verify_steps = 0
    with counting_mode(counter):
        llm.generate(prompts, params, use_tqdm=False)
    close(llm)
    steps = max(counter.verify_steps, 1)
    per_stage = {stage: round(n / steps, 1) for stage, n in sorted(counter.ops.items())}
    top_ops = {stage: dict(ops.most_common(40)) for stage, ops in counter.by_op.items()}
    return {
        "method": method, "budget": budget, "policy": policy if method == "ddtree" else None,
        "requests": num_requests, "temperature": temperature, "verify_steps": counter.verify_steps,
        "launches_per_verify_step": round(sum(counter.ops.values()) / steps, 1),
        "per_stage": per_stage,
        "host_tensors_per_verify_step": round(sum(counter.host_tensors.values()) / steps, 1),
        "top_ops_in_run": top_ops,
    }


def run_child(script: str, one: str, extra: list[str]) -> dict:
    """Run ``script --one ONE EXTRA...`` (one configuration per process: the instrumentation
    patches classes) and return the JSON it prints on its ``RESULT`` line."""
    out = subprocess.run([sys.executable, script, "--one", one, *extra], capture_output=True,
                         text=True, check=False)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{one} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def write_results(path: str, script: str, results: list[dict]) -> None:
    """The results as JSON, with the command that made them and the commit."""
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    command = f"python benchmarks/{os.path.basename(script)} " + " ".join(sys.argv[1:])
    with open(path, "w") as f:
        json.dump({"command": command, "commit": commit, "device": "cpu", "results": results},
                  f, indent=1)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--policy", default="static", choices=["static", "auto"],
                        help="ddtree's budget policy (B is then the largest tree)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "launches_cpu.json"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one configuration as JSON
    args = parser.parse_args()
    if args.one:
        config = json.loads(args.one)
        print("RESULT " + json.dumps(run_one(**config, max_tokens=args.max_tokens)), flush=True)
        return
    configs = [("dflash", 7)] + [("ddtree", b) for b in args.budgets]  # dflash: L drafts
    results = []
    for (method, budget), reqs, temp in ((c, r, t) for c in configs for r in args.requests
                                          for t in args.temperatures):
        one = json.dumps({"method": method, "budget": budget, "num_requests": reqs,
                          "temperature": temp, "policy": args.policy})
        start = time.time()
        result = run_child(__file__, one, ["--max-tokens", str(args.max_tokens)])
        results.append(result)
        print(f"{method:6s} B={budget:3d} R={reqs} T={temp}: "
              f"{result['launches_per_verify_step']:6.1f} launches per verify step "
              f"{result['per_stage']} ({time.time() - start:.0f} s)", flush=True)
    write_results(args.out, __file__, results)


if __name__ == "__main__":
    main()
