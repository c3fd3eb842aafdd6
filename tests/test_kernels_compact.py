"""compact_kv (Triton, one launch for all layers) against compact_kv_ref and a snapshot model.

The independent oracle is a snapshot: ``expected[dst[n]] = before[src[n]]`` (every source read
before any write). On the CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set by a module
fixture before the kernel module is first imported); with CUDA the same cases run natively.
"""


import pytest
import torch
from triton_utils import interpreter_on_cpu

from vllm_ddtree.kernels import KVCacheTable, compact_kv, compact_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, scope="module")
def triton_interpreter():
    with interpreter_on_cpu(DEVICE):
        yield


def vllm_layer_caches(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, gen):
    """Per layer (K, V): strided halves of one [num_blocks, num_kv_heads, block_size, 2 * D]
    tensor, as vLLM 0.32's FlashAttention/Triton backends view it."""
    layers = []
    for _ in range(num_layers):
        raw = torch.randn(num_blocks, num_kv_heads, block_size, 2 * head_dim, generator=gen)
        raw = raw.to(dtype).to(DEVICE)
        k, v = raw.transpose(1, 2).split(head_dim, dim=-1)
        layers.append((k, v))
    return layers


def snapshot_model(layers, src, dst):
    """Expected caches: copies of the originals with dst[n] <- original src[n] (skip -1)."""
    expected = []
    for layer in layers:
        pair = []
        for cache in layer:
            block_size = cache.shape[1]
            before = cache.clone()
            after = cache.clone()
            for s, d in zip(src.tolist(), dst.tolist()):
                if s >= 0 and d >= 0:
                    after[d // block_size, d % block_size] = before[s // block_size, s % block_size]
            pair.append(after)
        expected.append(tuple(pair))
    return expected


def assert_caches_equal(layers, expected):
    for i, (layer, exp) in enumerate(zip(layers, expected)):
        for name, got, want in zip("KV", layer, exp):
            # compare bit patterns: NaN-safe and exact for every dtype
            assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), \
                f"layer {i} {name} differs"


def test_hand_example_accepted_nodes_move_down():
    # Draft region at slots 40..47 (root at 40). Accepted nodes at slots 43 and 47 -> 41, 42.
    gen = torch.Generator().manual_seed(0)
    layers = vllm_layer_caches(2, 4, 16, 1, 32, torch.float32, gen)
    before = [tuple(c.clone() for c in layer) for layer in layers]
    src = torch.tensor([43, 47], device=DEVICE)
    dst = torch.tensor([41, 42], device=DEVICE)
    compact_kv(layers, src, dst)
    for layer, old in zip(layers, before):
        for cache, old_cache in zip(layer, old):
            assert torch.equal(cache[2, 9], old_cache[2, 11])  # slot 41 = block 2, offset 9
            assert torch.equal(cache[2, 10], old_cache[2, 15])
            cache[2, 9:11] = old_cache[2, 9:11]
            assert torch.equal(cache, old_cache), "a slot other than 41 and 42 changed"


@pytest.mark.parametrize("block_s", [None, 1, 2, 16])
def test_chain_overlap_dst_equals_previous_src(block_s):
    # dst[n] == src[n - 1]: every accepted node moves down by one, inside one tile (None: the
    # default puts all 30 slots in one tile) and across tiles of 1, 2 and 16 slots.
    gen = torch.Generator().manual_seed(1)
    layers = vllm_layer_caches(3, 3, 16, 2, 32, torch.float32, gen)
    src = torch.arange(10, 40, device=DEVICE)  # crosses block boundaries at slots 16 and 32
    dst = src - 1
    expected = snapshot_model(layers, src, dst)
    compact_kv(layers, src, dst, block_s=block_s)
    assert_caches_equal(layers, expected)


