"""The tree walk: hand-built cases, exact losslessness by enumeration, Monte Carlo, sampling."""

import itertools
from collections import Counter, defaultdict

import pytest
import torch
from lossless_utils import TableModel, chi_square_pvalue, max_abs_diff

from vllm_ddtree.sampling import SamplingBatch, processed_logits, sample_tokens
from vllm_ddtree.tree import DraftTree, build_tree, pack_mask
from vllm_ddtree.walk import verify_tree, walk


def _hand_tree(tokens, parents, max_depth):
    """A one-request DraftTree from token/parent lists (best-first order assumed)."""
    depths = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    n = len(tokens)
    dense = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    dense[:, 0] = True
    for k, p in enumerate(parents):
        dense[k + 1] = dense[p + 1] if p >= 0 else dense[0]
        dense[k + 1, k + 1] = True
    return DraftTree(
        token_ids=torch.tensor([tokens]),
        parents=torch.tensor([parents]),
        depths=torch.tensor([depths]),
        scores=torch.zeros(1, n),
        num_nodes=torch.tensor([n]),
        ancestor_mask=pack_mask(dense[None]),
        max_depth=max_depth,
    )


@pytest.mark.parametrize(
    "sampled,accepted,output",
    [
        ([7, 1, 4, 2, 8], [1, 3], [7, 4, 8]),  # the TreeVerdict docstring example
        ([5, 9, 1, 2, 3], [0, 2], [5, 9, 2]),  # first branch, to depth 2
        ([6, 9, 1, 2, 3], [-1, -1], [6, -1, -1]),  # root sample matches no child
        ([7, 1, 3, 2, 8], [1, -1], [7, 3, -1]),  # stops at depth 1, bonus from node 1
    ],
)
def test_hand_built_tree(sampled, accepted, output):
    # nodes: 0 = token 5 (root child), 1 = token 7 (root child), 2 = 9 under 0, 3 = 4 under 1
    tree = _hand_tree([5, 7, 9, 4], [-1, -1, 0, 1], max_depth=2)
    v = walk(tree, torch.tensor([sampled]))
    assert v.accepted_nodes.tolist() == [accepted]
    assert v.output_tokens.tolist() == [output]
    assert v.num_accepted.tolist() == [sum(a >= 0 for a in accepted)]
    assert v.bonus_token.tolist() == [output[v.num_accepted.item()]]
    rows = [0] + [a + 1 if a >= 0 else -1 for a in accepted]
    assert v.accepted_rows.tolist() == [rows]


def test_padding_nodes_are_never_accepted():
    logits = torch.randn(2, 3, 8)
    tree = build_tree(logits, torch.tensor([2, 0]), max_budget=6)
    # sample -1 nowhere; padding tokens are -1, so even "matching" garbage cannot reach them
    sampled = torch.full((2, 7), 3)
    v = walk(tree, sampled)
    for r in range(2):
        for k in v.accepted_nodes[r].tolist():
            assert k < int(tree.num_nodes[r])
    assert v.num_accepted[1] == 0 and v.output_tokens[1, 0] == 3


def _python_walk(tree: DraftTree, r: int, sampled: list[int]) -> list[int]:
    """The official host loop: follow the child whose token equals the sample, emit the bonus."""
    children = {}
    for k in range(int(tree.num_nodes[r])):
        children[(int(tree.parents[r, k]), int(tree.token_ids[r, k]))] = k
    node, out = -1, []
    while (node, sampled[node + 1]) in children:
        node = children[(node, sampled[node + 1])]
        out.append(int(tree.token_ids[r, node]))
    return out + [sampled[node + 1]]


@pytest.mark.parametrize("depth", [1, 2, 7, 15, 16])
def test_walk_matches_python_walk_on_deep_trees(depth):
    """Samples that follow a random child 97% of the time drive the walk deep."""
    gen = torch.Generator().manual_seed(depth)
    batch, vocab, budget = 40, 3, 150
    logits = torch.randn(batch, depth, vocab, generator=gen) * 3
    tree = build_tree(logits, torch.randint(1, budget + 1, (batch,), generator=gen), max_budget=budget)
    sampled = torch.randint(0, vocab, (batch, budget + 1), generator=gen)
    for r in range(batch):
        for k in range(int(tree.num_nodes[r])):  # row of the parent takes the child's token
            if torch.rand(1, generator=gen) < 0.97:
                sampled[r, int(tree.parents[r, k]) + 1] = tree.token_ids[r, k]
    v = walk(tree, sampled)
    deepest = 0
    for r in range(batch):
        expect = _python_walk(tree, r, sampled[r].tolist())
        n = len(expect) - 1
        assert v.output_tokens[r].tolist() == expect + [-1] * (depth + 1 - len(expect))
        assert int(v.num_accepted[r]) == n
        nodes = v.accepted_nodes[r, :n].tolist()
        assert [int(tree.depths[r, k]) for k in nodes] == list(range(1, n + 1))
        assert v.accepted_rows[r].tolist() == [0] + [k + 1 for k in nodes] + [-1] * (depth - n)
        deepest = max(deepest, n)
    # some request is accepted past depth 8 (12 here), so all 4 pointer-jumping rounds matter
    assert deepest >= min(depth, 9)


