"""The target's model state on V2, with trees: verify trees, depth positions, tree masks.

V2 asks a ``ModelState`` (``vllm.v1.worker.gpu.model_states``) for everything model-specific
in a step, in this order: ``preprocess_state`` (before the attention metadata),
``prepare_attn`` (the metadata), ``prepare_inputs`` (whose entries override the runner's
model inputs), ``postprocess_state`` (after sampling); and, once, ``custom_sampler`` (its
rejection sampler) and ``initialize_kv_cache``. :func:`tree_model_state` subclasses the class
vLLM picks for the target with :class:`TreeModelState` in front, so the model's own state
(M-RoPE, prompt embeddings, a hybrid model's recurrent state) keeps working under it: a new
kind of layer gets tree support by its own model state, without touching this glue.

A step (:class:`TreeStep`):

1. ``preprocess_state``: the verify trees, one per scheduled request, read from the slots of
   the batch (:class:`~vllm_ddtree.plugin.v2.trees.SlotTrees`) and cut to the request's
   scheduled drafts; the depth positions, written into a persistent buffer: query row i of a
   request with drafts moves from ``ctx + i`` to ``ctx + depth(i)``. ``input_batch.positions``
   stays sequential: V2 derives the K/V slots from it, so node i's K/V lands in slot
   ``ctx + i``, where compaction finds it.
2. ``prepare_attn``: the tree-attention backends (``cpu_attention.py``, ``cuda_attention.py``)
   read the step's trees from :attr:`TreeStep.verify`.
3. ``prepare_inputs``: ``{"positions": depth positions}`` for the target's RoPE.
4. the verifier (:mod:`.verifier`) samples, walks and compacts, and leaves the drafter's
   hidden-state gather index for the speculator (:mod:`.speculator`).

Everything per step is device work on fixed-address buffers; the host reads only what the
scheduler already put there (the batch's draft counts, its query starts).
"""

from __future__ import annotations

import torch
from vllm.sampling_params import SamplingType

from vllm_ddtree.calibration import TreeCalibration
from vllm_ddtree.plugin.known_params import reshapes_target
from vllm_ddtree.plugin.options import DDTreeConfigError, DDTreeOptions
from vllm_ddtree.plugin.state import VerifyBatch
from vllm_ddtree.plugin.v2.trees import SlotTrees, needs_chain_history
from vllm_ddtree.sampling import DRAFT_LAW_TOP_K, cached_arange, verify_rows


