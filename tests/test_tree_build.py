"""build_tree: optimality against brute-force enumeration and equality with the heap reference."""

import itertools
import math

import pytest
import torch

from vllm_ddtree.tree import DraftTree, build_tree, pack_mask, reference_build_tree, unpack_mask


def _check_structure(tree: DraftTree) -> None:
    """Invariants every tree must satisfy, whatever the logits."""
    batch, num_nodes = tree.token_ids.shape
    idx = torch.arange(num_nodes)
    valid = idx < tree.num_nodes[:, None]
    assert torch.equal(tree.valid, valid)
    assert (tree.parents < idx).all(), "a parent must precede its child"
    parent_depth = torch.where(
        tree.parents >= 0, tree.depths.gather(1, tree.parents.clamp(min=0)), 0
    )
    assert torch.equal(torch.where(valid, tree.depths, 0), torch.where(valid, parent_depth + 1, 0))
    assert (tree.token_ids[~valid] == -1).all() and (tree.depths[~valid] == 0).all()
    assert torch.isneginf(tree.scores[~valid]).all()
    # scores are non-increasing: best-first order
    s = torch.where(valid, tree.scores, -math.inf)
    assert (s[:, :-1] >= s[:, 1:]).all()
    # siblings carry distinct tokens
    for r in range(batch):
        seen = set()
        for k in range(int(tree.num_nodes[r])):
            key = (int(tree.parents[r, k]), int(tree.token_ids[r, k]))
            assert key not in seen
            seen.add(key)
    # the mask, row by row from the parents
    dense = tree.dense_mask()
    expect = torch.zeros_like(dense)
    expect[:, :, 0] = True
    for r in range(batch):
        expect[r, 0, 0] = True
        for k in range(num_nodes):
            p = int(tree.parents[r, k])
            expect[r, k + 1] = expect[r, p + 1] if p >= 0 else expect[r, 0]
            expect[r, k + 1, k + 1] = True
    assert torch.equal(dense, expect)


def test_pack_unpack_roundtrip_and_example():
    assert pack_mask(torch.tensor([[True, False, True]])).tolist() == [[5]]
    m = torch.rand(3, 70, 70) < 0.5
    words = pack_mask(m)
    assert words.dtype == torch.int32 and words.shape == (3, 70, 3)
    assert torch.equal(unpack_mask(words, 70), m)


def test_docstring_example():
    # q_1 = {a: .6, b: .4}, q_2 = {c: .9, d: .1} with a, b, c, d = 0, 1, 2, 3
    logits = torch.log(torch.tensor([[[0.6, 0.4, 1e-30, 1e-30], [1e-30, 1e-30, 0.9, 0.1]]]))
    tree = build_tree(logits, 3)
    assert tree.token_ids.tolist() == [[0, 2, 1]]
    assert tree.parents.tolist() == [[-1, 0, -1]]
    assert tree.depths.tolist() == [[1, 2, 1]]
    _check_structure(tree)


def test_position_offsets_and_query_token_ids():
    logits = torch.log(torch.tensor([[[0.6, 0.4, 1e-30, 1e-30], [1e-30, 1e-30, 0.9, 0.1]]]))
    tree = build_tree(logits, torch.tensor([3]), max_budget=4)  # nodes a, ac, b, padding
    assert tree.position_offsets().tolist() == [[0, 1, 2, 1, 0]]
    none = torch.empty(2, 0, dtype=torch.long)  # no drafts: the root alone
    empty = DraftTree(token_ids=none, parents=none, depths=none, scores=none.float(),
                      num_nodes=torch.zeros(2, dtype=torch.long),
                      ancestor_mask=torch.ones(2, 1, 1, dtype=torch.int32), max_depth=0)
    assert empty.position_offsets().tolist() == [[0], [0]]
    assert tree.query_token_ids(torch.tensor([3])).tolist() == [[3, 0, 2, 1, 0]]
    with pytest.raises(ValueError, match="root_token_ids.shape"):
        tree.query_token_ids(torch.tensor([3, 4]))


def _all_prefix_scores(lp: torch.Tensor) -> dict[tuple, float]:
    depth, vocab = lp.shape
    out = {}
    for d in range(1, depth + 1):
        for seq in itertools.product(range(vocab), repeat=d):
            out[seq] = sum(float(lp[i, t]) for i, t in enumerate(seq))
    return out


