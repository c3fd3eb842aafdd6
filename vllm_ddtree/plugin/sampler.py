"""TreeRejectionSampler: the walk in place of vLLM's chain rejection sampler.

vLLM hands the sampler the target logits of every verify row, flat and request-major:
``[T, V]`` with rows ``[root, node_0 .. node_{m-1}]`` for a request with m scheduled drafts
(chain order for a chain, node order for a tree: the same rows), T = sum over requests of
m_r + 1. The output follows vLLM's layout: ``[R, max_spec_len + 1]`` int32, accepted tokens,
the bonus token, then -1, so the scheduler's rule ``num_computed -= num_draft - num_accepted``
holds once the accepted path's K/V has been compacted to the chain slots.

Memory: the rows are never padded nor copied as a whole. Greedy rows take the argmax of the raw
logits; the others are sampled by vLLM's own top-k/top-p sampler (the runner's
``Sampler.topk_topp_sampler``: FlashInfer on CUDA, its native or CPU op elsewhere) one chunk of
rows at a time (:func:`vllm_ddtree.sampling.sample_rows`), so the extra memory is a few chunks
whatever T is. The walk only sees one token per row, arranged ``[R, width + 1]``: a view of the
flat rows when every request has ``width`` drafts, else by a row index built on the device from
vLLM's ``cu_num_sampled_tokens`` (:func:`vllm_ddtree.sampling.verify_rows`). ``hsd_chain``
chains are verified the same way against their sparse draft law
(:func:`vllm_ddtree.sampling.hsd_verify_rows`).

Request features (penalties, ``min_tokens``, ``bad_words``, ``allowed_token_ids``,
``logit_bias``, ``min_p``): every row is processed as vLLM's sampler processes a row whose
history is the request's output plus the row's path (:mod:`vllm_ddtree.plugin.features`), in
the same chunks, before the greedy argmax and the sampling op. Logprobs: vLLM's sample logprobs
of the emitted tokens, computed from the rows the walk emitted them from
(:meth:`TreeRejectionSampler.emitted_logprobs`).

Seeded requests (``SamplingParams.seed``): every token of a seeded request, in verify steps
and in steps without drafts alike, is drawn with noise that is a function of the request's seed
and of the token's position (:func:`sample_seeded`), never from a stream of draws. A tree
verify step samples every node, and which nodes exist depends on the drafter, the budget policy
(which depends on the batch and on measured step times) and the scheduler; with a stream, the
text of a seeded request would depend on all of them. With position noise the token emitted at
position p is ``argmax_v p(v | prefix) / E[p, v]`` whatever was drafted: the text is that of one
plain decoding run with this noise, reproducible whatever the traffic, the policy or the
tensor-parallel layout, and its law is exactly plain decoding's (the noise of position p is
used on the emitted path once, and the path up to p never depends on it). ``hsd_chain`` chains
are the exception: they are SAMPLED from the drafter with the request's generator and HSD draws
from it too, so their text depends on their own drafts (a static policy: not on the batch).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from torch import nn
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.sampler import Sampler

from vllm_ddtree.plugin.features import TreeFeatures
from vllm_ddtree.plugin.state import TreeState, to_device
from vllm_ddtree.sampling import (
    GeneratorNoise,
    RowSampling,
    SamplingBatch,
    cached_arange,
    hsd_verify_rows,
    keyed_exponential,
    processed_probs_of_rows,
    row_chunks,
    sample_rows,
    seed_key,
    unpack_sparse_law,
    verify_rows,
)
from vllm_ddtree.walk import walk


def seeded_rows(sampling_metadata, num_draft: list[int]) -> tuple[list[int], list[int]]:
    """The flat rows of the seeded requests (each request owns ``num_draft[r] + 1`` rows,
    request-major) and the request of each row (host lists; empty without seeded requests)."""
    generators = getattr(sampling_metadata, "generators", None)  # vLLM's always has them
    if not generators:
        return [], []
    starts = [0, *itertools.accumulate(m + 1 for m in num_draft)]
    pairs = [(starts[r] + i, r) for r in sorted(generators) for i in range(num_draft[r] + 1)]
    return [row for row, _ in pairs], [r for _, r in pairs]


def sample_seeded(logits: torch.Tensor, rows: list[int], requests: list[int], sampling_metadata,
                  positions: torch.Tensor | None, features=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens of the seeded requests' flat ``rows`` of ``logits [T, V]``, each drawn from its
    request's processed law (temperature, then vLLM's top-k / top-p) by the exponential race
    with :func:`~vllm_ddtree.sampling.keyed_exponential` noise: a function of the request's seed
    and the position of the token (``positions [T]``: of the token each row predicts). So a
    seeded request's text depends on its seed and prompt only: not on its drafts, on the
    budget policy's choices, on what it is batched with, or on the tensor-parallel rank. No
    host synchronisation; one :func:`row_chunks` chunk of rows at a time. ``features``: the
    step's :class:`~vllm_ddtree.plugin.features.TreeFeatures` (request features, processed
    before the temperature and after it, as vLLM does). Returns the rows (device) and their
    tokens, for ``index_copy_``."""
    if positions is None:
        raise RuntimeError("ddtree: seeded rows without their positions (TreeState."
                           "sample_positions is set by the runner's _prepare_inputs)")
    device, vocab = logits.device, logits.shape[1]
    generators = sampling_metadata.generators
    keys = to_device([seed_key(generators[r].initial_seed()) for r in requests], torch.int64,
                     device)
    row_index = to_device(rows, torch.int64, device)
    request = to_device(requests, torch.int64, device)
    temperature = sampling_metadata.temperature[request].float()
    top_k = None if sampling_metadata.top_k is None else sampling_metadata.top_k[request]
    if top_k is not None:
        top_k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
    top_p = None if sampling_metadata.top_p is None else sampling_metadata.top_p[request]
    tokens = []
    for start, end in row_chunks(len(rows), vocab):
        part = slice(start, end)
        chunk = logits.index_select(0, row_index[part]).float()
        if features is not None:
            chunk = features.apply(chunk, row_index[part])
        chunk = chunk.div_(temperature[part, None])
        if features is not None:
            chunk = features.after_temperature(chunk, row_index[part])
        chunk = apply_top_k_top_p(chunk, None if top_k is None else top_k[part],
                                  None if top_p is None else top_p[part])
        noise = keyed_exponential(keys[part], positions.index_select(0, row_index[part]), vocab)
        tokens.append((chunk.softmax(dim=-1) / noise).argmax(dim=-1))
        del chunk, noise
    return row_index, torch.cat(tokens)


