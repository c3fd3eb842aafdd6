"""Tree budget policies inside vLLM 0.32 (CPU): outputs stay those of plain decoding.

The "auto" engines get a synthetic step cost model (the start-up measurement is replaced, and
the online correction is held at 1) so that its choices do not depend on this machine's load:
with it, a step gives some requests nodes and others none. Oracles: plain decoding (100 % token
identity), the recorded per-step budgets, and the acceptance of a drafter that never paused.
"""

import pytest
import torch
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
from vllm_ddtree.budget import CostModel
from vllm_ddtree.plugin import costs
from vllm_ddtree.plugin.cpu_attention import cpu_kv_layout
from vllm_ddtree.plugin.policy import BudgetController

GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=512)
# T_verify(n) = 10 ms + 0.4 ms per token, drafter 1 ms: a node pays only if its calibrated
# path probability beats the step's rate times 0.4 ms, so confident requests draft, others do not
MIXED_COST = CostModel((1, 1001), (0.0104, 0.4104), (1,), (0.001,))
# drafting never pays: every node costs 1 s
NEVER_COST = CostModel((1, 2), (0.001, 1.0), (1,), (0.001,))
# verification is free: every node pays
FREE_COST = CostModel((1, 1000), (0.01, 0.01), (1,), (0.001,))


def _token_ids(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def baseline():
    llm = make_llm(None, **ENGINE)
    ids = _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    close(llm)
    return ids


@pytest.fixture
def synthetic_auto(monkeypatch):
    """Start-up measurement -> the given model; no online correction; budgets recorded."""
    steps = []

    def use(cost):
        monkeypatch.setattr(costs, "measure_costs", lambda runner: cost)

    monkeypatch.setattr(BudgetController, "step_started", lambda self, *a: None)
    drafts_sent = BudgetController.drafts_sent

    def recording(self, budgeted, num_nodes):
        steps.append((bool(self._drafting_now), list(budgeted)))
        return drafts_sent(self, budgeted, num_nodes)

    monkeypatch.setattr(BudgetController, "drafts_sent", recording)
    return use, steps


def test_auto_with_mixed_budgets_is_identical_to_plain_decoding(baseline, synthetic_auto):
    use, steps = synthetic_auto
    use(MIXED_COST)
    llm = make_llm(ddtree_spec(32, ddtree_budget_policy="auto"), **ENGINE)
    for _ in range(2):
        assert _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == baseline
    budgets = [b for drafted, b in steps if drafted and len(b) > 1]
    assert any(0 in b and max(b) > 0 for b in budgets), budgets  # mixed in one step
    assert len({n for b in budgets for n in b}) > 3  # budgets really vary
    summary = ddtree_state(llm).budgets.summary()
    assert 0 < summary["mean_nodes_per_request_step"] < 32
    assert all(c > 0 for row in summary["calibration_greedy"] for c in row)
    assert mean_acceptance_length(spec_metrics(llm)) > 1.2
    close(llm)


def test_table_policy_is_identical_and_pauses_large_batches(baseline):
    """[[2, 16], [256, 0]]: batches of 1-2 requests draft 16 nodes each, larger ones none (the
    drafter pauses: plain decoding steps)."""
    llm = make_llm(ddtree_spec(16, ddtree_budget_policy=[[2, 16], [256, 0]]), **ENGINE)
    assert _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == baseline
    assert spec_metrics(llm).get("vllm:spec_decode_num_drafts", 0) == 0  # 6 at once: none
    drafter = _runner(llm).drafter
    assert drafter._kept_rows > 0  # the paused steps' context waits for the next query pass
    assert _token_ids(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)) == baseline[:2]
    assert drafter._kept_rows == 0  # written when the drafter ran again
    metrics = spec_metrics(llm)
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert mean_acceptance_length(metrics) > 1.3
    close(llm)


