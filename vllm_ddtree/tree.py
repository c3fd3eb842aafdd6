"""Optimal draft trees from per-position draft distributions (DDTree, Algorithm 1).

Vocabulary (used everywhere in this project):

- **root**: the bonus token of the previous step, already chosen by the target. It is query
  row 0 of a request's verify block and row/column 0 of the ancestor mask.
- **node**: one of the B draft tokens of a request's tree (B = budget). Node k (0-based) is
  query row k + 1 and mask row/column k + 1.
- **parent**: the node index of a node's parent; -1 means the root.
- **depth**: 1..L for nodes (L = drafter block_size - 1), 0 for the root. A node's position is
  ``context_len + depth``: siblings share a position.
- **accepted path**: the nodes the verifier accepts, root excluded, in depth order.
- **bonus token**: the target's sample at the deepest accepted node (or at the root).

A DFlash drafter gives one distribution q_d per depth d, independent of the parent, so the
probability of a prefix y_1..y_d is prod_i q_i(y_i) and the tree with at most B nodes that
maximises the expected accepted length is the set of the B most probable prefixes (DDTree,
Prop. 2). :func:`build_tree` computes that set for a whole batch on the logits' device with
fixed shapes and no host synchronisation; :func:`reference_build_tree` is the plain best-first
heap of Algorithm 1, used as the oracle in tests and as the baseline in benchmarks.

Order and tie-break (both implementations): nodes are sorted by the key
``(-score, depth, index of the parent, rank of the token at its depth)``, where the rank orders a
depth's tokens by descending log-probability, then ascending token id. A parent always precedes
its children, so ``parents[k] < k``. Prefixes of probability zero are never nodes.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from collections.abc import Callable
from functools import lru_cache

import torch

from vllm_ddtree.sampling import row_chunks

__all__ = [
    "DraftTree",
    "build_tree",
    "reference_build_tree",
    "pack_mask",
    "unpack_mask",
]

PADDING_TOKEN_ID = -1  # token of a padding node: never equals a sampled token


@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees, padded to ``max_budget`` nodes (B) per request.

    Padding nodes (index >= ``num_nodes[r]``) have token -1, parent -1, depth 0, score -inf and
    a mask row holding only the root and themselves, so they are harmless to attention and are
    never accepted.
    """

    token_ids: torch.Tensor  # [batch, B] int64, -1 for padding
    parents: torch.Tensor  # [batch, B] int64, -1 = root (and padding)
    depths: torch.Tensor  # [batch, B] int64, 1..L, 0 for padding
    scores: torch.Tensor  # [batch, B] float32, log q of the prefix, -inf for padding
    num_nodes: torch.Tensor  # [batch] int64
    ancestor_mask: torch.Tensor  # [batch, B + 1, ceil((B + 1) / 32)] int32, packed bits
    max_depth: int  # L, the drafter's depth: no node is deeper

    @property
    def max_budget(self) -> int:
        return self.token_ids.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        """``[batch, B]`` bool: True for real nodes."""
        return self.depths > 0

    def first_nodes(self, width: int) -> DraftTree:
        """The trees of the first ``width`` nodes of each request (a subtree: parents precede
        their children), padded to ``width``. Example: nodes [a, b, ab] -> width 2: [a, b]."""
        if not 0 <= width <= self.max_budget:
            raise ValueError(f"width={width} must be in [0, {self.max_budget}]")
        words = (width + 1 + 31) // 32
        return DraftTree(
            token_ids=self.token_ids[:, :width],
            parents=self.parents[:, :width],
            depths=self.depths[:, :width],
            scores=self.scores[:, :width],
            num_nodes=self.num_nodes.clamp(max=width),
            ancestor_mask=self.ancestor_mask[:, : width + 1, :words],
            max_depth=min(self.max_depth, width),
        )

    def position_offsets(self) -> torch.Tensor:
        """``[batch, B + 1]`` int64 query position offsets: 0 at the root, then node depths.

        Query row i sits at ``context_len + offsets[:, i]`` (siblings share a position; padding
        rows get offset 0, harmless as they attend only to the root and themselves).
        Example: depths [1, 2, 1, 0(pad)] -> offsets [0, 1, 2, 1, 0].
        """
        root = self.depths.new_zeros(self.depths.shape[0], 1)
        return torch.cat([root, self.depths], dim=1)

    def query_token_ids(self, root_token_ids: torch.Tensor) -> torch.Tensor:
        """``[batch, B + 1]`` int64 verify-block input ids: the root token, then node tokens.

        Padding nodes (token -1) get id 0 so that an embedding lookup stays in range.
        Example: root 7, token_ids [5, 9, -1] -> [7, 5, 9, 0].
        """
        batch = self.token_ids.shape[0]
        if root_token_ids.shape != (batch,):
            raise ValueError(f"root_token_ids.shape={tuple(root_token_ids.shape)}, expected ({batch},)")
        nodes = self.token_ids.clamp(min=0)
        return torch.cat([root_token_ids.to(nodes.dtype)[:, None], nodes], dim=1)

    def dense_mask(self) -> torch.Tensor:
        """``[batch, B + 1, B + 1]`` bool: ``[r, i, j]`` is True iff j is i or its ancestor."""
        return unpack_mask(self.ancestor_mask, self.max_budget + 1)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool ``[..., n, n]`` mask into int32 words ``[..., n, ceil(n / 32)]``.

    Bit ``j % 32`` of word ``j // 32`` of row i holds ``mask[..., i, j]``. Example: a row
    ``[True, False, True]`` packs to the word ``0b101 = 5``.
    """
    n = mask.shape[-1]
    num_words = (n + 31) // 32
    padded = torch.zeros(*mask.shape[:-1], num_words * 32, dtype=torch.int64, device=mask.device)
    padded[..., :n] = mask.to(torch.int64)
    weights = torch.ones(32, dtype=torch.int64, device=mask.device) << torch.arange(
        32, device=mask.device
    )
    words = (padded.view(*mask.shape[:-1], num_words, 32) * weights).sum(-1)
    # Bit 31 makes the word negative as an int32: wrap the int64 value.
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_mask(words: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_mask`: int32 ``[..., rows, W]`` -> bool ``[..., rows, n]``."""
    bits = torch.arange(32, device=words.device, dtype=torch.int32)
    unpacked = (words.unsqueeze(-1) >> bits) & 1  # arithmetic shift; & 1 keeps the bit
    return unpacked.flatten(-2)[..., :n].bool()