def _paths(tree: DraftTree, r: int) -> list[tuple]:
    paths = []
    for k in range(int(tree.num_nodes[r])):
        p = int(tree.parents[r, k])
        paths.append((paths[p] if p >= 0 else ()) + (int(tree.token_ids[r, k]),))
    return paths


@pytest.mark.parametrize("vocab,depth", [(2, 4), (3, 3), (5, 2), (6, 3), (4, 4)])
@pytest.mark.parametrize("ties", [False, True])
def test_optimal_against_enumeration(vocab, depth, ties):
    """For every budget, the tree is a top-B set of prefixes (ties: any valid top-B set)."""
    gen = torch.Generator().manual_seed(vocab * 10 + depth)
    logits = torch.randn(3, depth, vocab, generator=gen, dtype=torch.float64)
    if ties:  # quantised logits create many equal prefix scores
        logits = torch.round(logits)
    lp = torch.log_softmax(logits.float(), -1)
    max_budget = sum(vocab**d for d in range(1, depth + 1))
    for r in range(3):
        all_scores = _all_prefix_scores(lp[r])
        ranked = sorted(all_scores.values(), reverse=True)
        for budget in range(1, max_budget + 1):
            tree = build_tree(logits[r : r + 1], budget)
            paths = _paths(tree, 0)
            assert len(paths) == budget and len(set(paths)) == budget
            got = sorted((all_scores[p] for p in paths), reverse=True)
            # equal multiset of scores (float tolerance: enumeration sums in another order)
            assert got == pytest.approx(ranked[:budget], abs=1e-5)
            # and every prefix outside the tree scores <= the tree's worst node
            worst = got[-1]
            outside = [s for p, s in all_scores.items() if p not in set(paths)]
            assert max(outside, default=-math.inf) <= worst + 1e-5
        _check_structure(tree)


def _assert_equal_to_reference(tree: DraftTree, ref: list[dict]) -> None:
    for r, expect in enumerate(ref):
        n = int(tree.num_nodes[r])
        assert n == len(expect["token_ids"])
        assert tree.token_ids[r, :n].tolist() == expect["token_ids"]
        assert tree.parents[r, :n].tolist() == expect["parents"]
        assert tree.depths[r, :n].tolist() == expect["depths"]
        # the fused CPU op's log-probabilities equal log_softmax's to ~1e-6 (its own exp)
        assert tree.scores[r, :n].tolist() == pytest.approx(expect["scores"], rel=0, abs=1e-5)


@pytest.mark.parametrize("budget", [1, 2, 3, 17, 64, 256, 1000, 1024])
def test_equals_reference_heap_large(budget):
    gen = torch.Generator().manual_seed(budget)
    # peaked distributions, as a trained drafter gives, so trees grow deep
    logits = torch.randn(8, 15, 32000, generator=gen) * 4.0
    tree = build_tree(logits, budget)
    _assert_equal_to_reference(tree, reference_build_tree(logits, budget))
    if budget <= 64:
        _check_structure(tree)


@pytest.mark.parametrize("budget,dtype", [(17, torch.float32), (1024, torch.float32), (256, torch.bfloat16)])
def test_equals_reference_heap_flat_logits(budget, dtype):
    """Flat drafts (unit-scale logits over 32k tokens) give wide, shallow trees; bfloat16
    logits add many exact ties, which both sides must break the same way."""
    gen = torch.Generator().manual_seed(100 + budget)
    logits = torch.randn(8, 15, 32000, generator=gen).to(dtype)
    _assert_equal_to_reference(build_tree(logits, budget), reference_build_tree(logits, budget))


@pytest.mark.parametrize("depth,budget", [(15, 200), (16, 300)])
def test_deep_trees_structure_and_mask(depth, budget):
    """Peaked drafts grow trees to full depth: the mask must hold whole 16-17 entry paths."""
    gen = torch.Generator().manual_seed(depth)
    logits = torch.randn(4, depth, 50, generator=gen) * 12
    tree = build_tree(logits, budget)
    assert tree.depths.max(dim=1).values.tolist() == [depth] * 4
    _check_structure(tree)
    _assert_equal_to_reference(tree, reference_build_tree(logits, budget))


