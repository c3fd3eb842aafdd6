"""Tree attention and K/V compaction on vLLM's CPU backend (``CPU_ATTN``).

The CPU platform ignores the attention-backend selection, so the plugin overrides
``CPU_ATTN`` itself with :class:`DDTreeCPUBackend`. It behaves exactly like the stock backend
unless its builder holds a :class:`TreeState` with a verify batch: then, after the stock causal
kernel, the node rows of every request with drafts are recomputed with the torch reference
:func:`vllm_ddtree.kernels.masked_attention_ref` over the committed context (read from the
paged cache) plus the request's ancestor-only span. The root row is causal already.

CPU K/V layout (one tensor per layer, ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``):
for the ``vec``/``vec16`` kernels a block's K half is stored transposed, ``[head_dim,
block_size]``, and its V half plain, ``[block_size, head_dim]``. :class:`CPUKVLayout` reads and
writes slots in that layout; :func:`check_cpu_kv_layout` proves it against vLLM's own
``cpu_attn_reshape_and_cache`` once per configuration and refuses to run otherwise.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from vllm_ddtree.kernels import masked_attention_ref


@dataclass
class TreeAttentionInfo:
    """Host-side description of the tree rows of one verify step."""

    requests: list[tuple[int, int, int]]  # (request row, first query row, m) with m > 0
    dense_mask: torch.Tensor  # [R, B + 1, B + 1] bool ancestor mask (row/col 0 = root)


@dataclass
class DDTreeCPUMetadata(CPUAttentionMetadata):
    ddtree: TreeAttentionInfo | None = None


class CPUKVLayout:
    """Slot reads and writes of one CPU layer cache ``[nb, nkv, bs, 2 * D]`` (see module doc).

    Example: block_size 32, slot 70 = block 2, offset 6: K is ``k_t[2, :, :, 6]`` and V is
    ``v[2, :, 6, :]``, each ``[num_kv_heads, head_dim]``.
    """

    def __init__(self, kv_cache: torch.Tensor):
        if not kv_cache.is_contiguous():
            raise RuntimeError(
                f"ddtree: expected a contiguous CPU KV cache per layer, got strides "
                f"{kv_cache.stride()} for shape {tuple(kv_cache.shape)}"
            )
        nb, nkv, bs, two_d = kv_cache.shape
        d = two_d // 2
        self.block_size = bs
        # K half of each (block, head) region, reinterpreted as [head_dim, block_size]
        self.k_t = kv_cache.as_strided(
            (nb, nkv, d, bs), (nkv * 2 * bs * d, 2 * bs * d, bs, 1), kv_cache.storage_offset()
        )
        self.v = kv_cache.view(nb, nkv, 2 * bs, d)[:, :, bs:, :]

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``slots [n]`` -> ``(K [n, nkv, D], V [n, nkv, D])``."""
        blocks, offsets = slots // self.block_size, slots % self.block_size
        return self.k_t[blocks, :, :, offsets], self.v[blocks, :, offsets, :]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        blocks, offsets = slots // self.block_size, slots % self.block_size
        self.k_t[blocks, :, :, offsets] = k
        self.v[blocks, :, offsets, :] = v


@functools.lru_cache(maxsize=None)
def check_cpu_kv_layout(isa: str, dtype: torch.dtype, block_size: int, num_kv_heads: int,
                        head_dim: int) -> None:
    """Write random K/V with vLLM's kernel and read them back through :class:`CPUKVLayout`."""
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(0)
    num_blocks, n = 3, 2 * block_size
    cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_dim, dtype=dtype)
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    view = cache.view(num_blocks, num_kv_heads, 2 * block_size, head_dim)
    kc, vc = view.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
    got_k, got_v = CPUKVLayout(cache).read(slots)
    if not (torch.equal(got_k, k) and torch.equal(got_v, v)):
        raise RuntimeError(
            f"ddtree: vLLM's CPU KV cache layout for isa={isa!r}, dtype={dtype}, "
            f"block_size={block_size}, head_dim={head_dim} is not the one this plugin reads; "
            "ddtree cannot run on this CPU configuration (try dtype=float32)"
        )


class DDTreeCPUMetadataBuilder(CPUAttentionMetadataBuilder):
    # Set by the runner patch on the builders of a ddtree runner; None = stock behaviour.
    ddtree_state = None

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        state = self.ddtree_state
        if state is None or state.verify is None or state.options.mode != "tree":
            return meta  # no verify step, or chains (causal is exact)
        verify = state.verify
        requests = [
            (r, start, m)
            for r, (start, m) in enumerate(zip(verify.query_start, verify.num_draft))
            if m > 0
        ]
        if not requests:
            return meta
        info = TreeAttentionInfo(requests=requests, dense_mask=verify.tree.dense_mask())
        return DDTreeCPUMetadata(**vars(meta), ddtree=info)

    def build_for_drafting(self, common_attn_metadata, draft_index: int):
        # The drafter's own (non-causal block) attention: always the stock path.
        return super().build(0, common_attn_metadata, fast_build=True)


class DDTreeCPUImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        info = getattr(attn_metadata, "ddtree", None)
        if info is None:
            return output
        num_blocks, num_kv_heads, block_size, two_d = kv_cache.shape
        head_dim = two_d // 2
        check_cpu_kv_layout(layer.isa, kv_cache.dtype, block_size, num_kv_heads, head_dim)
        layout = CPUKVLayout(kv_cache)
        out = output.view(output.shape[0], -1, head_dim)
        seq_lens = attn_metadata.seq_lens
        for r, start, m in info.requests:
            span = m + 1
            ctx = int(seq_lens[r]) - span
            positions = torch.arange(ctx, device=kv_cache.device)
            blocks = attn_metadata.block_table[r, positions // block_size].to(torch.int64)
            k_ctx, v_ctx = layout.read(blocks * block_size + positions % block_size)
            k = torch.cat([k_ctx, key[start : start + span]], dim=0)
            v = torch.cat([v_ctx, value[start : start + span]], dim=0)
            mask = torch.cat(
                [
                    torch.ones(m, ctx, dtype=torch.bool),
                    info.dense_mask[r, 1:span, :span],
                ],
                dim=1,
            )
            out[start + 1 : start + span] = masked_attention_ref(
                query[start + 1 : start + span], k, v, mask, self.scale
            ).to(out.dtype)
        return output


class DDTreeCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return DDTreeCPUImpl

    @staticmethod
    def get_builder_cls():
        return DDTreeCPUMetadataBuilder


def compact_cpu_kv(kv_caches: list[torch.Tensor], src_slots: torch.Tensor,
                   dst_slots: torch.Tensor) -> None:
    """Copy slot src[n] -> dst[n] in every CPU-layout layer cache; -1 entries are skipped.

    All sources are read before any write, so overlapping moves are safe.
    """
    keep = (src_slots >= 0) & (dst_slots >= 0)
    src, dst = src_slots[keep], dst_slots[keep]
    if src.numel() == 0:
        return
    for cache in kv_caches:
        layout = CPUKVLayout(cache)
        k, v = layout.read(src)
        layout.write(dst, k.clone(), v.clone())
