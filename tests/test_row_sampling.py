"""Flat verify rows sampled in chunks (vllm_ddtree.sampling): row_chunks, verify_rows,
RowSampling, sample_rows, and the chunked drafter log-softmax of build_tree.

Oracle for sample_rows: vLLM's own ``Sampler`` on the same ``[T, V]`` logits, every row its own
request (what vLLM does without speculation), the seeded rows drawing from their request's
generator in row order. With every random row seeded the draws are deterministic, so the
comparison is exact (``torch.equal``), whatever the chunk size.
"""

import pytest
import torch

import vllm_ddtree.sampling as sampling_module
from vllm_ddtree.sampling import (
    RowSampling,
    SamplingBatch,
    processed_logits,
    row_chunks,
    sample_rows,
    verify_rows,
)
from vllm_ddtree.tree import _ranked_log_probs


def test_row_chunks_docstring_example():
    assert row_chunks(300, 151936) == [(0, 110), (110, 220), (220, 300)]
    assert row_chunks(0, 10) == []
    assert row_chunks(3, 10, max_elements=1) == [(0, 1), (1, 2), (2, 3)]  # at least one row


def test_verify_rows_docstring_example():
    cu = torch.tensor([4, 5, 8], dtype=torch.int32)
    assert verify_rows(cu, 3).tolist() == [[0, 1, 2, 3], [4, 4, 4, 4], [5, 6, 7, 7]]


def test_row_sampling_expand_docstring_example():
    gen = torch.Generator()
    sampling = SamplingBatch(temperature=torch.tensor([0.6, 0.0]), top_k=torch.tensor([0, 5]),
                             top_p=torch.tensor([0.9, 1.0]), generators={0: gen})
    rows = RowSampling.expand(sampling, torch.tensor([2, 5], dtype=torch.int32), [1, 2], vocab=50)
    torch.testing.assert_close(rows.temperature, torch.tensor([0.6, 0.6, 1.0, 1.0, 1.0]))
    assert rows.is_greedy.tolist() == [False, False, True, True, True]
    assert rows.top_k.tolist() == [50, 50, 5, 5, 5]  # 0 (off) -> vocab
    assert [(r, g is gen) for r, g in rows.generators] == [(0, True), (1, True)]
    assert list(rows.generators_in(1, 4)) == [0]


def vllm_metadata(temperature, top_k, top_p, generators):
    """A real vLLM ``SamplingMetadata`` with one row per request, nothing but sampling."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    n = temperature.shape[0]
    greedy = temperature < 1e-5
    return SamplingMetadata(
        temperature=temperature, all_greedy=bool(greedy.all()), all_random=not bool(greedy.any()),
        top_p=top_p, top_k=top_k, generators=generators, max_num_logprobs=None,
        no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors())


# (temperature, top_k (vocab: off), top_p, seed or None) per request, with their draft counts
REQUESTS = [
    (0.6, 20, 0.95, 11),  # Qwen3's defaults
    (0.0, 64, 1.0, None),  # greedy
    (1.0, 64, 0.5, 12),  # top-p only
    (0.8, 3, 1.0, 13),  # top-k only
    (1.3, 64, 1.0, 14),  # neither
]
NUM_DRAFT = [5, 0, 3, 7, 2]


def _batch(vocab: int):
    temperature = torch.tensor([r[0] for r in REQUESTS])
    top_k = torch.tensor([min(r[1], vocab) for r in REQUESTS], dtype=torch.int32)
    top_p = torch.tensor([r[2] for r in REQUESTS])
    seeds = {i: r[3] for i, r in enumerate(REQUESTS) if r[3] is not None}
    return temperature, top_k, top_p, seeds


@pytest.mark.parametrize("rows_per_chunk", [1, 3, 1000])
def test_sample_rows_equals_vllm_sampler_row_by_row(monkeypatch, rows_per_chunk):
    """Every flat row sampled by :func:`sample_rows` (chunks of 1, 3 or all rows) equals vLLM's
    Sampler run on the same ``[T, V]`` logits as T requests, each row seeded with its
    request's generator (same seed, rows in order); greedy rows take the raw argmax."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler
    from vllm.v1.sample.sampler import Sampler

    vocab = 64
    monkeypatch.setattr(sampling_module, "ROW_CHUNK_ELEMENTS", rows_per_chunk * vocab)
    gen = torch.Generator().manual_seed(0)
    num_rows = sum(NUM_DRAFT) + len(NUM_DRAFT)
    logits = (torch.randn(num_rows, vocab, generator=gen) * 3).round(decimals=1)  # ties too
    temperature, top_k, top_p, seeds = _batch(vocab)
    cu = torch.tensor(NUM_DRAFT).add(1).cumsum(0).to(torch.int32)
    sampling = SamplingBatch(temperature, top_k, top_p,
                             {r: torch.Generator().manual_seed(s) for r, s in seeds.items()})
    rows = RowSampling.expand(sampling, cu, NUM_DRAFT, vocab)
    ours = sample_rows(logits, rows, TopKTopPSampler())

    request = torch.repeat_interleave(torch.arange(len(NUM_DRAFT)), torch.tensor(NUM_DRAFT) + 1)
    theirs_gens = {r: torch.Generator().manual_seed(s) for r, s in seeds.items()}
    per_row = {int(i): theirs_gens[int(r)] for i, r in enumerate(request) if int(r) in theirs_gens}
    metadata = vllm_metadata(temperature[request], top_k[request], top_p[request], per_row)
    theirs = Sampler()(logits.clone(), metadata).sampled_token_ids[:, 0].long()
    assert torch.equal(ours, theirs)
    # and the samples live in the processed support
    processed = processed_logits(logits[:, None], SamplingBatch(temperature[request],
                                                                top_k[request], top_p[request]))
    assert torch.isfinite(processed[:, 0].gather(1, ours[:, None])).all()


