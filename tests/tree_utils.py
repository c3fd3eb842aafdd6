"""Trees, target samples, expected moves and comparisons shared by the tests of the tree
build, the walk and finish_verify (the fused CPU ops in test_native.py, the Triton kernels in
test_verify_steps.py)."""

from __future__ import annotations

import torch

from vllm_ddtree.tree import DraftTree, _ancestor_mask

TREE_FIELDS = ("token_ids", "parents", "depths", "scores", "num_nodes", "ancestor_mask")
VERDICT_FIELDS = ("accepted_nodes", "num_accepted", "bonus_token", "output_tokens",
                  "accepted_rows")


def assert_verdicts_equal(got, want, what: str = "") -> None:
    """Every field of two TreeVerdicts, vLLM's output layout too when either has one: dtype,
    shape and values."""
    for name in VERDICT_FIELDS + ("sampled_token_ids",):
        a, b = getattr(got, name), getattr(want, name)
        if a is None or b is None:
            assert a is b, f"{what}: TreeVerdict.{name} is {a} against {b}"
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, (what, name, a.dtype, b.dtype)
        assert torch.equal(a, b), f"{what}: TreeVerdict.{name} differs\ngot  {a}\nwant {b}"


def random_logits(kind: str, batch: int, depth: int, vocab: int, gen: torch.Generator):
    """``randn``: distinct values; ``ties``: small integers (many equal log-probabilities,
    so the tie-break decides); ``zeros``: small integers and -inf (tokens of probability
    zero: fewer possible prefixes than the budget, padding); ``bf16``: bf16 logits."""
    if kind == "randn":
        return torch.randn(batch, depth, vocab, generator=gen) * 3
    if kind == "bf16":
        return (torch.randn(batch, depth, vocab, generator=gen) * 2).bfloat16()
    logits = torch.randint(0, 3, (batch, depth, vocab), generator=gen).float()
    if kind == "zeros":
        logits[torch.rand(batch, depth, vocab, generator=gen) < 0.7] = float("-inf")
        logits[..., 0] = 0.0  # every row keeps a possible token
    return logits


def path_samples(tree: DraftTree, vocab: int, gen: torch.Generator, follow: bool = True):
    """``[R, B + 1]`` target samples: random tokens in ``[0, vocab)``; with ``follow``, each
    request's samples follow a random tree path to a random depth, then diverge (a token that
    no child of the last node carries, or any token half of the time)."""
    batch, width = tree.token_ids.shape
    sampled = torch.randint(0, vocab, (batch, width + 1), generator=gen)
    if not follow:
        return sampled
    tokens, parents = tree.token_ids.tolist(), tree.parents.tolist()
    for r in range(batch):
        n = int(tree.num_nodes[r])
        target = int(torch.randint(0, tree.max_depth + 1, (1,), generator=gen))
        current = -1
        for _ in range(target):
            children = [k for k in range(n) if parents[r][k] == current]
            if not children:
                break
            child = children[int(torch.randint(0, len(children), (1,), generator=gen))]
            sampled[r, current + 1] = tokens[r][child]
            current = child
        if torch.rand(1, generator=gen) < 0.5:
            taken = {tokens[r][k] for k in range(n) if parents[r][k] == current}
            sampled[r, current + 1] = next(t for t in range(vocab + 1) if t not in taken)
    return sampled


def hand_tree(parents: list[list[int]], tokens: list[list[int]], max_depth: int) -> DraftTree:
    """A batch of trees from parent/token lists (padding: parent -1, token -1); depths and
    ancestor rows computed from the parents."""
    par = torch.tensor(parents)
    tok = torch.tensor(tokens)
    depths = []
    for row_p, row_t in zip(parents, tokens):
        d = []
        for p, t in zip(row_p, row_t):
            d.append(0 if t < 0 else (1 if p < 0 else d[p] + 1))
        depths.append(d)
    dep = torch.tensor(depths)
    return DraftTree(token_ids=tok, parents=par, depths=dep,
                     scores=torch.where(dep > 0, 0.0, float("-inf")),
                     num_nodes=(dep > 0).sum(dim=1), ancestor_mask=_ancestor_mask(par, max_depth),
                     max_depth=max_depth)


def moves_by_hand(accepted_rows: torch.Tensor, starts: list[int], num_tokens: int):
    """(src, dst, gather index, moved) written out per request: accepted node row q at depth
    j moves from ``start + q`` to ``start + j`` unless it is there already."""
    rows = accepted_rows.tolist()
    depth = len(rows[0]) - 1
    src, dst, gather, moved = [], [], list(range(num_tokens)), 0
    for r, start in enumerate(starts):
        for j in range(1, depth + 1):
            q = rows[r][j]
            s = d = -1
            if q >= 0:
                gather[start + j] = start + q
                if q != j:
                    s, d = start + q, start + j
                    moved += 1
            src.append(s)
            dst.append(d)
    return src, dst, gather, moved


def chain_trees(gen: torch.Generator, width: int = 9, lengths=(9, 5, 0, 1, 9, 3)):
    """Chains (node k hangs off k - 1) of the given lengths over tokens 0..2, -1 padded to
    ``width`` nodes; and the ``[R, width + 1]`` target samples that accept every chain whole."""
    parents, tokens = [], []
    for n in lengths:
        parents.append(list(range(-1, n - 1)) + [-1] * (width - n))
        tokens.append(torch.randint(0, 3, (n,), generator=gen).tolist() + [-1] * (width - n))
    whole = torch.cat([torch.tensor(tokens).clamp(min=0),
                       torch.zeros(len(lengths), 1, dtype=torch.long)], dim=1)
    return hand_tree(parents, tokens, max_depth=width), whole