def test_equals_reference_with_ties_small_vocab():
    """Exact ties (quantised logits): the documented tie-break is the heap's."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.round(torch.randn(6, 5, 4, generator=gen) * 2)
    for budget in [1, 5, 20, 100, 400]:
        _assert_equal_to_reference(build_tree(logits, budget), reference_build_tree(logits, budget))


def test_per_request_budgets_are_prefixes_of_the_full_tree():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 6, 100, generator=gen) * 3
    budgets = torch.tensor([0, 1, 7, 30, 64])
    tree = build_tree(logits, budgets, max_budget=64)
    full = build_tree(logits, 64)
    assert tree.num_nodes.tolist() == budgets.tolist()
    for r, b in enumerate(budgets.tolist()):
        assert tree.token_ids[r, :b].tolist() == full.token_ids[r, :b].tolist()
        assert tree.parents[r, :b].tolist() == full.parents[r, :b].tolist()
        _assert_equal_to_reference(
            DraftTree(
                token_ids=tree.token_ids[r : r + 1],
                parents=tree.parents[r : r + 1],
                depths=tree.depths[r : r + 1],
                scores=tree.scores[r : r + 1],
                num_nodes=tree.num_nodes[r : r + 1],
                ancestor_mask=tree.ancestor_mask[r : r + 1],
                max_depth=tree.max_depth,
            ),
            reference_build_tree(logits[r : r + 1], b) if b > 0 else [{"token_ids": [], "parents": [], "depths": [], "scores": []}],
        )
    _check_structure(tree)


def test_budget_larger_than_the_number_of_prefixes():
    logits = torch.randn(2, 2, 3)
    tree = build_tree(logits, 20)  # only 3 + 9 = 12 prefixes exist
    assert tree.num_nodes.tolist() == [12, 12]
    _check_structure(tree)


def test_zero_probability_tokens_are_never_nodes():
    logits = torch.full((1, 3, 10), float("-inf"))
    logits[0, :, :2] = 0.0  # two tokens of probability 1/2 per depth
    tree = build_tree(logits, 50)
    assert int(tree.num_nodes[0]) == 2 + 4 + 8
    assert set(tree.token_ids[0, :14].tolist()) == {0, 1}


def test_dtypes_and_errors():
    logits = torch.randn(2, 3, 40)
    base = build_tree(logits, 8)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        t = build_tree(logits.to(dtype), 8)
        _check_structure(t)
    assert base.ancestor_mask.shape == (2, 9, 1)
    with pytest.raises(ValueError, match="draft_logits.shape"):
        build_tree(torch.randn(3, 40), 4)
    with pytest.raises(ValueError, match="max_budget"):
        build_tree(logits, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="budget.shape"):
        build_tree(logits, torch.tensor([1, 2, 3]), max_budget=4)
    with pytest.raises(ValueError, match="float"):
        build_tree(torch.ones(2, 3, 4, dtype=torch.int64), 4)


def test_first_nodes_is_the_subtree_of_the_first_nodes():
    gen = torch.Generator().manual_seed(5)
    tree = build_tree(torch.randn(3, 4, 6, generator=gen) * 2, 40)
    for width in (0, 1, 7, 33, 40):
        part = tree.first_nodes(width)
        assert torch.equal(part.token_ids, tree.token_ids[:, :width])
        assert torch.equal(part.num_nodes, tree.num_nodes.clamp(max=width))
        dense = unpack_mask(tree.ancestor_mask, 41)[:, : width + 1, : width + 1]
        assert torch.equal(unpack_mask(part.ancestor_mask, width + 1), dense)
        _check_structure(part)
    with pytest.raises(ValueError, match="width=41"):
        tree.first_nodes(41)


def test_path_tokens_are_each_nodes_path_backwards():
    """``DraftTree.path_tokens``: for every (request, node) the tokens of the path root -> node
    (``_paths``, by parent hops on the host), newest first, -1 past the root; root rows and
    padding nodes: all -1 (a padding node's token is -1 and its parent the root)."""
    gen = torch.Generator().manual_seed(11)
    tree = build_tree(torch.randn(3, 4, 6, generator=gen) * 2,
                      torch.tensor([40, 9, 0]), max_budget=40)  # the last: padding only
    requests, nodes = zip(*itertools.product(range(3), range(-1, 40)))
    got = tree.path_tokens(torch.tensor(requests), torch.tensor(nodes))
    assert got.shape == (len(nodes), tree.max_depth)
    for row, (r, k) in enumerate(zip(requests, nodes)):
        path = _paths(tree, r)[k] if 0 <= k < int(tree.num_nodes[r]) else ()
        want = list(reversed(path)) + [-1] * (tree.max_depth - len(path))
        assert got[row].tolist() == want, (r, k)


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("vocab", [3, 40])
def test_shallow_trees_and_small_vocabularies(depth, vocab):
    """L = 1 (no candidate pairs), L = 2 (the only deeper depth is the unsorted last one) and a
    vocabulary smaller than the budget (depth 1's list padded): all equal to the heap."""
    gen = torch.Generator().manual_seed(depth * 100 + vocab)
    logits = torch.round(torch.randn(3, depth, vocab, generator=gen) * 2)  # ties too
    for budget in (1, 2, 5, 16, 50):
        tree = build_tree(logits, budget)
        _assert_equal_to_reference(tree, reference_build_tree(logits, budget))
        _check_structure(tree)


def test_int_tensor_and_function_budgets_agree():
    """An int budget below max_budget, the same budget as a tensor and as a function of the
    candidates give the same padded tree (the int path thresholds rows with a cached table)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5, 60, generator=gen) * 3
    full = build_tree(logits, 32)
    seen = {}

    def budget_fn(scores, depths):
        seen["scores"], seen["depths"] = scores, depths
        return torch.full((4,), 9)

    trees = [build_tree(logits, 9, max_budget=32),
             build_tree(logits, torch.full((4,), 9), max_budget=32),
             build_tree(logits, budget_fn, max_budget=32)]
    for tree in trees:
        _check_structure(tree)
        assert tree.num_nodes.tolist() == [9] * 4
        for name in ("token_ids", "parents", "depths", "scores", "ancestor_mask"):
            assert torch.equal(getattr(tree, name), getattr(trees[0], name)), name
        assert torch.equal(tree.token_ids[:, :9], full.token_ids[:, :9])
    # the function sees the full-width tree's candidates
    assert torch.equal(seen["scores"], full.scores)
    assert torch.equal(seen["depths"], full.depths)


@pytest.mark.parametrize("native", ["1", "0"])
def test_tree_temperature_is_the_tree_of_the_scaled_logits(native, monkeypatch):
    """``temperature=t`` (the transformers engine's ``tree_temperature``) builds the heap's tree
    of ``logits / t`` on both paths (the fused CPU op and torch), for int, tensor and function
    budgets; a sharper law (t < 1) grows deeper trees, a flatter one (t > 1) wider ones."""
    monkeypatch.setenv("VLLM_DDTREE_NATIVE", native)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 5, 50, generator=gen) * 2.0
    mean_depth = {}
    for t in (0.5, 1.0, 2.0):
        tree = build_tree(logits, 32, temperature=t)
        _check_structure(tree)
        _assert_equal_to_reference(tree, reference_build_tree(logits / t, 32))
        for budget in (torch.full((6,), 11), lambda scores, depths: torch.full((6,), 11)):
            cut = build_tree(logits, budget, max_budget=32, temperature=t)
            assert torch.equal(cut.token_ids[:, :11], tree.token_ids[:, :11])
            assert cut.num_nodes.tolist() == [11] * 6
        mean_depth[t] = tree.depths.float().mean().item()
    assert mean_depth[0.5] > mean_depth[1.0] > mean_depth[2.0], mean_depth
    # bfloat16 logits are scaled in float32 (no second rounding)
    half = logits.to(torch.bfloat16)
    _assert_equal_to_reference(build_tree(half, 32, temperature=0.7),
                               reference_build_tree(half.float() / 0.7, 32))


def test_ancestor_mask_from_node_parents():
    """``_ancestor_mask`` (the plugin rebuilds masks of re-indexed or chain trees with it)
    equals the row-by-row reference, padding rows (-1) hanging off the root."""
    from vllm_ddtree.tree import _ancestor_mask

    # a chain of 4, then a branch: node 4 under 1, node 5 under the root, node 6 padding
    parents = torch.tensor([[-1, 0, 1, 2, 1, -1, -1]])
    expect = [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 5], [0, 6], [0, 7]]
    dense = unpack_mask(_ancestor_mask(parents, 4), 8)[0]
    assert [torch.nonzero(row).flatten().tolist() for row in dense] == expect
    for max_depth in (4, 5, 8):  # more rounds than needed change nothing
        assert torch.equal(unpack_mask(_ancestor_mask(parents, max_depth), 8)[0], dense)
