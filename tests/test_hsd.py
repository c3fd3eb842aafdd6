"""Sampled-chain verifiers: exact losslessness, HSD >= token-wise, Monte Carlo of the batched code."""

import itertools
import math
from collections import Counter, defaultdict

import pytest
import torch
from lossless_utils import TableModel, chi_square_pvalue, max_abs_diff

from vllm_ddtree.sampling import (
    KeyedNoise,
    SamplingBatch,
    hsd_stop_probabilities,
    hsd_verify,
    hsd_verify_rows,
    hsd_verify_sparse,
    keyed_chain,
    pack_sparse_law,
    sparse_hsd_residual,
    sparse_hsd_stop_probabilities,
    seed_keys_of,
    tokenwise_verify,
    top_k_draft_law,
    unpack_sparse_law,
)

_T1 = SamplingBatch(temperature=torch.tensor([1.0]))


def _chain_inputs(target: TableModel, draft: TableModel, g: int):
    """Every draft x in V^g with its probability Q(x) and the per-position distributions."""
    p_all = target.processed(_T1)
    q_all = draft.processed(_T1)
    drafts = list(itertools.product(range(target.vocab), repeat=g))
    q_seq = torch.tensor([
        float(torch.prod(torch.stack([q_all[draft.index[x[:i]], x[i]] for i in range(g)])))
        for x in drafts
    ], dtype=torch.float64)
    draft_probs = torch.stack([torch.stack([q_all[draft.index[x[:i]]] for i in range(g)]) for x in drafts])
    target_probs = torch.stack([torch.stack([p_all[target.index[x[:i]]] for i in range(g + 1)]) for x in drafts])
    return torch.tensor(drafts), q_seq, draft_probs, target_probs, p_all


def _hsd_law(ids, draft_probs, target_probs):
    """Exact P(num_accepted = i, next token = y | x) of the backward scan: [n, g+1, V]."""
    h, residual = hsd_stop_probabilities(ids, draft_probs, target_probs)
    g = ids.shape[1]
    later_fail = torch.ones_like(h)
    for i in range(g - 1, -1, -1):
        later_fail[:, i] = later_fail[:, i + 1] * (1 - h[:, i + 1])
    stop = h * later_fail  # P(stop exactly at i)
    total = residual.sum(-1, keepdim=True)
    dist = torch.where(total > 0, residual / total.clamp(min=1e-300), 0.0)
    return stop[:, :, None] * dist


def _tokenwise_law(ids, draft_probs, target_probs):
    g = ids.shape[1]
    p_x = target_probs[:, :g].gather(2, ids[..., None]).squeeze(2)
    q_x = draft_probs.gather(2, ids[..., None]).squeeze(2)
    a = torch.clamp(p_x / q_x, max=1.0)
    reach = torch.cat([torch.ones(len(ids), 1, dtype=torch.float64), a.cumprod(1)], dim=1)
    stop = reach * torch.cat([1 - a, torch.ones(len(ids), 1, dtype=torch.float64)], dim=1)
    residual = torch.cat([torch.clamp(target_probs[:, :g] - draft_probs, min=0), target_probs[:, g:]], 1)
    total = residual.sum(-1, keepdim=True)
    dist = torch.where(total > 0, residual / total.clamp(min=1e-300), 0.0)
    return stop[:, :, None] * dist


def _emitted_law(ids, q_seq, law):
    emitted = defaultdict(float)
    n, levels, vocab = law.shape
    for r in range(n):
        for i in range(levels):
            for y in range(vocab):
                w = float(q_seq[r] * law[r, i, y])
                if w:
                    emitted[tuple(ids[r, :i].tolist()) + (y,)] += w
    return emitted