def _runner(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker \
        .model_runner


def drafter_context(llm) -> dict[str, tuple[torch.Tensor, torch.Tensor, int, int]]:
    """Per running request: the K and V of its committed positions in the first drafter layer
    (read through the CPU cache layout), the number of committed positions, of prompt ones."""
    runner = _runner(llm)
    name = sorted(runner.drafter._draft_attn_layer_names)[0]
    layer = runner.compilation_config.static_forward_context[name]
    layout = cpu_kv_layout(layer.kv_cache, layer.isa)
    block_size = layer.kv_cache.shape[2]
    table = runner.input_batch.block_table[runner.drafter.kv_cache_gid].block_table.cpu
    out = {}
    for req_id, row in runner.input_batch.req_id_to_index.items():
        request = runner.requests[req_id]
        pos = torch.arange(request.num_computed_tokens)
        slots = table[row, pos // block_size].long() * block_size + pos % block_size
        k, v = layout.read(slots)
        out[req_id] = (k, v, request.num_computed_tokens, request.num_prompt_tokens)
    return out


def test_a_paused_drafter_keeps_its_context(baseline, synthetic_auto):
    """While auto pauses the drafter (drafting never pays here; its first pauses, 8 and 16
    steps, are shorter than WARM_UP, so none goes cold), only the drafter's context pass runs
    (deferred: flushed before the next query pass), and it leaves the drafter's cache exactly
    as a drafter that drafts every step leaves it: the context K/V of every committed
    position equal (so drafting can resume with the same trees). Without the context pass (a mutant) the generated positions differ: this
    test can fail. Outputs stay those of plain decoding."""
    use, steps = synthetic_auto

    def context_after_steps(spec, mutant=False):
        llm = make_llm(spec, **ENGINE)
        if mutant:
            _runner(llm).drafter.store_context = lambda *args: None
        engine = llm.llm_engine
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), prompt, GREEDY)
        outputs = {}
        for _ in range(30):
            for out in engine.step():
                outputs[out.request_id] = out
        drafter = _runner(llm).drafter
        kept = drafter._kept_rows
        drafter.flush_context()  # what the next drafting step does before its query pass
        context = drafter_context(llm)
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out
        ids = [list(outputs[str(i)].outputs[0].token_ids) for i in range(len(PROMPTS))]
        num_drafts = spec_metrics(llm).get("vllm:spec_decode_num_drafts", 0)
        del engine
        close(llm)
        return context, ids, num_drafts, kept

    reference, ids, num_drafts, kept = context_after_steps(ddtree_spec(16))
    assert ids == baseline and num_drafts > 0 and kept == 0
    use(NEVER_COST)
    steps.clear()
    paused, ids, num_drafts, kept = context_after_steps(
        ddtree_spec(16, ddtree_budget_policy="auto"))
    assert ids == baseline
    # a paused drafter defers its context pass: step 30 is in the pause of 16 steps
    assert not steps[29][0] and kept > 0
    assert num_drafts == 0  # no verify step: every step after prefill was plain decoding
    # PAUSE_AFTER (2) proposal steps before the first pause, then probes after pauses of 8
    # and 16 steps
    assert sum(drafted for drafted, _ in steps) <= 4 < len(steps), steps
    holed, _, _, _ = context_after_steps(ddtree_spec(16, ddtree_budget_policy="auto"), mutant=True)
    for req_id, (k, v, committed, prompt) in reference.items():
        n = min(committed, paused[req_id][2], holed[req_id][2]) - 1
        assert n > prompt + 10  # generated positions are compared
        torch.testing.assert_close(paused[req_id][0][:n], k[:n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(paused[req_id][1][:n], v[:n], atol=1e-4, rtol=1e-4)
        assert not torch.allclose(holed[req_id][0][:n], k[:n], atol=1e-2), req_id


def test_a_paused_drafters_steps_run_as_plain_decoding(baseline, monkeypatch):
    """[[2, 16], [256, 0]] with 6 requests: the drafter never drafts, and every step (prefill
    and decode) runs as a step without speculation from its preparation (vLLM's branch without
    spec-decode metadata) through its forward and sampling (the runner has no speculative
    config there, so vLLM never calls the drafter: the plugin runs the drafter's context pass
    after sampling), and gets its speculative config back after sampling. With 2 requests the
    drafter drafts: every step carries metadata and speculation throughout (the drafter's input
    preparation and the verify steps need it). Outputs stay those of plain decoding."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    prepared, sampled, proposed = [], [], []
    patched_prepare = GPUModelRunner._prepare_inputs
    patched_sample = GPUModelRunner._sample
    patched_propose = GPUModelRunner.propose_draft_token_ids

    def prepare(self, scheduler_output, num_scheduled_tokens):
        result = patched_prepare(self, scheduler_output, num_scheduled_tokens)
        prepared.append(result[1] is None)
        return result

    def sample(self, logits, spec_decode_metadata):
        sampled.append(self.speculative_config is None)
        return patched_sample(self, logits, spec_decode_metadata)

    def propose(self, *args, **kwargs):
        proposed.append(1)
        return patched_propose(self, *args, **kwargs)

    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", prepare)
    monkeypatch.setattr(GPUModelRunner, "_sample", sample)
    monkeypatch.setattr(GPUModelRunner, "propose_draft_token_ids", propose)
    llm = make_llm(ddtree_spec(16, ddtree_budget_policy=[[2, 16], [256, 0]]), **ENGINE)
    runner = _runner(llm)
    spec_config = runner.speculative_config
    assert spec_config is not None
    prepared.clear(), sampled.clear(), proposed.clear()  # the engine's warm-up steps
    assert _token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == baseline
    assert len(prepared) >= GREEDY.max_tokens and all(prepared)
    assert len(sampled) == len(prepared) and all(sampled) and not proposed
    assert runner.speculative_config is spec_config
    prepared.clear(), sampled.clear()
    assert _token_ids(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)) == baseline[:2]
    assert prepared and not any(prepared) and not any(sampled)
    assert len(proposed) == len(prepared)
    assert spec_metrics(llm)["vllm:spec_decode_num_drafts"] > 0
    close(llm)


def test_a_cold_drafter_drafts_only_for_requests_with_a_complete_context(synthetic_auto,
                                                                         monkeypatch):
    """Auto's long pauses go cold (no context pass; WARM_UP 0 makes every pause cold): outputs
    stay those of plain decoding. When drafting pays again (FREE_COST, pauses lifted), a
    request whose prefix-cache hit covers positions written in cold steps drafts nothing (its
    drafter context has holes), and a new request drafts with its usual acceptance. Without
    the context check the follow-up request would draft (every node pays): this can fail."""
    from vllm_ddtree.plugin import policy

    use, steps = synthetic_auto
    monkeypatch.setattr(policy, "WARM_UP", 0)
    first = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    plain = make_llm(None, **ENGINE)
    (out,) = plain.generate([PROMPTS[0]], first, use_tqdm=False)
    # a follow-up turn: the first request's text, whose first two K/V blocks (128 positions
    # each on the CPU) are in the prefix cache (a drafter that uses the target's hidden states
    # recomputes the last block of a hit: the follow-up gets the first)
    follow_up = {"prompt_token_ids": list(out.prompt_token_ids) + list(out.outputs[0].token_ids)}
    expected = _token_ids(plain.generate([follow_up, PROMPTS[1]], GREEDY, use_tqdm=False))
    expected_first = list(out.outputs[0].token_ids)
    close(plain)

    use(NEVER_COST)
    llm = make_llm(ddtree_spec(16, ddtree_budget_policy="auto"), **ENGINE)
    state = ddtree_state(llm)
    assert _token_ids(llm.generate([PROMPTS[0]], first, use_tqdm=False)) == [expected_first]
    # cold from the first long pause on: the request can never draft again
    assert state.ever_cold and state.budgets.summary()["drafter_cold_fraction"] > 0.5

    def drafts_for(prompt):
        state.budgets.set_cost_model(FREE_COST)
        state.budgets._pause_until.clear()
        state.budgets._pause.clear()
        before = spec_metrics(llm).get("vllm:spec_decode_num_drafts", 0)
        ids = _token_ids(llm.generate([prompt], GREEDY, use_tqdm=False))
        return ids[0], spec_metrics(llm).get("vllm:spec_decode_num_drafts", 0) - before

    ids, num_drafts = drafts_for(follow_up)
    assert ids == expected[0] and num_drafts == 0
    ids, num_drafts = drafts_for(PROMPTS[1])
    assert ids == expected[1] and num_drafts > 0
    assert mean_acceptance_length(spec_metrics(llm)) > 1.3
    close(llm)


def test_a_prompt_that_arrives_in_a_cold_pause_keeps_its_drafter_context(synthetic_auto,
                                                                         monkeypatch):
    """A cold step still writes the drafter context of prompt rows: a long prompt (a shared
    system prompt, say) served entirely in a cold pause leaves no hole in the prefix cache, so
    a later request that reuses it drafts, with plain decoding's outputs. Its generated
    positions were cold, and it never drafted itself. Without the prompt rows' context pass
    the later request would draft nothing (its prefix-cache hit has holes): this can fail."""
    from vllm_ddtree.plugin import policy

    use, _ = synthetic_auto
    monkeypatch.setattr(policy, "WARM_UP", 0)
    plain = make_llm(None, **ENGINE)
    (out,) = plain.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=300,
                                                         ignore_eos=True), use_tqdm=False)
    # a prompt of over two K/V blocks (128 positions each on the CPU); the later request hits
    # its first block (the last block of a hit is recomputed for the drafter's hidden states)
    system = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
    later = {"prompt_token_ids": system + list(out.outputs[0].token_ids[:8])}
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected_system = _token_ids(plain.generate([{"prompt_token_ids": system}], short,
                                                use_tqdm=False))
    expected_later = _token_ids(plain.generate([later], GREEDY, use_tqdm=False))
    close(plain)

    use(NEVER_COST)
    llm = make_llm(ddtree_spec(16, ddtree_budget_policy="auto"), **ENGINE)
    state = ddtree_state(llm)
    budgets = state.budgets
    budgets._pause_until[budgets._bucket(1)] = 10**9  # a long pause: cold from the first step
    assert _token_ids(llm.generate([{"prompt_token_ids": system}], short,
                                   use_tqdm=False)) == expected_system
    assert state.ever_cold and budgets.summary()["drafter_on_fraction"] == 0

    budgets.set_cost_model(FREE_COST)  # drafting pays again
    budgets._pause_until.clear()
    assert _token_ids(llm.generate([later], GREEDY, use_tqdm=False)) == expected_later
    assert spec_metrics(llm).get("vllm:spec_decode_num_drafts", 0) > 0
    assert mean_acceptance_length(spec_metrics(llm)) > 1.3
    close(llm)


def test_each_cost_point_is_the_fastest_of_its_runs_taking_turns(monkeypatch):
    """A slow spell raises every point it overlaps a little, never one point against its
    neighbours: per point, the fastest of REPEATS runs after a warm-up, the points in turns."""
    clock, calls = [0.0], []
    monkeypatch.setattr(costs.time, "perf_counter", lambda: clock[0])

    def run(point: int, seconds: float):
        def fn():
            calls.append(point)
            # runs 3 to 9 (a slow spell, all points alike) take 10x longer
            clock[0] += seconds * (10 if 3 <= len(calls) <= 9 else 1)
        return fn

    best = costs._fastest_seconds([run(0, 1.0), run(1, 2.0)], lambda: None)
    assert best == [1.0, 2.0]
    assert calls == [0, 1] + [0, 1] * costs.REPEATS  # warm-up, then in turns
    assert costs.REPEATS >= 5


def test_a_failed_cost_measurement_stops_the_engine_and_names_the_fix(monkeypatch):
    """Auto cannot run without its step cost model: the engine does not start, and the error
    says how to run without it."""
    def failing(runner):
        raise RuntimeError("no clock on this device")

    monkeypatch.setattr(costs, "measure_costs", failing)
    try:
        with pytest.raises(Exception) as info:
            make_llm(ddtree_spec(16, ddtree_budget_policy="auto"), **ENGINE)
    finally:  # the half-started engine's distributed state must not reach the next test
        import gc

        from vllm.distributed import cleanup_dist_env_and_memory

        gc.collect()
        cleanup_dist_env_and_memory()
    chain = []
    error = info.value
    while error is not None:
        chain.append(str(error))
        error = error.__cause__ or error.__context__
    text = " | ".join(chain)
    assert "no clock on this device" in text and "\"ddtree_budget_policy\": \"static\"" in text


def test_auto_counts_the_grammar_cost_of_structured_requests(synthetic_auto, monkeypatch):
    """Verification is free (FREE_COST: every node pays for its row). While the scheduler's
    grammar work costs nothing per node, structured-output requests send trees (at most L
    nodes); at 1 s per node (the mean the scheduler sends with each schedule, forced here)
    auto gives them none, and the unconstrained requests of the same steps keep theirs."""
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_ddtree.plugin import grammar

    use, _ = synthetic_auto
    use(FREE_COST)
    per_node = {"seconds": 0.0}
    monkeypatch.setattr(grammar.GrammarTime, "per_node", lambda self: per_node["seconds"])
    llm = make_llm(ddtree_spec(16, ddtree_budget_policy="auto"), **ENGINE,
                   structured_outputs_config={"backend": "xgrammar",
                                              "disable_any_whitespace": True})
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    sent, update = [], scheduler.update_draft_token_ids

    def spy(draft_token_ids):
        for req_id, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = scheduler.requests.get(req_id)
            if request is not None and request.num_output_tokens > 1:  # decoding
                sent.append((per_node["seconds"], request.use_structured_output, len(drafts)))
        return update(draft_token_ids)

    scheduler.update_draft_token_ids = spy
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    structured = SamplingParams(temperature=0.0, max_tokens=32,
                                structured_outputs=StructuredOutputsParams(json=schema))
    depth = ddtree_state(llm).depth  # L
    try:
        for seconds in (0.0, 1.0):
            per_node["seconds"] = seconds
            llm.generate(PROMPTS[:4], [structured, GREEDY] * 2, use_tqdm=False)
    finally:
        del scheduler.update_draft_token_ids
        close(llm)

    def drafts(seconds, is_structured):
        return [n for s, kind, n in sent if s == seconds and kind == is_structured]

    assert max(drafts(0.0, True)) > 1 and max(drafts(0.0, True)) <= depth
    assert drafts(1.0, True) and not any(drafts(1.0, True))
    assert max(drafts(0.0, False)) > depth and max(drafts(1.0, False)) > depth


def test_auto_measures_a_verify_step_by_its_critical_request(synthetic_auto, monkeypatch):
    """What auto's rates count for a step (``tokens_emitted``): for a verify step, the batch's
    size times the tokens of the request that had the most tokens left before it (ties share
    their mean); for other steps every token. Oracle: each request's tokens so far, counted
    here from the runner's outputs, and its ``max_tokens`` (requests of 12, 20, 20 and 40
    tokens, so the critical request changes as they go)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    use, _ = synthetic_auto
    use(FREE_COST)  # every node pays: verify steps throughout
    seen = []
    monkeypatch.setattr(BudgetController, "tokens_emitted", lambda self, n: seen.append(n))
    llm = make_llm(ddtree_spec(8, ddtree_budget_policy="auto"), **ENGINE)
    done, expected, totals = {}, [], []
    sample_tokens = GPUModelRunner.sample_tokens  # the plugin's wrapper

    def recording(self, *args, **kwargs):
        drafted = any(self.ddtree_state.last_num_draft)
        left = {r: s.sampling_params.max_tokens - done.get(r, 0) for r, s in self.requests.items()}
        output = sample_tokens(self, *args, **kwargs)
        emitted = [len(ids) for ids in output.sampled_token_ids]
        before = [left[r] for r in output.req_ids]
        for r, n in zip(output.req_ids, emitted):
            done[r] = done.get(r, 0) + n
        totals.append(sum(emitted))
        if drafted:
            most = max(before)
            tied = [n for b, n in zip(before, emitted) if b == most]
            expected.append(len(emitted) * sum(tied) / len(tied))
        else:
            expected.append(sum(emitted))
        return output

    monkeypatch.setattr(GPUModelRunner, "sample_tokens", recording)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for n in (12, 20, 20, 40)]
    outputs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [12, 20, 20, 40]
    assert seen == pytest.approx(expected), (seen, expected)
    assert any(e != t for e, t in zip(expected, totals))  # the critical request set the value
    close(llm)


