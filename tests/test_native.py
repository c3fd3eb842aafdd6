"""The fused CPU kernels (kernels/csrc/ddtree_cpu.cpp) against their torch twins.

Every op runs twice on the same inputs: once through the package's dispatch with the kernels
enabled, once with ``VLLM_DDTREE_NATIVE=0`` (the torch path, the oracle), and the results
must be equal bit for bit (``torch.equal``). Where a second, independent oracle exists it is
checked too: the plain heap of :func:`reference_build_tree` for trees, the ancestor rows
recomputed from the parents by pointer jumping over all B levels (``_ancestor_mask(parents,
B)``) for masks, and hand-computed moves for ``finish_verify``.

The first test in a process builds the kernels (~20-40 s the very first time, cached after).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tree_utils import (
    TREE_FIELDS,
    assert_verdicts_equal,
    chain_trees,
    hand_tree,
    moves_by_hand,
    path_samples,
    random_logits,
)

import vllm_ddtree.tree as tree_module
from vllm_ddtree.kernels.native import cpu_ops
from vllm_ddtree.plugin.options import DDTreeOptions
from vllm_ddtree.plugin.state import TreeState, VerifyBatch, best_path
from vllm_ddtree.tree import DraftTree, _ancestor_mask, build_tree, reference_build_tree
from vllm_ddtree.walk import walk



@pytest.fixture
def native(monkeypatch):
    """The op namespace (the suite's machines build it: a failed build fails here).
    ``native.on()`` / ``native.off()`` switch every caller between the fused and torch paths
    (restored after the test)."""
    monkeypatch.setenv("VLLM_DDTREE_NATIVE", "1")
    ops = cpu_ops("cpu")
    if ops is None:
        pytest.fail("the fused CPU kernels could not be built on this machine (see the "
                    "warning of vllm_ddtree.kernels.native)")

    def switch(on: bool):
        monkeypatch.setenv("VLLM_DDTREE_NATIVE", "1" if on else "0")
        assert (cpu_ops("cpu") is not None) == on

    return SimpleNamespace(ops=ops, on=lambda: switch(True), off=lambda: switch(False))


def both_paths(native, fn):
    """``(fn() with the fused kernels, fn() on the torch path)``. The drafter's top-k
    log-probabilities (``_top_log_probs``) enter the torch path as the fused run computed them:
    ``top_log_probs_`` equals its torch path to ~1e-6, not bit for bit (its own exp;
    :func:`test_top_log_probs_equals_the_torch_path`), so every later stage is compared bit for
    bit on the same inputs."""
    real = tree_module._top_log_probs
    seen = []

    def recording(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    native.on()
    tree_module._top_log_probs = recording
    try:
        fused = fn()
        native.off()
        replay = iter(seen)
        tree_module._top_log_probs = lambda *args, **kwargs: next(replay)
        torch_path = fn()
    finally:
        tree_module._top_log_probs = real
        native.on()
    return fused, torch_path


def assert_trees_equal(got: DraftTree, want: DraftTree, what: str = "") -> None:
    for name in TREE_FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (what, name, a.dtype, b.dtype,
                                                           a.shape, b.shape)
        assert torch.equal(a, b), f"{what}: DraftTree.{name} differs\nfused {a}\ntorch {b}"
    assert got.max_depth == want.max_depth, what


# ----------------------------------------------------------------------------------- cpu_ops


def test_cpu_ops_only_for_the_cpu_and_only_when_enabled(native, monkeypatch):
    assert native.ops is torch.ops.ddtree
    assert cpu_ops("cpu") is torch.ops.ddtree
    assert cpu_ops(torch.device("cpu")) is torch.ops.ddtree
    for device in ("meta", "cuda", "cuda:0", torch.device("meta")):
        assert cpu_ops(device) is None, device
    for off in ("0", "false", "False"):
        monkeypatch.setenv("VLLM_DDTREE_NATIVE", off)
        assert cpu_ops("cpu") is None, off
    monkeypatch.setenv("VLLM_DDTREE_NATIVE", "1")
    assert cpu_ops("cpu") is torch.ops.ddtree


def test_a_compiler_without_openmp_still_builds_the_kernels(monkeypatch):
    """The first build asks for -fopenmp; where the compiler refuses it, the kernels are built
    without (single-threaded), not dropped; where both builds fail, the torch path serves."""
    import torch.utils.cpp_extension as cpp_extension

    from vllm_ddtree.kernels import native

    calls = []

    def load(**kwargs):
        calls.append(kwargs["extra_cflags"])
        if "-fopenmp" in kwargs["extra_cflags"]:
            raise RuntimeError("clang: error: unsupported option '-fopenmp'")

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(native, "_state", {})
    assert native._load() is torch.ops.ddtree
    assert calls == [["-O3", "-fopenmp"], ["-O3"]]

    def no_compiler(**kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(native, "_state", {})
    assert native._load() is None and "no C++ compiler" in str(native._state["error"])


# -------------------------------------------------------------------------------- build_tree


@pytest.mark.parametrize("B,L", list(itertools.product([1, 4, 16, 64, 300], [1, 2, 5, 8])))
def test_build_tree_equals_the_torch_path_and_the_heap(native, B, L):
    gen = torch.Generator().manual_seed(1000 * B + L)
    vocabs = sorted({max(2, B // 3), 2 * B + 5})  # fewer tokens than B (padding), and more
    for vocab, kind in itertools.product(vocabs, ("randn", "ties", "zeros", "bf16")):
        batch = int(torch.randint(1, 5, (1,), generator=gen))
        logits = random_logits(kind, batch, L, vocab, gen)
        case = f"B={B} L={L} vocab={vocab} {kind} batch={batch}"
        for budget in sorted({B, B // 2, 1, 0}):
            fused, ref = both_paths(native, lambda: build_tree(logits, budget, B))
            assert_trees_equal(fused, ref, f"{case} budget={budget}")
            assert torch.equal(fused.ancestor_mask, _ancestor_mask(fused.parents, B)), case
            assert (fused.num_nodes <= budget).all()
            # the plain heap, with the same top-k width (with ties, which of the tied tokens
            # enter the top-k depends on k; k = min(max_budget, vocab) in build_tree)
            if budget == 0:  # build_tree needs max_budget >= 1
                assert (fused.num_nodes == 0).all()
                continue
            narrow = build_tree(logits, budget)  # max_budget = budget
            heap = reference_build_tree(logits, budget)
            for r in range(batch):
                n = int(narrow.num_nodes[r])
                got = {"token_ids": narrow.token_ids[r, :n].tolist(),
                       "parents": narrow.parents[r, :n].tolist(),
                       "depths": narrow.depths[r, :n].tolist(),
                       "scores": narrow.scores[r, :n].tolist()}
                assert got == heap[r], f"{case} budget={budget} request {r}"
                if kind == "randn" or budget == B:  # no tie at the top-k boundary
                    assert int(fused.num_nodes[r]) == n, case
                    for name in TREE_FIELDS[:4]:
                        assert torch.equal(getattr(fused, name)[r, :n],
                                           getattr(narrow, name)[r, :n]), (case, name)
        # per-request budgets as a tensor (int64 and int32), each in [0, B]
        for dtype in (torch.int64, torch.int32):
            budgets = torch.randint(0, B + 1, (batch,), generator=gen).to(dtype)
            fused, ref = both_paths(native, lambda: build_tree(logits, budgets, B))
            assert_trees_equal(fused, ref, f"{case} budgets={budgets.tolist()}")
            full = build_tree(logits, B)
            assert torch.equal(fused.num_nodes, torch.minimum(budgets.long(), full.num_nodes))


@pytest.mark.parametrize("B,L,vocab,kind", [(16, 3, 9, "ties"), (64, 5, 40, "zeros"),
                                            (300, 8, 700, "randn"), (4, 1, 3, "zeros")])
def test_build_tree_budget_function(native, B, L, vocab, kind):
    """The budget function sees the full-width tree's best-first (scores, depths) on both
    paths: the same scores, the same depths wherever the score is > -inf (the torch path's
    depths of impossible prefixes are meaningless; the fused path's are 0), and the trees cut
    to its budgets are equal."""
    gen = torch.Generator().manual_seed(B + L)
    logits = random_logits(kind, 4, L, vocab, gen)
    seen = []

    def budget_fn(scores, depths):
        seen.append((scores.clone(), depths.clone()))
        # data-dependent: the nodes above a probability, less one per two possible depth-1
        # prefixes (the depths of impossible prefixes, score -inf, are not part of the contract)
        possible = scores > float("-inf")
        return (scores > -4.0).sum(dim=1) - ((depths == 1) & possible).sum(dim=1) // 2

    fused, ref = both_paths(native, lambda: build_tree(logits, budget_fn, B))
    assert len(seen) == 2
    (s_fused, d_fused), (s_torch, d_torch) = seen
    assert s_fused.dtype == s_torch.dtype == torch.float32 and s_fused.shape == (4, B)
    assert d_fused.dtype == d_torch.dtype == torch.int64 and d_fused.shape == (4, B)
    assert torch.equal(s_fused, s_torch)
    possible = s_fused > float("-inf")
    assert torch.equal(torch.where(possible, d_fused, 0), torch.where(possible, d_torch, 0))
    assert (d_fused[~possible] == 0).all()
    full = build_tree(logits, B)
    assert torch.equal(s_fused, full.scores) and torch.equal(d_fused, full.depths)
    assert_trees_equal(fused, ref, f"budget fn B={B} L={L}")
    budgets = budget_fn(s_fused, d_fused)
    assert torch.equal(fused.num_nodes, budgets.clamp(min=0).minimum(full.num_nodes))


# ----------------------------------------------------------------------- top_k_, argmax_rows


def _rows(kind: str, n: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "randn":
        return torch.randn(n, vocab, generator=gen)
    if kind == "ties":  # few distinct values: ties everywhere, across any top-k boundary
        return torch.randint(-3, 3, (n, vocab), generator=gen).float()
    if kind == "inf":  # banned tokens (-inf), a row of nothing but -inf, a +inf
        rows = torch.randn(n, vocab, generator=gen)
        rows[rows < 0.3] = float("-inf")
        rows[0] = float("-inf")
        rows[-1, vocab // 2] = float("inf")
        return rows
    rows = torch.randn(n, vocab, generator=gen)  # "nan": NaN early, late and twice in a row
    rows[0, vocab - 1] = float("nan")
    rows[-1, 0] = rows[-1, vocab // 3] = float("nan")
    return rows


@pytest.mark.parametrize("vocab", [1, 5, 8, 9, 100, 4096])
@pytest.mark.parametrize("kind", ["randn", "ties", "inf", "nan"])
def test_top_k_equals_torch_topk(native, vocab, kind):
    """``top_k_`` gives torch.topk's values (sorted, bit for bit) and ids; where a tie crosses
    the top-k boundary it says so (the caller then runs torch.topk), and its ids are the
    lowest of the tied ones."""

    gen = torch.Generator().manual_seed(vocab)
    rows = _rows(kind, 6, vocab, gen)
    for k in sorted({1, min(3, vocab), min(16, vocab), vocab}):
        values = torch.empty(6, k)
        ids = torch.empty(6, k, dtype=torch.int64)
        tied = native.ops.top_k_(values, ids, rows)
        want_values, _ = torch.topk(rows, k, dim=-1)
        assert torch.equal(values, want_values) or torch.allclose(
            values, want_values, equal_nan=True, rtol=0, atol=0), (kind, k)
        # the oracle: a stable sort by (value desc, id asc), NaN first
        key = torch.where(rows.isnan(), float("inf"), rows)
        order = torch.sort(-key, dim=-1, stable=True).indices[:, :k]
        assert torch.equal(ids, order), (kind, k)
        last = key.gather(1, order[:, -1:])
        crossing = bool(((key == last).sum(1) > (key.gather(1, order) == last).sum(1)).any())
        assert tied == crossing, (kind, k)
        if kind == "randn":
            assert not tied


@pytest.mark.parametrize("vocab", [1, 5, 8, 9, 100, 4096])
@pytest.mark.parametrize("kind", ["randn", "ties", "inf", "nan"])
@pytest.mark.parametrize("temperature", [1.0, 0.85])
def test_top_log_probs_equals_the_torch_path(native, vocab, kind, temperature):
    """``_top_log_probs`` on the CPU (the fused ``top_log_probs_``) against its torch path
    (log-softmax, then torch.topk): the same token ids, the values within 2e-6 (the op's own
    exp). Where the op declines (a NaN, a row with no finite logit, a tie of the k-th value with
    the next: torch.topk's choice) the torch path runs, and the two are equal bit for bit."""
    gen = torch.Generator().manual_seed(vocab)
    logits = _rows(kind, 6, vocab, gen).mul(4).view(2, 3, vocab)
    for k in sorted({1, min(3, vocab), min(16, vocab), vocab}):
        values, ids = torch.empty(6, k), torch.empty(6, k, dtype=torch.int64)
        declined = native.ops.top_log_probs_(values, ids, logits.flatten(0, 1), temperature)
        if kind == "randn":
            assert not declined
        if kind in ("inf", "nan"):  # a row of -inf or +inf, a NaN
            assert declined
        native.on()
        fused = tree_module._top_log_probs(logits, k, temperature)
        native.off()
        torch_path = tree_module._top_log_probs(logits, k, temperature)
        native.on()
        # (a row of -inf or with a NaN has NaN log-probabilities; equal values in any order)
        atol = 0.0 if declined else 2e-6
        torch.testing.assert_close(fused[0], torch_path[0], rtol=0, atol=atol, equal_nan=True)
        assert torch.equal(fused[1].sort(-1).values, torch_path[1].sort(-1).values), (kind, k)
        if not declined:  # what the op wrote is what _top_log_probs returned
            assert torch.equal(values.view(2, 3, k), fused[0])


def test_top_log_probs_declines_a_largest_logit_that_overflows(native):
    """A finite logit that ``/ temperature`` takes past float32's range: the op declines, and
    ``_top_log_probs`` is the torch path's (NaN for that row, as log_softmax gives)."""
    logits = torch.tensor([[[1e38, 0.0, -1.0, 2.0]]])
    values, ids = torch.empty(1, 2), torch.empty(1, 2, dtype=torch.int64)
    assert native.ops.top_log_probs_(values, ids, logits.flatten(0, 1), 0.01)
    fused = tree_module._top_log_probs(logits, 2, 0.01)
    native.off()
    torch_path = tree_module._top_log_probs(logits, 2, 0.01)
    native.on()
    torch.testing.assert_close(fused[0], torch_path[0], rtol=0, atol=0, equal_nan=True)


def test_top_log_probs_refuses_bad_arguments(native):
    with pytest.raises(RuntimeError, match="float32"):
        native.ops.top_log_probs_(torch.empty(2, 2), torch.empty(2, 2, dtype=torch.int64),
                                  torch.randn(2, 4, dtype=torch.bfloat16), 1.0)
    with pytest.raises(RuntimeError, match="temperature"):
        native.ops.top_log_probs_(torch.empty(2, 2), torch.empty(2, 2, dtype=torch.int64),
                                  torch.randn(2, 4), 0.0)


def test_top_k_refuses_bad_arguments(native):
    with pytest.raises(RuntimeError, match="0 < k <= V"):
        native.ops.top_k_(torch.empty(2, 5), torch.empty(2, 5, dtype=torch.int64),
                          torch.randn(2, 4))
    with pytest.raises(RuntimeError, match="float32"):
        native.ops.top_k_(torch.empty(2, 2), torch.empty(2, 2, dtype=torch.int64),
                          torch.randn(2, 4, dtype=torch.float64))


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 31, 100, 4096])
@pytest.mark.parametrize("kind", ["randn", "ties", "inf", "nan"])
def test_argmax_rows_equals_torch_argmax(native, vocab, kind):
    """``argmax_rows`` equals ``torch.argmax(dim=-1)`` (the first largest value, the first NaN)
    on contiguous and row-strided float32 rows, and ``sampling.argmax_rows`` takes it on the
    CPU (float32) and torch's argmax otherwise."""
    from vllm_ddtree.sampling import argmax_rows

    gen = torch.Generator().manual_seed(7 * vocab)
    rows = _rows(kind, 20, vocab, gen)
    if kind == "nan" and vocab > 16:  # a NaN in the vector part only, after the first lanes
        rows[1, 9] = float("nan")
    assert torch.equal(native.ops.argmax_rows(rows), rows.argmax(dim=-1)), kind
    wide = torch.cat([rows, torch.full((20, 3), 1e9)], dim=1)[:, :vocab]  # strided rows
    assert torch.equal(native.ops.argmax_rows(wide), rows.argmax(dim=-1)), kind
    assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1))
    for other in (rows.double(), rows.bfloat16()):  # the torch path
        assert torch.equal(argmax_rows(other), other.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="float32"):
        native.ops.argmax_rows(rows.double())


