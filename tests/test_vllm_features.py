"""ddtree inside vLLM 0.32 (CPU): the per-request features that change the sampled law (logprobs,
penalties, min_tokens, bad_words, allowed_token_ids, logit_bias, min_p, structured outputs,
thinking budgets) give exactly the output of decoding without speculation.

Oracle: the same engine settings without a speculative config, run once over the same list of
cases. Every case is one request of one ``llm.generate`` call, so requests with different
features share verify steps (mixed batches). At T = 0: token ids identical, logprobs equal within
1e-4. Each feature is shown to bite (its output differs from the same prompt without it), so a
plugin that ignored it would fail. Structured-output requests verify the grammar-valid subtree
of their tree (the scheduler checks each node's path: ``vllm_ddtree/plugin/grammar.py``).

Two pairs:

- the committed tiny pair, budget 16: realistic trees, shallow acceptance;
- an always-right pair (benchmarks/oracle_pair.py) whose target ranks five tokens with small
  margins: without features the drafter is right at every depth (acceptance ~8 with B = 64), and
  the penalties, bad words and biases make the target leave the drafted chain at depths that
  depend on the path, so they are applied node by node inside deep trees.
"""

import importlib.util
import json
import math
import os
import re
from dataclasses import dataclass

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
from vllm.sampling_params import StructuredOutputsParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_TOKENS = 32
# structured outputs: xgrammar (works on this CPU install) without free whitespace, so that the
# tiny target's JSON closes instead of running into max_tokens in blank lines
# thinking budgets: 'self' opens a thinking section, 'get_name' (3 tokens) closes it
REASONING = {"reasoning_start_str": "self", "reasoning_end_str": "get_name"}
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=512, reasoning_config=REASONING,
              structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
BUDGET = 16
LOGPROB_TOL = 1e-4

# the tiny target's greedy texts (asserted in test_premises_of_the_cases):
#   A 'class _name, self.assertEqual(self):\n        self.assertEqual(self.get_name)...'
#   B 'self.path.path.path)\n        self.assertEqual(self.get_name, ...'
#   C "self.get_name, 'n', 'n'\n\n\n..."   (ids 268 17 396 66 366 ...)
#   D '\n\n\n...' (one token, 202, repeated)
A, B, C, D = PROMPTS[2], PROMPTS[3], PROMPTS[1], PROMPTS[0]
STOP_IDS = [396, 366]  # 'get' and 'name': C's 3rd and 5th greedy tokens
BAD_WORDS = ["assertEqual", "get_name"]  # one token, and three (396 66 366): both in A's text
ALLOWED = list(range(200, 250)) + [268, 17, 459, 12]  # holds B's first 8 greedy tokens, not the rest
BIAS = {353: -100.0, 265: 5.0, 17: 5.0}  # 353 'assertEqual' is in A's text
CHOICES = ["yes", "no", "maybe"]
REGEX = r"[a-z]{3,8}( [a-z]{3,8}){2}"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@dataclass
class Case:
    name: str
    prompt: str
    params: SamplingParams
    base: str | None = None  # a case whose output this feature must change (it bites)


def greedy(**kw) -> SamplingParams:
    args = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    args.update(kw)
    return SamplingParams(**args)


def so(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                          structured_outputs=StructuredOutputsParams(**kw))