def _ranked_log_probs(draft_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` log-probabilities per depth in rank order (value desc, then token id asc).

    One fused log-softmax, then top-k (measured on CPU: 2x faster than top-k of the raw logits
    minus a logsumexp, which PyTorch runs as several unfused passes), one chunk of
    ``(request, depth)`` rows at a time (:func:`vllm_ddtree.sampling.row_chunks`): the float32
    log-probabilities of a chunk are the only vocabulary-sized temporary, so the extra memory
    is bounded whatever the batch (the whole ``[batch, L, vocab]`` at once was 2x bf16 logits).
    Row-wise ops, so the values are the same as without chunks, bit for bit.

    Returns ``(values [batch, L, k] float32, token_ids [batch, L, k] int64)``.
    """
    batch, depth, vocab = draft_logits.shape
    flat = draft_logits.flatten(0, 1)  # [batch * L, vocab], a view of contiguous logits
    values = torch.empty(batch * depth, k, dtype=torch.float32, device=draft_logits.device)
    token_ids = torch.empty(batch * depth, k, dtype=torch.int64, device=draft_logits.device)
    for start, end in row_chunks(batch * depth, vocab):
        log_probs = torch.log_softmax(flat[start:end], dim=-1, dtype=torch.float32)
        values[start:end], token_ids[start:end] = torch.topk(log_probs, k, dim=-1)
        del log_probs  # before the next chunk's
    values, token_ids = values.view(batch, depth, k), token_ids.view(batch, depth, k)
    # topk may order equal values arbitrarily: re-sort by (value desc, token id asc) with a
    # stable sort over the id-sorted list.
    token_ids, by_id = token_ids.sort(dim=-1)
    values = values.gather(-1, by_id)
    values, order = values.sort(dim=-1, descending=True, stable=True)
    return values, token_ids.gather(-1, order)


@lru_cache(maxsize=64)
def _candidate_pairs(budget: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs (i, j) that can extend prefix i with the rank-j token inside a top-``budget`` list.

    Both lists are sorted, so pair (i, j) is beaten by the (i + 1) * (j + 1) - 1 pairs
    (i' <= i, j' <= j); it can only be in the top ``budget`` if (i + 1) * (j + 1) <= budget.
    Pairs are in lexicographic (i, j) order, which a stable sort turns into the tie-break.
    Every i < budget has j = 0, so there are always at least ``budget`` pairs.
    Example: budget 4, k 4 -> i 0: j 0..3; i 1: j 0..1; i 2: j 0; i 3: j 0 (8 pairs).
    Built with device ops only (no host-to-device copy, which CUDA's sync checker flags), so
    even the first call for a shape needs no synchronisation.
    """
    total = sum(min(k, budget // (i + 1)) for i in range(budget))  # host arithmetic
    prefix = torch.arange(budget, dtype=torch.int64, device=device)
    widths = (budget // (prefix + 1)).clamp(max=k)
    ends = widths.cumsum(0)  # one past the last pair of each row
    pair = torch.arange(total, dtype=torch.int64, device=device)
    rows = torch.searchsorted(ends, pair, right=True)
    cols = pair - (ends - widths)[rows]
    return rows, cols


BudgetFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_tree(
    draft_logits: torch.Tensor,
    budget: int | torch.Tensor | BudgetFn,
    max_budget: int | None = None,
) -> DraftTree:
    """The top-B prefixes of every request's factorised draft distribution, as a tree.

    Args:
        draft_logits: ``[batch, L, vocab]`` logits of the L drafted positions (any float dtype).
        budget: the number of nodes B (int), a ``[batch]`` integer tensor of per-request
            budgets (each at most ``max_budget``), or a function that computes that tensor from
            the ranked candidates: ``budget(scores, depths)`` gets the ``[batch, max_budget]``
            log-probabilities and depths of each request's best-first prefixes (the nodes of
            the full-width tree, -inf for impossible ones) and returns the budgets; a request
            keeps its first ``budget[r]`` nodes (``vllm_ddtree.budget`` uses this).
        max_budget: the padded width B of the outputs; required with a tensor or a function
            ``budget``, defaults to ``budget`` when it is an int.

    Returns:
        A :class:`DraftTree` on ``draft_logits.device`` with ``[batch, max_budget]`` fields.

    Everything runs on the logits' device with shapes that depend only on ``(batch, L, vocab,
    max_budget)``: no host synchronisation, so the call can be captured in a CUDA graph.
    NOTE: the first call for a given ``(max_budget, min(max_budget, vocab), device)`` builds and
    caches two small index tables (a host-to-device upload): call once before graph capture.

    Example (L = 2, one request, budget 3): per-depth probabilities q_1 = {a: .6, b: .4},
    q_2 = {c: .9, d: .1} give prefixes a (.6), b (.4), ac (.54), bc (.36), ad (.06), ...;
    the top 3 are a, ac, b, so ``token_ids = [a, c, b]``, ``parents = [-1, 0, -1]``,
    ``depths = [1, 2, 1]``.
    """
    if draft_logits.dim() != 3:
        raise ValueError(
            f"draft_logits.shape={tuple(draft_logits.shape)}, expected [batch, depth, vocab]"
        )
    if not draft_logits.is_floating_point():
        raise ValueError(f"draft_logits.dtype={draft_logits.dtype}, expected a float dtype")
    batch, depth, vocab = draft_logits.shape
    device = draft_logits.device
    budget_fn = budget if callable(budget) and not isinstance(budget, torch.Tensor) else None
    if budget_fn is not None:
        if max_budget is None:
            raise ValueError("a budget function needs max_budget (the padded width of the tree)")
        per_request = None  # from the ranked candidates below
    elif isinstance(budget, torch.Tensor):
        if max_budget is None:
            raise ValueError("a tensor budget needs max_budget (the padded width of the tree)")
        if budget.shape != (batch,):
            raise ValueError(f"budget.shape={tuple(budget.shape)}, expected ({batch},)")
        if budget.is_floating_point():
            raise ValueError(f"budget.dtype={budget.dtype}, expected an integer dtype")
        per_request = budget.to(device=device, dtype=torch.int64).clamp(0, max_budget)
    else:
        if max_budget is None:
            max_budget = int(budget)
        if not 0 <= int(budget) <= max_budget:
            raise ValueError(f"budget={budget} must be in [0, max_budget={max_budget}]")
        per_request = torch.full((batch,), int(budget), dtype=torch.int64, device=device)
    if max_budget < 1:
        raise ValueError(f"max_budget={max_budget} must be >= 1")
    if depth < 1:
        raise ValueError(f"draft_logits has depth {depth}; a tree needs at least 1 position")
    num_slots = max_budget
    k = min(num_slots, vocab)

    top_values, top_ids = _ranked_log_probs(draft_logits, k)  # [batch, L, k] each
    pair_i, pair_j = _candidate_pairs(num_slots, k, device)  # [P] each
    pair_values = top_values[:, :, pair_j]  # [batch, L, P]: lp_d of each pair's token

    # Per-depth top-B lists, each sorted by (-score, parent position, rank): depth 1 is the
    # ranked list itself, depth d keeps the best B of the candidate pairs extending depth d-1.
    scores = top_values.new_full((batch, num_slots), float("-inf"))
    scores[:, :k] = top_values[:, 0]
    level_scores = [scores]  # L x [batch, B] float32
    level_pairs = []  # (L - 1) x [batch, B] int64: index into the pair list
    for d in range(1, depth):
        cand = scores[:, pair_i] + pair_values[:, d]  # [batch, P], P >= B
        cand, order = cand.sort(dim=-1, descending=True, stable=True)
        scores = cand[:, :num_slots]
        level_scores.append(scores)
        level_pairs.append(order[:, :num_slots])
    # Parent positions and tokens of every depth at once.
    tokens = torch.full((batch, depth, num_slots), PADDING_TOKEN_ID, dtype=torch.int64, device=device)
    tokens[:, 0, :k] = top_ids[:, 0]
    parents_pos = torch.full((batch, depth, num_slots), -1, dtype=torch.int64, device=device)
    if depth > 1:
        kept = torch.stack(level_pairs, dim=1)  # [batch, L - 1, B]
        parents_pos[:, 1:] = pair_i[kept]
        tokens[:, 1:] = top_ids[:, 1:].gather(2, pair_j[kept])

    # Global order: stable sort of the depth-major concatenation by score gives the key
    # (-score, depth, position within the depth's list).
    all_scores = torch.stack(level_scores, dim=1).view(batch, depth * num_slots)
    all_scores, global_order = all_scores.sort(dim=-1, descending=True, stable=True)
    chosen = global_order[:, :num_slots]  # [batch, B] flat (depth, position) index
    node_scores = all_scores[:, :num_slots]
    node_depths = chosen // num_slots + 1
    node_tokens = tokens.view(batch, -1).gather(1, chosen)
    parent_pos = parents_pos.view(batch, -1).gather(1, chosen)

    # Node index of each (depth, position) entry, to turn parent positions into node indices.
    node_of_entry = torch.full((batch, depth * num_slots), -1, dtype=torch.int64, device=device)
    node_index = torch.arange(num_slots, device=device).expand(batch, num_slots)
    node_of_entry.scatter_(1, chosen, node_index)
    parent_entry = ((node_depths - 2) * num_slots + parent_pos).clamp(min=0)
    node_parents = torch.where(node_depths > 1, node_of_entry.gather(1, parent_entry), -1)

    num_finite = torch.isfinite(node_scores).sum(dim=1)
    if budget_fn is not None:
        per_request = budget_fn(node_scores, node_depths).to(torch.int64).clamp(0, num_slots)
    num_nodes = torch.minimum(per_request, num_finite)
    valid = node_index < num_nodes[:, None]
    node_tokens = torch.where(valid, node_tokens, PADDING_TOKEN_ID)
    node_parents = torch.where(valid, node_parents, -1)
    node_depths = torch.where(valid, node_depths, 0)
    node_scores = node_scores.masked_fill(~valid, float("-inf"))

    mask = _ancestor_mask(node_parents, depth)
    return DraftTree(
        token_ids=node_tokens,
        parents=node_parents,
        depths=node_depths,
        scores=node_scores,
        num_nodes=num_nodes,
        ancestor_mask=mask,
        max_depth=depth,
    )


@lru_cache(maxsize=64)
def _self_bits(num_rows: int, device: torch.device) -> torch.Tensor:
    """``[num_rows, ceil(num_rows / 32)]`` int32 packed identity: row i has only bit i."""
    dense = torch.eye(num_rows, dtype=torch.bool, device=device)
    return pack_mask(dense)


def _ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Packed ancestor rows by pointer jumping: ceil(log2(max_depth + 1)) rounds.

    Row r starts as {r} with a jump pointer to its parent row (the root row points to itself);
    each round ORs in the row at the jump pointer and doubles the jump, so after t rounds a row
    holds its 2^t nearest path entries. A root-to-node path has at most max_depth + 1 entries.
    Example: a chain root <- 0 <- 1 <- 2 (rows 0..3): after round 1 row 3 = {3, 2}, jump -> 1;
    after round 2 row 3 = {3, 2, 1, 0}.
    """
    batch, num_nodes = parents.shape
    device = parents.device
    num_rows = num_nodes + 1
    num_words = (num_rows + 31) // 32
    mask = _self_bits(num_rows, device).expand(batch, num_rows, num_words)  # [batch, B + 1, W]
    # Jump pointers in row space: root -> 0, node k -> parent + 1 (padding hangs off the root).
    jump = torch.cat(
        [torch.zeros(batch, 1, dtype=torch.int64, device=device), (parents + 1).clamp(min=0)], dim=1
    )  # [batch, B + 1]
    for _ in range(max(max_depth, 1).bit_length()):  # 2^rounds >= max_depth + 1
        mask = mask | mask.gather(1, jump[:, :, None].expand(batch, num_rows, num_words))
        jump = jump.gather(1, jump)
    return mask.contiguous()


def reference_build_tree(draft_logits: torch.Tensor, budget: int) -> list[dict]:
    """DDTree Algorithm 1 with a plain binary heap, one request at a time, on the host.

    Like the official implementation, the top-K log-probabilities are taken on the logits'
    device and copied to the host; the heap then pops B prefixes best-first. Each heap entry
    is ``(key, depth, rank, parent node, score)`` with the module's tie-break key
    ``(-score, depth, parent node, rank)``. Scores are numpy float32 sums ``parent + lp``,
    computed exactly as the batched code computes them, so the two compare bit for bit.

    Returns one dict per request with lists ``token_ids``, ``parents``, ``depths``, ``scores``.

    Example (L = 2, budget 3, q_1 = {a: .6, b: .4}, q_2 = {c: .9, d: .1}): pop a (push b, ac),
    pop ac (push ad), pop b -> token_ids [a, c, b], parents [-1, 0, -1], depths [1, 2, 1].
    """
    if draft_logits.dim() != 3:
        raise ValueError(
            f"draft_logits.shape={tuple(draft_logits.shape)}, expected [batch, depth, vocab]"
        )
    if budget < 0:
        raise ValueError(f"budget={budget} must be >= 0")
    batch, depth, vocab = draft_logits.shape
    k = min(budget, vocab)
    if k == 0:
        return [{"token_ids": [], "parents": [], "depths": [], "scores": []} for _ in range(batch)]
    values, ids = _ranked_log_probs(draft_logits, k)
    values, ids = values.cpu().numpy(), ids.cpu().numpy()  # the device-to-host copy
    trees = []
    for r in range(batch):
        lp = values[r]  # [L, k] float32
        tok = ids[r]
        out = {"token_ids": [], "parents": [], "depths": [], "scores": []}
        node_scores = []  # float32 score of each emitted node
        first = lp[0, 0]
        heap = [((-float(first), 1, -1, 0), 1, 0, -1, first)]
        while heap and len(node_scores) < budget:
            _, d, rank, parent, score = heapq.heappop(heap)
            if math.isinf(score):
                break  # every remaining prefix has probability zero
            node = len(node_scores)
            node_scores.append(score)
            out["token_ids"].append(int(tok[d - 1, rank]))
            out["parents"].append(parent)
            out["depths"].append(d)
            out["scores"].append(float(score))
            if rank + 1 < k:  # next sibling: same parent, next rank
                s = lp[d - 1, rank + 1]
                if parent >= 0:
                    s = node_scores[parent] + s
                heapq.heappush(heap, ((-float(s), d, parent, rank + 1), d, rank + 1, parent, s))
            if d < depth:  # first child
                s = score + lp[d, 0]
                heapq.heappush(heap, ((-float(s), d + 1, node, 0), d + 1, 0, node, s))
        trees.append(out)
    return trees
