"""Triton body of tree attention (FlashAttention-style online softmax over paged K/V).

Imported lazily by :mod:`tree_attention` (the launcher), so that ``vllm_ddtree.kernels``
imports on machines where Triton cannot launch.

One program = (query block x context split, request, kv head). Its M rows are BLOCK_Q query
tokens times the GROUP_PAD query heads that share the kv head (GQA packing: row m is query token
m // GROUP_PAD, head kv_head * GROUP + m % GROUP_PAD), so each K/V tile is loaded once for the
whole group. Keys are visited in two phases:
  1. context keys 0 .. ctx_len - 1: visible to every query row, no mask;
  2. span keys ctx_len + j, j = 0 .. q_len - 1: bit j of the row's packed tree mask for tree
     requests, j <= i for causal requests (prefill chunks, plain decode). Tiles where no row
     sees any key are skipped (most of a tree's upper triangle).

Split context (flash-decoding): when the grid is too small to fill the GPU (one request, a
short tree, a long context), the launcher splits phase 1 into ``num_splits`` consecutive
ranges, one program each; the last split also runs phase 2. Each split stores its unnormalised
output, running max and sum (``SPLIT``), and :func:`combine_splits_kernel` merges them.
"""

import triton
import triton.language as tl

M_INIT = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max: exp2(M_INIT - M_INIT) = 1, no NaN

# NOTE: reductions go through tl.reduce with the standard library's combine functions, and
# zeros through tl.full, instead of tl.max / tl.sum / tl.zeros: those are @triton.jit helpers
# that stop working in the interpreter when triton was imported before TRITON_INTERPRET=1 was
# set (e.g. by vLLM earlier in a pytest run). The interpreter maps these combine functions to
# numpy; the compiler sees exactly what tl.max / tl.sum expand to.
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine


