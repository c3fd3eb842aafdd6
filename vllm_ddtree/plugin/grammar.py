"""Structured outputs with trees: vLLM's grammar checks, per tree node, in the scheduler.

vLLM's scheduler checks a request's drafts against its grammar as a chain
(``StructuredOutputManager.validate_tokens`` keeps the grammar-valid prefix) and builds one
bitmask row per draft position along that chain (``grammar_bitmask``). A tree's node n extends
its parent's path, not the node before it, so here both follow the tree, with vLLM's own
grammar objects (``accept_tokens`` / ``rollback`` / ``fill_bitmask``: any backend):

1. the worker sends each structured-output request's first L nodes (the grammar work is host
   work per node: L nodes cost what a chain of L drafts costs) with their parents
   (``DraftTokenIds.ddtree_parents``, from ``TreeState.clip_drafts``);
2. :func:`grammar_subtree` (``Scheduler.update_draft_token_ids``) walks the tree depth first,
   accepting each node's token after its parent's path and rolling back: the nodes the grammar
   rejects, and their subtrees, are pruned (the kept nodes, in order, are a subtree: a best-first
   prefix of them is one too). The request's drafts become the kept tokens;
3. the schedule tells the workers which of the sent nodes each scheduled request kept
   (``SchedulerOutput.ddtree_kept``); the worker re-indexes its proposal to them
   (``TreeState.keep_scheduled``), so the verified tree is exactly the scheduled one;
4. :func:`fill_tree_rows` (``grammar_bitmask``) fills node n's row with the grammar state
   after n's path (the row that predicts the token after n), the root's with the current
   state, as vLLM fills a chain's rows; the runner applies the rows to the verify rows, which
   are in the same order;
5. after the walk vLLM advances the grammar by the emitted tokens, as for chains.

A request whose grammar does not constrain its first token yet (reasoning still running:
vLLM's constraint bounds) drafts its tree's most probable path and vLLM checks it as a chain.

Cost: steps 2 and 4 are timed (:class:`GrammarTime`). Each schedule carries the mean seconds
per node (``SchedulerOutput.ddtree_grammar_node_s``) and the seconds spent since the previous
schedule (``ddtree_grammar_s``) to the workers, where the "auto" budget policy counts a node's
grammar cost in the step time of the trees it sizes (``budget.auto_budgets``, ``node_cost``).
"""

from __future__ import annotations

import logging

from vllm_ddtree.plugin.state import best_path

logger = logging.getLogger("vllm.ddtree")

TREE_ATTR = "ddtree_tree"  # on the scheduler's Request: (kept sent-node indices, their parents)
TIME_DECAY = 0.9  # weight of the past in the mean seconds per node, per timed call


class GrammarTime:
    """The scheduler's grammar work on trees (check and bitmask rows), timed: a decaying mean
    of seconds per node, and the seconds spent since the last schedule."""

    def __init__(self):
        self.since_schedule = 0.0
        self._seconds = self._nodes = 0.0

    def add(self, seconds: float, nodes: int) -> None:
        self.since_schedule += seconds
        if nodes:
            self._seconds = TIME_DECAY * self._seconds + seconds
            self._nodes = TIME_DECAY * self._nodes + nodes

    def per_node(self) -> float:
        """Mean seconds per node (0.0 until a tree was timed)."""
        return self._seconds / self._nodes if self._nodes else 0.0

    def take(self) -> float:
        """The seconds spent since the last call (a schedule)."""
        seconds, self.since_schedule = self.since_schedule, 0.0
        return seconds


def grammar_time(manager) -> GrammarTime:
    """The :class:`GrammarTime` of a scheduler's ``StructuredOutputManager``."""
    timer = manager.__dict__.get("_ddtree_grammar_time")
    if timer is None:
        timer = manager._ddtree_grammar_time = GrammarTime()
    return timer


def _children(parents: list[int]) -> tuple[list[int], list[list[int]]]:
    roots, children = [], [[] for _ in parents]
    for node, parent in enumerate(parents):
        (roots if parent < 0 else children[parent]).append(node)
    return roots, children


def constrained_from_start(manager, request) -> bool:
    """Whether the grammar constrains the request's next token (no reasoning left before it)."""
    return manager._get_constraint_bounds(request, ()).constraint_start == 0


def _depth_first(roots: list[int], children: list[list[int]], enter, leave) -> None:
    """Visit the tree (:func:`_children`) depth first: ``enter(node)`` says whether to go below
    ``node`` (then ``leave(node)`` follows its subtree); children in index order."""
    stack = [(node, False) for node in reversed(roots)]
    while stack:
        node, done = stack.pop()
        if done:
            leave(node)
        elif enter(node):
            stack.append((node, True))
            stack.extend((child, False) for child in reversed(children[node]))


def grammar_subtree(manager, request, tokens: list[int], parents: list[int]) -> list[int]:
    """The nodes of the tree ``(tokens, parents)`` that the request's grammar accepts after
    their path (each node's ancestors accepted too), in order. The grammar is left as it was."""
    if not constrained_from_start(manager, request):
        path = best_path(parents, len(tokens))
        valid = manager.validate_tokens(request, [tokens[i] for i in path])
        return path[: len(valid)]
    grammar = request.structured_output_request.grammar
    valid = [False] * len(tokens)

    def enter(node: int) -> bool:
        # validate first: a backend may log every rejected accept as an error (xgrammar does)
        if grammar.is_terminated() or not grammar.validate_tokens([tokens[node]]):
            return False  # pruned with its subtree
        grammar.accept_tokens(request.request_id, [tokens[node]])
        valid[node] = True
        return True

    _depth_first(*_children(parents), enter, lambda node: grammar.rollback(1))
    return [node for node, ok in enumerate(valid) if ok]


def fill_tree_rows(manager, request, tokens: list[int], parents: list[int], base: int) -> None:
    """Rows ``base + 1 + n`` of the manager's bitmask: the grammar state after node n's path
    (``tokens`` / ``parents``: the scheduled nodes). Row ``base`` (the root) is vLLM's. A node
    the grammar rejects (it was checked when it was drafted: unexpected) gets its parent's row
    for its whole subtree, as vLLM's chain fill does after a rejection."""
    bitmask = manager._grammar_bitmask
    grammar = request.structured_output_request.grammar
    roots, children = _children(parents)

    def enter(node: int) -> bool:
        row = base + 1 + node
        if grammar.is_terminated() or not grammar.validate_tokens([tokens[node]]):
            logger.error("ddtree: the grammar rejected draft token %s of request %s while "
                         "filling its bitmask", tokens[node], request.request_id)
            parent_row = base + 1 + parents[node] if parents[node] >= 0 else base
            todo = [node]
            while todo:
                n = todo.pop()
                bitmask[base + 1 + n].copy_(bitmask[parent_row])
                todo.extend(children[n])
            return False
        grammar.accept_tokens(request.request_id, [tokens[node]])
        if grammar.is_terminated():
            bitmask[row].fill_(manager._full_mask)
        else:
            grammar.fill_bitmask(bitmask, row)
        return True

    _depth_first(roots, children, enter, lambda node: grammar.rollback(1))