@pytest.mark.parametrize("vocab,g,seed", [(2, 3, 0), (3, 2, 1), (3, 3, 2), (4, 2, 3)])
@pytest.mark.parametrize("law_fn", [_hsd_law, _tokenwise_law], ids=["hsd", "tokenwise"])
def test_sampled_chain_is_lossless_by_exact_enumeration(vocab, g, seed, law_fn):
    target = TableModel(vocab, g + 2, seed=seed, scale=1.5)
    draft = TableModel(vocab, g + 1, seed=seed + 1000, scale=1.5)
    ids, q_seq, draft_probs, target_probs, p_all = _chain_inputs(target, draft, g)
    assert abs(float(q_seq.sum()) - 1) < 1e-12
    emitted = _emitted_law(ids, q_seq, law_fn(ids, draft_probs, target_probs))
    law = target.extend(p_all, emitted, g + 1)
    assert max_abs_diff(law, target.joint(p_all, g + 1)) < 1e-9


def test_uncapped_last_level_would_be_biased():
    """Guard that the enumeration can see the known bias: min(1, P(x)/Q(x)) at the last level."""
    target = TableModel(3, 4, seed=11, scale=1.5)
    draft = TableModel(3, 3, seed=12, scale=1.5)
    ids, q_seq, draft_probs, target_probs, p_all = _chain_inputs(target, draft, 2)
    law = _hsd_law(ids, draft_probs, target_probs)
    # replace h_g = capped p_g by the uncapped min(1, prod ratios), as in the public code
    p_x = target_probs[:, :2].gather(2, ids[..., None]).squeeze(2)
    q_x = draft_probs.gather(2, ids[..., None]).squeeze(2)
    h, residual = hsd_stop_probabilities(ids, draft_probs, target_probs)
    h_bad = h.clone()
    h_bad[:, 2] = torch.clamp((p_x / q_x).prod(1), max=1.0)
    assert not torch.allclose(h_bad, h), "this instance must exercise the capped/uncapped difference"
    stop = h_bad.clone()
    stop[:, 1] = h_bad[:, 1] * (1 - h_bad[:, 2])
    stop[:, 0] = (1 - h_bad[:, 1]) * (1 - h_bad[:, 2])
    total = residual.sum(-1, keepdim=True)
    bad_law = stop[:, :, None] * residual / total
    emitted = _emitted_law(ids, q_seq, bad_law)
    joint = target.joint(p_all, 3)
    assert max_abs_diff(target.extend(p_all, emitted, 3), joint) > 1e-6
    assert max_abs_diff(target.extend(p_all, _emitted_law(ids, q_seq, law), 3), joint) < 1e-9


@pytest.mark.parametrize("seed", range(20))
def test_hsd_accepts_at_least_as_much_as_tokenwise(seed):
    vocab, g = 3, 3
    target = TableModel(vocab, g + 2, seed=200 + seed, scale=1.0 + seed / 10)
    draft = TableModel(vocab, g + 1, seed=400 + seed, scale=1.0 + seed / 10)
    ids, q_seq, draft_probs, target_probs, _ = _chain_inputs(target, draft, g)
    levels = torch.arange(g + 1, dtype=torch.float64)
    e_hsd = float((q_seq[:, None] * _hsd_law(ids, draft_probs, target_probs).sum(-1) * levels).sum())
    e_tok = float((q_seq[:, None] * _tokenwise_law(ids, draft_probs, target_probs).sum(-1) * levels).sum())
    assert e_hsd >= e_tok - 1e-12
    # Closed forms, computed without the verifiers' code: E[tau] = sum_i E_Q[capped prefix
    # ratio p_i] for block verification, sum_i E_Q[prod_{j <= i} min(1, p_j / q_j)] token-wise.
    ratio = (target_probs[:, :g].gather(2, ids[..., None]) / draft_probs.gather(2, ids[..., None])).squeeze(2)
    capped, block_formula = torch.ones(len(ids), dtype=torch.float64), 0.0
    for i in range(g):
        capped = torch.clamp(capped * ratio[:, i], max=1.0)
        block_formula += float((q_seq * capped).sum())
    tokenwise_formula = float((q_seq[:, None] * torch.clamp(ratio, max=1.0).cumprod(1)).sum())
    assert e_hsd == pytest.approx(block_formula, abs=1e-12)
    assert e_tok == pytest.approx(tokenwise_formula, abs=1e-12)