@triton.jit
def _attend_tile(
    acc,  # [BLOCK_M, HEAD_DIM_PAD] fp32
    m_i,  # [BLOCK_M] fp32 running max (log2 domain)
    l_i,  # [BLOCK_M] fp32 running sum
    q,  # [BLOCK_M, HEAD_DIM_PAD]
    k_cache_ptr,
    v_cache_ptr,
    block_table_row_ptr,  # block_table[r]
    pos,  # [BLOCK_N] key positions
    pos_valid,  # [BLOCK_N] bool: pos < seq_len
    visible,  # [BLOCK_M, BLOCK_N] bool
    kv_head,
    offs_d,  # [HEAD_DIM_PAD]
    d_valid,  # [HEAD_DIM_PAD] bool
    qk_scale,  # softmax scale / ln(2), so that exp(x * scale) = exp2(x * qk_scale)
    block_size,
    stride_btn,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.load(block_table_row_ptr + (pos // block_size) * stride_btn, mask=pos_valid, other=0)
    block = block.to(tl.int64)
    offset = (pos % block_size).to(tl.int64)
    kv_mask = pos_valid[:, None] & d_valid[None, :]
    k = tl.load(  # [BLOCK_N, HEAD_DIM_PAD]
        k_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks
        + kv_head * stride_kh + offs_d[None, :] * stride_kd,
        mask=kv_mask, other=0.0,
    )
    v = tl.load(  # [BLOCK_N, HEAD_DIM_PAD]
        v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs
        + kv_head * stride_vh + offs_d[None, :] * stride_vd,
        mask=kv_mask, other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])  # masked: exp2(-inf) = 0
    l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
    p = p.to(v.dtype)
    if UPCAST:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# NOTE: Triton specialises integer arguments on their value (== 1, divisible by 16); the split
# count and the partial buffers' strides change with the batch, so they are not specialised
# (one compiled kernel per SPLIT for every batch).
_SPLIT_ARGS = ("num_splits", "stride_ps", "stride_pt", "stride_mls", "stride_mlt", "stride_ml")


# (in both lists: newer Tritons take an integer's divisibility by 16 from the alignment list)
@triton.jit(do_not_specialize=_SPLIT_ARGS, do_not_specialize_on_alignment=_SPLIT_ARGS)
def tree_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (any strides)
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (any strides)
    out_ptr,  # [num_tokens, num_heads, head_dim] (output)
    block_table_ptr,  # [batch, max_blocks]
    seq_lens_ptr,  # [batch]
    query_start_loc_ptr,  # [batch + 1]
    tree_mask_ptr,  # [batch, mask_rows, mask_words] int32
    has_tree_ptr,  # [batch] int8 (bool viewed as int8)
    part_acc_ptr,  # SPLIT: [num_splits, num_tokens, num_heads, HEAD_DIM] fp32 (output)
    part_ml_ptr,  # SPLIT: [2, num_splits, num_tokens, num_heads] fp32 running max, sum (output)
    num_splits,  # context ranges per (query block, request, kv head); 1 = no split
    qk_scale,  # softmax scale / ln(2), so that exp(x * scale) = exp2(x * qk_scale)
    block_size,
    mask_rows,
    mask_words,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_btb, stride_btn,
    stride_mb, stride_mr, stride_mw,
    stride_ps, stride_pt, stride_ph,  # part_acc's split / token / head strides (d: 1)
    stride_mls, stride_mlt,  # part_ml's split / token strides (head: 1; max -> sum: stride_ml)
    stride_ml,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= HEAD_DIM, >= 16
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # next power of two >= GROUP
    BLOCK_Q: tl.constexpr,  # query tokens per program; BLOCK_Q * GROUP_PAD >= 16
    BLOCK_N: tl.constexpr,  # keys per tile
    UPCAST: tl.constexpr,  # do the dots in fp32 (the interpreter's bf16 arithmetic is broken)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs, "tf32" otherwise (ignored for 16-bit)
    SPLIT: tl.constexpr,  # store partial results for combine_splits_kernel
):
    q_block = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    r = tl.program_id(1)
    kv_head = tl.program_id(2)
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD

    q_start = tl.load(query_start_loc_ptr + r).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + r + 1) - q_start).to(tl.int32)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + r).to(tl.int32)
    ctx_len = seq_len - q_len
    # NOTE: kept as int 0/1: the interpreter mishandles scalar-bool & tensor-bool.
    tree_flag = tl.load(has_tree_ptr + r).to(tl.int32)

    offs_m = tl.arange(0, BLOCK_M)
    row = q_block * BLOCK_Q + offs_m // GROUP_PAD  # [BLOCK_M] query index inside the span
    g = offs_m % GROUP_PAD
    head = kv_head * GROUP + g
    row_valid = (row < q_len) & (g < GROUP)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM
    q_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(  # [BLOCK_M, HEAD_DIM_PAD]
        q_ptr + (q_start + row)[:, None] * stride_qt + head[:, None] * stride_qh
        + offs_d[None, :] * stride_qd,
        mask=q_mask, other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], M_INIT, dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, dtype=tl.float32)
    bt_row_ptr = block_table_ptr + r.to(tl.int64) * stride_btb
    offs_n = tl.arange(0, BLOCK_N)

    # Phase 1: the split's range of the committed context, visible to every query row.
    # each split's range: a whole number of tiles (NOTE: no tl.cdiv, see the NOTE above)
    chunk = ((ctx_len + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    ctx_lo = split * chunk
    ctx_hi = tl.minimum(ctx_len, ctx_lo + chunk)
    for start in range(ctx_lo, ctx_hi, BLOCK_N):
        pos = start + offs_n
        pos_valid = pos < ctx_hi
        visible = row_valid[:, None] & pos_valid[None, :]
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr, pos, pos_valid, visible,
            kv_head, offs_d, d_valid, qk_scale, block_size, stride_btn,
            stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd,
            UPCAST, DOT_PRECISION,
        )

    # Phase 2 (the last split): the query span. Causal rows never look past the block's last row.
    causal_end = tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    span_end = causal_end + tree_flag * (q_len - causal_end)  # q_len for trees
    span_end = span_end * (split == num_splits - 1).to(tl.int32)
    is_tree = (tl.full([BLOCK_M], 0, dtype=tl.int32) + tree_flag) != 0  # [BLOCK_M]
    mask_row_ptr = tree_mask_ptr + r.to(tl.int64) * stride_mb + row[:, None] * stride_mr
    row_in_mask = row_valid & (row < mask_rows) & is_tree
    for start in range(0, span_end, BLOCK_N):
        j = start + offs_n  # [BLOCK_N] key index inside the span
        j_valid = j < q_len
        word_idx = j // 32
        words = tl.load(  # [BLOCK_M, BLOCK_N] packed word holding bit j of row i
            mask_row_ptr + word_idx[None, :] * stride_mw,
            mask=row_in_mask[:, None] & (j_valid & (word_idx < mask_words))[None, :],
            other=0,
        )
        tree_bit = ((words >> (j % 32)[None, :]) & 1) != 0
        causal = j[None, :] <= row[:, None]
        visible = tl.where(is_tree[:, None], tree_bit, causal) & row_valid[:, None] & j_valid[None, :]
        if tl.reduce(visible.to(tl.int32), None, _MAX) > 0:
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr, ctx_len + j, j_valid,
                visible, kv_head, offs_d, d_valid, qk_scale, block_size, stride_btn,
                stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd,
                UPCAST, DOT_PRECISION,
            )

    token = q_start + row
    if SPLIT:  # every split stores, also one whose range was empty (max M_INIT, sum 0)
        tl.store(part_acc_ptr + split.to(tl.int64) * stride_ps + token[:, None] * stride_pt
                 + head[:, None] * stride_ph + offs_d[None, :], acc, mask=q_mask)
        ml_ptr = part_ml_ptr + split.to(tl.int64) * stride_mls + token * stride_mlt + head
        tl.store(ml_ptr, m_i, mask=row_valid)
        tl.store(ml_ptr + stride_ml, l_i, mask=row_valid)
    else:
        # Rows that saw no key at all (l_i == 0) write zeros, like the reference.
        denom = tl.where(l_i > 0, l_i, 1.0)
        result = acc / denom[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
            + offs_d[None, :] * stride_od,
            result.to(out_ptr.dtype.element_ty),
            mask=q_mask,
        )