# -------------------------------------------------------------------------------------- walk


@pytest.mark.parametrize("B,L,vocab", [(1, 1, 3), (4, 2, 3), (16, 5, 6), (64, 8, 5),
                                       (300, 8, 40), (40, 3, 500)])
def test_walk_equals_the_torch_path(native, B, L, vocab):
    gen = torch.Generator().manual_seed(7 * B + L)
    for kind in ("ties", "zeros", "randn"):
        logits = random_logits(kind, 4, L, vocab, gen)
        budgets = torch.tensor([B, 0, max(B // 3, 1), B])  # request 1: no nodes
        tree = build_tree(logits, budgets, B)
        for follow in (True, True, False):
            sampled = path_samples(tree, vocab, gen, follow)
            fused, ref = both_paths(native, lambda: walk(tree, sampled))
            assert_verdicts_equal(fused, ref, f"B={B} L={L} {kind} follow={follow}")
            assert fused.num_accepted[1] == 0 and fused.bonus_token[1] == sampled[1, 0]
            # int32 samples are accepted too
            again = walk(tree, sampled.int())
            assert_verdicts_equal(again, fused, "int32 samples")
            # the first nodes of each request: strided views of the tree and of the samples
            for width in sorted({0, 1, B // 2, B}):
                sub = tree.first_nodes(width)
                if width and width < B:
                    assert not sub.token_ids.is_contiguous()
                sub_sampled = sampled[:, : width + 1]
                fused, ref = both_paths(native, lambda: walk(sub, sub_sampled))
                assert_verdicts_equal(fused, ref, f"B={B} L={L} {kind} width={width}")


def test_walk_chains_and_empty_rows(native):
    """Chains (node k hangs off k - 1), cut at various lengths, and rows with no nodes."""
    gen = torch.Generator().manual_seed(11)
    width = 9
    tree, whole = chain_trees(gen, width)
    for trial in range(20):
        sampled = path_samples(tree, 3, gen, follow=trial % 4 != 3)
        if trial == 0:  # every chain accepted whole
            sampled = whole
        fused, ref = both_paths(native, lambda: walk(tree, sampled))
        assert_verdicts_equal(fused, ref, f"chains, trial {trial}")
        if trial == 0:
            assert fused.num_accepted.tolist() == [9, 5, 0, 1, 9, 3]
        # vLLM's layout of the output: narrower, as wide and wider than the L + 1 columns
        for out_width in (4, width + 1, width + 3):
            fused, ref = both_paths(native, lambda: walk(tree, sampled, out_width))
            assert fused.sampled_token_ids.dtype == ref.sampled_token_ids.dtype == torch.int32
            assert torch.equal(fused.sampled_token_ids, ref.sampled_token_ids), out_width
            keep = min(out_width, width + 1)
            assert torch.equal(fused.sampled_token_ids[:, :keep].long(),
                               fused.output_tokens[:, :keep])
            assert bool((fused.sampled_token_ids[:, keep:] == -1).all())
    empty = hand_tree([[-1] * 4] * 2, [[-1] * 4] * 2, max_depth=3)
    sampled = torch.randint(0, 5, (2, 5), generator=gen)
    fused, ref = both_paths(native, lambda: walk(empty, sampled))
    assert_verdicts_equal(fused, ref, "no nodes")
    assert fused.num_accepted.tolist() == [0, 0]
    assert fused.output_tokens[:, 0].tolist() == sampled[:, 0].tolist()


def test_walk_refuses_a_parent_after_its_child(native):
    # node 0 hangs off node 1: not in an order where parents precede their children
    tree = DraftTree(token_ids=torch.tensor([[3, 4]]), parents=torch.tensor([[1, -1]]),
                     depths=torch.tensor([[2, 1]]), scores=torch.zeros(1, 2),
                     num_nodes=torch.tensor([2]),
                     ancestor_mask=torch.tensor([[[1], [7], [5]]], dtype=torch.int32),
                     max_depth=2)
    with pytest.raises(RuntimeError, match="parents must precede"):
        walk(tree, torch.tensor([[4, 0, 3]]))
    with pytest.raises(RuntimeError, match="parents must precede"):  # a self-loop
        native.ops.walk(torch.tensor([[3]]), torch.tensor([[0]]), torch.tensor([[3, 3]]), 1, 0)


# ----------------------------------------------------------------------------- finish_verify


@pytest.mark.parametrize("B,L", [(12, 4), (64, 8), (5, 1)])
def test_finish_verify_equals_the_torch_path(native, B, L):
    """Several requests with unequal draft counts (some none, one with extra rows: a chunk of
    prefill after its drafts), the verdict of a walk that follows random tree paths."""
    gen = torch.Generator().manual_seed(B * L)
    num_draft = [B, 0, 3 if B > 3 else 1, 0, B // 2, 1]
    extra = [0, 0, 0, 6, 0, 2]  # rows past the verify span (e.g. prefill)
    batch = len(num_draft)
    state = TreeState(DDTreeOptions(budget=B, depth=L), torch.device("cpu"))
    total_moved = 0
    for trial in range(4):
        tree = build_tree(random_logits("ties", batch, L, 5, gen), torch.tensor(num_draft), B)
        num_draft = tree.num_nodes.tolist()
        sizes = [m + 1 + e for m, e in zip(num_draft, extra)]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
        num_tokens = sum(sizes) + 3  # and a few rows of no request (padding)
        state.verify = VerifyBatch(tree=tree, num_draft=num_draft, query_start=starts,
                                   num_tokens=num_tokens, matched=torch.ones(batch, dtype=bool),
                                   starts=torch.tensor(starts))
        verdict = walk(tree, path_samples(tree, 5, gen, follow=trial != 3))

        def finish():
            before = state.num_compacted_slots
            src, dst = state.finish_verify(verdict)
            return src, dst, state.gather_index, state.num_compacted_slots - before

        (src, dst, gather, moved), (src_t, dst_t, gather_t, moved_t) = both_paths(native, finish)
        case = f"B={B} L={L} trial {trial} rows {verdict.accepted_rows.tolist()}"
        for a, b in ((src, src_t), (dst, dst_t), (gather, gather_t)):
            assert a.dtype == b.dtype == torch.int64 and a.shape == b.shape, case
            assert torch.equal(a, b), f"{case}\nfused {a}\ntorch {b}"
        assert moved == moved_t, case
        want = moves_by_hand(verdict.accepted_rows, starts, num_tokens)
        assert (src.tolist(), dst.tolist(), gather.tolist(), moved) == want, case
        assert state.take_gather_index(num_tokens) is not None
        total_moved += moved
    assert total_moved > 0 or L == 1  # at L = 1 the one accepted node is in place already


def test_finish_verify_docstring_example(native):
    """Rows start at 40, accepted nodes [0, 3, 7] -> src [-1, 44, 48], dst [-1, 42, 43]."""
    state = TreeState(DDTreeOptions(budget=8, depth=3), torch.device("cpu"))
    verdict = SimpleNamespace(accepted_rows=torch.tensor([[0, 1, 4, 8]]))
    state.verify = SimpleNamespace(num_tokens=60, starts=torch.tensor([40]))

    def finish():
        src, dst = state.finish_verify(verdict)
        return src.tolist(), dst.tolist(), state.gather_index[40:44].tolist()

    fused, ref = both_paths(native, finish)
    assert fused == ref == ([-1, 44, 48], [-1, 42, 43], [40, 41, 44, 48])
    assert state.num_compacted_slots == 4  # two moves per path


# ------------------------------------------------------------------------------- copy_slots_


def layouts_of(caches, isa):
    """vLLM's slot layout of each cache (learned from vLLM's writer, shared by the caches of
    one configuration), each remembering its cache's shape."""
    from vllm_ddtree.plugin.cpu_attention import cpu_kv_layout

    layouts = [cpu_kv_layout(cache, isa) for cache in caches]
    for layout, cache in zip(layouts, caches):
        layout.shape = cache.shape
    return layouts


def copy_both_ways(native, layouts, slot_mapping, src_rows, dst_rows):
    """The caches after ``copy_slots_`` (one call per distinct slot layout, as KVCompactor
    groups them) and after ``copy_cpu_slots`` (skipped pairs as null-slot self-copies, as
    KVCompactor.compact does), each from a copy of the caches."""
    from vllm_ddtree.plugin.cpu_attention import NULL_SLOT, CPUKVLayout, copy_cpu_slots

    results = []
    for fused in (True, False):
        copies = [CPUKVLayout(layout.flat.clone().view(layout.shape), layout.offsets)
                  for layout in layouts]
        if fused:
            shared: dict[int, tuple] = {}
            for copy in copies:
                entry = shared.setdefault(id(copy.offsets), ([], copy.offsets.contiguous(),
                                                             copy.slot_stride))
                entry[0].append(copy.flat)
            for flats, offsets, stride in shared.values():
                native.ops.copy_slots_(flats, offsets, stride, slot_mapping, src_rows, dst_rows)
        else:
            skip = torch.minimum(src_rows, dst_rows) < 0
            slots = slot_mapping[torch.stack((src_rows, dst_rows))].masked_fill_(skip, NULL_SLOT)
            copy_cpu_slots(copies, slots)
        results.append([copy.flat for copy in copies])
    return results


def random_cache(num_blocks, nkv, bs, d, dtype, gen):
    return torch.randn(num_blocks, nkv, bs, 2 * d, generator=gen).to(dtype)


def overlapping_pairs(num_rows: int, gen: torch.Generator):
    """Query-row pairs (src, dst) with distinct destinations: chains shifting down by one and
    two rows (row i + 1 -> i while i + 2 -> i + 1, ...), a swap, a self-copy, pairs with -1
    on either side, and random moves."""
    src = [5, 6, 7, 8, 20, 22, 24, 30, 31, 3, -1, 40, -1, 12, 50]
    dst = [4, 5, 6, 7, 18, 20, 22, 31, 30, 3, 41, -1, -1, 11, 49]
    free = [r for r in range(num_rows) if r not in dst]
    pick = torch.randperm(len(free), generator=gen)[:10].tolist()
    for k in pick:
        dst.append(free[k])
        src.append(int(torch.randint(0, num_rows, (1,), generator=gen)))
    return torch.tensor(src), torch.tensor(dst)


@pytest.mark.parametrize("isa,dtype,bs,nkv,d", [("vec", torch.float32, 16, 2, 32),
                                                ("vec", torch.bfloat16, 32, 1, 64),
                                                ("vec16", torch.float32, 16, 2, 48)])
def test_copy_slots_equals_copy_cpu_slots(native, isa, dtype, bs, nkv, d):
    gen = torch.Generator().manual_seed(bs + d)
    num_blocks, num_rows = 8, 64
    owned = bs + torch.randperm((num_blocks - 1) * bs, generator=gen)  # block 0: null block
    slot_mapping = owned[:num_rows].contiguous()
    caches = [random_cache(num_blocks, nkv, bs, d, dtype, gen) for _ in range(3)]
    layouts = layouts_of(caches, isa)
    assert len({id(layout.offsets) for layout in layouts}) == 1  # one shared layout
    for trial in range(3):
        src, dst = overlapping_pairs(num_rows, gen)
        fused, ref = copy_both_ways(native, layouts, slot_mapping, src, dst)
        for i, (a, b, before) in enumerate(zip(fused, ref, (lay.flat for lay in layouts))):
            assert not torch.equal(a, before), "nothing moved"
            assert torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), \
                f"{isa} {dtype} cache {i} trial {trial}"
    # only -1 pairs, or none: nothing changes
    for src, dst in ((torch.tensor([-1, 3, -1]), torch.tensor([4, -1, -1])),
                     (torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))):
        fused, ref = copy_both_ways(native, layouts, slot_mapping, src, dst)
        for a, b, before in zip(fused, ref, (lay.flat for lay in layouts)):
            assert torch.equal(a, before) and torch.equal(b, before)


def test_copy_slots_two_layouts_and_one_byte_elements(native):
    """Caches of two slot layouts in one list each (KVCompactor makes one call per layout),
    and a 1-byte cache on a float32 layout's offsets (element size 1)."""
    from vllm_ddtree.plugin.cpu_attention import CPUKVLayout

    gen = torch.Generator().manual_seed(5)
    num_blocks, num_rows = 6, 64
    a = layouts_of([random_cache(num_blocks, 2, 16, 32, torch.float32, gen) for _ in range(2)],
                   "vec")
    b = layouts_of([random_cache(num_blocks, 1, 16, 48, torch.float32, gen)], "vec16")
    bytes_cache = torch.randint(0, 256, (num_blocks, 2, 16, 64), generator=gen,
                                dtype=torch.uint8)
    c = [CPUKVLayout(bytes_cache, a[0].offsets.clone())]  # same offsets, another tensor
    c[0].shape = bytes_cache.shape
    owned = 16 + torch.randperm((num_blocks - 1) * 16, generator=gen)
    slot_mapping = owned[:num_rows].contiguous()
    src, dst = overlapping_pairs(num_rows, gen)
    for layouts in (a + b, c):
        fused, ref = copy_both_ways(native, layouts, slot_mapping, src, dst)
        for x, y in zip(fused, ref):
            assert torch.equal(x, y)


def test_copy_slots_refuses_bad_input(native):
    offsets = torch.zeros(4, 8, dtype=torch.long)
    cache = torch.zeros(64, dtype=torch.float64)
    rows = torch.tensor([0])
    with pytest.raises(RuntimeError, match="unsupported element size"):
        native.ops.copy_slots_([cache], offsets, 8, torch.tensor([1, 2]), rows, rows + 1)
    with pytest.raises(RuntimeError, match="row out of range"):
        native.ops.copy_slots_([cache.float()], offsets, 8, torch.tensor([1, 2]), rows,
                               rows + 2)


# ---------------------------------------------------------------------------- proposal store


def request(num_prompt, num_out, max_tokens, structured=False):
    params = SimpleNamespace(max_tokens=max_tokens)
    if structured:
        params.structured_outputs = object()
    return SimpleNamespace(num_tokens=num_prompt + num_out, output_token_ids=[0] * num_out,
                           sampling_params=params)


def verify_step(state: TreeState, req_ids, tree, requests, extra_rows=(), keep=None):
    """record_proposal -> clip_drafts -> (``keep``: the scheduler's grammar cut, ``keep(trees)``
    -> kept node indices per structured request) -> begin_verify (exact, with token rows) ->
    walk -> finish_verify, as the runner drives them. Returns what each stage produced."""
    state.record_proposal(req_ids, tree)
    latest = state._latest_nodes.clone()
    drafts = [tree.token_ids[r].tolist() for r in range(len(req_ids))]
    trees = state.clip_drafts(req_ids, drafts, requests, max_model_len=1000)
    if keep is not None:
        kept = keep(trees)
        state.keep_scheduled(kept)
        for r, req_id in enumerate(req_ids):
            if req_id in kept:
                drafts[r] = [drafts[r][i] for i in kept[req_id]]
    num_draft = [len(ids) for ids in drafts]
    extra = list(extra_rows) + [0] * (len(req_ids) - len(extra_rows))
    sizes = [m + 1 + e for m, e in zip(num_draft, extra)]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    row_req = np.repeat(np.arange(len(req_ids)), sizes)
    row_pos = np.concatenate([np.arange(s) for s in sizes])
    verify = state.begin_verify(req_ids, num_draft, torch.tensor(sum(drafts, []),
                                                                 dtype=torch.long),
                                starts.tolist(), int(sum(sizes)), scheduled=drafts,
                                token_rows=(row_req, row_pos))
    sampled = torch.zeros(len(req_ids), state.budget + 1, dtype=torch.long)
    for r in range(len(req_ids)):  # follow each request's first path as deep as it goes
        current = -1
        for k in range(state.budget):
            if verify.tree.parents[r, k] == current and verify.tree.depths[r, k] > 0:
                sampled[r, current + 1] = verify.tree.token_ids[r, k]
                current = k
    verdict = walk(verify.tree, sampled)
    src, dst = state.finish_verify(verdict)
    return SimpleNamespace(latest=latest, drafts=drafts, verify=verify, verdict=verdict,
                           src=src, dst=dst, gather=state.gather_index,
                           moved=state.num_compacted_slots)


def assert_steps_equal(fused, ref, what):
    assert torch.equal(fused.latest, ref.latest) and fused.latest.dtype == torch.int16, what
    assert fused.drafts == ref.drafts, what
    fv, rv = fused.verify, ref.verify
    assert fv.exact and rv.exact, what
    assert_trees_equal(fv.tree, rv.tree, f"{what}: verify tree")
    for name in ("matched", "position_shift", "starts"):
        a, b = getattr(fv, name), getattr(rv, name)
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: {name}\nfused {a}\ntorch {b}"
    assert (fv.num_draft, fv.query_start, fv.num_tokens) == (rv.num_draft, rv.query_start,
                                                             rv.num_tokens), what
    assert_verdicts_equal(fused.verdict, ref.verdict, what)
    for name in ("src", "dst", "gather"):
        assert torch.equal(getattr(fused, name), getattr(ref, name)), f"{what}: {name}"
    assert fused.moved == ref.moved, what


@pytest.mark.parametrize("B,L", [(12, 4), (24, 6), (64, 8)])
def test_proposal_store_equals_the_torch_path(native, B, L):
    """Two steps on two fresh TreeStates (fused / torch), same inputs: requests near
    max_tokens (their proposals re-indexed), one without nodes, one with extra rows; the
    store grows past its capacity; the second step re-proposes some requests into their
    slots while another keeps its older proposal."""
    gen = torch.Generator().manual_seed(B + L)
    logits1 = random_logits("ties", 5, L, 7, gen) + torch.randn(5, L, 7, generator=gen)
    budgets1 = torch.tensor([B, B, B // 2, 0, B])
    logits2 = random_logits("zeros", 3, L, 9, gen)
    budgets2 = torch.tensor([B, B - 1, 3])
    requests = {
        "a": request(2, 5, max_tokens=100),  # far from every limit
        "b": request(2, 5, max_tokens=8),  # 3 more tokens: depth <= 2 (re-indexed)
        "c": request(2, 5, max_tokens=7),  # 2 more tokens: depth <= 1 (re-indexed)
        "d": request(2, 5, max_tokens=100),  # no nodes
        "e": request(2, 5, max_tokens=9),  # depth <= 3 (re-indexed when L > 3)
        "f": request(2, 0, max_tokens=4),  # 4 more tokens: depth <= 3
    }

    def run():
        state = TreeState(DDTreeOptions(budget=B, depth=L), torch.device("cpu"),
                          max_num_reqs=2)
        first = verify_step(state, list("abcde"), build_tree(logits1, budgets1, B), requests,
                            extra_rows=[0, 0, 0, 4])
        second = verify_step(state, ["f", "b", "a"], build_tree(logits2, budgets2, B),
                             requests)
        return first, second

    (f1, f2), (r1, r2) = both_paths(native, run)
    assert_steps_equal(f1, r1, f"B={B} L={L} step 1")
    assert_steps_equal(f2, r2, f"B={B} L={L} step 2")
    assert f1.verify.tree.num_nodes.tolist()[3] == 0
    usable = {"b": 2, "c": 1, "e": 3, "f": 3}  # the depth each request can still accept
    for step, req_ids, budgets in ((f1, "abcde", budgets1), (f2, "fba", budgets2)):
        depths = step.verify.tree.depths
        for r, req_id in enumerate(req_ids):
            assert int(depths[r].max()) <= usable.get(req_id, L), (req_id, depths[r])
        clipped = [len(ids) < int(n) for ids, n in zip(step.drafts, budgets)]
        assert any(clipped), "some request must lose nodes near its end"
    for step in (f1, f2):  # the verify trees' ancestor rows follow their parents
        tree = step.verify.tree
        assert torch.equal(tree.ancestor_mask, _ancestor_mask(tree.parents, B))


@pytest.mark.parametrize("L", [2, 3, 4, 5, 9])
def test_reindexed_chain_of_full_depth(native, L):
    """A structured-output request whose grammar (the scheduler's cut, ``keep_scheduled``)
    keeps its tree's best path as a chain (re-indexed even far from its end); with a peaked
    draft the path has L nodes. The verify tree's ancestor rows must hold the whole path on
    both paths. Oracle: the rows rebuilt from the parents over all B levels.

    NOTE (found with this test): the torch path of ``TreeState._reindex_proposals`` rebuilds
    the rows with ``_ancestor_mask(parents, self.depth - 1)`` ("kept nodes are shallower than
    L"), i.e. ``(L - 2).bit_length()`` rounds of pointer jumping, which cover paths of up to
    ``2 ** rounds`` nodes; a best path of L nodes (kept whole: the request is far from its
    end) then loses its depth-1 ancestor in the deepest node's row when L is 2, 3, 5, 9, 17,
    ... The fused ``reindex_trees_`` copies the parent's row and is right."""
    B = 12
    gen = torch.Generator().manual_seed(L)
    logits = torch.randn(2, L, 6, generator=gen)
    logits[1, :, 0] += 8  # request "s": a path of L nodes is its best one
    requests = {"a": request(2, 5, max_tokens=100),
                "s": request(2, 5, max_tokens=100, structured=True)}

    def run():
        state = TreeState(DDTreeOptions(budget=B, depth=L), torch.device("cpu"))
        return verify_step(state, ["a", "s"], build_tree(logits, B), requests,
                           keep=lambda trees: {"s": best_path(trees["s"], L)})

    fused, ref = both_paths(native, run)
    assert fused.drafts[1] == [0] * L
    assert fused.verify.tree.parents[1, :L].tolist() == list(range(-1, L - 1))
    oracle = _ancestor_mask(fused.verify.tree.parents, B)
    assert torch.equal(fused.verify.tree.ancestor_mask, oracle), "fused path"
    assert torch.equal(ref.verify.tree.ancestor_mask, oracle), (
        f"torch path (_reindex_proposals) at L={L}: chain mask rows "
        f"{ref.verify.tree.ancestor_mask[1, :L + 1, 0].tolist()}, expected "
        f"{oracle[1, :L + 1, 0].tolist()}")
    assert_steps_equal(fused, ref, f"chain L={L}")


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_tree_attention_info_equals_the_torch_twin(native, table_dtype):
    """The CPU backend's per-step tree rows (query rows, validity, K/V slots, masks) from the
    packed ancestor rows equal :func:`tree_attention_info`'s from the dense mask: requests with
    unequal node counts and one without nodes, scattered blocks, a block table wider than
    needed, trees with padding (budgets below the width)."""
    from vllm_ddtree.plugin.cpu_attention import TreeAttentionInfo, tree_attention_info

    bs, width = 16, 40
    gen = torch.Generator().manual_seed(11)
    num_draft = [3, 0, 37, 12]
    ctx = [5, 30, 70, 0]
    tree = build_tree(torch.randn(4, 6, 50, generator=gen), torch.tensor(num_draft),
                      max_budget=width)
    seq_lens = [c + m + 1 for c, m in zip(ctx, num_draft)]
    block_table = torch.randperm(40, generator=gen)[:32].view(4, 8).to(table_dtype)
    starts = list(np.cumsum([0] + [m + 1 for m in num_draft[:-1]]))
    requests = [(r, int(starts[r]), m) for r, m in enumerate(num_draft) if m > 0]
    want = tree_attention_info(tree.dense_mask(), requests, seq_lens, block_table, bs)
    table = torch.tensor([(r, start, m, seq_lens[r]) for r, start, m in requests])
    got = TreeAttentionInfo(*native.ops.tree_attention_info(table, tree.ancestor_mask,
                                                            block_table, bs))
    for name in ("rows", "valid", "slots", "mask"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


# isa, dtype, block size, K/V heads, head size, query heads per K/V head, contexts, rounding of
# the probabilities as vLLM's kernel of this isa does (the op's bf16_probs: "amx" with bf16)
SHORT, LONG = [5, 30, 40, 0], [5, 300, 700, 256]
ATTENTION_CASES = [("vec", torch.float32, 16, 2, 32, 3, SHORT, "vec"),
                   ("vec16", torch.bfloat16, 16, 2, 32, 2, SHORT, "vec16"),
                   ("vec", torch.bfloat16, 32, 1, 64, 4, SHORT, "vec"),
                   ("vec", torch.float32, 16, 2, 32, 3, LONG, "vec"),
                   ("vec", torch.float32, 16, 2, 32, 3, LONG, "amx"),
                   ("vec", torch.bfloat16, 32, 1, 64, 4, SHORT, "amx"),
                   ("vec", torch.float32, 16, 1, 80, 2, LONG, "vec")]  # D = 2 x 32 + 16
if torch.cpu._is_amx_tile_supported():
    ATTENTION_CASES.append(("amx", torch.bfloat16, 32, 2, 32, 2, SHORT, "amx"))


def _bf16_probs_attention(q, k, v, mask, scale):
    """Attention of rows ``q [n, b, H, D]`` over ``k = v [n, s, Hkv, D]`` under ``mask [n, b,
    s]`` with the unnormalised probabilities exp(s - max) rounded to bf16 before they weigh V
    and their float32 sum dividing (vLLM's amx kernel), in float32."""
    group = q.shape[2] // k.shape[2]
    kf, vf = (x.float().repeat_interleave(group, dim=2) for x in (k, v))
    scores = torch.einsum("nbhd,nshd->nhbs", q.float(), kf) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    weights = (scores - scores.amax(-1, keepdim=True)).exp()
    out = torch.einsum("nhbs,nshd->nbhd", weights.bfloat16().float(), vf)
    return out / weights.sum(-1).permute(0, 2, 1)[..., None]


@pytest.mark.parametrize("vectorized", [True, False], ids=["avx2", "aten"])
@pytest.mark.parametrize("isa,dtype,bs,nkv,d,group,ctx,rounding", ATTENTION_CASES)
def test_tree_attention_equals_the_torch_twin(native, isa, dtype, bs, nkv, d, group, ctx,
                                              rounding, vectorized):
    """The fused tree-row attention (each request's root and node rows) over vLLM's paged CPU
    cache (written by vLLM's own writer) equals :func:`tree_rows_attention` over the layout's
    gathers (the torch path), row by row, within float32 rounding (bf16: one bf16 step), for
    short and long contexts (one and several 64-position tiles of the AVX2 loop, a context
    that is not a multiple of 8), with and without the bf16 rounding of the probabilities that
    vLLM's amx kernel does (also on float32 data, where its effect is seen); the rows of
    requests without nodes stay untouched. Both of the op's paths: the AVX2 loop (where the
    CPU has AVX2 and FMA) and the ATen one (every other CPU)."""
    from vllm_ddtree.plugin.cpu_attention import (
        _write_with_vllm, cpu_kv_layout, tree_attention_info, tree_rows_attention)

    heads, budget = nkv * group, 8
    gen = torch.Generator().manual_seed(3)
    num_draft = [3, 0, 8, 5]
    per = (max(ctx) + budget + bs) // bs  # blocks per request
    num_blocks = 4 * per + 8
    tree = build_tree(torch.randn(4, 4, 50, generator=gen), torch.tensor(num_draft),
                      max_budget=budget)
    seq_lens = [c + m + 1 for c, m in zip(ctx, num_draft)]
    block_table = torch.randperm(num_blocks, generator=gen)[:4 * per].view(4, per).to(torch.int32)
    starts = list(np.cumsum([0] + [m + 1 for m in num_draft[:-1]]))
    num_rows = int(starts[-1]) + num_draft[-1] + 1
    slots = torch.cat([block_table[r, p // bs].long() * bs + p % bs
                       for r, p in enumerate(torch.arange(n) for n in seq_lens)])
    k = torch.randn(sum(seq_lens), nkv, d, generator=gen).to(dtype)
    v = torch.randn(sum(seq_lens), nkv, d, generator=gen).to(dtype)
    cache = _write_with_vllm(isa, dtype, num_blocks, bs, nkv, d, k, v, slots)
    q = torch.randn(num_rows, heads, d, generator=gen).to(dtype)
    requests = [(r, int(starts[r]), m) for r, m in enumerate(num_draft) if m > 0]
    info = tree_attention_info(tree.dense_mask(), requests, seq_lens, block_table, bs)
    layout = cpu_kv_layout(cache, isa)
    k_index, v_index = layout.index(info.slots)
    flat = cache.view(-1)
    args = (q[info.rows], flat[k_index], flat[v_index], info.mask, 0.3)
    want = tree_rows_attention(*args, rounding)
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    if rounding == "amx" and dtype == torch.float32:  # the rounding alone, written out here
        unrounded = want
        want = _bf16_probs_attention(*args)
        # a weight within an ulp of a bf16 rounding boundary may round the other way (the op
        # sums in another order): one bf16 step of one weight, ~1e-4 here; the mean error must
        # stay far below the rounding's own effect (below)
        tol = dict(atol=1e-4, rtol=0)

    out = torch.full_like(q, 7.0)
    native.ops.tree_attention_(out, q, flat, layout.offsets, layout.slot_stride, info.rows,
                               info.valid, info.slots, info.mask, 0.3,
                               rounding == "amx", vectorized)
    got, want = out[info.rows[info.valid]].float(), want[info.valid].float()
    torch.testing.assert_close(got, want, **tol)
    if rounding == "amx" and dtype == torch.float32:  # the op rounds where the oracle does
        error = (got - want).abs().mean()
        assert error < 0.01 * (got - unrounded[info.valid]).abs().mean(), error
    untouched = torch.ones(num_rows, dtype=torch.bool)
    untouched[info.rows[info.valid]] = False
    assert bool((out[untouched] == 7.0).all())


def test_an_attention_layer_reads_the_cache_it_is_given(native):
    """The backend's attention layer keeps the K/V layout of its cache between steps: given
    another cache tensor (same shape, other contents), it reads that one. Oracle: the torch
    twin over each cache's own gathers."""
    from vllm_ddtree.plugin.cpu_attention import (
        DDTreeCPUImpl, TreeAttentionInfo, _write_with_vllm, cpu_kv_layout, tree_attention_info,
        tree_rows_attention)

    bs, nkv, d, heads, budget = 16, 2, 32, 4, 8
    gen = torch.Generator().manual_seed(5)
    num_draft, ctx = [5, 3], [20, 9]
    tree = build_tree(torch.randn(2, 4, 50, generator=gen), torch.tensor(num_draft),
                      max_budget=budget)
    seq_lens = [c + m + 1 for c, m in zip(ctx, num_draft)]
    block_table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32) + 1  # block 0: null
    slots = torch.cat([block_table[r, p // bs].long() * bs + p % bs
                       for r, p in enumerate(torch.arange(n) for n in seq_lens)])
    requests = [(0, 0, 5), (1, 6, 3)]
    num_rows = 10
    caches = []
    for _ in range(2):
        k, v = (torch.randn(sum(seq_lens), nkv, d, generator=gen) for _ in range(2))
        caches.append(_write_with_vllm("vec", torch.float32, 6, bs, nkv, d, k, v, slots))
    q = torch.randn(num_rows, heads, d, generator=gen)
    twin = tree_attention_info(tree.dense_mask(), requests, seq_lens, block_table, bs)
    table = torch.tensor([(r, start, m, seq_lens[r]) for r, start, m in requests])
    info = TreeAttentionInfo(*native.ops.tree_attention_info(table, tree.ancestor_mask,
                                                            block_table, bs),
                             covers_all=True, ops=native.ops)
    impl = DDTreeCPUImpl.__new__(DDTreeCPUImpl)
    impl.scale = 0.3
    layer = SimpleNamespace(isa="vec")
    for cache in (caches[0], caches[1], caches[0]):
        output = torch.zeros(num_rows, heads * d)
        impl.forward(layer, q.view(num_rows, -1), None, None, cache,
                     SimpleNamespace(ddtree=info), output)
        k_index, v_index = cpu_kv_layout(cache, "vec").index(twin.slots)
        flat = cache.view(-1)
        want = tree_rows_attention(q[twin.rows], flat[k_index], flat[v_index], twin.mask, 0.3,
                                   "vec")
        got = output.view(num_rows, heads, d)[twin.rows[twin.valid]]
        torch.testing.assert_close(got, want[twin.valid], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("versus_plain", [True, False])
def test_auto_budget_function_equals_the_torch_path(native, versus_plain):
    """auto's budget function (calibrated gains, global ranking, the cost model's best k, the
    plain-decoding comparison) as one fused op gives the torch path's budgets: random trees,
    calibrations, cost curves, overheads, sampled and incomplete requests, structured requests
    (node costs, a limit of L nodes). The trees cut to those budgets are equal too: on the
    CPU ``build_tree`` gets them from one op (``build_tree_auto``), on the torch path from the
    full-width tree, the budgets and ``first_nodes``."""
    from vllm_ddtree.budget import Calibration, CostModel, FusedAutoBudgets, budget_function

    gen = torch.Generator().manual_seed(21)
    for trial in range(30):
        num_reqs, width, depth = 1 + trial % 5, (8, 16, 64)[trial % 3], 1 + trial % 7
        logits = torch.randn(num_reqs, depth, 40, generator=gen) * (1 + trial % 4)
        tree = build_tree(logits, width)
        calibration = Calibration(depth, torch.device("cpu"))
        shape = calibration.predicted.shape  # [2, depth, SCORE_BINS]
        calibration.predicted.copy_(torch.rand(shape, generator=gen, dtype=torch.float64) * 5)
        calibration.observed.copy_(torch.rand(shape, generator=gen, dtype=torch.float64) * 5)
        tokens = sorted(set(torch.randint(1, 600, (5,), generator=gen).tolist()))
        seconds = sorted((torch.rand(len(tokens), generator=gen) * 0.02 + 0.001).tolist())
        cost = CostModel(tuple(tokens), tuple(seconds), (1, 8), (0.002, 0.004 + trial * 1e-4))
        sampled = torch.rand(num_reqs, generator=gen) < 0.5
        complete = None if trial % 3 else torch.rand(num_reqs, generator=gen) < 0.7
        overheads = dict(on_overhead=trial * 2e-4, off_overhead=(trial % 7) * 3e-4)
        costs = {}
        if trial % 2:  # structured requests: their grammar cost per node, at most L nodes
            structured = torch.rand(num_reqs, generator=gen) < 0.6
            costs = dict(node_cost=structured * torch.rand(num_reqs, generator=gen,
                                                           dtype=torch.float64) * 3e-4,
                         limit=torch.where(structured, depth, width))

        def budgets():
            fn = budget_function(cost, calibration, sampled, complete,
                                 versus_plain=versus_plain, **overheads, **costs)
            return fn(tree.scores, tree.depths)

        fused, ref = both_paths(native, budgets)
        assert fused.dtype == ref.dtype == torch.int64
        assert torch.equal(fused, ref), (trial, fused, ref)

        def cut_trees():
            fn = budget_function(cost, calibration, sampled, complete,
                                 versus_plain=versus_plain, **overheads, **costs)
            assert isinstance(fn, FusedAutoBudgets) == (cpu_ops("cpu") is not None)
            return build_tree(logits, fn, width)

        fused_tree, ref_tree = both_paths(native, cut_trees)
        assert_trees_equal(fused_tree, ref_tree, f"trial {trial}")
        assert torch.equal(fused_tree.num_nodes, torch.minimum(fused, tree.num_nodes))


@pytest.mark.parametrize("versus_plain", [True, False])
def test_auto_budgets_with_a_tie_equal_the_torch_path(native, versus_plain):
    """auto's tie (the largest tree within a share of the best rate, policy.TREE_TIE) in the
    fused op and on the torch path: the same budgets and the same cut trees, with and
    without node costs, never fewer nodes than without the tie, and none for a request
    without drafter context (its nodes have no gain)."""
    from vllm_ddtree.budget import Calibration, CostModel, budget_function

    gen = torch.Generator().manual_seed(5)
    for trial in range(24):
        num_reqs, width, depth = 1 + trial % 4, (8, 16, 24)[trial % 3], 2 + trial % 6
        logits = torch.randn(num_reqs, depth, 50, generator=gen) * (1 + trial % 3)
        tree = build_tree(logits, width)
        calibration = Calibration(depth, torch.device("cpu"))  # cells of evidence 0-5
        for sums in (calibration.predicted, calibration.observed):
            sums.uniform_(0.0, 5.0, generator=gen)
        slope = float(torch.rand(1, generator=gen)) * 1e-4
        cost = CostModel((1, 200), (0.005, 0.005 + 199 * slope), (1, 8), (0.001, 0.003))
        sampled = torch.rand(num_reqs, generator=gen) < 0.5
        # requests without drafter context: their nodes have no gain, and get none
        complete = None if trial % 4 else torch.arange(num_reqs) % 2 == 0
        costs = {}
        if trial % 2:
            costs = dict(node_cost=torch.rand(num_reqs, generator=gen, dtype=torch.float64)
                         * 2e-4, limit=torch.full((num_reqs,), width))
        tie = (0.005, 0.02, 0.1)[trial % 3]

        def budgets(tie=tie):
            fn = budget_function(cost, calibration, sampled, complete,
                                 versus_plain=versus_plain, on_overhead=2e-3, tie=tie, **costs)
            return fn(tree.scores, tree.depths)

        fused, ref = both_paths(native, budgets)
        assert torch.equal(fused, ref), (trial, fused, ref)
        assert fused.sum() >= budgets(0.0).sum(), trial
        if complete is not None:
            assert not fused[~complete].any(), (trial, fused)

        def cut_trees():
            fn = budget_function(cost, calibration, sampled, complete,
                                 versus_plain=versus_plain, on_overhead=2e-3, tie=tie, **costs)
            return build_tree(logits, fn, width)

        fused_tree, ref_tree = both_paths(native, cut_trees)
        assert_trees_equal(fused_tree, ref_tree, f"trial {trial}")


def test_calibration_observe_equals_the_torch_path(native):
    """Calibration.observe as one fused op: the same decayed sums per depth and score bin
    (float64, within an ulp of exp), greedy and sampled rows apart, uncounted rows ignored,
    accepted nodes counted in their cells (the walk's accepted nodes of random targets)."""
    from vllm_ddtree.budget import Calibration

    gen = torch.Generator().manual_seed(4)

    def run():
        calibration = Calibration(5, torch.device("cpu"), decay=0.9)
        for step in range(12):
            tree = build_tree(torch.randn(4, 5, 30, generator=torch.Generator().manual_seed(step)),
                              torch.tensor([16, 3, 0, 9]), max_budget=16)
            gen = torch.Generator().manual_seed(100 + step)
            # targets that mostly follow each row's first child (deep paths get accepted),
            # else a random token
            sampled = torch.randint(0, 30, (4, 17), generator=gen)
            follow = torch.rand(4, 17, generator=gen) < 0.8
            for r in range(4):
                for c in reversed(range(16)):  # the first child of each row wins
                    row = int(tree.parents[r, c]) + 1
                    if tree.depths[r, c] > 0 and follow[r, row]:
                        sampled[r, row] = tree.token_ids[r, c]
            verdict = walk(tree, sampled)
            calibration.observe(tree.scores, tree.depths, verdict.accepted_nodes,
                                torch.tensor([True, True, False, True]),
                                torch.tensor([step % 2 == 0, True, False, False]))
        return calibration.predicted, calibration.observed

    (p1, o1), (p2, o2) = both_paths(native, run)
    torch.testing.assert_close(p1, p2, rtol=1e-13, atol=0)
    assert torch.equal(o1, o2)
    assert bool((p1 > 0).any()) and bool((o1[:, 1:] > 0).any())  # deep nodes accepted too
    assert int((p1[0] > 0).sum()) > 5  # several cells


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_context_complete_equals_the_torch_path(native, table_dtype):
    """Which requests' drafter context is complete (auto's cold steps), as one fused op: the
    torch path's answer for random validity maps, scattered blocks in a block table wider
    than needed, requests with no computed positions and ones that end mid-block."""
    gen = torch.Generator().manual_seed(8)
    bs, num_blocks = 4, 40
    answers = set()
    for trial in range(20):
        state = TreeState(DDTreeOptions(budget=8, depth=3), torch.device("cpu"))
        state.allocate_context_validity(num_blocks * bs)
        table = torch.randperm(num_blocks, generator=gen)[:5 * 7].view(5, 7).to(table_dtype)
        num_computed = torch.randint(0, 7 * bs + 1, (5,), generator=gen).tolist()
        num_computed[trial % 5] = 0
        cold = torch.randperm(num_blocks * bs, generator=gen)[: trial % 6]
        state.went_cold(["a"], cold)
        fused, ref = both_paths(native, lambda: state.context_complete(table, num_computed, bs))
        assert fused.dtype == ref.dtype == torch.bool and torch.equal(fused, ref), trial
        answers.update(fused.tolist())
    assert answers == {True, False}  # both answers were exercised
