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

import torch
from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_ddtree.plugin.sampler import sampling_batch
from vllm_ddtree.plugin.state import TreeState, chain_parents
from vllm_ddtree.sampling import sample_from_probs
from vllm_ddtree.tree import DraftTree, _ancestor_mask, build_tree


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

    def propose(self, num_speculative_tokens, *args, **kwargs) -> torch.Tensor:
        """Draft one tree per request; returns ``[R, B]`` node tokens in best-first order."""
        state = self.ddtree_state
        self._pending_tree = None
        super().propose(state.depth, *args, **kwargs)
        tree = self._pending_tree
        assert tree is not None, "DFlash did not sample draft tokens"
        self._pending_tree = None
        num_reqs = tree.token_ids.shape[0]
        law = None if self._pending_probs is None else (self._pending_probs,)
        state.record_proposal(list(self._runner.input_batch.req_ids[:num_reqs]), tree, law)
        # Zero-probability padding nodes (-1) go to the scheduler as token 0; the verify step
        # restores their -1 from the recorded tree, so they are never accepted.
        return tree.token_ids.clamp(min=0)

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
        """``hidden_states [R * L, H]`` -> tree; returns placeholder ids of the expected shape."""
        depth = self.ddtree_state.depth
        logits = self.model.compute_logits(hidden_states)  # [R * L, V]
        num_reqs = logits.shape[0] // depth
        logits = logits.view(num_reqs, depth, -1)
        if self.ddtree_state.options.mode == "hsd_chain":
            self._pending_tree, self._pending_probs = self._sample_chain(logits, sampling_metadata)
        else:
            self._pending_tree = build_tree(logits, self.ddtree_state.budget)
            self._pending_probs = None
        return torch.zeros(num_reqs * depth, dtype=torch.int64, device=logits.device), None

    def _sample_chain(self, logits: torch.Tensor, sampling_metadata):
        """hsd_chain: ``[R, L, V]`` -> a chain of B tokens sampled from softmax(logits / T).

        Greedy requests get the argmax chain with a one-hot draft law (HSD then reduces to the
        walk). Returns the chain as a DraftTree and the draft law ``[R, B, V]`` float32.
        """
        budget = self.ddtree_state.budget
        logits = logits[:, :budget].float()
        num_reqs = logits.shape[0]
        greedy_ids = logits.argmax(dim=-1)
        probs = torch.nn.functional.one_hot(greedy_ids, logits.shape[-1]).float()
        tokens = greedy_ids
        sampling = sampling_batch(sampling_metadata)
        if sampling is not None:
            temperature = torch.where(sampling.is_greedy, 1.0, sampling.temperature.float())
            sampled_probs = (logits / temperature[:, None, None]).softmax(dim=-1)
            sampled = sample_from_probs(sampled_probs, sampling.generators)
            random_rows = ~sampling.is_greedy[:, None]
            tokens = torch.where(random_rows, sampled, greedy_ids)
            probs = torch.where(random_rows[:, :, None], sampled_probs, probs)
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
        return tree, probs