@pytest.mark.parametrize("verify,law_fn", [(hsd_verify, _hsd_law), (tokenwise_verify, _tokenwise_law)])
def test_batched_verifier_monte_carlo(verify, law_fn):
    """2e5 rows drawn from the drafter, verified in one batch; the joint law of
    (draft, num_accepted, next token) against the exact law. Bound: chi-square p > 1e-4."""
    vocab, g, n = 3, 3, 200_000
    target = TableModel(vocab, g + 2, seed=31, scale=1.2)
    draft = TableModel(vocab, g + 1, seed=32, scale=1.2)
    ids, q_seq, draft_probs, target_probs, _ = _chain_inputs(target, draft, g)
    gen = torch.Generator().manual_seed(0)
    pick = torch.multinomial(q_seq, n, replacement=True, generator=gen)
    num_acc, out = verify(ids[pick], draft_probs[pick].float(), target_probs[pick].float(), generator=gen)
    assert out.shape == (n, g + 1)
    nxt = out.gather(1, num_acc[:, None]).squeeze(1)
    # accepted tokens are the draft's, padding is -1
    cols = torch.arange(g + 1)
    assert torch.equal(torch.where(cols[:g] < num_acc[:, None], out[:, :g], -1),
                       torch.where(cols[:g] < num_acc[:, None], ids[pick], -1))
    assert (out[cols[None, :] > num_acc[:, None]] == -1).all()
    counts = Counter(zip(pick.tolist(), num_acc.tolist(), nxt.tolist()))
    law = law_fn(ids, draft_probs, target_probs) * q_seq[:, None, None]
    exact = {(r, i, y): float(law[r, i, y]) for r in range(len(ids)) for i in range(g + 1) for y in range(vocab)}
    assert chi_square_pvalue(counts, exact, n) > 1e-4


def test_point_mass_drafts_reduce_to_the_walk():
    """With one-hot q (argmax drafts), HSD accepts exactly while the target agrees greedily."""
    vocab, g = 5, 4
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (64, g), generator=gen)
    q = torch.nn.functional.one_hot(ids, vocab).double()
    p_tok = torch.randint(0, vocab, (64, g + 1), generator=gen)
    p_tok[:, :g] = torch.where(torch.rand(64, g, generator=gen) < 0.7, ids, p_tok[:, :g])
    p = torch.nn.functional.one_hot(p_tok, vocab).double()
    num, out = hsd_verify(ids, q, p, generator=gen)
    agree = (p_tok[:, :g] == ids).long().cumprod(1).sum(1)
    assert torch.equal(num, agree)
    assert torch.equal(out.gather(1, num[:, None]).squeeze(1), p_tok.gather(1, agree[:, None]).squeeze(1))


def test_chain_shape_errors():
    with pytest.raises(ValueError, match="target_probs.shape"):
        hsd_verify(torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 3, 5), torch.rand(2, 3, 5))
    with pytest.raises(ValueError, match="draft_probs.shape"):
        tokenwise_verify(torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 2, 5), torch.rand(2, 4, 5))


# ---------------------------------------------------------------------------------------------
# sparse draft laws (the vLLM plugin's hsd_chain): the same verifier, the law on K tokens


def _random_sparse_law(batch, g, vocab, k, gen):
    """``(probs [batch, g, k] float32 with some zeros, ids [batch, g, k] distinct)``."""
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(batch * g)])
    ids = ids.view(batch, g, k)
    probs = torch.rand(batch, g, k, generator=gen) * (torch.rand(batch, g, k, generator=gen) > 0.2)
    probs[..., 0] += 0.1  # never all zero
    return probs / probs.sum(-1, keepdim=True), ids


