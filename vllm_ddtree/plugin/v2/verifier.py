"""The tree verifier of V2: vLLM's sampler on every tree row, the walk, the K/V compaction.

V2 calls its rejection sampler with the logits of every verify row, request-major
(``input_batch.cu_num_logits``: a request's root, then its scheduled drafts), and expects a
``SamplerOutput``: ``sampled [R, S]`` (the accepted tokens, then the bonus), ``num_sampled``
and ``num_rejected`` per request. For a tree (``TreeVerifier.__call__``):

1. every row is sampled by the runner's own ``Sampler.sample`` (vLLM's processing of a row:
   logit bias, ``min_tokens`` and allowed tokens by the row's position, temperature,
   ``min_p``, top-k / top-p, then its Gumbel sampling keyed by the request's seed and the
   row's position), with each row at its depth position. The token a row predicts for
   position p is drawn with the noise plain decoding uses for position p, so a request's text
   is that of V2's plain decoding with the same seed whatever was drafted; the law of each
   emitted token is the row's processed law, so the walk is lossless (``vllm_ddtree.walk``);
2. the walk picks the accepted path (``vllm_ddtree.walk.walk``);
3. the accepted path's K/V moves to the chain slots (``state.accepted_moves``,
   ``compaction.KVCompactor``), and the drafter's hidden-state gather index is kept for the
   speculator;
4. logprobs, where asked for, are computed for the emitted rows only (the root, then the
   accepted nodes: ``R (L + 1)`` rows, not ``R (B + 1)``), laid out as V2 slices them
   (``LogprobsLists.slice_request``: each request's first ``num_sampled`` rows of its block).

Rows of requests without a tree (a prefill chunk in the batch, a request served without
nodes) are roots of empty trees: their one sample is vLLM's plain decoding token.
"""

from __future__ import annotations

import torch
from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
from vllm.v1.worker.gpu.metrics.logits import get_num_nans
from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores
from vllm.v1.worker.gpu.sample.output import SamplerOutput

from vllm_ddtree.plugin.state import accepted_moves
from vllm_ddtree.plugin.v2.model_state import TreeStep
from vllm_ddtree.sampling import argmax_rows, verify_rows
from vllm_ddtree.walk import walk


def _host_seq_lens(input_batch):
    """vLLM's host copy of the sequence lengths (an upper bound), as its own sampler reads it."""
    return input_batch.seq_lens_cpu_upper_bound.numpy()


class TreeVerifier:
    def __init__(self, sampler, step: TreeStep):
        """``sampler``: the runner's V2 ``Sampler`` (its states hold every request's sampling
        parameters by slot); ``step``: the runner's :class:`TreeStep`."""
        self.sampler = sampler
        self.step = step

    def __call__(self, logits: torch.Tensor, input_batch, draft_logits=None,
                 invalid_drafts=None) -> SamplerOutput:
        # (draft_logits: DFlash drafts argmax trees, none; invalid_drafts: the grammar's cut of
        # a chain, which structured-output requests do not have: they verify no node)
        step, sampler = self.step, self.sampler
        verify = step.verify_of(input_batch)
        if verify is None:
            raise RuntimeError("ddtree: a verify step without its trees (TreeStep.begin runs "
                               "in the model state's preprocess_state)")
        num_nans = get_num_nans(logits) if sampler.compute_nans else None
        logits_indices = input_batch.logits_indices
        idx_mapping_np = input_batch.idx_mapping_np
        logprobs_dims = sampler.get_logprobs_dims(idx_mapping_np)
        if (not sampler.sampling_states.temperature.np[idx_mapping_np].any()
                and not sampler.needs_logits_processing[idx_mapping_np].any()):
            # every request greedy and unprocessed: what vLLM's sampler computes at
            # temperature 0 (its Gumbel kernel takes the plain argmax), in one op
            sampled, processed = argmax_rows(logits), logits
        else:
            sampled, processed = sampler.sample(
                logits,
                input_batch.expanded_idx_mapping,
                input_batch.idx_mapping,
                idx_mapping_np,
                step.positions[logits_indices],  # depth positions: noise, min_tokens
                input_batch.input_ids[logits_indices],
                input_batch.expanded_local_pos,
                _host_seq_lens(input_batch),
                return_logprobs=logprobs_dims is not None,
            )
        tree = verify.tree
        num_reqs = input_batch.num_reqs
        cu_num_logits = input_batch.cu_num_logits[: num_reqs + 1]
        rows = verify_rows(cu_num_logits[1:], tree.max_budget)  # [R, W + 1] each tree's rows
        verdict = walk(tree, sampled[rows])
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            (verdict.num_accepted + 1).to(torch.int32), input_batch.seq_lens, cu_num_logits,
            input_batch.idx_mapping, sampler.req_states.prefill_len.gpu)
        if step.calibration is not None:  # the trees' calibration learns from this step
            counted = verify.matched & (tree.num_nodes > 0)
            step.calibration.observe(tree.tops, verdict.output_tokens, verdict.num_accepted,
                                     counted, step.trees.sampled[input_batch.idx_mapping])
        src, dst, step.gather_index = accepted_moves(
            verdict.accepted_rows, verify.starts, verify.num_tokens, step.moved)
        step.compactor.compact(src, dst, verify.num_tokens, num_reqs)
        logprobs = None
        if logprobs_dims is not None:
            num_logprobs, max_token_ids = logprobs_dims
            values = processed if sampler.logprobs_mode in (
                "processed_logprobs", "processed_logits") else logits
            logprobs = self._emitted_logprobs(values, rows, verdict, input_batch, num_logprobs,
                                              max_token_ids)
        return SamplerOutput(
            sampled_token_ids=verdict.output_tokens,
            logprobs_tensors=logprobs,
            num_nans=num_nans,
            num_sampled=num_sampled,
            num_rejected=num_rejected,
        )

    def _emitted_logprobs(self, values: torch.Tensor, rows: torch.Tensor, verdict,
                          input_batch, num_logprobs: int, max_token_ids: int):
        """vLLM's logprobs of the emitted tokens, from the rows that emitted them: request r's
        block is its ``L' + 1`` path rows (the root, the accepted nodes, then repeats)."""
        paths = verdict.accepted_rows  # [R, L' + 1] rows within each request's tree, -1 past
        width = paths.shape[1]
        flat = rows.gather(1, paths.clamp(min=0)).flatten()  # [R (L' + 1)] logits rows
        num_reqs = paths.shape[0]
        return compute_topk_scores(
            values.index_select(0, flat),
            num_logprobs,
            verdict.output_tokens.clamp(min=0).flatten(),
            list(range(0, num_reqs * width + 1, width)),
            logprob_token_ids_state=self.sampler.logprob_token_ids_state,
            expanded_idx_mapping=input_batch.idx_mapping.repeat_interleave(width),
            max_per_req_token_ids=max_token_ids,
            logits_mode=self.sampler.logprobs_mode in ("raw_logits", "processed_logits"),
        )
