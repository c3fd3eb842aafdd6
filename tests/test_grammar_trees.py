"""Structured outputs with trees (``vllm_ddtree.plugin.grammar``): the scheduler's grammar check
and bitmask rows follow each tree node's path.

Oracle: brute force over explicit paths with a small grammar whose language is known (a
stand-in for vLLM's ``StructuredOutputGrammar``, with its accept / rollback / fill_bitmask /
is_terminated interface): a node is kept iff every prefix of its path is in the language, and
its row allows exactly the tokens that extend its path. Engine-level identity with plain
decoding (xgrammar, chains and branching trees) is in ``test_vllm_features.py``.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from vllm_ddtree.plugin import grammar
from vllm_ddtree.plugin.state import renumbered_parents

VOCAB = 6
END = 5  # terminates the grammar


def allowed_after(path: tuple[int, ...]) -> set[int]:
    """The language: never two equal tokens in a row, token 4 only after token 1, END only
    after at least two tokens; nothing after END."""
    if path and path[-1] == END:
        return set()
    out = set()
    for t in range(VOCAB):
        if path and t == path[-1]:
            continue
        if t == 4 and (not path or path[-1] != 1):
            continue
        if t == END and len(path) < 2:
            continue
        out.add(t)
    return out


class FakeGrammar:
    def __init__(self, prefix=()):
        self.path = list(prefix)
        self.calls = 0

    def accept_tokens(self, request_id, tokens):
        self.calls += 1
        for t in tokens:
            if t not in allowed_after(tuple(self.path)):
                return False
            self.path.append(t)
        return True

    def validate_tokens(self, tokens):  # the valid prefix, the state unchanged
        n = 0
        for t in tokens:
            if not self.accept_tokens("r", [t]):
                break
            n += 1
        self.rollback(n)
        return list(tokens[:n])

    def rollback(self, num_tokens):
        del self.path[len(self.path) - num_tokens:]

    def is_terminated(self):
        return bool(self.path) and self.path[-1] == END

    def fill_bitmask(self, bitmask, index):
        bitmask[index] = 0
        for t in allowed_after(tuple(self.path)):
            bitmask[index, t] = 1


class FakeManager:
    def __init__(self, constrained=True):
        self._grammar_bitmask = torch.full((64, VOCAB), -9, dtype=torch.int32)
        self._full_mask = 7  # "everything allowed"
        self.constrained = constrained

    def _get_constraint_bounds(self, request, spec_tokens):
        return SimpleNamespace(constraint_start=0 if self.constrained else 1)

    def validate_tokens(self, request, tokens):  # vLLM's chain check: the valid prefix
        g = request.structured_output_request.grammar
        n = 0
        for t in tokens:
            if not g.accept_tokens(request.request_id, [t]):
                break
            n += 1
        g.rollback(n)
        return tokens[:n]


def random_tree(rng: random.Random, n: int):
    parents, tokens = [], []
    for node in range(n):
        parent = rng.randrange(-1, node) if node else -1
        siblings = {tokens[i] for i in range(node) if parents[i] == parent}
        choices = [t for t in range(VOCAB) if t not in siblings]
        if not choices:
            parent, choices = -1, [t for t in range(VOCAB)
                                   if t not in {tokens[i] for i in range(node) if parents[i] == -1}]
            if not choices:
                break
        parents.append(parent)
        tokens.append(rng.choice(choices))
    return tokens, parents


def path_of(tokens, parents, node):
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return tuple(reversed(path))


def request_with(prefix):
    return SimpleNamespace(request_id="r", structured_output_request=SimpleNamespace(
        grammar=FakeGrammar(prefix)))


def test_the_kept_nodes_are_the_grammar_valid_subtree_and_the_rows_follow_each_path():
    rng = random.Random(0)
    checked = pruned = 0
    for case in range(200):
        tokens, parents = random_tree(rng, rng.randrange(1, 20))
        prefix = [(), (1,), (2, 3)][case % 3]
        request = request_with(prefix)
        manager = FakeManager()
        kept = grammar.grammar_subtree(manager, request, tokens, parents)
        assert request.structured_output_request.grammar.path == list(prefix)  # rolled back
        want = [n for n in range(len(tokens))
                if all(path_of(tokens, parents, n)[i] in allowed_after(
                    prefix + path_of(tokens, parents, n)[:i])
                    for i in range(len(path_of(tokens, parents, n))))]
        assert kept == want
        pruned += len(tokens) - len(kept)
        # the rows of the kept subtree (parents renumbered), after the root row at base
        sub_tokens = [tokens[n] for n in kept]
        sub_parents = renumbered_parents(parents, kept)
        base = 3
        grammar.fill_tree_rows(manager, request, sub_tokens, sub_parents, base)
        assert request.structured_output_request.grammar.path == list(prefix)
        for i, n in enumerate(kept):
            path = prefix + path_of(tokens, parents, n)
            row = manager._grammar_bitmask[base + 1 + i]
            if path[-1] == END:
                assert (row == 7).all()  # terminated: vLLM's full mask
            else:
                assert set(row.nonzero().flatten().tolist()) == allowed_after(path)
            checked += 1
    assert checked > 500 and pruned > 200


def test_a_rejected_node_copies_its_parents_row_to_its_subtree():
    tokens, parents = [0, 1, 1, 2], [-1, 0, 1, 2]  # 1 -> 1 is not in the language
    manager = FakeManager()
    manager._grammar_bitmask[0] = 3  # the root row, vLLM's
    grammar.fill_tree_rows(manager, request_with(()), tokens, parents, 0)
    rows = manager._grammar_bitmask
    assert torch.equal(rows[3], rows[2]) and torch.equal(rows[4], rows[2])
    assert set(rows[2].nonzero().flatten().tolist()) == allowed_after((0, 1))


def test_unconstrained_first_token_checks_the_best_path_as_a_chain():
    """Reasoning still running (vLLM's constraint bounds): the tree's most probable path,
    checked by vLLM's chain validation."""
    tokens, parents = [0, 2, 1, 1, 3], [-1, -1, 0, 2, 0]  # best path 0 -> 1 (node 2) -> 1
    kept = grammar.grammar_subtree(FakeManager(constrained=False), request_with(()), tokens,
                                   parents)
    assert kept == [0, 2]  # 0, 1, then 1 again is rejected