def _sparse_levels(chains, probs, ids, target):
    """:func:`sparse_hsd_stop_probabilities` with its target inputs taken from dense rows."""
    g = chains.shape[1]
    p = target[:, :g].double()
    return sparse_hsd_stop_probabilities(chains, probs, ids, p.gather(2, ids),
                                         p.scatter(2, ids, 0.0).sum(-1),
                                         p.gather(2, chains[..., None]).squeeze(2))


def _densify(probs, ids, vocab):
    return torch.zeros(*probs.shape[:2], vocab, dtype=probs.dtype).scatter(2, ids, probs)


@pytest.mark.parametrize("vocab,k,g", [(50, 8, 4), (7, 7, 3), (300, 1, 2)])
def test_sparse_hsd_equals_dense_on_the_densified_law(vocab, k, g):
    """Same h (to float64 rounding: Z sums in another order) and the same residual at every
    level, bit for bit, as :func:`hsd_stop_probabilities` on the densified law."""
    gen = torch.Generator().manual_seed(vocab + k)
    batch = 64
    probs, ids = _random_sparse_law(batch, g, vocab, k, gen)
    pick = torch.multinomial(probs.view(-1, k), 1, generator=gen).view(batch, g, 1)
    chains = ids.gather(2, pick).squeeze(2)
    target = (torch.randn(batch, g + 1, vocab, generator=gen, dtype=torch.float64) * 2).softmax(-1)
    # rows 0-7: the target (nearly) equals the draft law, p / q ~ 1 and Z ~ 0: h's edge
    close = _densify(probs, ids, vocab)[:8].double()
    target[:8, :g] = close / close.sum(-1, keepdim=True)
    h_dense, residual_dense = hsd_stop_probabilities(chains, _densify(probs, ids, vocab), target)
    h, prefix = _sparse_levels(chains, probs, ids, target)
    torch.testing.assert_close(h, h_dense, rtol=1e-12, atol=1e-14)
    assert (h > 0).any() and (h < 1).any()
    for level in range(g + 1):
        at = min(level, g - 1)
        residual = sparse_hsd_residual(prefix[:, level], target[:, level], probs[:, at], ids[:, at],
                                       torch.full((batch,), level == g))
        assert torch.equal(residual, residual_dense[:, level]), level


def _sparse_chain_inputs(target: TableModel, draft: TableModel, g: int, k: int):
    """Every draft in the support of the drafter's top-k law (T = 1), its probability, and the
    sparse law and target rows along it."""
    p_all = target.processed(_T1)
    probs_all, ids_all = top_k_draft_law(draft.logits[:, None], torch.ones(len(draft.prefixes)), k)
    probs_all, ids_all = probs_all[:, 0].double(), ids_all[:, 0]
    probs_all /= probs_all.sum(-1, keepdim=True)  # the float32 law, normalised in float64
    drafts, q_seq = [], []
    for x in itertools.product(range(target.vocab), repeat=g):
        q = 1.0
        for i in range(g):
            row = draft.index[x[:i]]
            hit = (ids_all[row] == x[i]).nonzero()
            q *= float(probs_all[row, hit[0, 0]]) if len(hit) else 0.0
        if q > 0:
            drafts.append(x)
            q_seq.append(q)
    rows_q = [[draft.index[x[:i]] for i in range(g)] for x in drafts]
    rows_p = [[target.index[x[:i]] for i in range(g + 1)] for x in drafts]
    rows_q, rows_p = torch.tensor(rows_q), torch.tensor(rows_p)
    return (torch.tensor(drafts), torch.tensor(q_seq, dtype=torch.float64), probs_all[rows_q],
            ids_all[rows_q], p_all[rows_p], p_all)