def _tree_for(model: TableModel, depth: int, budget: int, seed: int) -> DraftTree:
    gen = torch.Generator().manual_seed(seed)
    draft_logits = torch.randn(1, depth, model.vocab, generator=gen) * 1.5
    return build_tree(draft_logits, budget)


def _node_prefixes(tree: DraftTree) -> list[tuple]:
    """Token prefix at each tree row (row 0 = root = empty prefix)."""
    paths = [()]
    for k in range(int(tree.num_nodes[0])):
        p = int(tree.parents[0, k])
        paths.append(paths[p + 1] + (int(tree.token_ids[0, k]),))
    return paths


SAMPLINGS = {
    "greedy": None,
    "t1": SamplingBatch(temperature=torch.tensor([1.0])),
    "t0.7_topk2": SamplingBatch(temperature=torch.tensor([0.7]), top_k=torch.tensor([2])),
    "t1.3_topp0.8": SamplingBatch(temperature=torch.tensor([1.3]), top_p=torch.tensor([0.8])),
    "t1_topk2_topp0.6": SamplingBatch(
        temperature=torch.tensor([1.0]), top_k=torch.tensor([2]), top_p=torch.tensor([0.6])
    ),
}


@pytest.mark.parametrize("name", list(SAMPLINGS))
@pytest.mark.parametrize("budget,seed", [(3, 0), (6, 1), (7, 2)])
def test_walk_is_lossless_by_exact_enumeration(name, budget, seed):
    """Sum over every joint outcome of the per-position samples: the emitted tokens, extended
    with the target's own continuation, have exactly the target's (processed) joint law."""
    sampling = SAMPLINGS[name]
    vocab, depth = 3, 3
    model = TableModel(vocab, depth + 2, seed=100 + seed)
    probs = model.processed(sampling)  # [num_prefixes, vocab] float64
    tree = _tree_for(model, depth, budget, seed)
    rows = [model.index[p] for p in _node_prefixes(tree)]
    num_rows = len(rows)
    outcomes = torch.tensor(list(itertools.product(range(vocab), repeat=num_rows)))
    big = DraftTree(**{
        f: (getattr(tree, f).expand(len(outcomes), *getattr(tree, f).shape[1:])
            if torch.is_tensor(getattr(tree, f)) else getattr(tree, f))
        for f in tree.__dataclass_fields__
    })
    verdict = walk(big, outcomes)
    weights = probs[rows][torch.arange(num_rows)[None, :], outcomes].prod(dim=1)  # [N]
    emitted = defaultdict(float)
    for out, n, w in zip(verdict.output_tokens.tolist(), verdict.num_accepted.tolist(), weights.tolist()):
        emitted[tuple(out[: n + 1])] += w
    length = depth + 1
    law = model.extend(probs, emitted, length)
    assert max_abs_diff(law, model.joint(probs, length)) < 1e-9


def test_verify_tree_monte_carlo_matches_target_law():
    """Batched sampled verify_tree on 2e5 identical rows: law of the first two tokens.

    Bound: p-value > 1e-4 of Pearson's chi-square (fixed seeds, so deterministic; a correct
    implementation fails with probability 1e-4 over seeds).
    """
    vocab, depth, budget, n = 4, 3, 8, 200_000
    model = TableModel(vocab, depth + 2, seed=5, scale=1.0)
    sampling1 = SamplingBatch(temperature=torch.tensor([0.9]), top_p=torch.tensor([0.95]))
    probs = model.processed(sampling1)
    tree = _tree_for(model, depth, budget, seed=3)
    prefixes = _node_prefixes(tree)
    target_logits = model.logits[[model.index[p] for p in prefixes]].float()
    batch_tree = DraftTree(**{
        f: (getattr(tree, f).expand(n, *getattr(tree, f).shape[1:]).contiguous()
            if torch.is_tensor(getattr(tree, f)) else getattr(tree, f))
        for f in tree.__dataclass_fields__
    })
    sampling = SamplingBatch(
        temperature=torch.full((n,), 0.9), top_p=torch.full((n,), 0.95)
    )
    torch.manual_seed(0)
    verdict = verify_tree(batch_tree, target_logits.expand(n, -1, -1), sampling)
    # complete short outputs with the model's own second token
    first = verdict.output_tokens[:, 0]
    second = verdict.output_tokens[:, 1].clone()
    need = second < 0
    cont = probs[[model.index[(t,)] for t in range(vocab)]].float()  # [vocab, vocab]
    second[need] = torch.multinomial(cont[first[need]], 1, generator=torch.Generator().manual_seed(1)).squeeze(1)
    counts = Counter(zip(first.tolist(), second.tolist()))
    exact = model.joint(probs, 2)
    assert chi_square_pvalue(counts, exact, n) > 1e-4


