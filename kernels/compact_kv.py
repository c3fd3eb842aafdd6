"""Launcher of KV compaction: after a tree verify step, move the accepted path's K/V into the
first slots of the draft region, in every layer, in ONE launch.

The scheduler assumes chains: draft token i sits at position num_computed + i. A tree puts
node k at slot base + 1 + k, so the accepted nodes must move down to consecutive slots before
the next step, in the target's layers and in the drafter's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._launch import check_dtype, check_launchable, check_same_device, next_power_of_2
from .reference import flatten_kv_caches

__all__ = ["KVCacheTable", "compact_kv"]

_INDEX_DTYPES = (torch.int32, torch.int64)


# Elements of one tile, 16 per thread of 4 warps: each element also holds a 64-bit address
# in registers, so a larger tile spills to local memory.
MAX_TILE_ELEMS = 2048
# NOTE: the tile is a constant (or follows group_size, fixed per engine), not the next power of
# two of the batch's slot count: a tile that followed the batch would compile a new kernel for
# every new power-of-two batch while serving (seconds of stall). Slots beyond one tile go in
# tiles in increasing n.
DEFAULT_BLOCK_S = 64


@dataclass(frozen=True)
class KVCacheTable:
    """The K and V caches of many layers as one device pointer table (build once, reuse).

    All caches must share shape, strides, dtype and device (one attention group of a model);
    call :meth:`from_caches` once per group otherwise.
    """

    pointers: torch.Tensor  # [num_caches] int64 data pointers: K0, V0, K1, V1, ...
    shape: tuple[int, int, int, int]  # (num_blocks, block_size, num_kv_heads, head_dim)
    strides: tuple[int, int, int, int]  # element strides of every cache
    dtype: torch.dtype
    caches: tuple[torch.Tensor, ...]  # keeps the memory alive while the table exists

    @classmethod
    def from_caches(cls, kv_caches) -> "KVCacheTable":
        """``kv_caches``: per layer ``(key_cache, value_cache)`` pairs, a flat list of caches or
        a stacked tensor; every cache ``[num_blocks, block_size, num_kv_heads, head_dim]``
        (strided views such as vLLM's K and V halves are fine)."""
        caches = flatten_kv_caches(kv_caches)
        if not caches:
            raise ValueError("kv_caches is empty: pass at least one (key_cache, value_cache)")
        first = caches[0]
        for i, c in enumerate(caches):
            same = (c.shape == first.shape and c.stride() == first.stride()
                    and c.dtype == first.dtype and c.device == first.device)
            if not same:
                raise ValueError(
                    f"cache {i} has shape {tuple(c.shape)}, strides {c.stride()}, {c.dtype} on "
                    f"{c.device}; cache 0 has {tuple(first.shape)}, {first.stride()}, "
                    f"{first.dtype} on {first.device}: build one KVCacheTable per group of "
                    "identical caches")
        pointers = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64,
                                device=first.device)
        return cls(pointers, tuple(first.shape), tuple(first.stride()), first.dtype,
                   tuple(caches))

    @property
    def device(self) -> torch.device:
        return self.pointers.device


def _tiles(num_elems: int, block_s: int) -> tuple[int, int]:
    """(BLOCK_S, BLOCK_E): ``block_s`` slots per tile, the slot's elements split so that a tile
    fits a program's registers. Neither depends on the number of slots, so one compiled kernel
    serves every batch.

    Example: 8 KV heads x 128 = 1024 elements -> block_s 64: (64, 32); block_s 16: (16, 128).
    """
    if block_s < 1 or block_s & (block_s - 1):
        raise ValueError(f"block_s={block_s} must be a power of two")
    block_e = max(1, min(256, MAX_TILE_ELEMS // block_s, next_power_of_2(num_elems)))
    return block_s, block_e


def compact_kv(
    kv_caches,  # per layer (K, V) pairs, a flat list, a stacked tensor, or a KVCacheTable
    src_slots: torch.Tensor,  # [num_slots] int32/int64, -1 = padding
    dst_slots: torch.Tensor,  # [num_slots] int32/int64, -1 = padding
    *,
    group_size: int | None = None,
    block_s: int | None = None,
) -> None:
    """Copy slot ``src_slots[n]`` to ``dst_slots[n]`` in every layer's K and V, one launch.

    slot = block * block_size + offset. Pairs with a -1 on either side are skipped;
    destinations must be distinct. Build the :class:`KVCacheTable` once and pass it to skip
    the pointer-table upload on every call.

    ``group_size``: the pairs come in groups of ``group_size`` consecutive entries (one
    request's, -1 padded), and no slot of a group is a slot of another group (requests own
    disjoint blocks): the groups are moved in parallel. ``None``: one group, any overlap.

    Note
    ----
    A group's slots go in tiles of ``block_s`` (default: the group, up to 64) in increasing n;
    inside a tile every source is read before any destination is written (a barrier separates
    them). So ANY overlap inside a group is safe when it fits one tile, as in
    :func:`compact_kv_ref`; beyond that overlaps are safe in the tree-compaction pattern:
    within a request the token positions behind both lists increase and
    ``position(dst[n]) <= position(src[n])`` (then no tile reads a slot that an earlier tile
    wrote).

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
    num_slots = src_slots.shape[0]
    if group_size is not None and (group_size < 1 or num_slots % group_size):
        raise ValueError(f"group_size={group_size} must be >= 1 and divide the "
                         f"{num_slots} pairs")
    if num_slots == 0:
        return
    if block_s is None:  # the tile follows the group (fixed per engine), never the batch
        block_s = DEFAULT_BLOCK_S if group_size is None else min(
            DEFAULT_BLOCK_S, next_power_of_2(group_size))
    group_size = group_size or num_slots
    _, block_size, num_kv_heads, head_dim = table.shape
    num_elems = num_kv_heads * head_dim
    block_s, block_e = _tiles(num_elems, block_s)

    import triton.language as tl  # lazy: needs Triton

    from .compact_kv_kernel import compact_kv_kernel

    elem_ty = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}[table.dtype.itemsize]
    grid = (table.pointers.shape[0], (num_elems + block_e - 1) // block_e, num_slots // group_size)
    compact_kv_kernel[grid](
        table.pointers, src_slots, dst_slots, num_slots, group_size, block_size, *table.strides,
        HEAD_DIM=head_dim, NUM_ELEMS=num_elems, ELEM_TY=elem_ty,
        BLOCK_S=block_s, BLOCK_E=block_e,
    )