@triton.jit(do_not_specialize=("batch",) + _SPLIT_ARGS,
            do_not_specialize_on_alignment=("batch",) + _SPLIT_ARGS)
def combine_splits_kernel(
    part_acc_ptr,  # [num_splits, num_tokens, num_heads, HEAD_DIM] fp32
    part_ml_ptr,  # [2, num_splits, num_tokens, num_heads] fp32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_start_loc_ptr,  # [batch + 1]: tokens at or after query_start_loc[batch] are skipped
    batch,
    num_splits,
    stride_ps, stride_pt, stride_ph,
    stride_mls, stride_mlt, stride_ml,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """One program = (token, head): merge the splits' partial softmaxes (log2 domain)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + batch):
        return
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM
    acc = tl.full([HEAD_DIM_PAD], 0.0, dtype=tl.float32)
    m = tl.full([1], M_INIT, dtype=tl.float32)
    total = tl.full([1], 0.0, dtype=tl.float32)
    acc_ptr = part_acc_ptr + token.to(tl.int64) * stride_pt + head * stride_ph + offs_d
    ml_ptr = part_ml_ptr + token.to(tl.int64) * stride_mlt + head + tl.arange(0, 1)
    for s in range(0, num_splits):
        m_s = tl.load(ml_ptr + s * stride_mls)
        l_s = tl.load(ml_ptr + s * stride_mls + stride_ml)
        acc_s = tl.load(acc_ptr + s * stride_ps, mask=d_valid, other=0.0)
        m_new = tl.maximum(m, m_s)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_s - m_new)  # 0 for a split that saw no key, unless none did yet
        total = total * alpha + l_s * beta
        acc = acc * alpha + acc_s * beta
        m = m_new
    # Rows that saw no key at all (sum 0) write zeros, like the reference.
    result = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d * stride_od,
             result.to(out_ptr.dtype.element_ty), mask=d_valid)
