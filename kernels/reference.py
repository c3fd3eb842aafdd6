"""Plain torch twins of the Triton kernels: the test oracles and the CPU fallback.

Everything here is written for clarity, not speed: one request at a time, dense masks, fp32
softmax. The vLLM plugin reuses :func:`masked_attention_ref` on the CPU through its own
adapter for the CPU KV layout; :func:`tree_attention_ref` and :func:`compact_kv_ref` take the
GPU paged layout, exactly like their kernels.

Paged layout (vLLM 0.32 FlashAttention / Triton backends): each layer's cache is logically
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` and the backends view it as
``key_cache, value_cache = cache.transpose(1, 2).split(head_dim, -1)``, i.e. two strided
``[num_blocks, block_size, num_kv_heads, head_dim]`` views. Token position p of request r lives
in block ``block_table[r, p // block_size]`` at offset ``p % block_size``; its slot is
``block * block_size + offset``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "unpack_tree_mask",
    "request_attention_mask",
    "masked_attention_ref",
    "tree_attention_ref",
    "compact_kv_ref",
    "flatten_kv_caches",
]


def unpack_tree_mask(words: torch.Tensor, n: int) -> torch.Tensor:
    """int32 words ``[..., rows, W]`` -> bool ``[..., rows, n]``; bit j % 32 of word j // 32.

    Example: the row ``[5]`` (``0b101``) with n = 3 unpacks to ``[True, False, True]``.
    """
    if words.dtype != torch.int32:
        raise ValueError(f"tree mask dtype={words.dtype}, expected torch.int32")
    if n > 32 * words.shape[-1]:
        raise ValueError(f"n={n} columns need {(n + 31) // 32} words, got {words.shape[-1]}")
    bits = torch.arange(32, device=words.device, dtype=torch.int32)
    unpacked = (words.unsqueeze(-1) >> bits) & 1  # arithmetic shift of bit 31 still ends in 1
    return unpacked.flatten(-2)[..., :n].bool()


def request_attention_mask(
    q_len: int, seq_len: int, tree_words: torch.Tensor | None
) -> torch.Tensor:
    """Bool ``[q_len, seq_len]`` visibility of one request's query tokens.

    Query i (0-based inside the span) sees every context key (positions < ctx = seq_len - q_len)
    and, inside the span, key ctx + j iff bit j of ``tree_words[i]`` is set; with
    ``tree_words=None`` (prefill chunk, plain decode) the span is causal: j <= i.

    Example: q_len 3, seq_len 5, tree rows [0b001, 0b011, 0b101] (node 1 and node 2 are both
    children of the root) ->
    ``[[1,1, 1,0,0], [1,1, 1,1,0], [1,1, 1,0,1]]``.
    """
    if not 0 <= q_len <= seq_len:
        raise ValueError(f"q_len={q_len}, seq_len={seq_len}: need 0 <= q_len <= seq_len")
    ctx = seq_len - q_len
    mask = torch.ones(q_len, seq_len, dtype=torch.bool)
    if tree_words is None:
        mask[:, ctx:] = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    else:
        if tree_words.shape[0] < q_len:
            raise ValueError(
                f"tree mask has {tree_words.shape[0]} rows, the request has q_len={q_len}"
            )
        mask[:, ctx:] = unpack_tree_mask(tree_words[:q_len].cpu(), q_len)
    return mask


def masked_attention_ref(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    k: torch.Tensor,  # [kv_len, num_kv_heads, head_dim]
    v: torch.Tensor,  # [kv_len, num_kv_heads, head_dim]
    mask: torch.Tensor,  # [q_len, kv_len] bool, True = visible
    scale: float,
) -> torch.Tensor:
    """Softmax attention of already gathered K/V under a dense bool mask, GQA aware.

    Returns ``[q_len, num_heads, head_dim]`` in q's dtype. The math runs in fp32 (fp64 for
    fp64 inputs). A query row
    with no visible key returns zeros (SDPA would return NaN).
    """
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         "expected q [q_len, H, D] and k = v [kv_len, Hkv, D]")
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of {num_kv_heads=}")
    if mask.shape != (q.shape[0], k.shape[0]):
        raise ValueError(f"mask.shape={tuple(mask.shape)}, expected {(q.shape[0], k.shape[0])}")
    group = num_heads // num_kv_heads
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    qf = q.to(acc).transpose(0, 1)  # [H, q_len, D]
    kf = k.to(acc).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, kv_len, D]
    vf = v.to(acc).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, kv_len, D]
    scores = (qf @ kf.transpose(1, 2)) * scale  # [H, q_len, kv_len]
    visible = mask.to(q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows: 0/0 -> 0
    return (probs @ vf).transpose(0, 1).to(q.dtype)


def _gather_request_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_row: torch.Tensor,  # [max_blocks]
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    blocks = block_row.to(cache.device).long()[pos // block_size]
    return cache[blocks, pos % block_size]


def tree_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [batch, max_blocks] int32
    seq_lens: torch.Tensor,  # [batch] KV length including the query tokens
    query_start_loc: torch.Tensor,  # [batch + 1]
    tree_mask: torch.Tensor,  # [batch, max_query_len, ceil(max_query_len / 32)] int32
    has_tree: torch.Tensor,  # [batch] bool
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim] (output)
) -> torch.Tensor:
    """Torch twin of :func:`vllm_ddtree.kernels.tree_attention` (same arguments, same result).

    Loops over requests on the host; tokens after ``query_start_loc[-1]`` are left untouched.
    """
    if out is None:
        out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    trees = has_tree.tolist()
    for r, seq_len in enumerate(lens):
        begin, end = starts[r], starts[r + 1]
        if end == begin:
            continue
        words = tree_mask[r] if trees[r] else None
        mask = request_attention_mask(end - begin, seq_len, words)
        k = _gather_request_kv(k_cache, block_table[r], seq_len)
        v = _gather_request_kv(v_cache, block_table[r], seq_len)
        out[begin:end] = masked_attention_ref(q[begin:end], k, v, mask, scale).to(out.dtype)
    return out


def flatten_kv_caches(kv_caches) -> list[torch.Tensor]:
    """The 4-D caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` inside
    ``kv_caches``, in order: per-layer ``(K, V)`` pairs, a flat list ``[K0, V0, K1, ...]``, or
    stacked tensors such as ``[num_layers, 2, num_blocks, block_size, heads, dim]`` all work.
    """
    if isinstance(kv_caches, torch.Tensor):
        if kv_caches.dim() < 4:
            raise ValueError(f"a KV cache has shape {tuple(kv_caches.shape)}, expected "
                             "[num_blocks, block_size, num_kv_heads, head_dim]")
        return [kv_caches] if kv_caches.dim() == 4 else [
            c for sub in kv_caches.unbind(0) for c in flatten_kv_caches(sub)]
    if not isinstance(kv_caches, (list, tuple)):
        raise ValueError(f"kv_caches is a {type(kv_caches).__name__}: pass per-layer (K, V) "
                         "pairs, a list of 4-D caches, or a stacked tensor")
    return [c for item in kv_caches for c in flatten_kv_caches(item)]


def compact_kv_ref(
    kv_caches,  # per layer (K, V) pairs (or a flat list / stacked tensor, see flatten_kv_caches),
    # each cache [num_blocks, block_size, num_kv_heads, head_dim]
    src_slots: torch.Tensor,  # [num_slots] int, -1 = padding
    dst_slots: torch.Tensor,  # [num_slots] int, -1 = padding
) -> None:
    """Torch twin of :func:`vllm_ddtree.kernels.compact_kv`: per layer, index_select then
    index_copy_, so every source is read before any destination is written.

    Example: accepted nodes at slots [40, 43, 47] -> src [40, 43, 47], dst [40, 41, 42]:
    slot 43 moves to 41 and slot 47 to 42 in every layer's K and V.
    """
    if src_slots.shape != dst_slots.shape or src_slots.dim() != 1:
        raise ValueError(f"src_slots {tuple(src_slots.shape)} and dst_slots "
                         f"{tuple(dst_slots.shape)} must be equal 1-D shapes")
    keep = (src_slots >= 0) & (dst_slots >= 0)
    src = src_slots[keep].long()
    dst = dst_slots[keep].long()
    for cache in flatten_kv_caches(kv_caches):
        block_size = cache.shape[1]
        s, d = src.to(cache.device), dst.to(cache.device)
        # Advanced indexing works on strided views (the K half of a vLLM cache) too.
        moved = cache[s // block_size, s % block_size]  # index_select: a copy
        cache[d // block_size, d % block_size] = moved  # index_copy_
