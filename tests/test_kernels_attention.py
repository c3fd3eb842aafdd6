"""tree_attention (Triton) against tree_attention_ref (torch), and the ref against brute force.

On the CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set by a module fixture
before the kernel module is first imported); with CUDA the same cases run natively. Smallest first:
the packed-mask helpers, a hand-built tree, then sweeps over head dims, block sizes, GQA,
ragged mixed batches, DDTree trees from build_tree and a 1024-node tree.
"""

import importlib
import math
import os
import subprocess
import sys

import pytest
import torch
from triton_utils import interpreter_on_cpu

from vllm_ddtree.kernels import (
    masked_attention_ref,
    request_attention_mask,
    tree_attention,
    tree_attention_ref,
    unpack_tree_mask,
)
from vllm_ddtree.tree import build_tree, pack_mask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, scope="module")
def triton_interpreter():
    with interpreter_on_cpu(DEVICE):
        yield


# (atol, rtol) of the kernel against the fp32 reference, per input dtype.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
# NOTE: on the CPU, bf16 runs through the launcher's fp32-dot path (the interpreter's bf16
# arithmetic is broken); on CUDA it runs the native bf16 dots.
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---------------------------------------------------------------------------------------------
# Helpers: random trees (independent of vllm_ddtree.tree), paged caches, brute force.


def random_parents(num_nodes: int, gen: torch.Generator) -> list[int]:
    """Parent (as mask row) of each row 1..num_nodes; row 0 is the root. parent < child."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, num_nodes + 1)]


def ancestors_by_walk(parents: list[int], i: int) -> set[int]:
    """Row i and its ancestors, found by walking the parent links (no mask involved)."""
    seen = set()
    while i >= 0:
        seen.add(i)
        i = parents[i]
    return seen


def mask_from_parents(parents: list[int]) -> torch.Tensor:
    """bool [n, n]: row(parent) | self, built row by row (the contract's recurrence)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def make_batch(q_lens, ctx_lens, tree_rows, *, num_heads, num_kv_heads, head_dim, block_size,
               dtype, gen, max_rows=None, spare_tokens=0):
    """Random q and a paged cache in vLLM's layout: K and V are strided views of one
    [num_blocks, num_kv_heads, block_size, 2 * head_dim] tensor, blocks shuffled.

    ``tree_rows[r]``: list of parents (tree request) or None (causal request).
    """
    batch = len(q_lens)
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req) + 1
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.full((batch, max_blocks), num_blocks + 7, dtype=torch.int32)  # junk
    used = 0
    for r, nb in enumerate(blocks_per_req):
        block_table[r, :nb] = perm[used:used + nb].int()
        used += nb
    cache = torch.randn(num_blocks, num_kv_heads, block_size, 2 * head_dim, generator=gen)
    cache = cache.to(dtype)
    k_cache, v_cache = cache.transpose(1, 2).split(head_dim, dim=-1)
    num_tokens = sum(q_lens) + spare_tokens
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    max_rows = max_rows or max(q_lens)
    tree_mask = torch.zeros(batch, max_rows, math.ceil(max_rows / 32), dtype=torch.int32)
    # garbage bits in causal requests' rows must be ignored
    tree_mask.random_(-(2**31), 2**31 - 1, generator=gen)
    for r, parents in enumerate(tree_rows):
        if parents is not None:
            rows = torch.zeros(max_rows, max_rows, dtype=torch.bool)
            rows[: len(parents), : len(parents)] = mask_from_parents(parents)
            tree_mask[r] = pack_mask(rows)
    has_tree = torch.tensor([p is not None for p in tree_rows])
    query_start_loc = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    args = dict(
        q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=query_start_loc,
        tree_mask=tree_mask, has_tree=has_tree,
    )
    return {k: v.to(DEVICE) for k, v in args.items()}


def run_and_compare(args, scale, dtype, **kernel_kw):
    """Kernel (poisoned output) vs the fp32 reference; tokens after the batch stay NaN."""
    out = torch.full_like(args["q"], float("nan"))
    tree_attention(**args, scale=scale, out=out, **kernel_kw)
    f32 = {k: (v.float() if v.is_floating_point() else v) for k, v in args.items()}
    ref = tree_attention_ref(**f32, scale=scale)
    end = int(args["query_start_loc"][-1])
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out[:end].float(), ref[:end], atol=atol, rtol=rtol)
    assert out[end:].isnan().all(), "tokens after query_start_loc[-1] must not be written"
    return out, ref


