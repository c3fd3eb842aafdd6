"""The CUDA attention backend of the plugin (DDTreeTritonBackend), exercised without a GPU.

On the CPU the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set for this module's
tests only, as in test_kernels_attention.py). Oracles: ``tree_attention_ref`` (torch) for the
verify forward through the backend's impl on vLLM's CUDA cache layout, ``compact_kv_ref`` for
the compaction on that layout, and plain expectations for the metadata and engine-start
checks. What is NOT covered here: the backend inside a running vLLM engine on a GPU.
"""

import importlib
from types import SimpleNamespace

import pytest
import torch
from sync_checker import NoHostSync, no_host_sync
from triton_utils import LaunchRecorder, interpreter_on_cpu
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata

from vllm_ddtree.kernels import compact_kv_ref, tree_attention, tree_attention_ref
from vllm_ddtree.plugin import patches
from vllm_ddtree.plugin.compaction import KVCompactor, kv_views
from vllm_ddtree.plugin.cuda_attention import (
    DDTreeTritonImpl,
    DDTreeTritonMetadata,
    DDTreeTritonMetadataBuilder,
    TreeMasks,
    warm_up_tree_attention,
)
from vllm_ddtree.plugin.options import DDTreeConfigError, DDTreeOptions
from vllm_ddtree.plugin.state import TreeState
from vllm_ddtree.tree import build_tree

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 32, 16, 24


@pytest.fixture(autouse=True, scope="module")
def triton_interpreter():
    with interpreter_on_cpu("cpu"):
        yield


def cuda_layout_cache(gen: torch.Generator, physical_nhd: bool) -> torch.Tensor:
    """A layer cache in vLLM's logical [nb, nkv, bs, 2D] order, HND or NHD in memory."""
    if physical_nhd:
        raw = torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 2 * HEAD_DIM, generator=gen)
        return raw.permute(0, 2, 1, 3)
    return torch.randn(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, generator=gen)


def verify_batch(state: TreeState, gen: torch.Generator, num_draft: list[int],
                 q_lens: list[int]):
    """A proposal from build_tree for requests r0.., then the scheduler's verify batch."""
    num_reqs, budget = len(num_draft), state.budget
    logits = torch.randn(num_reqs, state.depth, 50, generator=gen) * 3
    tree = build_tree(logits, budget)
    req_ids = [f"r{i}" for i in range(num_reqs)]
    state.record_proposal(req_ids, tree)
    drafts = torch.cat([tree.token_ids[r, :m].clamp(min=0) for r, m in enumerate(num_draft)])
    starts = [0]
    for n in q_lens[:-1]:
        starts.append(starts[-1] + n)
    return state.begin_verify(req_ids, num_draft, drafts, starts, sum(q_lens))


def tree_mask_info(verify, num_reqs: int | None = None):
    """The kernel inputs of ``verify`` in fresh TreeMasks buffers (budget 12, 8 requests)."""
    num_reqs = len(verify.num_draft) if num_reqs is None else num_reqs
    return TreeMasks(8, 12, torch.device("cpu")).fill(verify, num_reqs)


def test_tree_masks_mark_tree_requests_only_in_fixed_buffers():
    """TreeMasks: each step's masks go into the same buffers (a CUDA graph reads them at
    replay), in the top-left corner; requests without drafts and padding are causal."""
    gen = torch.Generator().manual_seed(0)
    state = TreeState(DDTreeOptions(budget=9, depth=4), torch.device("cpu"))
    masks = TreeMasks(5, 9, torch.device("cpu"))
    verify = verify_batch(state, gen, num_draft=[9, 0, 5], q_lens=[10, 7, 6])
    info = masks.fill(verify, 4)  # one padding request, as a graph's padded batch has
    assert info.has_tree.tolist() == [True, False, True, False]
    assert torch.equal(info.tree_mask[:3], verify.tree.ancestor_mask)
    assert info.tree_mask.shape == (4, 10, 1) and info.tree_mask.dtype == torch.int32
    again = masks.fill(verify_batch(state, gen, num_draft=[4, 4], q_lens=[5, 5]), 2)
    assert again.tree_mask.data_ptr() == info.tree_mask.data_ptr()
    assert again.has_tree.data_ptr() == info.has_tree.data_ptr()
    assert again.has_tree.tolist() == [True, True] and again.tree_mask.shape == (2, 10, 1)
    assert masks.fill(verify_batch(state, gen, [0, 0], [5, 3]), 2) is None
    assert masks.fill(None, 2) is None
    captured = masks.capture(3)
    assert captured.tree_mask.data_ptr() == info.tree_mask.data_ptr()
    assert captured.has_tree.tolist() == [True, True, True]