class TreeStep:
    """The tree state of one V2 runner, shared by its model state, verifier and speculator."""

    def __init__(self, options: DDTreeOptions, max_num_reqs: int, max_num_tokens: int,
                 vocab_size: int, device: torch.device):
        self.options = options
        self.device = device
        law_width = min(DRAFT_LAW_TOP_K, vocab_size) if options.mode == "hsd_chain" else 0
        self.trees = SlotTrees(max_num_reqs, options.budget, options.depth, device,
                               options.calibrate_trees, law_width)
        # trees by observed acceptance (vllm_ddtree/calibration.py)
        self.calibration = (TreeCalibration(options.depth, device) if options.calibrate_trees
                            else None)
        # [max_num_tokens] the target's positions: chain positions, depth-shifted on tree rows
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.verify: VerifyBatch | None = None  # the step's trees (attention reads them)
        self.input_batch = None  # the batch self.verify belongs to
        self.gather_index: torch.Tensor | None = None  # [T] for the drafter (accepted_moves)
        self.compactor = None  # built with the K/V caches (TreeModelState.initialize_kv_cache)
        self.slot_mappings = None  # [groups, max_num_tokens] each row's K/V slot, persistent
        self.drafter_layers: set[str] = set()  # the speculator's (set_attn)
        self.moved = torch.zeros((), dtype=torch.int64, device=device)  # K/V slots moved

    @property
    def num_compacted_slots(self) -> int:
        """K/V slots moved by compaction so far (tests, diagnostics; reading it syncs)."""
        return int(self.moved)

    def begin(self, input_batch) -> None:
        """Step 1 of the module doc for a real batch: its verify trees and depth positions."""
        num_tokens = input_batch.num_tokens_after_padding
        self.positions[:num_tokens].copy_(input_batch.positions[:num_tokens])
        self.verify, self.input_batch, self.gather_index = None, input_batch, None
        counts = input_batch.num_draft_tokens_per_req  # host, [R]: the scheduled drafts
        if counts is None or input_batch.num_draft_tokens == 0:
            return  # nothing to verify: chain positions, V2's own sampler
        num_reqs = input_batch.num_reqs
        width = int(counts.max())
        cu_num_logits = input_batch.cu_num_logits[: num_reqs + 1]
        num_draft = (cu_num_logits[1:] - cu_num_logits[:-1] - 1).long()  # device, [R]
        tree = self.trees.batch(input_batch.idx_mapping, num_draft, width)
        # each request's root and nodes as logits rows, then as the step's token rows
        rows = verify_rows(cu_num_logits[1:], width)  # [R, width + 1]
        token_rows = input_batch.logits_indices[rows]
        column = cached_arange(width + 1, self.device)
        depth = torch.nn.functional.pad(tree.depths, (1, 0))  # [R, width + 1], the root 0
        shift = torch.where((column <= num_draft[:, None]) & (depth > 0), depth - column, 0)
        # (a column past a request's drafts repeats its last row with a shift of 0)
        self.positions.index_add_(0, token_rows.flatten(), shift.flatten())
        query_end = input_batch.query_start_loc_np[1 : num_reqs + 1]
        self.verify = VerifyBatch(
            tree=tree,
            num_draft=counts.tolist(),
            query_start=(query_end - counts - 1).tolist(),  # each request's root row
            num_tokens=input_batch.num_tokens,
            matched=torch.ones(num_reqs, dtype=torch.bool, device=self.device),
            exact=True,
            starts=input_batch.logits_indices[cu_num_logits[:-1].long()],
        )

    def verify_of(self, input_batch) -> VerifyBatch | None:
        """The trees of ``input_batch`` (None for a batch :meth:`begin` did not see: dummy
        runs, CUDA-graph capture)."""
        return self.verify if input_batch is self.input_batch else None

    def positions_of(self, input_batch) -> torch.Tensor:
        """The positions the target reads for ``input_batch``: the depth positions of a begun
        batch, else its own (copied into the persistent buffer, which graphs capture)."""
        num_tokens = input_batch.num_tokens_after_padding
        if input_batch is not self.input_batch:
            self.positions[:num_tokens].copy_(input_batch.positions[:num_tokens])
        return self.positions[:num_tokens]

    def take_gather_index(self, num_tokens: int) -> torch.Tensor | None:
        index, self.gather_index = self.gather_index, None
        if index is None or index.numel() != num_tokens:
            return None
        return index


