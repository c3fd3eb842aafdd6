"""Tree budget policies (vllm_ddtree/budget.py) on synthetic cost curves and node scores.

Oracles: hand-computed optima (exact expected values), and brute force over every vector of
per-request budgets (each request's tree is a prefix of its best-first list).
"""

import itertools
import math

import pytest
import torch

from vllm_ddtree.budget import (
    SCORE_BINS,
    Calibration,
    CostModel,
    TablePolicy,
    _interpolate,
    auto_budgets,
    node_gains,
    score_bins,
)


def linear_cost(per_token: float, base: float, draft: float) -> CostModel:
    """T_verify(n) = base + per_token * n (two points define the line), T_draft = draft."""
    return CostModel((1, 1001), (base + per_token, base + 1001 * per_token), (1,), (draft,))


def test_interpolation_and_extrapolation():
    xs, ys = torch.tensor([1.0, 5.0, 9.0]), torch.tensor([2.0, 10.0, 12.0])
    got = _interpolate(torch.tensor([0.0, 3.0, 5.0, 7.0, 13.0]), xs.double(), ys.double())
    assert got.tolist() == [0.0, 6.0, 10.0, 11.0, 14.0]
    cost = CostModel((1, 5), (2.0, 10.0), (1, 3), (1.0, 2.0))
    assert cost.verify_time(torch.tensor([3.0])).item() == 6.0
    assert cost.draft_time(2) == 1.5 and cost.draft_time(5) == 3.0


def test_docstring_example_plain_decoding_wins():
    gains = torch.tensor([[0.9, 0.5], [0.6, 0.1]], dtype=torch.float64)
    # T_verify(n) = n ms, T_draft = 1 ms: the best tree step is k = 1 at 2.9 / 4 = 0.725
    # tokens per ms, below plain decoding's 2 / 2 = 1
    cost = CostModel((1, 2), (1e-3, 2e-3), (1,), (1e-3,))
    assert auto_budgets(gains, cost).tolist() == [0, 0]
    # when the measured rates decide whether to draft: the best tree step, k = 1
    assert auto_budgets(gains, cost, versus_plain=False).tolist() == [1, 0]
    # free verification (weight-bound): every node with a gain pays
    flat = CostModel((1, 1000), (10e-3, 10e-3), (1,), (1e-3,))
    assert auto_budgets(gains, flat).tolist() == [2, 2]


def test_knee_in_the_cost_curve():
    """Verification is free up to 4 tokens, then 1 ms a token: k = 2 (the first knee) wins.
    Rates: k = 0..4 -> (2 + [0, .9, 1.5, 2.1, 2.2]) / ([4, 4, 4, 5, 6] + 1) tokens/ms."""
    gains = torch.tensor([[0.9, 0.6], [0.6, 0.1]], dtype=torch.float64)
    cost = CostModel((1, 4, 5), (4e-3, 4e-3, 5e-3), (1,), (1e-3,))
    budgets = auto_budgets(gains, cost)
    # k = 2: nodes .9 (request 0) and the first .6 (request 0, earlier in the tie order)
    assert budgets.tolist() == [2, 0]
    rate = [(2 + s) / (t + 1) for s, t in zip([0, .9, 1.5, 2.1, 2.2], [4, 4, 4, 5, 6])]
    assert max(range(5), key=rate.__getitem__) == 2


def step_rate(gains: torch.Tensor, cost: CostModel, budgets, node_cost=None,
              overheads=(0.0, 0.0)) -> float:
    """Expected tokens per second of a step with these per-request budgets (each request's
    nodes also cost ``node_cost[r]`` seconds each; ``overheads``: seconds a drafting step and a
    plain step take beyond the model); all zero: plain decoding, no drafter."""
    num_reqs = gains.shape[0]
    if not any(budgets):
        return num_reqs / (cost.verify_time(torch.tensor([float(num_reqs)])).item()
                           + overheads[1])
    tokens = num_reqs + sum(gains[r, :b].sum().item() for r, b in enumerate(budgets))
    time = (cost.verify_time(torch.tensor([float(num_reqs + sum(budgets))])).item()
            + cost.draft_time(num_reqs) + overheads[0])
    if node_cost is not None:
        time += sum(c * b for c, b in zip(node_cost, budgets))
    return tokens / time


