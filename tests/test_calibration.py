"""Calibrated trees (vllm_ddtree/calibration.py): the tree is the top-B prefixes by calibrated
acceptance.

Oracles: brute-force enumeration of every prefix with the calibrated conditionals computed
here from their definition (float64, per depth: rank the tokens, then
``q'_r = min(c_cell(r) q_r, q'_{r-1}, 1)``), DDTree's tree itself for a calibration without
evidence, counts written out by hand for the calibration's updates, and a simulated drafter
whose first choice the target always takes.
"""

import itertools
import math

import pytest
import torch

from vllm_ddtree.calibration import (
    CELLS,
    TOP_RANKS,
    DraftTops,
    TreeCalibration,
    calibrated_values,
    draft_tops,
)
from vllm_ddtree.tree import build_tree

TREE_FIELDS = ("token_ids", "parents", "depths", "scores", "num_nodes", "ancestor_mask")


def _conditionals(logits: torch.Tensor, factors: torch.Tensor) -> list[dict[int, float]]:
    """Per depth, token -> calibrated conditional q', from the definition (float64)."""
    out = []
    for d in range(logits.shape[0]):
        q = torch.softmax(logits[d].double(), -1).tolist()
        order = sorted(range(len(q)), key=lambda t: (-q[t], t))
        best, cond = 1.0, {}
        for rank, token in enumerate(order):
            best = min(float(factors[d, min(rank, TOP_RANKS)]) * q[token], best, 1.0)
            cond[token] = best
        out.append(cond)
    return out


def _paths(tree, r: int) -> list[tuple]:
    paths = []
    for k in range(int(tree.num_nodes[r])):
        p = int(tree.parents[r, k])
        paths.append((paths[p] if p >= 0 else ()) + (int(tree.token_ids[r, k]),))
    return paths


def test_calibrated_values_example_and_no_evidence():
    """The docstring's example; log-factors 0 give the drafter's values back, bit for bit."""
    values = torch.tensor([[[0.52, 0.47, 0.01]]]).log()
    ids = torch.tensor([[[4, 2, 9]]])
    factors = torch.tensor([[[1.9, 0.1, 1.0, 1.0]]]).log()
    got, got_ids = calibrated_values(values, ids, factors)
    assert got.exp().tolist()[0][0] == pytest.approx([0.988, 0.047, 0.01], abs=1e-6)
    assert got_ids.tolist() == [[[4, 2, 9]]]
    same, same_ids = calibrated_values(values, ids, torch.zeros(1, 1, CELLS))
    assert torch.equal(same, values) and torch.equal(same_ids, ids)


def test_calibrated_values_are_capped_monotone_and_ranked_by_id_on_ties():
    """Values stay <= 0 and non-increasing along a row; a lower rank lifted above a better one
    is held at the better one's value, and the tie goes by token id."""
    values = torch.tensor([[[0.5, 0.3, 0.2]]]).log()
    ids = torch.tensor([[[7, 3, 5]]])
    factors = torch.tensor([[[3.0, 4.0, 1.0, 1.0]]]).log()  # 1.5 -> 1, 1.2 -> 1: a tie
    got, got_ids = calibrated_values(values, ids, factors)
    assert got.exp().tolist()[0][0] == pytest.approx([1.0, 1.0, 0.2])
    assert got_ids.tolist() == [[[3, 7, 5]]]  # the tie at 1: token 3 before token 7
    gen = torch.Generator().manual_seed(3)
    raw = torch.log_softmax(torch.randn(4, 5, 30, generator=gen) * 2, -1)
    ranked, order = raw.sort(-1, descending=True)
    got, _ = calibrated_values(ranked, order, torch.randn(4, 5, CELLS, generator=gen))
    assert (got <= 0).all() and (got[..., 1:] <= got[..., :-1]).all()


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("vocab,depth", [(2, 4), (3, 3), (5, 2), (4, 3)])
def test_calibrated_tree_is_the_brute_force_top_b(native, vocab, depth, monkeypatch):
    """For every budget the tree is a top-B set of prefixes by calibrated acceptance (the
    product of q' along the path), closed under parents, its scores the log of that value;
    on the fused CPU op and on the torch path."""
    monkeypatch.setenv("VLLM_DDTREE_NATIVE", native)
    gen = torch.Generator().manual_seed(vocab * 7 + depth)
    num_reqs = 3
    logits = torch.randn(num_reqs, depth, vocab, generator=gen) * 1.5
    factors = torch.rand(num_reqs, depth, CELLS, generator=gen, dtype=torch.float64) * 3 + 0.05
    factors[0] = 1.0  # no evidence: DDTree's own tree
    log_factors = factors.log().float()
    num_prefixes = sum(vocab ** d for d in range(1, depth + 1))
    for r in range(num_reqs):
        cond = _conditionals(logits[r], factors[r])
        value = {seq: math.prod(cond[i][t] for i, t in enumerate(seq))
                 for d in range(1, depth + 1) for seq in itertools.product(range(vocab), repeat=d)}
        ranked = sorted(value.values(), reverse=True)
        for budget in range(1, num_prefixes + 1):
            tree = build_tree(logits[r:r + 1], budget, calibration=log_factors[r:r + 1])
            paths = _paths(tree, 0)
            assert len(set(paths)) == budget
            assert all(p[:-1] in set(paths) or len(p) == 1 for p in paths)  # a subtree
            got = [value[p] for p in paths]
            assert sorted(got, reverse=True) == pytest.approx(ranked[:budget], rel=1e-4)
            outside = [v for p, v in value.items() if p not in set(paths)]
            assert max(outside, default=0.0) <= min(got) * (1 + 1e-4)
            assert tree.scores[0, :budget].double().exp().tolist() == pytest.approx(got,
                                                                                  rel=1e-4)
        if r == 0:  # factors of 1 are no calibration at all
            plain = build_tree(logits[:1], num_prefixes)
            for name in TREE_FIELDS:
                assert torch.equal(getattr(tree, name), getattr(plain, name)), name


