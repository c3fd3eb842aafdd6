"""Tree attention and K/V compaction on vLLM's CUDA ``TRITON_ATTN`` backend (experimental).

The plugin overrides ``TRITON_ATTN`` with :class:`DDTreeTritonBackend` and, for ddtree engines
on CUDA, selects that backend (for the target and the drafter). It behaves exactly like the
stock backend unless its builder holds a :class:`TreeState` with a verify batch: then the whole
step (tree requests, and the causal prefill or decode requests scheduled with them) runs in ONE
launch of :func:`vllm_ddtree.kernels.tree_attention`, with each request's packed ancestor mask
(``DraftTree.ancestor_mask``, row/column 0 = the root = the request's first query token).
vLLM writes the step's K/V into the paged cache before ``forward`` (the backend's
``do_kv_cache_update``), so the kernel reads the span from the cache like the context.

Full CUDA graphs would capture the causal kernel of a warm-up batch, so a ddtree engine reports
:attr:`AttentionCGSupport.NEVER` and vLLM runs attention piecewise (eager) while the rest of the
model stays in CUDA graphs. The stock backend is unchanged for every other engine.

CUDA K/V layout (one tensor per layer, logical ``[num_blocks, num_kv_heads, block_size,
2 * head_dim]``, any physical stride order): ``kv.transpose(1, 2).split(head_dim, -1)`` gives
the K and V views ``[num_blocks, block_size, num_kv_heads, head_dim]`` the kernels take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

from vllm_ddtree.kernels import KVCacheTable, compact_kv, tree_attention
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


def tree_mask_info(verify, device: torch.device) -> TreeMaskInfo | None:
    """The kernel inputs for a :class:`~vllm_ddtree.plugin.state.VerifyBatch` (None: no tree).

    Requests without drafts (prefill chunks) get ``has_tree`` False: causal in the same launch.
    """
    if verify is None or not any(m > 0 for m in verify.num_draft):
        return None
    return TreeMaskInfo(
        tree_mask=verify.tree.ancestor_mask.to(device=device, dtype=torch.int32),
        has_tree=to_device([m > 0 for m in verify.num_draft], torch.bool, device),
    )


def kv_views(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical ``[nb, nkv, bs, 2 * D]`` layer cache -> (K, V) views ``[nb, bs, nkv, D]``."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_dim, dim=-1)
    return key_cache, value_cache


class DDTreeTritonMetadataBuilder(TritonAttentionMetadataBuilder):
    # Set by the runner patch on the builders of a ddtree runner; None = stock behaviour.
    ddtree_state = None

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if ddtree_options(vllm_config) is not None:
            return AttentionCGSupport.NEVER  # attention runs piecewise (see module doc)
        return super().get_cudagraph_support(vllm_config, kv_cache_spec)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        state = self.ddtree_state
        if state is None or state.options.mode != "tree":
            return meta  # stock engine, or chains (causal is exact)
        info = tree_mask_info(state.verify, meta.query_start_loc.device)
        if info is None:
            return meta
        return DDTreeTritonMetadata(**vars(meta), ddtree=info)


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
        )
        return output

    def _check_tree_support(self, output_scale, output_block_scale) -> None:
        unsupported = []
        if self._is_per_token_head_quant or is_quantized_kv_cache(self.kv_cache_dtype):
            unsupported.append(f"kv_cache_dtype={self.kv_cache_dtype!r}")
        if self.alibi_slopes is not None:
            unsupported.append("ALiBi")
        if self.sliding_window not in (None, (-1, -1)):
            unsupported.append(f"sliding window {self.sliding_window}")
        if self.logits_soft_cap:
            unsupported.append("logit soft-capping")
        if self.sinks is not None:
            unsupported.append("attention sinks")
        if output_scale is not None or output_block_scale is not None:
            unsupported.append("fused output quantization")
        if unsupported:
            raise NotImplementedError(
                f"ddtree tree attention does not support {', '.join(unsupported)}; "
                "serve this model without ddtree"
            )


class DDTreeTritonBackend(TritonAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return DDTreeTritonImpl

    @staticmethod
    def get_builder_cls():
        return DDTreeTritonMetadataBuilder


def compact_cuda_kv(kv_caches: list[torch.Tensor], head_dim: int, src_slots: torch.Tensor,
                    dst_slots: torch.Tensor) -> None:
    """Copy slot src[n] -> dst[n] in every layer's K and V with one Triton launch.

    ``-1`` entries are skipped by the kernel (no host synchronisation); overlapping moves are
    safe (every source is read before any destination is written, see ``compact_kv``).
    """
    views = [kv_views(cache, head_dim) for cache in kv_caches]
    compact_kv(KVCacheTable.from_caches(views), src_slots, dst_slots)
