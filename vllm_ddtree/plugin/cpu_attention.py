"""Tree attention and K/V compaction on vLLM's CPU backend (``CPU_ATTN``).

The CPU platform ignores the attention-backend selection, so the plugin overrides
``CPU_ATTN`` itself with :class:`DDTreeCPUBackend`. It behaves exactly like the stock backend
unless its builder holds a :class:`TreeState` with a verify batch: then, after the stock causal
kernel, the node rows of every request with drafts are recomputed with the torch reference
:func:`vllm_ddtree.kernels.masked_attention_ref` over the committed context (read from the
paged cache) plus the request's ancestor-only span. The root row is causal already.

CPU K/V layout (one tensor per layer, ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``):
each (block, head) holds a K half and a V half of ``block_size * head_dim`` elements, whose
inner order depends on the kernel ISA vLLM picked (``vec``/``vec16``: K transposed, V plain;
``amx`` for bf16: VNNI-packed pairs). :func:`slot_maps` learns that order from vLLM's own
``cpu_attn_reshape_and_cache`` once per configuration, and :class:`CPUKVLayout` reads and
writes slots through it; a layout that is not a permutation of the slot elements (a
quantized cache) is refused with a clear error.
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

    ``k_index`` / ``v_index`` (``[bs, D]``, from :func:`slot_maps`) give the flat position of
    element (offset, dim) inside a (block, head) half. Example (``vec``, block_size 32): K of
    slot 70 = block 2, offset 6 is ``k[2, :, k_index[6]]`` = ``k[2, :, 6 + 32 * d]``.
    """

    def __init__(self, kv_cache: torch.Tensor, k_index: torch.Tensor, v_index: torch.Tensor):
        if not kv_cache.is_contiguous():
            raise RuntimeError(
                f"ddtree: expected a contiguous CPU KV cache per layer, got strides "
                f"{kv_cache.stride()} for shape {tuple(kv_cache.shape)}"
            )
        nb, nkv, bs, two_d = kv_cache.shape
        self.block_size = bs
        halves = kv_cache.view(nb, nkv, 2, bs * (two_d // 2))
        self.k, self.v = halves[:, :, 0], halves[:, :, 1]  # [nb, nkv, bs * D] each
        self.k_index, self.v_index = k_index, v_index

    def _where(self, slots: torch.Tensor, index: torch.Tensor):
        blocks, offsets = slots // self.block_size, slots % self.block_size
        return blocks[:, None], index[offsets]  # [n, 1], [n, D]

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``slots [n]`` -> ``(K [n, nkv, D], V [n, nkv, D])``."""
        kb, kp = self._where(slots, self.k_index)
        vb, vp = self._where(slots, self.v_index)
        # advanced indices around a slice: the result is [n, D, nkv]
        return self.k[kb, :, kp].transpose(1, 2), self.v[vb, :, vp].transpose(1, 2)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        kb, kp = self._where(slots, self.k_index)
        vb, vp = self._where(slots, self.v_index)
        self.k[kb, :, kp] = k.transpose(1, 2).to(self.k.dtype)
        self.v[vb, :, vp] = v.transpose(1, 2).to(self.v.dtype)


def _write_with_vllm(isa: str, dtype: torch.dtype, num_blocks: int, block_size: int,
                     num_kv_heads: int, head_dim: int, k, v, slots) -> torch.Tensor:
    from vllm import _custom_ops as ops

    cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = cache.view(num_blocks, num_kv_heads, 2 * block_size,
                                        head_dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k.to(dtype).contiguous(), v.to(dtype).contiguous(),
                                   key_cache, value_cache, slots, isa)
    return cache


@functools.lru_cache(maxsize=None)
def slot_maps(isa: str, dtype: torch.dtype, block_size: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_index, v_index)`` ``[block_size, head_dim]`` int64 for vLLM's CPU cache layout.

    Learned from vLLM's writer: element (offset o, dim d) of every token of block 0 is written
    as the base-16 digits of ``o * head_dim + d`` (+1, so unwritten zeros show), one digit per
    pass (small integers are exact in every float dtype); where each code lands is its
    position. The maps must be permutations, the same for every head, and must leave other
    blocks untouched; then a random round trip through :class:`CPUKVLayout` must be exact.
    """
    def refuse(why: str) -> RuntimeError:
        return RuntimeError(
            f"ddtree: vLLM's CPU KV cache layout for isa={isa!r}, dtype={dtype}, "
            f"block_size={block_size}, head_dim={head_dim} {why}; ddtree cannot run on this CPU "
            "configuration (try --dtype float32)"
        )

    size = block_size * head_dim
    code = torch.arange(size).view(block_size, 1, head_dim).expand(block_size, num_kv_heads,
                                                                   head_dim)
    found = torch.zeros(2, num_kv_heads, size, dtype=torch.int64)  # K, V codes at each position
    digit = 1
    while digit < size:
        values = ((code // digit) % 16 + 1).float()
        cache = _write_with_vllm(isa, dtype, 2, block_size, num_kv_heads, head_dim,
                                 values, values, torch.arange(block_size))
        halves = cache.view(2, num_kv_heads, 2, size).float()
        if halves[1].any():
            raise refuse("writes outside a slot's block")
        got = halves[0].permute(1, 0, 2)  # [2 (K, V), nkv, size]
        if not torch.equal(got, got.round()) or got.min() < 1 or got.max() > 16:
            raise refuse("is not a permutation of the slot elements")
        found += (got.long() - 1) * digit
        digit *= 16
    maps = []
    for half in found:
        if not (half == half[0]).all():
            raise refuse("differs between KV heads")
        if not torch.equal(half[0].sort().values, torch.arange(size)):
            raise refuse("is not a permutation of the slot elements")
        maps.append(half[0].argsort().view(block_size, head_dim))
    k_index, v_index = maps
    gen = torch.Generator().manual_seed(0)
    n = 2 * block_size
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    slots = torch.randperm(3 * block_size, generator=gen)[:n]
    cache = _write_with_vllm(isa, dtype, 3, block_size, num_kv_heads, head_dim, k, v, slots)
    got_k, got_v = CPUKVLayout(cache, k_index, v_index).read(slots)
    if not (torch.equal(got_k, k) and torch.equal(got_v, v)):
        raise refuse("does not round-trip through the learned slot maps")
    return k_index, v_index


def cpu_kv_layout(kv_cache: torch.Tensor, isa: str) -> CPUKVLayout:
    """The :class:`CPUKVLayout` of one layer cache written by vLLM's kernel for ``isa``."""
    _, num_kv_heads, block_size, two_d = kv_cache.shape
    maps = slot_maps(isa, kv_cache.dtype, block_size, num_kv_heads, two_d // 2)
    return CPUKVLayout(kv_cache, *maps)


def tree_rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float, isa: str) -> torch.Tensor:
    """Attention of the tree rows (:func:`masked_attention_ref` shapes), rounded like vLLM's
    CPU kernel where that is known, so that near-ties resolve as in plain decoding.

    ``amx`` (bf16): the kernel multiplies V by the unnormalised probabilities ``exp(s - max)``
    rounded to bf16 and divides by their float32 sum; doing the same here took a random
    hand-made pair in bf16 (6 prompts x 64 tokens) from 2/6 to 6/6 prompts token-identical to
    plain decoding at B=8 and from 3/6 to 5/6 at B=64. Otherwise: the float32 reference.
    """
    if isa != "amx" or q.dtype != torch.bfloat16:
        return masked_attention_ref(q, k, v, mask, scale)
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)  # [H, q_len, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, kv_len, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = ((qf @ kf.transpose(1, 2)) * scale).masked_fill(~mask, float("-inf"))
    probs = (scores - scores.amax(dim=-1, keepdim=True)).exp()  # every row sees the root
    out = (probs.to(torch.bfloat16).float() @ vf) / probs.sum(dim=-1, keepdim=True)
    return out.transpose(0, 1).to(q.dtype)


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
        block_size, head_dim = kv_cache.shape[2], kv_cache.shape[3] // 2
        layout = cpu_kv_layout(kv_cache, layer.isa)
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
            out[start + 1 : start + span] = tree_rows_attention(
                query[start + 1 : start + span], k, v, mask, self.scale, layer.isa
            ).to(out.dtype)
        return output


class DDTreeCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return DDTreeCPUImpl

    @staticmethod
    def get_builder_cls():
        return DDTreeCPUMetadataBuilder


def compact_cpu_kv(kv_caches: list[torch.Tensor], isa: str, src_slots: torch.Tensor,
                   dst_slots: torch.Tensor) -> None:
    """Copy slot src[n] -> dst[n] in every CPU-layout layer cache written for ``isa``; -1
    entries are skipped.

    All sources are read (gathered into new tensors) before any write, so overlapping moves
    are safe.
    """
    keep = (src_slots >= 0) & (dst_slots >= 0)
    src, dst = src_slots[keep], dst_slots[keep]
    if src.numel() == 0:
        return
    for cache in kv_caches:
        layout = cpu_kv_layout(cache, isa)
        k, v = layout.read(src)
        layout.write(dst, k, v)
