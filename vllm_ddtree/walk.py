"""Lossless tree verification ("the walk"), vectorised over the batch with fixed shapes.

The target samples one token at every tree position (root and nodes) in parallel, from its
processed distribution at that position. Starting at the root, the walk moves to the child
whose token equals the sample at the current position, as long as there is one; the sample at
the last reached position is the bonus token. For a tree whose children are distinct tokens
chosen by the drafter (not sampled), this is lossless at every temperature and optimal: the
path is accepted to depth d exactly when the target's own sample of d tokens is a tree path.

Vectorised form: node v *matches* when ``token(v) == y[parent(v)]`` (y: the samples by row),
and v is reached iff every node on its path from the root (its ancestors and v) matches. The
packed ancestor rows of the tree (``DraftTree.ancestor_mask``) hold each path, so one AND of
every node's unpacked row with the failed matches settles all nodes at once, whatever the
depth L. Children carry distinct tokens, so at most one node per depth is reached; its row
(node index + 1) lands in slot ``depth`` of the path with one scatter, and the emitted tokens
are the samples at the path's rows (the sample at a reached row is its child's token).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from vllm_ddtree.kernels.native import cpu_ops
from vllm_ddtree.kernels.verify_steps import triton_stages, walk_triton
from vllm_ddtree.sampling import PLACEHOLDER_TOKEN_ID, SamplingBatch, sample_tokens
from vllm_ddtree.tree import DraftTree

__all__ = ["TreeVerdict", "walk", "verify_tree"]


@dataclass(frozen=True)
class TreeVerdict:
    """The outcome of verifying a batch of trees.

    Example: a tree with nodes (token, parent) = [(5, -1), (7, -1), (9, 0), (4, 1)] and target
    samples y = [7, 1, 4, 2, 8] at rows [root, node 0..3]: y[root] = 7 matches node 1, y[node 1]
    (row 2) = 4 matches node 3, y[node 3] (row 4) = 8 matches nothing, so
    ``accepted_nodes = [1, 3]``, ``num_accepted = 2``, ``bonus_token = 8``,
    ``output_tokens = [7, 4, 8]`` and ``accepted_rows = [0, 2, 4]``.
    """

    accepted_nodes: torch.Tensor  # [batch, L] int64 node indices in depth order, -1 padded
    num_accepted: torch.Tensor  # [batch] int64
    bonus_token: torch.Tensor  # [batch] int64
    output_tokens: torch.Tensor  # [batch, L + 1] int64: accepted tokens, bonus, -1 padded
    accepted_rows: torch.Tensor  # [batch, L + 1] int64 query rows: 0, then node + 1, -1 padded
    # vLLM's layout of the output, when asked for (walk's out_width): [batch, out_width] int32,
    # output_tokens then -1
    sampled_token_ids: torch.Tensor | None = None


@lru_cache(maxsize=64)
def _walk_tables(num_nodes: int, depth: int, device: torch.device):
    """Constants of :func:`walk`, built once per shape with device ops: the row of each node
    ``[B]`` (k + 1), the smallest row of each path slot ``[L + 1]`` (0 for the root's slot 0,
    then 1: an empty slot holds row 0) and the bit offsets of a mask word ``[32]`` int32."""
    node_rows = torch.arange(1, num_nodes + 1, device=device)
    slot_floor = torch.arange(depth + 1, device=device).clamp_(max=1)
    bit_shifts = torch.arange(32, dtype=torch.int32, device=device)
    return node_rows, slot_floor, bit_shifts


def walk(tree: DraftTree, sampled: torch.Tensor, out_width: int | None = None) -> TreeVerdict:
    """Accept the longest tree path that agrees with the target samples.

    On the :class:`TreeVerdict` example (y = [7, 1, 4, 2, 8]): the matches of nodes 0..3 are
    [5 == 7, 7 == 7, 9 == y[row 1] = 1, 4 == y[row 2] = 4] = [no, yes, no, yes]; the paths
    of nodes 0..3 are {0}, {1}, {0, 2}, {1, 3}, so nodes 1 and 3 are reached. Their rows 2
    and 4 go to slots 1 and 2 (their depths): path rows [0, 2, 4], all on the path, and the
    output is y at those rows, [7, 4, 8].

    Args:
        tree: the batch of trees (B nodes each).
        sampled: ``[batch, B + 1]`` target token sampled at each position (row 0 = root).
        out_width: also lay the output out as vLLM's sampler output ``[batch, out_width]``
            int32 (:attr:`TreeVerdict.sampled_token_ids`).
    """
    batch, num_nodes = tree.token_ids.shape
    if sampled.shape != (batch, num_nodes + 1):
        raise ValueError(f"sampled.shape={tuple(sampled.shape)}, expected ({batch}, {num_nodes + 1})")
    depth = tree.max_depth
    ops = cpu_ops(sampled.device)
    if ops is not None:  # the fused CPU kernel: one op (nodes in best-first order)
        *fields, emitted = ops.walk(tree.token_ids, tree.parents, sampled.long(), depth,
                                    out_width or 0)
        return TreeVerdict(*fields, sampled_token_ids=emitted if out_width else None)
    if triton_stages(sampled.device):  # the Triton kernel: one launch
        *fields, emitted = walk_triton(tree.token_ids, tree.parents, tree.depths,
                                       tree.ancestor_mask, sampled.long(), depth, out_width or 0)
        return TreeVerdict(*fields, sampled_token_ids=emitted)
    node_rows, slot_floor, bit_shifts = _walk_tables(num_nodes, depth, sampled.device)
    sampled = sampled.long()
    # Padding nodes carry token -1, which no sample equals: they always fail.
    failed = tree.token_ids != sampled.gather(1, tree.parents + 1)  # [batch, B], root -> row 0
    # on_path[v, j] (bit 0): node j is v or an ancestor of v, i.e. bit j + 1 of mask row v + 1.
    # NOTE: 4 * B * 32W bytes per request (25 KB at B = 64, 4.3 MB at B = 1024), once.
    words = tree.ancestor_mask[:, 1:, :, None] >> bit_shifts  # [batch, B, W, 32] int32
    on_path = words.flatten(2)[:, :, 1 : num_nodes + 1]  # [batch, B, B]
    dead = on_path.bitwise_and_(failed[:, None, :]).any(dim=2)  # [batch, B] a failed node on it
    # slot d: the row of the reached node at depth d, 0 if none (slot 0: the root's row 0;
    # padding nodes have depth 0 and are never reached)
    path_rows = torch.zeros(batch, depth + 1, dtype=torch.int64, device=sampled.device)
    path_rows.scatter_reduce_(1, tree.depths, torch.where(dead, 0, node_rows), reduce="amax")
    kept = path_rows >= slot_floor  # [batch, L + 1] the root, then the reached depths
    num_accepted = kept[:, 1:].sum(dim=1)
    output_tokens = torch.where(kept, sampled.gather(1, path_rows), PLACEHOLDER_TOKEN_ID)
    emitted = None
    if out_width:
        emitted = torch.full((batch, out_width), PLACEHOLDER_TOKEN_ID, dtype=torch.int32,
                             device=sampled.device)
        keep = min(out_width, depth + 1)
        emitted[:, :keep] = output_tokens[:, :keep]
    return TreeVerdict(
        accepted_nodes=path_rows[:, 1:] - 1,  # an empty slot's row 0 -> -1
        num_accepted=num_accepted,
        bonus_token=output_tokens.gather(1, num_accepted[:, None]).squeeze(1),
        output_tokens=output_tokens,
        accepted_rows=torch.where(kept, path_rows, -1),
        sampled_token_ids=emitted,
    )


def verify_tree(
    tree: DraftTree,
    target_logits: torch.Tensor,
    sampling: SamplingBatch | None = None,
) -> TreeVerdict:
    """Sample the target at every tree position and walk the tree.

    Args:
        tree: the batch of trees (B nodes each).
        target_logits: ``[batch, B + 1, vocab]`` target logits, row 0 at the root, row k + 1 at
            node k.
        sampling: per-request parameters; ``None`` is greedy for every request.
    """
    batch, num_nodes = tree.token_ids.shape
    if target_logits.dim() != 3 or target_logits.shape[:2] != (batch, num_nodes + 1):
        raise ValueError(
            f"target_logits.shape={tuple(target_logits.shape)}, "
            f"expected [{batch}, {num_nodes + 1}, vocab]"
        )
    return walk(tree, sample_tokens(target_logits, sampling))
