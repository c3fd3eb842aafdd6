"""DDTreeProposer: vLLM's DFlash drafter forward, then the optimal tree instead of argmax.

vLLM's ``DFlashProposer`` runs the drafter with ``num_speculative_tokens`` mask queries and
argmaxes each position. Here the drafter runs with L = ``depth`` mask queries, the L
per-position distributions go to :func:`vllm_ddtree.tree.build_tree`, and the B node tokens
(best-first, so any prefix of them is a subtree) are returned as the request's drafts.

After a tree verify step the committed tokens are the root and the accepted nodes, scattered
over the verify rows and carrying depth positions. Before DFlash builds its context, the rows
are gathered back into chain order (hidden states by :meth:`TreeState.take_gather_index`,
positions from :attr:`TreeState.chain_positions`), so DFlash's own bookkeeping
(``num_rejected_tokens``, context slots) holds unchanged and the drafter's context K/V is
rewritten at chain positions: the drafter layers need no compaction.
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_ddtree.plugin import known_params
from vllm_ddtree.plugin.policy import has_structured_outputs
from vllm_ddtree.plugin.sampler import sampling_batch
from vllm_ddtree.plugin.state import TreeState, chain_parents
from vllm_ddtree.sampling import pack_sparse_law, sample_from_probs, top_k_draft_law
from vllm_ddtree.tree import DraftTree, _ancestor_mask, build_tree


def shareable_rows(counts: list[int], prompt: list[bool], computed: list[int],
                   known: list[int], block_size: int) -> np.ndarray:
    """``[sum(counts)]`` bool: which of a step's rows are prompt rows that the prefix cache can
    share, i.e. that lie in a block their request's known tokens fill. Request ``r`` (in row
    order) has ``counts[r]`` rows at positions ``computed[r]`` onwards; ``prompt[r]``: they
    are prompt rows (a prefill chunk or a recomputation); ``known[r]``: its tokens known now
    (prompt and outputs; a chunked prompt's later chunks included). vLLM caches full blocks
    only, so a row at position ``p`` can be shared iff ``p < known[r] // block_size *
    block_size``. Example: block 16, a prompt of 40 tokens in one chunk: rows 0-31 shared,
    32-39 not; a first chunk of 20 of them: rows 0-19 all shared (its block 1 is filled by
    the next chunk)."""
    shared = np.zeros(sum(counts), dtype=bool)
    start = 0
    for n, is_prompt, first, total in zip(counts, prompt, computed, known):
        if is_prompt:
            end = total // block_size * block_size  # positions before it are in full blocks
            shared[start: start + max(0, min(n, end - first))] = True
        start += n
    return shared


EMBEDDING_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
                   "language_model.model.embed_tokens.weight")


def load_target_embedding(param: torch.Tensor, model_config, load_config) -> None:
    """Load the target's input embedding (its checkpoint tensor, one of ``EMBEDDING_NAMES``)
    into ``param``, a drafter's ``VocabParallelEmbedding`` weight, through the parameter's own
    loader (its tensor-parallel shard, its vocabulary padding)."""
    import json
    import os

    from safetensors import safe_open
    from vllm.model_executor.model_loader.weight_utils import (
        default_weight_loader,
        download_weights_from_hf,
    )

    from vllm_ddtree.plugin.options import DDTreeConfigError

    path = model_config.model
    if not os.path.isdir(path):
        path = download_weights_from_hf(path, load_config.download_dir,
                                        ["*.safetensors", "*.json"], model_config.revision)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            where = json.load(f)["weight_map"]
    else:
        where = {}
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(path, name), "pt") as f:
                    where.update(dict.fromkeys(f.keys(), name))
    key = next((k for k in EMBEDDING_NAMES if k in where), None)
    if key is None:
        raise DDTreeConfigError(
            f"ddtree: under pipeline parallelism the DFlash drafter needs the target's input "
            f"embedding on the last stage, and {model_config.model} has none of "
            f"{list(EMBEDDING_NAMES)} in safetensors; use --tensor-parallel-size instead of "
            "--pipeline-parallel-size")
    with safe_open(os.path.join(path, where[key]), "pt") as f:
        weight = f.get_tensor(key)
    getattr(param, "weight_loader", default_weight_loader)(param, weight.to(param.dtype))


class DDTreeProposer(DFlashProposer):
    def __init__(self, vllm_config, device: torch.device, runner, state: TreeState):
        spec = vllm_config.speculative_config
        budget = spec.num_speculative_tokens
        # DFlash sizes its query buffers by num_speculative_tokens; the drafter runs
        # depth + 1 queries per request, which may exceed the budget B.
        spec.num_speculative_tokens = max(budget, state.depth)
        try:
            super().__init__(vllm_config, device, runner)
        finally:
            spec.num_speculative_tokens = budget
        self.ddtree_state = state
        self._runner = runner
        self._pending_tree: DraftTree | None = None
        self._pending_probs: torch.Tensor | None = None
        self._pending_budget = state.budget  # this step's build_tree budget (policy)
        self._pending_calibration = None  # and its calibration (TreeState.tree_calibration)
        # what _sample_draft_tokens hands DFlash (which only reshapes it): one buffer, no op
        self._placeholder_ids = torch.zeros(self.max_batch_size * state.depth, dtype=torch.int64,
                                            device=device)
        # paused steps' context rows (hidden, chain positions, slots), see store_context
        self._kept_context: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._kept_rows = 0

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        from vllm.distributed.parallel_state import get_pp_group

        pp = get_pp_group()
        if pp.world_size > 1 and pp.is_last_rank and not getattr(
                self.model, "has_own_embed_tokens", False):
            # vLLM shares the target's input embedding with a drafter that has none only
            # without pipeline parallelism (the last stage does not hold it): the drafter would
            # draft from an untrained embedding. Load the target's from its checkpoint.
            load_target_embedding(self.model.model.embed_tokens.weight,
                                  self.vllm_config.model_config,
                                  self.vllm_config.load_config)

    def propose(self, num_speculative_tokens, **kwargs) -> torch.Tensor:
        """Draft one tree per request; returns ``[R, B]`` node tokens in best-first order,
        padding -1.

        The budget policy sizes each request's tree (``TreeState.budgets``); steps in which it
        gives no request any node do not come here (see :meth:`store_context`).
        """
        state = self.ddtree_state
        self.flush_context()  # paused steps' context first, then this step's: in order
        num_reqs = kwargs["next_token_ids"].shape[0]
        sampling = sampling_batch(kwargs["sampling_metadata"])
        sampled = None if sampling is None else ~sampling.is_greedy  # [R] bool, T > 0
        structured = None  # only auto's budgets weigh it
        if state.budgets.name == "auto":
            requests = self._runner.requests
            structured = [has_structured_outputs(requests[req_id])
                          for req_id in self._runner.input_batch.req_ids[:num_reqs]]
        complete = None
        if state.ever_cold:  # requests with a hole in their drafter context draft nothing
            table = self._runner.input_batch.block_table[self.kv_cache_gid]
            complete = state.context_complete(
                table.block_table.gpu,
                self._runner.input_batch.num_computed_tokens_cpu[:num_reqs].tolist(),
                table.block_size)
            state.context_written(self._step_slots(kwargs["target_hidden_states"].shape[0]))
        self._pending_budget = state.budgets.budget(num_reqs, sampled, complete, structured)
        reshaped = None if state.calibration is None else known_params.reshaping(
            self._runner.requests, self._runner.input_batch.req_ids[:num_reqs])
        self._pending_calibration = state.tree_calibration(sampled, num_reqs, reshaped)
        self._pending_tree = None
        super().propose(state.depth, **kwargs)
        tree = self._pending_tree
        assert tree is not None, "DFlash did not sample draft tokens"
        self._pending_tree = None
        law = None if self._pending_probs is None else (self._pending_probs,)
        state.record_proposal(list(self._runner.input_batch.req_ids[:num_reqs]), tree, law)
        # Padding nodes (-1: beyond the request's budget, or of probability zero) go to the
        # host as they are: take_draft_token_ids (TreeState.clip_drafts) sends only the real
        # nodes (depth > 0) to the scheduler, and nothing else reads them (async scheduling,
        # which would scatter them into the next step's input ids, is refused).
        return tree.token_ids

    def store_context(self, target_hidden_states: torch.Tensor, num_tokens: int) -> None:
        """The drafter's context pass alone, for a step in which the policy drafts nothing.

        DFlash keeps the K/V of the committed text in the drafter's cache: every step writes
        the context rows of its ``num_tokens`` target tokens (``precompute_and_store_context_kv``:
        ``fc`` of the auxiliary hidden states, norms, RoPE at chain positions, the group's
        slots), committed rows in chain order as :meth:`set_inputs_first_pass` arranges them.
        Doing only that (no query pass, no lm_head, no tree, none of vLLM's drafter input
        preparation) keeps the cache complete, so drafting can resume any step later with the
        same context it would have had.

        The pass is deferred: the step's rows, positions and slots are kept, and
        :meth:`flush_context` writes every kept step in one pass when :meth:`propose` next runs
        the drafter (or once ``max_num_tokens`` rows are kept). Nothing reads the drafter's cache
        in between, and the writes keep their order (a slot freed by a finished request and
        given to another is written by the later step last), so the cache the query pass reads
        is the one that writing each step at once would have left. One pass over many steps'
        rows costs about what one step's does: a paused drafter costs a copy per step.

        Args:
            target_hidden_states: ``[>= num_tokens, n_aux * H]`` concatenated auxiliary hidden
                states of the step's rows, a tensor of the step's own (kept until the flush).
        """
        state = self.ddtree_state
        hidden = target_hidden_states[:num_tokens]
        gather = state.take_gather_index(num_tokens)
        if gather is not None:  # after a tree verify step: accepted rows to chain rows
            hidden = hidden.index_select(0, gather)
        slots = self._step_slots(num_tokens)
        self._keep_context(hidden, state.chain_positions[:num_tokens], slots.clone())

    def _keep_context(self, hidden: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor) -> None:
        """Keep context rows (tensors of their own) for :meth:`flush_context`."""
        self.ddtree_state.context_written(slots)
        self._kept_context.append((hidden, positions, slots))
        self._kept_rows += hidden.shape[0]
        if self._kept_rows >= self._runner.max_num_tokens:
            self.flush_context()

    def skip_context(self, scheduler_output, aux_hidden_states: list[torch.Tensor]) -> None:
        """A cold step (auto's long pauses): no context pass for the rows of running requests.
        Their positions get no drafter context, so those requests draft nothing for the rest
        of their life (and a prefix-cache hit on these positions gives a later request
        nothing to draft from: :meth:`TreeState.context_complete`); requests that arrive once
        the drafter keeps its context again draft normally. Saves the context pass's GEMMs and
        copies per step.

        Prompt rows (a request scheduled more tokens than its last token and its drafts: a
        prefill chunk, or the recomputation of a preempted request) that the prefix cache can
        share still get their context, kept for the next pass like :meth:`store_context`'s:
        prompts are what the prefix cache shares (a system prompt), so a prompt that arrived in
        a pause must not leave holes in the context of every later request that reuses it. The
        prefix cache shares whole blocks only (:func:`shareable_rows`): the rows of a prompt's
        last, partial block are completed by its request's next tokens, which a cold step
        leaves without context anyway, so they go cold with the decode rows (a request whose
        prompt fills no block keeps nothing: the tiny pair's 64-token prompts in blocks of 128
        on the CPU).
        """
        state = self.ddtree_state
        num_tokens = scheduler_output.total_num_scheduled_tokens
        gather = state.take_gather_index(num_tokens)
        batch = self._runner.input_batch
        req_ids = batch.req_ids[: batch.num_reqs]
        slots = self._step_slots(num_tokens)
        spec = scheduler_output.scheduled_spec_decode_tokens
        if num_tokens == len(req_ids) + sum(map(len, spec.values())):
            state.went_cold(req_ids, slots)  # decode rows only (the common case)
        else:
            counts = [scheduler_output.num_scheduled_tokens[r] for r in req_ids]
            prompt = [n > 1 + len(spec.get(r, ())) for r, n in zip(req_ids, counts)]
            requests = self._runner.requests
            shared = shareable_rows(
                counts, prompt, batch.num_computed_tokens_cpu[: len(req_ids)].tolist(),
                [requests[r].num_tokens for r in req_ids],
                batch.block_table[self.kv_cache_gid].block_size)  # host: no device sync
            self._keep_prompt_rows(np.flatnonzero(shared), aux_hidden_states, slots,
                                   gather, num_tokens)
            if not shared.all():  # decode rows, or prompt rows the prefix cache cannot share
                others = np.flatnonzero(~shared)
                owners = np.repeat(np.arange(len(req_ids)), counts)[others]
                state.went_cold([req_ids[i] for i in np.unique(owners)],
                                slots.index_select(0, torch.from_numpy(others).to(self.device)))
        state.budgets.went_cold()

    def _keep_prompt_rows(self, rows: np.ndarray, aux_hidden_states: list[torch.Tensor],
                          slots: torch.Tensor, gather: torch.Tensor | None,
                          num_tokens: int) -> None:
        """Keep the context of a cold step's prompt rows (``rows``: host indices into the
        step's ``num_tokens`` rows) for the next pass. Prompt rows are never depth-shifted:
        the runner's positions are chain positions."""
        if not len(rows):
            return
        positions = self._runner.positions
        first, end = int(rows[0]), int(rows[-1]) + 1
        if gather is None and end - first == len(rows):
            # one block of rows (a wave's prompts; new requests after the running ones, vLLM's
            # order): slices, copied once (the aux outputs and both buffers are reused)
            self._keep_context(torch.cat([h[first:end] for h in aux_hidden_states], dim=-1),
                               positions[first:end].clone(), slots[first:end].clone())
            return
        index = torch.from_numpy(rows).to(self.device)
        hidden = torch.cat([h[:num_tokens] for h in aux_hidden_states], dim=-1)
        if gather is not None:
            hidden = hidden.index_select(0, gather)
        self._keep_context(hidden.index_select(0, index),
                           positions[:num_tokens].index_select(0, index),
                           slots.index_select(0, index))

    def _step_slots(self, num_tokens: int) -> torch.Tensor:
        """The drafter group's K/V slots of this step's ``num_tokens`` rows (a view)."""
        table = self._runner.input_batch.block_table[self.kv_cache_gid]
        return table.slot_mapping.gpu[:num_tokens]

    def flush_context(self) -> None:
        """Write the kept context rows of paused steps into the drafter's cache, in order."""
        if not self._kept_context:
            return
        # one kept step (the common pause) needs no concatenation: its tensors are its own
        hidden, positions, slots = (parts[0] if len(parts) == 1 else torch.cat(parts)
                                    for parts in zip(*self._kept_context))
        self._kept_context.clear()
        self._kept_rows = 0
        self.model.precompute_and_store_context_kv(
            self.model.combine_hidden_states(hidden), positions, slots)

    def set_inputs_first_pass(
        self,
        target_token_ids: torch.Tensor,
        next_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        cad,
        num_rejected_tokens_gpu: torch.Tensor | None,
    ):
        state = self.ddtree_state
        num_tokens = target_hidden_states.shape[0]
        gather = state.take_gather_index(num_tokens)
        if gather is not None:
            # accepted nodes' hidden states to the chain rows ctx + 1 .. ctx + k
            target_hidden_states = target_hidden_states.index_select(0, gather)
        if state.chain_positions is not None and state.chain_positions.numel() >= num_tokens:
            target_positions = state.chain_positions[:num_tokens]
        return super().set_inputs_first_pass(
            target_token_ids,
            next_token_ids,
            target_positions,
            target_hidden_states,
            token_indices_to_sample,
            cad,
            num_rejected_tokens_gpu,
        )

    def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata):
        """``hidden_states [R * L, H]`` -> tree; returns placeholder ids of the expected shape
        (a view of one zero buffer: :meth:`propose` discards what DFlash returns)."""
        depth = self.ddtree_state.depth
        logits = self.model.compute_logits(hidden_states)  # [R * L, V]
        num_reqs = logits.shape[0] // depth
        logits = logits.view(num_reqs, depth, -1)
        allowed = getattr(sampling_metadata, "allowed_token_ids_mask", None)  # True: banned
        if allowed is not None:  # never draft a token the request does not allow
            logits = logits.masked_fill(allowed[:num_reqs, None, :], float("-inf"))
        if self.ddtree_state.options.mode == "hsd_chain":
            self._pending_tree, self._pending_probs = self._sample_chain(logits, sampling_metadata)
        else:
            self._pending_tree = build_tree(
                logits, self._pending_budget, max_budget=self.ddtree_state.budget,
                calibration=self._pending_calibration)
            self._pending_probs = None
        return self._placeholder_ids[: num_reqs * depth], None

    def _sample_chain(self, logits: torch.Tensor, sampling_metadata):
        """hsd_chain: ``[R, L, V]`` -> a chain of B tokens sampled from the drafter's top-K law.

        Random requests draw x_i from q_i = softmax(logits_i / T) restricted to the
        ``DRAFT_LAW_TOP_K`` largest logits and renormalised (:func:`top_k_draft_law`); greedy
        requests take the argmax chain with a point-mass law (HSD then reduces to the walk).
        HSD is lossless for any law the chain is drawn from, so truncating the drafter costs
        acceptance (the tail mass beyond K), never correctness. Returns the chain as a
        DraftTree and the law packed in one ``[R, B, 2K]`` float32 tensor
        (:func:`pack_sparse_law`), not ``[R, B, V]``.
        """
        budget = self.ddtree_state.budget
        logits = logits[:, :budget]
        num_reqs, vocab = logits.shape[0], logits.shape[2]
        sampling = sampling_batch(sampling_metadata)
        probs, ids = top_k_draft_law(logits, None if sampling is None else sampling.temperature)
        if sampling is None:
            pick = torch.zeros(probs.shape[:2], dtype=torch.int64, device=logits.device)
        else:  # a point mass always picks its first entry
            pick = sample_from_probs(probs, sampling.generators)  # [R, B] index into ids
        tokens = ids.gather(2, pick[..., None]).squeeze(2)
        parents = chain_parents(num_reqs, budget, logits.device)
        depths = torch.arange(1, budget + 1, device=logits.device).expand(num_reqs, budget)
        tree = DraftTree(
            token_ids=tokens,
            parents=parents,
            depths=depths,
            scores=torch.zeros(num_reqs, budget, device=logits.device),
            num_nodes=torch.full((num_reqs,), budget, device=logits.device),
            ancestor_mask=_ancestor_mask(parents, budget),
            max_depth=budget,
        )
        return tree, pack_sparse_law(probs, ids, vocab)
