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
whatever T is. The walk only sees one token per row, arranged ``[R, width + 1]`` by a row index
built on the device from vLLM's ``cu_num_sampled_tokens``
(:func:`vllm_ddtree.sampling.verify_rows`). ``hsd_chain`` chains are verified the same way
against their sparse draft law (:func:`vllm_ddtree.sampling.hsd_verify_rows`).

Seeded requests (``SamplingParams.seed``): vLLM's op draws each of a seeded request's rows
from the request's generator, rows in order (on the CPU one seed per row, on CUDA one
exponential per vocabulary entry and row), and HSD then draws from the same generator: the
stream a seeded request consumes depends only on its own drafts, never on the other requests of
the batch or on where the chunks fall, so its output does not depend on the traffic. Example: a
seeded request with 2 drafts consumes 3 draws of its generator on the CPU; with m_r = 0 (its
first token, in a step where other requests verify) this is exactly the draw vLLM's sampler
makes in a step without speculation.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

from vllm_ddtree.plugin.state import TreeState
from vllm_ddtree.sampling import (
    RowSampling,
    SamplingBatch,
    hsd_verify_rows,
    sample_rows,
    unpack_sparse_law,
    verify_rows,
)
from vllm_ddtree.walk import walk


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
        verify rows); None builds a default ``TopKTopPSampler``."""
        super().__init__()
        self.ddtree_state = state
        if target_sampler is None:
            from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

            self.topk_topp_sampler = TopKTopPSampler()
        else:
            self.topk_topp_sampler = target_sampler.topk_topp_sampler

    def forward(self, metadata, draft_probs, logits: torch.Tensor, sampling_metadata) -> SamplerOutput:
        state = self.ddtree_state
        num_draft = list(metadata.num_draft_tokens)
        if logits.shape[0] != sum(num_draft) + len(num_draft):
            raise ValueError(f"logits.shape={tuple(logits.shape)}, expected "
                             f"[{sum(num_draft) + len(num_draft)}, vocab] for {num_draft=}")
        verify = state.verify
        if verify is None or verify.num_draft != num_draft:
            # dummy sampler runs and steps without proposals: verify the drafts as chains
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
        tree = verify.tree.first_nodes(width)
        rows_index = verify_rows(metadata.cu_num_sampled_tokens, width)  # [R, width + 1]
        sampling = sampling_batch(sampling_metadata)
        rows = None if sampling is None else RowSampling.expand(
            sampling, metadata.cu_num_sampled_tokens, num_draft, logits.shape[1])
        sampled = sample_rows(logits, rows, self.topk_topp_sampler,
                              all_random=bool(getattr(sampling_metadata, "all_random", False)))
        verdict = walk(tree, sampled[rows_index])
        out_width = metadata.max_spec_len + 1
        out = torch.full((tree.token_ids.shape[0], out_width), -1, dtype=torch.int64,
                         device=logits.device)
        keep = min(out_width, verdict.output_tokens.shape[1])
        out[:, :keep] = verdict.output_tokens[:, :keep]
        state.verdict = verdict
        if (state.options.mode == "hsd_chain" and verify.draft_law is not None
                and width == state.budget and sampling is not None):
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
            hsd_out = hsd_verify_rows(logits, rows_index, tree.token_ids.clamp(min=0), probs_q,
                                      ids_q, rows, apply_top_k_top_p, seeded)
            out = torch.where(use_hsd[:, None], hsd_out[:, :out_width], out)
            state.verdict = None
        return SamplerOutput(sampled_token_ids=out.to(torch.int32), logprobs_tensors=None)
