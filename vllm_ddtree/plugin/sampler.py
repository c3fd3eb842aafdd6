"""TreeRejectionSampler: the walk in place of vLLM's chain rejection sampler.

vLLM hands the sampler the target logits of every verify row, request-major:
``[root, node_0 .. node_{m-1}]`` for a request with m scheduled drafts (chain order for a
chain, node order for a tree: the same rows). The walk needs exactly these distributions.
The output follows vLLM's layout: ``[R, max_spec_len + 1]`` int32, accepted tokens, the bonus
token, then -1, so the scheduler's rule ``num_computed -= num_draft - num_accepted`` holds
once the accepted path's K/V has been compacted to the chain slots.

Seeded requests (``SamplingParams.seed``) draw every verify position from their own generator
with vLLM's sampling op, position by position (:meth:`TreeRejectionSampler._sample_seeded`), and
run HSD with that generator: the stream a seeded request consumes depends only on its own
drafts, never on the other requests of the batch, so its output does not depend on the traffic.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from vllm.v1.outputs import SamplerOutput

from vllm_ddtree.plugin.state import TreeState, to_device
from vllm_ddtree.sampling import (
    SamplingBatch,
    hsd_verify,
    processed_logits,
    sample_tokens,
    target_probs_from_logits,
)
from vllm_ddtree.walk import verify_tree, walk


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
        """``target_sampler``: the runner's vLLM ``Sampler`` (its top-k/top-p op draws the
        tokens of seeded requests); None builds a default ``TopKTopPSampler``."""
        super().__init__()
        self.ddtree_state = state
        if target_sampler is None:
            from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

            self.topk_topp_sampler = TopKTopPSampler()
        else:
            self.topk_topp_sampler = target_sampler.topk_topp_sampler

    def _sample_seeded(self, logits: torch.Tensor, num_draft: list[int],
                       sampling: SamplingBatch) -> torch.Tensor:
        """Target samples ``[R, width + 1]`` of a batch with seeded requests.

        Unseeded rows draw from the default generator (:func:`sample_tokens`). Seeded request r
        (vLLM gives generators to random seeded requests only) draws its m_r + 1 positions
        with vLLM's sampling op from its generator alone, one position after the other: with
        m_r = 0 (its first token, in a step where other requests verify) this is exactly the
        draw vLLM's sampler makes in a step without speculation, and the stream never depends
        on the width of the other requests' trees. Example: a seeded request with 2 drafts
        consumes 3 draws of its generator (the CPU op draws one seed per position).
        """
        sampled = sample_tokens(logits, dataclasses.replace(sampling, generators=None))
        for r, generator in sampling.generators.items():
            m = num_draft[r]
            row = SamplingBatch(
                temperature=sampling.temperature[r:r + 1],
                top_k=None if sampling.top_k is None else sampling.top_k[r:r + 1],
                top_p=None if sampling.top_p is None else sampling.top_p[r:r + 1],
            )
            row_logits = processed_logits(logits[r:r + 1, :m + 1], row)[0].float()  # [m + 1, V]
            tokens, _ = self.topk_topp_sampler(
                row_logits, {i: generator for i in range(m + 1)}, None, None
            )
            sampled[r, :m + 1] = tokens.to(sampled.dtype)
        return sampled

    def forward(self, metadata, draft_probs, logits: torch.Tensor, sampling_metadata) -> SamplerOutput:
        state = self.ddtree_state
        num_draft = list(metadata.num_draft_tokens)
        verify = state.verify
        if verify is None or verify.num_draft != num_draft:
            # dummy sampler runs and steps without proposals: verify the drafts as chains
            starts = [0]
            for m in num_draft[:-1]:
                starts.append(starts[-1] + m + 1)
            verify = state.begin_verify(
                req_ids=[f"__chain_{i}" for i in range(len(num_draft))],
                num_draft=num_draft,
                draft_token_ids=metadata.draft_token_ids,
                query_start=starts,
                num_tokens=sum(num_draft) + len(num_draft),
            )
        # Only the widest scheduled tree is padded for: [R, max m + 1, V], not [R, B + 1, V]
        # (vLLM's warm-up runs max_num_seqs requests with one draft each).
        width = max(num_draft, default=0)
        tree = verify.tree.first_nodes(width)
        num_reqs = tree.token_ids.shape[0]
        # logits rows of request r: [cu_sampled[r] - m_r - 1, cu_sampled[r]) -> padded [R, m+1, V]
        row_of = []
        start = 0
        for m in num_draft:
            row_of.append(list(range(start, start + m + 1)) + [-1] * (width - m))
            start += m + 1
        rows = to_device(row_of, torch.int64, logits.device)
        padded = logits[rows.clamp(min=0)]  # [R, width + 1, V]; padding rows are never reached
        sampling = sampling_batch(sampling_metadata)
        if sampling is not None and sampling.generators:
            verdict = walk(tree, self._sample_seeded(padded, num_draft, sampling))
        else:
            verdict = verify_tree(tree, padded, sampling)
        out_width = metadata.max_spec_len + 1
        out = torch.full((num_reqs, out_width), -1, dtype=torch.int64, device=logits.device)
        keep = min(out_width, verdict.output_tokens.shape[1])
        out[:, :keep] = verdict.output_tokens[:, :keep]
        state.verdict = verdict
        if (state.options.mode == "hsd_chain" and verify.draft_law is not None
                and width == state.budget):
            # Sampled chains: HSD where the drafts are the proposal at full length; the walk
            # (above) for placeholder or truncated rows. Chains need no K/V compaction.
            use_hsd = verify.matched & (tree.num_nodes == width)
            chains = tree.token_ids.clamp(min=0)
            target_probs = target_probs_from_logits(padded, sampling)
            _, hsd_out = hsd_verify(chains, verify.draft_law[0], target_probs)
            seeded = sampling.generators if sampling is not None and sampling.generators else {}
            for r, generator in seeded.items():
                # seeded requests with a full chain: HSD's uniforms and residual draw from
                # their own generator (rows without a chain draw nothing more from it)
                if num_draft[r] != width:
                    continue
                _, hsd_out[r:r + 1] = hsd_verify(chains[r:r + 1], verify.draft_law[0][r:r + 1],
                                                 target_probs[r:r + 1], generator=generator)
            out = torch.where(use_hsd[:, None], hsd_out[:, :out_width], out)
            state.verdict = None
        return SamplerOutput(sampled_token_ids=out.to(torch.int32), logprobs_tensors=None)
