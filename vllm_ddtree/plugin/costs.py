"""Start-up measurement of the step costs that ``ddtree_budget_policy: "auto"`` weighs.

Run once per engine, after vLLM's own warm-up (and CUDA graph capture), by the worker patch
in ``patches.py``; it takes a few seconds and fits whatever device runs it:

- **verify**: a target step over n tokens, at n = 1, 2, 4, ... up to ``max_num_batched_tokens``:
  vLLM's own dummy forward (``GPUModelRunner._dummy_run``, so CUDA graphs are used where serving
  uses them; the drafter's part of the dummy run is switched off for the measurement), the
  logits of all n rows (the verify step needs every row's distribution) and their argmax.
  What that dummy forward is: vLLM spreads the n tokens over min(n, max_num_seqs) requests and
  builds no attention metadata (except for full CUDA graphs), so its attention layers return
  at once: the curve holds the GEMMs and the per-request work, not attention (not the tree
  rows' attention either); the online overheads of ``policy.py`` absorb that (added seconds).
- **draft**: the drafter for R requests, at R = 1, 2, 4, ... up to ``max_num_seqs``: its dummy
  pass over R * (L + 1) query tokens (with the context K/V write), the lm_head over the R * L
  drafted positions, and the tree build with auto's budget function.

Each point is the fastest of ``REPEATS`` timed runs after one warm-up run, the points of a
curve taking turns run by run, with the device synchronised around each run (start-up only:
serving never synchronises for this). Interference (another process, a page fault, a slow
spell of a shared CPU) only ever adds time, so the fastest run is the cost; taking turns keeps
a slow spell from raising one point against its neighbours (the medians of 3 runs in a row
that this replaced moved the CPU curve's bends from one start of a lone engine to the next).
Starts of several engines on one 2-core machine still draw different bends, and one
request's tree stops at a bend (docs/measurements.md). The random state is restored
afterwards, so seeded generation is unaffected.

Under tensor parallelism every rank measures (the forwards run their collectives on every
rank), then every point becomes the slowest rank's time (:func:`shared_cost_model`): all ranks
decide from the same model. The ranks then compare a digest of their options and model, and a
rank whose measurement failed stops every rank with the same error (no rank is left waiting).
"""

from __future__ import annotations

import contextlib
import time

import torch

from vllm_ddtree.budget import Calibration, CostModel, budget_function
from vllm_ddtree.plugin.options import DDTreeConfigError
from vllm_ddtree.plugin.ranks import check_same, max_over_ranks
from vllm_ddtree.tree import build_tree

REPEATS = 7


def _grid(top: int) -> list[int]:
    """Powers of two below ``top``, then ``top``. Example: 48 -> [1, 2, 4, 8, 16, 32, 48]."""
    points = [1 << i for i in range(max(top, 1).bit_length()) if 1 << i < top]
    return points + [max(top, 1)]


def _fastest_seconds(fns: list, sync) -> list[float]:
    """Per function, the fastest of ``REPEATS`` timed runs after one warm-up run each, the
    functions taking turns run by run."""
    for fn in fns:
        fn()  # warm-up: allocations, first-call paths
    best = [float("inf")] * len(fns)
    for _ in range(REPEATS):
        for i, fn in enumerate(fns):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


@contextlib.contextmanager
def _without_drafter_dummy(drafter):
    """vLLM's target dummy run also runs the drafter's; time the target alone."""
    drafter.dummy_run = lambda *args, **kwargs: None  # instance attribute shadows the method
    try:
        yield
    finally:
        del drafter.dummy_run


def _grids(runner) -> tuple[list[int], list[int]]:
    """The measured token counts and request counts (from the configuration: the same on
    every rank)."""
    budget = runner.ddtree_state.budget
    max_tokens = min(runner.max_num_tokens, runner.max_num_reqs * (budget + 1))
    return _grid(max_tokens), _grid(runner.max_num_reqs)


def shared_cost_model(runner) -> CostModel:
    """:func:`measure_costs` on every rank of the tensor-parallel group, reduced to one model
    (each point: the slowest rank's time), checked to be the same on every rank."""
    failure = None
    try:
        cost = measure_costs(runner)
    except Exception as error:  # every rank must still reach the reduction below
        failure, cost = error, None
    if max_over_ranks([float(failure is not None)])[0]:
        reason = "on another rank" if failure is None else f"{type(failure).__name__}: {failure}"
        raise DDTreeConfigError(
            f"ddtree: measuring the step costs of ddtree_budget_policy 'auto' at engine start "
            f"failed ({reason}); pin a budget instead with \"ddtree_budget_policy\": \"static\" "
            "(every request drafts num_speculative_tokens nodes) and report this failure"
        ) from failure
    check_same("the step cost model's points", (cost.verify_tokens, cost.draft_requests))
    values = max_over_ranks([*cost.verify_seconds, *cost.draft_seconds])
    split = len(cost.verify_seconds)
    cost = CostModel(cost.verify_tokens, tuple(values[:split]), cost.draft_requests,
                     tuple(values[split:]))
    check_same("the ddtree options and the step cost model",
               (runner.ddtree_state.options.to_dict(), cost.to_dict()))
    return cost


def measure_costs(runner) -> CostModel:
    """The :class:`~vllm_ddtree.budget.CostModel` of ``runner``'s engine as this rank measures
    it (see the module doc; :func:`shared_cost_model` is what the policy uses)."""
    state = runner.ddtree_state
    drafter = runner.drafter
    device = runner.device
    depth, budget = state.depth, state.budget
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def verify(num_tokens: int) -> None:
        hidden, _ = runner._dummy_run(num_tokens, skip_eplb=True, remove_lora=False)
        runner.model.compute_logits(hidden[:num_tokens]).argmax(dim=-1)

    unit_cost = CostModel((1,), (1.0,), (1,), (1.0,))
    unit_cost.upload(device)

    def draft(num_reqs: int) -> None:
        drafter.dummy_run(num_reqs * (depth + 1), use_cudagraphs=not runner.model_config.enforce_eager)
        hidden = torch.randn(num_reqs * depth, drafter.hidden_size, device=device,
                             dtype=runner.model_config.dtype)
        logits = drafter.model.compute_logits(hidden).view(num_reqs, depth, -1)
        sampled = torch.zeros(num_reqs, dtype=torch.bool, device=device)
        build_tree(logits, budget_function(unit_cost, Calibration(depth, device), sampled),
                   max_budget=budget, calibration=state.tree_calibration(sampled, num_reqs))
        # (as served: the trees calibrated, the budget function's fused op)

    verify_grid, draft_grid = _grids(runner)
    with torch.inference_mode(), torch.random.fork_rng(devices=[device] if cuda else []):
        with _without_drafter_dummy(drafter):
            verify_seconds = _fastest_seconds(
                [lambda n=n: verify(n) for n in verify_grid], sync)
        draft_seconds = _fastest_seconds([lambda r=r: draft(r) for r in draft_grid], sync)
    return CostModel(
        verify_tokens=tuple(verify_grid),
        verify_seconds=_monotone(verify_seconds),
        draft_requests=tuple(draft_grid),
        draft_seconds=_monotone(draft_seconds),
    )


def _monotone(times) -> tuple[float, ...]:
    """A smaller batch never costs more than a bigger one: each point is capped by every
    later one, so a noisy spike (a page fault, another process) cannot make the model say
    otherwise. Example: [9.0, 2.0, 1.9, 3.0] -> (1.9, 1.9, 1.9, 3.0)."""
    out, low = [], float("inf")
    for t in reversed(list(times)):
        low = min(low, t)
        out.append(low)
    return tuple(reversed(out))
