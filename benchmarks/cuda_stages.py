#!/usr/bin/env python
"""The plugin's verify-step stages on CUDA: results, launches, host syncs, CUDA graph capture.

    python benchmarks/cuda_stages.py [--smoke] [--out PATH]

One verify step is driven as ``tests/test_native.py``'s ``verify_step`` drives it, on a
``TreeState(DDTreeOptions(budget=B, depth=L))``: ``build_tree`` (static policy: every request
gets B nodes) -> ``record_proposal`` -> ``clip_drafts`` -> ``begin_verify`` (the scheduled
drafts and token rows) -> ``walk`` -> ``finish_verify``. The drafter's logits are float32
``randn * 8`` (peaked: deep, branching trees) from a seeded CPU generator, then moved, so
every path sees the same numbers; the scheduler's drafts (each tree's nodes) and the target
samples of the walk (each request's first path, as deep as it goes) come from the reference
tree and are built before anything is counted. For B in {16, 64, 256}, R in {1, 8}, L = 15
(DFlash b16 drafters), vocab 151936 (Qwen3's), after two warm-up steps, on both CUDA paths
side by side: "torch" (the torch path of every stage) and "triton" (the Triton tree build,
walk and finish_verify of ``kernels/verify_steps.py``; the other stages' torch path):

1. correctness: the CUDA step's outputs (trees, verify batch, walk verdict, finish_verify's
   src / dst / gather index) against the same step on the CPU (the fused ops of
   ``kernels/csrc``, the torch path where they cannot be built): integers bit for bit (dtype,
   shape, values), scores with ``torch.equal``, else ``allclose`` at rtol = 1e-5, atol = 1e-4
   (float32 log-softmax over the vocabulary on two devices: a few ulps per term, L terms);
2. launches per stage: aten ops with ``benchmarks/launches.py``'s filter (its ``Counter``),
   of them the ops on host tensors only (no launch on the device), tensors made from host
   data, host<->device copies; and what the GPU ran (``torch.profiler``, one session per
   stage: kernels, memcpys by direction, memsets);
3. host syncs: ``torch.cuda.set_sync_debug_mode("warn")`` per stage, with the project line
   that synchronised. build_tree, walk and finish_verify must not; record_proposal,
   clip_drafts and begin_verify do host work by design (reported too);
4. CUDA graphs: build_tree, walk and finish_verify, each alone on static inputs, warmed up on
   a side stream, captured, then replayed on new inputs copied into the static ones and
   compared with an eager run on them. A failure is recorded and the script goes on.

Between record_proposal and clip_drafts the stream is synchronised, outside every stage: vLLM
waits for its draft-id copy there, which record_proposal's copy of the node depths rides on.
Everything runs under ``torch.inference_mode()``, as vLLM's runner does.

Needs torch, no vLLM; on a machine without an install of the package, link its kernels first
(``ln -sfn ../kernels vllm_ddtree/kernels``) and run with ``PYTHONPATH=<repo root>``. The
first run on a machine builds the fused CPU ops (~20-40 s with g++, then cached). Writes
``benchmarks/results/cuda_stages_<device>.json``; exits non-zero when a configuration failed
or differs from the reference.
``--smoke``: the CPU, vocab 512, B {16, 64}, R {1, 2}, the torch path against the fused ops;
no profiler, sync checks or graphs (seconds, for tests on machines without a GPU).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import itertools
import json
import os
import shlex
import subprocess
import sys
import time
import traceback
import warnings
from types import SimpleNamespace

import numpy as np
import torch
from torch.utils._pytree import tree_leaves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(ROOT)  # after an install or a PYTHONPATH entry, which win
import launches  # noqa: E402  (its op counter; the module itself needs no vLLM)

try:
    import vllm_ddtree.kernels  # noqa: E402,F401
except ImportError as exc:
    sys.exit(f"cannot import vllm_ddtree.kernels ({exc}): the repository's kernels/ folder "
             "installs as vllm_ddtree.kernels; without an install, link it from the repository "
             "root with `ln -sfn ../kernels vllm_ddtree/kernels` and set PYTHONPATH to the root")

from vllm_ddtree.kernels.native import cpu_ops  # noqa: E402
from vllm_ddtree.plugin.options import DDTreeOptions  # noqa: E402
from vllm_ddtree.plugin.state import TreeState  # noqa: E402
from vllm_ddtree.tree import DraftTree, build_tree  # noqa: E402
from vllm_ddtree.walk import TreeVerdict, walk  # noqa: E402

STAGES = ("build_tree", "record_proposal", "clip_drafts", "begin_verify", "walk",
          "finish_verify")
DEVICE_ONLY = ("build_tree", "walk", "finish_verify")  # no host sync allowed
TREE_FIELDS = ("token_ids", "parents", "depths", "scores", "num_nodes", "ancestor_mask")
VERDICT_FIELDS = ("accepted_nodes", "num_accepted", "bonus_token", "output_tokens",
                  "accepted_rows")
DEPTH = 15  # L of the DFlash b16 drafters
WARMUP_STEPS = 2
MAX_MODEL_LEN = 1 << 20
# a confident drafter's peaked distributions: trees branch and reach depth ~5-15 (plain randn
# over 151936 tokens gives trees of depth-1 nodes only: nothing for the walk and the masks)
DRAFT_SCALE = 8.0
REAL_ROOT = os.path.realpath(ROOT)
FULL = dict(vocab=151936, budgets=(16, 64, 256), requests=(1, 8))
SMOKE = dict(vocab=512, budgets=(16, 64), requests=(1, 2))


# ------------------------------------------------------------------------------- the step


@dataclasses.dataclass
class StepInputs:
    """One verify step's inputs: tensors on the device, the scheduler's host lists."""

    logits: torch.Tensor  # [R, L, vocab] float32, the drafter's
    req_ids: list[str]
    requests: dict  # req_id -> what clip_drafts reads (far from every limit: nothing is cut)
    drafts: list[list[int]]  # each request's drafts as the scheduler gets them: its tree's nodes
    draft_ids: torch.Tensor  # the scheduled drafts, flat
    query_start: list[int]
    num_tokens: int
    token_rows: tuple[np.ndarray, np.ndarray]  # each row's request and query position
    sampled: torch.Tensor  # [R, B + 1] target samples: each request's first path

    def to(self, device: torch.device) -> StepInputs:
        return dataclasses.replace(self, logits=self.logits.to(device),
                                   draft_ids=self.draft_ids.to(device),
                                   sampled=self.sampled.to(device))


def step_inputs(logits: torch.Tensor, tree: DraftTree, path_depth: int = DEPTH) -> StepInputs:
    """The inputs (on the host) of a step whose drafter gave ``logits`` and whose trees are
    ``tree``: the drafts, token rows and target samples of ``verify_step`` (the samples follow
    each request's first path, at most ``path_depth`` nodes of it)."""
    num_reqs, width = tree.token_ids.shape
    tokens, parents, depths = tree.token_ids.tolist(), tree.parents.tolist(), tree.depths.tolist()
    drafts = [[t for t, d in zip(tokens[r], depths[r]) if d > 0] for r in range(num_reqs)]
    sizes = [len(ids) + 1 for ids in drafts]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    sampled = torch.zeros(num_reqs, width + 1, dtype=torch.long)
    for r in range(num_reqs):  # follow each request's first path as deep as it goes
        current = -1
        for k in range(width):
            if parents[r][k] == current and 0 < depths[r][k] <= path_depth:
                sampled[r, current + 1] = tokens[r][k]
                current = k
    req_ids = [f"req{r}" for r in range(num_reqs)]
    requests = {req_id: SimpleNamespace(num_tokens=7, output_token_ids=[0] * 5,
                                        sampling_params=SimpleNamespace(max_tokens=1 << 20))
                for req_id in req_ids}
    return StepInputs(
        logits=logits, req_ids=req_ids, requests=requests, drafts=drafts,
        draft_ids=torch.tensor(sum(drafts, []), dtype=torch.long), query_start=starts.tolist(),
        num_tokens=int(sum(sizes)),
        token_rows=(np.repeat(np.arange(num_reqs), sizes),
                    np.concatenate([np.arange(s) for s in sizes])),
        sampled=sampled)


def verify_step(state: TreeState, inputs: StepInputs, stage=lambda name: contextlib.nullcontext()):
    """One verify step, each stage inside ``stage(name)``; returns what the stages produced."""
    with stage("build_tree"):
        tree = build_tree(inputs.logits, state.budget)
    with stage("record_proposal"):
        state.record_proposal(inputs.req_ids, tree)
    if state.device.type == "cuda":  # vLLM's wait for its draft-id copy
        torch.cuda.current_stream().synchronize()
    drafts = [list(ids) for ids in inputs.drafts]  # the scheduler's lists (clip_drafts edits)
    with stage("clip_drafts"):
        state.clip_drafts(inputs.req_ids, drafts, inputs.requests, max_model_len=MAX_MODEL_LEN)
    num_draft = [len(ids) for ids in drafts]
    with stage("begin_verify"):
        verify = state.begin_verify(inputs.req_ids, num_draft, inputs.draft_ids,
                                    inputs.query_start, inputs.num_tokens, scheduled=drafts,
                                    token_rows=inputs.token_rows)
    with stage("walk"):
        verdict = walk(verify.tree, inputs.sampled)
    with stage("finish_verify"):
        src, dst = state.finish_verify(verdict)
    return SimpleNamespace(tree=tree, verify=verify, verdict=verdict, src=src, dst=dst,
                           gather_index=state.gather_index)


def outputs(step) -> dict[str, torch.Tensor]:
    """A step's outputs by name, on the host."""
    named = {f"build_tree.{name}": getattr(step.tree, name) for name in TREE_FIELDS}
    named.update({f"begin_verify.tree.{name}": getattr(step.verify.tree, name)
                  for name in TREE_FIELDS})
    named.update({f"begin_verify.{name}": getattr(step.verify, name)
                  for name in ("matched", "starts", "position_shift")})
    named.update({f"walk.{name}": getattr(step.verdict, name) for name in VERDICT_FIELDS})
    named.update({f"finish_verify.{name}": getattr(step, name)
                  for name in ("src", "dst", "gather_index")})
    return {name: value.cpu() for name, value in named.items()}


def compare(reference: dict, got: dict) -> dict:
    """Integers bit for bit; scores (floats) equal, else within rtol = 1e-5, atol = 1e-4 (a
    score sums up to L float32 log-probabilities; the devices round each a few ulps apart:
    the first H200 run saw at most 1.1e-5)."""
    mismatches, close, worst = [], [], 0.0
    for name, want in reference.items():
        have = got[name]
        if have.dtype != want.dtype or have.shape != want.shape:
            mismatches.append(f"{name}: {have.dtype}{list(have.shape)} vs reference "
                              f"{want.dtype}{list(want.shape)}")
        elif torch.equal(have, want):
            continue
        elif want.is_floating_point():
            diff = (have.double() - want.double()).abs()[torch.isfinite(want)]
            worst = max(worst, float(diff.max()) if diff.numel() else float("inf"))
            if torch.allclose(have, want, rtol=1e-5, atol=1e-4):
                close.append(name)
            else:
                mismatches.append(f"{name}: differs (max |diff| {worst:.3g})")
        else:
            mismatches.append(f"{name}: {int((have != want).sum())} of {want.numel()} differ")
    scores = ("differ" if any("scores" in m for m in mismatches)
              else "allclose (rtol = 1e-5, atol = 1e-4)" if close else "torch.equal")
    return {"correct": not mismatches, "scores": scores, "max_score_diff": worst,
            "mismatches": mismatches}


@contextlib.contextmanager
def stage_path(fused: bool):
    """Every stage on its fused ops (the CPU's C++ ops, CUDA's Triton kernels) or on its torch
    path (``cpu_ops`` and ``triton_stages`` read the variable at each call)."""
    saved = os.environ.get("VLLM_DDTREE_NATIVE")
    os.environ["VLLM_DDTREE_NATIVE"] = "1" if fused else "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["VLLM_DDTREE_NATIVE"]
        else:
            os.environ["VLLM_DDTREE_NATIVE"] = saved


# ------------------------------------------------------------------------------ measuring


class StageCounter(launches.Counter):
    """launches.py's counter (its filter, its stages), plus per stage the counted ops none of
    whose tensors is on ``device`` (host work: no launch there) and the host<->device copies."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.off_device: collections.Counter = collections.Counter()
        self.copies: dict[str, collections.Counter] = collections.defaultdict(
            collections.Counter)

    def record(self, func, args, out) -> None:
        stage = self.stack[-1]
        counted = self.ops[stage]
        super().record(func, args, out)
        if self.ops[stage] == counted:
            return
        tensors = [t for t in tree_leaves((args, out)) if isinstance(t, torch.Tensor)]
        if all(t.device.type != self.device.type for t in tensors):
            self.off_device[stage] += 1
        name = func.overloadpacket.__name__
        if name in ("_to_copy", "copy_"):  # (source, destination)
            src, dst = (args[1], args[0]) if name == "copy_" else (args[0], out)
            if src.device.type == "cpu" and dst.device.type != "cpu":
                self.copies[stage]["h2d"] += 1
            elif src.device.type != "cpu" and dst.device.type == "cpu":
                self.copies[stage]["d2h"] += 1


def count_ops(state: TreeState, inputs: StepInputs) -> tuple[dict, object]:
    """Per stage: aten ops (launches.py's filter) and the rest of :class:`StageCounter`."""
    counter = StageCounter(state.device)
    with launches.counting_mode(counter):
        step = verify_step(state, inputs, counter.stage)
    return {stage: {"aten_ops": counter.ops[stage],
                    "aten_ops_off_device": counter.off_device[stage],
                    "host_tensors": counter.host_tensors[stage],
                    "h2d_copies": counter.copies[stage]["h2d"],
                    "d2h_copies": counter.copies[stage]["d2h"],
                    "top_ops": dict(counter.by_op[stage].most_common(12))}
            for stage in STAGES}, step


def project_line() -> str:
    """The innermost line of the project's code below the warning hook that calls this, as
    ``path:line (function)``."""
    for frame in reversed(traceback.extract_stack(sys._getframe(2))):
        path = os.path.realpath(frame.filename)
        if path.startswith(REAL_ROOT + os.sep):
            return f"{os.path.relpath(path, REAL_ROOT)}:{frame.lineno} ({frame.name})"
    return "outside the project"


def find_syncs(state: TreeState, inputs: StepInputs) -> dict:
    """Per stage: the host synchronisations CUDA's sync debug mode reports, by project line."""
    found = {stage: collections.Counter() for stage in STAGES}

    @contextlib.contextmanager
    def watched(stage: str):
        show = warnings.showwarning

        def hook(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                found[stage][project_line()] += 1
            else:
                show(message, category, filename, lineno, file, line)

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = hook
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(0)

    verify_step(state, inputs, watched)
    return {stage: {"syncs": sum(lines.values()), "where": dict(lines)}
            for stage, lines in found.items()}


def profile_stages(state: TreeState, inputs: StepInputs) -> dict:
    """Per stage: what the GPU ran (one profiler session per stage, the stream idle at both
    ends): kernels, memcpys by direction, memsets."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    found = {}

    @contextlib.contextmanager
    def profiled(stage: str):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            yield
            torch.cuda.synchronize()
        events = collections.Counter()
        for event in prof.events():
            if event.device_type != DeviceType.CUDA:
                continue
            if event.name.startswith("Memcpy"):
                kind = next((f"memcpy_{d.lower()}" for d in ("HtoD", "DtoH", "DtoD")
                             if d in event.name), "memcpy_other")
            else:
                kind = "memset" if event.name.startswith("Memset") else "kernels"
            events[kind] += 1
        found[stage] = {"gpu_" + kind: events[kind] for kind in (
            "kernels", "memcpy_htod", "memcpy_dtoh", "memcpy_dtod", "memcpy_other", "memset")}
        found[stage]["gpu_launches"] = sum(events.values())

    verify_step(state, inputs, profiled)
    return found


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def tensors_of(value) -> list[torch.Tensor]:
    if dataclasses.is_dataclass(value):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def check_graph(fn, new_inputs: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """Capture ``fn`` (its inputs: static tensors) in a CUDA graph as torch's docs prescribe,
    copy each ``(static, new)`` pair's new values in, replay, and compare with ``fn`` eager."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = tensors_of(fn())
    except Exception as exc:
        with contextlib.suppress(Exception):  # what is left of the failed capture
            torch.cuda.synchronize()
        return f"capture failed: {first_line(exc)}"
    try:
        for static, new in new_inputs:
            static.copy_(new)
        graph.replay()
        eager = tensors_of(fn())
        same = len(eager) == len(captured) and all(
            a.shape == b.shape and torch.equal(a, b) for a, b in zip(captured, eager))
    except Exception as exc:
        return f"replay failed: {first_line(exc)}"
    return "captured, replay equals eager" if same else "replay differs"


def graph_checks(budget: int, num_reqs: int, vocab: int, device: torch.device,
                 path: str) -> dict:
    with stage_path(fused=path == "triton"):
        return _graph_checks(budget, num_reqs, vocab, device)


def _graph_checks(budget: int, num_reqs: int, vocab: int, device: torch.device) -> dict:
    """build_tree, walk and finish_verify each in a CUDA graph (see :func:`check_graph`): the
    static inputs hold step A's values at capture, step B's at replay (other logits, and
    samples that leave the first path after 2 nodes: another verdict for finish_verify)."""
    state = TreeState(DDTreeOptions(budget=budget, depth=DEPTH), device, max_num_reqs=num_reqs)
    steps = []
    for seed, path_depth in ((1, DEPTH), (2, 2)):
        logits = drafter_logits(budget, num_reqs, vocab, seed)
        steps.append(step_inputs(logits, build_tree(logits, budget), path_depth).to(device))
    first = verify_step(state, steps[0])  # eager: the state's verify batch, the cached tables
    new_tree = build_tree(steps[1].logits, budget)
    new_verdict = walk(new_tree, steps[1].sampled)

    logits = steps[0].logits.clone()
    tree = DraftTree(**{name: getattr(first.verify.tree, name).clone() for name in TREE_FIELDS},
                     max_depth=DEPTH)
    sampled = steps[0].sampled.clone()
    verdict = TreeVerdict(**{name: getattr(first.verdict, name).clone()
                             for name in VERDICT_FIELDS})

    def finish():
        return (*state.finish_verify(verdict), state.gather_index)

    cases = {
        "build_tree": (lambda: build_tree(logits, budget), [(logits, steps[1].logits)]),
        "walk": (lambda: walk(tree, sampled),
                 [(getattr(tree, name), getattr(new_tree, name)) for name in TREE_FIELDS]
                 + [(sampled, steps[1].sampled)]),
        "finish_verify": (finish, [(getattr(verdict, name), getattr(new_verdict, name))
                                   for name in VERDICT_FIELDS]),
    }
    return {stage: check_graph(fn, pairs) for stage, (fn, pairs) in cases.items()}


def drafter_logits(budget: int, num_reqs: int, vocab: int, seed: int) -> torch.Tensor:
    """``[R, L, vocab]`` float32 ``randn * DRAFT_SCALE`` on the CPU, seeded per configuration."""
    gen = torch.Generator().manual_seed(10_000 * seed + 100 * budget + num_reqs)
    return torch.randn(num_reqs, DEPTH, vocab, generator=gen) * DRAFT_SCALE


def measure(budget: int, num_reqs: int, vocab: int, device: torch.device, path: str) -> dict:
    """One configuration: the reference step on the CPU (fused ops), then on ``device`` the
    counted step, the sync-checked step and the profiled step, on ``path``: "torch" (the torch
    path of every stage) or "triton" (CUDA's fused kernels, ``kernels/verify_steps.py``)."""
    start = time.time()
    logits = drafter_logits(budget, num_reqs, vocab, seed=1)
    with stage_path(fused=True):
        inputs = step_inputs(logits, build_tree(logits, budget))
        state = TreeState(DDTreeOptions(budget=budget, depth=DEPTH), torch.device("cpu"),
                          max_num_reqs=num_reqs)
        for _ in range(WARMUP_STEPS):
            verify_step(state, inputs)
        reference = outputs(verify_step(state, inputs))
    inputs = inputs.to(device)
    result = {"path": path, "budget": budget, "requests": num_reqs, "depth": DEPTH, "vocab": vocab,
              # the trees' shape: the deepest node and the accepted nodes, per request
              "mean_tree_depth": float(reference["build_tree.depths"].amax(1).double().mean()),
              "mean_accepted": float(reference["walk.num_accepted"].double().mean())}
    with stage_path(fused=path == "triton"):
        state = TreeState(DDTreeOptions(budget=budget, depth=DEPTH), device,
                          max_num_reqs=num_reqs)
        for _ in range(WARMUP_STEPS):
            verify_step(state, inputs)
        stages, step = count_ops(state, inputs)
        result.update(compare(reference, outputs(step)))
        if device.type == "cuda":
            for name, part in (("syncs", find_syncs), ("profiler", profile_stages)):
                try:
                    for stage, found in part(state, inputs).items():
                        stages[stage].update(found)
                except Exception as exc:
                    result[f"{name}_error"] = first_line(exc)
            if not sum(s.get("gpu_launches", 0) for s in stages.values()):
                result.setdefault("profiler_error", "no CUDA events recorded (no CUPTI?)")
    result["stages"] = stages
    result["per_step"] = {key: sum(s[key] for s in stages.values() if key in s) for key in (
        "aten_ops", "aten_ops_off_device", "host_tensors", "h2d_copies", "d2h_copies",
        "gpu_launches", "gpu_kernels", "gpu_memset", "gpu_memcpy_htod", "syncs")
        if key in stages["walk"]}
    result["device_only_stages_sync"] = (
        sorted(s for s in DEVICE_ONLY if stages[s]["syncs"]) if "syncs" in stages["walk"]
        else None)
    result["seconds"] = round(time.time() - start, 2)
    return result


# --------------------------------------------------------------------------------- report


def cell(row: dict, key: str, width: int) -> str:
    return f"{row[key] if key in row else '-':>{width}}"


def print_table(result: dict) -> None:
    if "error" in result:
        print(f"\n{result['path']}: B={result['budget']} R={result['requests']}: FAILED: "
              f"{result['error']}")
        return
    verdict = ("correct" if result["correct"] else "WRONG: " + "; ".join(result["mismatches"]))
    print(f"\n{result['path']}: B={result['budget']} R={result['requests']} L={result['depth']} "
          f"vocab={result['vocab']} (trees {result['mean_tree_depth']:.1f} deep, "
          f"{result['mean_accepted']:.1f} accepted): {verdict} (scores {result['scores']}), "
          f"{result['seconds']:.1f} s")
    for key in ("syncs_error", "profiler_error", "graphs_error"):
        if key in result:
            print(f"  {key}: {result[key]}")
    # aten: launches.py's count; host: of them, ops on host tensors only; h2d / d2h: copies
    # among them; kern / cpy / set: the GPU's kernels, memcpys, memsets (profiler)
    print(f"  {'stage':16s} {'aten':>5s} {'host':>5s} {'h2d':>4s} {'d2h':>4s} {'kern':>5s} "
          f"{'cpy':>4s} {'set':>4s} {'sync':>5s}  graph")
    rows = [(stage, result["stages"][stage]) for stage in STAGES]
    for stage, row in rows + [("step", result["per_step"])]:
        if "gpu_launches" in row:
            row = dict(row, gpu_memcpy=row["gpu_launches"] - row["gpu_kernels"]
                       - row["gpu_memset"])
        print(f"  {stage:16s} {cell(row, 'aten_ops', 5)} {cell(row, 'aten_ops_off_device', 5)} "
              f"{cell(row, 'h2d_copies', 4)} {cell(row, 'd2h_copies', 4)} "
              f"{cell(row, 'gpu_kernels', 5)} {cell(row, 'gpu_memcpy', 4)} "
              f"{cell(row, 'gpu_memset', 4)} {cell(row, 'syncs', 5)}  "
              f"{result.get('graphs', {}).get(stage, '')}")
        for line, n in row.get("where", {}).items():
            print(f"  {'':16s} sync x{n} at {line}")


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=False).stdout.strip()
    except OSError:  # no git on the machine
        return None
    return out or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="the CPU's torch path against its fused ops, small shapes")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/"
                                      "cuda_stages_<device>.json)")
    args = parser.parse_args()
    if args.smoke:
        shape, device = SMOKE, torch.device("cpu")
        name = "smoke"
    else:
        if not torch.cuda.is_available():
            sys.exit("benchmarks/cuda_stages.py needs a CUDA device (--smoke runs on the CPU)")
        shape, device = FULL, torch.device("cuda", torch.cuda.current_device())  # as vLLM's
        name = torch.cuda.get_device_name().replace(" ", "_")
    start = time.time()
    with stage_path(fused=True):
        fused = cpu_ops("cpu") is not None  # builds the fused CPU ops on a first use
    if args.smoke and not fused:
        sys.exit("--smoke compares the CPU's torch path with the fused ops, which could not be "
                 "built here (see the warning above)")
    reference = "cpu, fused ops" if fused else "cpu, torch path (the fused ops failed to build)"
    print(f"reference: {reference} ({time.time() - start:.1f} s to load); device: {device}",
          flush=True)
    results = []
    # on CUDA both paths, side by side; --smoke: the CPU's torch path (its fused ops are the
    # reference)
    paths = ("torch",) if args.smoke else ("torch", "triton")
    with torch.inference_mode():
        for path, budget, num_reqs in itertools.product(paths, shape["budgets"],
                                                        shape["requests"]):
            try:
                results.append(measure(budget, num_reqs, shape["vocab"], device, path))
            except Exception as exc:  # the other configurations still run
                traceback.print_exc()
                results.append({"path": path, "budget": budget, "requests": num_reqs,
                                "error": first_line(exc)})
            print(f"{path}: B={budget} R={num_reqs}: {time.time() - start:.1f} s", flush=True)
        # last: a failed capture must not disturb the other measurements
        for result in results if device.type == "cuda" else ():
            try:
                result["graphs"] = graph_checks(result["budget"], result["requests"],
                                                shape["vocab"], device, result["path"])
            except Exception as exc:
                result["graphs_error"] = first_line(exc)
    for result in results:
        print_table(result)
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"cuda_stages_{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"command": shlex.join(["python", *sys.argv]), "commit": git_commit(),
                   "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                   "torch": torch.__version__, "reference": reference,
                   "smoke": args.smoke, "seconds": round(time.time() - start, 1),
                   "results": results}, f, indent=1)
    print(f"\nwrote {out} ({time.time() - start:.0f} s)")
    failed = [f"{r['path']} B={r['budget']} R={r['requests']}" for r in results
              if "error" in r or not r["correct"]]
    if failed:
        sys.exit(f"failed or not equal to the reference: {', '.join(failed)}")


if __name__ == "__main__":
    main()