def test_seeded_rows_do_not_depend_on_the_batch_or_the_chunks(monkeypatch):
    """A seeded request's rows are the same alone, in a batch, and whatever the chunk size."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    vocab = 40
    gen = torch.Generator().manual_seed(1)
    alone_logits = torch.randn(4, vocab, generator=gen)
    others = torch.randn(9, vocab, generator=gen)
    op = TopKTopPSampler()

    def run(logits, num_draft, r, rows_per_chunk):
        monkeypatch.setattr(sampling_module, "ROW_CHUNK_ELEMENTS", rows_per_chunk * vocab)
        n = len(num_draft)
        sampling = SamplingBatch(torch.full((n,), 0.7), torch.full((n,), 10), torch.full((n,), 0.9),
                                 {r: torch.Generator().manual_seed(5)})
        cu = torch.tensor(num_draft).add(1).cumsum(0).to(torch.int32)
        return sample_rows(logits, RowSampling.expand(sampling, cu, num_draft, vocab), op)

    alone = run(alone_logits, [3], 0, 1000)
    batched = run(torch.cat([others[:5], alone_logits, others[5:]]), [4, 3, 3], 1, 2)
    assert torch.equal(batched[5:9], alone)


@pytest.mark.parametrize("rows_per_chunk", [1, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ranked_log_probs_chunks_are_bit_identical(monkeypatch, rows_per_chunk, dtype):
    """The drafter's log-softmax + top-k, one chunk of (request, depth) rows at a time, equals
    the whole ``[batch, L, vocab]`` at once bit for bit (ties in bf16 included). The torch path:
    on the CPU float32 logits take the fused ``top_log_probs_``, which has no chunks."""
    monkeypatch.setenv("VLLM_DDTREE_NATIVE", "0")
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 5, 500, generator=gen) * 4).to(dtype)
    monkeypatch.setattr(sampling_module, "ROW_CHUNK_ELEMENTS", logits.numel())  # one chunk
    whole_values, whole_ids = _ranked_log_probs(logits, 20)
    assert torch.equal(whole_values, torch.log_softmax(logits, -1, dtype=torch.float32).topk(20).values)
    monkeypatch.setattr(sampling_module, "ROW_CHUNK_ELEMENTS", rows_per_chunk * 500)
    values, ids = _ranked_log_probs(logits, 20)
    assert torch.equal(values, whole_values)
    assert torch.equal(ids, whole_ids)


@pytest.mark.parametrize("num_draft", [[4], [3, 3, 3], [2, 0, 5]])
@pytest.mark.parametrize("all_random", [False, True])
def test_row_sampling_expand_equal_drafts_and_all_random(num_draft, all_random):
    """Equal draft counts broadcast each request's parameters instead of indexing them: the
    same rows as indexing row by row; ``all_random`` leaves out the greedy bookkeeping. vLLM's
    ops get contiguous top-k / top-p rows."""
    num_reqs, vocab = len(num_draft), 50
    temperature = torch.tensor([0.7, 1.2, 0.4][:num_reqs])
    if not all_random:
        temperature[-1] = 0.0
    sampling = SamplingBatch(temperature, top_k=torch.tensor([0, 7, 60][:num_reqs], dtype=torch.int32),
                             top_p=torch.tensor([0.9, 1.0, 0.5][:num_reqs]))
    cu = torch.tensor(num_draft).add(1).cumsum(0).to(torch.int32)
    rows = RowSampling.expand(sampling, cu, num_draft, vocab, all_random=all_random)
    request = torch.repeat_interleave(torch.arange(num_reqs), torch.tensor(num_draft) + 1)
    greedy = temperature[request] < 1e-5
    assert torch.equal(rows.temperature, torch.where(greedy, 1.0, temperature[request]))
    assert rows.is_greedy is None if all_random else torch.equal(rows.is_greedy, greedy)
    assert rows.top_k.tolist() == [[vocab, 7, vocab][r] for r in request.tolist()]
    assert rows.top_k.dtype == torch.int32 and rows.top_k.is_contiguous()
    assert torch.equal(rows.top_p, sampling.top_p[request]) and rows.top_p.is_contiguous()
    # vLLM's metadata holds the vocabulary size for "no top-k": taken as it is
    in_range = SamplingBatch(temperature, top_k=rows.top_k[cu.long() - 1], top_p=sampling.top_p)
    taken = RowSampling.expand(in_range, cu, num_draft, vocab, all_random, top_k_in_range=True)
    assert torch.equal(taken.top_k, rows.top_k) and taken.top_k.is_contiguous()