# interleaved so that every wave of max_num_seqs requests mixes drafting requests with
# logprobs, penalties, masks and structured outputs
CASES = [
    Case("greedy_A", A, greedy()),
    Case("logprobs5_A", A, greedy(logprobs=5)),
    Case("choice_D", D, so(choice=CHOICES)),
    Case("presence_A", A, greedy(presence_penalty=1.5), base="greedy_A"),
    Case("greedy_B", B, greedy()),
    Case("min_tokens_C", C, greedy(ignore_eos=False, stop_token_ids=STOP_IDS, min_tokens=20),
         base="stop_C"),
    Case("bad_words_A", A, greedy(bad_words=BAD_WORDS), base="greedy_A"),
    Case("json_A", A, so(json=SCHEMA)),
    Case("frequency_B", B, greedy(frequency_penalty=0.8), base="greedy_B"),
    Case("logprobs0_B", B, greedy(logprobs=0)),
    Case("allowed_ids_B", B, greedy(allowed_token_ids=ALLOWED), base="greedy_B"),
    Case("regex_B", B, so(regex=REGEX)),
    Case("repetition_A", A, greedy(repetition_penalty=1.3), base="greedy_A"),
    Case("greedy_C", C, greedy()),
    Case("logit_bias_A", A, greedy(logit_bias=BIAS), base="greedy_A"),
    Case("json_object_C", C, so(json_object=True)),
    Case("greedy_D", D, greedy()),
    Case("penalties_D", D, greedy(presence_penalty=0.5, frequency_penalty=0.5,
                                  repetition_penalty=1.2), base="greedy_D"),
    Case("stop_C", C, greedy(ignore_eos=False, stop_token_ids=STOP_IDS)),
    Case("min_p_B", B, greedy(min_p=0.2)),  # vLLM drops min_p at T = 0; it must be accepted
    # logprobs are the raw model's (vLLM's default logprobs_mode): with a penalty the sampled
    # token is often not the top-ranked one
    Case("logprobs3_repetition_A", A, greedy(logprobs=3, repetition_penalty=1.3), base="greedy_A"),
    Case("combined_B", B, greedy(presence_penalty=0.3, frequency_penalty=0.3, repetition_penalty=1.1,
                                 bad_words=["path"], logit_bias={275: 2.0}, min_p=0.2, logprobs=2),
         base="greedy_B"),
    Case("choice_A", A, so(choice=CHOICES)),
    # A's prompt ends inside a thinking section ('self' in 'push(self, item)'); B's greedy
    # text opens one with its first token
    Case("thinking_A", A, greedy(thinking_token_budget=4), base="greedy_A"),
    Case("thinking_B", B, greedy(thinking_token_budget=6, logprobs=2), base="greedy_B"),
]
NAMES = [c.name for c in CASES]
BY_NAME = {c.name: c for c in CASES}
LOGPROB_CASES = [c.name for c in CASES if c.params.logprobs is not None]
BITING = [c.name for c in CASES if c.base is not None]

# T > 0 with a seed: reproducible in ddtree, but not plain's stream (not compared with plain)
SEEDED = SamplingParams(temperature=0.8, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True,
                        presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
                        min_p=0.05, logit_bias={275: 2.0, 17: -1.0}, logprobs=2)


def _generate(llm, cases):
    outs = llm.generate([c.prompt for c in cases], [c.params for c in cases], use_tqdm=False)
    return {c.name: o.outputs[0] for c, o in zip(cases, outs)}


@pytest.fixture(scope="module")
def plain():
    llm = make_llm(None, **ENGINE)
    try:
        return _generate(llm, CASES)
    finally:
        close(llm)


@pytest.fixture(scope="module")
def ddtree():
    from vllm_ddtree.plugin import grammar

    # the scheduler's grammar check of each structured request's tree (in-process engine)
    checks, real = [], grammar.grammar_subtree

    def spy(manager, request, tokens, parents):
        kept = real(manager, request, tokens, parents)
        checks.append((list(parents), kept))
        return kept

    grammar.grammar_subtree = spy
    llm = make_llm(ddtree_spec(BUDGET), **ENGINE)
    try:
        got = _generate(llm, CASES)
        # the seeded request: once in a batch of feature requests, once alone
        mixed = llm.generate(PROMPTS[:4] + [B], [greedy(logprobs=1)] * 4 + [SEEDED], use_tqdm=False)
        alone = llm.generate([B], SEEDED, use_tqdm=False)
        # seeded requests draw their tokens again, in prefill steps too: logprobs of those
        sole = llm.generate(PROMPTS, [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=32,
                                                     ignore_eos=True, logprobs=0)
                                      for i in range(len(PROMPTS))], use_tqdm=False)
        metrics = spec_metrics(llm)
        return {"cases": got, "seeded": [mixed[-1].outputs[0], alone[0].outputs[0]],
                "seeded_sole": [o.outputs[0] for o in sole], "metrics": metrics,
                "grammar_checks": checks, "unknown": _unknown_field_phase(llm)}
    finally:
        grammar.grammar_subtree = real
        close(llm)


UNKNOWN = ["greedy_A", "presence_A", "greedy_B", "logprobs5_A"]


