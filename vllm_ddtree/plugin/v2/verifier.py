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

``hsd_chain`` (sampled chains): the rows are sampled by vLLM's unfused path, whose processed
logits are the rows' laws, and HSD replaces the walk's verdict for sampled requests
(:meth:`TreeVerifier._hsd_chains`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
from vllm.v1.worker.gpu.metrics.logits import get_num_nans
from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample
from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores
from vllm.v1.worker.gpu.sample.output import SamplerOutput

from vllm_ddtree.plugin.state import accepted_moves
from vllm_ddtree.plugin.v2.model_state import TreeStep
from vllm_ddtree.sampling import (
    KeyedNoise,
    argmax_rows,
    cached_arange,
    hsd_verify_rows,
    seed_keys_of,
    verify_rows,
)
from vllm_ddtree.tree import PADDING_TOKEN_ID
from vllm_ddtree.walk import walk


def _rows_of(cu_num_logits: np.ndarray, requests: np.ndarray, device: torch.device
             ) -> torch.Tensor:
    """``[3, n]`` int64 on ``device`` (one small pinned upload): the logits rows of the batch's
    ``requests`` (positions in the batch, host), each with its request and its node (-1 for a
    request's root row). Example: cu [0, 3, 5], requests [1] -> [[3, 4], [1, 1], [-1, 0]]."""
    from vllm.utils import torch_utils

    lengths = cu_num_logits[requests + 1] - cu_num_logits[requests]
    request = np.repeat(requests, lengths)
    local = np.arange(request.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    rows = cu_num_logits[request] + local
    return torch_utils.async_tensor_h2d(np.stack([rows, request, local - 1]), device=device,
                                        dtype=torch.int64)


class _OnTreeRows:
    """One of vLLM's V2 logits processors (``state``), in its place in the sampler's list, with
    tree rows: steps without trees, and requests that do not use it (:meth:`requests`), are
    vLLM's; the others' rows get :meth:`apply_rows`."""

    def __init__(self, state, step: TreeStep):
        self.state = state  # vLLM's processor: every request's parameters, by slot
        self.step = step

    def add_request(self, req_idx: int, sampling_params) -> bool:
        return self.state.add_request(req_idx, sampling_params)

    def apply_staged_writes(self) -> None:
        self.state.apply_staged_writes()

    def apply(self, logits: torch.Tensor, ctx) -> torch.Tensor:
        verify = self.step.verify
        if verify is None:  # a step without trees: vLLM's
            return self.state.apply(logits, ctx)
        requests = self.requests(ctx.idx_mapping_np)
        if requests.size:
            self.apply_rows(logits, ctx, verify.tree, requests)
        return logits

    def requests(self, idx_mapping_np: np.ndarray) -> np.ndarray:
        """The batch positions of the requests that use the processor (host)."""
        raise NotImplementedError

    def apply_rows(self, logits, ctx, tree, requests: np.ndarray) -> None:
        """Process, in place, the rows of ``requests`` (batch positions, host) of ``tree``."""
        raise NotImplementedError


class TreePenalties(_OnTreeRows):
    """vLLM's V2 penalties (``PenaltiesState``, in its place in the sampler's processors) with
    each tree row's own history: the request's output, then its path's tokens.

    vLLM's kernel counts a verify row's history as the request's output plus the drafts before
    it in the request's block (a chain). For a tree row the history is the path root -> node
    (``DraftTree.path_tokens``): per chunk of the rows of requests with penalties, their
    output counts plus their paths' tokens are handed to vLLM's own kernel as one "request"
    per row with no drafts before it, so each row is penalised with the arithmetic plain
    decoding uses. Steps without trees, and requests without penalties, are vLLM's. Memory: a
    ``[rows, V]`` count table per chunk (:data:`CHUNK_BYTES`). Host work: the chunk rows, from
    the host's own copies of the batch layout (one small pinned upload a step)."""

    CHUNK_BYTES = 64 << 20

    def requests(self, idx_mapping_np: np.ndarray) -> np.ndarray:
        return np.flatnonzero(self.state.use_penalty[idx_mapping_np])

    def apply_rows(self, logits, ctx, tree, requests: np.ndarray) -> None:
        from vllm.v1.worker.gpu.sample.penalties import apply_penalties

        state = self.state
        layout = _rows_of(self.step.input_batch.cu_num_logits_np, requests, logits.device)
        chunk = max(1, self.CHUNK_BYTES // (4 * logits.shape[1]))
        for start in range(0, layout.shape[1], chunk):
            row, req, node = layout[:, start : start + chunk]
            slot = ctx.idx_mapping[req]
            counts = state.output_bin_counts.index_select(0, slot)  # [c, V] the output's
            path = tree.path_tokens(req, node)  # plus the path's
            counts.scatter_add_(1, path.clamp(min=0), (path >= 0).to(counts.dtype))
            values = logits.index_select(0, row)
            each = cached_arange(row.shape[0], logits.device)
            apply_penalties(values, each, each, torch.zeros_like(each),
                            state.repetition_penalty.gpu[slot],
                            state.frequency_penalty.gpu[slot],
                            state.presence_penalty.gpu[slot],
                            state.prompt_bin_mask.index_select(0, slot), counts)
            logits.index_copy_(0, row, values)


class TreeBadWords(_OnTreeRows):
    """vLLM's V2 bad words (``BadWordsState``, in its place in the sampler's processors) with
    each tree row's own history: a word's last token is banned where the row's path, then its
    request's output, ends with the word's other tokens (``features.row_history``,
    ``features.ban_bad_words``: V1's tree rows use the same two). vLLM's kernel reads a row's
    history as the drafts before it in its block (a chain). Steps without trees are vLLM's.
    Only -inf is written, so the rows' logits are vLLM's exactly. Host work: the rows of the
    requests with bad words and their longest word (kept at :meth:`add_request`)."""

    def __init__(self, state, step: TreeStep, max_num_reqs: int):
        super().__init__(state, step)
        self.longest = np.zeros(max_num_reqs, dtype=np.int64)  # per slot: its longest word

    def add_request(self, req_idx: int, sampling_params) -> bool:
        words = sampling_params.bad_words_token_ids or ()
        self.longest[req_idx] = max((len(word) for word in words), default=0)
        return super().add_request(req_idx, sampling_params)

    def requests(self, idx_mapping_np: np.ndarray) -> np.ndarray:
        return np.flatnonzero(self.state.num_bad_words.np[idx_mapping_np] > 0)

    def apply_rows(self, logits, ctx, tree, requests: np.ndarray) -> None:
        from vllm_ddtree.plugin.features import NO_TOKEN, ban_bad_words, row_history

        state = self.state
        slots_np = ctx.idx_mapping_np[requests]
        width = max(int(self.longest[slots_np].max()) - 1, 1)  # the longest prefix
        num_words = int(state.num_bad_words.np[slots_np].max())
        device = logits.device
        row, request, node = _rows_of(self.step.input_batch.cu_num_logits_np, requests, device)
        # the words of the batch's requests, [R, num_words] flattened: (request, last token,
        # prefix length, prefix newest first); a slot past a request's words matches no row
        slot = ctx.idx_mapping  # [R] by batch position
        offsets = state.bad_word_offsets.gpu[slot].long()  # [R, max words + 1]
        end = offsets[:, 1 : num_words + 1]
        length = end - offsets[:, :num_words]
        counts = state.num_bad_words.gpu[slot].long()
        word = cached_arange(num_words, device)
        batch = cached_arange(slot.shape[0], device)
        word_request = torch.where(word[None, :] < counts[:, None], batch[:, None], -1)
        tokens = state.bad_word_token_ids.gpu[slot].long()  # [R, max total tokens]
        last = tokens.gather(1, (end - 1).clamp(min=0))
        back = cached_arange(width, device)  # prefix token i: end - 2 - i
        at = (end[:, :, None] - 2 - back).clamp(min=0)  # [R, num_words, width]
        prefix = torch.where(back < (length - 1)[:, :, None],
                             tokens.gather(1, at.flatten(1)).view_as(at), NO_TOKEN)
        # each row's history: its path, then its request's output newest first
        req_states = state.req_states
        row_slot = slot[request]
        total = req_states.total_len.gpu[row_slot].long()
        first = req_states.prompt_len.gpu[row_slot].long()
        position = total[:, None] - 1 - back  # the output, newest first
        output = req_states.all_token_ids.gpu[row_slot].gather(1, position.clamp(min=0))
        output = torch.where(position >= first[:, None], output.long(), NO_TOKEN)
        history = row_history(tree.path_tokens(request, node), output, width)
        values = logits.index_select(0, row)
        ban_bad_words(values, history, request, word_request.flatten(), last.flatten(),
                      (length - 1).flatten(), prefix.flatten(0, 1))
        logits.index_copy_(0, row, values)


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
        # (draft_logits: DFlash drafts argmax trees, none; invalid_drafts: [logits rows] bool,
        # the rows of structured-output requests whose bitmask was permissive, past what the
        # scheduler could check of their chains: see below)
        step, sampler = self.step, self.sampler
        verify = step.verify_of(input_batch)
        if verify is None:
            raise RuntimeError("ddtree: a verify step without its trees (TreeStep.begin runs "
                               "in the model state's preprocess_state)")
        num_nans = get_num_nans(logits) if sampler.compute_nans else None
        logits_indices = input_batch.logits_indices
        idx_mapping_np = input_batch.idx_mapping_np
        logprobs_dims = sampler.get_logprobs_dims(idx_mapping_np)
        sampling_states = sampler.sampling_states
        random = bool(sampling_states.temperature.np[idx_mapping_np].any())
        hsd = random and step.options.mode == "hsd_chain"
        if not random and not sampler.needs_logits_processing[idx_mapping_np].any():
            # every request greedy and unprocessed: what vLLM's sampler computes at
            # temperature 0 (its Gumbel kernel takes the plain argmax), in one op
            sampled, processed = argmax_rows(logits), logits
        else:
            args = (logits, input_batch.expanded_idx_mapping, input_batch.idx_mapping,
                    idx_mapping_np,
                    step.positions[logits_indices],  # depth positions: noise, min_tokens
                    input_batch.input_ids[logits_indices], input_batch.expanded_local_pos,
                    _host_seq_lens(input_batch))
            if hsd:  # HSD reads each row's law: vLLM's unfused path, whose logits hold it
                processed = sampler.apply_sampling_params(*args, skip_top_k_top_p=False)
                sampled = gumbel_sample(
                    processed, input_batch.expanded_idx_mapping, sampling_states.temperature.gpu,
                    sampling_states.seeds.gpu, args[4], apply_temperature=False,
                    is_drafting=False, use_fp64=sampler.use_fp64_gumbel)
            else:
                sampled, processed = sampler.sample(
                    *args, return_logprobs=logprobs_dims is not None)
        tree = verify.tree
        num_reqs = input_batch.num_reqs
        cu_num_logits = input_batch.cu_num_logits[: num_reqs + 1]
        rows = verify_rows(cu_num_logits[1:], tree.max_budget)  # [R, W + 1] each tree's rows
        invalid = None
        if invalid_drafts is not None:
            # a node whose own row was not held to the grammar is never accepted (the token
            # drawn from its row could break the grammar): as vLLM pins a chain's acceptance
            invalid = invalid_drafts[rows[:, 1:]]
            tree = dataclasses.replace(tree, token_ids=torch.where(
                invalid, PADDING_TOKEN_ID, tree.token_ids))
        verdict = walk(tree, sampled[rows])
        if hsd and tree.max_budget == step.options.budget:
            verdict = self._hsd_chains(verdict, processed, rows, tree, input_batch, invalid)
        num_sampled, num_rejected = get_num_sampled_and_rejected(
            (verdict.num_accepted + 1).to(torch.int32), input_batch.seq_lens, cu_num_logits,
            input_batch.idx_mapping, sampler.req_states.prefill_len.gpu)
        if step.calibration is not None:  # the trees' calibration learns from this step
            counted = (verify.matched & (tree.num_nodes > 0)
                       & ~step.trees.reshaped[input_batch.idx_mapping])
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

    def _hsd_chains(self, verdict, processed: torch.Tensor, rows: torch.Tensor, tree,
                    input_batch, invalid: torch.Tensor | None):
        """``hsd_chain``: the verdict of HSD (``vllm_ddtree.sampling.hsd_verify_rows``) for
        every sampled request whose whole chain of B drafts is verified with every row held to
        its request's law (the walk's verdict, lossless for any drafts, for the others: greedy
        requests, chains the scheduler cut, grammar rows vLLM could not check). The target law
        of a row is its processed logits' softmax; the noise is keyed by the request's seed
        and its root's position (``KeyedNoise``), apart from the drafts' (``keyed_chain``)."""
        states = self.sampler.sampling_states
        idx_mapping = input_batch.idx_mapping
        width = rows.shape[1] - 1
        use = (states.temperature.gpu[idx_mapping] > 0) & (tree.num_nodes == width)
        if invalid is not None:
            use &= ~invalid.any(dim=1)
        law_probs, law_ids = self.step.trees.law(idx_mapping)
        roots = input_batch.positions[input_batch.logits_indices[rows[:, 0]]]
        num_accepted, output = hsd_verify_rows(
            lambda index: torch.softmax(processed.index_select(0, index), dim=-1,
                                        dtype=torch.float64),
            processed.shape[1], rows, tree.token_ids.clamp(min=0), law_probs, law_ids,
            KeyedNoise(seed_keys_of(states.seeds.gpu[idx_mapping]), roots))
        column = cached_arange(width + 1, rows.device)
        chain_rows = torch.where(column <= num_accepted[:, None], column, -1)  # node k: row k + 1
        chain_nodes = torch.where(chain_rows[:, 1:] > 0, chain_rows[:, 1:] - 1, -1)
        return dataclasses.replace(
            verdict,
            accepted_nodes=torch.where(use[:, None], chain_nodes, verdict.accepted_nodes),
            num_accepted=torch.where(use, num_accepted, verdict.num_accepted),
            bonus_token=torch.where(use, output.gather(1, num_accepted[:, None]).squeeze(1),
                                    verdict.bonus_token),
            output_tokens=torch.where(use[:, None], output, verdict.output_tokens),
            accepted_rows=torch.where(use[:, None], chain_rows, verdict.accepted_rows),
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
