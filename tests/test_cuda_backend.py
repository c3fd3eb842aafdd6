"""The CUDA attention backend of the plugin (DDTreeTritonBackend), exercised without a GPU.

On the CPU the Triton kernels run in the interpreter (TRITON_INTERPRET=1, set for this module's
tests only, as in test_kernels_attention.py). Oracles: ``tree_attention_ref`` (torch) for the
verify forward through the backend's impl on vLLM's CUDA cache layout, ``compact_kv_ref`` for
the compaction on that layout, and plain expectations for the metadata and engine-start
checks. What is NOT covered here: the backend inside a running vLLM engine on a GPU.
"""

from types import SimpleNamespace

import pytest
import torch
from triton_utils import interpreter_on_cpu
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata

from vllm_ddtree.kernels import compact_kv_ref, tree_attention_ref
from vllm_ddtree.plugin import patches
from vllm_ddtree.plugin.cuda_attention import (
    DDTreeTritonImpl,
    DDTreeTritonMetadata,
    DDTreeTritonMetadataBuilder,
    compact_cuda_kv,
    kv_views,
    tree_mask_info,
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


def test_tree_mask_info_marks_tree_requests_only():
    gen = torch.Generator().manual_seed(0)
    state = TreeState(DDTreeOptions(budget=9, depth=4), torch.device("cpu"))
    verify = verify_batch(state, gen, num_draft=[9, 0, 5], q_lens=[10, 7, 6])
    info = tree_mask_info(verify, torch.device("cpu"))
    assert info.has_tree.tolist() == [True, False, True]
    assert torch.equal(info.tree_mask, verify.tree.ancestor_mask)
    assert info.tree_mask.shape == (3, 10, 1) and info.tree_mask.dtype == torch.int32
    assert tree_mask_info(verify_batch(state, gen, [0, 0], [5, 3]), torch.device("cpu")) is None
    assert tree_mask_info(None, torch.device("cpu")) is None


@pytest.mark.parametrize("physical_nhd", [False, True])
def test_verify_forward_matches_reference(physical_nhd):
    """A batch of two trees (one truncated by the scheduler) and a causal prefill chunk."""
    gen = torch.Generator().manual_seed(1)
    state = TreeState(DDTreeOptions(budget=12, depth=5), torch.device("cpu"))
    num_draft, q_lens, ctx = [12, 0, 7], [13, 20, 8], [37, 5, 70]
    verify = verify_batch(state, gen, num_draft, q_lens)
    info = tree_mask_info(verify, torch.device("cpu"))
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


def test_unsupported_layer_features_fail_loudly():
    impl = DDTreeTritonImpl(NUM_HEADS, HEAD_DIM, 1.0, NUM_KV_HEADS, None, 64, "auto")
    meta = SimpleNamespace(ddtree=object())
    with pytest.raises(NotImplementedError, match="sliding window"):
        impl.forward(None, None, None, None, None, meta, None)


@pytest.mark.parametrize("physical_nhd", [False, True])
def test_compaction_on_the_cuda_layout(physical_nhd):
    gen = torch.Generator().manual_seed(2)
    caches = [cuda_layout_cache(gen, physical_nhd) for _ in range(3)]
    original = [c.clone() for c in caches]
    before = [c.clone() for c in caches]
    # the tree pattern: accepted nodes move down onto the first draft slots (overlapping)
    src = torch.tensor([-1, 44, 48, 51, 100, -1], dtype=torch.int64)
    dst = torch.tensor([-1, 42, 43, 44, 97, 7], dtype=torch.int64)
    compact_cuda_kv(caches, HEAD_DIM, src, dst)
    expected = [kv_views(c, HEAD_DIM) for c in before]
    keep = (src >= 0) & (dst >= 0)
    compact_kv_ref(expected, src[keep], dst[keep])
    for got, (k, v) in zip(caches, expected):
        got_k, got_v = kv_views(got, HEAD_DIM)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert not torch.equal(caches[0], original[0])  # something moved


def test_cudagraph_support_is_piecewise_for_ddtree_only():
    ddtree = SimpleNamespace(additional_config={"ddtree": DDTreeOptions(8, 7).to_dict()})
    stock = SimpleNamespace(additional_config={})
    assert DDTreeTritonMetadataBuilder.get_cudagraph_support(ddtree, None) == (
        AttentionCGSupport.NEVER)
    assert DDTreeTritonMetadataBuilder.get_cudagraph_support(stock, None) == (
        AttentionCGSupport.ALWAYS)
    assert issubclass(DDTreeTritonMetadata, TritonAttentionMetadata)


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
