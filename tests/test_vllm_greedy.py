"""ddtree inside vLLM 0.32 (CPU): greedy outputs identical to decoding without speculation.

Oracle: the same engine settings without a speculative config. 100% token equality.
"""

import collections
import functools

import pytest
from vllm_utils import (
    PROMPTS,
    close,
    ddtree_spec,
    ddtree_state,
    make_llm,
    mean_acceptance_length,
    spec_metrics,
)

from vllm import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
# prefix caching and chunked prefill on; 64-token chunks split the longer prompts
ENGINE = dict(enable_prefix_caching=True, enable_chunked_prefill=True,
              max_num_batched_tokens=256, max_num_seqs=8)


def _token_ids(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def baseline():
    llm = make_llm(None, **ENGINE)
    ids = _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    close(llm)
    return ids


def _count_attention_calls(monkeypatch) -> collections.Counter:
    """Counts the target layers' attention calls of verify steps, by whether the tree rows are
    every row of the step ("all tree rows": decoding) or not ("mixed": prefill rows too), for
    the plugin's backend ("ddtree ...") and the stock kernel under it ("stock ...")."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from vllm_ddtree.plugin.cpu_attention import DDTreeCPUImpl

    calls = collections.Counter()

    def counting(cls, name):
        forward = cls.forward

        @functools.wraps(forward)
        def counted(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
            info = getattr(attn_metadata, "ddtree", None)
            if info is not None:
                calls[f"{name} {'all tree rows' if info.covers_all else 'mixed'}"] += 1
            return forward(self, layer, query, key, value, kv_cache, attn_metadata, *args,
                           **kwargs)

        monkeypatch.setattr(cls, "forward", counted)

    counting(CPUAttentionBackendImpl, "stock")
    counting(DDTreeCPUImpl, "ddtree")
    return calls


@pytest.mark.parametrize("budget", [1, 4, 16, 64, 256])
def test_greedy_outputs_identical(baseline, budget, monkeypatch):
    # each decoding request takes 1 + B + L of the token budget (1 + B verify slots, L drafter
    # slots); room for 4 of them per step
    engine = dict(ENGINE, max_num_batched_tokens=max(ENGINE["max_num_batched_tokens"],
                                                     4 * (budget + 8)))
    calls = _count_attention_calls(monkeypatch)
    llm = make_llm(ddtree_spec(budget), per_request_spec_decode_metrics="summary", **engine)
    # twice: the second pass hits the prefix cache built by the first
    per_request, depth = collections.Counter(), ddtree_state(llm).depth
    for _ in range(2):
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert _token_ids(outputs) == baseline
        for out in outputs:  # vLLM's per-request acceptance metrics, served with trees too
            hist = out.outputs[0].spec_decode_metrics.histogram
            assert len(hist) == budget + 1 and not any(hist[min(budget, depth) + 1:]), hist
            per_request.update(steps=sum(hist), drafted=out.outputs[0].spec_decode_metrics
                               .num_draft_tokens, accepted=sum(j * n for j, n in enumerate(hist)))
    # the stock kernel ran in the steps that mix tree rows with prefill rows (for those), and
    # not in the steps of tree rows only (decoding, once the prompts are in)
    assert calls["stock mixed"] == calls["ddtree mixed"] > 0, calls
    assert calls["ddtree all tree rows"] > 0 and calls["stock all tree rows"] == 0, calls
    metrics = spec_metrics(llm)
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert per_request == {"steps": metrics["vllm:spec_decode_num_drafts"],
                           "drafted": metrics["vllm:spec_decode_num_draft_tokens"],
                           "accepted": metrics["vllm:spec_decode_num_accepted_tokens"]}
    # accepted per position: a tree of B nodes accepts at most min(B, depth) per step
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert sum(per_pos) == metrics["vllm:spec_decode_num_accepted_tokens"]
    assert all(n == 0 for n in per_pos[budget:])
    if budget >= 16:
        assert mean_acceptance_length(metrics) > 1.3
        assert ddtree_state(llm).num_compacted_slots > 0, "no accepted path needed compaction"
    close(llm)


def test_torch_path_greedy_identical(baseline, monkeypatch):
    """The stages' torch path (what CUDA runs; VLLM_DDTREE_NATIVE=0 on the CPU) serves the
    same text; tests/test_native.py compares the two paths op by op."""
    monkeypatch.setenv("VLLM_DDTREE_NATIVE", "0")
    llm = make_llm(ddtree_spec(16), **ENGINE)
    assert _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == baseline
    assert ddtree_state(llm).num_compacted_slots > 0
    close(llm)


def test_requests_arriving_while_others_run(baseline):
    """Requests added between engine steps (staggered batches) still match plain decoding."""
    llm = make_llm(ddtree_spec(16), **ENGINE)
    engine = llm.llm_engine
    pending = list(enumerate(PROMPTS))
    done = {}
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 3 == 0:
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, GREEDY)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = list(out.outputs[0].token_ids)
        steps += 1
        assert steps < 2000
    assert [done[i] for i in range(len(PROMPTS))] == baseline
    close(llm)


def test_preemption_with_a_small_kv_cache():
    """A KV cache too small for the batch forces preemption and recomputation."""
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    small = dict(num_gpu_blocks_override=16, block_size=32, max_num_seqs=6, max_model_len=256,
                 enable_prefix_caching=True, max_num_batched_tokens=512)
    llm = make_llm(None, **small)
    expect = _token_ids(llm.generate(PROMPTS, params, use_tqdm=False))
    close(llm)
    llm = make_llm(ddtree_spec(16), **small)
    assert _token_ids(llm.generate(PROMPTS, params, use_tqdm=False)) == expect
    assert spec_metrics(llm)["vllm:num_preemptions"] > 0, "the test did not preempt"
    close(llm)


def test_hsd_chain_mode_greedy_identical(baseline):
    """ddtree_mode "hsd_chain" (sampled chains + HSD) reduces to argmax chains at T = 0."""
    llm = make_llm(ddtree_spec(4, ddtree_mode="hsd_chain"), **ENGINE)
    assert _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == baseline
    assert ddtree_state(llm).num_compacted_slots == 0  # chains never move K/V
    close(llm)


HANDMADE_ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=1024)


@pytest.fixture(scope="module")
def handmade(tmp_path_factory):
    """The hand-made pair (tests/handmade_pair.py) and its greedy outputs without speculation."""
    from handmade_pair import make_pair

    target, drafter = make_pair(tmp_path_factory.mktemp("handmade") / "pair")
    llm = make_llm(None, model=target, **HANDMADE_ENGINE)
    expect = _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    close(llm)
    return target, drafter, expect


@pytest.mark.parametrize("budget", [8, 64])
def test_drafter_with_other_attention_shapes(handmade, budget):
    """A hand-made pair (tests/handmade_pair.py): untied 4-layer target with 4/2 heads of 64, a
    2-layer drafter with 8/1 heads of 32 and block size 16. vLLM keeps both in one KV-cache group
    with per-layer specs; compaction must touch only the target's layers, with their shape."""
    target, drafter, expect = handmade
    engine = dict(model=target, **HANDMADE_ENGINE)
    spec = ddtree_spec(budget, model=drafter)
    llm = make_llm(spec, **engine)
    assert _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expect
    assert mean_acceptance_length(spec_metrics(llm)) > 1.1
    assert ddtree_state(llm).num_compacted_slots > 0
    close(llm)


@pytest.mark.parametrize("pair", ["tiny", "handmade"])
def test_acceptance_equals_the_transformers_engine(request, pair):
    """Round for round, vLLM with ddtree accepts what the independent transformers engine
    (vllm_ddtree.hf, its own drafter and KV cache, never clipped) accepts on the same prompts at
    T = 0: the drafter's context after compaction is the committed text's, so nothing is lost
    in vLLM. Rounds that start with fewer than L + 1 tokens left are clipped in vLLM (only the
    usable nodes are drafted), so there only the emitted text is compared. Both build DDTree's
    trees (``ddtree_calibrate_trees`` false: the transformers engine does not calibrate)."""
    from vllm_utils import DRAFTER, TARGET

    from vllm_ddtree.hf.engine import generate
    from vllm_ddtree.hf.evaluate import heldout_prompts, load_pair

    target_dir, drafter_dir = ((TARGET, DRAFTER) if pair == "tiny"
                               else request.getfixturevalue("handmade")[:2])
    target, drafter, tokenizer = load_pair(target_dir, drafter_dir)
    depth, max_new = drafter.block_size - 1, 40
    prompts = heldout_prompts(tokenizer, 4, prompt_len=48)
    hf = [generate(target, drafter, p, method="ddtree", budget=32, max_new_tokens=max_new)
          for p in prompts]
    llm = make_llm(ddtree_spec(32, model=drafter_dir, ddtree_calibrate_trees=False),
                   model=target_dir)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    emitted = {str(i): [] for i in range(len(prompts))}  # tokens per engine step
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids = list(out.outputs[0].token_ids)
            emitted[out.request_id].append(len(ids) - sum(emitted[out.request_id]))
            tokens[out.request_id] = ids
    close(llm)
    compared = 0
    for i, res in enumerate(hf):
        steps = [n for n in emitted[str(i)] if n > 0]
        assert tokens[str(i)] == res.output_ids
        assert steps[0] == 1  # the prefill's token
        done = 1
        for round_, length in enumerate(res.acceptance_lengths):
            if max_new - done - 1 < depth:
                break  # from here on vLLM drafts only the usable nodes
            assert steps[1 + round_] == length, (i, round_)
            done += length
            compared += 1
    assert compared >= 2 * len(prompts)
    tau = sum(sum(r.acceptance_lengths) for r in hf) / sum(len(r.num_accepted) for r in hf)
    assert tau > 1.2  # real acceptance


@pytest.fixture(scope="module")
def unsure_pair(tmp_path_factory):
    """A drafter right at every depth that says so with probability ~0.52 (its second choice
    ~0.47): ``benchmarks/oracle_pair.py --confidence 0.52``."""
    from handmade_pair import make_unsure_pair

    return make_unsure_pair(tmp_path_factory.mktemp("unsure") / "pair")


def test_calibrated_trees_follow_an_underconfident_drafter(unsure_pair):
    """Issue 54's case, B = 8, greedy, four requests at once, each engine starting with no
    evidence: DDTree's trees by the drafter's probabilities (``ddtree_calibrate_trees`` false)
    spend the nodes on siblings and accept ~4 tokens a step; calibrated trees learn within a
    few steps that the first choice is always taken and then accept L + 1 = 8, the chain's
    (~6.7 over the run: its first steps have no evidence yet).
    Then, on the calibrated engine, four requests with a feature that reshapes the target's
    law (a ``logit_bias``, here one that changes no token): the calibration leaves them out
    (``known_params.reshapes_target``), so their trees are DDTree's (~4 a step), while the
    calibration the plain requests taught still holds for the next plain requests (~8).
    Outputs are plain decoding's: the target emits token 100 after every prefix."""
    target, drafter = unsure_pair
    tau, reshaped, after = {}, None, None
    biased = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, ignore_eos=True,
                            logit_bias={5: -1.0})
    for calibrate in (False, True):
        llm = make_llm(ddtree_spec(8, model=drafter, ddtree_calibrate_trees=calibrate),
                       model=target)
        outputs = _token_ids(llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False))
        assert outputs == [[100] * GREEDY.max_tokens] * 4
        tau[calibrate] = mean_acceptance_length(spec_metrics(llm))
        if calibrate:
            marks = [spec_metrics(llm)]
            for params in (biased, GREEDY):
                outputs = _token_ids(llm.generate(PROMPTS[:4], params, use_tqdm=False))
                assert outputs == [[100] * GREEDY.max_tokens] * 4
                marks.append(spec_metrics(llm))
            reshaped, after = (mean_acceptance_length({
                k: marks[i + 1][k] - marks[i][k] for k in marks[i]
                if isinstance(marks[i][k], (int, float))}) for i in (0, 1))
        close(llm)
    assert tau[False] < 5.0 and tau[True] > 6.0, tau
    assert reshaped < 5.0 and after > 7.0, (reshaped, after)