def _unknown_field_phase(llm):
    """A later vLLM's new sampling field, played by ``presence_penalty`` taken out of the
    plugin's table (known_params.KNOWN): the batch of UNKNOWN, then a batch without it."""
    from vllm_ddtree.plugin import known_params

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    steps, real_schedule = [], scheduler.schedule

    def schedule(*args, **kwargs):
        output = real_schedule(*args, **kwargs)
        steps.append((set(output.num_scheduled_tokens),
                      sum(map(len, output.scheduled_spec_decode_tokens.values())),
                      output.ddtree_without_drafts, output.ddtree_grammar_node_s))
        return output

    warnings, real_warning = [], known_params.logger.warning
    scheduler.schedule = schedule
    known_params.logger.warning = lambda *args: warnings.append(args)
    del known_params.KNOWN["presence_penalty"]
    try:
        cases = [BY_NAME[name] for name in UNKNOWN]
        first = _generate(llm, cases)
        second = _generate(llm, cases)  # logged once: not again
        after = _generate(llm, [BY_NAME["greedy_A"], BY_NAME["greedy_B"]])
    finally:
        known_params.KNOWN["presence_penalty"] = "counts the path's tokens"
        known_params.logger.warning = real_warning
        del scheduler.schedule
    return {"first": first, "second": second, "after": after, "steps": steps,
            "warnings": warnings, "worker_grammar_node_s": ddtree_state(llm).budgets.grammar_node_s}


def _ids(out):
    return list(out.token_ids)


def assert_logprobs_equal(want, got, top_n: int):
    """Per position: the same ids (sampled token plus the top ``top_n``), logprobs within
    LOGPROB_TOL, the same ranks."""
    assert want.logprobs is not None and got.logprobs is not None
    assert len(got.logprobs) == len(got.token_ids) == len(want.logprobs)
    for pos, (w, g, tok) in enumerate(zip(want.logprobs, got.logprobs, got.token_ids)):
        assert tok in g, (pos, tok, g)
        assert set(g) == set(w), (pos, w, g)
        assert top_n <= len(g) <= top_n + 1, (pos, g)
        for t in w:
            assert abs(g[t].logprob - w[t].logprob) <= LOGPROB_TOL, (pos, t, w[t], g[t])
            assert g[t].rank == w[t].rank, (pos, t, w[t], g[t])
    assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)


# ---- the tiny pair ----------------------------------------------------------------------------


def test_premises_of_the_cases(plain):
    """The cases are built from the tiny target's greedy outputs; if these change, the features
    may no longer bite where the other tests claim they do."""
    c = _ids(plain["greedy_C"])
    assert [c[2], c[4]] == STOP_IDS
    assert plain["stop_C"].finish_reason == "stop" and len(plain["stop_C"].token_ids) == 3
    assert plain["min_tokens_C"].finish_reason == "stop"
    assert len(plain["min_tokens_C"].token_ids) > 20
    text_a = plain["greedy_A"].text
    assert all(w in text_a for w in BAD_WORDS)
    assert 353 in _ids(plain["greedy_A"])
    b = _ids(plain["greedy_B"])
    assert set(b[:8]) <= set(ALLOWED) and not set(b) <= set(ALLOWED)
    assert "path" in plain["greedy_B"].text
    assert _ids(plain["min_p_B"]) == b


@pytest.mark.parametrize("name", BITING)
def test_feature_bites_in_plain_decoding(plain, name):
    assert _ids(plain[name]) != _ids(plain[BY_NAME[name].base])


@pytest.mark.parametrize("name", NAMES)
def test_outputs_identical_to_plain(plain, ddtree, name):
    want, got = plain[name], ddtree["cases"][name]
    assert _ids(got) == _ids(want)
    assert got.text == want.text
    assert got.finish_reason == want.finish_reason


@pytest.mark.parametrize("name", LOGPROB_CASES)
def test_logprobs_equal_plain(plain, ddtree, name):
    assert_logprobs_equal(plain[name], ddtree["cases"][name], BY_NAME[name].params.logprobs)


