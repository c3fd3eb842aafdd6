"""Pipeline parallelism: every stage verifies the same trees and moves its own layers' K/V.

Only the last stage runs the drafter and walks the trees; a stage before it holds the first
layers of the target, so it must (1) attend over the same trees in the verify step and (2)
move its layers' K/V along the accepted path before its next forward, as the last stage does
right after its walk (``compaction.py``). Both come through the scheduler, the only process
that talks to every stage:

* **The trees.** The last stage sends each request's node parents with its drafts
  (``DraftTokenIds.ddtree_parents``); the scheduler keeps them on the request and puts the
  parents of the scheduled nodes on the step's ``SchedulerOutput.ddtree_trees`` (a prefix of
  a best-first tree is a subtree: :func:`scheduled_trees`). A stage records them as the
  request's proposal (:func:`record_trees`) and verifies them exactly as the last stage does.
* **The accepted path.** A stage remembers each tree it verified (:class:`StageMoves`). When the
  request is scheduled again, its computed length ``n`` says how many nodes were accepted
  (``k = n - c - 1`` for a tree verified at computed length ``c``), and the scheduler's
  ``SchedulerOutput.ddtree_recent`` holds the tokens before ``n`` (:func:`recent_tokens`):
  the last ``k`` of them are the accepted path's tokens. Siblings carry distinct tokens, so the
  path is unique (:func:`accepted_nodes`); node ``q_j`` at depth ``j`` moves from position
  ``c + 1 + q_j`` to ``c + j`` in the request's blocks (:meth:`StageMoves.take`).

Example: a tree verified at c = 40 with tokens [5, 7, 9] and parents [-1, -1, 1]; the request
comes back with n = 43, so k = 2 nodes were accepted, and the two tokens before position 43 are
[7, 9]: node 1 (token 7, depth 1) moves from position 42 to 41, node 2 (token 9, depth 2) from
43 to 42.

vLLM's engine core runs the batches of a pipeline one at a time under ddtree
(``patches._wrap_max_concurrent_batches``): its batch queue hands the scheduler a batch's
drafts before that batch's sampled tokens, and a request's next verify step needs both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_ddtree.plugin.state import to_device
from vllm_ddtree.tree import PADDING_TOKEN_ID, DraftTree, _ancestor_mask


def scheduled_trees(requests: dict, spec_tokens: dict[str, list[int]],
                    tree_attr: str) -> dict[str, list[int]]:
    """Scheduler: the parents of each request's scheduled drafts, from the tree the last stage
    sent with them (``tree_attr``: ``(kept nodes, their parents)`` on the request)."""
    trees = {}
    for req_id, tokens in spec_tokens.items():
        if not tokens:
            continue
        tree = getattr(requests.get(req_id), tree_attr, None)
        if tree is None or len(tree[1]) < len(tokens):
            raise RuntimeError(
                f"ddtree: request {req_id} is scheduled {len(tokens)} drafts without the tree "
                "they were drafted in; under pipeline parallelism every draft comes with its "
                "parents (please report this with your vLLM version)")
        trees[req_id] = list(tree[1][: len(tokens)])
    return trees


def recent_tokens(requests: dict, cached_reqs, depth: int
                  ) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Scheduler: each scheduled running request's last ``depth`` tokens before its first
    uncomputed position (``cached_reqs``: the step's ``CachedRequestData``, whose computed
    lengths are those before this step); and each request resumed after preemption, which
    recomputes its K/V, its whole output instead (what a stage's token history needs,
    :func:`complete_histories`)."""
    recent, outputs = {}, {}
    resumed = cached_reqs.resumed_req_ids
    for req_id, computed in zip(cached_reqs.req_ids, cached_reqs.num_computed_tokens):
        request = requests.get(req_id)
        if request is None:
            continue
        if req_id in resumed:
            outputs[req_id] = list(request.output_token_ids)
        else:
            recent[req_id] = request.all_token_ids[max(0, computed - depth): computed]
    return recent, outputs