def test_fused_op_and_torch_path_build_the_same_calibrated_tree(monkeypatch):
    """Same inputs, both CPU paths: the same trees (scores to float rounding) and the same
    tops, for an int budget, per-request budgets and a budget function."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 6, 80, generator=gen) * 2
    log_factors = (torch.rand(4, 6, CELLS, generator=gen) * 4 + 0.1).log()
    budgets = (32, torch.tensor([32, 0, 5, 17]),
               lambda scores, depths: (scores > -3).sum(dim=1))
    for budget in budgets:
        trees = []
        for native in ("1", "0"):
            monkeypatch.setenv("VLLM_DDTREE_NATIVE", native)
            trees.append(build_tree(logits, budget, max_budget=32, calibration=log_factors))
        fused, torch_path = trees
        for name in TREE_FIELDS:
            a, b = getattr(fused, name), getattr(torch_path, name)
            assert torch.equal(a, b) if name != "scores" else torch.allclose(a, b, atol=1e-5)
        assert torch.equal(fused.tops.token_ids, torch_path.tops.token_ids)
        assert torch.allclose(fused.tops.probs, torch_path.tops.probs)


def test_draft_tops_of_a_small_vocabulary():
    """Ranks past the vocabulary: token -1, probability 0; the last cell the rest's mass."""
    values = torch.tensor([[[0.7, 0.3]]]).log()
    tops = draft_tops(values, torch.tensor([[[5, 1]]]))
    assert tops.token_ids.tolist() == [[[5, 1, -1]]]
    assert tops.probs[0, 0].tolist() == pytest.approx([0.7, 0.3, 0.0, 0.0], abs=1e-6)


def test_observe_counts_by_hand():
    """The docstring's example, then a second request that samples: its step lands in row 1
    only; depths past the accepted path + 1 and uncounted requests add nothing."""
    cal = TreeCalibration(depth=2, device=torch.device("cpu"), decay=1.0)
    tops = DraftTops(token_ids=torch.tensor([[[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]],
                                             [[1, 2, 3], [4, 5, 6]]]),
                     probs=torch.tensor([[[.5, .3, .1, .1], [.6, .2, .1, .1]]] * 3))
    # request 0 (greedy): nothing accepted, target token 2 (rank 1) at depth 1
    # request 1 (sampled): token 1 accepted at depth 1, then 9 (no rank) at depth 2
    # request 2: not counted
    output = torch.tensor([[2, -1, -1], [1, 9, -1], [1, 4, 7]])
    cal.observe(tops, output, torch.tensor([0, 1, 2]), torch.tensor([True, True, False]),
                torch.tensor([False, True, False]))
    assert cal.observed[0].tolist() == [[0, 1, 0, 0], [0, 0, 0, 0]]
    assert torch.allclose(cal.predicted[0], torch.tensor([[.5, .3, .1, .1], [0, 0, 0, 0]],
                                                         dtype=torch.float64))
    assert cal.observed[1].tolist() == [[1, 0, 0, 0], [0, 0, 0, 1]]
    assert torch.allclose(cal.predicted[1], torch.tensor([[.5, .3, .1, .1], [.6, .2, .1, .1]],
                                                         dtype=torch.float64))
    assert cal.factors()[0, 0].tolist() == pytest.approx([1 / 1.5, 2 / 1.3, 1 / 1.1, 1 / 1.1])