def test_ddtree_drafted_and_accepted(ddtree):
    m = ddtree["metrics"]
    print(f"mean acceptance length {mean_acceptance_length(m):.2f}")
    assert m["vllm:spec_decode_num_drafts"] > 0
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("engine", ["plain", "ddtree"])
def test_structured_outputs_valid(request, engine):
    outs = request.getfixturevalue("plain")
    if engine == "ddtree":
        outs = request.getfixturevalue("ddtree")["cases"]
    for name in ("choice_A", "choice_D"):
        assert outs[name].text in CHOICES and outs[name].finish_reason == "stop"
    assert re.fullmatch(REGEX, outs["regex_B"].text) and outs["regex_B"].finish_reason == "stop"
    assert isinstance(json.loads(outs["json_A"].text)["a"], int)
    # json_object: the tiny target writes an endless string here; only its start is checked
    assert outs["json_object_C"].text.startswith("{")


def test_structured_requests_verify_branching_trees_pruned_by_their_grammar(ddtree):
    """The scheduler checked the structured requests' trees node by node: trees that branch
    (a node whose parent is not the node before it), nodes the grammar rejected pruned with
    their subtrees (a kept set that is not a prefix), and every kept set a subtree."""
    checks = ddtree["grammar_checks"]
    assert checks, "no structured request sent a tree"
    for parents, kept in checks:
        assert all(parents[n] < 0 or parents[n] in kept for n in kept)
        assert len(parents) <= 7  # L: at most the tree's first L nodes are sent
    assert any(any(p not in (-1, n - 1) for n, p in enumerate(parents))
               for parents, _ in checks), "no tree branched"
    assert any(kept != list(range(len(kept))) for _, kept in checks), "nothing was pruned"


def test_unknown_sampling_field_is_served_without_drafts(plain, ddtree):
    """A request setting a field the plugin does not know: while it is scheduled no request
    verifies drafts (vLLM's sampler serves every row, exact), the outputs of its batch are plain
    decoding's, the log names the field once, and drafting resumes when it has finished."""
    got = ddtree["unknown"]
    for batch in ("first", "second"):
        for name in UNKNOWN:
            assert _ids(got[batch][name]) == _ids(plain[name]), (batch, name)
        assert_logprobs_equal(plain["logprobs5_A"], got[batch]["logprobs5_A"], 5)
    for name in ("greedy_A", "greedy_B"):
        assert _ids(got["after"][name]) == _ids(plain[name])
    assert len(got["warnings"]) == 1 and "presence_penalty" in got["warnings"][0][2]
    held = [drafts for _, drafts, without, _ in got["steps"] if without]
    assert len(held) >= 2 * MAX_TOKENS - 2 and not any(held)  # two batches, no drafts
    assert any(drafts for _, drafts, without, _ in got["steps"] if not without)  # resumed


def test_the_grammar_cost_per_node_reaches_the_workers(ddtree):
    """The scheduler timed the structured requests' grammar work (grammar.GrammarTime) and
    sends its mean per node with every schedule; the worker's policy holds the latest."""
    sent = [node_s for *_, node_s in ddtree["unknown"]["steps"]]
    assert sent and all(0 < s < 0.1 for s in sent)
    assert ddtree["unknown"]["worker_grammar_node_s"] == sent[-1]


def test_seeded_sampling_with_features_is_reproducible(ddtree):
    mixed, alone = ddtree["seeded"]
    for out in (mixed, alone):
        assert len(out.token_ids) == MAX_TOKENS
        assert len(out.logprobs) == MAX_TOKENS
        assert all(t in lp and 2 <= len(lp) <= 3 for t, lp in zip(out.token_ids, out.logprobs))
    assert _ids(mixed) == _ids(alone) and mixed.text == alone.text


def test_seeded_logprobs_are_those_of_the_emitted_tokens(ddtree):
    """logprobs=0: each position reports exactly the emitted token, in steps with drafts and
    in steps without (prefill: vLLM's sampler draws a token the seeded noise then replaces;
    before the fix 5 of 192 positions reported vLLM's token)."""
    for out in ddtree["seeded_sole"]:
        assert len(out.logprobs) == len(out.token_ids) == 32
        for pos, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            assert set(lp) == {token}, (pos, token, lp)
            assert lp[token].logprob <= 0.0


# ---- the always-right pair, deep trees --------------------------------------------------------

ORACLE_BUDGET = 64
ORACLE_MAX_TOKENS = 40
# the target's logits after every prefix: 'self' 40, '.' 38, 'path' 37, 'get' 36, 'name' 35, the
# rest 0 (the drafter shares the lm_head, so it drafts 'self' chains with these as siblings)
ORACLE_LOGITS = {268: 40.0, 17: 38.0, 459: 37.0, 396: 36.0, 366: 35.0}
ORACLE_ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=1024, reasoning_config=REASONING)