def _sparse_hsd_law(ids, probs_q, ids_q, target_probs):
    """Exact P(num_accepted = i, next token = y | x) with the sparse functions: [n, g+1, V]."""
    g = ids.shape[1]
    h, prefix = _sparse_levels(ids, probs_q, ids_q, target_probs)
    later_fail = torch.ones_like(h)
    for i in range(g - 1, -1, -1):
        later_fail[:, i] = later_fail[:, i + 1] * (1 - h[:, i + 1])
    stop = h * later_fail
    laws = []
    for level in range(g + 1):
        at = min(level, g - 1)
        residual = sparse_hsd_residual(prefix[:, level], target_probs[:, level], probs_q[:, at],
                                       ids_q[:, at], torch.full((len(ids),), level == g))
        total = residual.sum(-1, keepdim=True)
        dist = torch.where(total > 0, residual / total.clamp(min=1e-300), 0.0)
        laws.append(stop[:, level, None] * dist)
    return torch.stack(laws, dim=1)


@pytest.mark.parametrize("vocab,g,k,seed", [(3, 2, 1, 0), (3, 3, 2, 1), (4, 2, 2, 2), (4, 3, 3, 3)])
def test_sparse_hsd_is_lossless_by_exact_enumeration(vocab, g, k, seed):
    """Chains drawn from the drafter's top-k law, verified with the sparse functions: the
    emitted tokens, extended by the target, have exactly the target's joint law."""
    target = TableModel(vocab, g + 2, seed=seed, scale=1.5)
    draft = TableModel(vocab, g + 1, seed=seed + 1000, scale=1.5)
    ids, q_seq, probs_q, ids_q, target_probs, p_all = _sparse_chain_inputs(target, draft, g, k)
    assert abs(float(q_seq.sum()) - 1) < 1e-12 and len(ids) <= k ** g
    emitted = _emitted_law(ids, q_seq, _sparse_hsd_law(ids, probs_q, ids_q, target_probs))
    law = target.extend(p_all, emitted, g + 1)
    assert max_abs_diff(law, target.joint(p_all, g + 1)) < 1e-9


def _hsd_verify_sparse_full_support(ids, draft_probs, target_probs, generator=None):
    """:func:`hsd_verify_sparse` with the dense law written as K = V support tokens."""
    batch, g, vocab = draft_probs.shape
    support = torch.arange(vocab).expand(batch, g, vocab)
    return hsd_verify_sparse(ids, draft_probs, support, target_probs, generator=generator)


def test_sparse_verifier_monte_carlo():
    """:func:`hsd_verify_sparse` (sampling, stop scan, residual draw) on 2e5 rows against the
    exact law, as for the dense verifiers above."""
    test_batched_verifier_monte_carlo(_hsd_verify_sparse_full_support, _hsd_law)


