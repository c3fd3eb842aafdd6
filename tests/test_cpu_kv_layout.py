"""The plugin's reader/writer of vLLM's CPU KV cache (vllm_ddtree/plugin/cpu_attention.py).

Oracle: vLLM's own writer, ``ops.cpu_attn_reshape_and_cache``, for every kernel ISA this machine
runs (``vec`` and ``vec16`` everywhere on x86; ``amx`` for bf16 where the CPU has AMX tiles).
Writing through ``CPUKVLayout.index`` must leave the cache byte-identical to vLLM's writer,
``read`` must return what vLLM wrote, and ``copy_cpu_slots`` must equal re-writing the moved
tokens with vLLM's writer, for overlapping moves too.
"""

import pytest
import torch

from vllm_ddtree.kernels import masked_attention_ref
from vllm_ddtree.plugin.cpu_attention import (
    _write_with_vllm,
    copy_cpu_slots,
    cpu_kv_layout,
    slot_maps,
    tree_attention_info,
    tree_rows_attention,
)
from vllm_ddtree.tree import build_tree

AMX = torch.cpu._is_amx_tile_supported()
CASES = [
    # isa, dtype, block_size, num_kv_heads, head_dim
    ("vec", torch.float32, 32, 2, 32),
    ("vec", torch.float32, 128, 1, 128),
    ("vec", torch.bfloat16, 64, 3, 64),
    ("vec16", torch.float32, 16, 2, 48),
    pytest.param("amx", torch.bfloat16, 128, 2, 64,
                 marks=pytest.mark.skipif(not AMX, reason="this CPU has no AMX tiles")),
    pytest.param("amx", torch.bfloat16, 32, 1, 128,
                 marks=pytest.mark.skipif(not AMX, reason="this CPU has no AMX tiles")),
]


def random_kv(n, nkv, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, nkv, d, generator=gen).to(dtype)
    v = torch.randn(n, nkv, d, generator=gen).to(dtype)
    return k, v


def test_vec_maps_are_the_known_layout():
    """``vec``: K transposed per (block, head), ``[head_dim, block_size]``; V plain."""
    bs, d = 32, 64
    k_index, v_index = slot_maps("vec", torch.float32, bs, 2, d)
    offset = torch.arange(bs)[:, None]
    dim = torch.arange(d)[None, :]
    assert torch.equal(k_index, offset + bs * dim)
    assert torch.equal(v_index, offset * d + dim)