def oracle_greedy(**kw) -> SamplingParams:
    args = dict(temperature=0.0, max_tokens=ORACLE_MAX_TOKENS, ignore_eos=True)
    args.update(kw)
    return SamplingParams(**args)


ORACLE_CASES = [
    Case("greedy", PROMPTS[0], oracle_greedy()),
    Case("frequency", PROMPTS[1], oracle_greedy(frequency_penalty=0.8), base="greedy"),
    Case("presence", PROMPTS[2], oracle_greedy(presence_penalty=2.0), base="greedy"),
    Case("repetition", PROMPTS[3], oracle_greedy(repetition_penalty=1.3), base="greedy"),
    Case("penalties", PROMPTS[4], oracle_greedy(frequency_penalty=0.4, presence_penalty=0.5,
                                                repetition_penalty=1.05), base="greedy"),
    # 'path' stops, but not before 20 tokens; the frequency penalty makes the target emit it
    Case("min_tokens", PROMPTS[5], oracle_greedy(ignore_eos=False, frequency_penalty=0.8,
                                                 min_tokens=20, stop_token_ids=[459]),
         base="greedy"),
    # 'selfself' is 268 268: 'self' is banned right after 'self', a mask that depends on the path
    Case("bad_words", PROMPTS[0], oracle_greedy(bad_words=["selfself"]), base="greedy"),
    Case("logit_bias", PROMPTS[1], oracle_greedy(logit_bias={268: -3.0}), base="greedy"),
    Case("allowed_ids", PROMPTS[2], oracle_greedy(allowed_token_ids=list(range(300, 320)) + [17, 459]),
         base="greedy"),
    Case("logprobs5_frequency", PROMPTS[3], oracle_greedy(logprobs=5, frequency_penalty=0.8),
         base="greedy"),
    Case("logprobs0", PROMPTS[4], oracle_greedy(logprobs=0)),
    Case("greedy_2", PROMPTS[5], oracle_greedy()),
    # the first 'self' opens a thinking section: 6 tokens, then 'get_name' is forced (3
    # tokens), then the next 'self' opens the next: forced rows at depths set by each path
    Case("thinking", PROMPTS[0], oracle_greedy(thinking_token_budget=6), base="greedy"),
    # structured outputs verify the grammar-valid subtree of their tree: here only 'self'
    # (the siblings the drafter ranks next are pruned: a chain) ...
    Case("regex_self", PROMPTS[1], SamplingParams(
        temperature=0.0, max_tokens=ORACLE_MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(regex=r"(self)+"))),
    # ... here every token the target ranks (whole trees), and 'name' only once (pruned below
    # the nodes after it)
    Case("regex_tree", PROMPTS[2], SamplingParams(
        temperature=0.0, max_tokens=ORACLE_MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(regex=r"(self|\.|path|get)+(name)?(self)*"))),
]
ORACLE_NAMES = [c.name for c in ORACLE_CASES]
ORACLE_BY_NAME = {c.name: c for c in ORACLE_CASES}


@pytest.fixture(scope="module")
def oracle_target(tmp_path_factory):
    import torch
    from safetensors.torch import load_file, save_file

    spec = importlib.util.spec_from_file_location(
        "oracle_pair", os.path.join(ROOT, "benchmarks", "oracle_pair.py"))
    oracle_pair = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(oracle_pair)
    out = str(tmp_path_factory.mktemp("oracle_pair"))
    oracle_pair.make_pair(out, 268)
    # the normed residual is (sqrt(hidden), 0, ...): lm_head row t = logit_t / sqrt(hidden) e_0
    path = os.path.join(out, "target", "model.safetensors")
    weights = load_file(path)
    lm_head = torch.zeros_like(weights["lm_head.weight"])
    scale = math.sqrt(lm_head.shape[1])
    for token, logit in ORACLE_LOGITS.items():
        lm_head[token, 0] = logit / scale
    weights["lm_head.weight"] = lm_head
    save_file(weights, path)
    return os.path.join(out, "target"), os.path.join(out, "drafter")


