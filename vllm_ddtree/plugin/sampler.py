"""TreeRejectionSampler: the walk in place of vLLM's chain rejection sampler.

vLLM hands the sampler the target logits of every verify row, request-major:
``[root, node_0 .. node_{m-1}]`` for a request with m scheduled drafts (chain order for a
chain, node order for a tree: the same rows). The walk needs exactly these distributions.
The output follows vLLM's layout: ``[R, max_spec_len + 1]`` int32, accepted tokens, the bonus
token, then -1, so the scheduler's rule ``num_computed -= num_draft - num_accepted`` holds
once the accepted path's K/V has been compacted to the chain slots.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.v1.outputs import SamplerOutput

from vllm_ddtree.plugin.state import TreeState
from vllm_ddtree.sampling import SamplingBatch, hsd_verify, target_probs_from_logits
from vllm_ddtree.walk import verify_tree


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
    def __init__(self, state: TreeState):
        super().__init__()
        self.ddtree_state = state

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
        rows = torch.tensor(row_of, dtype=torch.int64, device=logits.device)
        padded = logits[rows.clamp(min=0)]  # [R, width + 1, V]; padding rows are never reached
        sampling = sampling_batch(sampling_metadata)
        verdict = verify_tree(tree, padded, sampling)
        out_width = metadata.max_spec_len + 1
        out = torch.full((num_reqs, out_width), -1, dtype=torch.int64, device=logits.device)
        keep = min(out_width, verdict.output_tokens.shape[1])
        out[:, :keep] = verdict.output_tokens[:, :keep]
        state.verdict = verdict
        if (state.options.mode == "hsd_chain" and verify.draft_probs is not None
                and width == state.budget):
            # Sampled chains: HSD where the drafts are the proposal at full length; the walk
            # (above) for placeholder or truncated rows. Chains need no K/V compaction.
            use_hsd = verify.matched & (tree.num_nodes == width)
            _, hsd_out = hsd_verify(tree.token_ids.clamp(min=0), verify.draft_probs,
                                    target_probs_from_logits(padded, sampling))
            out = torch.where(use_hsd[:, None], hsd_out[:, :out_width], out)
            state.verdict = None
        return SamplerOutput(sampled_token_ids=out.to(torch.int32), logprobs_tensors=None)