@pytest.mark.parametrize("isa,dtype,bs,nkv,d", CASES)
def test_read_and_write_match_vllms_writer(isa, dtype, bs, nkv, d):
    num_blocks = 4
    n = 3 * bs
    k, v = random_kv(n, nkv, d, dtype, seed=1)
    slots = torch.randperm(num_blocks * bs, generator=torch.Generator().manual_seed(2))[:n]
    expect = _write_with_vllm(isa, dtype, num_blocks, bs, nkv, d, k, v, slots)
    layout = cpu_kv_layout(expect, isa)
    got_k, got_v = layout.read(slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    ours = torch.zeros_like(expect)
    k_index, v_index = cpu_kv_layout(ours, isa).index(slots)  # the indices compaction writes
    ours.view(-1)[k_index], ours.view(-1)[v_index] = k, v
    assert torch.equal(ours.view(torch.int8 if dtype != torch.float32 else torch.int32),
                       expect.view(torch.int8 if dtype != torch.float32 else torch.int32))


@pytest.mark.parametrize("isa,dtype,bs,nkv,d", CASES)
def test_compaction_equals_rewriting_the_moved_tokens(isa, dtype, bs, nkv, d):
    """A verify span of 2 * bs tokens starting mid-block; the accepted nodes move down to the
    first draft slots, overlapping their own sources (node 3 -> slot 1 while node 1 -> ...)."""
    num_blocks = 4
    span = torch.arange(bs // 2, bs // 2 + 2 * bs)  # slots of the verify rows
    k, v = random_kv(span.numel(), nkv, d, dtype, seed=3)
    before = _write_with_vllm(isa, dtype, num_blocks, bs, nkv, d, k, v, span)
    rows_src = torch.tensor([2, 3, 5, 9, bs + 1, 2 * bs - 1])  # accepted rows (chain order)
    rows_dst = torch.arange(1, rows_src.numel() + 1)  # chain rows 1..6
    moved_k, moved_v = k.clone(), v.clone()
    moved_k[rows_dst], moved_v[rows_dst] = k[rows_src], v[rows_src]
    expect = _write_with_vllm(isa, dtype, num_blocks, bs, nkv, d, moved_k, moved_v, span)
    cache = before.clone()
    slots = torch.stack((span[rows_src], span[rows_dst]))  # (skipped pairs: the compactor test)
    copy_cpu_slots([cpu_kv_layout(c, isa) for c in (cache, before)], slots)  # two layers
    assert torch.equal(cache, expect) and torch.equal(before, expect)


def test_tree_rows_attention_is_the_reference_up_to_the_kernels_rounding():
    """fp32 (any ISA) and non-AMX ISAs: exactly the torch reference. AMX bf16: the same
    attention with the unnormalised probabilities rounded to bf16 (within bf16 error of the
    reference, and bit-equal to that rounding written out here)."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(5, 4, 32, generator=gen)
    k, v = torch.randn(2, 20, 2, 32, generator=gen)
    mask = torch.rand(5, 20, generator=gen) < 0.7
    mask[:, 0] = True
    for isa, dtype in (("vec", torch.float32), ("amx", torch.float32), ("vec", torch.bfloat16)):
        args = (q.to(dtype), k.to(dtype), v.to(dtype), mask, 0.2)
        assert torch.equal(tree_rows_attention(*args, isa), masked_attention_ref(*args))
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    got = tree_rows_attention(qb, kb, vb, mask, 0.2, "amx")
    ref = masked_attention_ref(qb, kb, vb, mask, 0.2)
    assert torch.allclose(got.float(), ref.float(), atol=2e-2, rtol=2e-2)
    kf = kb.float().repeat_interleave(2, dim=1)
    vf = vb.float().repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", qb.float(), kf) * 0.2
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = (scores - scores.amax(-1, keepdim=True)).exp()
    expect = torch.einsum("hqk,khd->qhd", weights.bfloat16().float(), vf)
    expect = expect / weights.sum(-1).transpose(0, 1)[..., None]
    assert torch.equal(got, expect.bfloat16())
    assert not torch.equal(got, ref)  # the rounding is really there


@pytest.mark.parametrize("isa,dtype", [("vec", torch.float32), ("vec16", torch.bfloat16)])
def test_batched_tree_rows_equal_the_reference_per_request(isa, dtype):
    """One verify step of three requests (the middle one without drafts) on a paged cache with
    scattered blocks: the step's slots and masks (:func:`tree_attention_info`), the flat cache
    gathers and the batched attention give, for every tree row (a request's root and its
    nodes), the torch reference over that request's context plus the row's ancestors (K/V
    written by vLLM's writer)."""
    bs, nkv, heads, d, budget = 16, 2, 4, 32, 6
    gen = torch.Generator().manual_seed(5)
    ctx, num_draft = [5, 30, 20], [3, 0, 6]
    tree = build_tree(torch.randn(3, 4, 50, generator=gen), torch.tensor(num_draft),
                      max_budget=budget)
    dense = tree.dense_mask()
    seq_lens = [c + m + 1 for c, m in zip(ctx, num_draft)]
    block_table = torch.randperm(12, generator=gen)[:9].view(3, 3).to(torch.int32)
    starts = [0, num_draft[0] + 1, num_draft[0] + 2]  # query rows: span of 0, 1 row of 1, ...
    num_rows = starts[-1] + num_draft[2] + 1
    positions = [torch.arange(n) for n in seq_lens]
    slots = [block_table[r, p // bs].long() * bs + p % bs for r, p in enumerate(positions)]
    k = torch.randn(sum(seq_lens), nkv, d, generator=gen).to(dtype)
    v = torch.randn(sum(seq_lens), nkv, d, generator=gen).to(dtype)
    cache = _write_with_vllm(isa, dtype, 12, bs, nkv, d, k, v, torch.cat(slots))
    q = torch.randn(num_rows, heads, d, generator=gen).to(dtype)

    requests = [(r, starts[r], m) for r, m in enumerate(num_draft) if m > 0]
    info = tree_attention_info(dense, requests, seq_lens, block_table, bs)
    k_index, v_index = cpu_kv_layout(cache, isa).index(info.slots)
    flat = cache.view(-1)
    got = tree_rows_attention(q[info.rows], flat[k_index], flat[v_index], info.mask, 0.3, isa)

    first = 0
    for r, start, m in [(r, starts[r], m) for r, m in enumerate(num_draft)]:
        n = seq_lens[r]
        if m:
            # the root row sees the context and itself, node i the context and its ancestors
            span = dense[r, :m + 1, :m + 1]
            assert torch.equal(span[0], torch.arange(m + 1) == 0)
            mask = torch.cat([torch.ones(m + 1, ctx[r], dtype=torch.bool), span], dim=1)
            want = masked_attention_ref(q[start:start + m + 1], k[first:first + n],
                                        v[first:first + n], mask, 0.3)
            i = [j for j, (rr, _, _) in enumerate(requests) if rr == r][0]
            assert torch.equal(info.rows[i, :m + 1], torch.arange(start, start + m + 1))
            assert int(info.valid[i].sum()) == m + 1
            torch.testing.assert_close(got[i, :m + 1].float(), want.float(), atol=2e-6 if
                                       dtype == torch.float32 else 1e-2, rtol=1e-3)
        first += n


def test_compactor_on_the_cpu_layout_skips_either_side_without_host_sync():
    """KVCompactor on vLLM's CPU layout: target layers only, a KV-shared layer moved once, a
    pair with a -1 on either side skipped (as a self-copy of the null block's slot), no host
    sync; every moved token reads back at its new slot, nothing else changes."""
    from types import SimpleNamespace

    from sync_checker import NoHostSync, no_host_sync

    from vllm_ddtree.plugin.compaction import KVCompactor

    isa, dtype, bs, nkv, d, num_blocks = "vec", torch.float32, 16, 2, 32, 8
    gen = torch.Generator().manual_seed(6)
    owned = bs + torch.randperm((num_blocks - 1) * bs, generator=gen)  # block 0: null block
    slot_mapping = owned[:64]  # query row -> slot
    caches = [_write_with_vllm(isa, dtype, num_blocks, bs, nkv, d,
                               *random_kv(owned.numel(), nkv, d, dtype, seed=10 + i), owned)
              for i in range(4)]  # L3: the drafter's
    before = [c.clone() for c in caches]
    layers = {f"L{i}": SimpleNamespace(kv_cache=c, isa=isa) for i, c in enumerate(caches)}
    layers["S0"] = SimpleNamespace(kv_cache=caches[0], isa=isa)  # shares L0's cache
    groups = [SimpleNamespace(layer_names=list(layers), kv_cache_spec=SimpleNamespace(head_size=d))]
    compactor = KVCompactor(groups, layers, {"L3"}, depth=4,
                            slot_mapping=lambda gid, n: slot_mapping[:n])
    assert [len(g.caches) for g in compactor.groups] == [3]  # L0 (= S0), L1, L2
    src_rows = torch.tensor([-1, 44, 48, 51, 60, -1, 9], dtype=torch.int64)
    dst_rows = torch.tensor([-1, 42, 43, 44, 57, 7, -1], dtype=torch.int64)
    checker = NoHostSync(scope=("vllm_ddtree/plugin/compaction.py",
                                "vllm_ddtree/plugin/cpu_attention.py"))
    with no_host_sync(checker):
        compactor.compact(src_rows, dst_rows, num_tokens=64, num_requests=1)
    assert checker.num_checked > 0
    moved = slot_mapping[torch.tensor([42, 43, 44, 57])]
    for got, cache in zip(caches, before):
        if cache is before[3]:
            assert torch.equal(got, cache), "a drafter layer was compacted"
            continue
        old = cpu_kv_layout(cache, isa)
        new = cpu_kv_layout(got, isa)
        want_k, want_v = old.read(slot_mapping[torch.tensor([44, 48, 51, 60])])
        got_k, got_v = new.read(moved)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        rest = torch.tensor([s for s in range(num_blocks * bs) if s not in moved.tolist()])
        assert torch.equal(torch.stack(new.read(rest)), torch.stack(old.read(rest)))
