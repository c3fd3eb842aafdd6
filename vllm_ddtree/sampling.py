"""Target-side sampling shared by every verifier, and lossless verification of SAMPLED chains.

- :class:`SamplingBatch` carries per-request sampling parameters; :func:`processed_logits` turns
  raw target logits into the distribution vLLM's sampler draws from (temperature, then top-k,
  then top-p, exactly the semantics of ``vllm/v1/sample/ops/topk_topp_sampler.py``);
  :func:`sample_tokens` draws one token per position without host synchronisation.
- :func:`hsd_verify` verifies a chain whose draft tokens were SAMPLED from the drafter with
  hierarchical speculative decoding with capped prefix ratios. Its stop probabilities and
  residuals coincide with block verification (Sun et al., arXiv 2403.10444), which is the form
  implemented here; it is lossless and accepts at least as much as :func:`tokenwise_verify`,
  the classic per-token rejection sampler kept as the baseline.

Glossary for chains: ``draft_probs[:, i]`` is the drafter distribution q_{i+1} the draft token
``x_{i+1} = draft_token_ids[:, i]`` was sampled from; ``target_probs[:, i]`` is the target
distribution p_{i+1} of token i + 1 given ``x_1..x_i`` (row g: the bonus distribution after the
whole chain). Outputs follow vLLM's layout: accepted tokens, then one recovered or bonus token,
then -1 padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "SAMPLING_EPS",
    "SamplingBatch",
    "processed_logits",
    "target_probs_from_logits",
    "sample_tokens",
    "sample_from_probs",
    "hsd_stop_probabilities",
    "hsd_verify",
    "tokenwise_verify",
]

SAMPLING_EPS = 1e-5  # temperature below this is greedy (vLLM's _SAMPLING_EPS)
PLACEHOLDER_TOKEN_ID = -1


@dataclass(frozen=True)
class SamplingBatch:
    """Per-request sampling parameters of a batch (vLLM's ``SamplingMetadata``, reduced).

    ``temperature < SAMPLING_EPS`` means greedy (argmax of the raw logits). ``top_k`` values
    ``<= 0`` or ``>= vocab`` disable top-k; ``top_p == 1`` disables top-p. Rows listed in
    ``generators`` draw their randomness from their own generator (seeded requests); the others
    from the default generator of the device.

    NOTE: when every request is greedy (vLLM's ``SamplingMetadata.all_greedy``), pass
    ``sampling=None`` to the verifiers instead: a SamplingBatch always runs the random path
    for every row (choosing per row on the device, without a host sync), which costs a
    softmax and one exponential draw per logit.

    Example (vLLM's metadata, three requests, the second seeded)::

        SamplingBatch(temperature=torch.tensor([0.0, 0.7, 1.0]),   # request 0 is greedy
                      top_k=torch.tensor([0, 50, 0]),              # 0: no top-k
                      top_p=torch.tensor([1.0, 0.9, 1.0]),         # 1.0: no top-p
                      generators={1: torch.Generator().manual_seed(42)})
    """

    temperature: torch.Tensor  # [batch] float32
    top_k: torch.Tensor | None = None  # [batch] int64
    top_p: torch.Tensor | None = None  # [batch] float32
    generators: dict[int, torch.Generator] | None = None

    @property
    def is_greedy(self) -> torch.Tensor:
        """``[batch]`` bool."""
        return self.temperature < SAMPLING_EPS


def _check_logits(logits: torch.Tensor, sampling: SamplingBatch) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits.shape={tuple(logits.shape)}, expected [batch, positions, vocab]")
    batch = logits.shape[0]
    for name in ("temperature", "top_k", "top_p"):
        value = getattr(sampling, name)
        if value is not None and value.shape != (batch,):
            raise ValueError(f"sampling.{name}.shape={tuple(value.shape)}, expected ({batch},)")


def processed_logits(logits: torch.Tensor, sampling: SamplingBatch) -> torch.Tensor:
    """The logits vLLM's sampler draws from: ``[batch, n, vocab]`` -> float32 (float64 stays
    float64), same shape.

    Temperature (greedy rows use 1), then top-k (keeps every logit >= the k-th largest, ties
    included), then top-p on what is left (drops the smallest tokens whose cumulative
    probability stays <= 1 - p, always keeping the largest), masked entries set to -inf.
    """
    _check_logits(logits, sampling)
    batch, n, vocab = logits.shape
    temperature = torch.where(sampling.is_greedy, 1.0, sampling.temperature.float())
    out = logits.to(torch.promote_types(logits.dtype, torch.float32))
    out = out / temperature[:, None, None].to(out.dtype)
    if sampling.top_k is None and sampling.top_p is None:
        return out
    flat = out.reshape(batch * n, vocab)
    sorted_logits, sorted_idx = flat.sort(dim=-1, descending=False)
    if sampling.top_k is not None:
        k = sampling.top_k.to(torch.int64)
        k = torch.where((k <= 0) | (k > vocab), vocab, k).repeat_interleave(n)
        kth = sorted_logits.gather(1, (vocab - k)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if sampling.top_p is not None:
        p = sampling.top_p.to(out.dtype).repeat_interleave(n)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - p[:, None]
        drop[:, -1] = False  # at least one token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    flat = flat.scatter(1, sorted_idx, sorted_logits)
    return flat.view(batch, n, vocab)


def target_probs_from_logits(logits: torch.Tensor, sampling: SamplingBatch | None) -> torch.Tensor:
    """``[batch, n, vocab]`` probabilities of the processed target distribution.

    Greedy rows (and ``sampling=None``) get a one-hot at the argmax of the raw logits.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    greedy = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(dtype)
    if sampling is None:
        return greedy
    probs = processed_logits(logits, sampling).softmax(dim=-1)
    return torch.where(sampling.is_greedy[:, None, None], greedy, probs)


def _exponential_noise(
    shape: tuple[int, ...],
    device: torch.device,
    generators: dict[int, torch.Generator] | None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Exp(1) noise ``shape = [batch, ...]``; row i comes from ``generators[i]`` when given."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    noise.exponential_(generator=generator)
    # NOTE: a Python loop over the seeded rows, as in vLLM's sampler: host work, no device sync.
    for row, gen in (generators or {}).items():
        noise[row].exponential_(generator=gen)
    return noise


def sample_from_probs(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator] | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row of ``probs [batch, ..., vocab]`` by the exponential race (no sync).

    argmax(p / E) with E ~ Exp(1) i.i.d. is a sample from p (same trick as vLLM's sampler).
    """
    noise = _exponential_noise(tuple(probs.shape), probs.device, generators, generator)
    return (probs / noise).argmax(dim=-1)


def sample_tokens(logits: torch.Tensor, sampling: SamplingBatch | None) -> torch.Tensor:
    """One target token per position: ``[batch, n, vocab]`` -> ``[batch, n]`` int64.

    Greedy rows take the argmax of the raw logits; the others sample from
    :func:`processed_logits` with their own generator when they have one.
    """
    greedy = logits.argmax(dim=-1)
    if sampling is None:
        return greedy
    probs = processed_logits(logits, sampling).softmax(dim=-1)
    sampled = sample_from_probs(probs, sampling.generators)
    return torch.where(sampling.is_greedy[:, None], greedy, sampled)


def _check_chain(draft_token_ids, draft_probs, target_probs) -> None:
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids.shape={tuple(draft_token_ids.shape)}, expected [batch, g]")
    batch, g = draft_token_ids.shape
    if draft_probs.dim() != 3 or draft_probs.shape[:2] != (batch, g):
        raise ValueError(f"draft_probs.shape={tuple(draft_probs.shape)}, expected [{batch}, {g}, vocab]")
    vocab = draft_probs.shape[2]
    if tuple(target_probs.shape) != (batch, g + 1, vocab):
        raise ValueError(
            f"target_probs.shape={tuple(target_probs.shape)}, expected [{batch}, {g + 1}, {vocab}]"
        )


def _draft_ratios(draft_token_ids, draft_probs, target_probs) -> torch.Tensor:
    """``[batch, g]`` p_i(x_i) / q_i(x_i) in float64 (inf when q_i(x_i) = 0)."""
    g = draft_token_ids.shape[1]
    ids = draft_token_ids[..., None].long()
    p = target_probs[:, :g].double().gather(2, ids).squeeze(2)
    q = draft_probs.double().gather(2, ids).squeeze(2)
    return torch.where(q > 0, p / q.clamp(min=1e-300), torch.inf)


def hsd_stop_probabilities(
    draft_token_ids: torch.Tensor,  # [batch, g]
    draft_probs: torch.Tensor,  # [batch, g, vocab]
    target_probs: torch.Tensor,  # [batch, g + 1, vocab]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stop probabilities and residuals of capped HSD (= block verification).

    With capped prefix ratios p_0 = 1, p_i = min(1, p_{i-1} * p_i(x_i) / q_i(x_i)):

    - Z_i = sum_v max(p_i * p_{i+1}(v) - q_{i+1}(v), 0) for i < g,
    - h_i = Z_i / (Z_i + 1 - p_i) for 0 < i < g, h_0 = 1, h_g = p_g,
    - residual_i = max(p_i * p_{i+1} - q_{i+1}, 0) for i < g (unnormalised), residual_g = p_{g+1}.

    Scanning i = g, g-1, ..., 0 with independent eta_i ~ U(0, 1), the verifier stops at the first
    i with eta_i <= h_i, accepts x_1..x_i and draws the next token from normalised residual_i.

    Returns ``(h [batch, g + 1] float64, residual [batch, g + 1, vocab] float64)``.
    """
    _check_chain(draft_token_ids, draft_probs, target_probs)
    batch, g = draft_token_ids.shape
    ratios = _draft_ratios(draft_token_ids, draft_probs, target_probs)
    prefix = [torch.ones(batch, dtype=torch.float64, device=ratios.device)]
    for i in range(g):
        prefix.append(torch.clamp(prefix[-1] * ratios[:, i], max=1.0))
    prefix = torch.stack(prefix, dim=1)  # [batch, g + 1]: p_0 .. p_g
    p_next = target_probs.double()  # p_{i+1} at index i
    q_next = draft_probs.double()
    residual = torch.clamp(prefix[:, :g, None] * p_next[:, :g] - q_next, min=0.0)
    z = residual.sum(dim=-1)  # [batch, g]
    denom = z + 1.0 - prefix[:, :g]
    h_inner = torch.where(denom > 0, z / denom.clamp(min=1e-300), 0.0)
    h = torch.cat([h_inner, prefix[:, g:]], dim=1)
    h[:, 0] = 1.0
    residual = torch.cat([residual, p_next[:, g:]], dim=1)
    return h, residual


def _finish_chain(draft_token_ids, num_accepted, residual, generator) -> torch.Tensor:
    """Draw the next token from ``residual[r, num_accepted[r]]`` (unnormalised) and lay out
    ``[batch, g + 1]``: accepted drafts, then that token, then -1."""
    batch, g = draft_token_ids.shape
    dist = residual.gather(1, num_accepted[:, None, None].expand(-1, 1, residual.shape[2]))
    next_token = sample_from_probs(dist.squeeze(1).float(), generator=generator)
    cols = torch.arange(g + 1, device=draft_token_ids.device)
    padded = torch.cat([draft_token_ids.long(), draft_token_ids.new_zeros(batch, 1).long()], dim=1)
    out = torch.where(cols < num_accepted[:, None], padded, PLACEHOLDER_TOKEN_ID)
    return out.scatter(1, num_accepted[:, None], next_token[:, None])


def hsd_verify(
    draft_token_ids: torch.Tensor,  # [batch, g]
    draft_probs: torch.Tensor,  # [batch, g, vocab]
    target_probs: torch.Tensor,  # [batch, g + 1, vocab]
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless verification of sampled chains with capped HSD (block verification form).

    Returns ``(num_accepted [batch] int64, output_tokens [batch, g + 1] int64)``.

    Example: g = 3 and h = [1, .9, .2, .1] with eta = [*, .5, .7, .3]: scanning from i = 3,
    eta_3 = .3 > .1, eta_2 = .7 > .2, eta_1 = .5 <= .9, so x_1 is accepted and the next token
    is drawn from residual_1: output [x_1, y, -1, -1].
    """
    h, residual = hsd_stop_probabilities(draft_token_ids, draft_probs, target_probs)
    batch, g = draft_token_ids.shape
    eta = torch.rand((batch, g + 1), dtype=torch.float64, device=h.device, generator=generator)
    stop = eta <= h
    stop[:, 0] = True
    levels = torch.arange(g + 1, device=h.device)
    num_accepted = torch.where(stop, levels, 0).amax(dim=1)  # deepest level that stops
    return num_accepted, _finish_chain(draft_token_ids, num_accepted, residual, generator)


def tokenwise_verify(
    draft_token_ids: torch.Tensor,  # [batch, g]
    draft_probs: torch.Tensor,  # [batch, g, vocab]
    target_probs: torch.Tensor,  # [batch, g + 1, vocab]
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Classic speculative sampling (Leviathan et al.): the baseline for :func:`hsd_verify`.

    Accepts x_i with probability min(1, p_i(x_i) / q_i(x_i)) until the first rejection, then
    draws from norm(max(p_i - q_i, 0)); a fully accepted chain draws the bonus from p_{g+1}.
    """
    _check_chain(draft_token_ids, draft_probs, target_probs)
    batch, g = draft_token_ids.shape
    accept_prob = torch.clamp(_draft_ratios(draft_token_ids, draft_probs, target_probs), max=1.0)
    u = torch.rand((batch, g), dtype=torch.float64, device=accept_prob.device, generator=generator)
    accepted = (u <= accept_prob).long().cumprod(dim=1)
    num_accepted = accepted.sum(dim=1)
    residual = torch.clamp(target_probs[:, :g].double() - draft_probs.double(), min=0.0)
    residual = torch.cat([residual, target_probs[:, g:].double()], dim=1)
    return num_accepted, _finish_chain(draft_token_ids, num_accepted, residual, generator)
