"""DDTreeSpeculator: vLLM's V2 DFlash speculator, drafting the optimal tree.

vLLM's ``DFlashSpeculator`` runs the drafter on a block of ``1 + k`` queries per request (the
bonus token, then k mask tokens) and takes the argmax at each mask position: a chain of k
drafts. Here the block is ``1 + L`` queries (L = the drafter's depth, whatever the budget B),
the L per-position distributions go to :func:`vllm_ddtree.tree.build_tree`, and the B node
tokens (best-first: any prefix is a subtree) become the request's drafts; the tree's structure
goes to the request's slot (:class:`~vllm_ddtree.plugin.v2.trees.SlotTrees`), where the next
step's model state finds it. The tree build is device work of fixed shape, so it runs inside
the drafter's CUDA graph like DFlash's sampling does. In ``hsd_chain`` mode the drafts are a
chain sampled from the drafter's law at each request's temperature
(:meth:`DDTreeSpeculator._sample_chain`).

The drafter's context: DFlash keeps the K/V of the committed text in its own cache, rebuilt
each step from the target's auxiliary hidden states of the step's rows, taking a request's
accepted rows as a prefix of its span (``num_rejected`` rows at the end are dropped). After a
tree verify step the accepted rows are scattered over the tree's rows: before DFlash reads
them, :meth:`DDTreeSpeculator.propose` gathers the path's rows to the front (the verifier's
gather index, ``state.accepted_moves``). Their sequential positions are the chain positions
the accepted tokens now hold, so the context is the committed text's and the drafter layers
need no compaction.
"""

from __future__ import annotations

import torch
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from vllm_ddtree.plugin.options import ddtree_options
from vllm_ddtree.sampling import keyed_chain, seed_keys_of, top_k_draft_law
from vllm_ddtree.tree import build_tree


class DDTreeSpeculator(DFlashSpeculator):
    _speculator_name = "DDTree"

    def __init__(self, vllm_config, device: torch.device):
        # (first: 0.33's __init__ sizes a buffer by _num_graph_context_tokens, which reads it)
        self.options = options = ddtree_options(vllm_config)
        spec = vllm_config.speculative_config
        budget = spec.num_speculative_tokens
        # DFlash sizes its query block and sampling buffers by num_speculative_tokens: the
        # drafter runs 1 + L queries per request, whatever the tree budget B
        spec.num_speculative_tokens = options.depth
        try:
            super().__init__(vllm_config, device)
        finally:
            spec.num_speculative_tokens = budget
        self.step = None  # the model state's TreeStep (set_attn)
        # [max_num_reqs, B] the drafts of the step's requests: their trees' node tokens
        self.tree_tokens = torch.zeros(self.max_num_reqs, options.budget, dtype=torch.int64,
                                       device=device)

    def set_attn(self, model_state, *args, **kwargs) -> None:
        super().set_attn(model_state, *args, **kwargs)
        self.step = model_state.ddtree  # the runner's model state is a TreeModelState
        self.step.drafter_layers = set(self.draft_attn_layer_names)

    def _num_graph_context_tokens(self, num_reqs: int) -> int:
        # context rows a captured draft step stores: one tree verify (B + 1 rows) per request
        return min(num_reqs * (self.options.budget + 1), self.max_num_tokens)

    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, *args, **kwargs) -> torch.Tensor:
        """The step's trees: ``[R, B]`` node tokens (0 for padding nodes), stored in their
        requests' slots with their structure. DFlash's context is built from the target's
        auxiliary hidden states with the accepted path's rows gathered to the front of each
        request's span first (the module doc). A step in which vLLM asks for no drafts
        (0.33's ``num_speculative_tokens=0``: no request of the batch verifies drafts next)
        stores the context only; the slots' trees are then never verified."""
        num_tokens = input_batch.num_tokens
        gather = None if self.step is None else self.step.take_gather_index(num_tokens)
        if gather is not None and aux_hidden_states:
            # (DFlash reads each tensor's first num_tokens rows)
            aux_hidden_states = [h[:num_tokens].index_select(0, gather)
                                 for h in aux_hidden_states]
        super().propose(input_batch, attn_metadata, slot_mappings, last_hidden_states,
                        aux_hidden_states, *args, **kwargs)
        return self.tree_tokens[: input_batch.num_reqs]

    def _generate_draft(self, num_reqs: int, num_tokens_padded: int, attn_metadata,
                        slot_mappings, num_tokens_across_dp,
                        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE) -> None:
        hidden = self._run_model(num_tokens_padded, attn_metadata, slot_mappings,
                                 num_tokens_across_dp, cudagraph_runtime_mode)
        depth = self.num_speculative_steps  # L mask positions per request
        num_sample = num_reqs * depth
        logits = self.model.compute_logits(hidden[self.sample_indices[:num_sample]])
        step = self.step  # None: memory profiling, before the K/V caches exist
        # each request's slot (-1 for a padding row: its tree goes nowhere)
        slots = self.sample_idx_mapping[:num_sample].view(num_reqs, depth)[:, 0]
        logits = logits.view(num_reqs, depth, -1)
        if self.options.mode == "hsd_chain":
            chain, law = self._sample_chain(logits, slots, num_sample)
            if step is not None:
                self.tree_tokens[:num_reqs] = step.trees.store(slots, None, chain, law)
            return
        calibration = None
        if step is not None and step.calibration is not None:
            target = step.trees.targets(slots)
            # (a request whose features reshape the target's law gets DDTree's tree)
            calibration = step.calibration.log_factors(step.trees.sampled[target]).masked_fill_(
                step.trees.reshaped[target][:, None, None], 0.0)
        tree = build_tree(logits, self.options.budget, calibration=calibration)
        if step is not None:  # (first choices: the chains of requests that draft chains;
            # a calibrated tree's drafter tops hold them, ranked as argmax breaks ties)
            first = (logits.argmax(dim=-1) if tree.tops is None
                     else tree.tops.token_ids[..., 0])
            self.tree_tokens[:num_reqs] = step.trees.store(slots, tree, first)

    def _sample_chain(self, logits: torch.Tensor, slots: torch.Tensor, num_sample: int):
        """``hsd_chain``: each request's chain of B tokens drawn from the drafter's law at its
        temperature (:func:`~vllm_ddtree.sampling.top_k_draft_law`, a point mass for a greedy
        request: its argmax chain), with noise keyed by its seed and the drafting step's
        position (:func:`~vllm_ddtree.sampling.keyed_chain`); returns ``(chain [R, B], law)``,
        the law ``(probs, ids) [R, B, K]`` the verify step's HSD reads."""
        slot = slots.clamp(min=0)  # (a padding row's values go to the padding slot)
        probs, ids = top_k_draft_law(logits[:, : self.options.budget], self.temperature[slot])
        # sample_pos: each query's predicted position; the block's first predicts P + 1, P
        # the last committed token's
        committed = self.sample_pos[:num_sample].view(logits.shape[0], -1)[:, 0] - 1
        chain = keyed_chain(probs, ids, seed_keys_of(self.seeds[slot]), committed)
        return chain, (probs, ids)
