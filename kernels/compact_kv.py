"""Launcher of KV compaction: after a tree verify step, move the accepted path's K/V into the
first slots of the draft region, in every layer, in ONE launch.

The scheduler assumes chains: draft token i sits at position num_computed + i. A tree puts
node k at slot base + 1 + k, so the accepted nodes must move down to consecutive slots before
the next step, in the target's layers and in the drafter's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._launch import check_dtype, check_launchable, check_same_device, next_power_of_2

__all__ = ["KVCacheTable", "compact_kv"]

_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class KVCacheTable:
    """The K and V caches of many layers as one device pointer table (build once, reuse).

    All caches must share shape, strides, dtype and device (one attention group of a model);
    call :meth:`from_caches` once per group otherwise.
    """

    pointers: torch.Tensor  # [2 * num_layers] int64 data pointers: K0, V0, K1, V1, ...
    shape: tuple[int, int, int, int]  # (num_blocks, block_size, num_kv_heads, head_dim)
    strides: tuple[int, int, int, int]  # element strides of every cache
    dtype: torch.dtype
    caches: tuple[torch.Tensor, ...]  # keeps the memory alive while the table exists

    @classmethod
    def from_caches(
        cls, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> "KVCacheTable":
        """``kv_caches``: per layer ``(key_cache, value_cache)``, each
        ``[num_blocks, block_size, num_kv_heads, head_dim]`` (strided views are fine)."""
        caches = []
        for i, layer in enumerate(kv_caches):
            if len(layer) != 2:
                raise ValueError(f"kv_caches[{i}] has {len(layer)} tensors, expected (K, V)")
            caches.extend(layer)
        if not caches:
            raise ValueError("kv_caches is empty: pass at least one (key_cache, value_cache)")
        first = caches[0]
        if first.dim() != 4:
            raise ValueError(f"kv_caches[0][0].shape={tuple(first.shape)}, expected "
                             "[num_blocks, block_size, num_kv_heads, head_dim]")
        for i, c in enumerate(caches):
            same = (c.shape == first.shape and c.stride() == first.stride()
                    and c.dtype == first.dtype and c.device == first.device)
            if not same:
                raise ValueError(
                    f"kv_caches[{i // 2}][{i % 2}] has shape {tuple(c.shape)}, strides "
                    f"{c.stride()}, {c.dtype} on {c.device}; kv_caches[0][0] has "
                    f"{tuple(first.shape)}, {first.stride()}, {first.dtype} on {first.device}: "
                    "build one KVCacheTable per group of identical caches")
        pointers = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64,
                                device=first.device)
        return cls(pointers, tuple(first.shape), tuple(first.stride()), first.dtype,
                   tuple(caches))

    @property
    def device(self) -> torch.device:
        return self.pointers.device


def compact_kv(
    kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]] | KVCacheTable,
    src_slots: torch.Tensor,  # [num_slots] int32/int64, -1 = padding
    dst_slots: torch.Tensor,  # [num_slots] int32/int64, -1 = padding
    *,
    block_s: int = 16,
    block_e: int | None = None,
) -> None:
    """Copy slot ``src_slots[n]`` to ``dst_slots[n]`` in every layer's K and V, one launch.

    slot = block * block_size + offset. Pairs with a -1 on either side are skipped.

    Note
    ----
    Overlapping moves are safe when, within each request, the token positions behind both
    lists increase and ``position(dst[n]) <= position(src[n])`` (what tree compaction
    produces; with shuffled block tables the slot numbers themselves need not be ordered),
    and different requests use different blocks. Slots are processed in tiles of ``block_s`` in increasing n; a tile
    reads all its sources before writing any destination. Arbitrary permutations are NOT
    supported (use :func:`compact_kv_ref`).

    Example
    -------
    Draft region at slots 40..56 (root at 40), accepted nodes 2 and 6 (slots 43 and 47):
    ``src [43, 47] -> dst [41, 42]``; the root already sits at 40.
    """
    table = kv_caches if isinstance(kv_caches, KVCacheTable) else KVCacheTable.from_caches(kv_caches)
    check_launchable("kv_caches", table.pointers, "vllm_ddtree.kernels.compact_kv_ref")
    check_same_device(pointers=table.pointers, src_slots=src_slots, dst_slots=dst_slots)
    if src_slots.dim() != 1 or src_slots.shape != dst_slots.shape:
        raise ValueError(f"src_slots.shape={tuple(src_slots.shape)}, dst_slots.shape="
                         f"{tuple(dst_slots.shape)}: expected two equal [num_slots] shapes")
    check_dtype("src_slots", src_slots, _INDEX_DTYPES)
    check_dtype("dst_slots", dst_slots, _INDEX_DTYPES)
    if block_s < 1 or block_s & (block_s - 1):
        raise ValueError(f"block_s={block_s} must be a power of two")
    num_slots = src_slots.shape[0]
    if num_slots == 0:
        return
    _, block_size, num_kv_heads, head_dim = table.shape
    num_elems = num_kv_heads * head_dim
    block_e = block_e or min(256, next_power_of_2(num_elems))

    import triton.language as tl  # lazy: needs Triton

    from .compact_kv_kernel import compact_kv_kernel

    elem_ty = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}[table.dtype.itemsize]
    grid = (table.pointers.shape[0], (num_elems + block_e - 1) // block_e)
    compact_kv_kernel[grid](
        table.pointers, src_slots, dst_slots, num_slots, block_size, *table.strides,
        HEAD_DIM=head_dim, NUM_ELEMS=num_elems, ELEM_TY=elem_ty,
        BLOCK_S=block_s, BLOCK_E=block_e,
    )
