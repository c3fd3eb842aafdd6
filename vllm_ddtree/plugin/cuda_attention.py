"""Tree attention on vLLM's CUDA ``TRITON_ATTN`` backend (experimental).

The plugin overrides ``TRITON_ATTN`` with :class:`DDTreeTritonBackend` and, for ddtree engines
on CUDA, selects that backend for the TARGET. The drafter does not get it: vLLM builds the
drafter's config with ``speculative_config.attention_backend`` (None unless the user sets it),
so its backend is auto-selected among those supporting DFlash's non-causal block (FLASH_ATTN on
an H100), and the drafter's own attention never needs a tree mask. It behaves exactly like the
stock backend unless its builder holds a :class:`TreeState` with a verify batch: then the whole
step (tree requests, and the causal prefill or decode requests scheduled with them) runs in ONE
launch of :func:`vllm_ddtree.kernels.tree_attention`, with each request's packed ancestor mask
(``DraftTree.ancestor_mask``, row/column 0 = the root = the request's first query token).
vLLM writes the step's K/V into the paged cache before ``forward`` (the backend's
``do_kv_cache_update``), so the kernel reads the span from the cache like the context.

CUDA graphs: the tree kernel reads every per-step input from device buffers of fixed address
(vLLM's query starts, sequence lengths and block tables, and :class:`TreeMasks`), with its grid
fixed by the captured batch, so on Model Runner V2 a ddtree engine reports
:attr:`AttentionCGSupport.UNIFORM_BATCH`: uniform decode batches (every request its B + 1 tree
rows) run as full graphs, mixed batches piecewise. On the V1 runner (whose step writes its
inputs elsewhere) it reports :attr:`AttentionCGSupport.NEVER`: attention runs piecewise (eager)
while the rest of the model stays in CUDA graphs. The stock backend is unchanged for every
other engine.

CUDA K/V layout (one tensor per layer, logical ``[num_blocks, num_kv_heads, block_size,
2 * head_dim]``, any physical stride order): ``kv.transpose(1, 2).split(head_dim, -1)`` gives
the K and V views ``[num_blocks, block_size, num_kv_heads, head_dim]`` the kernels take.
Compaction on this layout lives in ``compaction.py``; :func:`warm_up_tree_attention` compiles
the kernel at engine start.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

from vllm_ddtree.kernels import tree_attention
from vllm_ddtree.plugin.compaction import kv_views
from vllm_ddtree.plugin.options import ddtree_options
from vllm_ddtree.plugin.state import to_device


@dataclass
class TreeMaskInfo:
    """Device tensors of one verify step, in the attention batch's request order."""

    tree_mask: torch.Tensor  # [R, B + 1, ceil((B + 1) / 32)] int32 packed ancestor masks
    has_tree: torch.Tensor  # [R] bool: the request's query span is a tree (m > 0 drafts)


@dataclass
class DDTreeTritonMetadata(TritonAttentionMetadata):
    ddtree: TreeMaskInfo | None = None


class TreeMasks:
    """The kernel's tree inputs in fixed-address buffers, sized for ``max_num_reqs`` requests
    of ``budget + 1`` query rows: ``tree_mask [max_num_reqs, B + 1, W]`` int32 and
    ``has_tree [max_num_reqs]`` bool. Every step copies its masks into them (:meth:`fill`), so
    a CUDA graph captured on them (:meth:`capture`) reads each replay's trees. The kernel takes
    the buffers' full width whatever the step's trees: row i of request r is read only for
    ``i < q_len(r)``, which the step's masks cover."""

    def __init__(self, max_num_reqs: int, budget: int, device: torch.device):
        words = (budget + 1 + 31) // 32
        self.tree_mask = torch.zeros(max_num_reqs, budget + 1, words, dtype=torch.int32,
                                     device=device)
        self.has_tree = torch.zeros(max_num_reqs, dtype=torch.bool, device=device)

    def fill(self, verify, num_reqs: int) -> TreeMaskInfo | None:
        """The kernel inputs of a :class:`~vllm_ddtree.plugin.state.VerifyBatch` whose requests
        are the first of the attention batch's ``num_reqs`` (more with CUDA-graph padding); None
        when no request has drafts. Requests without drafts (prefill chunks) and padding get
        ``has_tree`` False: causal in the same launch."""
        if verify is None or not any(m > 0 for m in verify.num_draft):
            return None
        mask = verify.tree.ancestor_mask
        num_trees, rows, words = mask.shape
        self.tree_mask[:num_trees, :rows, :words].copy_(mask)
        has_tree = self.has_tree[:num_reqs]
        has_tree.zero_()
        has_tree[:num_trees].copy_(to_device([m > 0 for m in verify.num_draft], torch.bool,
                                             has_tree.device))
        return TreeMaskInfo(self.tree_mask[:num_reqs], has_tree)

    def capture(self, num_reqs: int) -> TreeMaskInfo:
        """The kernel inputs a CUDA graph of ``num_reqs`` tree requests captures: the buffers
        themselves (their content at capture does not matter)."""
        self.has_tree[:num_reqs].fill_(True)
        return TreeMaskInfo(self.tree_mask[:num_reqs], self.has_tree[:num_reqs])


