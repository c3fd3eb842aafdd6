"""Launchers of the verify step's tree build, walk and finish_verify on CUDA: one launch each.

The torch path of these stages (``vllm_ddtree/tree.py``, ``vllm_ddtree/walk.py``,
``TreeState.finish_verify``) runs 165-206, 20 and 18 GPU launches per step (H200,
``benchmarks/cuda_stages.py``); these kernels do the same work, one program per request, with
the same outputs bit for bit (the tree build after the torch log-softmax and top-k). :func:`triton_stages` says
whether a device gets them (CUDA, unless ``VLLM_DDTREE_NATIVE=0`` selects the torch path, as
on the CPU).
"""

from __future__ import annotations

import torch

from ._launch import check_launchable, next_power_of_2
from .native import enabled

__all__ = ["triton_stages", "build_tree_triton", "walk_triton", "finish_verify_triton",
           "warm_up"]


def triton_stages(device: torch.device | str) -> bool:
    """True when the verify-step stages on ``device`` run these Triton kernels: CUDA, with the
    fused kernels enabled (``VLLM_DDTREE_NATIVE`` not 0)."""
    return torch.device(device).type == "cuda" and enabled()


def _walk_block(num_nodes: int) -> int:
    """The walk's node tile: 256 for every tree up to 256 nodes, so that the step's widest tree
    (which follows auto's budgets) never compiles a new kernel while serving."""
    return max(256, next_power_of_2(num_nodes))


def walk_triton(token_ids: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                ancestor_mask: torch.Tensor, sampled: torch.Tensor, depth: int,
                out_width: int = 0):
    """The walk of :func:`vllm_ddtree.walk.walk` in one launch.

    ``token_ids`` / ``parents`` / ``depths``: ``[R, B]`` int64; ``ancestor_mask``: ``[R, B + 1,
    W]`` int32; ``sampled``: ``[R, B + 1]`` int64; ``depth``: L. Returns (accepted_nodes
    ``[R, L]``, num_accepted ``[R]``, bonus_token ``[R]``, output_tokens ``[R, L + 1]``,
    accepted_rows ``[R, L + 1]``, and with ``out_width`` vLLM's ``[R, out_width]`` int32
    output, else None).
    """
    check_launchable("sampled", sampled, "vllm_ddtree.walk.walk")
    num_reqs, num_nodes = token_ids.shape
    device = sampled.device
    accepted_nodes = torch.empty(num_reqs, depth, dtype=torch.int64, device=device)
    num_accepted = torch.empty(num_reqs, dtype=torch.int64, device=device)
    bonus = torch.empty(num_reqs, dtype=torch.int64, device=device)
    output_tokens = torch.empty(num_reqs, depth + 1, dtype=torch.int64, device=device)
    accepted_rows = torch.empty(num_reqs, depth + 1, dtype=torch.int64, device=device)
    emitted = (torch.empty(num_reqs, out_width, dtype=torch.int32, device=device) if out_width
               else accepted_rows)  # unused when not emitting
    if num_reqs:
        from .verify_steps_kernel import walk_kernel  # lazy: needs Triton

        walk_kernel[(num_reqs,)](
            token_ids, parents, depths, ancestor_mask, sampled,
            accepted_nodes, num_accepted, bonus, output_tokens, accepted_rows, emitted,
            num_nodes, ancestor_mask.shape[2], out_width,
            *token_ids.stride(), *parents.stride(), *depths.stride(), *ancestor_mask.stride(),
            *sampled.stride(),
            DEPTH=depth, BLOCK_B=_walk_block(num_nodes),
            BLOCK_L=max(16, next_power_of_2(depth + 1)), EMIT=bool(out_width),
        )
    return (accepted_nodes, num_accepted, bonus, output_tokens, accepted_rows,
            emitted if out_width else None)


def finish_verify_triton(accepted_rows: torch.Tensor, starts: torch.Tensor, num_tokens: int,
                         moved: torch.Tensor):
    """:meth:`TreeState.finish_verify` in one launch: returns (src, dst, gather_index) and adds
    the moved slots to ``moved`` (a 0-dim int64 tensor).

    ``accepted_rows``: ``[R, L + 1]`` the walk's query rows; ``starts``: ``[R]`` int64 first
    query row of each request (increasing, the step's rows end at ``num_tokens``).
    """
    check_launchable("accepted_rows", accepted_rows, "TreeState.finish_verify's torch path")
    num_reqs, width = accepted_rows.shape
    depth = width - 1
    device = accepted_rows.device
    src = torch.empty(num_reqs * depth, dtype=torch.int64, device=device)
    dst = torch.empty(num_reqs * depth, dtype=torch.int64, device=device)
    if not num_reqs:
        return src, dst, torch.arange(num_tokens, device=device)
    gather_index = torch.empty(num_tokens, dtype=torch.int64, device=device)
    from .verify_steps_kernel import finish_verify_kernel  # lazy: needs Triton

    finish_verify_kernel[(num_reqs,)](
        accepted_rows, starts, src, dst, gather_index, moved, num_reqs, num_tokens,
        *accepted_rows.stride(), DEPTH=depth, BLOCK_L=max(16, next_power_of_2(depth)),
        BLOCK_T=256,
    )
    return src, dst, gather_index