def test_keyed_chains_verified_on_flat_rows_monte_carlo():
    """Model Runner V2's hsd_chain, its randomness included: 2e5 requests, one seed each
    (negative ones too), draw their chains with :func:`keyed_chain` from per-depth drafter
    laws (DFlash's: a depth's law does not depend on the drafts before it) and verify them
    with :func:`hsd_verify_rows` on flat target rows with :class:`KeyedNoise`. The joint law
    of (chain, num_accepted, next token) fits the exact one (chi-square p > 1e-4): the drafts'
    noise and the verify step's are independent, and the flat-row plumbing is HSD's."""
    vocab, g, n = 3, 3, 200_000
    target = TableModel(vocab, g + 2, seed=31, scale=1.2)
    gen = torch.Generator().manual_seed(5)
    q = torch.rand(g, vocab, generator=gen, dtype=torch.float64) + 0.1
    q = (q / q.sum(-1, keepdim=True)).float()  # the law as the drafter hands it, float32
    chains_all = torch.tensor(list(itertools.product(range(vocab), repeat=g)))  # [V^g, g]
    q_seq = q.double()[torch.arange(g), chains_all].prod(-1)
    p_all = target.processed(_T1)
    target_all = torch.stack([torch.stack([p_all[target.index[tuple(x[:i])]]
                                           for i in range(g + 1)]) for x in chains_all.tolist()])
    seed_keys = seed_keys_of(torch.arange(n, dtype=torch.int64) * 7919 - 50_000)
    positions = torch.full((n,), 41)
    laws = q.expand(n, g, vocab), torch.arange(vocab).expand(n, g, vocab)
    chains = keyed_chain(*laws, seed_keys, positions)
    pick = (chains * vocab ** torch.arange(g - 1, -1, -1)).sum(-1)  # its row of chains_all
    flat = target_all[pick].reshape(n * (g + 1), vocab)
    num_acc, out = hsd_verify_rows(lambda index: flat.index_select(0, index), vocab,
                                   torch.arange(n * (g + 1)).view(n, g + 1), chains, *laws,
                                   KeyedNoise(seed_keys, positions))
    nxt = out.gather(1, num_acc[:, None]).squeeze(1)
    counts = Counter(zip(pick.tolist(), num_acc.tolist(), nxt.tolist()))
    law = _hsd_law(chains_all, q.double().expand(len(chains_all), g, vocab),
                   target_all) * q_seq[:, None, None]
    exact = {(r, i, y): float(law[r, i, y]) for r in range(len(chains_all))
             for i in range(g + 1) for y in range(vocab)}
    assert chi_square_pvalue(counts, exact, n) > 1e-4
    # the same seeds and positions draw the same chains and verdicts (no hidden state)
    again = hsd_verify_rows(lambda index: flat.index_select(0, index), vocab,
                            torch.arange(n * (g + 1)).view(n, g + 1), chains, *laws,
                            KeyedNoise(seed_keys, positions))
    assert torch.equal(keyed_chain(*laws, seed_keys, positions), chains)
    assert torch.equal(again[1], out)


def test_hsd_verify_sparse_consumes_the_generator_like_the_dense_one():
    """Same law, same generator state: the sparse and dense verifiers give the same output."""
    gen = torch.Generator().manual_seed(4)
    batch, g, vocab, k = 256, 3, 30, 30
    probs, ids = _random_sparse_law(batch, g, vocab, k, gen)
    pick = torch.multinomial(probs.view(-1, k), 1, generator=gen).view(batch, g, 1)
    chains = ids.gather(2, pick).squeeze(2)
    target = torch.randn(batch, g + 1, vocab, generator=gen).softmax(-1).double()
    dense = hsd_verify(chains, _densify(probs, ids, vocab), target, torch.Generator().manual_seed(9))
    sparse = hsd_verify_sparse(chains, probs, ids, target, torch.Generator().manual_seed(9))
    assert torch.equal(dense[0], sparse[0]) and torch.equal(dense[1], sparse[1])


def test_top_k_draft_law_and_packing():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -5.0]]])
    probs, ids = top_k_draft_law(logits, torch.tensor([1.0]), k=2)  # the docstring example
    assert ids.tolist() == [[[0, 1]]]
    torch.testing.assert_close(probs, torch.tensor([[[1 / (1 + math.exp(-1)), 1 / (1 + math.e)]]]))
    probs, ids = top_k_draft_law(logits, torch.tensor([0.0]), k=2)  # greedy: a point mass
    assert probs.tolist() == [[[1.0, 0.0]]] and ids.tolist() == [[[0, 1]]]
    probs, ids = top_k_draft_law(logits.expand(3, 2, 4), None, k=9)  # k > vocab, all greedy
    assert probs.shape == (3, 2, 4) and (probs[..., 0] == 1).all()
    big = torch.tensor([[[151935, 12]]])
    packed = pack_sparse_law(torch.tensor([[[0.7, 0.3]]]), big, vocab=151936)
    assert packed.dtype == torch.float32 and packed.shape == (1, 1, 4)
    p, i = unpack_sparse_law(packed)
    assert torch.equal(i, big) and torch.equal(p, torch.tensor([[[0.7, 0.3]]]))
    with pytest.raises(ValueError, match="vocab"):
        pack_sparse_law(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2, dtype=torch.long), vocab=1 << 25)