def test_bfloat16_engine():
    """bf16 on the CPU: vLLM picks another kernel ISA (``amx`` where the CPU has AMX tiles) whose
    K/V block layout is VNNI-packed; tree attention and compaction read it through the learned
    slot maps (tests/test_cpu_kv_layout.py). The trained pair's margins survive bf16 rounding, so
    outputs stay identical to plain bf16 decoding."""
    engine = dict(ENGINE, dtype="bfloat16")
    llm = make_llm(None, **engine)
    expect = _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    close(llm)
    llm = make_llm(ddtree_spec(32), **engine)
    assert _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expect
    assert ddtree_state(llm).num_compacted_slots > 0
    close(llm)


def test_budgets_clipped_near_max_tokens_and_max_model_len():
    """Only nodes that can still be accepted are scheduled: with max_tokens = 3 the first
    verify step may accept one token (depth-1 nodes only), after that no drafts are scheduled
    at all; near max_model_len the same cut applies. Outputs stay identical."""
    short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    to_the_end = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    engine = dict(ENGINE, max_model_len=96)
    llm = make_llm(None, **engine)
    expect = [_token_ids(llm.generate(PROMPTS, p, use_tqdm=False)) for p in (short, to_the_end)]
    close(llm)
    budget = 16
    llm = make_llm(ddtree_spec(budget), **engine)
    assert _token_ids(llm.generate(PROMPTS, short, use_tqdm=False)) == expect[0]
    metrics = spec_metrics(llm)
    assert metrics["vllm:spec_decode_num_drafts"] <= len(PROMPTS)  # one verify step at most
    assert metrics["vllm:spec_decode_num_draft_tokens"] < budget * len(PROMPTS)
    assert sum(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"][1:]) == 0  # depth 1 only
    assert _token_ids(llm.generate(PROMPTS, to_the_end, use_tqdm=False)) == expect[1]
    assert min(len(ids) for ids in expect[1]) > 48  # ran into max_model_len
    close(llm)
