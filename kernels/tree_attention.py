"""Launcher of the tree-attention kernel: checks inputs, picks tile sizes, launches once.

A DDTree verify step runs B + 1 query tokens per request (the root, then the B nodes) whose
attention is causal over the committed context and ancestor-only inside the tree; every
request has its own tree. Prefill chunks and plain decodes (``has_tree`` False) are causal and
go in the same launch.
"""

from __future__ import annotations

import torch

from ._launch import (
    check_dtype,
    check_launchable,
    check_same_device,
    check_shape,
    interpreter_active,
    next_power_of_2,
)

__all__ = ["tree_attention"]

_INDEX_DTYPES = (torch.int32, torch.int64)
_DATA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634  # 1 / ln(2)
MAX_SPLITS = 32  # context splits per (query block, request, kv head)
MIN_SPLIT_KEYS = 1024  # a split covers at least this many context keys (512 lost at 1k on an H200)
WAVES = 4  # programs per SM that a split grid aims at


def _num_splits(programs: int, max_seq_len: int | None, device: torch.device) -> int:
    """Context splits so that a small grid still fills the GPU: about :data:`WAVES` programs
    per SM, each split at least :data:`MIN_SPLIT_KEYS` keys. 1 (no split) when the grid
    already has them, when the context is short, when ``max_seq_len`` is unknown, or off CUDA.

    Example (H200, 132 SMs): one request, 17 query rows (B = 16), 8 kv heads -> 16 programs;
    context 16k -> min(32, ceil(528 / 16) = 33, 16384 // 1024 = 16) = 16 splits; B = 256
    (17 query blocks) -> 136 programs -> 4 splits.
    """
    if max_seq_len is None or device.type != "cuda":
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    wanted = WAVES * sms
    if programs >= wanted:
        return 1
    return max(1, min(MAX_SPLITS, -(-wanted // programs), max_seq_len // MIN_SPLIT_KEYS))


_SM_COUNTS: dict[int, int] = {}


def _sm_count(index: int) -> int:
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def _tile_sizes(group_pad: int, head_dim_pad: int) -> tuple[int, int, int, int]:
    """(BLOCK_Q, BLOCK_N, num_warps, num_stages) for a GQA group and head size.

    BLOCK_M = BLOCK_Q * group_pad rows per program, 64 when the group allows (Qwen3-8B:
    4 heads per kv head -> 16 query tokens x 4 heads).
    """
    block_q = max(1, 64 // group_pad)
    block_n = 64 if head_dim_pad <= 128 else 32
    return block_q, block_n, 4, 2


def tree_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], any strides
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], any strides
    block_table: torch.Tensor,  # [batch, max_blocks] int32
    seq_lens: torch.Tensor,  # [batch] int32, KV length including the query tokens
    query_start_loc: torch.Tensor,  # [batch + 1] int32
    tree_mask: torch.Tensor,  # [batch, max_query_len, ceil(max_query_len / 32)] int32
    has_tree: torch.Tensor,  # [batch] bool
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim] (output)
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Paged attention where each request's query span is a tree (or causal).

    Request r owns query tokens ``query_start_loc[r] : query_start_loc[r + 1]`` (q_len of
    them), already written to the cache at positions ``seq_lens[r] - q_len ..
    seq_lens[r] - 1``. Query i of the span sees every context key (position <
    ``seq_lens[r] - q_len``) and span key j iff bit ``j % 32`` of word ``j // 32`` of
    ``tree_mask[r, i]`` is set (``has_tree[r]``), or iff ``j <= i`` (causal).

    Parameters
    ----------
    max_query_len:
        Largest q_len in the batch; sizes the grid. ``None`` reads it from
        ``query_start_loc`` (one host sync). vLLM's metadata has it: pass it.
    max_seq_len:
        Largest ``seq_lens`` entry (host int; vLLM's metadata has it). With it, a grid too
        small for the GPU splits each request's context over several programs and merges them
        in a second launch (flash-decoding); without it, one launch and no split.
    num_splits:
        Force the number of context splits (tests; ``None``: chosen from the grid and
        ``max_seq_len``).
    block_q, block_n:
        Override the tile sizes (tests use small ones to cover multi-tile loops).

    Returns ``out``; tokens at or after ``query_start_loc[-1]`` are not written. Rows with no
    visible key (only possible with a mask that hides the diagonal and no context) get zeros.

    Example
    -------
    One request, context 5, tree root -> {node 0, node 1}, node 0 -> node 2:
    q_len 4, seq_len 9 = 5 + 4, tree_mask rows ``[0b0001, 0b0011, 0b0101, 0b1011]``:
    query 3 (node 2) sees keys 0..4 (context), 5 (root), 6 (node 0) and 8 (itself).
    """
    check_launchable("q", q, "vllm_ddtree.kernels.tree_attention_ref")
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                      seq_lens=seq_lens, query_start_loc=query_start_loc, tree_mask=tree_mask,
                      has_tree=has_tree)
    if q.dim() != 3:
        raise ValueError(f"q.shape={tuple(q.shape)}, expected [num_tokens, num_heads, head_dim]")
    num_tokens, num_heads, head_dim = q.shape
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache.shape={tuple(k_cache.shape)}, expected "
                         "[num_blocks, block_size, num_kv_heads, head_dim]")
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    check_shape("k_cache", k_cache, (None, None, None, head_dim))
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    check_dtype("q", q, _DATA_DTYPES)
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q.dtype={q.dtype}, k_cache.dtype={k_cache.dtype}, "
                         f"v_cache.dtype={v_cache.dtype}: must be equal (no quantized KV)")
    batch = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    check_shape("seq_lens", seq_lens, (batch,))
    check_shape("query_start_loc", query_start_loc, (batch + 1,))
    check_shape("block_table", block_table, (batch, None))
    check_shape("has_tree", has_tree, (batch,))
    if tree_mask.dim() != 3 or tree_mask.shape[0] != batch or (
        tree_mask.shape[2] * 32 < tree_mask.shape[1]
    ):
        raise ValueError(f"tree_mask.shape={tuple(tree_mask.shape)}, expected "
                         f"[{batch}, max_query_len, ceil(max_query_len / 32)]")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        check_dtype(name, t, _INDEX_DTYPES)
    check_dtype("tree_mask", tree_mask, (torch.int32,))
    check_dtype("has_tree", has_tree, (torch.bool,))
    if out is None:
        out = torch.empty_like(q)
    check_shape("out", out, tuple(q.shape))
    check_dtype("out", out, (q.dtype,))
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if batch else 0
    if batch == 0 or max_query_len == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    head_dim_pad = max(16, next_power_of_2(head_dim))
    default_q, default_n, num_warps, num_stages = _tile_sizes(group_pad, head_dim_pad)
    block_q = block_q or default_q
    block_n = block_n or default_n
    if block_q * group_pad < 16 or block_n < 16:
        raise ValueError(f"block_q * group_pad = {block_q} * {group_pad} and block_n={block_n} "
                         "must be >= 16 (tl.dot)")
    upcast = interpreter_active() and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 else "tf32"

    from .tree_attention_kernel import combine_splits_kernel, tree_attention_kernel  # lazy

    q_blocks = (max_query_len + block_q - 1) // block_q
    if num_splits is None:
        num_splits = _num_splits(q_blocks * batch * num_kv_heads, max_seq_len, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    split = num_splits > 1
    if split:  # partial outputs, and (max, sum) per row and head
        part_acc = torch.empty(num_splits, num_tokens, num_heads, head_dim,
                               dtype=torch.float32, device=q.device)
        part_ml = torch.empty(2, num_splits, num_tokens, num_heads, dtype=torch.float32,
                              device=q.device)
    else:  # unused: any float32 tensors with the right number of strides
        part_acc = part_ml = out.new_empty(1, 1, 1, 1, dtype=torch.float32)
    tree_attention_kernel[(q_blocks * num_splits, batch, num_kv_heads)](
        q, k_cache, v_cache, out, block_table, seq_lens, query_start_loc, tree_mask,
        has_tree.view(torch.int8), part_acc, part_ml, num_splits, scale * _LOG2E, block_size,
        tree_mask.shape[1], tree_mask.shape[2],
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        *block_table.stride(), *tree_mask.stride(),
        *part_acc.stride()[:3], part_ml.stride(1), part_ml.stride(2), part_ml.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_Q=block_q, BLOCK_N=block_n, UPCAST=upcast, DOT_PRECISION=precision, SPLIT=split,
        num_warps=num_warps, num_stages=num_stages,
    )
    if split:
        combine_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_ml, out, query_start_loc, batch, num_splits,
            *part_acc.stride()[:3], part_ml.stride(1), part_ml.stride(2), part_ml.stride(0),
            *out.stride(), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        )
    return out
