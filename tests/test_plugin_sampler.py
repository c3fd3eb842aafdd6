"""TreeRejectionSampler (the walk in vLLM's sampler slot) on hand-made batches, no engine.

Oracles: plain decoding's rule at temperature 0 (accept while the draft equals the target's
argmax, then the argmax as the bonus), written out per request; vLLM's own ``Sampler`` on the
same flat logits (every random request seeded, so its draws are reproducible), walked in
Python; and, for ``hsd_chain``, :func:`vllm_ddtree.sampling.hsd_verify_sparse` on the dense
target law of each request with the same generator.
"""

import importlib.util
from pathlib import Path

import pytest
import torch
from sync_checker import NoHostSync, no_host_sync
from test_row_sampling import vllm_metadata
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

import vllm_ddtree.plugin.sampler as sampler_module
import vllm_ddtree.sampling as sampling_module
from vllm_ddtree.plugin.options import DDTreeOptions
from vllm_ddtree.plugin.sampler import TreeRejectionSampler
from vllm_ddtree.plugin.state import TreeState, chain_parents
from vllm_ddtree.sampling import (
    RowSampling,
    SamplingBatch,
    hsd_verify_sparse,
    keyed_exponential,
    pack_sparse_law,
    processed_logits,
    processed_probs_of_rows,
    seed_key,
    top_k_draft_law,
)
from vllm_ddtree.tree import DraftTree, _ancestor_mask, build_tree

ROOT = Path(__file__).resolve().parents[1]


def greedy(num_reqs: int):
    """vLLM's sampling metadata of ``num_reqs`` greedy requests without other features."""
    return vllm_metadata(torch.zeros(num_reqs), None, None, {})


def greedy_chain_output(drafts: list[int], logits: torch.Tensor) -> list[int]:
    out = []
    for i, token in enumerate(drafts):
        best = int(logits[i].argmax())
        out.append(best)
        if best != token:
            return out
    out.append(int(logits[len(drafts)].argmax()))
    return out


def test_warmup_batch_walks_the_widest_tree_not_the_budget(monkeypatch):
    """vLLM's warm-up: max_num_seqs requests with one draft each, budget 1024.

    The walk must see ``[R, 2]`` samples, and no vocabulary-sized tensor is padded: padding
    the logits to the budget (``[256, 1025, V]``) is what made budget 1024 run out of memory
    at engine start.
    """
    seen = []
    real_walk = sampler_module.walk
    monkeypatch.setattr(sampler_module, "walk", lambda tree, sampled, *rest: (
        seen.append(sampled.shape) or real_walk(tree, sampled, *rest)))
    state = TreeState(DDTreeOptions(budget=1024, depth=15), torch.device("cpu"))
    num_reqs, vocab = 256, 64
    drafts = [[int(t)] for t in torch.randint(0, vocab, (num_reqs,))]
    metadata = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    logits = torch.randn(2 * num_reqs, vocab)
    out = TreeRejectionSampler(state)(metadata, None, logits, greedy(len(metadata.num_draft_tokens))).sampled_token_ids
    assert seen == [torch.Size([num_reqs, 2])]
    # the warm-up's chains are not left for the attention of a later dummy forward (vLLM
    # captures CUDA graphs with dummy forwards after this run): a tree of another batch
    # shape there indexed rows that do not exist
    assert state.verify is None
    assert out.shape == (num_reqs, 2)
    for r in range(num_reqs):
        expected = greedy_chain_output(drafts[r], logits[2 * r: 2 * r + 2])
        assert out[r].tolist() == expected + [-1] * (2 - len(expected))


# one request per sampling kind: (temperature, top_k, top_p, seed)
SETTINGS = [(0.6, 20, 0.95, 21), (0.0, 50, 1.0, None), (1.0, 50, 0.8, 22), (0.8, 5, 1.0, 23)]


def _metadata(vocab):
    temperature = torch.tensor([s[0] for s in SETTINGS])
    top_k = torch.tensor([min(s[1], vocab) for s in SETTINGS], dtype=torch.int32)
    top_p = torch.tensor([s[2] for s in SETTINGS])
    gens = {r: torch.Generator().manual_seed(s[3]) for r, s in enumerate(SETTINGS) if s[3]}
    return vllm_metadata(temperature, top_k, top_p, gens)