@pytest.mark.parametrize("physical_nhd", [False, True])
def test_verify_forward_matches_reference(physical_nhd):
    """A batch of two trees (one truncated by the scheduler) and a causal prefill chunk."""
    gen = torch.Generator().manual_seed(1)
    state = TreeState(DDTreeOptions(budget=12, depth=5), torch.device("cpu"))
    num_draft, q_lens, ctx = [12, 0, 7], [13, 20, 8], [37, 5, 70]
    verify = verify_batch(state, gen, num_draft, q_lens)
    info = tree_mask_info(verify)
    kv_cache = cuda_layout_cache(gen, physical_nhd)
    key_cache, value_cache = kv_views(kv_cache, HEAD_DIM)
    seq_lens = torch.tensor([c + q for c, q in zip(ctx, q_lens)], dtype=torch.int32)
    blocks_per_req = (int(seq_lens.max()) + BLOCK_SIZE - 1) // BLOCK_SIZE
    block_table = torch.randperm(NUM_BLOCKS, generator=gen)[: 3 * blocks_per_req]
    block_table = block_table.view(3, blocks_per_req).to(torch.int32)
    query_start_loc = torch.tensor([0, 13, 33, 41], dtype=torch.int32)
    num_tokens = 41
    query = torch.randn(num_tokens + 3, NUM_HEADS, HEAD_DIM, generator=gen)  # + padding rows
    meta = DDTreeTritonMetadata(
        num_actual_tokens=num_tokens, max_query_len=max(q_lens), query_start_loc=query_start_loc,
        max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=block_table,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64), seq_threshold_3D=0,
        num_par_softmax_segments=0, softmax_segm_output=None, softmax_segm_max=None,
        softmax_segm_expsum=None, causal=True, ddtree=info,
    )
    impl = DDTreeTritonImpl(NUM_HEADS, HEAD_DIM, HEAD_DIM**-0.5, NUM_KV_HEADS, None, None, "auto")
    output = torch.full((num_tokens + 3, NUM_HEADS * HEAD_DIM), float("nan"))
    impl.forward(None, query, None, None, kv_cache, meta, output)
    expected = tree_attention_ref(query[:num_tokens], key_cache, value_cache, block_table,
                                  seq_lens, query_start_loc, info.tree_mask, info.has_tree,
                                  HEAD_DIM**-0.5)
    got = output[:num_tokens].view(num_tokens, NUM_HEADS, HEAD_DIM)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert output[num_tokens:].isnan().all()  # padding rows untouched
    # the tree really matters: the causal answer differs on the node rows of request 0
    causal = tree_attention_ref(query[:num_tokens], key_cache, value_cache, block_table,
                                seq_lens, query_start_loc, info.tree_mask,
                                torch.zeros(3, dtype=torch.bool), HEAD_DIM**-0.5)
    assert not torch.allclose(causal[1:13], expected[1:13], atol=1e-3)


def test_fused_output_quantization_fails_loudly():
    """Layer features are refused at engine start (tests/test_vllm_support.py); fused output
    quantization is only visible in forward."""
    impl = DDTreeTritonImpl(NUM_HEADS, HEAD_DIM, 1.0, NUM_KV_HEADS, None, None, "auto")
    meta = SimpleNamespace(ddtree=object())
    with pytest.raises(NotImplementedError, match="fused output quantization"):
        impl.forward(None, None, None, None, None, meta, None, output_scale=torch.ones(1))


def fake_runner(caches, slot_mapping, *, drafter_layers=(), shared=(), impl=None, budget=12,
                max_blocks=8):
    """The runner attributes compaction and warm-up read: layers "L0".. with their caches (a
    layer of ``shared`` aliases L0's cache, as KV sharing does), one KV-cache group, and a
    persistent block table ``[4, max_blocks]`` whose device views keep its row stride."""
    names = [f"L{i}" for i in range(len(caches))] + list(shared)
    layers = {f"L{i}": SimpleNamespace(kv_cache=c, impl=impl) for i, c in enumerate(caches)}
    layers.update({name: SimpleNamespace(kv_cache=caches[0], impl=impl) for name in shared})
    table = torch.zeros(4, max_blocks, dtype=torch.int32)
    block_table = SimpleNamespace(slot_mapping=SimpleNamespace(gpu=slot_mapping),
                                  get_device_tensor=lambda n: table[:n])
    return SimpleNamespace(
        drafter=SimpleNamespace(_draft_attn_layer_names=set(drafter_layers)),
        kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(
            layer_names=names, kv_cache_spec=SimpleNamespace(head_size=HEAD_DIM))]),
        compilation_config=SimpleNamespace(static_forward_context=layers),
        input_batch=SimpleNamespace(block_table=[block_table]),
        ddtree_state=SimpleNamespace(budget=budget, depth=5),
    )


