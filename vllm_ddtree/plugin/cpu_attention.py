"""Tree attention and K/V compaction on vLLM's CPU backend (``CPU_ATTN``).

The CPU platform ignores the attention-backend selection, so the plugin overrides
``CPU_ATTN`` itself with :class:`DDTreeCPUBackend`. It behaves exactly like the stock backend
unless its builder holds a :class:`TreeState` with a verify batch: then the tree rows of every
request with drafts (its root row and its node rows) are computed with the math of the torch
reference (:func:`vllm_ddtree.kernels.masked_attention_ref`) over the committed context plus
the request's ancestor-only span, both read from the paged cache (vLLM's separate K/V update
has written the step's K/V before). The stock causal kernel runs only in a step that has rows
outside the trees (prefills, requests without drafts), over every row, before the tree rows are
overwritten; in a step where every query row is a tree row it does not run at all. The slots and masks of a step are built once
(:func:`tree_attention_info`, in the metadata builder); each layer then runs two gathers, one
batched attention over all requests and one scatter. With the fused CPU kernels
(``vllm_ddtree.kernels.native``) both are one op: ``tree_attention_info`` from the packed
ancestor rows, and ``tree_attention_`` per layer, which reads K/V in place through the layout's
offsets and writes the tree rows (the torch path above is its oracle in tests/test_native.py).

CPU K/V layout (one tensor per layer, ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]``):
each (block, head) holds a K half and a V half of ``block_size * head_dim`` elements, whose
inner order depends on the kernel ISA vLLM picked (``vec``/``vec16``: K transposed, V plain;
``amx`` for bf16: VNNI-packed pairs). :func:`slot_maps` learns that order from vLLM's own
``cpu_attn_reshape_and_cache`` once per configuration, :func:`slot_offsets` turns it into one
offset table, and :class:`CPUKVLayout` turns slots into flat cache indices with it in three ops
(tree attention reads them, compaction copies them); a layout that is not a permutation of the
slot elements (a quantized cache) is refused with a clear error.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
    CPUAttentionMetadataBuilder,
)

from vllm_ddtree.kernels.native import cpu_ops


@dataclass
class TreeAttentionInfo:
    """The tree rows of one verify step, built once per step and shared by every layer of the
    KV group (all gather the same slots under the same mask).

    Requests with drafts are padded to ``b`` rows (row 0 the root, row i its node i - 1) and
    ``s`` key positions (positions ``0 .. seq_len - 1``: the committed context, then the verify
    span, whose K/V vLLM's K/V update has just written at the span's slots).
    """

    rows: torch.Tensor  # [n, b] int64 flat query row of row i of request n (padding: 0)
    valid: torch.Tensor  # [n, b] bool: a real row
    slots: torch.Tensor  # [n, s] int64 K/V slot of position j (padding: slot 0, masked)
    mask: torch.Tensor  # [n, b, s] bool: what row i sees (padding rows: position 0)
    # the tree rows are every query row of the step: the stock causal kernel is not needed
    covers_all: bool = False
    # the fused CPU ops when the builder used them (every layer of the step then does too)
    ops: object = None
    # (isa, dtype, per-layer cache shape) -> flat cache indices of ``slots`` (K, V), made by the
    # group's first layer and reused by the others
    flat_index: dict = field(default_factory=dict)


def tree_attention_info(dense_mask: torch.Tensor, requests: list[tuple[int, int, int]],
                        seq_lens: list[int], block_table: torch.Tensor,
                        block_size: int) -> TreeAttentionInfo:
    """The :class:`TreeAttentionInfo` of a verify step.

    Args:
        dense_mask: ``[R, B + 1, B + 1]`` ancestor masks of the step's trees (row/col 0 = root).
        requests: ``(request row, first query row, m)`` of each request with ``m > 0`` nodes.
        seq_lens: every request's sequence length after this step's tokens.
        block_table: ``[R, max_blocks]`` the group's block table.
    """
    req = torch.tensor([r for r, _, _ in requests])
    start = torch.tensor([first for _, first, _ in requests])
    m = torch.tensor([n for _, _, n in requests])
    seq = torch.tensor([seq_lens[r] for r, _, _ in requests])
    ctx = seq - m - 1
    b, s = int(m.max()) + 1, int(seq.max())  # the root row and up to max(m) node rows
    node = torch.arange(b)
    valid = node[None] <= m[:, None]  # [n, b]
    rows = torch.where(valid, start[:, None] + node[None], 0)
    pos = torch.arange(s)[None].expand(len(requests), s)
    blocks = block_table[req[:, None], pos // block_size].to(torch.int64)
    slots = torch.where(pos < seq[:, None], blocks * block_size + pos % block_size, 0)
    rel = pos[:, None, :] - ctx[:, None, None]  # [n, 1, s]: position within the span
    in_span = (rel >= 0) & (rel <= m[:, None, None])
    tree = dense_mask[req, :b].gather(2, rel.clamp(0, dense_mask.shape[2] - 1).expand(-1, b, -1))
    mask = ((rel < 0) | (in_span & tree)) & valid[..., None]
    mask[..., 0] |= ~valid  # a padding row sees one position: no all-masked softmax
    return TreeAttentionInfo(rows=rows, valid=valid, slots=slots, mask=mask)


@dataclass
class DDTreeCPUMetadata(CPUAttentionMetadata):
    ddtree: TreeAttentionInfo | None = None


class CPUKVLayout:
    """Slot addressing of one CPU layer cache ``[nb, nkv, bs, 2 * D]`` (see module doc).

    A slot holds ``C = nkv * 2 * D`` elements and a block ``bs * C``, so element (K or V, head
    h, dim d) of slot s is cache element ``s * C + offsets[s % bs, kv, h, d]`` with the table
    of :func:`slot_offsets` (the block's base ``(s // bs) * bs * C`` is ``s * C`` less
    ``(s % bs) * C``, which the table subtracts). Example (``vec``, block_size 32, nkv 1,
    D 64, so C = 128): K of slot 70 (block 2, offset 6), dim d is ``70 * 128 + offsets[6, 0,
    0, d] = 8960 + (6 + 32 * d - 6 * 128) = 8192 + 6 + 32 * d``: block 2 starts at 8192 and
    ``vec`` stores K transposed.
    """

    def __init__(self, kv_cache: torch.Tensor, offsets: torch.Tensor):
        if not kv_cache.is_contiguous():
            raise RuntimeError(
                f"ddtree: expected a contiguous CPU KV cache per layer, got strides "
                f"{kv_cache.stride()} for shape {tuple(kv_cache.shape)}"
            )
        _, num_kv_heads, self.block_size, two_d = kv_cache.shape
        self.flat = kv_cache.view(-1)
        self.offsets = offsets  # [bs, 2, nkv, D] int64, shared by every cache of this layout
        self.slot_stride = num_kv_heads * two_d  # C

    def flat_index(self, slots: torch.Tensor) -> torch.Tensor:
        """``slots [...]`` int64 -> flat cache indices ``[..., 2 (K, V), nkv, D]``; the same for
        every layer cache of this layout."""
        return torch.add(self.offsets[slots % self.block_size], slots[..., None, None, None],
                         alpha=self.slot_stride)

    def index(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``slots [...]`` -> flat cache indices ``(K [..., nkv, D], V [..., nkv, D])``."""
        return self.flat_index(slots).unbind(-3)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``slots [n]`` -> ``(K [n, nkv, D], V [n, nkv, D])``."""
        k_index, v_index = self.index(slots)
        return self.flat[k_index], self.flat[v_index]


def offset_table(k_index: torch.Tensor, v_index: torch.Tensor,
                 num_kv_heads: int) -> torch.Tensor:
    """The :class:`CPUKVLayout` table ``[bs, 2, nkv, D]`` int64 of the slot maps ``[bs, D]``.

    A (block, head) holds a K half then a V half of ``bs * D`` elements each, heads one after
    the other: ``offsets[o, kv, h, d] = (2 * h + kv) * bs * D + map_kv[o, d] - o * C``.
    """
    block_size, head_dim = k_index.shape
    half = block_size * head_dim
    within = torch.stack((k_index, v_index + half), dim=1)[:, :, None, :]  # [bs, 2, 1, D]
    heads = torch.arange(num_kv_heads)[:, None] * (2 * half)  # [nkv, 1]
    base = torch.arange(block_size)[:, None, None, None] * (num_kv_heads * 2 * head_dim)
    return (within + heads - base).contiguous()


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
    got_k, got_v = CPUKVLayout(cache, offset_table(k_index, v_index, num_kv_heads)).read(slots)
    if not (torch.equal(got_k, k) and torch.equal(got_v, v)):
        raise refuse("does not round-trip through the learned slot maps")
    return k_index, v_index


@functools.lru_cache(maxsize=None)
def slot_offsets(isa: str, dtype: torch.dtype, block_size: int, num_kv_heads: int,
                 head_dim: int) -> torch.Tensor:
    """The :class:`CPUKVLayout` table of a configuration (:func:`offset_table`), built once."""
    k_index, v_index = slot_maps(isa, dtype, block_size, num_kv_heads, head_dim)
    return offset_table(k_index, v_index, num_kv_heads)


def cpu_kv_layout(kv_cache: torch.Tensor, isa: str) -> CPUKVLayout:
    """The :class:`CPUKVLayout` of one layer cache written by vLLM's kernel for ``isa``."""
    _, num_kv_heads, block_size, two_d = kv_cache.shape
    return CPUKVLayout(kv_cache, slot_offsets(isa, kv_cache.dtype, block_size, num_kv_heads,
                                              two_d // 2))


def tree_rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float, isa: str) -> torch.Tensor:
    """Attention of the tree rows: the math of :func:`masked_attention_ref` (fp32) batched over
    leading dims, rounded like vLLM's CPU kernel where that is known, so that near-ties resolve
    as in plain decoding.

    Shapes: ``q [..., n, H, D]``, ``k = v [..., L, Hkv, D]``, ``mask [..., n, L]`` (every row
    must see a position) -> ``[..., n, H, D]`` in q's dtype.

    ``amx`` (bf16): the kernel multiplies V by the unnormalised probabilities ``exp(s - max)``
    rounded to bf16 and divides by their float32 sum; doing the same here took a random
    hand-made pair in bf16 (6 prompts x 64 tokens) from 2/6 to 6/6 prompts token-identical to
    plain decoding at B=8 and from 3/6 to 5/6 at B=64. Otherwise: the float32 reference.
    """
    group = q.shape[-2] // k.shape[-2]
    acc = torch.promote_types(q.dtype, torch.float32)
    qf = q.to(acc).transpose(-3, -2)  # [..., H, n, D]
    kf = k.to(acc).repeat_interleave(group, dim=-2).transpose(-3, -2)  # [..., H, L, D]
    vf = v.to(acc).repeat_interleave(group, dim=-2).transpose(-3, -2)
    scores = (qf @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask.unsqueeze(-3), float("-inf"))
    if isa == "amx" and q.dtype == torch.bfloat16:
        probs = (scores - scores.amax(dim=-1, keepdim=True)).exp()
        out = (probs.to(torch.bfloat16).float() @ vf) / probs.sum(dim=-1, keepdim=True)
    else:
        out = torch.softmax(scores, dim=-1) @ vf
    return out.transpose(-3, -2).to(q.dtype)


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
        seq_lens = meta.seq_lens.tolist()
        ops = cpu_ops(meta.block_table.device)
        if ops is not None:  # the fused CPU kernel: one op from the packed ancestor rows
            table = torch.tensor([(r, start, m, seq_lens[r]) for r, start, m in requests])
            info = TreeAttentionInfo(*ops.tree_attention_info(
                table, verify.tree.ancestor_mask, meta.block_table,
                self.kv_cache_spec.block_size), ops=ops)
        else:
            info = tree_attention_info(verify.tree.dense_mask(), requests, seq_lens,
                                       meta.block_table, self.kv_cache_spec.block_size)
        # the requests' spans are disjoint: they cover every query row when their sizes add up
        info.covers_all = sum(m + 1 for _, _, m in requests) == meta.num_actual_tokens
        return DDTreeCPUMetadata(**vars(meta), ddtree=info)

    def build_for_drafting(self, common_attn_metadata, draft_index: int):
        # The drafter's own (non-causal block) attention: always the stock path.
        return super().build(0, common_attn_metadata, fast_build=True)


class DDTreeCPUImpl(CPUAttentionBackendImpl):
    # the layer's K/V cache and its CPUKVLayout (the fused path reads it every verify step)
    _ddtree_cache: torch.Tensor | None = None
    _ddtree_layout: CPUKVLayout | None = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        # vLLM's K/V update (do_kv_cache_update, before this) has written the step's K/V, the
        # verify spans' too. A step with rows outside the trees runs the stock kernel over
        # every row (causal); the tree rows are then computed over context + ancestors
        info = getattr(attn_metadata, "ddtree", None)
        if info is None or not info.covers_all or output_scale is not None or \
                output_block_scale is not None:  # (the stock kernel refuses these)
            output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                     output_scale, output_block_scale)
        if info is None:
            return output
        head_dim = kv_cache.shape[3] // 2
        out = output.view(output.shape[0], -1, head_dim)
        ops = info.ops
        if ops is not None:  # the fused CPU kernel: the node rows read the paged cache in place
            if self._ddtree_cache is not kv_cache:  # the layer's cache, bound once
                self._ddtree_layout = cpu_kv_layout(kv_cache, layer.isa)
                self._ddtree_cache = kv_cache
            layout = self._ddtree_layout
            ops.tree_attention_(out, query.view(query.shape[0], -1, head_dim), layout.flat,
                                layout.offsets, layout.slot_stride, info.rows, info.valid,
                                info.slots, info.mask, self.scale,
                                layer.isa == "amx" and query.dtype == torch.bfloat16)
            return output
        where = (layer.isa, kv_cache.dtype, tuple(kv_cache.shape[1:]))
        index = info.flat_index.get(where)
        if index is None:
            index = info.flat_index[where] = cpu_kv_layout(kv_cache, layer.isa).index(info.slots)
        flat = kv_cache.view(-1)
        k, v = flat[index[0]], flat[index[1]]  # [n, s, nkv, D]
        rows = tree_rows_attention(query[info.rows], k, v, info.mask, self.scale, layer.isa)
        out[info.rows[info.valid]] = rows[info.valid].to(out.dtype)
        return output


class DDTreeCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return DDTreeCPUImpl

    @staticmethod
    def get_builder_cls():
        return DDTreeCPUMetadataBuilder


# Slot 0 lies in block 0, vLLM's null block (``BlockPool.null_block``), which no request owns:
# no move ever writes it, so copying it onto itself is how a skipped pair moves nothing.
NULL_SLOT = 0


def copy_cpu_slots(layouts: list[CPUKVLayout], slots: torch.Tensor) -> None:
    """Copy slot ``slots[0, n]`` -> ``slots[1, n]`` in the cache of every layout.

    ``slots [2, n]`` int64 holds no -1: a pair to skip is a self-copy of a slot no other pair
    writes (:data:`NULL_SLOT`), so no boolean mask (a data-dependent shape) is needed. All
    sources are read (gathered into a new tensor) before any write, so overlapping moves are
    safe. The flat indices of one layout serve every cache that shares it: a step costs one
    gather and one scatter per layer. Example (``vec``, bs 16, nkv 1, D 32: a block of 1024
    elements, K half then V half): slots ``[[21], [18]]`` (block 1, offsets 5 -> 2) copy K
    elements ``1029 + 16 * d`` to ``1026 + 16 * d`` and V elements ``1696 + d`` to ``1600 + d``.
    """
    flat_index: dict[int, torch.Tensor] = {}  # id(layout.offsets) -> [2, n, 2, nkv, D]
    for layout in layouts:
        index = flat_index.get(id(layout.offsets))
        if index is None:
            index = flat_index[id(layout.offsets)] = layout.flat_index(slots)
        layout.flat[index[1]] = layout.flat[index[0]]
