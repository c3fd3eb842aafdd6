"""The transformers engine: greedy outputs equal plain greedy decoding; sampled outputs follow the
target's law (exact enumeration of the target vs a chi-square test)."""

import os

import pytest
import torch

from hf_utils import one_thread, tiny_drafter, tiny_target
from vllm_ddtree.hf.engine import METHODS, chain_tree, generate
from vllm_ddtree.tree import unpack_mask

PAIR = os.path.join(os.path.dirname(__file__), "..", "vllm_ddtree", "assets", "tiny_pair")


_threads = pytest.fixture(scope="module", autouse=True)(one_thread)


def greedy_reference(target, ids, n):
    """Plain greedy decoding with a full forward per token (no cache, no engine code)."""
    out = ids.clone()
    with torch.no_grad():
        for _ in range(n):
            nxt = target(input_ids=out).logits[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], dim=1)
    return out[0, ids.shape[1]:].tolist()


def test_chain_tree_is_causal():
    tree = chain_tree(torch.tensor([[5, 9, 2]]))
    assert tree.parents.tolist() == [[-1, 0, 1]] and tree.depths.tolist() == [[1, 2, 3]]
    assert torch.equal(unpack_mask(tree.ancestor_mask, 4)[0], torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("method,budget", [("ar", 0), ("chain", 0), ("ddtree", 1), ("ddtree", 5),
                                           ("ddtree", 24), ("chain_hsd", 0), ("chain_tokenwise", 0)])
def test_greedy_equals_plain_decoding_random_pair(method, budget):
    target = tiny_target()
    drafter = tiny_drafter(target, block_size=4)
    g = torch.Generator().manual_seed(3)
    for prompt_len in (1, 7):
        ids = torch.randint(0, 62, (1, prompt_len), generator=g)
        ref = greedy_reference(target, ids, 24)
        res = generate(target, drafter, ids, method=method, budget=max(budget, 1), max_new_tokens=24)
        assert res.output_ids == ref, (method, budget, prompt_len)
        assert sum(res.acceptance_lengths) + 1 >= 24  # prefill gives one token, rounds the rest


def test_greedy_equals_plain_decoding_tiny_pair():
    from transformers import AutoModelForCausalLM

    from vllm_ddtree.hf.drafter import DFlashDrafter

    target = AutoModelForCausalLM.from_pretrained(f"{PAIR}/target", dtype=torch.float32).eval()
    drafter = DFlashDrafter.from_pretrained(f"{PAIR}/drafter")
    ids = torch.tensor([[5, 300, 17, 1000, 42, 9]])
    ref = greedy_reference(target, ids, 40)
    taus = {}
    for method, budget in [("chain", 1), ("ddtree", 8), ("ddtree", 64)]:
        res = generate(target, drafter, ids, method=method, budget=budget, max_new_tokens=40)
        assert res.output_ids == ref, (method, budget)
        taus[method, budget] = res.tau
    assert all(t >= 1.0 for t in taus.values())


def test_stop_tokens_and_max_new_tokens():
    target = tiny_target()
    drafter = tiny_drafter(target)
    ids = torch.tensor([[1, 2, 3]])
    ref = greedy_reference(target, ids, 20)
    stop = ref[5]
    res = generate(target, drafter, ids, method="ddtree", budget=8, max_new_tokens=20, stop_token_ids=[stop])
    assert res.output_ids == ref[: ref.index(stop) + 1]
    res = generate(target, drafter, ids, method="chain", max_new_tokens=3)
    assert res.output_ids == ref[:3]


def test_timing_records_every_stage():
    target = tiny_target()
    res = generate(target, tiny_drafter(target), [1, 2, 3], method="ddtree", budget=4, max_new_tokens=8, timing=True)
    assert set(res.stage_times) == {"draft", "tree", "verify", "commit"}
    assert all(len(v) == len(res.num_accepted) and min(v) >= 0 for v in res.stage_times.values())


def test_bad_arguments():
    target = tiny_target()
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="method="):
        generate(target, drafter, [1], method="eagle")
    with pytest.raises(ValueError, match="needs a drafter"):
        generate(target, None, [1], method="ddtree")
    with pytest.raises(ValueError, match="input_ids.shape"):
        generate(target, drafter, torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        generate(target, drafter, [1], temperature=-1.0)
    assert set(METHODS) == {"ar", "chain", "ddtree", "chain_hsd", "chain_tokenwise"}


def exact_law_of_tokens_2_3(target, ids, temperature, top_k):
    """P(y2, y3) = sum_y1 p(y1) p(y2 | y1) p(y3 | y1, y2) under the processed target law."""
    from vllm_ddtree.sampling import SamplingBatch, target_probs_from_logits

    V = target.config.vocab_size
    sb = SamplingBatch(temperature=torch.tensor([temperature]), top_k=torch.tensor([top_k]),
                       top_p=torch.tensor([1.0]))

    def probs(prefixes):  # [n, len] -> [n, V]
        with torch.no_grad():
            logits = target(input_ids=prefixes).logits[:, -1:]
        return torch.cat([target_probs_from_logits(l[None], sb)[0, 0][None] for l in logits]).double()

    p1 = probs(ids)[0]  # [V]
    y1 = torch.arange(V)[:, None]
    p2 = probs(torch.cat([ids.expand(V, -1), y1], 1))  # [V(y1), V(y2)]
    pre = torch.cat([ids.expand(V * V, -1), y1.repeat_interleave(V, 0), torch.arange(V).repeat(V)[:, None]], 1)
    p3 = probs(pre).view(V, V, V)
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0)  # [V, V]


@pytest.mark.parametrize("method", ["ddtree", "chain_hsd", "chain_tokenwise"])
def test_sampled_outputs_follow_target_law(method):
    """Tokens 2 and 3 come out of the first verification round. Chi-square over the cells of
    expected count >= 5 (the rest merged), N = 2000 draws, fixed seed; we require p > 1e-3
    (a correct engine fails with probability 1e-3; a biased one, e.g. accepting with the
    uncapped ratio or a wrong residual, gives p ~ 0 at this N)."""
    from scipy.stats import chisquare

    target = tiny_target(vocab=8, std=0.5)
    drafter = tiny_drafter(target, block_size=3, std=0.5, seed=7)
    ids = torch.tensor([[1, 4, 2]])
    temperature, top_k = 1.0, 6
    law = exact_law_of_tokens_2_3(target, ids, temperature, top_k).flatten()
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    N = 2000
    counts = torch.zeros(64, dtype=torch.float64)
    for _ in range(N):
        out = generate(target, drafter, ids, method=method, budget=6, temperature=temperature, top_k=top_k,
                       max_new_tokens=3, generator=gen).output_ids
        counts[out[1] * 8 + out[2]] += 1
    expected = law * N
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    assert counts[law == 0].sum() == 0, "a token outside top-k was produced"
    p = chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue
    assert p > 1e-3, (method, p)