def test_an_underconfident_drafter_that_is_always_right_gets_the_chain():
    """A drafter right at every depth with q ~ 0.52 (its second choice ~ 0.47): DDTree's tree
    of B = L nodes is bushy and shallow; after the calibration has seen the target take the
    first choice at every depth for a while, the tree of B = L nodes is the chain of first
    choices, and a wider tree keeps the chain as its first L nodes (never worse than it)."""
    depth, vocab, num_reqs = 7, 16, 4
    logits = torch.full((num_reqs, depth, vocab), -6.0)
    logits[..., 3], logits[..., 8] = 0.1, 0.0  # token 3 first (~.52), token 8 second (~.47)
    plain = build_tree(logits, depth)
    assert int(plain.depths.max()) <= 3
    cal = TreeCalibration(depth, torch.device("cpu"))
    greedy = torch.zeros(num_reqs, dtype=torch.bool)
    for _ in range(100):
        tree = build_tree(logits, depth, calibration=cal.log_factors(greedy))
        chain = torch.full((num_reqs, depth + 1), 3)  # the target takes token 3 everywhere
        cal.observe(tree.tops, chain, torch.full((num_reqs,), depth),
                    torch.ones(num_reqs, dtype=torch.bool), greedy)
    tree = build_tree(logits, depth, calibration=cal.log_factors(greedy))
    assert tree.depths.tolist() == [list(range(1, depth + 1))] * num_reqs
    assert (tree.token_ids == 3).all() and tree.parents[0].tolist() == list(range(-1, depth - 1))
    wide = build_tree(logits, 32, calibration=cal.log_factors(greedy))
    assert torch.equal(wide.token_ids[:, :depth], tree.token_ids)
    sampled = cal.log_factors(torch.ones(num_reqs, dtype=torch.bool))
    assert torch.equal(sampled, torch.zeros_like(sampled))  # sampled requests: no evidence yet


def test_build_tree_refuses_a_calibration_of_another_shape():
    with pytest.raises(ValueError, match="calibration.shape"):
        build_tree(torch.randn(2, 3, 10), 4, calibration=torch.zeros(2, 3, CELLS + 1))


def test_fused_ops_equal_their_torch_twins(monkeypatch):
    """The three fused CPU ops (kernels/csrc/ddtree_cpu.cpp) against the torch path on the same
    inputs: the factors of each request's kind, the calibrated lists with their tops (lists
    full of ties: ranks lifted to the cap, values held at a better rank's), and the update
    (random trees, outputs, counted and sampled rows, a decay)."""
    gen = torch.Generator().manual_seed(5)
    num_reqs, depth, k = 6, 5, 12
    values = torch.log_softmax(torch.randn(num_reqs, depth, 40, generator=gen) * 2, -1)
    values, ids = values.topk(k, dim=-1)
    values[0, 0, 3:6] = values[0, 0, 3]  # exact ties in the drafter's own values
    perm = torch.randperm(k, generator=gen)
    values, ids = values[..., perm], ids[..., perm]  # any order, as top-k leaves them
    output = torch.randint(0, 40, (num_reqs, depth + 1), generator=gen)
    output[:, 0] = ids[:, 0].gather(-1, values[:, 0].argmax(-1, keepdim=True))[:, 0]
    num_accepted = torch.tensor([0, 1, 2, 5, 3, 4])
    counted = torch.tensor([True, True, False, True, True, True])
    sampled = torch.tensor([False, True, True, False, False, True])
    results = []
    for native in ("1", "0"):
        monkeypatch.setenv("VLLM_DDTREE_NATIVE", native)
        cal = TreeCalibration(depth, torch.device("cpu"), decay=0.9)
        cal.observed += torch.rand(2, depth, CELLS, generator=torch.Generator().manual_seed(1),
                                   dtype=torch.float64) * 3
        log_factors = cal.log_factors(sampled)
        from vllm_ddtree.calibration import calibrate_lists

        lists = calibrate_lists(values, ids, log_factors + 2.0 * (torch.arange(CELLS) == 1))
        cal.observe(lists[2], output, num_accepted, counted, sampled)
        results.append((log_factors, *lists[:2], *lists[2], cal.observed, cal.predicted))
    for name, a, b in zip(("factors", "values", "ids", "top ids", "top probs", "observed",
                           "predicted"), *results):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert (torch.equal(a, b) if name in ("ids", "top ids", "values", "observed")
                else torch.allclose(a, b, atol=1e-6)), f"{name}\nfused {a}\ntorch {b}"
