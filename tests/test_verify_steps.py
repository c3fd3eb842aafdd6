"""The Triton tree build, walk and finish_verify (kernels/verify_steps.py) against their torch
paths.

Oracle: the torch path of :func:`vllm_ddtree.tree.build_tree`, :func:`vllm_ddtree.walk.walk`
and ``TreeState.finish_verify`` on the CPU (``VLLM_DDTREE_NATIVE=0``), which test_native.py,
test_tree_build.py and test_walk.py hold against the fused CPU ops, DDTree's heap
(``reference_build_tree``) and brute force; the expected moves are also written out by hand
(``moves_by_hand``). On the CPU the kernels run in Triton's interpreter; with CUDA natively
(the GPU box runs this file too). Equality is bit for bit.
"""

import itertools

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
from triton_utils import interpreter_on_cpu

import vllm_ddtree.plugin.state as state_module
import vllm_ddtree.walk as walk_module
from vllm_ddtree.kernels import verify_steps
from vllm_ddtree.kernels.verify_steps import build_tree_triton, finish_verify_triton, walk_triton
from vllm_ddtree.plugin.options import DDTreeOptions
from vllm_ddtree.plugin.state import TreeState, VerifyBatch
import vllm_ddtree.tree as tree_module
from vllm_ddtree.tree import _top_log_probs, build_tree
from vllm_ddtree.walk import TreeVerdict, walk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, scope="module")
def triton_interpreter():
    with interpreter_on_cpu(DEVICE):
        yield


@pytest.fixture
def torch_path(monkeypatch):
    """The reference: every stage on its torch path (no fused CPU op, no Triton)."""
    monkeypatch.setenv("VLLM_DDTREE_NATIVE", "0")


def on_device(tree):
    return type(tree)(**{name: (getattr(tree, name).to(DEVICE)
                                if name not in ("max_depth", "tops") else getattr(tree, name))
                         for name in tree.__dataclass_fields__})


def triton_verdict(tree, sampled, out_width=0) -> TreeVerdict:
    t = on_device(tree)
    *fields, emitted = walk_triton(t.token_ids, t.parents, t.depths, t.ancestor_mask,
                                   sampled.to(DEVICE).long(), tree.max_depth, out_width)
    return TreeVerdict(*(f.cpu() for f in fields),
                       sampled_token_ids=None if emitted is None else emitted.cpu())


def triton_tree(logits, budget, max_budget):
    values, ids = _top_log_probs(logits, min(max_budget, logits.shape[2]))
    if isinstance(budget, torch.Tensor):
        budget = budget.to(DEVICE)
    fields = build_tree_triton(values.to(DEVICE), ids.to(DEVICE), budget, max_budget)
    return [f.cpu() for f in fields]


@pytest.mark.parametrize("B,L,vocab,kind", [(1, 1, 3, "ties"), (5, 1, 1, "ties"),
                                            (16, 5, 9, "ties"), (16, 3, 40, "zeros"),
                                            (64, 8, 5, "randn"), (33, 6, 50, "bf16"),
                                            (256, 15, 300, "randn"), (256, 15, 7, "ties")])