@pytest.mark.parametrize("physical_nhd", [False, True])
def test_compaction_on_the_cuda_layout(physical_nhd):
    """KVCompactor on vLLM's CUDA layout (Triton kernel, interpreted): target layers only,
    a KV-shared layer moved once, no host sync or pageable upload per step."""
    gen = torch.Generator().manual_seed(2)
    caches = [cuda_layout_cache(gen, physical_nhd) for _ in range(4)]  # L3: the drafter's
    before = [c.clone() for c in caches]
    slot_mapping = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:64]  # row -> slot
    runner = fake_runner(caches, slot_mapping, drafter_layers=["L3"], shared=["S0"])
    compactor = KVCompactor.of_v1_runner(runner, use_triton=True)
    assert [len(g.caches) for g in compactor.groups] == [3]  # L0 (= S0), L1, L2
    # the tree pattern: accepted nodes move down onto the first draft rows (overlapping)
    src_rows = torch.tensor([-1, 44, 48, 51, 60, -1], dtype=torch.int64)
    dst_rows = torch.tensor([-1, 42, 43, 44, 57, 7], dtype=torch.int64)
    checker = NoHostSync(scope=("vllm_ddtree/plugin/compaction.py", "kernels/compact_kv.py"),
                         allowed_uploads=(("plugin/state.py", "to_device"),))
    with no_host_sync(checker):  # one request: its pairs overlap (51 -> 44, 44 -> 42)
        compactor.compact(src_rows, dst_rows, num_tokens=64, num_requests=1)
    assert checker.num_checked > 0
    keep = (src_rows >= 0) & (dst_rows >= 0)
    for got, cache in zip(caches, before):
        if cache is before[3]:
            assert torch.equal(got, cache), "a drafter layer was compacted"
            continue
        expected = [kv_views(cache.clone(), HEAD_DIM)]
        compact_kv_ref(expected, slot_mapping[src_rows[keep]], slot_mapping[dst_rows[keep]])
        got_k, got_v = kv_views(got, HEAD_DIM)
        assert torch.equal(got_k, expected[0][0]) and torch.equal(got_v, expected[0][1])
        assert not torch.equal(got, cache)  # something moved


