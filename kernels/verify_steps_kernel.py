"""Triton bodies of the verify step's walk and finish_verify (one program per request).

Imported lazily by :mod:`verify_steps` (the launchers). Each is the CUDA twin of a fused CPU op
(``csrc/ddtree_cpu.cpp``) and of the torch path in ``vllm_ddtree/walk.py`` and
``vllm_ddtree/plugin/state.py``: same inputs, same outputs, bit for bit.
"""

import triton
import triton.language as tl

# NOTE: reductions go through tl.reduce with the standard library's combine functions (see
# tree_attention_kernel.py: tl.max / tl.sum stop working in the interpreter when triton was
# imported before TRITON_INTERPRET=1 was set).
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine


# NOTE: Triton specialises integer arguments on their value (== 1, divisible by 16) and
# pointers on their 16-byte alignment. The batch, the step's widest tree (auto's budgets),
# vLLM's output width and the row strides that follow them change every step, and the inputs
# are views (the proposal store's rows, a row-index gather) whose alignment can too: none is
# specialised, so the warm-up at engine start (``warm_up``) compiles everything a step launches.
_WALK_INTS = ("num_nodes", "num_words", "out_width", "stride_tr", "stride_pr", "stride_dr",
              "stride_mr", "stride_mrow", "stride_sr")


# (integers go in both lists: newer Tritons take an integer's divisibility by 16 from the
# alignment list)
@triton.jit(do_not_specialize=_WALK_INTS,
            do_not_specialize_on_alignment=_WALK_INTS + (
                "token_ids_ptr", "parents_ptr", "depths_ptr", "mask_ptr", "sampled_ptr"))
def walk_kernel(
    token_ids_ptr, parents_ptr, depths_ptr,  # [R, B] int64 (strides below)
    mask_ptr,  # [R, B + 1, W] int32 packed ancestor rows (row k + 1 = node k, bit j + 1 = node j)
    sampled_ptr,  # [R, B + 1] int64 target samples (row 0 = root)
    accepted_nodes_ptr,  # [R, DEPTH] int64 (output, contiguous)
    num_accepted_ptr,  # [R] int64 (output)
    bonus_ptr,  # [R] int64 (output)
    output_tokens_ptr,  # [R, DEPTH + 1] int64 (output, contiguous)
    accepted_rows_ptr,  # [R, DEPTH + 1] int64 (output, contiguous)
    emitted_ptr,  # EMIT: [R, out_width] int32 (output, contiguous)
    num_nodes,
    num_words,
    out_width,
    stride_tr, stride_tk, stride_pr, stride_pk, stride_dr, stride_dk,
    stride_mr, stride_mrow, stride_mw,
    stride_sr, stride_sk,
    DEPTH: tl.constexpr,  # L
    BLOCK_B: tl.constexpr,  # a power of two >= B (fixed per engine, see the launcher)
    BLOCK_L: tl.constexpr,  # next power of two >= L + 1
    EMIT: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_B)
    valid = k < num_nodes
    depth = tl.load(depths_ptr + r * stride_dr + k * stride_dk, mask=valid, other=0)
    sampled_row = sampled_ptr + r * stride_sr

    # dead[v]: a node on v's path (bit j + 1 of mask row v + 1) failed: its token is not the
    # target's sample at its parent's row. Padding nodes carry token -1: they always fail.
    dead = tl.full([BLOCK_B], 0, dtype=tl.int32)
    bit = tl.arange(0, 32)
    for w in range(0, num_words):
        j = w * 32 + bit - 1  # the node of bit `bit` of word w (bit 0 of word 0: the root)
        j_valid = (j >= 0) & (j < num_nodes)
        token_j = tl.load(token_ids_ptr + r * stride_tr + j * stride_tk, mask=j_valid, other=-1)
        parent_j = tl.load(parents_ptr + r * stride_pr + j * stride_pk, mask=j_valid, other=-1)
        sample_j = tl.load(sampled_row + (parent_j + 1) * stride_sk, mask=j_valid, other=-1)
        failed_j = j_valid & (token_j != sample_j)
        words = tl.load(mask_ptr + r * stride_mr + (k + 1) * stride_mrow + w * stride_mw,
                        mask=valid, other=0)  # [BLOCK_B]
        on_path = ((words[:, None] >> bit[None, :]) & 1) != 0  # [BLOCK_B, 32]
        hit = (on_path & failed_j[None, :]).to(tl.int32)
        dead = tl.maximum(dead, tl.reduce(hit, 1, _MAX))
    reached = valid & (depth > 0) & (dead == 0)

    # slot d: the row (node + 1) of the reached node at depth d, 0 if none (slot 0: the root)
    d = tl.arange(0, BLOCK_L)
    at_depth = reached[:, None] & (depth[:, None] == d[None, :])  # [BLOCK_B, BLOCK_L]
    path_rows = tl.reduce(tl.where(at_depth, (k + 1)[:, None].to(tl.int64), 0), 0, _MAX)
    in_path = d <= DEPTH
    kept = in_path & (path_rows >= tl.where(d == 0, 0, 1))  # the root, then reached depths
    num_accepted = tl.reduce(tl.where(kept & (d > 0), 1, 0).to(tl.int64), 0, _SUM)
    sample = tl.load(sampled_row + path_rows * stride_sk, mask=kept, other=-1)
    output_tokens = tl.where(kept, sample, -1)
    bonus = tl.reduce(tl.where(d == num_accepted, output_tokens, 0), 0, _SUM)

    out_row = r * (DEPTH + 1)
    tl.store(output_tokens_ptr + out_row + d, output_tokens, mask=in_path)
    tl.store(accepted_rows_ptr + out_row + d, tl.where(kept, path_rows, -1), mask=in_path)
    tl.store(accepted_nodes_ptr + r * DEPTH + d - 1, path_rows - 1, mask=(d > 0) & in_path)
    tl.store(num_accepted_ptr + r, num_accepted)
    tl.store(bonus_ptr + r, bonus)
    if EMIT:  # vLLM's layout: the output tokens, then -1
        emitted_row = emitted_ptr + r * out_width
        tl.store(emitted_row + d, output_tokens.to(tl.int32), mask=in_path & (d < out_width))
        o = tl.arange(0, 64)
        for first in range(DEPTH + 1, out_width, 64):
            tl.store(emitted_row + first + o, tl.full([64], -1, dtype=tl.int32),
                     mask=first + o < out_width)