def _tree_batch(budget, vocab, num_draft, seed=0):
    """A state holding real trees (build_tree) for 4 requests, their scheduled drafts (the
    first ``num_draft[r]`` nodes) and vLLM's spec-decode metadata for them."""
    gen = torch.Generator().manual_seed(seed)
    state = TreeState(DDTreeOptions(budget=budget, depth=4), torch.device("cpu"))
    tree = build_tree(torch.randn(len(num_draft), 4, vocab, generator=gen) * 2, budget)
    req_ids = [f"r{i}" for i in range(len(num_draft))]
    state.record_proposal(req_ids, tree)
    drafts = [tree.token_ids[r, :m].tolist() for r, m in enumerate(num_draft)]
    starts = [0]
    for m in num_draft[:-1]:
        starts.append(starts[-1] + m + 1)
    state.begin_verify(req_ids, num_draft, torch.tensor(sum(drafts, [])), starts,
                       sum(num_draft) + len(num_draft))
    state.sample_positions = _positions(num_draft)
    return state, SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))


def _positions(num_draft: list[int], context: int = 30) -> torch.Tensor:
    """What the runner's _prepare_inputs records for seeded rows: the position of the token
    each flat row predicts (request r's context is ``context + r`` tokens; node rows add their
    depth: here every tree is given its chain depth, which is all the sampler reads)."""
    return torch.cat([context + r + torch.arange(m + 1) for r, m in enumerate(num_draft)])

def _prefer_first_children(logits, tree, num_draft, boost: float) -> None:
    """Each root/node row of the flat ``logits`` strongly prefers the token of its first child."""
    for r in range(len(num_draft)):
        start, seen = sum(num_draft[:r]) + r, set()
        for k in range(num_draft[r]):
            parent = int(tree.parents[r, k])
            if parent not in seen:
                seen.add(parent)
                logits[start + parent + 1, int(tree.token_ids[r, k])] += boost


def _assert_python_walk(out, tree, num_draft, sampled: list[int]) -> int:
    """Each request's output row is the Python walk of the flat ``sampled`` tokens over its
    tree (accepted tokens, bonus, then -1); returns the deepest accepted path's length."""
    deepest = 0
    for r, m in enumerate(num_draft):
        start = sum(num_draft[:r]) + r
        children = {(int(tree.parents[r, k]), int(tree.token_ids[r, k])): k for k in range(m)}
        node, expect = -1, []
        while (node, sampled[start + node + 1]) in children:
            node = children[(node, sampled[start + node + 1])]
            expect.append(int(tree.token_ids[r, node]))
        expect.append(sampled[start + node + 1])
        deepest = max(deepest, len(expect) - 1)
        assert out[r].tolist() == expect + [-1] * (max(num_draft) + 1 - len(expect)), r
    return deepest



def _seeded_oracle(logits: torch.Tensor, row: int, seed: int, setting, position: int) -> int:
    """The token of a seeded row, independently: the reference processed law
    (sampling.processed_logits) and the position noise, by the exponential race."""
    batch = SamplingBatch(torch.tensor([setting[0]]), torch.tensor([setting[1]]),
                          torch.tensor([setting[2]]))
    probs = processed_logits(logits[row][None, None], batch).softmax(-1)[0, 0]
    noise = keyed_exponential(torch.tensor([seed_key(seed)]), torch.tensor([position]),
                              logits.shape[1])[0]
    return int((probs / noise).argmax())


@pytest.mark.parametrize("rows_per_chunk", [2, 1000])
def test_tree_sampler_walks_vllm_sampler_tokens(monkeypatch, rows_per_chunk):
    """Mixed batch (Qwen3's T 0.6 / top-k 20 / top-p 0.95, greedy, top-p only, top-k only),
    every random request seeded: the output is the Python walk of the tokens of the same flat
    rows drawn independently (greedy: vLLM's Sampler; seeded: the reference law with the noise
    of the row's position), whatever the chunk size."""
    from vllm.v1.sample.sampler import Sampler

    vocab, budget, num_draft = 50, 12, [12, 7, 12, 0]
    monkeypatch.setattr(sampling_module, "ROW_CHUNK_ELEMENTS", rows_per_chunk * vocab)
    state, metadata = _tree_batch(budget, vocab, num_draft)
    tree = state.verify.tree
    num_rows = sum(num_draft) + len(num_draft)
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(5)) * 2
    # make the walk go deep: each root/node row strongly prefers the token of its first child
    _prefer_first_children(logits, tree, num_draft, 6.0)
    out = TreeRejectionSampler(state)(metadata, None, logits, _metadata(vocab)).sampled_token_ids

    request = torch.repeat_interleave(torch.arange(4), torch.tensor(num_draft) + 1)
    theirs = _metadata(vocab)
    rows_md = vllm_metadata(theirs.temperature[request], theirs.top_k[request],
                            theirs.top_p[request], {})
    sampled = Sampler()(logits.clone(), rows_md).sampled_token_ids[:, 0].tolist()
    positions = state.sample_positions.tolist()
    for row, r in enumerate(request.tolist()):  # seeded rows: their position's noise
        if int(r) in theirs.generators:
            sampled[row] = _seeded_oracle(logits, row, SETTINGS[r][3], SETTINGS[r], positions[row])
    deepest = _assert_python_walk(out, tree, num_draft, sampled)
    assert deepest >= 2