@pytest.fixture(scope="module")
def oracle_plain(oracle_target):
    llm = make_llm(None, model=oracle_target[0], **ORACLE_ENGINE)
    try:
        return _generate(llm, ORACLE_CASES)
    finally:
        close(llm)


@pytest.fixture(scope="module")
def oracle_ddtree(oracle_target):
    target, drafter = oracle_target
    # Calibrated trees (the default): the feature requests, whose targets leave the drafter's
    # first choice, do not teach the calibration (known_params.reshapes_target). When they
    # did, the structured request alone then accepted nothing past depth 5 (per depth
    # [7, 7, 6, 6, 6, 0, 0, 0]): test_oracle_trees_were_deep holds that it does.
    llm = make_llm(ddtree_spec(ORACLE_BUDGET, model=drafter), model=target, **ORACLE_ENGINE)
    try:
        got = _generate(llm, ORACLE_CASES)
        before = spec_metrics(llm)
        # again, the requests with features alone: their own trees must be deep too
        features = [c for c in ORACLE_CASES if not c.name.startswith("greedy")]
        again = _generate(llm, features)
        after = spec_metrics(llm)
        alone, marks = {}, [after]
        for name in ("regex_self", "allowed_ids", "regex_tree"):  # their drafts, alone
            alone[name] = _generate(llm, [ORACLE_BY_NAME[name]])[name]
            marks.append(spec_metrics(llm))
    finally:
        close(llm)

    def delta(new, old):
        return {k: ([a - b for a, b in zip(new[k], old[k])] if isinstance(new[k], list)
                    else new[k] - old[k]) for k in new}

    return {"cases": got, "again": {**again, "regex_self": alone["regex_self"],
                                    "regex_tree": alone["regex_tree"]},
            "metrics": before, "features_metrics": delta(after, before),
            "structured_metrics": delta(marks[1], marks[0]),
            "allowed_metrics": delta(marks[2], marks[1]),
            "structured_tree_metrics": delta(marks[3], marks[2])}


def test_oracle_premises(oracle_plain):
    assert set(_ids(oracle_plain["greedy"])) == {268}
    for name in ORACLE_NAMES:
        base = ORACLE_BY_NAME[name].base
        if base is not None:
            assert _ids(oracle_plain[name]) != _ids(oracle_plain[base]), name
    mt = oracle_plain["min_tokens"]
    assert mt.finish_reason == "stop" and len(mt.token_ids) == 21 and mt.token_ids[-1] == 459


@pytest.mark.parametrize("name", ORACLE_NAMES)
def test_oracle_outputs_identical_to_plain(oracle_plain, oracle_ddtree, name):
    want, got = oracle_plain[name], oracle_ddtree["cases"][name]
    assert _ids(got) == _ids(want)
    assert got.finish_reason == want.finish_reason


@pytest.mark.parametrize("name", ["logprobs5_frequency", "logprobs0"])
def test_oracle_logprobs_equal_plain(oracle_plain, oracle_ddtree, name):
    top_n = ORACLE_BY_NAME[name].params.logprobs
    assert_logprobs_equal(oracle_plain[name], oracle_ddtree["cases"][name], top_n)


def test_oracle_feature_requests_alone_give_the_same_outputs(oracle_ddtree):
    """The second pass (feature requests only, other batches) repeats the first."""
    for name, out in oracle_ddtree["again"].items():
        assert _ids(out) == _ids(oracle_ddtree["cases"][name]), name


@pytest.mark.parametrize("which", ["metrics", "features_metrics", "structured_metrics",
                                   "allowed_metrics", "structured_tree_metrics"])
def test_oracle_trees_were_deep(oracle_ddtree, which):
    """All cases, then the feature requests alone, then the structured-output request alone
    (its chain of drafts), then the allowed-ids request alone (the drafter drafts allowed
    tokens only: its favourite, 'self', is not allowed, and without the mask every step would
    accept nothing): drafted, and paths of 6 and more tokens accepted (the penalties and masks
    still let the drafted chain through at some depths)."""
    m = oracle_ddtree[which]
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
    print(f"{which}: mean acceptance length {mean_acceptance_length(m):.2f}, "
          f"accepted per depth {per_pos[:8]}")
    assert m["vllm:spec_decode_num_drafts"] > 0
    assert per_pos[5] > 0
    assert mean_acceptance_length(m) > 1.5