class DDTreeTritonMetadataBuilder(TritonAttentionMetadataBuilder):
    # Set by the runner patch on the builders of a ddtree runner; None = stock behaviour.
    ddtree_state = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        options = ddtree_options(vllm_config)
        self._tree_masks = None if options is None else TreeMasks(
            vllm_config.scheduler_config.max_num_seqs, options.budget, device)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        options = ddtree_options(vllm_config)
        if options is None:
            return super().get_cudagraph_support(vllm_config, kv_cache_spec)
        if options.runner == "v2":
            # Model Runner V2 captures uniform decode batches (every request its B + 1 tree
            # rows) in full graphs: the tree kernel reads TreeMasks' buffers and the depth
            # positions' (v2/model_state.py); mixed batches run attention piecewise
            return AttentionCGSupport.UNIFORM_BATCH
        return AttentionCGSupport.NEVER  # the V1 runner: attention piecewise (module doc)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        state = self.ddtree_state
        if state is None or state.options.mode != "tree":
            return meta  # stock engine, or chains (causal is exact)
        info = self._tree_masks.fill(state.verify, common_attn_metadata.num_reqs)
        if info is None:
            return meta
        return DDTreeTritonMetadata(**vars(meta), ddtree=info)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        meta = super().build_for_cudagraph_capture(common_attn_metadata)
        if self.ddtree_state is None or self.ddtree_state.options.mode != "tree":
            return meta
        # A full graph of tree verify steps: the tree kernel, on the persistent masks. vLLM
        # sets seq_lens to 1 for the capture run; a tree's B + 1 rows must fit its sequence.
        meta.seq_lens.fill_(common_attn_metadata.max_query_len)
        meta = DDTreeTritonMetadata(**{k: v for k, v in vars(meta).items() if k != "ddtree"},
                                    ddtree=self._tree_masks.capture(common_attn_metadata.num_reqs))
        return meta


class DDTreeTritonImpl(TritonAttentionImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        info = getattr(attn_metadata, "ddtree", None)
        if info is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        self._check_tree_support(output_scale, output_block_scale)
        num_tokens = attn_metadata.num_actual_tokens
        key_cache, value_cache = kv_views(kv_cache, self.head_size)
        out = output[:num_tokens]
        if out.dim() == 2:
            out = out.view(num_tokens, self.num_heads, self.head_size)
        tree_attention(
            query[:num_tokens].view(num_tokens, self.num_heads, self.head_size),
            key_cache,
            value_cache,
            attn_metadata.block_table,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc,
            info.tree_mask,
            info.has_tree,
            self.scale,
            out=out,
            max_query_len=attn_metadata.max_query_len,
            max_seq_len=attn_metadata.max_seq_len,  # small batches split the context
        )
        return output

    @staticmethod
    def _check_tree_support(output_scale, output_block_scale) -> None:
        # Layer features (windows, sinks, soft-capping, ALiBi, quantized K/V) are refused at
        # engine start (support.check_attention_layers, _select_attention_backend); fused
        # output quantization is only known here.
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                "ddtree tree attention does not support fused output quantization; serve "
                "this model without ddtree"
            )


class DDTreeTritonBackend(TritonAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return DDTreeTritonImpl

    @staticmethod
    def get_builder_cls():
        return DDTreeTritonMetadataBuilder


def warm_up_tree_attention(runner) -> None:
    """Compile the tree-attention kernel for every target layer shape now (engine start).

    Serving launches it with the same dtypes, strides and constants every step (the batch
    only changes the grid, the number of context splits and the contents of the metadata
    tensors), so one launch per distinct layer shape, unsplit and split, compiles everything a
    verify step will need. The launch reads block
    0 of the real cache for one query row and writes a scratch output.
    """
    budget = runner.ddtree_state.budget
    drafter_layers = set(getattr(runner.drafter, "_draft_attn_layer_names", ()) or ())
    forward_context = runner.compilation_config.static_forward_context
    done = set()
    for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        for name in group.layer_names:
            layer = forward_context[name]
            impl = getattr(layer, "impl", None)
            if name in drafter_layers or not isinstance(impl, DDTreeTritonImpl):
                continue
            kv_cache = layer.kv_cache
            key = (gid, kv_cache.dtype, tuple(kv_cache.shape), kv_cache.stride(),
                   impl.num_heads, impl.head_size, impl.num_kv_heads)
            if key in done:
                continue
            done.add(key)
            device = kv_cache.device
            key_cache, value_cache = kv_views(kv_cache, impl.head_size)
            query = torch.zeros(1, impl.num_heads, impl.head_size, dtype=kv_cache.dtype,
                                device=device)
            words = (budget + 1 + 31) // 32
            for num_splits in (1, 2):  # one launch, and the split context with its merge
                tree_attention(
                    query, key_cache, value_cache,
                    runner.input_batch.block_table[gid].get_device_tensor(1),
                    torch.ones(1, dtype=torch.int32, device=device),  # seq_lens
                    torch.arange(2, dtype=torch.int32, device=device),  # query_start_loc
                    torch.zeros(1, budget + 1, words, dtype=torch.int32, device=device),
                    torch.ones(1, dtype=torch.bool, device=device),  # has_tree
                    impl.scale, out=torch.empty_like(query), max_query_len=1,
                    num_splits=num_splits,
                )
