"""Tree budgets per request and step: static, a batch-size table, or cost-aware ("auto").

A request's tree is its first b nodes in best-first order (any prefix is a subtree). Node i
has score ``s_i = log q(path to i)``: the path's estimated acceptance, calibrated per depth and
drafter rank where the trees are (``vllm_ddtree.calibration``), else the drafter's factorised
surrogate; by DDTree's Prop. 1 the expected accepted length of a tree is the sum over its nodes
of the probability of each node's path. That estimate is still off, differently at each depth
and each level of probability (the tiny pair's drafter, uncalibrated: its likeliest paths about
right, the paths of probability e^-5 to e^-3 accepted 1.6-6.7x more often than it says), so
the **gain** of a node at
depth d with score s is ``g = c_{d,b} * exp(s)``, ``b = bin(s)`` (:func:`score_bins`), where
the calibration ``c_{d,b}`` is the ratio of the acceptances actually observed for such nodes to
the drafter's predictions for them (:class:`Calibration`, running on the device).

"auto" (:func:`auto_budgets`) maximises the expected emitted tokens per second of a step: with
R requests and k verified nodes in all, a step emits ``R + S_k`` tokens (``S_k``: the gains of
the k nodes) and costs ``T_verify(R + k) + T_draft(R)`` (:class:`CostModel`, measured by the
engine) plus the step's overhead beyond the forwards (learned online by the engine). The k
nodes of largest gain over ALL requests of the batch are taken, k chosen by an
exhaustive argmax over ``0 .. R * B`` (gains are sorted, so this is the best set of every size);
each request's budget is its number of nodes among them. Whether to draft at all is a second
question: until the engine has measured both kinds of step in this regime, the model answers it
(if even the best k emits fewer tokens per second than not drafting at all, ``R / T_verify(R)``:
a plain decoding step, no drafter, every budget is 0 and the drafter should pause); after that
the measured rates answer it (``plugin/policy.py``) and the budgets are the best trees given
that the drafter runs. Everything runs on the device with fixed shapes: no host
synchronisation.

No vLLM imports here; the plugin measures the costs and feeds the calibration.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from vllm_ddtree.kernels.native import cpu_ops

__all__ = ["CostModel", "Calibration", "SCORE_BINS", "TablePolicy", "auto_budgets",
           "budget_function", "score_bins"]


def _interpolate(x: torch.Tensor, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear ``y(x)`` through ``(xs, ys)`` (xs increasing), extended linearly past
    both ends by the first and last segments. Example: xs [1, 5], ys [2, 10]: y(3) = 6, y(9) = 18.
    """
    if xs.numel() == 1:
        return ys[0].expand_as(x).to(torch.float64)
    x = x.to(torch.float64)
    seg = (torch.searchsorted(xs, x.contiguous(), right=True) - 1).clamp(0, xs.numel() - 2)
    x0, x1, y0, y1 = xs[seg], xs[seg + 1], ys[seg], ys[seg + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _interpolate_host(x: float, xs: tuple, ys: tuple) -> float:
    """:func:`_interpolate` for one value on the host (floored like the device version)."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    y = ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])
    return max(y, min(ys) * 1e-3)


@dataclass(frozen=True)
class CostModel:
    """Measured step costs, in seconds.

    ``verify_tokens`` / ``verify_seconds``: a target step that processes n tokens (its forward,
    the logits of every row and their sampling), at increasing token counts. ``draft_requests``
    / ``draft_seconds``: the drafter's pass and the tree build for R requests. Between the
    measured points costs are interpolated linearly (and extrapolated by the end segments).
    """

    verify_tokens: tuple[int, ...]
    verify_seconds: tuple[float, ...]
    draft_requests: tuple[int, ...]
    draft_seconds: tuple[float, ...]

    def __post_init__(self):
        for xs, ys, name in ((self.verify_tokens, self.verify_seconds, "verify"),
                             (self.draft_requests, self.draft_seconds, "draft")):
            if not xs or len(xs) != len(ys):
                raise ValueError(f"{name}: {len(xs)} points and {len(ys)} times; need >= 1 each")
            if any(b <= a for a, b in zip(xs, xs[1:])):
                raise ValueError(f"{name} points must increase, got {xs}")
            if any(not y > 0 for y in ys):
                raise ValueError(f"{name} times must be positive, got {ys}")

    def _on_device(self, name: str, device: torch.device, make) -> tuple[torch.Tensor, ...]:
        """``make()``'s tensors on ``device``, made once and kept under ``name``, under the
        device asked for and the one its tensors report ("cuda" is "cuda:0" there): a step's
        lookup by a tensor's device finds what :meth:`upload` put there."""
        cache = self.__dict__.setdefault(name, {})
        if device not in cache:
            made = make()
            cache[device] = cache[made[0].device] = made
        return cache[device]

    def _points(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The verify curve on ``device``, uploaded once (no per-step host-to-device copy)."""
        return self._on_device("_device_points", device, lambda: (
            torch.tensor(self.verify_tokens, dtype=torch.float64).to(device),
            torch.tensor(self.verify_seconds, dtype=torch.float64).to(device)))

    def empty(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Empty float64, int64 and bool tensors on ``device`` (the fused op's "none" inputs),
        made once: a step's budget function does not allocate them."""
        return self._on_device("_device_empty", device, lambda: tuple(
            torch.empty(0, dtype=dtype, device=device)
            for dtype in (torch.float64, torch.int64, torch.bool)))

    def verify_time(self, num_tokens: torch.Tensor) -> torch.Tensor:
        """Seconds of a target step of ``num_tokens`` tokens (any shape, float64, on its device)."""
        xs, ys = self._points(num_tokens.device)
        return _interpolate(num_tokens, xs, ys).clamp(min=min(self.verify_seconds) * 1e-3)

    def upload(self, device: torch.device) -> None:
        """Put the curve on ``device`` now (engine start), so serving never copies it."""
        self._points(torch.device(device))

    def draft_time(self, num_requests: int) -> float:
        """Seconds of the drafter and the tree build for ``num_requests`` requests (host)."""
        return self._host("draft", num_requests, self.draft_requests, self.draft_seconds)

    def verify_time_host(self, num_tokens: int) -> float:
        """:meth:`verify_time` on the host, for one token count."""
        return self._host("verify", num_tokens, self.verify_tokens, self.verify_seconds)

    def _host(self, curve: str, x: int, xs: tuple, ys: tuple) -> float:
        """A host interpolation, remembered per (curve, x): the runner asks every step, for
        the few batch shapes its traffic has."""
        cache = self.__dict__.setdefault("_host_points", {})
        key = (curve, x)
        if key not in cache:
            cache[key] = _interpolate_host(x, xs, ys)
        return cache[key]

    def to_dict(self) -> dict:
        return {k: list(getattr(self, k)) for k in
                ("verify_tokens", "verify_seconds", "draft_requests", "draft_seconds")}


SCORE_BINS = 6  # score bins of the calibration: s in [-1, 0], [-2, -1), ..., below -5


def score_bins(scores: torch.Tensor) -> torch.Tensor:
    """The calibration's bin of each path log-probability: ``min(floor(-s), SCORE_BINS - 1)``
    (int64, same shape), so unit-wide bins in natural log: q >= 1/e is bin 0, q in
    [e^-2, e^-1) bin 1, ..., q < e^-5 bin 5. Padding (-inf) lands in the last bin."""
    return (-scores).floor().clamp(0, SCORE_BINS - 1).long()


class Calibration:
    """Calibration of the drafter's path probabilities per depth and score bin, on the device.

    For every verified tree (rows whose drafts were the recorded proposal), each node at depth
    d with score s predicts ``exp(s)`` acceptances of its path, and counts one if the walk
    accepted it; both go to the cell ``(d, score_bins(s))``. Running sums decay by ``decay``
    per update, and ``c_{d,b} = (observed + prior) / (predicted + prior)``: 1 until evidence
    says otherwise. Greedy and sampled requests are calibrated separately (row 0: greedy, row
    1: sampled; the walk at T > 0 accepts less than at T = 0). A per-depth ratio alone weighed
    each node by its probability, so the likeliest paths set every node's factor; the tiny
    pair's drafter is about right on its likeliest paths and 1.6-6.7x too pessimistic on its
    paths of probability e^-5 to e^-3 (``benchmarks/calibration.py``; docs/measurements.md,
    "The tree rows' attention in AVX2, fused top-k and argmax, auto re-priced"), which auto
    then did not draft.
    Example: depth-1 nodes of probability .6 (bin 0) and .3 (bin 1) in two trees, the .6 one
    accepted once: with no prior, c_{1,0} = 1 / 1.2 = 0.83 and c_{1,1} = 0 / 0.6 = 0.
    """

    def __init__(self, depth: int, device: torch.device, decay: float = 0.99,
                 prior: float = 1.0):
        self.depth = depth
        self.decay = decay
        self.prior = prior
        self.predicted = torch.zeros(2, depth, SCORE_BINS, dtype=torch.float64, device=device)
        self.observed = torch.zeros(2, depth, SCORE_BINS, dtype=torch.float64, device=device)

    def factors(self) -> torch.Tensor:
        """``[2, L, SCORE_BINS]`` float64: c_{d,b} for greedy (row 0) and sampled (row 1)
        requests."""
        return (self.observed + self.prior) / (self.predicted + self.prior)

    def observe(self, scores: torch.Tensor, depths: torch.Tensor, accepted_nodes: torch.Tensor,
                counted: torch.Tensor, sampled: torch.Tensor) -> None:
        """Fold in one verify step.

        Args:
            scores: ``[R, B]`` log q of each node's path (-inf for padding).
            depths: ``[R, B]`` node depths, 0 for padding.
            accepted_nodes: ``[R, L']`` int64 the accepted nodes of each request (the walk's
                :attr:`TreeVerdict.accepted_nodes`), -1 padded.
            counted: ``[R]`` bool, the rows to count (trees that were the drafter's proposal).
            sampled: ``[R]`` bool, the request samples (T > 0).
        """
        ops = cpu_ops(scores.device)
        if ops is not None:  # the fused CPU kernel: one op
            ops.calibration_observe_(self.predicted, self.observed, scores.contiguous(),
                                     depths.contiguous(), accepted_nodes.contiguous(),
                                     counted.contiguous(), sampled.contiguous(), self.decay)
            return
        num_reqs, width = scores.shape
        cells = self.depth * SCORE_BINS
        # each node's cell (d - 1) * SCORE_BINS + bin; padding to an extra cell, dropped
        real = depths > 0
        cell = torch.where(real, (depths.clamp(1, self.depth) - 1) * SCORE_BINS
                           + score_bins(scores), cells)
        accepted = torch.zeros(num_reqs, width + 1, dtype=torch.float64, device=scores.device)
        accepted.scatter_(1, torch.where(accepted_nodes >= 0, accepted_nodes, width), 1.0)
        weight = counted.double()[:, None]
        predicted = torch.zeros(num_reqs, cells + 1, dtype=torch.float64, device=scores.device)
        predicted.scatter_add_(1, cell, scores.double().exp().masked_fill(~real, 0.0) * weight)
        observed = torch.zeros_like(predicted)
        observed.scatter_add_(1, cell, accepted[:, :width] * weight)
        kind = sampled.long()
        shape = (num_reqs, self.depth, SCORE_BINS)
        self.predicted.mul_(self.decay).index_add_(0, kind, predicted[:, :cells].view(shape))
        self.observed.mul_(self.decay).index_add_(0, kind, observed[:, :cells].view(shape))


def node_gains(scores: torch.Tensor, depths: torch.Tensor, factors: torch.Tensor,
               sampled: torch.Tensor) -> torch.Tensor:
    """``[R, B]`` calibrated gain ``c_{d,bin(s)} * exp(s)`` of every node, 0 for padding."""
    rows = factors[sampled.long()].flatten(1)  # [R, L * SCORE_BINS]
    cell = (depths - 1).clamp(min=0) * SCORE_BINS + score_bins(scores)
    c = rows.gather(1, cell)
    return torch.where(depths > 0, c * scores.double().exp(), 0.0)


def auto_budgets(gains: torch.Tensor, cost: CostModel, on_overhead: float = 0.0,
                 off_overhead: float = 0.0, versus_plain: bool = True,
                 node_cost: torch.Tensor | None = None, tie: float = 0.0) -> torch.Tensor:
    """Per-request budgets ``[R]`` int64 that maximise the expected tokens per second of a step
    (or, with ``tie``, the largest within ``tie`` of the best).

    Args:
        gains: ``[R, B]`` calibrated node gains in each request's best-first order (non-
            increasing along a row; 0 for padding).
        cost: the step cost model.
        on_overhead, off_overhead: seconds that a step which drafted, and one which did not,
            takes beyond the model's prediction (the engine's online correction, >= 0: vLLM's
            scheduling and input preparation, which the start-up measurement of forwards does
            not see and which no node adds to; 0 = trust the model).
        versus_plain: compare the best tree step with plain decoding (the model decides
            whether to draft at all); False when the engine's measured rates decide that, so
            the budgets are the best trees given that the drafter runs.
        node_cost: ``[R]`` float64 seconds that each node of request r adds to the step
            besides its verify row (the scheduler's grammar work for a structured-output
            request), or None. Taking a node then adds its cost to the step time, and the
            nodes are ranked twice: by gain per cost, ``g * s / (s + c_r)`` with ``s`` the
            step curve's mean slope per node, then by ``g - lam * c_r`` with ``lam`` the best
            rate of the first ranking (a Dinkelbach step); the better of the two wins. Both
            keep each request's best-first order.
        tie: 0, the best k; > 0, the largest k whose expected rate is at least ``1 - tie``
            of the best one's, among the prefixes of nodes with a gain (auto's ``TREE_TIE``:
            the nodes the model is unsure of, the trees' tails, are kept where they cost at
            most that share by its own reckoning; a node of gain 0 is never one of them).

    The nodes of all requests are ranked by gain (ties: request, then node order); taking the
    first k costs ``T_verify(R + k) + T_draft(R) + on_overhead`` and emits ``R + S_k`` tokens in
    expectation. The best k wins (with ``versus_plain``, the best k >= 1: a step without nodes
    is plain decoding's), unless ``versus_plain`` and ``R / (T_verify(R) + off_overhead)`` (no
    drafter at all) is at least as good: then every budget is 0. A request's budget is its
    number of nodes among the first k, a prefix of its best-first list, hence a subtree.

    Example: two requests with gains [[.9, .5], [.6, .1]], T_verify(n) = n ms, T_draft = 1 ms:
    k = 0..4 give (2 + [0, .9, 1.5, 2.0, 2.1]) / ([2, 3, 4, 5, 6] + 1) tokens per ms =
    [.67, .73, .70, .67, .59]: k = 1, budgets [1, 0]; plain decoding gives 2 / 2 = 1 token
    per ms, better still, so both budgets are 0 (with ``versus_plain=False``: [1, 0]).
    """
    num_reqs, width = gains.shape
    device = gains.device
    flat = gains.flatten()
    k = torch.arange(num_reqs * width + 1, device=device)
    step_time = cost.verify_time(num_reqs + k) + cost.draft_time(num_reqs) + on_overhead

    def best_prefix(key: torch.Tensor, per_node: torch.Tensor | None):
        """(order of the nodes by ``key``, best k, its rate)."""
        order = torch.sort(key, descending=True, stable=True).indices  # [R * B]
        taken = torch.cat([flat.new_zeros(1), flat[order].cumsum(0)])  # S_0 .. S_{R*B}
        time = step_time
        if per_node is not None:
            time = step_time + torch.cat([flat.new_zeros(1), per_node[order].cumsum(0)])
        rate = (num_reqs + taken) / time
        if versus_plain and rate.numel() > 1:  # no nodes is plain decoding's step, priced below
            rate = torch.cat([rate.new_full((1,), float("-inf")), rate[1:]])
        best, keep = rate.max(), rate.argmax()
        if tie > 0.0:  # the largest k within tie of the best (device ops: no sync), over
            # nodes that have a gain: none of a request without drafter context, past its
            # limit, or padding
            with_gain = (flat[order] > 0).cumprod(0).sum()  # the leading nodes with a gain
            within = (rate >= (1.0 - tie) * best) & (k <= with_gain)
            keep = torch.maximum(torch.where(within, k, 0).max(), keep)
        return order, keep, best

    if node_cost is None or not flat.numel():
        order, keep, best = best_prefix(flat, None)
    else:
        per_node = node_cost.to(torch.float64)[:, None].expand(num_reqs, width).flatten()
        slope = ((step_time[-1] - step_time[0]) / flat.numel()).clamp(min=1e-12)
        order, keep, best = best_prefix(flat * slope / (slope + per_node), per_node)
        # one Dinkelbach step: at the best rate lam, the best k nodes are those of largest
        # g - lam * c (exact in every brute-force check of tests/test_budget.py)
        order2, keep2, best2 = best_prefix(flat - best * per_node, per_node)
        better = best2 > best
        order = torch.where(better, order2, order)
        keep, best = torch.where(better, keep2, keep), torch.maximum(best, best2)
    if versus_plain:
        plain = num_reqs / (cost.verify_time_host(num_reqs) + off_overhead)
        keep = torch.where(best > plain, keep, 0)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=device)
    chosen = (rank < keep).view(num_reqs, width)
    return chosen.sum(dim=1)


class FusedAutoBudgets:
    """auto's budget function on the CPU (:func:`budget_function`). Called with a tree's
    ``(scores, depths)`` it is one fused op (``torch.ops.ddtree.auto_budgets``), and
    :func:`vllm_ddtree.tree.build_tree` gets the cut trees from :meth:`build_budgeted`: the
    full-width trees, this function and the cut to its budgets in one op, not three."""

    def __init__(self, ops, args: tuple):
        self._ops, self._args = ops, args  # the op's inputs after (scores, depths)

    def __call__(self, scores: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        return self._ops.auto_budgets(scores.contiguous(), depths.contiguous(), *self._args)

    def build_budgeted(self, values: torch.Tensor, token_ids: torch.Tensor, max_budget: int):
        """``torch.ops.ddtree.build_tree``'s fields for ranked ``values`` / ``token_ids``
        ``[R, L, k]``, each tree cut to the budget this function gives its full-width tree
        (``torch.ops.ddtree.build_tree_auto``)."""
        return self._ops.build_tree_auto(values, token_ids, max_budget, *self._args)


def budget_function(cost: CostModel, calibration: Calibration, sampled: torch.Tensor,
                    complete: torch.Tensor | None = None, on_overhead: float = 0.0,
                    off_overhead: float = 0.0, versus_plain: bool = True,
                    node_cost: torch.Tensor | None = None, limit: torch.Tensor | None = None,
                    tie: float = 0.0):
    """auto's ``build_tree`` budget for one step: ``fn(scores, depths) -> [R]`` budgets from
    the calibrated node gains (:func:`node_gains`) and the step cost model
    (:func:`auto_budgets`). ``sampled``: ``[R]`` bool, requests with T > 0; ``complete``:
    ``[R]`` bool or None, requests whose drafter context is complete (the others get no
    nodes); ``node_cost`` (``[R]`` float64 seconds, see :func:`auto_budgets`) and ``limit``
    (``[R]`` int64, the most nodes each request can send: gains past it count 0), both or
    neither; ``tie``: see :func:`auto_budgets`. On the CPU the whole function is one fused op
    (``torch.ops.ddtree.auto_budgets``, :class:`FusedAutoBudgets`).
    """
    num_reqs = sampled.shape[0]
    ops = cpu_ops(sampled.device)
    if ops is not None:
        xs, ys = cost._points(sampled.device)
        plain_time = cost.verify_time_host(num_reqs) + off_overhead if versus_plain else 0.0
        draft_time = cost.draft_time(num_reqs)
        none_f64, none_i64, none_bool = cost.empty(sampled.device)
        costs = (none_f64, none_i64) if node_cost is None else (node_cost, limit)
        return FusedAutoBudgets(ops, (
            calibration.predicted, calibration.observed, calibration.prior, sampled,
            # an empty mask: every request's context is complete
            none_bool if complete is None else complete.contiguous(), xs, ys, draft_time,
            on_overhead, plain_time, *costs, tie))
    factors = calibration.factors()

    def budgets(scores: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        gains = node_gains(scores, depths, factors, sampled)
        if complete is not None:
            gains = gains * complete[:, None]
        if limit is not None:
            index = torch.arange(gains.shape[1], device=gains.device)
            gains = gains * (index[None, :] < limit[:, None])
        return auto_budgets(gains, cost, on_overhead=on_overhead, off_overhead=off_overhead,
                            versus_plain=versus_plain, node_cost=node_cost, tie=tie)

    return budgets


class TablePolicy:
    """``[[max_running_requests, budget], ...]``: the first row whose bound covers the step's
    number of requests gives every request its budget (like vLLM's dynamic speculation length).

    Example: ``[[4, 64], [16, 16], [256, 0]]``: 1-4 requests draft 64 nodes each, 5-16 draft
    16, 17-256 none.
    """

    def __init__(self, rows: list[list[int]]):
        self.bounds = [int(bound) for bound, _ in rows]
        self.budgets = [int(budget) for _, budget in rows]

    def budget(self, num_requests: int) -> int:
        i = bisect.bisect_left(self.bounds, num_requests)
        return self.budgets[min(i, len(self.budgets) - 1)]
