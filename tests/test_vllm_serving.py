"""Serving behaviour of ddtree inside vLLM 0.32 (CPU): step capacity and per-step host syncs.

- Capacity: the drafter runs depth + 1 queries per request, so the scheduler must charge
  depth drafter slots (not the budget B) per request: at B = 256 and 8192 batched tokens a step
  verifies ~30 requests (8192 / (257 + 7)), not ~15 (8192 / (257 + 256)). A request the budget
  left out of a step keeps its proposal until it is verified. Oracle: the busiest verify step,
  plain decoding's outputs (token identity), and zero chain fallbacks.
- Host syncs: engine steps run under :mod:`sync_checker` scoped to the plugin's per-step code
  (everything but the CPU-only attention backend): no value reads of tensors, no syncing ops,
  host data only through the pinned ``to_device`` path. Without its allowance, the plugin's
  one host read (of vLLM's own host copy) is caught: the checker sees plugin code inside a
  running engine.
"""

import pytest
from sync_checker import HostSyncError, NoHostSync, no_host_sync
from vllm_utils import PROMPTS, close, ddtree_spec, ddtree_state, make_llm

from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams
from vllm_ddtree.plugin.state import TreeState

PER_STEP_FILES = tuple(f"vllm_ddtree/{name}.py" for name in (
    "plugin/patches", "plugin/state", "plugin/sampler", "plugin/proposer", "plugin/compaction",
    "plugin/cuda_attention", "plugin/features", "tree", "walk", "sampling")) + ("kernels/compact_kv.py",
                                                             "kernels/tree_attention.py")
HOST_READS = {  # (file, function): why the tensor it reads is a host copy made for it
    ("plugin/state.py", "clip_drafts"): "node depths copied with vLLM's draft copy, read after "
                                        "vLLM waits for that copy's event",
    ("plugin/patches.py", "_input_fits_in_drafter"): "vLLM's seq_lens_cpu_upper_bound",
    ("plugin/state.py", "_read_host_count"): "the unmatched-row count's host copy, started by "
                                             "the previous periodic report (~10 s before)",
}
# thinking budgets step vLLM's host state machine along the trees: a documented read, in steps
# with such requests only
THINKING_READS = {("plugin/features.py", "_forced_rows"): "the trees, for vLLM's host "
                                                          "thinking-budget state machine"}
UPLOADS = (("plugin/state.py", "to_device"),)


def _prompts(n):
    return [PROMPTS[i % len(PROMPTS)] + f"# {i}\n" for i in range(n)]


def test_busiest_step_verifies_as_many_requests_as_the_budget_holds(monkeypatch):
    budget, num_tokens, num_reqs = 256, 8192, 40
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = dict(max_num_seqs=num_reqs, max_num_batched_tokens=num_tokens, max_model_len=512,
                  enable_chunked_prefill=True)
    prompts = _prompts(num_reqs)
    llm = make_llm(None, **engine)
    expect = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    close(llm)

    verified = []  # requests with drafts, per verify step
    begin_verify = TreeState.begin_verify

    def counting(self, req_ids, num_draft, *args, **kwargs):
        verified.append(sum(1 for m in num_draft if m > 0))
        return begin_verify(self, req_ids, num_draft, *args, **kwargs)

    monkeypatch.setattr(TreeState, "begin_verify", counting)
    llm = make_llm(ddtree_spec(budget), **engine)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    state = ddtree_state(llm)
    assert got == expect
    # 8192 // (257 + 7) = 31 full trees (more when requests near max_tokens draft fewer
    # nodes); vLLM's dflash reservation, 8192 // (257 + 256), gives at most 15
    assert max(verified) >= 28, verified
    # requests left out of a step were verified later with their own trees, not as chains
    assert state.num_unmatched_rows == 0
    close(llm)


@pytest.fixture(scope="class")
def tree_engine():
    """Shared by the tests of one class, closed after them: two CPU engines at once would not
    find memory for their K/V caches."""
    llm = make_llm(ddtree_spec(16), max_num_seqs=8, max_num_batched_tokens=512,
                   reasoning_config={"reasoning_start_str": "self", "reasoning_end_str": "get_name"})
    yield llm
    close(llm)


def _run_checked_steps(llm, params_list, checker):
    """Run requests ``req0, req1, ...`` to the end, checking six of their engine steps. On any
    failure the requests are aborted and the engine drained before the error goes on, so the
    next test of a class that shares the engine starts clean (left running, they made it
    hang until the test timeout)."""
    engine = llm.llm_engine
    req_ids = [f"req{i}" for i in range(len(params_list))]
    for i, (req_id, params) in enumerate(zip(req_ids, params_list)):
        engine.add_request(req_id, PROMPTS[i % len(PROMPTS)], params)
    try:
        for _ in range(3):  # prefill and the first proposals, unchecked
            engine.step()
        with no_host_sync(checker):
            for _ in range(6):
                engine.step()
        _drain(engine)
    except BaseException:
        engine.abort_request(req_ids)
        _drain(engine)
        raise


def _drain(engine, max_steps: int = 2000) -> None:
    """Step until no request is left; a bounded loop, so an engine that never finishes fails."""
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError(f"requests still unfinished after {max_steps} engine steps")


MIXED = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
         SamplingParams(temperature=0.6, top_k=20, top_p=0.95, max_tokens=40, ignore_eos=True),
         SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True),
         SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=40, ignore_eos=True)]