def brute_force(gains: torch.Tensor, cost: CostModel, node_cost=None,
                overheads=(0.0, 0.0)) -> float:
    """The best :func:`step_rate` over every per-request budget vector."""
    num_reqs, width = gains.shape
    return max(step_rate(gains, cost, budgets, node_cost, overheads)
               for budgets in itertools.product(range(width + 1), repeat=num_reqs))


def random_case(seed: int):
    """3 requests x 4 nodes of best-first gains (non-increasing along each row), a cost curve
    flat up to a random knee, and per-request node costs (0 for ~40 % of the requests)."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs, width = 3, 4
    gains = torch.rand(num_reqs, width, generator=gen, dtype=torch.float64)
    gains = gains.sort(dim=1, descending=True).values * torch.rand(num_reqs, 1, generator=gen,
                                                                    dtype=torch.float64)
    knee = int(torch.randint(2, 12, (1,), generator=gen))
    per_token = float(torch.rand(1, generator=gen)) * 2e-3
    cost = CostModel((1, knee, knee + 100), (5e-3, 5e-3, 5e-3 + 100 * per_token), (1,),
                     (float(torch.rand(1, generator=gen)) * 4e-3 + 1e-4,))
    node_cost = (torch.rand(num_reqs, generator=gen, dtype=torch.float64) * 2e-3
                 * (torch.rand(num_reqs, generator=gen) < 0.6))
    return gains, cost, node_cost


@pytest.mark.parametrize("seed", range(12))
def test_auto_is_the_best_budget_vector(seed):
    gains, cost, _ = random_case(seed)
    budgets = auto_budgets(gains, cost).tolist()
    assert step_rate(gains, cost, budgets) == pytest.approx(brute_force(gains, cost), rel=1e-9)


@pytest.mark.parametrize("seed", range(12))
def test_auto_with_step_overheads_is_the_best_budget_vector(seed):
    """With the engine's learned overheads (seconds a drafting and a plain step take beyond
    the model), auto's budgets reach the best rate over every budget vector, with the
    overheads counted; and a drafting overhead never makes the trees smaller (it lowers each
    node's share of the step's cost)."""
    gains, cost, _ = random_case(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    overheads = tuple((torch.rand(2, generator=gen) * 1e-2).tolist())
    budgets = auto_budgets(gains, cost, *overheads).tolist()
    assert step_rate(gains, cost, budgets, overheads=overheads) == pytest.approx(
        brute_force(gains, cost, overheads=overheads), rel=1e-9)
    without = auto_budgets(gains, cost, versus_plain=False)
    more = auto_budgets(gains, cost, overheads[0], versus_plain=False)
    assert (more >= without).all(), (without, more)


def test_a_tie_takes_the_largest_tree_within_it_of_the_best():
    """One request, gains [.9, .5, .05], T_verify(n) = n ms, T_draft = 1 ms: k = 0..3 give
    (1 + [0, .9, 1.4, 1.45]) / ([1, 2, 3, 4] + 1) = [.5, .633, .6, .49] tokens per ms. The best
    is k = 1; within 6 % of it (.595) also k = 2, the largest; within 1 % only k = 1."""
    gains = torch.tensor([[0.9, 0.5, 0.05]], dtype=torch.float64)
    cost = CostModel((1, 4), (0.001, 0.004), (1,), (0.001,))
    assert auto_budgets(gains, cost, versus_plain=False).tolist() == [1]
    assert auto_budgets(gains, cost, versus_plain=False, tie=0.01).tolist() == [1]
    assert auto_budgets(gains, cost, versus_plain=False, tie=0.06).tolist() == [2]
    # the plain-decoding comparison is still the best tree's: 1 / 1 ms beats .633
    assert auto_budgets(gains, cost, tie=0.06).tolist() == [0]


def test_a_tie_never_takes_a_node_without_gain():
    """Nodes of gain 0 (a request without drafter context, nodes past a structured request's
    limit, padding) are never taken for a tie: on a nearly flat cost curve every extra row is
    within 1 % of the best rate, yet the request without gains gets no node."""
    gains = torch.tensor([[0.9, 0.5], [0.0, 0.0]], dtype=torch.float64)
    cost = CostModel((1, 100), (0.010, 0.010 + 99 * 1e-6), (1, 2), (0.001, 0.001))
    assert auto_budgets(gains, cost, versus_plain=False).tolist() == [2, 0]
    assert auto_budgets(gains, cost, versus_plain=False, tie=0.01).tolist() == [2, 0]
    # the same rows with a small gain are taken: the tie is about gains the model doubts
    gains[1] = torch.tensor([1e-4, 1e-5], dtype=torch.float64)
    assert auto_budgets(gains, cost, versus_plain=False).tolist() == [2, 0]
    assert auto_budgets(gains, cost, versus_plain=False, tie=0.01).tolist() == [2, 2]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("tie", [0.01, 0.05])
def test_a_tie_is_the_largest_prefix_of_the_ranking_within_it(seed, tie):
    """The oracle: every prefix of the nodes ranked by gain (ties: request, then node order),
    its rate written out (a drafting step: no nodes still runs the drafter); auto with ``tie``
    takes the largest prefix within ``tie`` of the best of them, so it is never worse than that
    share and never smaller than the best tree (which the other tests hold against every
    budget vector)."""
    gains, cost, _ = random_case(seed)
    num_reqs, width = gains.shape
    ranked = sorted(range(num_reqs * width), key=lambda i: (-gains.flatten()[i].item(), i))
    prefixes, rates = [], []
    for k in range(len(ranked) + 1):
        budgets = [0] * num_reqs
        for i in ranked[:k]:
            budgets[i // width] += 1
        prefixes.append(budgets)
        rates.append(step_rate(gains, cost, budgets) if k else num_reqs / (
            cost.verify_time(torch.tensor([float(num_reqs)])).item()
            + cost.draft_time(num_reqs)))
    best = max(rates)
    want = max(k for k, rate in enumerate(rates) if rate >= (1 - tie) * best * (1 - 1e-12))
    got = auto_budgets(gains, cost, versus_plain=False, tie=tie).tolist()
    assert got == prefixes[want], (got, prefixes[want])
    assert rates[want] >= (1 - tie) * best * (1 - 1e-12)
    assert sum(got) >= sum(auto_budgets(gains, cost, versus_plain=False).tolist())


def test_a_step_overhead_gives_deeper_trees():
    """One request, a node worth 0.09 tokens at 1 ms a verify row on a 10 ms step: not worth
    it by the model alone (1.09 / 11 ms < 1 / 10 ms); with 10 ms of overhead every step
    (vLLM's own work, the same whatever the tree) it is (1.09 / 21 ms > 1 / 20 ms)."""
    gains = torch.tensor([[0.09]], dtype=torch.float64)
    cost = CostModel((1, 2), (0.010, 0.011), (1,), (1e-9,))
    assert auto_budgets(gains, cost, versus_plain=False).tolist() == [0]
    assert auto_budgets(gains, cost, 0.010, versus_plain=False).tolist() == [1]


@pytest.mark.parametrize("seed", range(40))
def test_auto_with_node_costs_is_the_best_budget_vector(seed):
    """Requests whose nodes cost extra host time (structured outputs' grammar work): auto's
    budgets reach the best rate over every budget vector (with the costs counted)."""
    gains, cost, node_cost = random_case(seed)
    budgets = auto_budgets(gains, cost, node_cost=node_cost).tolist()
    costs = node_cost.tolist()
    assert step_rate(gains, cost, budgets, costs) == pytest.approx(
        brute_force(gains, cost, costs), rel=1e-9)


def test_score_bins_are_unit_wide_in_log_probability():
    scores = torch.tensor([0.0, -0.5, -1.0, -1.5, -4.99, -5.0, -30.0, float("-inf")])
    assert score_bins(scores).tolist() == [0, 0, 1, 1, 4, 5, 5, 5]
    assert SCORE_BINS == 6


def test_node_gains_apply_the_calibration_of_their_depth_and_score_bin():
    # q .5 (bin 0) at depth 1, q .25 (bin 1) and q .01 (bin 4) at depth 2, padding
    scores = torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.01), float("-inf")]])
    depths = torch.tensor([[1, 2, 2, 0]])
    factors = torch.ones(2, 2, SCORE_BINS, dtype=torch.float64)
    factors[0, 0, 0], factors[0, 1, 1], factors[0, 1, 4] = 1.0, 0.5, 3.0
    factors[1] = 2.0
    greedy = node_gains(scores, depths, factors, torch.tensor([False]))
    assert greedy[0].tolist() == pytest.approx([0.5, 0.125, 0.03, 0.0], rel=1e-6)
    sampled = node_gains(scores, depths, factors, torch.tensor([True]))
    assert sampled[0].tolist() == pytest.approx([1.0, 0.5, 0.02, 0.0], rel=1e-6)