def brute_force(args, tree_rows, scale):
    """Per query, per head: softmax over the keys that parents say are visible (math module)."""
    q, kc, vc = args["q"].double().cpu(), args["k_cache"].double().cpu(), args["v_cache"].double().cpu()
    bt = args["block_table"].cpu()
    block_size = kc.shape[1]
    out = torch.zeros_like(q)
    starts = args["query_start_loc"].tolist()
    group = q.shape[1] // kc.shape[2]
    for r, seq_len in enumerate(args["seq_lens"].tolist()):
        q_len = starts[r + 1] - starts[r]
        ctx = seq_len - q_len
        for i in range(q_len):
            if tree_rows[r] is None:
                span = set(range(i + 1))
            else:
                span = ancestors_by_walk(tree_rows[r], i)
            keys = list(range(ctx)) + sorted(ctx + j for j in span)
            for h in range(q.shape[1]):
                kvh = h // group
                logits = []
                for p in keys:
                    k = kc[bt[r, p // block_size], p % block_size, kvh]
                    logits.append(float(q[starts[r] + i, h] @ k) * scale)
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                for w, p in zip(weights, keys):
                    out[starts[r] + i, h] += (w / total) * vc[bt[r, p // block_size], p % block_size, kvh]
    return out


# ---------------------------------------------------------------------------------------------
# The reference against hand-made cases and brute force.


def test_unpack_tree_mask_hand_example():
    words = torch.tensor([[5], [-(2**31)]], dtype=torch.int32)  # 0b101 and bit 31 alone
    assert unpack_tree_mask(words, 3).tolist() == [[True, False, True], [False, False, False]]
    assert unpack_tree_mask(words, 32)[1].nonzero().flatten().tolist() == [31]


def test_request_attention_mask_hand_example():
    words = torch.tensor([[0b001], [0b011], [0b101]], dtype=torch.int32)
    expected = [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]
    assert request_attention_mask(3, 5, words).int().tolist() == expected
    causal = [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert request_attention_mask(3, 5, None).int().tolist() == causal
    with pytest.raises(ValueError, match="q_len=6"):
        request_attention_mask(6, 5, None)


def test_masked_attention_ref_all_masked_row_is_zero_and_one_key_copies_v():
    q = torch.randn(2, 2, 8)
    k = torch.randn(3, 1, 8)
    v = torch.randn(3, 1, 8)
    mask = torch.tensor([[False, False, False], [False, True, False]])
    out = masked_attention_ref(q, k, v, mask, 0.5)
    assert torch.equal(out[0], torch.zeros(2, 8))
    torch.testing.assert_close(out[1], v[1].expand(2, 8))


def test_tree_attention_ref_matches_brute_force():
    gen = torch.Generator().manual_seed(1)
    trees = [random_parents(6, gen), None, random_parents(2, gen)]
    args = make_batch([7, 4, 3], [5, 0, 9], trees, num_heads=4, num_kv_heads=2, head_dim=8,
                      block_size=4, dtype=torch.float64, gen=gen)
    args = {k: v.cpu() for k, v in args.items()}
    ref = tree_attention_ref(**args, scale=0.4)
    torch.testing.assert_close(ref, brute_force(args, trees, 0.4), atol=1e-10, rtol=1e-10)


# ---------------------------------------------------------------------------------------------
# The kernel against the reference.


def test_kernel_hand_built_tree_matches_brute_force():
    # root -> {node 0, node 1}, node 0 -> node 2: rows 0..3 with parents [-1, 0, 0, 1].
    gen = torch.Generator().manual_seed(0)
    trees = [[-1, 0, 0, 1]]
    args = make_batch([4], [5], trees, num_heads=2, num_kv_heads=1, head_dim=32,
                      block_size=16, dtype=torch.float32, gen=gen)
    out, _ = run_and_compare(args, 0.2, torch.float32)
    expected = brute_force(args, trees, 0.2).float()
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2)])
def test_kernel_ragged_mixed_batch(dtype, head_dim, block_size, num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(head_dim * 7 + block_size + num_heads)
    # tree, causal prefill chunk, tree with no context, plain decode, tree across blocks
    q_lens = [9, 13, 5, 1, 17]
    ctx_lens = [21, 40, 0, 33, 15]
    trees = [random_parents(8, gen), None, random_parents(4, gen), None, random_parents(16, gen)]
    args = make_batch(q_lens, ctx_lens, trees, num_heads=num_heads, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, block_size=block_size, dtype=dtype, gen=gen,
                      max_rows=20, spare_tokens=3)
    run_and_compare(args, head_dim**-0.5, dtype, block_n=16, max_query_len=17)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [2, 3, 7])
def test_kernel_split_context_equals_the_reference(dtype, num_splits):
    # Flash-decoding: each request's context in num_splits ranges of whole 16-key tiles, merged
    # by a second launch. Contexts 0 and 3 leave most splits empty; 40 keys in 7 splits of one
    # tile leave the last splits empty (the span still runs in the last one); a causal prefill
    # chunk and a plain decode share the launch; spare tokens stay unwritten (NaN).
    gen = torch.Generator().manual_seed(num_splits)
    q_lens = [9, 13, 5, 1, 17, 4]
    ctx_lens = [21, 40, 0, 33, 150, 3]
    trees = [random_parents(8, gen), None, random_parents(4, gen), None, random_parents(16, gen),
             random_parents(3, gen)]
    args = make_batch(q_lens, ctx_lens, trees, num_heads=8, num_kv_heads=2, head_dim=64,
                      block_size=16, dtype=dtype, gen=gen, max_rows=20, spare_tokens=3)
    run_and_compare(args, 0.125, dtype, block_n=16, max_query_len=17, num_splits=num_splits)


def test_split_count_fills_the_gpu_only_when_the_grid_is_small(monkeypatch):
    launcher = importlib.import_module("vllm_ddtree.kernels.tree_attention")  # the module
    monkeypatch.setattr(launcher, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    # one request, B = 16 (17 rows, 2 query blocks of 16 tokens), 8 kv heads: 16 programs
    assert launcher._num_splits(16, 16384, cuda) == 16  # each split >= 1024 keys
    assert launcher._num_splits(136, 16384, cuda) == 4  # B = 256: 17 query blocks; 4 per SM
    assert launcher._num_splits(16, 2048, cuda) == 2
    assert launcher._num_splits(16, 1300, cuda) == 1  # short context: no split
    assert launcher._num_splits(2, 10**6, cuda) == launcher.MAX_SPLITS  # at most 32
    assert launcher._num_splits(528, 16384, cuda) == 1  # the grid fills the GPU already
    assert launcher._num_splits(16, None, cuda) == 1  # unknown lengths: no split, no sync
    assert launcher._num_splits(16, 16384, torch.device("cpu")) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80])
def test_kernel_default_tiles_and_odd_group(dtype, head_dim):
    # 12 heads over 4 kv heads: group 3 padded to 4; head_dim 80 padded to 128; int64 indices;
    # the launcher picks the tiles and reads max_query_len from query_start_loc.
    gen = torch.Generator().manual_seed(3)
    trees = [random_parents(30, gen), random_parents(1, gen), None]
    args = make_batch([31, 2, 70], [100, 3, 0], trees, num_heads=12, num_kv_heads=4,
                      head_dim=head_dim, block_size=16, dtype=dtype, gen=gen)
    for name in ("seq_lens", "query_start_loc", "block_table"):
        args[name] = args[name].long()
    run_and_compare(args, 0.125, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_with_build_tree_trees(dtype):
    # DDTree trees: best-first node order, padding nodes, per-request budgets.
    gen = torch.Generator().manual_seed(5)
    budget = 24
    logits = torch.randn(3, 7, 50, generator=gen) * 3
    tree = build_tree(logits, torch.tensor([24, 10, 3]), max_budget=budget)
    q_len = budget + 1  # every request verifies root + max_budget rows (padding rows included)
    args = make_batch([q_len] * 3, [19, 64, 1], [None] * 3, num_heads=4, num_kv_heads=1,
                      head_dim=32, block_size=16, dtype=dtype, gen=gen)
    args["tree_mask"] = tree.ancestor_mask.to(DEVICE)
    args["has_tree"] = torch.ones(3, dtype=torch.bool, device=DEVICE)
    run_and_compare(args, 0.3, dtype, block_n=32)


def test_kernel_1024_node_tree():
    # q_len 1025 needs 33 mask words per row; bit 31 makes words negative.
    gen = torch.Generator().manual_seed(11)
    parents = [-1] + [int(torch.randint(max(0, i - 40), i, (1,), generator=gen))
                      for i in range(1, 1025)]
    args = make_batch([1025], [37], [parents], num_heads=1, num_kv_heads=1, head_dim=32,
                      block_size=32, dtype=torch.float32, gen=gen)
    assert args["tree_mask"].shape == (1, 1025, 33)
    run_and_compare(args, 0.2, torch.float32, block_q=64, block_n=128)


def test_kernel_non_ancestor_bits_are_respected():
    # A mask that is not lower-triangular (row 0 sees column 2) must still be followed exactly.
    gen = torch.Generator().manual_seed(2)
    args = make_batch([3], [4], [[-1, 0, 0]], num_heads=1, num_kv_heads=1, head_dim=32,
                      block_size=16, dtype=torch.float32, gen=gen)
    args["tree_mask"][0, 0, 0] = 0b101
    out, ref = run_and_compare(args, 0.5, torch.float32, block_n=16)
    args["tree_mask"][0, 0, 0] = 0b001
    out2 = tree_attention(**args, scale=0.5)
    assert not torch.allclose(out[0], out2[0]), "the bit above the diagonal had no effect"


# ---------------------------------------------------------------------------------------------
# Input checks and import without a launchable backend.


def test_kernel_rejects_bad_inputs_with_messages():
    gen = torch.Generator().manual_seed(0)
    args = make_batch([3], [4], [[-1, 0, 0]], num_heads=2, num_kv_heads=1, head_dim=32,
                      block_size=16, dtype=torch.float32, gen=gen)
    with pytest.raises(ValueError, match=r"tree_mask.shape=\(1, 3, 1, 1\)"):
        tree_attention(**{**args, "tree_mask": args["tree_mask"][..., None]}, scale=1.0)
    with pytest.raises(ValueError, match="num_heads=3 is not a multiple of num_kv_heads=2"):
        bad_q = torch.zeros(3, 3, 32, device=DEVICE)
        kc = args["k_cache"].repeat(1, 1, 2, 1)
        tree_attention(**{**args, "q": bad_q, "k_cache": kc, "v_cache": kc}, scale=1.0)
    with pytest.raises(ValueError, match="has_tree.dtype"):
        tree_attention(**{**args, "has_tree": args["has_tree"].int()}, scale=1.0)
    with pytest.raises(ValueError, match=r"query_start_loc.shape=\(3,\)"):
        qsl = torch.tensor([0, 1, 3], dtype=torch.int32, device=DEVICE)
        tree_attention(**{**args, "query_start_loc": qsl}, scale=1.0)


def test_import_without_launchable_triton_and_cpu_errors_name_the_fallbacks():
    code = (
        "import torch, vllm_ddtree.kernels as K\n"
        "x = torch.zeros(1, 1, 32)\n"
        "try:\n"
        "    K.tree_attention(x, x[None], x[None], torch.zeros(1, 1, dtype=torch.int32),\n"
        "        torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),\n"
        "        torch.ones(1, 1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.bool), 1.0)\n"
        "except ValueError as e:\n"
        "    assert 'tree_attention_ref' in str(e), e\n"
        "    print('ok')\n"
        "try:\n"
        "    K.compact_kv([(x[None, None], x[None, None])], torch.tensor([0]), torch.tensor([0]))\n"
        "except ValueError as e:\n"
        "    assert 'compact_kv_ref' in str(e), e\n"
        "    print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.split() == ["ok", "ok"], res.stderr