def _hsd_batch(budget, vocab, seed=0):
    """hsd_chain state: 4 chains of ``budget`` drawn from the drafter's top-K law by the
    proposer's rule (request 1 greedy; request 3's scheduled drafts are not its chain)."""
    gen = torch.Generator().manual_seed(seed)
    metadata = _metadata(vocab)
    num_reqs = len(SETTINGS)
    drafter = torch.randn(num_reqs, budget, vocab, generator=gen) * 2
    probs, ids = top_k_draft_law(drafter, metadata.temperature, k=8)
    pick = torch.multinomial(probs.view(-1, probs.shape[-1]), 1, generator=gen).view(num_reqs, budget)
    chains = ids.gather(2, pick[..., None]).squeeze(2)
    parents = chain_parents(num_reqs, budget, torch.device("cpu"))
    tree = DraftTree(token_ids=chains, parents=parents,
                     depths=torch.arange(1, budget + 1).expand(num_reqs, budget),
                     scores=torch.zeros(num_reqs, budget), num_nodes=torch.full((num_reqs,), budget),
                     ancestor_mask=_ancestor_mask(parents, budget), max_depth=budget)
    state = TreeState(DDTreeOptions(budget=budget, depth=budget, mode="hsd_chain"), torch.device("cpu"))
    req_ids = [f"r{i}" for i in range(num_reqs)]
    state.record_proposal(req_ids, tree, (pack_sparse_law(probs, ids, vocab),))
    drafts = [chains[r].tolist() for r in range(num_reqs)]
    drafts[3] = [(t + 1) % vocab for t in drafts[3]]  # not the proposal: verified by the walk
    num_draft = [budget] * num_reqs
    state.begin_verify(req_ids, num_draft, torch.tensor(sum(drafts, [])),
                       [r * (budget + 1) for r in range(num_reqs)], num_reqs * (budget + 1))
    state.sample_positions = _positions(num_draft)
    return state, SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu")), probs, ids, drafts