def test_calibration_counts_each_node_in_its_depth_and_score_bin():
    cal = Calibration(depth=2, device=torch.device("cpu"), decay=1.0, prior=0.0)
    # two greedy trees: depth 1 nodes .6 (bin 0) and .3 (bin 1), depth 2 node .2 (bin 1, a
    # child of the .6 node); the first tree accepts its .6 node, the second its .3 node
    scores = torch.tensor([[0.6, 0.3, 0.2], [0.6, 0.3, 0.2]]).log()
    depths = torch.tensor([[1, 1, 2], [1, 1, 2]])
    accepted = torch.tensor([[0, -1], [1, -1]])
    cal.observe(scores, depths, accepted, counted=torch.tensor([True, True]),
                sampled=torch.tensor([False, False]))
    # a third row that is not counted (a chain fallback) changes nothing
    cal.observe(scores[:1], depths[:1], torch.tensor([[0, 2]]), counted=torch.tensor([False]),
                sampled=torch.tensor([False]))
    factors = cal.factors()
    assert factors[0, 0, 0].item() == pytest.approx(1 / 1.2)  # one of two .6 nodes
    assert factors[0, 0, 1].item() == pytest.approx(1 / 0.6)  # one of two .3 nodes
    assert factors[0, 1, 1].item() == pytest.approx(0.0)  # no depth-2 node accepted
    assert torch.isnan(factors[0, 0, 2:]).all()  # empty cells, no prior: 0 / 0
    assert torch.isnan(factors[1]).all()  # no sampled evidence
    # with a prior, empty cells are 1 and evidence pulls the factor from it
    cal = Calibration(depth=2, device=torch.device("cpu"), decay=1.0, prior=1.0)
    cal.observe(scores, depths, accepted, counted=torch.tensor([True, True]),
                sampled=torch.tensor([False, False]))
    assert cal.factors()[0, 0, 0].item() == pytest.approx(2 / 2.2)
    assert cal.factors()[0, 0, 3].item() == 1.0