def complete_histories(requests: dict, cached_reqs, recent: dict[str, list[int]],
                       outputs: dict[str, list[int]]) -> None:
    """A stage before the last, before vLLM updates its requests for the step: each request's
    token history (``CachedRequestState.output_token_ids``) gets the drafts its last verify
    step accepted.

    vLLM's V1 runner keeps a stage's history from the tokens the scheduler sends it under
    pipeline parallelism, the step's first token only, so after a verify step that accepted k
    drafts the history lacks them (the last stage keeps its own). A request resumed after
    preemption is rebuilt from that history: with a hole in it, the stage would recompute its
    K/V from other tokens. Example: a history of 40 tokens, computed length now 43: the last 3
    of ``recent`` complete it (vLLM then appends the step's first token at 43); a resumed
    request's history becomes its whole output."""
    for req_id, computed in zip(cached_reqs.req_ids, cached_reqs.num_computed_tokens):
        state = requests.get(req_id)
        if state is None:
            continue
        if req_id in outputs:
            state.output_token_ids[:] = outputs[req_id]  # in place: the batch may share it
            continue
        missing = computed - state.num_tokens
        if missing <= 0:
            continue
        tokens = recent.get(req_id, ())
        if len(tokens) < missing:
            raise RuntimeError(
                f"ddtree: request {req_id} lacks {missing} tokens of its history on this "
                f"pipeline stage and the scheduler sent {len(tokens)} (please report this)")
        state.output_token_ids.extend(tokens[-missing:])


def record_trees(state, req_ids: list[str], scheduled: list[list[int]],
                 trees: dict[str, list[int]]) -> None:
    """A stage before the last: the scheduled trees become the requests' proposals, sent
    exactly as scheduled (``TreeState.begin_verify`` then reads them as the last stage reads its
    own). ``scheduled``: each request's scheduled drafts; ``trees``: their parents."""
    rows = [(req_id, list(tokens)) for req_id, tokens in zip(req_ids, scheduled) if tokens]
    if not rows:
        return
    width, device = state.budget, state.device
    tokens = np.full((len(rows), width), PADDING_TOKEN_ID, dtype=np.int64)
    parents = np.full((len(rows), width), -1, dtype=np.int64)
    depths = np.zeros((len(rows), width), dtype=np.int64)
    for r, (req_id, drafts) in enumerate(rows):
        tree = trees.get(req_id)
        if tree is None or len(tree) != len(drafts):
            raise RuntimeError(
                f"ddtree: request {req_id} has {len(drafts)} scheduled drafts but the scheduler "
                "sent no tree for them (pipeline parallelism; please report this)")
        m = len(drafts)
        tokens[r, :m] = drafts
        parents[r, :m] = tree
        for i, parent in enumerate(tree):
            if not -1 <= parent < i:
                raise RuntimeError(f"ddtree: request {req_id}'s tree has node {i} under "
                                   f"{parent}: parents must precede their children")
            depths[r, i] = 1 if parent < 0 else depths[r, parent] + 1
    upload = to_device(np.stack([tokens, parents, depths]), torch.int64, device)
    num_nodes = to_device([len(d) for _, d in rows], torch.int64, device)
    real = upload[2] > 0
    tree = DraftTree(
        token_ids=upload[0], parents=upload[1], depths=upload[2],
        scores=torch.zeros(real.shape, device=device).masked_fill_(~real, float("-inf")),
        num_nodes=num_nodes, ancestor_mask=_ancestor_mask(upload[1], state.depth),
        max_depth=state.depth)
    state.record_proposal([req_id for req_id, _ in rows], tree)
    for req_id, drafts in rows:
        state.proposals.sent[req_id] = drafts


def accepted_nodes(tokens: list[int], parents: list[int], path_tokens: list[int]) -> list[int]:
    """The nodes of the accepted path: from the root, the child carrying each token in turn.

    Example: tokens [5, 7, 9], parents [-1, -1, 1], path tokens [7, 9] -> [1, 2]. Raises if a
    token has no such child (the tree is not the one the last stage walked)."""
    path, current = [], -1
    for token in path_tokens:
        child = next((i for i, (t, p) in enumerate(zip(tokens, parents))
                      if p == current and t == token), None)
        if child is None:
            raise RuntimeError(
                "ddtree: the accepted path is not in the tree this pipeline stage verified "
                f"(token {token} under node {current}); the stages' K/V would diverge")
        path.append(child)
        current = child
    return path


@dataclass
class _Verified:
    computed: int  # the request's computed length at the verify step: the root's position
    tokens: list[int]
    parents: list[int]