def test_processed_logits_match_vllm_sampler():
    """Our top-k/top-p processing equals vLLM's own torch implementation."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    gen = torch.Generator().manual_seed(0)
    batch, vocab = 6, 50
    logits = torch.randn(batch, 1, vocab, generator=gen)
    logits[0, 0, :5] = 1.0  # ties at the top-k boundary
    sampling = SamplingBatch(
        temperature=torch.tensor([0.5, 1.0, 2.0, 0.0, 1.0, 0.8]),
        top_k=torch.tensor([3, 50, 7, 1, 0, 10]),
        top_p=torch.tensor([1.0, 0.3, 0.9, 0.5, 0.99, 1.0]),
    )
    ours = processed_logits(logits, sampling)[:, 0]
    temp = torch.where(sampling.temperature < 1e-5, 1.0, sampling.temperature)
    k = torch.where(sampling.top_k <= 0, vocab, sampling.top_k)
    theirs = apply_top_k_top_p_pytorch(logits[:, 0] / temp[:, None], k, sampling.top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = torch.isfinite(ours)
    torch.testing.assert_close(ours[finite], theirs[finite])


def test_greedy_rows_use_raw_argmax_and_seeded_rows_reproduce():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 30, generator=gen)
    def run(seed, default_seed):
        torch.manual_seed(default_seed)
        s = SamplingBatch(
            temperature=torch.tensor([0.0, 1.0, 1.0]),
            top_k=torch.tensor([2, 0, 5]),
            generators={1: torch.Generator().manual_seed(seed)},
        )
        return sample_tokens(logits, s)
    a, b = run(11, default_seed=0), run(11, default_seed=1)
    assert torch.equal(a[0], logits[0].argmax(-1))
    # the seeded row ignores the default generator; the unseeded one follows it
    assert torch.equal(a[1], b[1])
    assert torch.equal(run(11, default_seed=0)[2], a[2])
    # top-k 5 keeps row 2's samples inside its 5 best tokens
    assert all(t in logits[2, i].topk(5).indices.tolist() for i, t in enumerate(a[2].tolist()))


def test_verify_tree_rejects_bad_shapes():
    tree = build_tree(torch.randn(2, 3, 10), 4)
    with pytest.raises(ValueError, match="target_logits.shape"):
        verify_tree(tree, torch.randn(2, 4, 10))
    with pytest.raises(ValueError, match="sampled.shape"):
        walk(tree, torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("width", [0, 1, 5, 31, 32, 40])
def test_walk_of_first_nodes_matches_python_walk(width):
    """The sampler walks ``first_nodes(width)``: ancestor rows cut to ceil((width + 1) / 32)
    words of a wider mask, a depth bound of min(L, width)."""
    gen = torch.Generator().manual_seed(width)
    batch, vocab, budget, depth = 6, 3, 70, 9
    logits = torch.randn(batch, depth, vocab, generator=gen) * 3
    tree = build_tree(logits, torch.randint(1, budget + 1, (batch,), generator=gen),
                      max_budget=budget).first_nodes(width)
    sampled = torch.randint(0, vocab, (batch, width + 1), generator=gen)
    for r in range(batch):
        for k in range(int(tree.num_nodes[r])):
            if torch.rand(1, generator=gen) < 0.9:
                sampled[r, int(tree.parents[r, k]) + 1] = tree.token_ids[r, k]
    v = walk(tree, sampled)
    assert v.output_tokens.shape == (batch, tree.max_depth + 1)
    for r in range(batch):
        expect = _python_walk(tree, r, sampled[r].tolist())
        assert v.output_tokens[r].tolist() == expect + [-1] * (tree.max_depth + 1 - len(expect))
        assert int(v.num_accepted[r]) == len(expect) - 1
        assert int(v.bonus_token[r]) == expect[-1]