def test_table_policy_rows():
    table = TablePolicy([[4, 64], [16, 16], [256, 0]])
    assert [table.budget(n) for n in (1, 4, 5, 16, 17, 256)] == [64, 64, 16, 16, 0, 0]


def test_cost_model_validation():
    with pytest.raises(ValueError, match="must increase"):
        CostModel((4, 2), (1.0, 2.0), (1,), (1.0,))
    with pytest.raises(ValueError, match="positive"):
        CostModel((1,), (0.0,), (1,), (1.0,))


def test_node_costs_take_nodes_from_the_requests_that_pay_for_them():
    """Free verification (10 ms whatever the rows), 1 ms of drafter: every plain node pays.
    A request whose nodes cost 1 ms each still gets both (rates 3.4/11, 4.3/12, 4.8/13 tokens
    per ms), at 5 ms each none (4.3/16 < 3.4/11): the other request keeps its two."""
    gains = torch.tensor([[0.9, 0.5], [0.9, 0.5]], dtype=torch.float64)
    flat = CostModel((1, 1000), (10e-3, 10e-3), (1,), (1e-3,))
    assert auto_budgets(gains, flat, node_cost=torch.tensor([1e-3, 0.0])).tolist() == [2, 2]
    assert auto_budgets(gains, flat, node_cost=torch.tensor([5e-3, 0.0])).tolist() == [0, 2]
    assert auto_budgets(gains, flat, node_cost=torch.zeros(2)).tolist() == \
        auto_budgets(gains, flat).tolist()