# request features on tree rows (features.py) and logprobs of the emitted rows
FEATURES = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2,
                           presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
            SamplingParams(temperature=0.7, max_tokens=40, min_tokens=30, stop_token_ids=[202],
                           bad_words=["self", " in range"], logit_bias={13: 1.5}, min_p=0.05),
            SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                           allowed_token_ids=list(range(100, 400))),
            SamplingParams(temperature=0.9, seed=5, max_tokens=40, ignore_eos=True,
                           frequency_penalty=0.5, logprobs=1),
            SamplingParams(temperature=0.0, max_tokens=40,
                           structured_outputs=StructuredOutputsParams(regex=r"[a-z ]{10,60}"))]


class TestTreeEngine:
    def test_steps_with_request_features_have_no_host_sync_in_plugin_code(self, tree_engine):
        checker = NoHostSync(scope=PER_STEP_FILES, allowed_reads=HOST_READS,
                             allowed_uploads=UPLOADS)
        _run_checked_steps(tree_engine, FEATURES + MIXED[:2], checker)
        assert checker.num_checked > 100, "the checker saw no plugin code"

    def test_thinking_budget_steps_read_only_the_trees(self, tree_engine, monkeypatch):
        """A thinking-budget request (its prompt ends inside a thinking section: forced rows
        within a few steps) among the feature requests: the plugin's one extra host read is
        the trees for the thinking state machine (without its allowance the checker reports
        it); nothing else syncs."""
        import vllm_ddtree.plugin.features as features

        forced = []
        real = features.forced_tokens
        monkeypatch.setattr(features, "forced_tokens",
                            lambda *args: forced.append(1) or real(*args))
        checker = NoHostSync(scope=PER_STEP_FILES, allowed_reads={**HOST_READS, **THINKING_READS},
                             allowed_uploads=UPLOADS)
        thinking = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                  thinking_token_budget=4)
        _run_checked_steps(tree_engine, [FEATURES[0], FEATURES[1], thinking], checker)
        assert checker.num_checked > 100 and forced, "the thinking path did not run"

    def test_engine_steps_have_no_host_sync_in_plugin_code(self, tree_engine):
        checker = NoHostSync(scope=PER_STEP_FILES, allowed_reads=HOST_READS,
                             allowed_uploads=UPLOADS)
        _run_checked_steps(tree_engine, MIXED, checker)
        assert checker.num_checked > 100, "the checker saw no plugin code"
        assert ddtree_state(tree_engine).num_compacted_slots > 0

    def test_the_checker_sees_plugin_code_inside_the_engine(self, tree_engine):
        """Without its allowance, the one host read the plugin makes every step (vLLM's host copy
        of the sequence lengths) is reported, with its place: the checker attributes ops to the
        plugin's code while vLLM's engine runs."""
        checker = NoHostSync(scope=PER_STEP_FILES, allowed_uploads=UPLOADS)
        with pytest.raises(HostSyncError, match="_input_fits_in_drafter"):
            _run_checked_steps(tree_engine, MIXED[:1], checker)
        assert not tree_engine.llm_engine.has_unfinished_requests()  # aborted and drained
        # the engine serves the class's next run after the failure inside its step
        _run_checked_steps(tree_engine, MIXED[:1], NoHostSync(
            scope=PER_STEP_FILES, allowed_reads=HOST_READS, allowed_uploads=UPLOADS))


def test_hsd_chain_steps_have_no_host_sync_in_plugin_code():
    llm = make_llm(ddtree_spec(4, ddtree_mode="hsd_chain"), max_num_seqs=8,
                   max_num_batched_tokens=512)
    checker = NoHostSync(scope=PER_STEP_FILES, allowed_reads=HOST_READS, allowed_uploads=UPLOADS)
    _run_checked_steps(llm, MIXED, checker)
    assert checker.num_checked > 100
    close(llm)


def test_auto_budget_steps_have_no_host_sync_in_plugin_code():
    """The "auto" policy's per-step work (node gains, the global ranking, the calibration,
    the paused drafter's context pass) is device work too: checked while it drafts (free
    verification) and while it pauses (drafting never pays)."""
    from vllm_ddtree.budget import CostModel

    llm = make_llm(ddtree_spec(16, ddtree_budget_policy="auto"), max_num_seqs=8,
                   max_num_batched_tokens=512)
    budgets = ddtree_state(llm).budgets
    budgets.step_started = lambda *args: None  # keep the synthetic costs below as they are
    for cost, drafted in ((CostModel((1, 1000), (0.01, 0.01), (1,), (0.001,)), True),
                          (CostModel((1, 2), (0.001, 1.0), (1,), (0.001,)), False)):
        budgets.set_cost_model(cost)
        budgets._pause_until.clear()
        checker = NoHostSync(scope=PER_STEP_FILES, allowed_reads=HOST_READS,
                             allowed_uploads=UPLOADS)
        before = budgets.summary()
        _run_checked_steps(llm, MIXED, checker)
        after = budgets.summary()
        # paused steps run little plugin code: the context pass, the draft bookkeeping (a step
        # without drafts samples with vLLM's sampler)
        assert checker.num_checked > (100 if drafted else 30), checker.num_checked
        ran = after["drafter_on_fraction"] * after["steps"] - (
            before["drafter_on_fraction"] * before["steps"])
        steps = after["steps"] - before["steps"]
        assert (ran > 0.8 * steps) if drafted else (ran < 0.3 * steps), (ran, steps)
    close(llm)