@pytest.mark.parametrize("rows_per_chunk", [3, 1000])
def test_hsd_chain_sampler_equals_sparse_hsd_per_request(monkeypatch, rows_per_chunk):
    """hsd_chain: each seeded request's output is :func:`hsd_verify_sparse` on its own dense
    target law with its own generator (its walk rows draw with position noise, not from the
    generator); the greedy request follows the argmax rule; the request whose drafts are
    not its proposal is walked (here: the tokens vLLM's op draws for its rows)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    vocab, budget = 40, 4
    monkeypatch.setattr(sampling_module, "ROW_CHUNK_ELEMENTS", rows_per_chunk * vocab)
    state, metadata, probs, ids, drafts = _hsd_batch(budget, vocab)
    num_rows = 4 * (budget + 1)
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(8)) * 2
    for r in range(4):  # drafts likely under the target too
        logits[r * (budget + 1) + torch.arange(budget), torch.tensor(drafts[r])] += 4.0
    sampling = _metadata(vocab)
    out = TreeRejectionSampler(state)(metadata, None, logits, sampling).sampled_token_ids

    cu = torch.tensor([budget + 1] * 4).cumsum(0).to(torch.int32)
    batch = SamplingBatch(sampling.temperature, sampling.top_k, sampling.top_p)
    rows = RowSampling.expand(batch, cu, [budget] * 4, vocab)
    accepted = []
    for r in (0, 2):
        gen = torch.Generator().manual_seed(SETTINGS[r][3])
        target = processed_probs_of_rows(logits, torch.arange(r * (budget + 1), (r + 1) * (budget + 1)),
                                         rows, apply_top_k_top_p)
        num, expect = hsd_verify_sparse(torch.tensor([drafts[r]]), probs[r:r + 1], ids[r:r + 1],
                                        target[None], generator=gen)
        assert out[r].tolist() == expect[0].tolist(), r
        accepted.append(int(num))
    greedy = greedy_chain_output(drafts[1], logits[budget + 1: 2 * (budget + 1)])
    assert out[1].tolist() == greedy + [-1] * (budget + 1 - len(greedy))
    assert out[3, 0] >= 0 and state.verdict is None
    assert max(accepted) > 0


def test_hsd_chain_seeded_request_does_not_depend_on_the_batch():
    """The seeded request 0 gives the same output alone and with the other three."""
    vocab, budget = 40, 4
    state, metadata, probs, ids, drafts = _hsd_batch(budget, vocab)
    logits = torch.randn(4 * (budget + 1), vocab, generator=torch.Generator().manual_seed(8))
    together = TreeRejectionSampler(state)(metadata, None, logits, _metadata(vocab)).sampled_token_ids

    alone_state = TreeState(DDTreeOptions(budget=budget, depth=budget, mode="hsd_chain"),
                            torch.device("cpu"))
    tree = state.verify.tree
    one = DraftTree(**{f: (v[:1] if torch.is_tensor(v) else v)
                       for f, v in ((f, getattr(tree, f)) for f in tree.__dataclass_fields__)})
    alone_state.record_proposal(["r0"], one, (pack_sparse_law(probs[:1], ids[:1], vocab),))
    alone_state.begin_verify(["r0"], [budget], torch.tensor(drafts[0]), [0], budget + 1)
    alone_state.sample_positions = state.sample_positions[: budget + 1]  # its own positions
    md = _metadata(vocab)
    alone_md = vllm_metadata(md.temperature[:1], md.top_k[:1], md.top_p[:1], {0: md.generators[0]})
    alone_spec = SpecDecodeMetadata.make_dummy([drafts[0]], torch.device("cpu"))
    alone = TreeRejectionSampler(alone_state)(alone_spec, None, logits[: budget + 1],
                                              alone_md).sampled_token_ids
    assert torch.equal(together[0], alone[0])


SCOPE = ("vllm_ddtree/sampling.py", "vllm_ddtree/walk.py", "vllm_ddtree/plugin/sampler.py")


@pytest.mark.parametrize("mode", ["tree", "hsd_chain"])
def test_sampler_has_no_host_sync(mode):
    """The plugin's per-step sampling code (sampler, sampling, walk) reads no tensor value,
    makes no data-dependent shape and uploads no host data; vLLM's own op (which draws a CPU
    seed per seeded row with ``.item()``) is outside the scope."""
    vocab, budget = 40, 4
    if mode == "tree":
        state, metadata = _tree_batch(12, vocab, [12, 7, 12, 0])
        num_rows = 12 + 7 + 12 + 4
    else:
        state, metadata = _hsd_batch(budget, vocab)[:2]
        num_rows = 4 * (budget + 1)
    sampler = TreeRejectionSampler(state)
    logits = torch.randn(num_rows, vocab)
    checker = NoHostSync(scope=SCOPE)
    with no_host_sync(checker):
        sampler(metadata, None, logits, _metadata(vocab))
        sampler(metadata, None, logits, greedy(len(metadata.num_draft_tokens)))
    assert checker.num_checked > 0


def _benchmark_module():
    path = ROOT / "benchmarks" / "sampler_memory.py"
    spec = importlib.util.spec_from_file_location("sampler_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peak_memory_is_bounded_by_the_chunk(monkeypatch):
    """R=4 trees of B=64 over V=32000 at T 0.6 / top-k 20 / top-p 0.95, chunks of 16 rows:
    the sampler + walk add less than 0.6x the logits' bytes (the whole vocabulary sorted at
    once costs > 4x: the padded path of commit d38f397 adds 7x), measured with the CPU
    allocator's events (benchmarks/sampler_memory.py)."""
    bench = _benchmark_module()
    vocab, budget, num_draft = 32000, 64, [64] * 4
    state, metadata = _tree_batch(budget, vocab, num_draft)
    logits = torch.randn(sum(num_draft) + 4, vocab)
    sampling = bench.make_setting("sampled", 4, vocab, torch.device("cpu"))
    sampler = TreeRejectionSampler(state)
    size = logits.numel() * 4
    monkeypatch.setattr(sampling_module, "ROW_CHUNK_ELEMENTS", 16 * vocab)
    new = bench.peak_extra_bytes(lambda: sampler(metadata, None, logits, sampling)) / size
    old = bench.peak_extra_bytes(
        lambda: bench.old_tree_path(logits, state.verify.tree, num_draft, sampling)) / size
    assert new < 0.6, new
    assert old > 4, old


@pytest.mark.parametrize("num_draft", [[12, 12, 12], [12, 5, 0]])
def test_greedy_tree_sampler_is_the_argmax_walk(num_draft):
    """Greedy: the output is the Python walk of each row's argmax, in vLLM's int32 layout,
    whether the rows are a view (equal draft counts) or gathered by verify_rows."""
    vocab = 50
    state, metadata = _tree_batch(12, vocab, num_draft, seed=3)
    tree = state.verify.tree
    logits = torch.randn(sum(num_draft) + len(num_draft), vocab,
                         generator=torch.Generator().manual_seed(4))
    _prefer_first_children(logits, tree, num_draft, 8.0)  # deep walks
    out = TreeRejectionSampler(state)(metadata, None, logits, greedy(len(metadata.num_draft_tokens))).sampled_token_ids
    assert out.dtype == torch.int32 and out.shape == (len(num_draft), max(num_draft) + 1)
    deepest = _assert_python_walk(out, tree, num_draft, logits.argmax(-1).tolist())
    assert deepest >= 3
