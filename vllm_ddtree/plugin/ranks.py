"""Keeping the ranks of a tensor-parallel group in agreement.

Every rank of a TP group runs its own model runner, drafter and budget policy. Whatever changes
what a rank computes (the drafter's plan for a step, the trees, which rows are verified as
chains) must be the same on every rank, or the ranks compute different attention masks (wrong
text) or one rank enters a collective the others never enter (a hang). ddtree makes these
decisions identical by construction:

- **Step clock**: the scheduler (one per engine, in the engine-core process) stamps every
  :class:`SchedulerOutput` with its clock (``patches.py``, ``Scheduler.schedule``); the "auto"
  policy times steps by these stamps, which every rank receives in the same broadcast. No rank
  reads its own clock for a decision.
- **Emitted tokens**: every rank counts the tokens of its own sampled output, which vLLM
  already requires to be identical on every rank (each rank feeds them back as inputs).
- **Start-up cost model**: each rank measures it (the measurement runs the model, with its
  collectives, on every rank), then the ranks take the slowest rank's time per point
  (:func:`max_over_ranks`): the model every rank uses is the same numbers.
- Everything else the policy reads is device data computed identically on every rank (the
  drafter's logits are gathered to every rank, the walk runs on identical target logits).

Guards: at start-up the ranks compare a digest of their options and cost model
(:func:`check_same`, always); with ``VLLM_DDTREE_CHECK_RANKS=1`` they also compare each step's
plan before the drafter runs (a debug setting: one small host collective per step). A rank that
disagrees stops the engine with :class:`DDTreeRankError` instead of computing wrong text or
waiting forever in a collective.
"""

from __future__ import annotations

import hashlib
import os

import torch

CHECK_RANKS_ENV = "VLLM_DDTREE_CHECK_RANKS"


class DDTreeRankError(RuntimeError):
    """Tensor-parallel ranks that would diverge; the message names what differs."""


def _tp_group():
    """vLLM's tensor-parallel group of this process when it has more than one rank, else None."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_tp_group()
    return group if group.world_size > 1 else None


def tp_world_size() -> int:
    group = _tp_group()
    return 1 if group is None else group.world_size


def check_every_step() -> bool:
    """Whether :func:`check_same` runs on every step's plan (``VLLM_DDTREE_CHECK_RANKS=1``)."""
    return os.environ.get(CHECK_RANKS_ENV, "0") not in ("", "0") and tp_world_size() > 1


def max_over_ranks(values: list[float]) -> list[float]:
    """``values`` reduced over the TP group by the maximum, element by element (a no-op with
    one rank). Every rank must call it with the same number of values."""
    group = _tp_group()
    if group is None:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX,
                                 group=group.cpu_group)
    return tensor.tolist()


def digest(value) -> str:
    """A short digest of ``repr(value)`` (host data only)."""
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def check_same(what: str, value) -> None:
    """Stop with :class:`DDTreeRankError` unless every rank of the TP group holds the same
    ``value`` (compared by :func:`digest`; a no-op with one rank). ``what`` names it in the
    error. Every rank must call it at the same point."""
    group = _tp_group()
    if group is None:
        return
    mine = (digest(value), repr(value)[:300])
    gathered: list = [None] * group.world_size
    torch.distributed.all_gather_object(gathered, mine, group=group.cpu_group)
    if len({d for d, _ in gathered}) > 1:
        detail = "; ".join(f"rank {rank}: {text}" for rank, (_, text) in enumerate(gathered))
        raise DDTreeRankError(
            f"ddtree: the tensor-parallel ranks disagree on {what} ({detail}); they would "
            "compute different trees or wait in different collectives. This is a bug in "
            "vllm-ddtree: report it; \"ddtree_budget_policy\": \"static\" avoids the policy's "
            "decisions")
