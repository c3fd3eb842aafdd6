"""Trees by the acceptance the engine observes, not by the drafter's stated probabilities.

DDTree's tree is the top-B prefixes by ``prod_d q_d(y_d)``, the drafter's path probability.
A drafter that is right more often than it says (right at every depth with q ~ 0.52, its
second choice ~ 0.47) gets a bushy tree 3-4 deep where the chain of its first choices would be
accepted 7 deep. What a node's path is worth is how often the target takes it: the product,
along the path, of how often the target takes a node's token once it has taken the parent's.

The calibration (:class:`TreeCalibration`) learns that conditional per depth d and *rank cell*
of the token in the drafter's ranked list at depth d (ranks 0, 1, 2 each a cell, every lower
rank one more: :data:`TOP_RANKS`), for greedy and sampled requests apart: the ratio ``c`` of
how often the target's token at depth d had that rank to how often the drafter said it would
(the sum of the cell's probabilities), over the depths the target reached. The target's token
at depth d is known for every depth up to one past the accepted path (the accepted tokens, then
the bonus token: at T = 0 the target's argmax, at T > 0 the target's sample, which the walk
draws whether or not the tree holds it), so the evidence does not depend on the tree's shape:
a rank the trees never hold is still measured.

A node's calibrated acceptance is ``prod_d q'_d(y_d)`` with, per depth, the calibrated
conditional of the token of rank r (:func:`calibrated_values`, in log space)::

    q'_r = min(c_cell(r) * q_r, q'_{r-1}, 1)          (q'_{-1} = 1)

non-increasing in the rank (a token the drafter ranks lower is never worth more) and at most 1,
so a node is never accepted more often than its parent. The tree is the best-first top-B by
that value (DDTree's build, unchanged: ``vllm_ddtree.tree.build_tree`` gets the calibrated
per-depth log-values in place of the drafter's log-probabilities), so any prefix of it is still
a subtree. With no evidence every ``c`` is 1 and the tree is DDTree's, bit for bit. For the
drafter above ``c`` -> 1/0.52 at rank 0 and -> 0 at rank 1: the tree's first L nodes are the
chain of first choices, which is then never worse than vLLM's ``dflash`` chain.

Everything is device work of fixed shape (no host synchronisation): the per-request factors are
one gather, the update one scatter-add. On the CPU each of the three steps (the factors, the
calibrated lists with their tops, the update) is one fused op (``kernels/csrc/ddtree_cpu.cpp``:
their torch twins here ran ~45 small ops a step, 7 % of a step at one request on the tiny
pair's shapes).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_ddtree.kernels.native import cpu_ops

__all__ = ["TOP_RANKS", "CELLS", "DraftTops", "TreeCalibration", "calibrate_lists",
           "calibrated_values", "draft_tops", "rank_lists"]

TOP_RANKS = 3  # ranks 0, 1, 2 are a cell each
CELLS = TOP_RANKS + 1  # ... and cell TOP_RANKS holds every lower rank


class DraftTops(NamedTuple):
    """What the calibration needs of a tree's drafter distributions, kept until the tree is
    verified: per request and depth the drafter's ``TOP_RANKS`` first tokens and each cell's
    probability (the rest of the vocabulary in the last)."""

    token_ids: torch.Tensor  # [R, L, TOP_RANKS] int64, ranked; -1 past the vocabulary
    probs: torch.Tensor  # [R, L, CELLS] float32: q of ranks 0..TOP_RANKS-1, then the rest


def rank_lists(values: torch.Tensor, token_ids: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., k]`` values and token ids (any order) ranked by (value desc, token id asc), the
    order every tree build uses."""
    token_ids, by_id = token_ids.sort(dim=-1)
    values = values.gather(-1, by_id)
    values, order = values.sort(dim=-1, descending=True, stable=True)
    return values, token_ids.gather(-1, order)


def _cells(k: int, device: torch.device) -> torch.Tensor:
    """``[k]`` the cell of each rank: ``min(rank, TOP_RANKS)``."""
    return torch.arange(k, device=device).clamp_(max=TOP_RANKS)


def draft_tops(values: torch.Tensor, token_ids: torch.Tensor) -> DraftTops:
    """:class:`DraftTops` of ranked ``[R, L, k]`` log-probabilities and their token ids."""
    num_reqs, depth, k = values.shape
    top = min(k, TOP_RANKS)
    probs = values[..., :top].exp()
    ids = token_ids[..., :top]
    if top < TOP_RANKS:  # a vocabulary of fewer than TOP_RANKS tokens
        pad = TOP_RANKS - top
        probs = torch.nn.functional.pad(probs, (0, pad))
        ids = torch.nn.functional.pad(ids, (0, pad), value=-1)
    rest = (1.0 - probs.sum(-1, keepdim=True)).clamp_(min=0.0)
    return DraftTops(token_ids=ids, probs=torch.cat([probs, rest], dim=-1))