def sampling_batch(sampling_metadata) -> SamplingBatch | None:
    """vLLM's ``SamplingMetadata`` -> :class:`SamplingBatch` (None when every row is greedy)."""
    if sampling_metadata.all_greedy or sampling_metadata.temperature is None:
        return None
    return SamplingBatch(
        temperature=sampling_metadata.temperature,
        top_k=sampling_metadata.top_k,
        top_p=sampling_metadata.top_p,
        generators=sampling_metadata.generators or None,
    )


class TreeRejectionSampler(nn.Module):
    def __init__(self, state: TreeState, target_sampler=None):
        """``target_sampler``: the runner's vLLM ``Sampler`` (its top-k/top-p op samples the
        verify rows, its ``logprobs_mode`` and logprob gathering serve logprobs); None builds a
        default ``Sampler``."""
        super().__init__()
        self.ddtree_state = state
        self.vllm_sampler = Sampler() if target_sampler is None else target_sampler
        self.topk_topp_sampler = self.vllm_sampler.topk_topp_sampler
        self.logprobs_mode = self.vllm_sampler.logprobs_mode

    def forward(self, metadata, draft_probs, logits: torch.Tensor, sampling_metadata) -> SamplerOutput:
        state = self.ddtree_state
        num_draft = list(metadata.num_draft_tokens)
        if logits.shape[0] != sum(num_draft) + len(num_draft):
            raise ValueError(f"logits.shape={tuple(logits.shape)}, expected "
                             f"[{sum(num_draft) + len(num_draft)}, vocab] for {num_draft=}")
        verify = state.verify
        dummy = verify is None or verify.num_draft != num_draft
        if dummy:
            # vLLM's dummy sampler runs (warm-up): verify the drafts as chains
            starts = [0, *itertools.accumulate(m + 1 for m in num_draft[:-1])]
            verify = state.begin_verify(
                req_ids=[f"__chain_{i}" for i in range(len(num_draft))],
                num_draft=num_draft,
                draft_token_ids=metadata.draft_token_ids,
                query_start=starts,
                num_tokens=sum(num_draft) + len(num_draft),
            )
        # Only the widest scheduled tree is walked: [R, max m + 1], not [R, B + 1]
        # (vLLM's warm-up runs max_num_seqs requests with one draft each).
        width = max(num_draft, default=0)
        tree = verify.tree
        if width != tree.max_budget or tree.max_depth > width:  # else first_nodes is the tree
            # (a verify tree's nodes are its scheduled drafts: none has more than width)
            tree = tree.first_nodes(width, num_nodes=tree.num_nodes)
        sampling = sampling_batch(sampling_metadata)
        all_random = bool(getattr(sampling_metadata, "all_random", False))
        rows = None if sampling is None else RowSampling.expand(
            dataclasses.replace(sampling, generators=None), metadata.cu_num_sampled_tokens,
            num_draft, logits.shape[1], all_random=all_random, top_k_in_range=True)
        features = TreeFeatures.build(sampling_metadata, tree, metadata.cu_num_sampled_tokens,
                                      logits.shape)
        sampled = sample_rows(logits, rows, self.topk_topp_sampler, all_random=all_random,
                              features=features)
        seeded, requests = seeded_rows(sampling_metadata, num_draft)
        if seeded:  # drawn again with their own noise (sample_seeded)
            sampled.index_copy_(0, *sample_seeded(logits, seeded, requests, sampling_metadata,
                                                  state.sample_positions, features))
        rows_index = None
        # vLLM's layout: [R, max_spec_len + 1] int32, the walk's output then -1
        out_width = metadata.max_spec_len + 1
        if len(set(num_draft)) == 1:  # request r owns rows r (width + 1) .. (r + 1)(width + 1) - 1
            verdict = walk(tree, sampled.reshape(len(num_draft), width + 1), out_width)
        else:
            rows_index = verify_rows(metadata.cu_num_sampled_tokens, width)  # [R, width + 1]
            verdict = walk(tree, sampled[rows_index], out_width)
        out = verdict.sampled_token_ids
        state.verdict = verdict
        if (state.options.mode == "hsd_chain" and verify.draft_law is not None
                and width == state.budget and sampling is not None and features is None):
            # (with request features the walk verifies the chains: lossless for any drafts;
            # HSD reads the target law from the raw logits)
            # Sampled chains: HSD where the drafts are the proposal at full length; the walk
            # (above) for placeholder or truncated rows, and for greedy requests (argmax chains
            # with a point-mass law, where HSD is the walk). Chains need no K/V compaction.
            use_hsd = verify.matched & (tree.num_nodes == width) & ~sampling.is_greedy
            # seeded requests with a full chain: HSD's uniforms and residual draw from their
            # own generator (rows without a chain draw nothing more from it)
            seeded = {r: gen for r, gen in (sampling.generators or {}).items()
                      if num_draft[r] == width}
            law = verify.draft_law  # (packed,) from the proposer, or (probs, ids)
            probs_q, ids_q = law if len(law) == 2 else unpack_sparse_law(law[0])
            if rows_index is None:
                rows_index = verify_rows(metadata.cu_num_sampled_tokens, width)
            _, hsd_out = hsd_verify_rows(
                lambda index: processed_probs_of_rows(logits, index, rows, apply_top_k_top_p),
                logits.shape[1], rows_index, tree.token_ids.clamp(min=0), probs_q, ids_q,
                GeneratorNoise(seeded))
            out = torch.where(use_hsd[:, None], hsd_out[:, :out.shape[1]], out)
            state.verdict = None
        if dummy:  # no tree left behind for a later dummy forward's attention to read
            state.verify = None
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None or sampling_metadata.logprob_token_ids:
            # the rows that emitted each output token: the walk's path (HSD chains: in order)
            emitted = verdict.accepted_rows
            if state.verdict is None:  # hsd_chain: the verdict above was replaced by HSD's
                emitted = torch.where(use_hsd[:, None], cached_arange(emitted.shape[1],
                                                                      emitted.device), emitted)
            logprobs = self.emitted_logprobs(logits, metadata.cu_num_sampled_tokens, emitted,
                                             out, sampling_metadata, rows, features)
        return SamplerOutput(sampled_token_ids=out.to(torch.int32), logprobs_tensors=logprobs)

    def emitted_logprobs(self, logits: torch.Tensor, cu_num_rows: torch.Tensor,
                         emitted: torch.Tensor, out: torch.Tensor, sampling_metadata,
                         rows: RowSampling | None, features) -> LogprobsTensors:
        """vLLM's sample logprobs of the emitted tokens ``out [R, S]`` (-1 past the last), from
        the rows that emitted them (``emitted [R, L + 1]``: query rows of each request, -1 past
        the last), laid out as vLLM's ``parse_output`` filters them (``[R * S, N + 1]``). Only
        the rows that can emit are read (``R (L + 1)``, not the ``R (B + 1)`` verify rows); the
        other columns are zeros, filtered out by vLLM."""
        num_reqs, width = out.shape
        keep = min(width, emitted.shape[1])
        ends = cu_num_rows.long()
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        flat = torch.minimum(starts[:, None] + emitted[:, :keep].clamp(min=0),
                             ends[:, None] - 1).reshape(-1)  # [R * keep] flat rows
        tokens = out[:, :keep].reshape(-1).long().clamp(min=0)
        got = self.row_logprobs(logits.index_select(0, flat).float(), flat, tokens,
                                [r for r in range(num_reqs) for _ in range(keep)],
                                sampling_metadata, rows, features)
        if keep == width:
            return got
        return LogprobsTensors(*(_pad_columns(t, num_reqs, keep, width) for t in got[:3]))

    def row_logprobs(self, values: torch.Tensor, flat_rows: torch.Tensor, tokens: torch.Tensor,
                     requests: list[int], sampling_metadata, rows: RowSampling | None,
                     features) -> LogprobsTensors:
        """vLLM's sample logprobs of ``tokens [n]``: each token's logprob and rank and the top
        ``max_num_logprobs`` of its row (or the request's ``logprob_token_ids``), in the
        engine's ``logprobs_mode``. ``values [n, V]``: a float32 copy of the raw logits of the
        flat rows ``flat_rows [n]`` (processed in place in the processed modes), which belong
        to the requests ``requests`` (host)."""
        mode = self.logprobs_mode
        if mode in ("processed_logits", "processed_logprobs"):
            if features is not None:
                values = features.apply(values, flat_rows)
            if rows is not None:  # as vLLM's sampler: the temperature (1 on greedy rows),
                values = values.div_(rows.temperature[flat_rows, None])  # min_p, top-k / p
                if features is not None:
                    values = features.after_temperature(values, flat_rows)
                values = apply_top_k_top_p(
                    values, None if rows.top_k is None else rows.top_k[flat_rows],
                    None if rows.top_p is None else rows.top_p[flat_rows])
        if mode in ("raw_logprobs", "processed_logprobs"):
            values = values.log_softmax(dim=-1)
        given = sampling_metadata.logprob_token_ids
        if given:  # given ids win over the top-N, as in vLLM
            return self.vllm_sampler.gather_specific_token_logprobs(
                values, {i: given[r] for i, r in enumerate(requests) if r in given}, tokens)
        return Sampler.gather_logprobs(values, sampling_metadata.max_num_logprobs, tokens)

    @staticmethod
    def fix_seeded_logprobs(output, row_index: torch.Tensor, fix: LogprobsTensors) -> None:
        """A step without drafts: vLLM's sampler returned the logprobs of its own tokens, and
        the seeded requests' tokens were drawn again (:func:`sample_seeded`); their rows
        ``row_index`` of ``output.logprobs_tensors`` get ``fix``, the logprobs of the tokens
        they emit (:meth:`seeded_logprobs`, computed before vLLM's sampler scaled the logits
        in place)."""
        target = output.logprobs_tensors
        for have, new in zip(target[:3], fix[:3]):
            if have.dim() == 1:
                have[row_index] = new.to(have.dtype)
                continue
            columns = new.shape[1]
            have[row_index, :columns] = new.to(have.dtype)
            if columns < have.shape[1]:  # given ids: vLLM pads the shorter lists
                pad = float("-inf") if have.is_floating_point() else 0
                have[row_index, columns:] = pad

    def seeded_logprobs(self, logits: torch.Tensor, row_index: torch.Tensor,
                        tokens: torch.Tensor, requests: list[int], sampling_metadata,
                        features) -> LogprobsTensors:
        """The logprobs of the seeded rows' tokens in a step without drafts (one row per
        request), from the raw logits before vLLM's sampler modifies them."""
        sampling = sampling_batch(sampling_metadata)
        num_reqs = logits.shape[0]
        rows = None if sampling is None else RowSampling.expand(
            dataclasses.replace(sampling, generators=None),
            cached_arange(num_reqs + 1, logits.device)[1:], [0] * num_reqs, logits.shape[1],
            all_random=bool(getattr(sampling_metadata, "all_random", False)),
            top_k_in_range=True)
        return self.row_logprobs(logits.index_select(0, row_index).float(), row_index,
                                 tokens.long(), requests, sampling_metadata, rows, features)


def _pad_columns(values: torch.Tensor, num_reqs: int, keep: int, width: int) -> torch.Tensor:
    """``[R * keep, ...]`` -> ``[R * width, ...]``, zeros in the new columns."""
    shaped = values.view(num_reqs, keep, *values.shape[1:])
    padded = shaped.new_zeros(num_reqs, width, *values.shape[1:])
    padded[:, :keep] = shaped
    return padded.view(num_reqs * width, *values.shape[1:])