def test_kernels_compile_once_for_every_batch(monkeypatch):
    """The warm-up at engine start launches each kernel with the compile key of every verify
    step: serving batches of any size (1 to 300 moved slots, 1 to 4 requests) never compile."""
    import vllm_ddtree.kernels.compact_kv_kernel as compact_module
    import vllm_ddtree.kernels.tree_attention_kernel as attention_module

    compact_kv_launches = LaunchRecorder(compact_module.compact_kv_kernel)
    attention_launches = LaunchRecorder(attention_module.tree_attention_kernel)
    combine_launches = LaunchRecorder(attention_module.combine_splits_kernel)
    monkeypatch.setattr(compact_module, "compact_kv_kernel", compact_kv_launches)
    monkeypatch.setattr(attention_module, "tree_attention_kernel", attention_launches)
    monkeypatch.setattr(attention_module, "combine_splits_kernel", combine_launches)
    # the interpreter has no SMs: split the context in some steps as a small grid would
    launcher = importlib.import_module("vllm_ddtree.kernels.tree_attention")
    monkeypatch.setattr(launcher, "_num_splits", lambda programs, max_seq_len, device:
                        1 + programs % 3)
    gen = torch.Generator().manual_seed(3)
    caches = [cuda_layout_cache(gen, False) for _ in range(2)]
    slot_mapping = torch.arange(NUM_BLOCKS * BLOCK_SIZE)
    impl = DDTreeTritonImpl(NUM_HEADS, HEAD_DIM, HEAD_DIM**-0.5, NUM_KV_HEADS, None, None, "auto")
    runner = fake_runner(caches, slot_mapping, impl=impl, budget=12)
    compactor = KVCompactor.of_v1_runner(runner, use_triton=True)
    compactor.warm_up()
    warm_up_tree_attention(runner)
    warm = (set(compact_kv_launches.keys), set(attention_launches.keys),
            set(combine_launches.keys))
    assert [len(keys) for keys in warm] == [1, 2, 1]  # attention: unsplit and split
    for num_reqs in (1, 2, 3, 4, 60):  # L = 5 pairs per request
        rows = torch.randint(0, 300, (5 * num_reqs,), generator=gen)
        compactor.compact(rows, rows, num_tokens=300, num_requests=num_reqs)
    state = TreeState(DDTreeOptions(budget=12, depth=5), torch.device("cpu"))
    for num_draft in ([12], [3, 0], [12, 12, 1], [0, 7, 12, 2]):
        q_lens = [m + 1 if m else 5 for m in num_draft]
        verify = verify_batch(state, gen, num_draft, q_lens)
        num_reqs, num_tokens = len(num_draft), sum(q_lens)
        seq_lens = torch.tensor([q + 9 for q in q_lens], dtype=torch.int32)
        meta = DDTreeTritonMetadata(
            num_actual_tokens=num_tokens, max_query_len=max(q_lens),
            query_start_loc=torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).int(),
            max_seq_len=int(seq_lens.max()), seq_lens=seq_lens,
            block_table=runner.input_batch.block_table[0].get_device_tensor(num_reqs),
            slot_mapping=torch.zeros(num_tokens, dtype=torch.int64), seq_threshold_3D=0,
            num_par_softmax_segments=0, softmax_segm_output=None, softmax_segm_max=None,
            softmax_segm_expsum=None, causal=True,
            ddtree=tree_mask_info(verify),
        )
        query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen)
        impl.forward(None, query, None, None, caches[0], meta,
                     torch.empty(num_tokens, NUM_HEADS * HEAD_DIM))
    assert len(compact_kv_launches.keys) == 6 and len(attention_launches.keys) == 6
    assert len(combine_launches.keys) > 1, "no serving step split its context"
    assert (set(compact_kv_launches.keys), set(attention_launches.keys),
            set(combine_launches.keys)) == warm


def test_cudagraph_support_by_runner():
    """Full graphs of uniform tree batches on Model Runner V2; attention piecewise on V1."""
    v2 = SimpleNamespace(additional_config={"ddtree": DDTreeOptions(8, 7, runner="v2").to_dict()})
    v1 = SimpleNamespace(additional_config={"ddtree": DDTreeOptions(8, 7).to_dict()})
    stock = SimpleNamespace(additional_config={})
    assert DDTreeTritonMetadataBuilder.get_cudagraph_support(v2, None) == (
        AttentionCGSupport.UNIFORM_BATCH)
    assert DDTreeTritonMetadataBuilder.get_cudagraph_support(v1, None) == (
        AttentionCGSupport.NEVER)
    assert DDTreeTritonMetadataBuilder.get_cudagraph_support(stock, None) == (
        AttentionCGSupport.ALWAYS)
    assert issubclass(DDTreeTritonMetadata, TritonAttentionMetadata)


def test_vllm_captures_uniform_tree_batches_in_full_graphs():
    """vLLM's own resolution (V2) with the backend's support: full graphs for decode batches
    of B + 1 rows per request, piecewise for mixed ones, capture sizes in multiples of B + 1."""
    from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode

    budget = 8
    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                               cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                               cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64])
    mode = config.resolve_cudagraph_mode_and_sizes(
        AttentionCGSupport.UNIFORM_BATCH, "TRITON_ATTN", budget + 1, use_v2_model_runner=True,
        max_num_reqs=8)
    assert mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert mode.decode_mode() == CUDAGraphMode.FULL