MAX_TRITON_BUDGET = 256  # the kernel keeps a tree's nodes and mask rows in registers


def build_tree_triton(values: torch.Tensor, ids: torch.Tensor, budget: int | torch.Tensor,
                      max_budget: int):
    """DDTree's tree from the top-k lists of each depth in one launch (``max_budget`` <= 256).

    ``values`` / ``ids``: ``[R, L, K]`` float32 log-probabilities and int64 token ids
    (:func:`vllm_ddtree.tree._top_log_probs`, ties in any order); ``budget``: nodes per request
    (an int, or a ``[R]`` int64 device tensor: each request keeps its first ``budget[r]``
    nodes, which a best-first order makes a subtree). Returns (tokens, parents, depths,
    scores, num_nodes, ancestor_mask) as the fused CPU op does.
    """
    check_launchable("values", values, "vllm_ddtree.tree.build_tree's torch path")
    if max_budget > MAX_TRITON_BUDGET:
        raise ValueError(f"max_budget={max_budget} > {MAX_TRITON_BUDGET}: use the torch path")
    num_reqs, depth, k = values.shape
    device = values.device
    words = (max_budget + 1 + 31) // 32
    tokens, parents, depths = (torch.empty(num_reqs, max_budget, dtype=torch.int64,
                                           device=device) for _ in range(3))
    scores = torch.empty(num_reqs, max_budget, dtype=torch.float32, device=device)
    num_nodes = torch.empty(num_reqs, dtype=torch.int64, device=device)
    mask = torch.empty(num_reqs, max_budget + 1, words, dtype=torch.int32, device=device)
    if num_reqs:
        from .verify_steps_kernel import build_tree_kernel  # lazy: needs Triton

        per_request = isinstance(budget, torch.Tensor)
        build_tree_kernel[(num_reqs,)](
            values.contiguous(), ids.contiguous(), torch.empty_like(values),
            torch.empty_like(ids), budget if per_request else num_nodes, tokens, parents, depths,
            scores, num_nodes, mask, 0 if per_request else int(budget), words,
            DEPTH=depth, K=k, B=max_budget, BLOCK_K=max(16, next_power_of_2(k)),
            BLOCK_L=max(16, next_power_of_2(depth + 1)),
            BLOCK_B=max(16, next_power_of_2(max_budget + 2)),
            BLOCK_W=max(16, next_power_of_2(words)), HAS_BUDGETS=per_request, num_warps=8,
        )
    return tokens, parents, depths, scores, num_nodes, mask


def warm_up(budget: int, depth: int, vocab: int, device: torch.device) -> None:
    """Compile every stage kernel a verify step of this engine launches (engine start, not
    mid-serving): the tree build with one budget and with per-request budgets, the walk with
    vLLM's output layout, finish_verify. Their compile keys depend only on the engine's B, L
    and vocabulary (see the kernels' NOTE), never on the batch."""
    k = min(budget, vocab)
    if budget <= MAX_TRITON_BUDGET:
        values = torch.zeros(1, depth, k, dtype=torch.float32, device=device)
        ids = torch.arange(k, device=device).expand(1, depth, k).contiguous()
        build_tree_triton(values, ids, budget, budget)
        build_tree_triton(values, ids, torch.full((1,), budget, device=device), budget)
    widths, block = [min(budget, 256)], 256  # a tree of each walk tile up to B (_walk_block)
    while block < budget:
        block *= 2
        widths.append(min(budget, block))
    for width in widths:
        words = (width + 1 + 31) // 32
        none = torch.full((1, width), -1, dtype=torch.int64, device=device)
        mask = torch.zeros(1, width + 1, words, dtype=torch.int32, device=device)
        sampled = torch.zeros(1, width + 1, dtype=torch.int64, device=device)
        verdict = walk_triton(none, none, none.clamp(min=0), mask, sampled, depth, budget + 1)
    finish_verify_triton(verdict[4], torch.zeros(1, dtype=torch.int64, device=device),
                         budget + 1, torch.zeros((), dtype=torch.int64, device=device))
