"""Sampled-chain verifiers: exact losslessness, HSD >= token-wise, Monte Carlo of the batched code."""

import itertools
from collections import Counter, defaultdict

import pytest
import torch
from lossless_utils import TableModel, chi_square_pvalue, max_abs_diff

from vllm_ddtree.sampling import SamplingBatch, hsd_stop_probabilities, hsd_verify, tokenwise_verify

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