@triton.jit(do_not_specialize=("num_reqs", "num_tokens"),
            do_not_specialize_on_alignment=("num_reqs", "num_tokens", "accepted_rows_ptr",
                                            "starts_ptr"))
def finish_verify_kernel(
    accepted_rows_ptr,  # [R, DEPTH + 1] int64 query rows within the request: 0, node + 1, -1
    starts_ptr,  # [R] int64 first query row of each request
    src_ptr,  # [R * DEPTH] int64 (output): flat query row to move, -1 = none
    dst_ptr,  # [R * DEPTH] int64 (output)
    gather_ptr,  # [T] int64 (output): the drafter's hidden-state row of each query row
    moved_ptr,  # [] int64: the moved-slot count, incremented
    num_reqs,
    num_tokens,
    stride_ar, stride_ak,
    DEPTH: tl.constexpr,
    BLOCK_L: tl.constexpr,  # next power of two >= DEPTH
    BLOCK_T: tl.constexpr,  # rows per tile of the identity
):
    r = tl.program_id(0).to(tl.int64)
    start = tl.load(starts_ptr + r)
    end = tl.load(starts_ptr + r + 1, mask=r + 1 < num_reqs, other=num_tokens)
    # the identity over the request's rows (the first request's from 0, the last's to T) ...
    t = tl.arange(0, BLOCK_T)
    for first in range(tl.where(r == 0, 0, start), end, BLOCK_T):
        rows = first + t
        tl.store(gather_ptr + rows, rows, mask=rows < end)
    tl.debug_barrier()  # ... written before the moved rows overwrite theirs
    d = tl.arange(0, BLOCK_L)
    in_path = d < DEPTH
    node_row = tl.load(accepted_rows_ptr + r * stride_ar + (d + 1) * stride_ak, mask=in_path,
                       other=-1)
    accepted = node_row >= 0
    src = start + node_row
    dst = start + d + 1  # node at depth d + 1 goes to the chain slot d + 1
    tl.store(gather_ptr + dst, src, mask=accepted)
    moves = accepted & (src != dst)
    tl.store(src_ptr + r * DEPTH + d, tl.where(moves, src, -1), mask=in_path)
    tl.store(dst_ptr + r * DEPTH + d, tl.where(moves, dst, -1), mask=in_path)
    tl.atomic_add(moved_ptr, tl.reduce(moves.to(tl.int64), 0, _SUM))


@triton.jit(do_not_specialize=("budget",), do_not_specialize_on_alignment=("budget",
                                                                           "budgets_ptr"))
