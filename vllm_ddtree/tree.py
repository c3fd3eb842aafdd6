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
Prop. 2). With a calibration (``vllm_ddtree.calibration``) each depth's probabilities are first
replaced by how often the target takes a token of that rank, and the tree is the top-B prefixes
by that estimate. :func:`build_tree` computes that set for a whole batch on the logits' device
with fixed shapes and no host synchronisation; :func:`reference_build_tree` is the plain
best-first heap of Algorithm 1, used as the oracle in tests and as the baseline in benchmarks.

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
from typing import NamedTuple

import torch

from vllm_ddtree.calibration import CELLS, DraftTops, calibrate_lists, rank_lists
from vllm_ddtree.kernels.native import cpu_ops
from vllm_ddtree.kernels.verify_steps import (
    MAX_TRITON_BUDGET,
    build_tree_triton,
    triton_stages,
)
from vllm_ddtree.sampling import cached_arange, row_chunks

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
    # [batch, B] float32: the prefix's log q (its calibrated acceptance's log where the tree
    # was built with a calibration), -inf for padding
    scores: torch.Tensor
    num_nodes: torch.Tensor  # [batch] int64
    ancestor_mask: torch.Tensor  # [batch, B + 1, ceil((B + 1) / 32)] int32, packed bits
    max_depth: int  # L, the drafter's depth: no node is deeper
    # the drafter's top tokens per depth, for the calibration (build_tree with calibration)
    tops: DraftTops | None = None

    @property
    def max_budget(self) -> int:
        return self.token_ids.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        """``[batch, B]`` bool: True for real nodes."""
        return self.depths > 0

    def first_nodes(self, width: int, num_nodes: torch.Tensor | None = None) -> DraftTree:
        """The trees of the first ``width`` nodes of each request (a subtree: parents precede
        their children), padded to ``width``. ``num_nodes``: their node counts where the caller
        knows that no tree has more than ``width`` nodes (a verify batch cut to its widest
        scheduled tree: ``self.num_nodes``), else ``self.num_nodes`` clamped to ``width`` (one
        op less a verify step). Example: nodes [a, b, ab] -> width 2: [a, b]."""
        if not 0 <= width <= self.max_budget:
            raise ValueError(f"width={width} must be in [0, {self.max_budget}]")
        words = (width + 1 + 31) // 32
        return DraftTree(
            token_ids=self.token_ids[:, :width],
            parents=self.parents[:, :width],
            depths=self.depths[:, :width],
            scores=self.scores[:, :width],
            num_nodes=self.num_nodes.clamp(max=width) if num_nodes is None else num_nodes,
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

    def path_tokens(self, request: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
        """``[c, max_depth]`` int64: the tokens on the path root -> ``node[i]`` of tree
        ``request[i]`` (the root excluded), the node's first, then its parent's, ..., -1 past
        the root; ``node`` -1 (a root row): all -1. What a verify row's history adds to the
        request's output. Device ops of fixed shape.
        Example: nodes (token, parent) [(5, -1), (7, -1), (9, 0)], node 2 -> [9, 5, -1, ...].
        """
        width = self.max_budget
        if width == 0 or self.max_depth == 0:
            return node.new_full((node.shape[0], self.max_depth), -1)
        tokens, parents = self.token_ids.reshape(-1), self.parents.reshape(-1)
        base = request * width
        columns = []
        for _ in range(self.max_depth):
            on_path = node >= 0
            at = base + node.clamp(min=0)
            columns.append(torch.where(on_path, tokens[at], -1))
            node = torch.where(on_path, parents[at], -1)
        return torch.stack(columns, dim=1)

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


def _top_log_probs(draft_logits: torch.Tensor, k: int,
                   temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` log-probabilities of ``softmax(draft_logits / temperature)`` per depth, in
    ``torch.topk``'s order (equal values in any order): ``(values [batch, L, k] float32,
    token_ids [batch, L, k] int64)``.

    On the CPU with float32 logits, one fused op (``top_log_probs_``: per row, one pass for the
    top k + 1 logits, one for the softmax's denominator, no temporary; its values equal this
    function's torch path to ~1e-6, its own exp), unless it declines (no AVX2, a NaN, a tie
    across the top-k boundary). Otherwise one fused log-softmax, then top-k (measured on CPU:
    2x faster than top-k of the raw logits minus a logsumexp, which PyTorch runs as several
    unfused passes; on the CPU the top-k is the fused op ``top_k_``, or torch.topk where a tie
    crosses the top-k boundary), one chunk of ``(request, depth)`` rows at a time
    (:func:`vllm_ddtree.sampling.row_chunks`): the float32 log-probabilities of a chunk are the
    only vocabulary-sized temporary, so the extra memory is bounded whatever the batch (the
    whole ``[batch, L, vocab]`` at once was 2x bf16 logits). Row-wise ops, so the values are the
    same as without chunks, bit for bit; top-k writes each chunk straight into the outputs
    (``out=``, no copy).
    """
    batch, depth, vocab = draft_logits.shape
    flat = draft_logits.flatten(0, 1)  # [batch * L, vocab], a view of contiguous logits
    values = torch.empty(batch * depth, k, dtype=torch.float32, device=draft_logits.device)
    token_ids = torch.empty(batch * depth, k, dtype=torch.int64, device=draft_logits.device)
    ops = cpu_ops(draft_logits.device)  # the CPU's top-k: one pass per row, no sort
    if (ops is not None and flat.dtype == torch.float32 and flat.stride(-1) == 1
            and not ops.top_log_probs_(values, token_ids, flat, temperature)):
        return values.view(batch, depth, k), token_ids.view(batch, depth, k)
    for start, end in row_chunks(batch * depth, vocab):
        chunk = flat[start:end]
        if temperature != 1.0:  # in float32: bf16 logits / t would round again
            chunk = chunk.to(torch.float32) / temperature
        log_probs = torch.log_softmax(chunk, dim=-1, dtype=torch.float32)
        del chunk
        # (the op declines a tie across the top-k boundary: torch.topk's choice stands)
        if ops is None or ops.top_k_(values[start:end], token_ids[start:end], log_probs):
            torch.topk(log_probs, k, dim=-1, out=(values[start:end], token_ids[start:end]))
        del log_probs  # before the next chunk's
    return values.view(batch, depth, k), token_ids.view(batch, depth, k)


def _ranked_log_probs(draft_logits: torch.Tensor, k: int,
                      temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_top_log_probs` in rank order (value desc, then token id asc: topk may order
    equal values arbitrarily)."""
    return rank_lists(*_top_log_probs(draft_logits, k, temperature))


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


class _Entries(NamedTuple):
    """Constant tables of :func:`build_tree`'s entry space, for one ``(B, k, L, device)``.

    Each request ranks N *entries*: entry 0 is the root (score +inf, so it sorts first), entry
    ``1 + (d - 1) * B + q`` is position q of depth d's top-B list (d < L), then come the P
    candidate pairs of depth L (unsorted, see :func:`build_tree`), and entry ``N - 1`` is
    padding (score -inf), where every unused row points. An entry's *code* is its index in the
    list of its depth: its position q at depth 1 (the ranked tokens), its candidate pair
    (:func:`_candidate_pairs`) deeper down, 0 for the root and the padding entry.
    Example (B 2, k 2, L 2; depth 2's pairs (0, 0), (0, 1), (1, 0)): entries [root, q0, q1,
    pair 0, pair 1, pair 2, pad] (N = 7); the entry of pair 2 = (1, 0) has the token of flat
    index ``1 * k + 0 = 2`` in the ``[L * k]`` ranked ids and parent entry ``1 + 0 * B + 1 = 2``.
    """

    nodes: torch.Tensor  # [N] int64, -1..N-2: the node index of each sorted position
    depths: torch.Tensor  # [N] int64, depth of each entry; 0 for the root and the padding
    head_codes: torch.Tensor  # [1, 1 + B] int64, codes of the root and of depth 1: 0, 0..B-1
    tail_codes: torch.Tensor  # [1, P + 1] int64 (L > 1) or [1, 1]: depth L's, the padding's
    info: torch.Tensor  # [L + 1, max(P, B), 3] int64 per (depth, code): token index, parent
    # entry, depth (token index: into the [L * k] ranked ids; the root's and padding's are 0)
    pair_values: torch.Tensor  # [L, P] int64 into the [L * k] ranked log-probs, see build_tree
    root_score: torch.Tensor  # [1, 1] float32, +inf
    pad_scores: torch.Tensor  # [1, B] float32, -inf


@lru_cache(maxsize=64)
def _entries(budget: int, k: int, depth: int, device: torch.device) -> _Entries:
    """The :class:`_Entries` tables, built with device ops only (like :func:`_candidate_pairs`)."""
    pair_i, pair_j = _candidate_pairs(budget, k, device)
    num_pairs = pair_i.numel()
    num_entries = (depth - 1) * budget + (num_pairs if depth > 1 else budget) + 2
    nodes = torch.arange(-1, num_entries - 1, dtype=torch.int64, device=device)
    depths = torch.zeros(num_entries, dtype=torch.int64, device=device)
    depths[1:-1] = (nodes[1:-1] // budget + 1).clamp(max=depth)
    position = torch.arange(budget, dtype=torch.int64, device=device)
    zero = position[:1] * 0
    head_codes = torch.cat([zero, position])[None]
    pairs = torch.arange(num_pairs, dtype=torch.int64, device=device)
    tail_codes = (torch.cat([pairs, zero]) if depth > 1 else zero)[None]
    info = torch.zeros(depth + 1, max(num_pairs, budget), 3, dtype=torch.int64, device=device)
    info[:, :, 2] = torch.arange(depth + 1, dtype=torch.int64, device=device)[:, None]
    info[1, :budget, 0] = torch.where(position < k, position, 0)  # depth 1: parent entry 0
    level = torch.arange(1, depth, dtype=torch.int64, device=device)[:, None]  # depth - 1
    info[2:, :num_pairs, 0] = level * k + pair_j
    info[2:, :num_pairs, 1] = 1 + (level - 1) * budget + pair_i
    pair_values = torch.cat([pair_i.clamp(max=k - 1)[None], level * k + pair_j])
    return _Entries(
        nodes=nodes,
        depths=depths,
        head_codes=head_codes,
        tail_codes=tail_codes,
        info=info,
        pair_values=pair_values,
        root_score=torch.full((1, 1), float("inf"), device=device),
        pad_scores=torch.full((1, budget), float("-inf"), device=device),
    )


@lru_cache(maxsize=64)
def _row_thresholds(budget: int, max_budget: int, device: torch.device) -> torch.Tensor:
    """``[max_budget + 2]`` float32: row i of :func:`build_tree` (0 = the root, k + 1 = node k,
    max_budget + 1 = the root's copy) is real iff its score exceeds entry i.

    -inf up to row ``budget`` (any possible prefix is real), +inf past it (never real).
    Example: budget 2, max_budget 3 -> [-inf, -inf, -inf, inf, inf].
    """
    rows = torch.arange(max_budget + 2, device=device)
    return torch.where(rows <= budget, float("-inf"), float("inf"))


BudgetFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_tree(
    draft_logits: torch.Tensor,
    budget: int | torch.Tensor | BudgetFn,
    max_budget: int | None = None,
    temperature: float = 1.0,
    calibration: torch.Tensor | None = None,
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
        temperature: the distributions are ``softmax(draft_logits / temperature)`` (1.0: the
            drafter's own, DDTree's tree; the transformers engine's ``tree_temperature``, for
            acceptance studies: the plugin calibrates its trees instead, ``calibration``).
        calibration: ``[batch, L, CELLS]`` float32 log-factors of each request's calibration
            (``vllm_ddtree.calibration``): the tree is then the top-B prefixes by calibrated
            acceptance, its scores the log of that, and its :attr:`DraftTree.tops` what the
            calibration learns from once the tree is verified. None: DDTree's tree.

    Returns:
        A :class:`DraftTree` on ``draft_logits.device`` with ``[batch, max_budget]`` fields.

    Everything runs on the logits' device with shapes that depend only on ``(batch, L, vocab,
    max_budget)``: no host synchronisation, so the call can be captured in a CUDA graph.
    NOTE: the first call for a given ``(max_budget, min(max_budget, vocab), L, device)`` builds
    and caches small index tables with device ops: call once before graph capture.

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
    elif isinstance(budget, torch.Tensor):
        if max_budget is None:
            raise ValueError("a tensor budget needs max_budget (the padded width of the tree)")
        if budget.shape != (batch,):
            raise ValueError(f"budget.shape={tuple(budget.shape)}, expected ({batch},)")
        if budget.is_floating_point():
            raise ValueError(f"budget.dtype={budget.dtype}, expected an integer dtype")
    else:
        if max_budget is None:
            max_budget = int(budget)
        if not 0 <= int(budget) <= max_budget:
            raise ValueError(f"budget={budget} must be in [0, max_budget={max_budget}]")
    if max_budget < 1:
        raise ValueError(f"max_budget={max_budget} must be >= 1")
    if depth < 1:
        raise ValueError(f"draft_logits has depth {depth}; a tree needs at least 1 position")
    if calibration is not None and calibration.shape != (batch, depth, CELLS):
        raise ValueError(f"calibration.shape={tuple(calibration.shape)}, expected "
                         f"({batch}, {depth}, {CELLS})")
    num_slots = max_budget
    num_rows = num_slots + 2  # the root, the nodes, the root's copy (see _ancestor_rows)
    k = min(num_slots, vocab)
    ops = cpu_ops(device)
    if ops is not None:  # the fused CPU kernel: the same tree in 3 ops (auto's in 2)
        return _build_tree_fused(draft_logits, budget, budget_fn, num_slots, k, temperature,
                                 calibration, ops.build_tree,
                                 lambda values, ids, fields, budgets: ops.first_nodes(
                                     *fields, budgets),
                                 getattr(budget_fn, "build_budgeted", None))
    if triton_stages(device) and num_slots <= MAX_TRITON_BUDGET:
        # the Triton kernel on CUDA: one launch (two with per-request budgets: the heap runs
        # again, stopping at each request's budget)
        return _build_tree_fused(draft_logits, budget, budget_fn, num_slots, k, temperature,
                                 calibration, build_tree_triton,
                                 lambda values, ids, fields, budgets: build_tree_triton(
                                     values, ids, budgets, num_slots))

    # [batch, L, k] each, ranked (calibrated lists come ranked by their calibrated values)
    top_values, top_ids, tops = (
        (*_ranked_log_probs(draft_logits, k, temperature), None) if calibration is None
        else calibrate_lists(*_top_log_probs(draft_logits, k, temperature), calibration))
    pair_i, pair_j = _candidate_pairs(num_slots, k, device)  # [P] each
    entries = _entries(num_slots, k, depth, device)

    # Per-depth top-B lists, each sorted by (-score, parent position, rank): depth 1 is the
    # ranked list itself (padded with impossible prefixes when the vocabulary is smaller than
    # B), depth d keeps the best B of the candidate pairs extending depth d-1. pair_values[:, 0]
    # holds depth 1's log-probabilities at each pair's parent position (used when k == B: no
    # padding), pair_values[:, d] depth d+1's at each pair's token.
    scores = top_values[:, 0]
    if k < num_slots:
        scores = torch.cat([scores, entries.pad_scores[:, k:].expand(batch, -1)], dim=1)
    level_scores = [scores]  # L x [batch, B] float32 (depth L: [batch, P])
    level_codes = []  # (L - 2) x [batch, B] int64: index into the pair list
    if depth > 1:
        pair_values = top_values.view(batch, depth * k)[:, entries.pair_values]  # [batch, L, P]
    for d in range(1, depth):
        parent_scores = pair_values[:, 0] if d == 1 and k == num_slots else scores[:, pair_i]
        cand = parent_scores + pair_values[:, d]  # [batch, P], P >= B
        if d == depth - 1:
            level_scores.append(cand)  # the deepest depth stays unsorted: see below
            break
        cand, order = cand.sort(dim=-1, descending=True, stable=True)
        scores = cand[:, :num_slots]
        level_scores.append(scores)
        level_codes.append(order[:, :num_slots])

    # Global order: a stable sort of the entries (root, depth-major lists, padding) by score
    # gives the key (-score, depth, position within the depth's list); the root comes first,
    # so the first B + 1 sorted entries are the root and the nodes. Depth L's candidates enter in
    # pair order, which is how its own stable sort would break ties, and one outside depth L's
    # top B has B better entries at its depth before it, so it never becomes a node.
    root_score = entries.root_score.expand(batch, 1)
    pad_score = entries.pad_scores[:, :1].expand(batch, 1)
    entry_scores = torch.cat([root_score, *level_scores, pad_score], dim=1)  # [batch, N]
    sorted_scores, entry_order = entry_scores.sort(dim=-1, descending=True, stable=True)
    node_of_entry = torch.empty_like(entry_order).scatter_(
        1, entry_order, entries.nodes.expand(batch, -1)
    )  # [batch, N]: the inverse permutation, less 1 (the root -> -1)
    entry_codes = torch.cat(
        [entries.head_codes.expand(batch, -1), *level_codes, entries.tail_codes.expand(batch, -1)],
        dim=1,
    )  # [batch, N]

    # Rows: the root, node k at row k + 1, and a copy of the root (for _ancestor_rows). A row
    # is real if it holds a possible prefix (score > -inf) within the request's budget (never
    # the copy); every other row points to the padding entry, whose tables give parent -1 (so
    # the copy points to the root, as the root does), depth 0 and score -inf.
    nodes = slice(1, num_slots + 1)
    row_scores = sorted_scores[:, :num_rows]  # [batch, B + 2]
    if budget_fn is not None:
        node_depths = entries.depths[entry_order[:, nodes]]
        budget = budget_fn(sorted_scores[:, nodes], node_depths)
    if isinstance(budget, torch.Tensor):
        per_request = budget.to(device=device, dtype=torch.int64)
        in_budget = entries.nodes[:num_rows] < per_request[:, None]  # row i holds node i - 1
        real = (row_scores > _row_thresholds(num_slots, num_slots, device)) & in_budget
        node_scores = None  # gathered below: rows past the budget become -inf
    else:
        real = row_scores > _row_thresholds(int(budget), num_slots, device)
        # the whole width: the rows past the possible prefixes are -inf already
        node_scores = sorted_scores[:, nodes] if int(budget) == num_slots else None
    row_entry = torch.where(real, entry_order[:, :num_rows], entry_order.shape[1] - 1)
    if node_scores is None:
        node_scores = entry_scores.gather(1, row_entry[:, nodes])
    entry_info = entries.info[entries.depths, entry_codes]  # [batch, N, 3]
    row_info = entry_info.gather(1, row_entry[:, :, None].expand(-1, -1, 3))  # [batch, B + 2, 3]
    token_index, parent_entry, row_depths = row_info.unbind(-1)
    parent_nodes = node_of_entry.gather(1, parent_entry)  # [batch, B + 2], -1 = the root

    node_tokens = top_ids.view(batch, depth * k).gather(1, token_index[:, nodes])
    return DraftTree(
        token_ids=torch.where(real[:, nodes], node_tokens, PADDING_TOKEN_ID),
        parents=parent_nodes[:, nodes],
        depths=row_depths[:, nodes],
        scores=node_scores,
        num_nodes=real[:, nodes].sum(dim=1),
        ancestor_mask=_ancestor_rows(parent_nodes, depth),
        max_depth=depth,
        tops=tops,
    )


def _calibrated(values: torch.Tensor, token_ids: torch.Tensor,
                calibration: torch.Tensor | None):
    """``(values, token_ids, tops)``: ``[R, L, k]`` ranked lists as the tree build takes them,
    calibrated where ``calibration`` is given (then ``tops`` holds the drafter's own, for the
    calibration to learn from; else None and the lists are returned as they are)."""
    if calibration is None:
        return values, token_ids, None
    return calibrate_lists(values, token_ids, calibration)


def _build_tree_fused(draft_logits: torch.Tensor, budget, budget_fn: BudgetFn | None,
                      max_budget: int, k: int, temperature: float,
                      calibration: torch.Tensor | None, build, keep,
                      build_budgeted=None) -> DraftTree:
    """:func:`build_tree` with a fused op: the ranking and DDTree's best-first heap per request
    in one call, ``build(values, token_ids, budget, max_budget)`` (the CPU op
    ``torch.ops.ddtree.build_tree``, kernels/csrc/ddtree_cpu.cpp, or the Triton kernel
    ``build_tree_triton``). A budget function or tensor builds the full-width tree first, then
    ``keep(values, token_ids, fields, budgets)`` keeps each request's first ``budget[r]`` nodes
    (a best-first prefix is a subtree). ``build_budgeted(values, token_ids, max_budget)``, where
    given, does all three at once (auto's budget function on the CPU,
    :class:`vllm_ddtree.budget.FusedAutoBudgets`)."""
    values, token_ids, tops = _calibrated(*_top_log_probs(draft_logits, k, temperature),
                                          calibration)
    if build_budgeted is not None:  # the budget function's own build (auto on the CPU)
        fields = build_budgeted(values, token_ids, max_budget)
    else:
        width_budget = max_budget if budget_fn is not None or isinstance(budget, torch.Tensor) \
            else int(budget)
        fields = build(values, token_ids, width_budget, max_budget)
        if budget_fn is not None:
            budget = budget_fn(fields[3], fields[2])  # (scores, depths) of the full-width tree
        if isinstance(budget, torch.Tensor):
            budget = budget.to(device=draft_logits.device, dtype=torch.int64)
            fields = keep(values, token_ids, fields, budget)
    token_ids, parents, depths, scores, num_nodes, mask = fields
    return DraftTree(token_ids=token_ids, parents=parents, depths=depths, scores=scores,
                     num_nodes=num_nodes, ancestor_mask=mask, max_depth=draft_logits.shape[1],
                     tops=tops)


@lru_cache(maxsize=64)
def _root_and_self_bits(num_rows: int, device: torch.device) -> torch.Tensor:
    """``[num_rows + 1, ceil(num_rows / 32)]`` int32 packed rows: row i < num_rows has bits 0
    (the root) and i; the extra last row is a copy of the root's (bit 0 only)."""
    rows = torch.arange(num_rows, device=device)
    start = pack_mask((rows[None, :] == rows[:, None]) | (rows[None, :] == 0))
    return torch.cat([start, start[:1]])


def _ancestor_rows(pointers: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Packed ancestor rows ``[batch, B + 1, W]`` by pointer jumping, from ``pointers``
    ``[batch, B + 2]``: the parent node (-1 = the root) of the rows [root, node 0..B-1, root
    again]; the root points to the root, padding nodes hang off the root.

    Row r starts as {root, r} with a jump pointer to its parent; each round ORs in the row at
    the jump pointer and doubles the jump, so after t rounds a row holds the root and its 2^t
    nearest nodes on the path; a path has at most max_depth nodes, hence ceil(log2(max_depth))
    rounds (the last one needs no new jump). A pointer is a node index n, whose row n + 1 is
    read through the view ``rows[:, 1:]``: there -1 wraps around to the last row, the root's
    copy, so no pointer needs shifting.
    Example: a chain root <- 0 <- 1 <- 2, pointers [-1, -1, 0, 1, -1]: after round 1 row 3
    (node 2) = {0, 3, 2}, jump -> node 0; after round 2 row 3 = {0, 3, 2, 1}.
    """
    batch, num_pointers = pointers.shape
    num_rows = num_pointers - 1
    start = _root_and_self_bits(num_rows, pointers.device)  # [B + 2, W]
    mask = start.expand(batch, *start.shape)
    request = cached_arange(batch, pointers.device)[:, None]  # per-request row lookup
    jump = pointers
    rounds = max(max_depth - 1, 0).bit_length()  # 2^rounds >= max_depth
    for round_ in range(rounds):
        if round_:
            jump = jump[:, 1:][request, jump]
        if round_ == rounds - 1:  # the last round writes only the rows of the result
            return mask[:, :num_rows] | mask[:, 1:][request, jump[:, :num_rows]]
        mask = mask | mask[:, 1:][request, jump]
    return mask[:, :num_rows].clone(memory_format=torch.contiguous_format)  # no rounds (L = 1)


def _ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Packed ancestor rows ``[batch, B + 1, W]`` of trees given by ``parents`` ``[batch, B]``
    (-1 = the root; padding too) with at most ``max_depth`` levels.

    Example: parents [-1, 0, 1] (a chain) -> pointers [-1, -1, 0, 1, -1] -> rows {0}, {0, 1},
    {0, 1, 2}, {0, 1, 2, 3} (:func:`_ancestor_rows`).
    """
    pointers = torch.nn.functional.pad(parents, (1, 1), value=-1)  # the root and its copy
    return _ancestor_rows(pointers, max_depth)


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
