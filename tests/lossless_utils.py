"""Small random "language models" over tiny vocabularies, for exact-law tests.

A model is a table of logits for every prefix up to a maximum length; its joint law over
sequences is the product of its processed conditionals, computed exactly in float64.
"""

import itertools
from collections import defaultdict

import torch
from scipy.stats import chi2

from vllm_ddtree.sampling import SamplingBatch, target_probs_from_logits


class TableModel:
    def __init__(self, vocab: int, max_len: int, seed: int, scale: float = 2.0):
        gen = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.max_len = max_len
        self.prefixes = [
            p for n in range(max_len) for p in itertools.product(range(vocab), repeat=n)
        ]
        self.index = {p: i for i, p in enumerate(self.prefixes)}
        self.logits = torch.randn(len(self.prefixes), vocab, generator=gen, dtype=torch.float64) * scale

    def processed(self, sampling: SamplingBatch | None) -> torch.Tensor:
        """``[num_prefixes, vocab]`` float64 probabilities of the processed distribution."""
        if sampling is not None:
            n = len(self.prefixes)
            sampling = SamplingBatch(
                temperature=sampling.temperature.expand(n),
                top_k=None if sampling.top_k is None else sampling.top_k.expand(n),
                top_p=None if sampling.top_p is None else sampling.top_p.expand(n),
            )
        probs = target_probs_from_logits(self.logits[:, None], sampling)[:, 0]
        return probs.double()

    def joint(self, probs: torch.Tensor, length: int) -> dict[tuple, float]:
        law = {}
        for seq in itertools.product(range(self.vocab), repeat=length):
            w = 1.0
            for i, tok in enumerate(seq):
                w *= float(probs[self.index[seq[:i]], tok])
            law[seq] = w
        return law

    def extend(self, probs: torch.Tensor, emitted_law: dict[tuple, float], length: int) -> dict:
        """Law of ``length`` tokens: emitted prefix, then the model's own continuation."""
        law = defaultdict(float)
        for prefix, w in emitted_law.items():
            if w == 0.0:
                continue
            stack = [(prefix, w)]
            while stack:
                seq, weight = stack.pop()
                if len(seq) == length:
                    law[seq] += weight
                    continue
                row = probs[self.index[seq]]
                for tok in range(self.vocab):
                    if row[tok] > 0:
                        stack.append((seq + (tok,), weight * float(row[tok])))
        return law


def max_abs_diff(a: dict, b: dict) -> float:
    keys = set(a) | set(b)
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in keys)


def chi_square_pvalue(counts: dict, probs: dict, total: int) -> float:
    """Pearson chi-square p-value of observed ``counts`` against exact ``probs``.

    Cells with expected count < 5 are pooled into one cell.
    """
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0.0, 0.0
    for key in set(counts) | set(probs):
        expected = probs.get(key, 0.0) * total
        observed = counts.get(key, 0)
        if expected < 5:
            pooled_obs += observed
            pooled_exp += expected
            continue
        stat += (observed - expected) ** 2 / expected
        dof += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-12)
        dof += 1
    elif pooled_obs > 0:
        return 0.0  # mass where the law has none
    return float(chi2.sf(stat, max(dof, 1)))
