"""Seeded requests draw with noise keyed by (seed, position) (plugin/sampler.py, sample_seeded).

Oracles: sequential decoding with the same noise (a seeded text must not depend on what was
drafted: every tree, chain or no draft at all gives the text of that one plain run), and the
exact law of the processed distribution (Monte Carlo over seeds, a chi-square bound).
"""

import itertools
from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.sampling import keyed_exponential, mix32, seed_key

pytest.importorskip("vllm")

from vllm_ddtree.plugin.sampler import sample_seeded, seeded_rows  # noqa: E402

VOCAB = 5


def metadata(seeds: dict[int, int], temperature: list[float], top_k=None, top_p=None):
    return SimpleNamespace(
        generators={r: torch.Generator().manual_seed(s) for r, s in seeds.items()},
        temperature=torch.tensor(temperature),
        top_k=None if top_k is None else torch.tensor(top_k),
        top_p=None if top_p is None else torch.tensor(top_p))


def test_mix32_is_the_same_on_ints_and_tensors_and_a_bijection():
    values = torch.arange(1 << 16, dtype=torch.int64) * 65537 + 12345
    hashed = mix32(values & 0xFFFFFFFF)
    assert hashed.unique().numel() == values.numel()
    assert hashed.min() >= 0 and hashed.max() < (1 << 32)
    assert [mix32(int(v) & 0xFFFFFFFF) for v in values[:50]] == hashed[:50].tolist()
    assert seed_key(2**64 - 1) == seed_key(-1)  # generators hold unsigned 64-bit seeds


def test_noise_depends_on_seed_and_position_only():
    keys = torch.tensor([seed_key(7), seed_key(7), seed_key(8)])
    noise = keyed_exponential(keys, torch.tensor([3, 4, 3]), 1000)
    alone = keyed_exponential(keys[1:2], torch.tensor([4]), 1000)
    assert torch.equal(noise[1], alone[0])  # the row's company does not matter
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert noise.min() > 0
    big = keyed_exponential(torch.tensor([seed_key(1)]), torch.tensor([0]), 200_000)[0]
    assert big.mean().item() == pytest.approx(1.0, abs=0.01)  # Exp(1)
    assert big.var().item() == pytest.approx(1.0, abs=0.03)


def test_sample_seeded_has_the_processed_law():
    """Over 6000 seeds: the frequencies of the tokens follow softmax(logits / T) after top-k
    (vLLM's semantics), within a chi-square bound (p = 1e-4)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    for top_k, temperature in ((None, 0.8), ([3], 1.3)):
        counts = torch.zeros(VOCAB)
        for seed in range(6000):
            md = metadata({0: seed}, [temperature], top_k=top_k)
            token = sample_seeded(logits.clone(), [0], [0], md, torch.tensor([17]))[1]
            counts[token] += 1
        scaled = logits[0] / temperature
        if top_k is not None:
            scaled[scaled < scaled.topk(top_k[0]).values[-1]] = float("-inf")
        expected = scaled.softmax(-1) * counts.sum()
        support = expected > 0
        assert counts[~support].sum() == 0
        chi2 = ((counts[support] - expected[support]) ** 2 / expected[support]).sum().item()
        assert chi2 < 23.5  # chi-square, 4 degrees of freedom, p = 1e-4


def _target_logits(prefix: tuple[int, ...]) -> torch.Tensor:
    """A small target: logits of the next token as a fixed random function of the prefix."""
    gen = torch.Generator().manual_seed(hash(prefix) % (2**31))
    return torch.randn(VOCAB, generator=gen) * 1.5


def test_a_seeded_text_does_not_depend_on_the_drafts():
    """Any draft tree walked with position noise emits exactly the tokens that decoding one
    token at a time with the same noise gives: the drafts change how many tokens a step
    emits, never which."""
    prompt, seed, ctx = (3, 1), 1234, 2
    md = metadata({0: seed}, [0.9])
    # plain decoding, one token per step, each drawn with its position's noise
    text = list(prompt)
    for _ in range(6):
        logits = _target_logits(tuple(text))[None]
        text.append(int(sample_seeded(logits, [0], [0], md, torch.tensor([len(text)]))[1]))
    # trees: all tokens of depth 1, two per deeper level (node -> parent index, -1 = root)
    for draft_seed in range(20):
        gen = torch.Generator().manual_seed(draft_seed)
        nodes = [(-1, t) for t in range(VOCAB)]
        for depth in range(2, 4):
            parents = [i for i, (p, _) in enumerate(nodes) if _depth(nodes, i) == depth - 1]
            for p in parents[:3]:
                nodes += [(p, int(t)) for t in torch.randperm(VOCAB, generator=gen)[:2]]
        rows = [tuple(prompt)] + [tuple(prompt) + _path(nodes, i) for i in range(len(nodes))]
        logits = torch.stack([_target_logits(r) for r in rows])
        positions = torch.tensor([ctx] + [ctx + _depth(nodes, i) for i in range(len(nodes))])
        sampled = sample_seeded(logits, list(range(len(rows))), [0] * len(rows),
                                metadata({0: seed}, [0.9]), positions)[1]
        # the walk: from the root, follow the child whose token is the sample
        emitted, node = [], -1
        while True:
            token = int(sampled[node + 1])
            emitted.append(token)
            child = next((i for i, (p, t) in enumerate(nodes) if p == node and t == token), None)
            if child is None:
                break
            node = child
        assert emitted == text[ctx: ctx + len(emitted)], f"draft seed {draft_seed}"


def _path(nodes, i) -> tuple[int, ...]:
    out = []
    while i >= 0:
        out.append(nodes[i][1])
        i = nodes[i][0]
    return tuple(reversed(out))


def _depth(nodes, i) -> int:
    return len(_path(nodes, i))


def test_seeded_rows_are_every_row_of_the_seeded_requests():
    md = metadata({2: 5, 0: 9}, [0.5, 0.0, 0.7])
    assert seeded_rows(md, [2, 1, 0]) == ([0, 1, 2, 5], [0, 0, 0, 2])
    assert seeded_rows(metadata({}, [0.5]), [3]) == ([], [])
    assert list(itertools.chain(*seeded_rows(md, [0, 0, 0]))) == [0, 2, 0, 2]