def test_build_tree_equals_the_torch_path(torch_path, B, L, vocab, kind):
    """Ties (the rank's token-id tie-break and the heap's depth / parent / rank order),
    tokens of probability zero (fewer prefixes than B: padding), vocabularies smaller than B,
    B = 256 at L = 15; an int budget below the width, per-request budgets (0 and the full
    width among them) and a budget function, each against the torch path bit for bit."""
    gen = torch.Generator().manual_seed(B * 13 + L + vocab)
    big = B >= 256  # the interpreter runs B heap pops per request: fewer cases (CI time)
    logits = random_logits(kind, 2 if big else 3, L, vocab, gen)
    budgets = torch.tensor([B, 17] if big else [B, 0, max(B // 2, 1)])
    cases = ((B, B), (budgets, B)) if big else ((B, B), (max(B // 3, 1), B), (budgets, B))
    for budget, width in cases:
        want = build_tree(logits, budget, width)
        got = triton_tree(logits, budget, width)
        for name, a in zip(TREE_FIELDS, got):
            b = getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), f"{name}\ntriton {a}\ntorch  {b}"


@pytest.mark.parametrize("B,L,vocab", [(16, 5, 9), (64, 8, 40)])
def test_calibrated_build_tree_equals_the_torch_path(torch_path, B, L, vocab):
    """A calibrated tree (vllm_ddtree/calibration.py): the kernel gets the calibrated lists
    (full of exact ties: conditionals capped at 1 or held at a better rank's) and builds the
    torch path's tree, bit for bit, for an int budget and per-request budgets."""
    from vllm_ddtree.calibration import CELLS
    gen = torch.Generator().manual_seed(B + L)
    logits = random_logits("randn", 3, L, vocab, gen)
    log_factors = (torch.rand(3, L, CELLS, generator=gen) * 4 + 0.1).log()
    values, ids, _ = tree_module._calibrated(*_top_log_probs(logits, min(B, vocab)),
                                             log_factors)
    for budget in (B, torch.tensor([B, 0, B // 2])):
        want = build_tree(logits, budget, B, calibration=log_factors)
        fields = build_tree_triton(values.to(DEVICE), ids.to(DEVICE),
                                   budget.to(DEVICE) if isinstance(budget, torch.Tensor)
                                   else budget, B)
        for name, a in zip(TREE_FIELDS, fields):
            b = getattr(want, name)
            assert torch.equal(a.cpu(), b), f"{name}\ntriton {a}\ntorch  {b}"


@pytest.mark.parametrize("B", [3, 4, 7, 12])
def test_build_tree_breaks_exact_ties_across_depths_parents_and_ranks(torch_path, B):
    """Prefixes of exactly equal scores at different depths, under different parents and at
    different ranks: a certain token (log-probability 0) at depth 2 gives ``a c`` the score of
    ``a``, equal to ``b``'s; depth 3 has three equally likely tokens. The heap's order (depth,
    then parent, then rank) decides every node."""
    inf = float("-inf")
    logits = torch.tensor([[[0.0, 0.0, inf, inf], [5.0, inf, inf, inf], [0.0, 0.0, 0.0, inf]],
                           [[1.0, 1.0, 1.0, 1.0], [0.0, inf, inf, inf], [2.0, 2.0, inf, inf]]])
    want = build_tree(logits, B)
    got = triton_tree(logits, B, B)
    for name, a in zip(TREE_FIELDS, got):
        b = getattr(want, name)
        assert torch.equal(a, b), f"B={B} {name}\ntriton {a}\ntorch  {b}"
    if B >= 4:  # a, then b (depth 1) before a c (depth 2) at the same score
        assert want.depths[0, :3].tolist() == [1, 1, 2]


def test_build_tree_with_a_budget_function_takes_the_kernel(monkeypatch):
    """build_tree on a device where triton_stages holds (forced here for the interpreter): a
    budget function sees the full-width tree, the kept nodes are each request's first."""
    gen = torch.Generator().manual_seed(9)
    logits = random_logits("ties", 3, 4, 6, gen).to(DEVICE)
    seen = []

    def budget_fn(scores, depths):
        seen.append((scores.clone(), depths.clone()))
        return (depths > 0).sum(dim=1) // 2  # half of each request's possible nodes

    monkeypatch.setenv("VLLM_DDTREE_NATIVE", "0")  # the torch path, on the same device (the
    want = build_tree(logits, budget_fn, 12)  # same log-probabilities, bit for bit)
    want_seen = seen.pop()
    monkeypatch.delenv("VLLM_DDTREE_NATIVE")
    launches = []
    real = tree_module.build_tree_triton
    monkeypatch.setattr(tree_module, "build_tree_triton",
                        lambda *args: launches.append(1) or real(*args))
    monkeypatch.setattr(tree_module, "triton_stages", lambda device: True)
    monkeypatch.setattr(tree_module, "cpu_ops", lambda device: None)
    got = build_tree(logits, budget_fn, 12)
    assert len(launches) == 2  # the full width for the function, then the kept nodes
    assert all(torch.equal(a, b) for a, b in zip(seen.pop(), want_seen))
    for name in TREE_FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize("B,L", list(itertools.product([1, 16, 64, 300], [1, 5, 15])))
def test_walk_equals_the_torch_path(torch_path, B, L):
    """DDTree trees (ties, padding from tokens of probability zero, a request without nodes,
    a budget < B), samples that follow a random path or none, vLLM's output widths."""
    gen = torch.Generator().manual_seed(31 * B + L)
    for kind in ("ties", "zeros"):
        vocab = 5 if kind == "ties" else 40
        logits = random_logits(kind, 4, L, vocab, gen)
        tree = build_tree(logits, torch.tensor([B, 0, max(B // 3, 1), B]), B)
        for follow in (True, True, False):
            sampled = path_samples(tree, vocab, gen, follow)
            for out_width in (0, 3, B + 1):
                want = walk(tree, sampled, out_width)
                got = triton_verdict(tree, sampled, out_width)
                assert_verdicts_equal(got, want, f"B={B} L={L} {kind} {follow} {out_width}")


def test_walk_chains_strided_views_and_empty_trees(torch_path):
    """Chains accepted whole and cut; strided first-node views (the verify tree of a step
    whose scheduler kept fewer nodes); trees without any node."""
    gen = torch.Generator().manual_seed(3)
    width = 9
    tree, whole = chain_trees(gen, width)
    assert triton_verdict(tree, whole).num_accepted.tolist() == [9, 5, 0, 1, 9, 3]
    for trial in range(6):
        sampled = whole if trial == 0 else path_samples(tree, 3, gen, follow=trial % 3 != 2)
        assert_verdicts_equal(triton_verdict(tree, sampled, width + 3),
                              walk(tree, sampled, width + 3), f"chains {trial}")
        sub = tree.first_nodes(4)
        assert not sub.token_ids.is_contiguous()
        assert_verdicts_equal(triton_verdict(sub, sampled[:, :5]), walk(sub, sampled[:, :5]),
                              f"first nodes {trial}")
    empty = hand_tree([[-1] * 4] * 2, [[-1] * 4] * 2, max_depth=3)
    sampled = torch.randint(0, 5, (2, 5), generator=gen)
    got = triton_verdict(empty, sampled, 5)
    assert_verdicts_equal(got, walk(empty, sampled, 5), "no nodes")
    assert got.num_accepted.tolist() == [0, 0]
    assert got.bonus_token.tolist() == sampled[:, 0].tolist()


@pytest.mark.parametrize("B,L", [(12, 4), (64, 15), (300, 15), (5, 1)])
def test_finish_verify_equals_the_torch_path_and_the_moves_by_hand(torch_path, B, L):
    """Unequal draft counts (some none), rows past a request's verify span (prefill), padding
    rows after the last request; the moved-slot counter adds up over steps."""
    gen = torch.Generator().manual_seed(B + 100 * L)
    num_draft = [B, 0, min(3, B), 0, B // 2, 1]
    extra = [0, 0, 0, 6, 0, 300]  # the last request runs past one identity tile
    batch = len(num_draft)
    reference = TreeState(DDTreeOptions(budget=B, depth=L), torch.device("cpu"))
    moved = torch.zeros((), dtype=torch.int64, device=DEVICE)
    total = 0
    for trial in range(4):
        tree = build_tree(random_logits("ties", batch, L, 5, gen), torch.tensor(num_draft), B)
        counts = tree.num_nodes.tolist()
        sizes = [m + 1 + e for m, e in zip(counts, extra)]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
        num_tokens = sum(sizes) + 3
        reference.verify = VerifyBatch(tree=tree, num_draft=counts, query_start=starts,
                                       num_tokens=num_tokens,
                                       matched=torch.ones(batch, dtype=torch.bool),
                                       starts=torch.tensor(starts))
        verdict = walk(tree, path_samples(tree, 5, gen, follow=trial != 3))
        src_t, dst_t = reference.finish_verify(verdict)
        src, dst, gather = finish_verify_triton(verdict.accepted_rows.to(DEVICE),
                                                torch.tensor(starts, device=DEVICE),
                                                num_tokens, moved)
        case = f"B={B} L={L} trial {trial}"
        for a, b in ((src, src_t), (dst, dst_t), (gather, reference.gather_index)):
            a = a.cpu()
            assert a.dtype == b.dtype == torch.int64 and a.shape == b.shape, case
            assert torch.equal(a, b), f"{case}\ntriton {a}\ntorch  {b}"
        want = moves_by_hand(verdict.accepted_rows, starts, num_tokens)
        total += want[3]
        assert (src.tolist(), dst.tolist(), gather.tolist()) == want[:3], case
        assert int(moved) == total == reference.num_compacted_slots, case
    assert total > 0 or L == 1


def test_the_state_and_the_walk_take_the_kernels_where_triton_stages_says(monkeypatch):
    """``walk`` and ``TreeState.finish_verify`` dispatch to the kernels when
    ``triton_stages`` holds for their device (CUDA; forced here for the interpreter), and to
    the torch path with ``VLLM_DDTREE_NATIVE=0``."""
    calls = []

    def spy(module, name):
        real = getattr(verify_steps, name)

        def launch(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, launch)
        monkeypatch.setattr(module, "triton_stages", lambda device: True)
        monkeypatch.setattr(module, "cpu_ops", lambda device: None)

    spy(walk_module, "walk_triton")
    spy(state_module, "finish_verify_triton")
    gen = torch.Generator().manual_seed(5)
    tree = build_tree(random_logits("ties", 2, 4, 5, gen), 8, 8)
    tree = on_device(tree)
    state = TreeState(DDTreeOptions(budget=8, depth=4), torch.device(DEVICE))
    state.verify = VerifyBatch(tree=tree, num_draft=[8, 8], query_start=[0, 9], num_tokens=18,
                               matched=torch.ones(2, dtype=torch.bool, device=DEVICE),
                               starts=torch.tensor([0, 9], device=DEVICE))
    verdict = walk(tree, path_samples(tree, 5, gen).to(DEVICE), 9)
    state.finish_verify(verdict)
    assert calls == ["walk_triton", "finish_verify_triton"]
    assert verify_steps.triton_stages("cuda") and not verify_steps.triton_stages("cpu")
    monkeypatch.setenv("VLLM_DDTREE_NATIVE", "0")
    assert not verify_steps.triton_stages("cuda")


def test_the_warm_up_compiles_every_kernel_a_step_launches(monkeypatch):
    """``verify_steps.warm_up`` at engine start (B = 12, L = 4) launches each stage kernel with
    the compile key of every later step: batches of 1 to 7 requests, trees cut to any width
    (auto's budgets), vLLM's output width following them, int and per-request budgets, any
    number of query rows never compile anew while serving."""
    import vllm_ddtree.kernels.verify_steps_kernel as kernels_module
    from triton_utils import LaunchRecorder

    recorders = {}
    for name in ("build_tree_kernel", "walk_kernel", "finish_verify_kernel"):
        recorders[name] = LaunchRecorder(getattr(kernels_module, name))
        monkeypatch.setattr(kernels_module, name, recorders[name])
    B, L, vocab = 12, 4, 50
    verify_steps.warm_up(B, L, vocab, torch.device(DEVICE))
    warm = {name: set(r.keys) for name, r in recorders.items()}
    assert [len(keys) for keys in warm.values()] == [2, 1, 1]  # build: one budget / per request
    gen = torch.Generator().manual_seed(4)
    moved = torch.zeros((), dtype=torch.int64, device=DEVICE)
    for num_reqs, budget in ((1, B), (3, 5), (7, torch.tensor([12, 0, 3, 7, 1, 12, 9]))):
        if isinstance(budget, torch.Tensor):
            budget = budget.to(DEVICE)
        logits = random_logits("ties", num_reqs, L, vocab, gen)
        values, ids = _top_log_probs(logits, B)
        fields = build_tree_triton(values.to(DEVICE), ids.to(DEVICE), budget, B)
        tree = tree_module.DraftTree(*fields[:3], scores=fields[3], num_nodes=fields[4],
                                     ancestor_mask=fields[5], max_depth=L)
        for width in (B, 7, 1):
            sub = tree.first_nodes(width)
            # views that start 8 bytes into their storage, as the store's rows can
            flat = torch.randint(0, vocab, (num_reqs * (width + 1) + 1,), generator=gen)
            sampled = flat.to(DEVICE)[1:].view(num_reqs, width + 1)
            verdict = walk_triton(sub.token_ids, sub.parents, sub.depths, sub.ancestor_mask,
                                  sampled, L, width + 1)
            starts = torch.cat([torch.full((1,), -7, device=DEVICE),
                                torch.arange(num_reqs, device=DEVICE) * (width + 1)])[1:]
            assert starts.data_ptr() % 16 != 0 and sampled.data_ptr() % 16 != 0
            finish_verify_triton(verdict[4], starts, num_reqs * (width + 1) + 3, moved)
    for name, recorder in recorders.items():
        assert set(recorder.keys) == warm[name], f"{name} compiled anew while serving"


def test_the_warm_up_covers_every_walk_tile_up_to_b(monkeypatch):
    """B = 600: trees up to 256 nodes share one walk tile, wider ones take 512 or 1024; the
    warm-up compiles every tile a step of this engine can reach (256, 512, 1024 for B = 600)."""
    launched = []
    def walk_triton(token_ids, *args):
        launched.append(token_ids.shape[1])
        return [None] * 6

    monkeypatch.setattr(verify_steps, "walk_triton", walk_triton)
    monkeypatch.setattr(verify_steps, "finish_verify_triton", lambda *args: None)
    monkeypatch.setattr(verify_steps, "build_tree_triton", lambda *args: None)
    verify_steps.warm_up(600, 4, 50, torch.device(DEVICE))
    assert launched == [256, 512, 600]
    assert {verify_steps._walk_block(n) for n in launched} == {256, 512, 1024}