def test_padding_slots_are_skipped():
    gen = torch.Generator().manual_seed(2)
    layers = vllm_layer_caches(1, 4, 16, 2, 32, torch.float32, gen)
    src = torch.tensor([5, -1, 9, 30], device=DEVICE)
    dst = torch.tensor([3, 7, -1, 20], device=DEVICE)
    expected = snapshot_model(layers, src, dst)
    compact_kv(layers, src, dst)
    assert_caches_equal(layers, expected)


def random_compaction(batch, block_size, num_blocks, max_nodes, gen):
    """Per request: a shuffled block table, a draft region of 1 + nodes positions after a
    random context, and an accepted path (increasing node indices). Returns flat src/dst slots
    (accepted node i of the path moves to position root + 1 + i), padded with -1."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    blocks_per_req = num_blocks // batch
    src, dst = [], []
    for r in range(batch):
        table = perm[r * blocks_per_req:(r + 1) * blocks_per_req]
        capacity = blocks_per_req * block_size
        nodes = int(torch.randint(1, max_nodes + 1, (1,), generator=gen))
        root = int(torch.randint(0, capacity - nodes, (1,), generator=gen))
        path_len = int(torch.randint(0, nodes + 1, (1,), generator=gen))
        path = sorted(torch.randperm(nodes, generator=gen)[:path_len].tolist())

        def slot(pos):
            return table[pos // block_size] * block_size + pos % block_size

        for i, node in enumerate(path):
            src.append(slot(root + 1 + node))
            dst.append(slot(root + 1 + i))
        src.append(-1)  # padding between requests, as a fixed-shape caller would leave
        dst.append(-1)
    return torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16,
                                   torch.float8_e4m3fn])
@pytest.mark.parametrize("block_size", [16, 32])
def test_random_tree_compactions_match_snapshot_and_ref(dtype, block_size):
    gen = torch.Generator().manual_seed(block_size + dtype.itemsize)
    num_blocks = 24
    layers = vllm_layer_caches(4, num_blocks, block_size, 2, 64, dtype, gen)
    twins = [tuple(c.clone() for c in layer) for layer in layers]
    src, dst = random_compaction(batch=4, block_size=block_size, num_blocks=num_blocks,
                                 max_nodes=40, gen=gen)
    expected = snapshot_model(layers, src, dst)
    table = KVCacheTable.from_caches(layers)
    compact_kv(table, src.int(), dst.int(), block_s=4)
    assert_caches_equal(layers, expected)
    compact_kv_ref(twins, src, dst)
    assert_caches_equal(twins, expected)


@pytest.mark.parametrize("depth", [1, 3, 15, 70])
def test_groups_of_one_request_each_move_in_parallel(depth):
    # As the plugin calls it: per request ``depth`` pairs (its accepted path, -1 padded), the
    # groups moved in parallel. Paths accept consecutive nodes too, so a pair's destination is
    # often an earlier pair's source (70 > 64: a group in several tiles).
    gen = torch.Generator().manual_seed(depth)
    batch, block_size = 5, 16
    num_blocks = batch * (3 * depth // block_size + 2)  # room for a 2 * depth draft region
    layers = vllm_layer_caches(2, num_blocks, block_size, 2, 32, torch.bfloat16, gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    per_req = num_blocks // batch
    src, dst = [], []
    for r in range(batch):
        table = perm[r * per_req:(r + 1) * per_req]

        def slot(pos):
            return table[pos // block_size] * block_size + pos % block_size

        root = int(torch.randint(0, per_req * block_size - 2 * depth - 1, (1,), generator=gen))
        length = int(torch.randint(0, depth + 1, (1,), generator=gen))
        nodes = sorted(torch.randperm(2 * depth, generator=gen)[:length].tolist())
        if r == 0:
            nodes = list(range(1, depth + 1))  # every node one row down: dst[n] == src[n-1]
        pairs = [(slot(root + 1 + node), slot(root + 1 + i)) for i, node in enumerate(nodes)]
        pairs += [(-1, -1)] * (depth - len(pairs))
        src += [p[0] for p in pairs]
        dst += [p[1] for p in pairs]
    src, dst = torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE)
    expected = snapshot_model(layers, src, dst)
    compact_kv(layers, src, dst, group_size=depth)
    assert_caches_equal(layers, expected)
    with pytest.raises(ValueError, match=f"group_size={depth + 1} must be >= 1 and divide"):
        compact_kv(layers, src, dst, group_size=depth + 1)


def test_table_is_reusable_and_contiguous_caches_work():
    gen = torch.Generator().manual_seed(4)
    layers = [tuple(torch.randn(2, 6, 16, 4, 32, generator=gen).to(DEVICE).unbind(0))
              for _ in range(3)]
    table = KVCacheTable.from_caches(layers)
    for step in range(3):
        src = torch.tensor([10 + step, 12 + step], device=DEVICE) + 16 * step
        dst = src - 1 - torch.arange(2, device=DEVICE)
        expected = snapshot_model(layers, src, dst)
        compact_kv(table, src, dst)
        assert_caches_equal(layers, expected)


def test_rejects_mixed_caches_and_bad_slots():
    gen = torch.Generator().manual_seed(5)
    layers = vllm_layer_caches(2, 4, 16, 2, 32, torch.float32, gen)
    other = torch.zeros(4, 16, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="one KVCacheTable per group"):
        compact_kv(layers + [(other, other)], torch.tensor([1]), torch.tensor([0]))
    with pytest.raises(ValueError, match="src_slots.dtype"):
        compact_kv(layers, torch.tensor([1.0], device=DEVICE), torch.tensor([0.0], device=DEVICE))
    with pytest.raises(ValueError, match=r"src_slots.shape=\(2,\), dst_slots.shape=\(1,\)"):
        compact_kv(layers, torch.tensor([1, 2], device=DEVICE), torch.tensor([0], device=DEVICE))


@pytest.mark.parametrize("num_slots", [1, 7, 64])
def test_arbitrary_overlap_in_one_tile_reads_all_sources_first(num_slots):
    # Sources and destinations drawn independently from the same few blocks: cycles, swaps,
    # dst > src. The default single tile must behave like a snapshot (the contract).
    gen = torch.Generator().manual_seed(num_slots)
    layers = vllm_layer_caches(2, 5, 16, 2, 32, torch.bfloat16, gen)
    src = torch.randint(0, 80, (num_slots,), generator=gen).to(DEVICE)
    dst = torch.randperm(80, generator=gen)[:num_slots].to(DEVICE)  # distinct destinations
    expected = snapshot_model(layers, src, dst)
    compact_kv(layers, src, dst)
    assert_caches_equal(layers, expected)


def test_swap_of_two_slots():
    gen = torch.Generator().manual_seed(9)
    layers = vllm_layer_caches(1, 2, 16, 1, 32, torch.float32, gen)
    k0 = layers[0][0].clone()
    compact_kv(layers, torch.tensor([3, 20], device=DEVICE), torch.tensor([20, 3], device=DEVICE))
    assert torch.equal(layers[0][0][1, 4], k0[0, 3]) and torch.equal(layers[0][0][0, 3], k0[1, 4])


def test_flat_list_and_stacked_tensor_inputs():
    gen = torch.Generator().manual_seed(6)
    stacked = torch.randn(3, 2, 4, 16, 2, 32, generator=gen).to(DEVICE)  # [layers, K/V, ...]
    twin = stacked.clone()
    flat = [c for layer in twin for c in layer]  # [K0, V0, K1, ...] views into twin
    src = torch.tensor([17, 30, 33], device=DEVICE)
    dst = torch.tensor([16, 17, 18], device=DEVICE)
    expected = snapshot_model([tuple(layer) for layer in stacked], src, dst)
    compact_kv(stacked, src, dst)
    compact_kv(flat, src, dst)
    assert_caches_equal([tuple(layer) for layer in stacked], expected)
    assert_caches_equal([tuple(layer) for layer in twin], expected)