def build_tree_kernel(
    values_ptr,  # [R, L, K] float32 top-k log-probabilities per depth (any order of ties)
    ids_ptr,  # [R, L, K] int64 their token ids
    ranked_lp_ptr,  # [R, L, K] float32 scratch: the lists ranked (value desc, token id asc)
    ranked_id_ptr,  # [R, L, K] int64 scratch
    budgets_ptr,  # HAS_BUDGETS: [R] int64 nodes per request
    tokens_ptr, parents_ptr, depths_ptr,  # [R, B] int64 (output, contiguous)
    scores_ptr,  # [R, B] float32 (output)
    num_nodes_ptr,  # [R] int64 (output)
    mask_ptr,  # [R, B + 1, W] int32 (output)
    budget,  # nodes per request without budgets_ptr
    num_words,  # W
    DEPTH: tl.constexpr,  # L
    K: tl.constexpr,  # candidates per depth, min(B, vocab)
    B: tl.constexpr,  # max_budget, the padded width
    BLOCK_K: tl.constexpr,  # next power of two >= K
    BLOCK_L: tl.constexpr,  # next power of two >= L + 1
    BLOCK_B: tl.constexpr,  # next power of two >= B + 2: nodes, frontier slots, mask rows
    BLOCK_W: tl.constexpr,  # next power of two >= W
    HAS_BUDGETS: tl.constexpr,
):
    """DDTree's best-first tree of one request, as ``csrc/ddtree_cpu.cpp``'s build_tree: pop
    the best prefix (key: score desc, depth, parent, rank), make it node n, push its next
    sibling (same parent, next rank) and its first child (next depth, rank 0). The frontier,
    the nodes and their mask rows live in registers; each pop is a few vector reductions."""
    r = tl.program_id(0).to(tl.int64)
    NEG: tl.constexpr = float("-inf")
    BIG: tl.constexpr = 1 << 30
    lists = r * DEPTH * K

    # 1. Rank each depth's list: rank of j = the entries before it (greater value, or equal
    # value and smaller token id); scatter into the scratch lists.
    j = tl.arange(0, BLOCK_K)
    j_valid = j < K
    i = tl.arange(0, 32)
    for d in range(0, DEPTH):
        row = lists + d * K
        v_j = tl.load(values_ptr + row + j, mask=j_valid, other=NEG)
        t_j = tl.load(ids_ptr + row + j, mask=j_valid, other=0)
        rank = tl.full([BLOCK_K], 0, dtype=tl.int32)
        for first in range(0, K, 32):
            i_valid = first + i < K
            v_i = tl.load(values_ptr + row + first + i, mask=i_valid, other=NEG)
            t_i = tl.load(ids_ptr + row + first + i, mask=i_valid, other=0)
            before = i_valid[:, None] & ((v_i[:, None] > v_j[None, :]) | (
                (v_i[:, None] == v_j[None, :]) & (t_i[:, None] < t_j[None, :])))
            rank += tl.reduce(before.to(tl.int32), 0, _SUM)
        tl.store(ranked_lp_ptr + row + rank, v_j, mask=j_valid)
        tl.store(ranked_id_ptr + row + rank, t_j, mask=j_valid)
    tl.debug_barrier()  # the ranked lists, written above, are read below by other threads

    dd = tl.arange(0, BLOCK_L)[:, None]
    qq = tl.arange(0, BLOCK_K)[None, :]
    lp = tl.load(ranked_lp_ptr + lists + dd * K + qq, mask=(dd < DEPTH) & (qq < K), other=NEG)
    lp_first = tl.reduce(tl.where(qq == 0, lp, NEG), 1, _MAX)  # [BLOCK_L] rank 0 per depth

    if HAS_BUDGETS:
        limit = tl.minimum(tl.load(budgets_ptr + r), B).to(tl.int32)
    else:
        limit = budget
    slot = tl.arange(0, BLOCK_B)  # frontier slot, node index, mask row
    word = tl.arange(0, BLOCK_W)
    # the frontier: entry (score, depth, parent, rank); slot 0 holds depth 1's best token
    first_score = tl.reduce(tl.where(tl.arange(0, BLOCK_L) == 0, lp_first, NEG), 0, _MAX)
    f_score = tl.where(slot == 0, first_score, NEG)
    f_valid = (slot == 0) & (limit > 0)
    f_depth = tl.where(slot == 0, 1, 0)
    f_parent = tl.full([BLOCK_B], -1, dtype=tl.int32)
    f_rank = tl.full([BLOCK_B], 0, dtype=tl.int32)
    n_depth = tl.full([BLOCK_B], 0, dtype=tl.int32)
    n_parent = tl.full([BLOCK_B], -1, dtype=tl.int32)
    n_rank = tl.full([BLOCK_B], 0, dtype=tl.int32)
    n_score = tl.full([BLOCK_B], NEG, dtype=tl.float32)
    rows = slot[:, None]  # [BLOCK_B, 1] mask row (row 0: the root, row n + 1: node n)
    one = tl.full([BLOCK_B, BLOCK_W], 1, dtype=tl.int32)
    one_word = tl.full([BLOCK_W], 1, dtype=tl.int32)
    mask = tl.where((rows == 0) & (word[None, :] == 0), one, 0)  # the root sees itself
    n = tl.full([], 0, dtype=tl.int32)  # nodes so far
    next_slot = tl.full([], 1, dtype=tl.int32)  # the first unused frontier slot
    for _ in range(0, B):
        best = tl.reduce(tl.where(f_valid, f_score, NEG), 0, _MAX)
        go = (n < limit) & (best > NEG)  # a possible prefix left, and room for it
        pick = f_valid & (f_score == best)
        best_depth = -tl.reduce(tl.where(pick, -f_depth, -BIG), 0, _MAX)
        pick = pick & (f_depth == best_depth)
        best_parent = -tl.reduce(tl.where(pick, -f_parent, -BIG), 0, _MAX)
        pick = pick & (f_parent == best_parent)
        best_rank = -tl.reduce(tl.where(pick, -f_rank, -BIG), 0, _MAX)
        pick = pick & (f_rank == best_rank) & go
        # node n
        is_n = (slot == n) & go
        n_depth = tl.where(is_n, best_depth, n_depth)
        n_parent = tl.where(is_n, best_parent, n_parent)
        n_rank = tl.where(is_n, best_rank, n_rank)
        n_score = tl.where(is_n, best, n_score)
        parent_row = tl.reduce(tl.where(rows == best_parent + 1, mask, 0), 0, _SUM)  # [W]
        own_bit = tl.where(word == (n + 1) // 32, one_word << ((n + 1) % 32), 0)
        mask = tl.where((rows == n + 1) & go, (parent_row | own_bit)[None, :], mask)
        # its next sibling takes its frontier slot; its first child a new slot
        sibling_lp = tl.reduce(tl.reduce(tl.where((dd == best_depth - 1) & (qq == best_rank + 1),
                                                  lp, NEG), 1, _MAX), 0, _MAX)
        parent_score = tl.reduce(tl.where(slot == best_parent, n_score, NEG), 0, _MAX)
        sibling = tl.where(best_parent >= 0, parent_score + sibling_lp, sibling_lp)
        has_sibling = best_rank + 1 < K
        f_score = tl.where(pick, sibling, f_score)
        f_rank = tl.where(pick, best_rank + 1, f_rank)
        f_valid = tl.where(pick, has_sibling, f_valid)
        child_lp = tl.reduce(tl.where(tl.arange(0, BLOCK_L) == best_depth, lp_first, NEG), 0,
                             _MAX)
        has_child = go & (best_depth < DEPTH)
        is_child = (slot == next_slot) & has_child
        f_score = tl.where(is_child, best + child_lp, f_score)
        f_depth = tl.where(is_child, best_depth + 1, f_depth)
        f_parent = tl.where(is_child, n, f_parent)
        f_rank = tl.where(is_child, 0, f_rank)
        f_valid = f_valid | is_child
        next_slot += has_child.to(tl.int32)
        n += go.to(tl.int32)

    # the nodes (their tokens gathered from the ranked lists), then padding past node n - 1:
    # token -1, parent -1, depth 0, score -inf, mask row {root, itself}
    real = slot < n
    out = r * B + slot
    in_width = slot < B
    token = tl.load(ranked_id_ptr + lists + (n_depth - 1) * K + n_rank, mask=real, other=-1)
    tl.store(tokens_ptr + out, tl.where(real, token, -1), mask=in_width)
    tl.store(parents_ptr + out, tl.where(real, n_parent, -1).to(tl.int64), mask=in_width)
    tl.store(depths_ptr + out, tl.where(real, n_depth, 0).to(tl.int64), mask=in_width)
    tl.store(scores_ptr + out, tl.where(real, n_score, NEG), mask=in_width)
    tl.store(num_nodes_ptr + r, n.to(tl.int64))
    padding = (rows > n) & (rows <= B)
    pad_row = tl.where(word[None, :] == 0, one, 0) | tl.where(word[None, :] == rows // 32,
                                                               one << (rows % 32), 0)
    mask = tl.where(padding, pad_row, mask)
    tl.store(mask_ptr + (r * (B + 1) + rows) * num_words + word[None, :], mask,
             mask=(rows <= B) & (word[None, :] < num_words))
