"""Lossless tree verification ("the walk"), vectorised over the batch with fixed shapes.

The target samples one token at every tree position (root and nodes) in parallel, from its
processed distribution at that position. Starting at the root, the walk moves to the child
whose token equals the sample at the current position, as long as there is one; the sample at
the last reached position is the bonus token. For a tree whose children are distinct tokens
chosen by the drafter (not sampled), this is lossless at every temperature and optimal: the
path is accepted to depth d exactly when the target's own sample of d tokens is a tree path.

Vectorised form: node v is reached iff its parent is reached and ``token(v) == y[parent(v)]``.
At most one node per depth is reached. Pointer jumping settles every node in
ceil(log2(L + 1)) rounds of two gathers (4 rounds for L = 15) instead of L rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


def walk(tree: DraftTree, sampled: torch.Tensor) -> TreeVerdict:
    """Accept the longest tree path that agrees with the target samples.

    Args:
        tree: the batch of trees (B nodes each).
        sampled: ``[batch, B + 1]`` target token sampled at each position (row 0 = root).
    """
    batch, num_nodes = tree.token_ids.shape
    if sampled.shape != (batch, num_nodes + 1):
        raise ValueError(f"sampled.shape={tuple(sampled.shape)}, expected ({batch}, {num_nodes + 1})")
    depth = tree.max_depth
    sampled = sampled.long()
    parent_rows = tree.parents + 1  # root -> row 0; padding nodes hang off the root
    # Padding nodes carry token -1, which no sample equals.
    matches = tree.token_ids == sampled.gather(1, parent_rows)  # [batch, B]
    # Pointer jumping in row space (row 0 = root, always reached, its own parent): after t
    # rounds, ok[r] = AND of the matches of r's 2^t nearest path entries; a path from a
    # depth-L node to the root has L + 1 entries, so bit_length(L) rounds settle every node.
    root = torch.ones(batch, 1, dtype=torch.bool, device=matches.device)
    ok = torch.cat([root, matches], dim=1)  # [batch, B + 1]
    jump = torch.cat([torch.zeros_like(parent_rows[:, :1]), parent_rows.clamp(min=0)], dim=1)
    for _ in range(max(depth, 1).bit_length()):
        ok = ok & ok.gather(1, jump)
        jump = jump.gather(1, jump)
    reached = ok[:, 1:]  # [batch, B]

    node_index = torch.arange(num_nodes, device=matches.device).expand(batch, num_nodes)
    slot = (tree.depths - 1).clamp(min=0, max=depth - 1)
    accepted_nodes = torch.full((batch, depth), -1, dtype=torch.int64, device=matches.device)
    accepted_nodes.scatter_reduce_(
        1, slot, torch.where(reached, node_index, -1), reduce="amax", include_self=True
    )
    num_accepted = (accepted_nodes >= 0).sum(dim=1)
    accepted_rows = torch.cat(
        [torch.zeros(batch, 1, dtype=torch.int64, device=matches.device),
         torch.where(accepted_nodes >= 0, accepted_nodes + 1, -1)],
        dim=1,
    )
    last_row = accepted_rows.gather(1, num_accepted[:, None])  # deepest reached position
    bonus_token = sampled.gather(1, last_row).squeeze(1)
    accepted_tokens = torch.where(
        accepted_nodes >= 0, tree.token_ids.gather(1, accepted_nodes.clamp(min=0)), -1
    )
    output_tokens = torch.cat(
        [accepted_tokens, accepted_tokens.new_full((batch, 1), PLACEHOLDER_TOKEN_ID)], dim=1
    ).scatter(1, num_accepted[:, None], bonus_token[:, None])
    return TreeVerdict(
        accepted_nodes=accepted_nodes,
        num_accepted=num_accepted,
        bonus_token=bonus_token,
        output_tokens=output_tokens,
        accepted_rows=accepted_rows,
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
