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
- Sparse draft laws: the vLLM plugin draws its chains from :func:`top_k_draft_law` (the
  drafter's distribution restricted to its K most likely tokens) and verifies them with
  :func:`sparse_hsd_stop_probabilities` and :func:`sparse_hsd_residual`, which need the target
  law only at the K support tokens of each position and one full row per request (the stop
  level's residual): no ``[batch, g + 1, vocab]`` float64 tensor. HSD is lossless for ANY draft
  law as long as the chain is drawn from it and verified against it.
  :func:`hsd_verify_sparse` composes them on dense target probabilities (tests, oracle).
- Flat verify rows (vLLM's ``[T, V]`` logits, request-major): :func:`sample_rows` and
  :func:`hsd_verify_rows` run vLLM's own sampling ops (injected: this module imports nothing
  from vLLM) on one :func:`row_chunks` chunk of rows at a time, so their extra memory is
  bounded by a few chunks whatever T is; :func:`verify_rows` arranges the rows per request.

Glossary for chains: ``draft_probs[:, i]`` is the drafter distribution q_{i+1} the draft token
``x_{i+1} = draft_token_ids[:, i]`` was sampled from; ``target_probs[:, i]`` is the target
distribution p_{i+1} of token i + 1 given ``x_1..x_i`` (row g: the bonus distribution after the
whole chain). Outputs follow vLLM's layout: accepted tokens, then one recovered or bonus token,
then -1 padding.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from vllm_ddtree.kernels.native import cpu_ops

__all__ = [
    "SAMPLING_EPS",
    "argmax_rows",
    "SamplingBatch",
    "processed_logits",
    "target_probs_from_logits",
    "sample_tokens",
    "sample_from_probs",
    "hsd_stop_probabilities",
    "hsd_verify",
    "tokenwise_verify",
    "ROW_CHUNK_ELEMENTS",
    "row_chunks",
    "DRAFT_LAW_TOP_K",
    "top_k_draft_law",
    "keyed_chain",
    "pack_sparse_law",
    "unpack_sparse_law",
    "deepest_stop",
    "chain_output",
    "sparse_hsd_stop_probabilities",
    "sparse_hsd_residual",
    "hsd_verify_sparse",
    "hsd_verify_rows",
    "verify_rows",
    "RowSampling",
    "sample_rows",
    "processed_probs_of_rows",
    "mix32",
    "seed_key",
    "seed_keys_of",
    "stream_keys",
    "keyed_uniform",
    "keyed_exponential",
    "HsdNoise",
    "GeneratorNoise",
    "KeyedNoise",
]

SAMPLING_EPS = 1e-5  # temperature below this is greedy (vLLM's _SAMPLING_EPS)
PLACEHOLDER_TOKEN_ID = -1
# Logits entries one chunk of rows holds: 64 MiB of float32, 110 rows of Qwen3's 151936-token
# vocabulary. Sorting a chunk (vLLM's native top-k/top-p op: float values, int64 indices,
# softmax, masks) costs ~5.5x the chunk, so a chunked sampler adds ~0.35 GiB at most, whatever
# the number of rows; ~10 chunks for 4 requests x 257 rows keep the kernel launches few.
ROW_CHUNK_ELEMENTS = 1 << 24
# Support of the draft law sampled chains are drawn from (per position): the drafter's K most
# likely tokens, renormalised. The law travels from the proposal to the verify step as
# [R, B, K] probabilities and ids instead of [R, B, vocab].
DRAFT_LAW_TOP_K = 64
_FLOAT32_EXACT_INT = 1 << 24  # every integer below 2**24 is exact in float32


def row_chunks(num_rows: int, vocab: int, max_elements: int | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` ranges covering ``num_rows`` rows, ``max(1, max_elements // vocab)`` rows
    each (the last one shorter); ``max_elements`` defaults to :data:`ROW_CHUNK_ELEMENTS`.

    Example: 300 rows of a 151936-token vocabulary -> ``[(0, 110), (110, 220), (220, 300)]``.
    """
    if max_elements is None:
        max_elements = ROW_CHUNK_ELEMENTS  # read at call time (tests shrink it)
    step = max(1, max_elements // max(vocab, 1))
    return [(start, min(start + step, num_rows)) for start in range(0, num_rows, step)]


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

    The reference law (exact-law tests, the transformers engine): it sorts the whole vocabulary
    with float and int64 copies, ~4x its input. The vLLM plugin samples with vLLM's own op, one
    :func:`row_chunks` chunk at a time.
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


# ---------------------------------------------------------------------------------------------
# flat verify rows: vLLM's [T, V] logits, sampled one chunk of rows at a time

# vLLM's sampling ops, injected so that this module imports nothing from vLLM:
# ``TopKTopPSampler.__call__(logits [n, V], generators {row: gen}, top_k [n] | None,
# top_p [n] | None) -> (tokens [n], _)`` and ``apply_top_k_top_p(logits [n, V], top_k, top_p)
# -> logits`` (masked entries -inf). Both may update ``logits`` in place.
SampleOp = Callable[[torch.Tensor, dict, torch.Tensor | None, torch.Tensor | None], tuple]
MaskOp = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], torch.Tensor]


_ARANGES: dict[torch.device, torch.Tensor] = {}


def cached_arange(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` int64 on ``device`` without a launch: a view of one cached table per
    device (grown by doubling), shared by every per-step index of the plugin."""
    table = _ARANGES.get(device)
    if table is None or table.numel() < n:
        table = _ARANGES[device] = torch.arange(max(2 * n, 1024), device=device)
    return table[:n]


def verify_rows(cu_num_rows: torch.Tensor, width: int) -> torch.Tensor:
    """``[R, width + 1]`` int64 flat row of each request's root and nodes, on the device.

    Request r owns rows ``[cu[r - 1], cu[r])`` (vLLM's ``cu_num_sampled_tokens``: m_r + 1 rows,
    request-major); columns past m_r repeat its last row (padding nodes, never reached by the
    walk). Example: num_draft [3, 0, 2] -> cu [4, 5, 8]; width 3 ->
    ``[[0, 1, 2, 3], [4, 4, 4, 4], [5, 6, 7, 7]]``.
    """
    ends = cu_num_rows.long()
    columns = cached_arange(width + 1, ends.device)
    starts = torch.cat([columns[:1], ends[:-1]])  # columns[0] is 0
    return torch.minimum(starts[:, None] + columns, ends[:, None] - 1)


@dataclass(frozen=True)
class RowSampling:
    """Per-request sampling parameters expanded to the T flat rows (vLLM's ops take rows)."""

    temperature: torch.Tensor  # [T] float32, 1 on greedy rows (may be a broadcast view)
    is_greedy: torch.Tensor | None  # [T] bool; None: no row is greedy
    top_k: torch.Tensor | None  # [T] in [1, vocab] (vocab: no top-k)
    top_p: torch.Tensor | None  # [T]
    generators: tuple[tuple[int, torch.Generator], ...]  # (row, generator) of seeded rows, by row

    @classmethod
    def expand(cls, sampling: SamplingBatch, cu_num_rows: torch.Tensor, num_draft: list[int],
               vocab: int, all_random: bool = False, top_k_in_range: bool = False) -> RowSampling:
        """Expand ``sampling`` (one entry per request) to rows, on the device: no per-row host
        data but the seeded rows' generators, which vLLM's op takes as a dict keyed by row.
        ``all_random`` (vLLM's ``SamplingMetadata.all_random``: no request is greedy) skips
        the greedy rows' bookkeeping: ``is_greedy`` is None. ``top_k_in_range``: every top-k is
        already in [1, vocab] (vLLM's ``InputBatch`` stores the vocabulary size for "no
        top-k"), so it is taken as it is.

        When every request has the same m drafts, request r owns rows ``r (m + 1) ..`` and its
        parameters are broadcast to ``[R, m + 1]``, the expansion folded into the op that
        makes each field; otherwise each field is indexed by the request of each row.

        Example: num_draft [1, 2] (cu [2, 5]), temperature [0.6, 0.0], request 0 seeded with g ->
        temperature [0.6, 0.6, 1.0, 1.0, 1.0], generators ((0, g), (1, g)).
        """
        num_rows = sum(num_draft) + len(num_draft)
        if len(set(num_draft)) == 1:
            shape = (len(num_draft), num_draft[0] + 1)

            def per_row(values: torch.Tensor) -> torch.Tensor:  # [R] -> [R, m + 1] view
                return values[:, None].expand(shape)
        else:
            row = torch.arange(num_rows, dtype=cu_num_rows.dtype, device=cu_num_rows.device)
            request = torch.searchsorted(cu_num_rows, row, right=True)  # [T] request of each row

            def per_row(values: torch.Tensor) -> torch.Tensor:  # [R] -> [T]
                return values[request]
        temperature = per_row(sampling.temperature.float())
        is_greedy = None
        if not all_random:
            is_greedy = (temperature < SAMPLING_EPS).reshape(num_rows)
            temperature = torch.where(is_greedy.view(temperature.shape), 1.0, temperature)
        # NOTE: vLLM's ops read their per-row parameters as contiguous rows
        top_k = top_p = None
        if sampling.top_k is not None:
            k = per_row(sampling.top_k)
            if not top_k_in_range:  # 0 or above vocab: no top-k
                k = torch.where(k > 0, k, vocab).clamp_(max=vocab)
            top_k = k.contiguous().view(num_rows)
        if sampling.top_p is not None:
            top_p = per_row(sampling.top_p).contiguous().view(num_rows)
        starts = [0, *itertools.accumulate(m + 1 for m in num_draft)]  # host, per request
        generators = tuple(sorted(
            ((starts[r] + i, gen) for r, gen in (sampling.generators or {}).items()
             for i in range(num_draft[r] + 1)), key=lambda pair: pair[0]))
        return cls(temperature.reshape(num_rows), is_greedy, top_k, top_p, generators)

    def generators_in(self, start: int, end: int) -> dict[int, torch.Generator]:
        """The seeded rows in ``[start, end)``, keyed by row - start, in row order."""
        rows = [row for row, _ in self.generators]
        lo, hi = bisect.bisect_left(rows, start), bisect.bisect_left(rows, end)
        return {row - start: gen for row, gen in self.generators[lo:hi]}


def _take(values: torch.Tensor | None, index) -> torch.Tensor | None:
    return None if values is None else values[index]


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits [T, V]`` -> ``[T]`` int64: ``logits.argmax(dim=-1)`` (the first index of the
    largest value; the first NaN where there is one). On the CPU, float32 rows go to the fused
    op (one vectorised pass per row, ``torch.ops.ddtree.argmax_rows``), equal to torch's."""
    ops = cpu_ops(logits.device)
    if ops is not None and logits.dtype == torch.float32 and logits.dim() == 2 and \
            logits.shape[1] > 0 and logits.stride(1) == 1:
        return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def sample_rows(logits: torch.Tensor, rows: RowSampling | None, sample_op: SampleOp,
                all_random: bool = False, features: RowFeatures | None = None) -> torch.Tensor:
    """One target token per flat row: ``logits [T, V]`` -> ``[T]`` int64.

    Greedy rows: argmax of the raw logits (no copy; skipped when ``all_random`` or when
    ``rows.is_greedy`` is None). The others:
    ``sample_op`` (vLLM's top-k/top-p sampler) on one :func:`row_chunks` chunk at a time, each
    a float32 copy divided by the temperature (the op may update it in place), freed before the
    next one: the extra memory is about what the op costs on one chunk. Seeded rows draw from
    their generator in row order, wherever the chunks fall.

    ``features`` (per-request logits processing, e.g. the plugin's ``TreeFeatures``): every
    chunk is processed before the temperature (``features.apply``) and after it
    (``features.after_temperature``), and greedy rows take the argmax of the processed chunk.
    """
    if features is None:
        if rows is None:
            return argmax_rows(logits)
        greedy = None if all_random or rows.is_greedy is None else argmax_rows(logits)
    else:
        greedy = None if rows is not None and (all_random or rows.is_greedy is None) else []
    num_rows, vocab = logits.shape
    parts = []
    for start, end in row_chunks(num_rows, vocab):
        part = slice(start, end)
        if features is None:
            chunk = torch.div(logits[part], rows.temperature[part, None])  # [c, V] float32
        else:
            row_ids = cached_arange(num_rows, logits.device)[part]
            chunk = features.apply(logits[part].to(torch.float32, copy=True), row_ids)
            if greedy is not None:
                greedy.append(argmax_rows(chunk))
            if rows is None:
                continue
            chunk = features.after_temperature(chunk.div_(rows.temperature[part, None]), row_ids)
        tokens, _ = sample_op(chunk, rows.generators_in(start, end), _take(rows.top_k, part),
                              _take(rows.top_p, part))
        parts.append(tokens)
        del chunk, tokens  # before the next chunk's copy
    if isinstance(greedy, list):
        greedy = torch.cat(greedy) if greedy else None
        if rows is None:
            return greedy if greedy is not None else logits.new_empty(0, dtype=torch.int64)
    if not parts:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    sampled = (parts[0] if len(parts) == 1 else torch.cat(parts)).long()
    return sampled if greedy is None else torch.where(rows.is_greedy, greedy, sampled)


class RowFeatures(Protocol):
    """Per-row logits processing for :func:`sample_rows` (``logits [c, V]`` float32 of the flat
    rows ``row_ids [c]``, updated in place and returned)."""

    def apply(self, logits: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor: ...

    def after_temperature(self, logits: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor: ...


# ---------------------------------------------------------------------------------------------
# seeded requests: noise that is a function of (seed, position) only

_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """``x * c mod 2**32`` for 32-bit ``x`` (Python int or int64 tensor) without int64
    overflow: the constant is split in 16-bit halves, each product stays below 2**48."""
    return ((((x * (c >> 16)) & 0xFFFF) << 16) + x * (c & 0xFFFF)) & _M32


def mix32(x):
    """A bijective 32-bit integer hash (Chris Wellons' "lowbias32"), for Python ints and int64
    tensors alike (values in [0, 2**32)). Example: ``mix32(0) == 0``, ``mix32(1) == 0x688990c0``."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """A request seed (any Python int: vLLM's generators hold unsigned 64-bit seeds) -> 32 bits."""
    seed &= (1 << 64) - 1
    return mix32(mix32(seed & _M32) ^ (seed >> 32))


def seed_keys_of(seeds: torch.Tensor) -> torch.Tensor:
    """:func:`seed_key` of every value of an int64 tensor (two's complement: -1 is 2**64 - 1),
    on its device."""
    return mix32(mix32(seeds & _M32) ^ ((seeds >> 32) & _M32))


# the streams of a seeded request's noise besides its target rows' (stream_keys' salts)
DRAFT_STREAM, ETA_STREAM, RESIDUAL_STREAM = 0x5EED0001, 0x5EED0002, 0x5EED0003


def _position_keys(seed_keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``mix32(seed_key ^ position)`` of each request: the key of its target noise at that
    position (:func:`keyed_exponential`), on ``positions``' device."""
    return mix32((seed_keys.to(positions.device) ^ (positions.long() & _M32)) & _M32)


def stream_keys(seed_keys: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """The 32-bit key of the noise of ``stream`` (one of ``*_STREAM``) at ``positions``, of the
    requests with ``seed_keys``: apart from :func:`keyed_exponential`'s, and from each
    other's."""
    return mix32(_position_keys(seed_keys, positions) ^ stream)


def keyed_uniform(keys: torch.Tensor, width: int) -> torch.Tensor:
    """``[n, width]`` float64 uniforms in (0, 1), a function of ``keys [n]`` (32-bit values,
    int64) only: column c of row i is ``(mix32(mix32(c ^ 0x9E3779B9) ^ keys[i]) + 0.5) / 2**32``."""
    device = keys.device
    column = mix32(torch.arange(width, dtype=torch.int64, device=device) ^ 0x9E3779B9)
    bits = mix32(column[None, :] ^ keys[:, None])
    return (bits.double() + 0.5) * (1.0 / 4294967296.0)


def keyed_exponential(seed_keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[n, vocab]`` float32 Exp(1) noise of row i: a function of ``(seed_keys[i],
    positions[i])`` only (int64 tensors of n values, :func:`seed_key` and the absolute position
    of the token being sampled), on their device, without a host synchronisation.

    Each row hashes every vocabulary index with its key (:func:`keyed_uniform` with ``key =
    mix32(seed_key ^ position)``), then ``-log(u)``. The exponential race ``argmax(p / E)``
    with this noise is a sample from ``p`` whose randomness belongs to the position, not to
    the order of draws: whatever rows a step verifies (tree, chain, none), the token emitted
    at a position of a seeded request is drawn with that position's noise.
    """
    return (-keyed_uniform(_position_keys(seed_keys, positions), vocab).log()).float()


def processed_probs_of_rows(logits: torch.Tensor, index: torch.Tensor, rows: RowSampling,
                            mask_op: MaskOp) -> torch.Tensor:
    """``[n, V]`` float64 processed target law of the flat rows ``index [n]`` (callers keep n
    to one :func:`row_chunks` chunk): temperature, then ``mask_op`` (vLLM's top-k/top-p), then
    softmax. Greedy rows are not special-cased (temperature 1)."""
    chunk = logits.index_select(0, index)
    chunk = chunk if chunk.dtype == torch.float32 else chunk.float()
    chunk.div_(rows.temperature[index][:, None])
    chunk = mask_op(chunk, _take(rows.top_k, index), _take(rows.top_p, index))
    return torch.softmax(chunk, dim=-1, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# sampled chains, dense laws


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


def _ratios(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """``[batch, g]`` p_i(x_i) / q_i(x_i) in float64 (inf when q_i(x_i) = 0)."""
    p, q = p_draft.double(), q_draft.double()
    return torch.where(q > 0, p / q.clamp(min=1e-300), torch.inf)


def _draft_ratios(draft_token_ids, draft_probs, target_probs) -> torch.Tensor:
    """``[batch, g]`` p_i(x_i) / q_i(x_i) in float64 (inf when q_i(x_i) = 0)."""
    g = draft_token_ids.shape[1]
    ids = draft_token_ids[..., None].long()
    p = target_probs[:, :g].double().gather(2, ids).squeeze(2)
    q = draft_probs.double().gather(2, ids).squeeze(2)
    return _ratios(p, q)


def _capped_prefix(ratios: torch.Tensor) -> torch.Tensor:
    """``[batch, g]`` ratios -> ``[batch, g + 1]`` float64 p_0 = 1, p_i = min(1, p_{i-1} * ratio_i)."""
    prefix = [torch.ones(ratios.shape[0], dtype=torch.float64, device=ratios.device)]
    for i in range(ratios.shape[1]):
        prefix.append(torch.clamp(prefix[-1] * ratios[:, i], max=1.0))
    return torch.stack(prefix, dim=1)


def _stop_probabilities(prefix: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """h_0 = 1, h_i = Z_i / (Z_i + 1 - p_i) for 0 < i < g, h_g = p_g: ``[batch, g + 1]``."""
    g = z.shape[1]
    denom = z + 1.0 - prefix[:, :g]
    h_inner = torch.where(denom > 0, z / denom.clamp(min=1e-300), 0.0)
    h = torch.cat([h_inner, prefix[:, g:]], dim=1)
    h[:, 0] = 1.0
    return h


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

    Returns ``(h [batch, g + 1] float64, residual [batch, g + 1, vocab] float64)``. The dense
    oracle of :func:`sparse_hsd_stop_probabilities` / :func:`sparse_hsd_residual`.
    """
    _check_chain(draft_token_ids, draft_probs, target_probs)
    g = draft_token_ids.shape[1]
    prefix = _capped_prefix(_draft_ratios(draft_token_ids, draft_probs, target_probs))
    p_next = target_probs.double()  # p_{i+1} at index i
    q_next = draft_probs.double()
    residual = torch.clamp(prefix[:, :g, None] * p_next[:, :g] - q_next, min=0.0)
    h = _stop_probabilities(prefix, residual.sum(dim=-1))
    residual = torch.cat([residual, p_next[:, g:]], dim=1)
    return h, residual


def deepest_stop(h: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
    """The backward scan's stop level: the deepest i with ``eta_i <= h_i`` (level 0 always
    stops). ``h, eta [batch, g + 1]`` -> ``[batch]`` int64 number of accepted drafts.

    Example: h = [1, .9, .2, .1], eta = [*, .5, .7, .3] -> 1 (eta_1 = .5 <= .9 is the deepest).
    """
    stop = eta <= h
    stop[:, 0] = True
    levels = torch.arange(h.shape[1], device=h.device)
    return torch.where(stop, levels, 0).amax(dim=1)


def chain_output(draft_token_ids: torch.Tensor, num_accepted: torch.Tensor,
                 next_token: torch.Tensor) -> torch.Tensor:
    """vLLM's layout of a verified chain: ``[batch, g + 1]`` int64, the accepted drafts, the next
    (recovered or bonus) token, then -1.

    Example: drafts [5, 6, 7], 1 accepted, next token 9 -> ``[5, 9, -1, -1]``.
    """
    batch, g = draft_token_ids.shape
    cols = torch.arange(g + 1, device=draft_token_ids.device)
    padded = torch.cat([draft_token_ids.long(), draft_token_ids.new_zeros(batch, 1).long()], dim=1)
    out = torch.where(cols < num_accepted[:, None], padded, PLACEHOLDER_TOKEN_ID)
    return out.scatter(1, num_accepted[:, None], next_token.long()[:, None])


def _finish_chain(draft_token_ids, num_accepted, residual, generator) -> torch.Tensor:
    """Draw the next token from ``residual[r, num_accepted[r]]`` (unnormalised) and lay out
    ``[batch, g + 1]`` with :func:`chain_output`."""
    dist = residual.gather(1, num_accepted[:, None, None].expand(-1, 1, residual.shape[2]))
    next_token = sample_from_probs(dist.squeeze(1).float(), generator=generator)
    return chain_output(draft_token_ids, num_accepted, next_token)


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
    num_accepted = deepest_stop(h, eta)
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


# ---------------------------------------------------------------------------------------------
# sparse draft laws: the chain's law on K tokens per position


def top_k_draft_law(
    draft_logits: torch.Tensor,  # [batch, g, vocab]
    temperature: torch.Tensor | None,  # [batch]; None: every row greedy
    k: int | None = None,  # None: DRAFT_LAW_TOP_K, read at call time
) -> tuple[torch.Tensor, torch.Tensor]:
    """The law a sampled chain is drawn from: softmax(logits / T) on the ``k`` largest logits of
    each position, renormalised. Greedy rows (T < SAMPLING_EPS) put all the mass on the first
    of them (a point mass: HSD then reduces to the walk).

    Top-k of the raw logits picks the same support as top-k of logits / T, so no
    ``[batch, g, vocab]`` copy is made. Returns ``(probs [batch, g, k'] float32, ids [batch, g,
    k'] int64)``, k' = min(k, vocab), ids in descending logit order.

    Example: logits [2, 1, 0, -5] at T = 1, k = 2 -> ids [0, 1], probs [e / (e + 1), 1 / (e + 1)]
    = [.731, .269]; at T = 0 -> probs [1, 0].
    """
    if draft_logits.dim() != 3:
        raise ValueError(f"draft_logits.shape={tuple(draft_logits.shape)}, expected [batch, g, vocab]")
    k = DRAFT_LAW_TOP_K if k is None else k
    values, ids = draft_logits.topk(min(k, draft_logits.shape[2]), dim=-1)  # [batch, g, k']
    point = torch.zeros_like(values, dtype=torch.float32)
    point[..., 0] = 1.0
    if temperature is None:
        return point, ids
    greedy = temperature < SAMPLING_EPS
    scale = torch.where(greedy, 1.0, temperature.float())
    probs = (values.float() / scale[:, None, None]).softmax(dim=-1)
    return torch.where(greedy[:, None, None], point, probs), ids


def keyed_chain(draft_probs: torch.Tensor, draft_ids: torch.Tensor, seed_keys: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
    """A chain drawn from a sparse law (:func:`top_k_draft_law`: ``draft_probs``, ``draft_ids``
    ``[R, g, K]``), one token per depth, with noise that is a function of each request's seed
    (``seed_keys [R]``, :func:`seed_keys_of`) and the drafting step's position (``positions
    [R]``: the last committed token's, which every drafting step of a request moves forward)
    only: :data:`DRAFT_STREAM`, apart from the verify step's (:class:`KeyedNoise`). Returns
    ``[R, g]`` int64. A point mass (a greedy request's law) draws its first token."""
    num_reqs, g, k = draft_probs.shape
    keys = stream_keys(seed_keys, positions, DRAFT_STREAM)
    depth_keys = mix32(keys[:, None] ^ torch.arange(g, dtype=torch.int64, device=keys.device))
    noise = -keyed_uniform(depth_keys.flatten(), k).log().view(num_reqs, g, k)
    pick = (draft_probs.double() / noise).argmax(dim=-1, keepdim=True)
    return draft_ids.gather(2, pick).squeeze(2)


def pack_sparse_law(probs: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """``(probs [..., K] float32, ids [..., K] int64)`` -> ONE ``[..., 2K]`` float32 tensor,
    probabilities then ids (exact in float32 below 2**24), so that the law travels as one
    tensor with one row per request (``TreeState.record_proposal``'s ``draft_law`` tuple).

    Example: probs [.7, .3], ids [151935, 12] -> [.7, .3, 151935., 12.].
    """
    if vocab > _FLOAT32_EXACT_INT:
        raise ValueError(f"{vocab=} token ids are not exact in float32 (limit {_FLOAT32_EXACT_INT})")
    if probs.shape != ids.shape:
        raise ValueError(f"probs.shape={tuple(probs.shape)} != ids.shape={tuple(ids.shape)}")
    return torch.cat([probs.float(), ids.float()], dim=-1)


def unpack_sparse_law(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_sparse_law`: ``[..., 2K]`` -> ``(probs [..., K], ids [..., K] int64)``."""
    k = packed.shape[-1] // 2
    return packed[..., :k], packed[..., k:].long()


def _check_sparse_chain(draft_token_ids, draft_probs, draft_ids) -> None:
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids.shape={tuple(draft_token_ids.shape)}, expected [batch, g]")
    batch, g = draft_token_ids.shape
    if draft_probs.dim() != 3 or draft_probs.shape[:2] != (batch, g):
        raise ValueError(f"draft_probs.shape={tuple(draft_probs.shape)}, expected [{batch}, {g}, K]")
    if draft_ids.shape != draft_probs.shape:
        raise ValueError(
            f"draft_ids.shape={tuple(draft_ids.shape)}, expected {tuple(draft_probs.shape)}")


def sparse_hsd_stop_probabilities(
    draft_token_ids: torch.Tensor,  # [batch, g] x_1..x_g
    draft_probs: torch.Tensor,  # [batch, g, K] q_{i+1} on its support, index i
    draft_ids: torch.Tensor,  # [batch, g, K] the support S_{i+1} (distinct tokens), index i
    target_on_support: torch.Tensor,  # [batch, g, K] p_{i+1} at S_{i+1}, float64
    target_off_support: torch.Tensor,  # [batch, g] p_{i+1} mass outside S_{i+1}, float64
    target_on_draft: torch.Tensor,  # [batch, g] p_{i+1}(x_{i+1}), float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`hsd_stop_probabilities` for a draft law that lives on K tokens per position.

    q_{i+1} is zero outside S_{i+1}, so
    Z_i = p_i * p_{i+1}(not S_{i+1}) + sum over v in S_{i+1} of max(p_i * p_{i+1}(v) - q_{i+1}(v), 0):
    the target law is needed on the support and as one mass outside it (summed directly,
    not as 1 - p(S), which would cancel catastrophically where the support holds it all).

    Returns ``(h [batch, g + 1] float64, prefix [batch, g + 1] float64)``, prefix = the capped
    ratios p_0 .. p_g (the stop level's residual needs its p_i: :func:`sparse_hsd_residual`).

    Example (g = 1, K = 2): q_1 = {a: .8, b: .2}, p_1 = {a: .4, b: .5, c: .1}, x_1 = a:
    p_1 = min(1, .4 / .8) = .5, h = [1, .5]; residual_0 = max(p_1 - q_1, 0) = {b: .3, c: .1}.
    """
    _check_sparse_chain(draft_token_ids, draft_probs, draft_ids)
    q = draft_probs.double()
    on_draft = draft_ids == draft_token_ids[..., None].long()  # [batch, g, K]
    q_draft = torch.where(on_draft, q, 0.0).sum(dim=-1)
    prefix = _capped_prefix(_ratios(target_on_draft, q_draft))
    g = draft_token_ids.shape[1]
    a = prefix[:, :g]
    p = target_on_support.double()
    z = a * target_off_support.double() + torch.clamp(a[..., None] * p - q, min=0.0).sum(dim=-1)
    return _stop_probabilities(prefix, z), prefix


def _target_at_support(probs: torch.Tensor, support: torch.Tensor, draft: torch.Tensor):
    """``probs [n, V]`` (consumed: zeroed on the support), ``support [n, K]``, ``draft [n]`` ->
    ``(on_support [n, K], off_support [n], on_draft [n])``, float64."""
    on_draft = probs.gather(1, draft[:, None]).squeeze(1)
    on_support = probs.gather(1, support)
    off_support = probs.scatter_(1, support, 0.0).sum(dim=-1)
    return on_support.double(), off_support.double(), on_draft.double()


def sparse_hsd_residual(
    prefix: torch.Tensor,  # [batch] float64 p_i of the stop level i
    target_probs: torch.Tensor,  # [batch, vocab] p_{i+1}, the target row after the accepted drafts
    draft_probs: torch.Tensor,  # [batch, K] q_{i+1} on its support (ignored where ``last``)
    draft_ids: torch.Tensor,  # [batch, K] distinct tokens
    last: torch.Tensor,  # [batch] bool: i = g (every draft accepted: the bonus row)
) -> torch.Tensor:
    """The stop level's residual, unnormalised: ``[batch, vocab]`` float64
    max(p_i * p_{i+1} - q_{i+1}, 0), or p_{i+1} where ``last`` (the same numbers as the dense
    :func:`hsd_stop_probabilities` residual for the densified law).

    Example: p_i = .5, p_{i+1} = {a: .4, b: .5, c: .1}, q_{i+1} = {a: .8, b: .2} ->
    {a: 0, b: .05, c: .05}.
    """
    scale = torch.where(last, 1.0, prefix.double())
    residual = target_probs.double() * scale[:, None]
    subtract = torch.where(last[:, None], 0.0, -draft_probs.double())
    return residual.scatter_add_(1, draft_ids.long(), subtract).clamp_(min=0.0)


def hsd_verify_sparse(
    draft_token_ids: torch.Tensor,  # [batch, g]
    draft_probs: torch.Tensor,  # [batch, g, K]
    draft_ids: torch.Tensor,  # [batch, g, K]
    target_probs: torch.Tensor,  # [batch, g + 1, vocab]
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`hsd_verify` for a sparse draft law, on dense target probabilities.

    The vLLM plugin computes the same pieces from chunks of logits rows; this composition is
    the reference the tests hold them to. Consumes ``generator`` like :func:`hsd_verify`
    (g + 1 uniforms, then one exponential per vocabulary entry and request).

    Returns ``(num_accepted [batch] int64, output_tokens [batch, g + 1] int64)``.
    """
    _check_sparse_chain(draft_token_ids, draft_probs, draft_ids)
    batch, g = draft_token_ids.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (batch, g + 1):
        raise ValueError(
            f"target_probs.shape={tuple(target_probs.shape)}, expected [{batch}, {g + 1}, vocab]")
    p = target_probs.double()
    ids = draft_ids.long()
    on_support, off_support, on_draft = _target_at_support(
        p[:, :g].reshape(batch * g, -1).clone(), ids.view(batch * g, -1),
        draft_token_ids.long().reshape(-1))
    h, prefix = sparse_hsd_stop_probabilities(
        draft_token_ids, draft_probs, ids, on_support.view(batch, g, -1),
        off_support.view(batch, g), on_draft.view(batch, g))
    eta = torch.rand((batch, g + 1), dtype=torch.float64, device=h.device, generator=generator)
    level = deepest_stop(h, eta)
    at = level.clamp(max=g - 1)[:, None, None].expand(-1, 1, ids.shape[2])
    residual = sparse_hsd_residual(
        prefix.gather(1, level[:, None]).squeeze(1),
        p.gather(1, level[:, None, None].expand(-1, 1, p.shape[2])).squeeze(1),
        draft_probs.gather(1, at).squeeze(1), ids.gather(1, at).squeeze(1), level == g)
    next_token = sample_from_probs(residual.float(), generator=generator)
    return level, chain_output(draft_token_ids, level, next_token)


class HsdNoise(Protocol):
    """Where :func:`hsd_verify_rows` draws its randomness: g + 1 uniforms per request (the
    stop levels'), then one Exp(1) per vocabulary entry for the requests' next tokens."""

    def uniforms(self, num_reqs: int, width: int, device: torch.device) -> torch.Tensor:
        """``[num_reqs, width]`` float64 uniforms in (0, 1)."""

    def exponentials(self, start: int, end: int, vocab: int, device: torch.device
                     ) -> torch.Tensor:
        """``[end - start, vocab]`` float32 Exp(1) noise of requests ``start .. end - 1``."""


class GeneratorNoise:
    """HSD's randomness from torch generators (the V1 runner): the default one, or a request's
    own (``generators``: request -> generator), whose stream holds g + 1 uniforms then V
    exponentials per verify step."""

    def __init__(self, generators: dict[int, torch.Generator] | None = None):
        self.generators = generators or {}

    def uniforms(self, num_reqs: int, width: int, device: torch.device) -> torch.Tensor:
        eta = torch.rand((num_reqs, width), dtype=torch.float64, device=device)
        # NOTE: a Python loop over the seeded requests, as in vLLM's sampler: host work only.
        for r, gen in self.generators.items():
            eta[r] = torch.rand(width, dtype=torch.float64, device=device, generator=gen)
        return eta

    def exponentials(self, start: int, end: int, vocab: int, device: torch.device
                     ) -> torch.Tensor:
        seeded = {r - start: gen for r, gen in self.generators.items() if start <= r < end}
        return _exponential_noise((end - start, vocab), device, seeded)


class KeyedNoise:
    """HSD's randomness as a function of each request's seed and its verify step's root
    position only (Model Runner V2, where every request has a seed and no generator): the
    uniforms of :func:`stream_keys` with :data:`ETA_STREAM`, the exponentials with
    :data:`RESIDUAL_STREAM`. A root position is verified once, so every step draws afresh.
    ``seed_keys [R]``: :func:`seed_keys_of`; ``positions [R]``: the roots' positions."""

    def __init__(self, seed_keys: torch.Tensor, positions: torch.Tensor):
        self.seed_keys, self.positions = seed_keys, positions

    def uniforms(self, num_reqs: int, width: int, device: torch.device) -> torch.Tensor:
        return keyed_uniform(stream_keys(self.seed_keys, self.positions, ETA_STREAM), width)

    def exponentials(self, start: int, end: int, vocab: int, device: torch.device
                     ) -> torch.Tensor:
        keys = stream_keys(self.seed_keys[start:end], self.positions[start:end],
                           RESIDUAL_STREAM)
        return (-keyed_uniform(keys, vocab).log()).float()


def hsd_verify_rows(
    target_probs_of: Callable[[torch.Tensor], torch.Tensor],
    vocab: int,
    rows_index: torch.Tensor,  # [R, g + 1] flat row of each request's root and nodes
    draft_token_ids: torch.Tensor,  # [R, g]
    draft_probs: torch.Tensor,  # [R, g, K]
    draft_ids: torch.Tensor,  # [R, g, K]
    noise: HsdNoise,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`hsd_verify_sparse` on a runner's flat verify rows, one :func:`row_chunks` chunk
    at a time. ``target_probs_of(index [n]) -> [n, vocab]`` float64: the processed target law
    of flat rows (callers' processing: the V1 runner's :func:`processed_probs_of_rows`, V2's
    sampler); ``noise``: where the uniforms and the next tokens' noise come from
    (:class:`GeneratorNoise`, :class:`KeyedNoise`).

    The target law is computed for a chunk of (request, position) rows and kept only where the
    stop probabilities need it (the K support tokens, the draft, the mass off the support);
    after the scan it is computed in full for one row per request, the stop level's, to draw
    the next token. No ``[R, g + 1, V]`` tensor is made.

    Returns ``(num_accepted [R] int64, output_tokens [R, g + 1] int64)`` in vLLM's layout
    (:func:`chain_output`).
    """
    _check_sparse_chain(draft_token_ids, draft_probs, draft_ids)
    num_reqs, g = draft_token_ids.shape
    device = rows_index.device
    ids = draft_ids.long()
    support = ids.view(num_reqs * g, -1)  # [R g, K]
    drafts = draft_token_ids.long().reshape(-1)  # [R g]
    position_rows = rows_index[:, :g].reshape(-1)  # [R g] the row of p_{i+1}
    on_support = torch.empty(support.shape, dtype=torch.float64, device=device)
    off_support = torch.empty(num_reqs * g, dtype=torch.float64, device=device)
    on_draft = torch.empty(num_reqs * g, dtype=torch.float64, device=device)
    for start, end in row_chunks(num_reqs * g, vocab):
        probs = target_probs_of(position_rows[start:end])
        on_support[start:end], off_support[start:end], on_draft[start:end] = _target_at_support(
            probs, support[start:end], drafts[start:end])
        del probs
    h, prefix = sparse_hsd_stop_probabilities(
        draft_token_ids, draft_probs, ids, on_support.view(num_reqs, g, -1),
        off_support.view(num_reqs, g), on_draft.view(num_reqs, g))
    level = deepest_stop(h, noise.uniforms(num_reqs, g + 1, device))  # [R] drafts accepted
    at = level.clamp(max=g - 1)[:, None, None].expand(-1, 1, ids.shape[2])
    q_at, ids_at = draft_probs.gather(1, at).squeeze(1), ids.gather(1, at).squeeze(1)  # [R, K]
    prefix_at = prefix.gather(1, level[:, None]).squeeze(1)
    stop_rows = rows_index.gather(1, level[:, None]).squeeze(1)  # the row of p_{level + 1}
    next_token = torch.empty(num_reqs, dtype=torch.int64, device=device)
    for start, end in row_chunks(num_reqs, vocab):
        residual = sparse_hsd_residual(
            prefix_at[start:end], target_probs_of(stop_rows[start:end]), q_at[start:end],
            ids_at[start:end], level[start:end] == g)
        noise_chunk = noise.exponentials(start, end, vocab, device)
        next_token[start:end] = (residual.float() / noise_chunk).argmax(dim=-1)
        del residual, noise_chunk
    return level, chain_output(draft_token_ids, level, next_token)
