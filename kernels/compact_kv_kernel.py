"""Triton body of KV compaction: copy slot src[n] -> dst[n] in every layer's K and V.

Imported lazily by :mod:`compact_kv` (the launcher).

One program = (cache c of the pointer table, chunk of BLOCK_E elements of a slot's
num_kv_heads * head_dim, group of group_size consecutive pairs). Different programs touch
disjoint memory (other caches, other elements of a slot, or other groups: a group is one
request's pairs, and requests own disjoint blocks). A program walks its group's pairs in tiles
of BLOCK_S, in increasing n, and inside a tile a barrier separates the loads of every source
from the stores: when a group fits in one tile any overlap inside it is safe. With several
tiles a source must not be read after an earlier tile wrote it, which tree compaction
guarantees: pos(dst[m]) <= pos(src[m]) < pos(src[n]) for m < n within a request (pos = token
position, mapped one-to-one to slots by the request's block table).
Elements are moved as same-width integers: the copy is bit exact for any dtype.
"""

import triton
import triton.language as tl


# NOTE: Triton specialises integer arguments on their value (== 1, divisible by 16); the slot
# count changes every step, so it is not specialised (one compiled kernel for every batch).
DO_NOT_SPECIALIZE = ("num_slots", "group_size")


# (in both lists: newer Tritons take an integer's divisibility by 16 from the alignment list)
@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE, do_not_specialize_on_alignment=DO_NOT_SPECIALIZE)
def compact_kv_kernel(
    cache_ptrs_ptr,  # [num_caches] int64 data pointers: K0, V0, K1, V1, ...
    src_slots_ptr,  # [num_slots] int32/int64, -1 = padding
    dst_slots_ptr,  # [num_slots] int32/int64, -1 = padding
    num_slots,
    group_size,  # consecutive pairs per program (one request's); num_slots: one group
    block_size,
    stride_b, stride_s, stride_h, stride_d,  # element strides, shared by all caches
    HEAD_DIM: tl.constexpr,
    NUM_ELEMS: tl.constexpr,  # num_kv_heads * head_dim
    ELEM_TY: tl.constexpr,  # integer type as wide as the cache dtype
    BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    cache = tl.program_id(0)
    chunk = tl.program_id(1)
    first = tl.program_id(2) * group_size
    end = tl.minimum(num_slots, first + group_size)
    base = tl.load(cache_ptrs_ptr + cache).to(tl.pointer_type(ELEM_TY))

    e = chunk * BLOCK_E + tl.arange(0, BLOCK_E)  # [BLOCK_E] element of the slot
    e_valid = e < NUM_ELEMS
    e_off = (e // HEAD_DIM).to(tl.int64) * stride_h + (e % HEAD_DIM).to(tl.int64) * stride_d

    for start in range(first, end, BLOCK_S):
        n = start + tl.arange(0, BLOCK_S)
        n_valid = n < end
        src = tl.load(src_slots_ptr + n, mask=n_valid, other=-1).to(tl.int64)
        dst = tl.load(dst_slots_ptr + n, mask=n_valid, other=-1).to(tl.int64)
        ok = (src >= 0) & (dst >= 0)
        src_off = (src // block_size) * stride_b + (src % block_size) * stride_s  # [BLOCK_S]
        dst_off = (dst // block_size) * stride_b + (dst % block_size) * stride_s
        mask = ok[:, None] & e_valid[None, :]
        x = tl.load(base + src_off[:, None] + e_off[None, :], mask=mask)
        # NOTE: a slot may be read by one thread and written by another in the same tile
        # (dst[n] == src[n - 1]): the barrier makes every read of the tile land first.
        tl.debug_barrier()
        tl.store(base + dst_off[:, None] + e_off[None, :], x, mask=mask)  # then its writes