class StageMoves:
    """A stage before the last: the trees it verified, until their requests' next steps say
    which nodes were accepted (see the module doc)."""

    def __init__(self, depth: int):
        self.depth = depth
        self._verified: dict[str, _Verified] = {}
        self.moved_slots = 0  # K/V positions moved so far (tests, diagnostics)

    def __len__(self) -> int:
        return len(self._verified)

    def verified(self, req_ids: list[str], computed: list[int], scheduled: list[list[int]],
                 trees: dict[str, list[int]]) -> None:
        """Remember the trees of this verify step: request ``req_ids[i]`` verified drafts
        ``scheduled[i]`` (parents ``trees[req_id]``) at computed length ``computed[i]``."""
        for req_id, c, drafts in zip(req_ids, computed, scheduled):
            if drafts:
                self._verified[req_id] = _Verified(int(c), list(drafts), list(trees[req_id]))
            else:
                self._verified.pop(req_id, None)

    def keep_only(self, live_req_ids) -> None:
        for req_id in [r for r in self._verified if r not in live_req_ids]:
            del self._verified[req_id]

    def take(self, cached_reqs, recent: dict[str, list[int]]) -> list[tuple[str, list]]:
        """The K/V moves due before this step's forward: for each scheduled request whose
        previous verify step is known, ``(req_id, pairs)`` with ``pairs[j - 1]`` the (source,
        destination) positions of the accepted node at depth ``j``, or None where it is already
        in place (pairs in depth order, as ``TreeState.finish_verify`` gives the last stage's).
        Requests resumed after preemption recompute their K/V: their trees are dropped."""
        moves = []
        if not self._verified:
            return moves
        for req_id, n in zip(cached_reqs.req_ids, cached_reqs.num_computed_tokens):
            verified = self._verified.pop(req_id, None)
            if verified is None or req_id in cached_reqs.resumed_req_ids:
                continue
            accepted = n - verified.computed - 1
            if not 0 <= accepted <= min(self.depth, len(verified.tokens)):
                raise RuntimeError(
                    f"ddtree: request {req_id} verified a tree at computed length "
                    f"{verified.computed} and came back at {n}: more than its tree could accept")
            if accepted == 0:
                continue
            tokens = recent.get(req_id)
            if tokens is None or len(tokens) < accepted:
                raise RuntimeError(
                    f"ddtree: the scheduler sent no accepted tokens for request {req_id} "
                    "(pipeline parallelism; please report this)")
            path = accepted_nodes(verified.tokens, verified.parents, tokens[-accepted:])
            c = verified.computed
            pairs = [None if node + 1 == depth else (c + 1 + node, c + depth)
                     for depth, node in enumerate(path, start=1)]
            moved = sum(pair is not None for pair in pairs)
            if moved:
                self.moved_slots += moved
                moves.append((req_id, pairs))
        return moves


def move_slots(block_table, req_index: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """K/V slots of ``positions[i]`` of request ``req_index[i]`` (its row in the input batch) in
    one KV-cache group (``block_table``: vLLM's ``BlockTable`` of the group, on the host)."""
    size = block_table.block_size
    blocks = block_table.block_table.np[req_index, positions // size]
    return blocks.astype(np.int64) * size + positions % size


def move_kv(runner, state, scheduler_output) -> None:
    """A pipeline stage before the last: move its layers' K/V along the paths accepted in the
    scheduled requests' previous verify steps, before this step's forward (the module doc).
    Each request's pairs are laid out by depth, L per request, as the last stage's are."""
    moves = state.stage.take(scheduler_output.scheduled_cached_reqs,
                             getattr(scheduler_output, "ddtree_recent", {}))
    if not moves or runner.ddtree_compactor is None:
        return
    depth, num = state.depth, len(moves)
    rows = np.full((2, num * depth), -1, dtype=np.int64)  # src rows, dst rows
    positions = np.zeros((2, num * depth), dtype=np.int64)
    for r, (_, pairs) in enumerate(moves):
        for j, pair in enumerate(pairs):
            if pair is not None:
                k = r * depth + j
                rows[:, k] = (k, num * depth + k)
                positions[:, k] = pair
    index = runner.input_batch.req_id_to_index
    req_of = np.repeat([index[req_id] for req_id, _ in moves], depth)
    slot_mappings = {}
    block_tables = runner.input_batch.block_table
    for group in runner.ddtree_compactor.groups:
        gid = group.group_id
        if gid in slot_mappings:
            continue
        table = block_tables[gid]
        slots = np.concatenate([move_slots(table, req_of, positions[0]),
                                move_slots(table, req_of, positions[1])])
        slot_mappings[gid] = to_device(slots, table.slot_mapping.gpu.dtype, runner.device)
    src, dst = to_device(rows, torch.int64, runner.device).unbind(0)
    runner.ddtree_compactor.compact(src, dst, 2 * num * depth, num, slot_mappings)