def test_a_padded_graph_batch_attends_as_the_exact_batch():
    """A full graph replays the batch it captured: padded to its request count (query starts
    padded with the token count, sequence lengths 0, no tree), its masks at the buffers' full
    width, its context split for the longest sequence the engine allows. The real rows must
    equal those of the exact batch."""
    gen = torch.Generator().manual_seed(3)
    budget, num_reqs, padded = 6, 3, 5
    state = TreeState(DDTreeOptions(budget=budget, depth=4), torch.device("cpu"))
    verify = verify_batch(state, gen, [budget] * num_reqs, [budget + 1] * num_reqs)
    masks = TreeMasks(padded, budget, torch.device("cpu"))
    kv_cache = cuda_layout_cache(gen, False)
    ctx = [29, 3, 60]
    num_tokens = num_reqs * (budget + 1)
    seq_lens = torch.zeros(padded, dtype=torch.int32)
    seq_lens[:num_reqs] = torch.tensor([c + budget + 1 for c in ctx])
    blocks = (int(seq_lens.max()) + BLOCK_SIZE - 1) // BLOCK_SIZE
    block_table = torch.zeros(padded, blocks, dtype=torch.int32)
    block_table[:num_reqs] = torch.randperm(NUM_BLOCKS, generator=gen)[: num_reqs * blocks].view(
        num_reqs, blocks).int()
    qsl = torch.full((padded + 1,), num_tokens, dtype=torch.int32)
    qsl[: num_reqs + 1] = torch.arange(num_reqs + 1, dtype=torch.int32) * (budget + 1)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen)
    impl = DDTreeTritonImpl(NUM_HEADS, HEAD_DIM, HEAD_DIM**-0.5, NUM_KV_HEADS, None, None, "auto")

    def attend(reqs: int, info, max_seq_len: int, num_splits: int | None = None):
        meta = DDTreeTritonMetadata(
            num_actual_tokens=num_tokens, max_query_len=budget + 1,
            query_start_loc=qsl[: reqs + 1], max_seq_len=max_seq_len, seq_lens=seq_lens[:reqs],
            block_table=block_table[:reqs], slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
            seq_threshold_3D=0, num_par_softmax_segments=0, softmax_segm_output=None,
            softmax_segm_max=None, softmax_segm_expsum=None, causal=True, ddtree=info)
        output = torch.full((num_tokens, NUM_HEADS * HEAD_DIM), float("nan"))
        impl.forward(None, query, None, None, kv_cache, meta, output)
        return output

    exact = attend(num_reqs, masks.fill(verify, num_reqs), int(seq_lens.max()))
    info = masks.fill(verify, padded)
    replayed = attend(padded, info, 512)
    torch.testing.assert_close(replayed, exact, atol=1e-5, rtol=1e-5)
    assert not exact.isnan().any()
    # on CUDA a long max_seq_len splits the context (flash-decoding); the CPU never splits, so
    # the split launch is forced: empty splits of the short and padded requests merge to 0
    key_cache, value_cache = kv_views(kv_cache, HEAD_DIM)
    split = tree_attention(query, key_cache, value_cache, block_table, seq_lens, qsl,
                           info.tree_mask, info.has_tree, HEAD_DIM**-0.5,
                           max_query_len=budget + 1, num_splits=4)
    torch.testing.assert_close(split.view(num_tokens, -1), exact, atol=1e-5, rtol=1e-5)


@pytest.fixture
def cuda_platform(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    return monkeypatch


def engine_args(**kwargs):
    args = dict(kv_cache_dtype="auto", attention_backend=None, attention_config={})
    args.update(kwargs)
    return SimpleNamespace(**args)


def test_cuda_needs_the_opt_in(cuda_platform):
    cuda_platform.delenv(patches.CUDA_OPT_IN, raising=False)
    with pytest.raises(DDTreeConfigError, match=patches.CUDA_OPT_IN):
        patches._select_attention_backend(engine_args())


def test_cuda_selects_triton_and_refuses_what_it_cannot_run(cuda_platform):
    cuda_platform.setenv(patches.CUDA_OPT_IN, "1")
    args = engine_args()
    patches._select_attention_backend(args)
    assert args.attention_backend == "TRITON_ATTN"
    for chosen in ("TRITON_ATTN", "auto"):
        patches._select_attention_backend(engine_args(attention_backend=chosen))
    with pytest.raises(DDTreeConfigError, match="FLASH_ATTN.*drop --attention-backend"):
        patches._select_attention_backend(engine_args(attention_backend="FLASH_ATTN"))
    with pytest.raises(DDTreeConfigError, match="FLASHINFER"):
        patches._select_attention_backend(engine_args(attention_config={"backend": "FLASHINFER"}))
    with pytest.raises(DDTreeConfigError, match="kv_cache_dtype='fp8'"):
        patches._select_attention_backend(engine_args(kv_cache_dtype="fp8"))


def test_cpu_platform_needs_nothing():
    args = engine_args()
    patches._select_attention_backend(args)  # this machine: CPU
    assert args.attention_backend is None