class _Boom(RuntimeError):
    pass


def _paused_runner():
    """A runner stand-in in a paused drafter's step: the plan is "cold", no drafts scheduled."""
    from types import SimpleNamespace

    calls = []
    budgets = SimpleNamespace(name="static", drafting=lambda run: calls.append(("drafting", run)))
    state = SimpleNamespace(check_ranks=False, held_spec_config=None, plan="cold", budgets=budgets,
                            stage=None,  # no pipeline parallelism
                            plan_step=lambda req_ids, without_drafts: "cold")
    drafter = SimpleNamespace(skip_context=lambda *args: calls.append(("skip_context",) + args))
    runner = SimpleNamespace(ddtree_state=state, speculative_config=object(), drafter=drafter,
                             input_batch=SimpleNamespace(req_ids=["a", "b"], num_reqs=2))
    scheduler_output = SimpleNamespace(scheduled_spec_decode_tokens={})
    return runner, state, scheduler_output, calls


def test_a_paused_step_gets_its_speculative_config_back_whatever_happens():
    """The wiring of a paused drafter's step without the engine: ``_prepare_inputs`` holds the
    runner's speculative config and ``sample_tokens`` gives it back, then runs the drafter's
    paused step with the step's auxiliary hidden states; an error in either gives it back too."""
    from types import SimpleNamespace

    from vllm_ddtree.plugin import patches

    def failing(*args, **kwargs):
        raise _Boom

    runner, state, scheduler_output, _ = _paused_runner()
    config = runner.speculative_config
    with pytest.raises(_Boom):
        patches._wrap_prepare_inputs(failing)(runner, scheduler_output, None)
    assert runner.speculative_config is config and state.held_spec_config is None

    seen = []

    def prepared(self, *args):
        seen.append(self.speculative_config)
        raise _Boom  # after the config was held: stop before the rest of the real method

    with pytest.raises(_Boom):
        patches._wrap_prepare_inputs(prepared)(runner, scheduler_output, None)
    assert seen == [None] and runner.speculative_config is config

    runner.speculative_config, state.held_spec_config = None, config
    runner.execute_model_state = SimpleNamespace(scheduler_output=scheduler_output,
                                                 aux_hidden_states=["aux"])
    with pytest.raises(_Boom):
        patches._wrap_sample_tokens(failing)(runner, None)
    assert runner.speculative_config is config and state.held_spec_config is None

    runner, state, scheduler_output, calls = _paused_runner()
    config = runner.speculative_config
    runner.speculative_config, state.held_spec_config = None, config
    runner.execute_model_state = SimpleNamespace(scheduler_output=scheduler_output,
                                                 aux_hidden_states=["aux"])
    sampled_without = []

    def sample(self, grammar_output):
        sampled_without.append(self.speculative_config is None)
        return SimpleNamespace(sampled_token_ids=[[1], [2]])

    output = patches._wrap_sample_tokens(sample)(runner, None)
    assert sampled_without == [True] and output.sampled_token_ids == [[1], [2]]
    assert runner.speculative_config is config and state.held_spec_config is None
    assert calls == [("drafting", False), ("skip_context", scheduler_output, ["aux"])]
    assert runner._draft_token_ids == [[], []]  # no drafts: take_draft_token_ids sends none