def calibrated_values(values: torch.Tensor, token_ids: torch.Tensor,
                      log_factors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The calibrated conditionals of the module doc, in log space, ranked again.

    ``values``/``token_ids``: ``[R, L, k]`` log-probabilities ranked by (value desc, id asc)
    (:func:`rank_lists`); ``log_factors``: ``[R, L, CELLS]`` float32 ``log c`` per request,
    depth and cell (:meth:`TreeCalibration.log_factors`). Returns the ``[R, L, k]`` values
    ``log q'`` (<= 0, non-increasing along a row) and the token ids, ranked by (value desc, id
    asc): equal values (capped at 1, or held at a better rank's) go by token id, as every
    tree build ranks them. With ``log_factors`` 0 the values come back unchanged.
    Example: q = [.52, .47, .01], c = [1.9, .1, 1, 1] -> q' = [.99, .047, .01].
    """
    cells = _cells(values.shape[-1], values.device).expand_as(values)
    calibrated = (values + log_factors.gather(-1, cells)).clamp_(max=0.0)
    calibrated = torch.cummin(calibrated, dim=-1).values
    return rank_lists(calibrated, token_ids)


def calibrate_lists(values: torch.Tensor, token_ids: torch.Tensor, log_factors: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, DraftTops]:
    """``[R, L, k]`` top-k log-probabilities and token ids (any order) -> the calibrated lists
    (:func:`calibrated_values`) and the drafter's :class:`DraftTops`: what the tree build takes
    and what the calibration later learns from. One fused op on the CPU."""
    ops = cpu_ops(values.device)
    if ops is not None:
        *lists, top_ids, top_probs = ops.calibrate_lists(
            values.contiguous(), token_ids.contiguous(), log_factors.contiguous())
        return (*lists, DraftTops(top_ids, top_probs))
    values, token_ids = rank_lists(values, token_ids)
    return (*calibrated_values(values, token_ids, log_factors), draft_tops(values, token_ids))


class TreeCalibration:
    """The calibration of the module doc, on the device: decayed sums per (kind, depth, cell).

    ``observed[kind, d, cell]``: how often the target's token at depth d + 1 had a rank in
    ``cell`` of the drafter's list; ``predicted[kind, d, cell]``: the drafter's probability of
    that cell, summed over the same depths; kind 0 greedy, 1 sampled requests (the target's
    token at T > 0 is its sample: a sampled request's drafter is right less often). Both decay
    by ``decay`` per update; ``c = (observed + prior) / (predicted + prior)``, 1 before any
    evidence.
    Example: one greedy request, drafter ranks [a, b, ...] with q = [.5, .3, .1, .1] at depth 1,
    the target's token b: observed[0, 0] = [0, 1, 0, 0], predicted[0, 0] = [.5, .3, .1, .1], so
    c = [1 / 1.5, 2 / 1.3, 1 / 1.1, 1 / 1.1] (prior 1).
    """

    def __init__(self, depth: int, device: torch.device, decay: float = 0.99,
                 prior: float = 1.0):
        self.depth, self.decay, self.prior = depth, decay, prior
        self.observed = torch.zeros(2, depth, CELLS, dtype=torch.float64, device=device)
        self.predicted = torch.zeros_like(self.observed)

    def factors(self) -> torch.Tensor:
        """``[2, L, CELLS]`` float64: c per kind, depth and cell."""
        return (self.observed + self.prior) / (self.predicted + self.prior)

    def log_factors(self, sampled: torch.Tensor) -> torch.Tensor:
        """``[R, L, CELLS]`` float32 ``log c`` for each request (``sampled``: ``[R]`` bool,
        T > 0), what :func:`calibrated_values` takes."""
        ops = cpu_ops(sampled.device)
        if ops is not None:  # the fused CPU kernel: one op
            return ops.tree_log_factors(self.observed, self.predicted, self.prior,
                                        sampled.contiguous())
        return self.factors().log()[sampled.long()].float()

    def observe(self, tops: DraftTops, output_tokens: torch.Tensor,
                num_accepted: torch.Tensor, counted: torch.Tensor,
                sampled: torch.Tensor) -> None:
        """Fold in one verify step.

        Args:
            tops: the verified trees' :class:`DraftTops` (row r: request r's proposal).
            output_tokens: ``[R, L' + 1]`` int64 the walk's emitted tokens (accepted, then the
                bonus): the target's token at depths 1 .. ``num_accepted + 1``.
            num_accepted: ``[R]`` int64.
            counted: ``[R]`` bool, the requests to count (whose trees are their recorded
                proposal: ``tops`` belong to this step's root).
            sampled: ``[R]`` bool, T > 0.
        """
        ops = cpu_ops(output_tokens.device)
        if ops is not None:  # the fused CPU kernel: one op
            ops.tree_calibration_observe_(
                self.observed, self.predicted, tops.token_ids.contiguous(),
                tops.probs.contiguous(), output_tokens.contiguous(), num_accepted.contiguous(),
                counted.contiguous(), sampled.contiguous(), self.decay)
            return
        num_reqs, depth = tops.probs.shape[:2]
        width = min(output_tokens.shape[1], depth)  # the depths with a drafter list
        targets = output_tokens[:, :width]  # [R, D]: the target's token at depth d + 1
        column = torch.arange(width, device=targets.device)
        reached = (column[None, :] <= num_accepted[:, None]) & counted[:, None]  # [R, D]
        ranks = tops.token_ids[:, :width]  # [R, D, TOP_RANKS]
        hit = ranks == targets[:, :, None]
        cell = torch.where(hit.any(-1), hit.int().argmax(-1), TOP_RANKS)  # [R, D]
        weight = reached.double()
        observed = torch.zeros(num_reqs, depth, CELLS, dtype=torch.float64,
                               device=targets.device)
        observed[:, :width].scatter_(2, cell[:, :, None], weight[:, :, None])
        predicted = torch.zeros_like(observed)
        predicted[:, :width] = tops.probs[:, :width].double() * weight[:, :, None]
        kind = sampled.long()
        self.observed.mul_(self.decay).index_add_(0, kind, observed)
        self.predicted.mul_(self.decay).index_add_(0, kind, predicted)