class TreeModelState:
    """The mixin in front of the target's model state (see the module doc)."""

    ddtree: TreeStep

    def __init__(self, vllm_config, model, encoder_cache, device):
        super().__init__(vllm_config, model, encoder_cache, device)
        from vllm_ddtree.plugin.options import ddtree_options

        self.ddtree = TreeStep(ddtree_options(vllm_config), self.max_num_reqs,
                               self.max_num_tokens, vllm_config.model_config.get_vocab_size(),
                               device)
        self._builders_bound = False

    def add_request(self, req_index: int, new_req_data) -> None:
        super().add_request(req_index, new_req_data)
        params = new_req_data.sampling_params
        self.ddtree.trees.reset(req_index, bool(needs_chain_history(params)),
                                params is not None
                                and params.sampling_type != SamplingType.GREEDY,
                                reshapes_target(params))

    def initialize_kv_cache(self, kv_cache_config, block_tables) -> None:
        super().initialize_kv_cache(kv_cache_config, block_tables)
        from vllm_ddtree.plugin.compaction import KVCompactor
        from vllm_ddtree.plugin.support import check_attention_layers

        forward_context = self.vllm_config.compilation_config.static_forward_context
        # the layers are final now: refuse what the tree kernels cannot compute, before serving
        check_attention_layers(forward_context, self.ddtree.drafter_layers)
        slot_mappings = self.ddtree.slot_mappings = block_tables.slot_mappings
        self.ddtree.compactor = KVCompactor(
            kv_cache_config.kv_cache_groups, forward_context, self.ddtree.drafter_layers,
            self.ddtree.options.depth, lambda gid, n: slot_mappings[gid, :n])
        self.ddtree.compactor.warm_up()

    def preprocess_state(self, input_batch, block_tables, kv_cache_config,
                         num_computed_tokens) -> None:
        super().preprocess_state(input_batch, block_tables, kv_cache_config,
                                 num_computed_tokens)
        self.ddtree.begin(input_batch)

    def prepare_attn(self, input_batch, cudagraph_mode, block_tables, slot_mappings,
                     attn_groups, kv_cache_config, *args, **kwargs):
        if not self._builders_bound:  # the tree backends' builders read TreeStep.verify
            for groups in attn_groups:
                for group in groups:
                    for builder in group.metadata_builders:
                        if hasattr(type(builder), "ddtree_state"):
                            builder.ddtree_state = self.ddtree
            self._builders_bound = True
        if self.ddtree.verify_of(input_batch) is None:
            self.ddtree.verify = None  # a dummy or capture batch: no trees
        return super().prepare_attn(input_batch, cudagraph_mode, block_tables, slot_mappings,
                                    attn_groups, kv_cache_config, *args, **kwargs)

    def prepare_inputs(self, input_batch, req_states) -> dict:
        inputs = super().prepare_inputs(input_batch, req_states)
        if "positions" in inputs:  # (M-RoPE targets are refused at engine start)
            raise DDTreeConfigError(
                f"ddtree: {type(self).__name__} feeds the target its own positions, which trees "
                "cannot shift to node depths; serve this model without ddtree")
        inputs["positions"] = self.ddtree.positions_of(input_batch)
        return inputs

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> dict:
        inputs = super().prepare_dummy_inputs(num_reqs, num_tokens)
        inputs["positions"] = self.ddtree.positions[:num_tokens]  # what graphs capture
        return inputs

    def custom_sampler(self, sampler):
        if super().custom_sampler(sampler) is not None:
            raise DDTreeConfigError(
                f"ddtree: the target's model state {type(self).__name__} brings its own "
                "sampler, which cannot verify trees; serve this model without ddtree")
        from vllm.v1.worker.gpu.sample.bad_words import BadWordsState
        from vllm.v1.worker.gpu.sample.logit_bias import LogitBiasState
        from vllm.v1.worker.gpu.sample.penalties import PenaltiesState

        builtin = (LogitBiasState, PenaltiesState, BadWordsState)
        custom = [type(p).__name__ for p in sampler.logits_processors
                  if not isinstance(p, builtin)]
        if custom:
            raise DDTreeConfigError(
                f"ddtree: custom logits processors ({', '.join(custom)}) read a row's drafts as "
                "a chain and cannot process tree rows; drop them or serve without ddtree")
        from vllm_ddtree.plugin.v2.verifier import TreeBadWords, TreePenalties, TreeVerifier

        # penalties and bad words read each tree row's path, not the drafts before it in its
        # block: in their places, the same processors with tree rows
        processors = sampler.logits_processors
        for i, processor in enumerate(processors):
            if isinstance(processor, PenaltiesState):
                processors[i] = TreePenalties(processor, self.ddtree)
            elif isinstance(processor, BadWordsState):
                processors[i] = TreeBadWords(processor, self.ddtree, self.max_num_reqs)
        return sampler, TreeVerifier(sampler, self.ddtree)


_CLASSES: dict[type, type] = {}


def tree_model_state(base: type) -> type:
    """``base`` (the model state class vLLM picked) with :class:`TreeModelState` in front."""
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(f"DDTree{base.__name__}", (TreeModelState, base), {})
    return cls
