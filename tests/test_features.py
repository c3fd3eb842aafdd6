"""Request features on tree rows (``vllm_ddtree.plugin.features``) against vLLM's own processing
of one row with an explicit history.

The walk emits a path whose token at each step is the sample of the row it stands on, so the
law of the emitted text is the product, along the path, of the rows' processed laws: it is
plain decoding's law exactly when every row's processed logits are plain decoding's after the
same history (the request's output tokens plus the row's path). That is what this file checks,
row by row, for every feature at once and each alone, with vLLM's own functions as the oracle
where they exist (``apply_all_penalties`` and ``_apply_bad_words_single_batch`` on the row's
explicit history, a non-speculative ``ThinkingBudgetStateHolder`` stepped token by token along
it as plain decoding steps it, the built-in processors' rules written out per row otherwise);
then the sampler's greedy choice and its min_p step; then the composition end to end: the
emitted text's exact law at T = 1, by enumerating every outcome of a tree's rows and walking
it, against plain decoding's law with the same features (two mutants fail it: rows processed
with the root's history, and rows not processed). Engine-level identity with plain decoding is
in ``test_vllm_features.py``.
"""

from __future__ import annotations

import itertools
import math
import types
from collections import defaultdict

import pytest
import torch
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)
from vllm.v1.sample.ops.bad_words import _apply_bad_words_single_batch
from vllm.v1.sample.logits_processor.interface import BatchUpdate
from vllm.v1.sample.ops.penalties import apply_all_penalties
from vllm.v1.sample.thinking_budget_state import ThinkingBudgetStateHolder

from vllm_ddtree.plugin.features import ForcedRows, TreeFeatures, forced_tokens
from vllm_ddtree.sampling import RowSampling, SamplingBatch, sample_rows
from vllm_ddtree.tree import DraftTree, build_tree, pack_mask
from vllm_ddtree.walk import walk

VOCAB = 12
DEVICE = torch.device("cpu")
# thinking: a one-token start, a two-token end (vLLM forces it token by token)
THINK = types.SimpleNamespace(reasoning_start_token_ids=[3], reasoning_end_token_ids=[7, 9])
# request -> (prompt, budget): request 0's prompt ends inside a thinking section, the others
# enter one when they emit token 3; request 1 has no budget
THINKING = {0: ([5, 3, 1], 3), 2: ([4, 4], 1), 3: ([2, 8, 6], 2)}


def _step(seed: int, num_draft=(10, 6, 0, 10), depth=4, budget=10):
    """A verify step: trees built from random draft logits, request r verifies its first
    ``num_draft[r]`` nodes (a subtree), the flat rows' logits and vLLM-style row offsets."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(num_draft)
    tree = build_tree(torch.randn(num_reqs, depth, VOCAB, generator=gen) * 2, budget)
    cu = torch.tensor(num_draft).add(1).cumsum(0)
    logits = torch.randn(int(cu[-1]), VOCAB, generator=gen) * 3
    return tree, list(num_draft), cu, logits, gen


def _metadata(num_reqs: int, gen: torch.Generator, features: set[str]):
    """vLLM-shaped sampling metadata with the given features on some requests (request 1 has
    none of them, so rows without a feature are checked too)."""
    outputs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 3, 0, 7)][:num_reqs]
    prompt = torch.randint(0, VOCAB, (num_reqs, 6), generator=gen)
    prompt[0, 4:] = VOCAB  # padding, as vLLM pads prompts
    min_tokens = MinTokensLogitsProcessor(None, DEVICE, False)
    bias = LogitBiasLogitsProcessor(None, DEVICE, False)
    min_p = MinPLogitsProcessor(types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(max_num_seqs=8)), DEVICE, False)
    meta = types.SimpleNamespace(
        allowed_token_ids_mask=None, bad_words_token_ids={}, output_token_ids=outputs,
        no_penalties=True, prompt_token_ids=prompt,
        presence_penalties=torch.zeros(num_reqs), frequency_penalties=torch.zeros(num_reqs),
        repetition_penalties=torch.ones(num_reqs),
        logitsprocs=LogitsProcessors([min_tokens, bias, min_p]))
    if "allowed" in features:
        mask = torch.ones(num_reqs, VOCAB, dtype=torch.bool)
        mask[0, [1, 2, 3, 5, 8]] = False
        mask[1] = False
        mask[3, :7] = False
        meta.allowed_token_ids_mask = mask
    if "bad_words" in features:
        # single tokens, pairs and triples whose prefix the trees' paths or the outputs hold
        out0 = outputs[0]
        meta.bad_words_token_ids = {0: [[4], [out0[-1], 3], [out0[-2], out0[-1], 7], [2, 9]],
                                    3: [[1, 1], [6, 6, 6], [0, 5]], 2: [[3, 4]]}
    if "min_tokens" in features:
        min_tokens.min_toks = {0: (8, outputs[0], {1, 4}, False),  # 3 more: depths 0..2 masked
                               3: (9, outputs[3], {0}, False), 2: (2, outputs[2], {5, 6}, False)}
    if "logit_bias" in features:
        bias.biases = {0: {3: 5.0, 7: -2.5}, 2: {0: 1.25}, 3: {3: -100.0, 11: 0.5}}
    if "penalties" in features:
        meta.no_penalties = False
        meta.presence_penalties = torch.tensor([0.7, 0.0, 1.1, -0.4])[:num_reqs]
        meta.frequency_penalties = torch.tensor([0.3, 0.0, -0.2, 0.9])[:num_reqs]
        meta.repetition_penalties = torch.tensor([1.3, 1.0, 0.8, 1.7])[:num_reqs]
    if "min_p" in features:
        min_p.min_p_cpu[:num_reqs] = [0.2, 0.0, 0.5, 0.05][:num_reqs]
        min_p.min_p_count = 3
    if "thinking" in features:
        meta.thinking_budget_state_holder = _thinking_holder(
            {r: (prompt, budget, outputs[r]) for r, (prompt, budget) in THINKING.items()
             if r < num_reqs}, num_spec_tokens=16)  # the engine's: speculative
    return meta


def _thinking_holder(requests, num_spec_tokens: int) -> ThinkingBudgetStateHolder:
    holder = ThinkingBudgetStateHolder(THINK, 8, num_spec_tokens, DEVICE, False)
    added = [(r, types.SimpleNamespace(thinking_token_budget=budget), prompt, output)
             for r, (prompt, budget, output) in requests.items()]
    holder.sync_batch(BatchUpdate(batch_size=8, removed=[], added=added, moved=[]))
    return holder


def _plain_forced(prompt: list[int], budget: int, history: list[int]) -> int | None:
    """The token plain decoding forces after ``history``: vLLM's holder without speculation,
    stepped as its sampler steps it, once per decode step (output lengths 0 .. len(history)),
    through its public calls; the last step's forced logit names the token."""
    holder = _thinking_holder({0: (prompt, budget, [])}, num_spec_tokens=0)
    for length in range(len(history) + 1):
        holder.update_state([list(history[:length])], [[]])
        logits = holder.apply_to_logits(torch.zeros(1, VOCAB), False, [[]])
    hit = (logits[0] == 1e9).nonzero().flatten().tolist()
    assert len(hit) <= 1
    return hit[0] if hit else None


def _row_history(tree, meta, request: int, node: int) -> list[int]:
    """The output tokens, then the path root -> node (explicit parent walk)."""
    path = []
    while node >= 0:
        path.append(int(tree.token_ids[request, node]))
        node = int(tree.parents[request, node])
    return list(meta.output_token_ids[request]) + path[::-1]


def _oracle_row(logits_row, tree, meta, request: int, node: int) -> torch.Tensor:
    """Plain decoding's processing of one tree row (its history: the output, then its path)."""
    return _plain_row(logits_row, meta, request, _row_history(tree, meta, request, node))


def _plain_row(logits_row, meta, request: int, history: list[int]) -> torch.Tensor:
    """Plain decoding's processing of one row with an explicit history, in vLLM's order."""
    x = logits_row.clone()[None]
    depth = len(history) - len(meta.output_token_ids[request])
    if meta.allowed_token_ids_mask is not None:
        x.masked_fill_(meta.allowed_token_ids_mask[request], float("-inf"))
    if request in meta.bad_words_token_ids:
        _apply_bad_words_single_batch(x[0], meta.bad_words_token_ids[request], history)
    for processor in meta.logitsprocs.non_argmax_invariant:
        if isinstance(processor, MinTokensLogitsProcessor):
            entry = processor.min_toks.get(request)
            if entry is not None and len(entry[1]) + depth < entry[0]:
                x[0, sorted(entry[2])] = float("-inf")
        else:
            for token, value in processor.biases.get(request, {}).items():
                x[0, token] += value
    if not meta.no_penalties:
        x = apply_all_penalties(x, meta.prompt_token_ids[request:request + 1],
                                meta.presence_penalties[request:request + 1],
                                meta.frequency_penalties[request:request + 1],
                                meta.repetition_penalties[request:request + 1], [history])
    if getattr(meta, "thinking_budget_state_holder", None) is not None and request in THINKING:
        forced = _plain_forced(*THINKING[request], history)
        if forced is not None:
            x[0, forced] = 1e9
    return x[0]


def _rows(num_draft):
    return [(r, i - 1) for r, m in enumerate(num_draft) for i in range(m + 1)]


ALL = {"allowed", "bad_words", "min_tokens", "logit_bias", "penalties", "min_p", "thinking"}


@pytest.mark.parametrize("features", [{f} for f in sorted(ALL - {"min_p"})] + [ALL])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_row_is_processed_as_plain_decoding_after_its_path(features, seed):
    tree, num_draft, cu, logits, gen = _step(seed)
    meta = _metadata(len(num_draft), gen, features)
    built = TreeFeatures.build(meta, tree, cu, tuple(logits.shape))
    assert built is not None
    rows = _rows(num_draft)
    expected = torch.stack([_oracle_row(logits[i], tree, meta, r, n)
                            for i, (r, n) in enumerate(rows)])
    # any subset of rows, in any order, in chunks: as the sampler's chunks and seeded rows
    order = torch.randperm(len(rows), generator=gen)
    for part in order.split(5):
        got = built.apply(logits[part].clone(), part)
        assert torch.equal(got, expected[part]), (features, part.tolist())
    changed = ~torch.isclose(expected, logits).all(dim=-1)
    assert changed.any(), "the features changed no row: the check could not fail"


def _min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """vLLM's min_p on temperature-scaled logits: tokens below min_p x the top probability."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p, float("-inf"))


def _hand_trees(tokens: list[int], parents: list[int], num_reqs: int) -> DraftTree:
    """Request 0's tree from token / parent lists (parents before children), then
    ``num_reqs - 1`` requests without nodes."""
    n = len(tokens)
    depths, dense = [], torch.zeros(num_reqs, n + 1, n + 1, dtype=torch.bool)
    dense[:, :, 0] = True
    for k, p in enumerate(parents):
        depths.append(1 if p < 0 else depths[p] + 1)
        dense[0, k + 1] = dense[0, p + 1]
        dense[0, k + 1, k + 1] = True
    pad = [[-1] * n] * (num_reqs - 1)
    return DraftTree(
        token_ids=torch.tensor([tokens] + pad), parents=torch.tensor([parents] + pad),
        depths=torch.tensor([depths] + [[0] * n] * (num_reqs - 1)),
        scores=torch.zeros(num_reqs, n), num_nodes=torch.tensor([n] + [0] * (num_reqs - 1)),
        ancestor_mask=pack_mask(dense), max_depth=max(depths))


@pytest.mark.parametrize("features", [{f} for f in sorted(ALL)] + [ALL])
def test_the_emitted_text_has_plain_decodings_law_by_enumeration(features):
    """End to end at T = 1 on request 0 (each feature, then all at once): a tree of 3 nodes
    on plain decoding's likely paths, its rows processed by TreeFeatures (then min_p), every
    joint outcome of the rows' samples enumerated (12^4) and walked; the emitted tokens,
    continued by plain decoding, have exactly plain decoding's law of the next 3 tokens (each
    prefix processed as plain decoding after the output plus that prefix). The features are
    set where the path matters: a bad word and a min_tokens bound that bite on node rows
    only, a thinking budget whose end is forced from the root on."""
    gen = torch.Generator().manual_seed(7)
    depth = 2
    prefixes = [p for n in range(depth + 1) for p in itertools.product(range(VOCAB), repeat=n)]
    index = {p: i for i, p in enumerate(prefixes)}
    target = torch.randn(len(prefixes), VOCAB, generator=gen) * 1.5  # the target, per prefix
    meta = _metadata(4, gen, features)
    outputs = meta.output_token_ids[0]
    outputs[:] = [2, 6]  # in place: the processors' entries hold this list
    if "thinking" in features:  # prompt [5, 3, 1], budget 3: the end is forced from the root
        meta.thinking_budget_state_holder = _thinking_holder(
            {r: (prompt, budget, meta.output_token_ids[r]) for r, (prompt, budget)
             in THINKING.items()}, num_spec_tokens=16)
    min_p = float(meta.logitsprocs.argmax_invariant[0].min_p_cpu[0]) if "min_p" in features \
        else 0.0

    def plain_law():
        def probs(prefix):
            row = _plain_row(target[index[prefix]], meta, 0, outputs + list(prefix))
            return _min_p(row[None], min_p)[0].softmax(-1).double()
        return torch.stack([probs(p) for p in prefixes])  # [prefixes, V]

    first = int(plain_law()[index[()]].argmax())
    raw_next = int(target[index[(first,)]].argmax())  # the target's own choice after it
    if "bad_words" in features:  # banned after `first` only: on that node's row
        meta.bad_words_token_ids[0] = [[first, raw_next]]
    if "min_tokens" in features:  # stop tokens masked at depth 0 only: the root's row
        meta.logitsprocs.non_argmax_invariant[0].min_toks[0] = (3, outputs, {raw_next}, False)
    plain = plain_law()
    ranked = plain[index[()]].argsort(descending=True).tolist()
    tree = _hand_trees([ranked[0], ranked[1], int(plain[index[(ranked[0],)]].argmax())],
                       [-1, -1, 0], 4)
    paths = [(), (ranked[0],), (ranked[1],), (ranked[0], int(tree.token_ids[0, 2]))]
    logits = torch.cat([target[[index[p] for p in paths]], torch.randn(3, VOCAB, generator=gen)])
    built = TreeFeatures.build(meta, tree, torch.tensor([4, 5, 6, 7]), tuple(logits.shape))
    rows, probs = torch.arange(4), logits[:4].clone()
    if built is not None:
        probs = built.after_temperature(built.apply(probs, rows), rows)
    probs = probs.softmax(-1).double()
    outcomes = torch.tensor(list(itertools.product(range(VOCAB), repeat=4)))
    one = DraftTree(**{f: (getattr(tree, f)[:1].expand(len(outcomes), *getattr(tree, f).shape[1:])
                           if torch.is_tensor(getattr(tree, f)) else getattr(tree, f))
                       for f in tree.__dataclass_fields__})
    verdict = walk(one, outcomes)
    weights = probs[rows[None, :], outcomes].prod(dim=1)
    emitted = defaultdict(float)
    for out, n, w in zip(verdict.output_tokens.tolist(), verdict.num_accepted.tolist(),
                         weights.tolist()):
        emitted[tuple(out[: n + 1])] += w
    assert sum(w for e, w in emitted.items() if len(e) == 3) > 0.01  # depth 2 accepted
    # each emitted prefix continued by plain decoding to 3 tokens, against plain's own law
    got, law = defaultdict(float), {}
    for seq in itertools.product(range(VOCAB), repeat=depth + 1):
        law[seq] = math.prod(float(plain[index[seq[:i]], t]) for i, t in enumerate(seq))
    for prefix, w in emitted.items():
        for rest in itertools.product(range(VOCAB), repeat=depth + 1 - len(prefix)):
            got[prefix + rest] += w * math.prod(float(plain[index[prefix + rest[:i]], t])
                                                for i, t in enumerate(rest))
    assert max(abs(got[k] - law[k]) for k in law) < 1e-6  # float32 rows; a wrong law: >1e-3
    assert not torch.allclose(plain, target.softmax(-1).double()), "no feature bit"


def test_paths_matter_rows_of_one_request_differ():
    """Penalties and bad words depend on the path: rows of the same request with different
    paths get different processing (a check that ignored paths would pass rows equal)."""
    tree, num_draft, cu, logits, gen = _step(3)
    meta = _metadata(len(num_draft), gen, {"penalties"})
    built = TreeFeatures.build(meta, tree, cu, tuple(logits.shape))
    same = logits[:1].expand(num_draft[0] + 1, -1).clone()  # request 0's rows, equal logits
    got = built.apply(same, torch.arange(num_draft[0] + 1))
    assert len({tuple(row.tolist()) for row in got}) > 1


def test_no_features_builds_nothing():
    tree, num_draft, cu, logits, gen = _step(0)
    assert TreeFeatures.build(_metadata(len(num_draft), gen, set()), tree, cu,
                              tuple(logits.shape)) is None


def test_min_tokens_keeps_a_structured_row_that_would_be_all_masked():
    """vLLM's rule for structured-output requests: stop tokens stay when masking them would
    leave the row at -inf (the grammar allows nothing else)."""
    tree, num_draft, cu, logits, gen = _step(0)
    meta = _metadata(len(num_draft), gen, set())
    processor = meta.logitsprocs.non_argmax_invariant[0]
    processor.min_toks = {0: (50, meta.output_token_ids[0], {1, 4}, True),
                          3: (50, meta.output_token_ids[3], {1, 4}, False)}
    logits[:] = float("-inf")
    logits[:, [1, 4]] = 2.0  # the grammar allows only the stop tokens
    logits[1, 6] = 0.5  # except on row 1 (request 0, node 0)
    built = TreeFeatures.build(meta, tree, cu, tuple(logits.shape))
    got = built.apply(logits.clone(), torch.arange(logits.shape[0]))
    request0 = range(num_draft[0] + 1)
    for row in request0:
        kept = row != 1
        assert torch.isfinite(got[row, [1, 4]]).all() == kept, row
    start3 = int(cu[2])
    assert torch.isneginf(got[start3:]).all()  # not structured: masked whatever is left


def test_sample_rows_greedy_and_min_p_follow_the_processed_rows():
    tree, num_draft, cu, logits, gen = _step(4)
    meta = _metadata(len(num_draft), gen, ALL - {"allowed"})  # no row left all -inf
    built = TreeFeatures.build(meta, tree, cu, tuple(logits.shape))
    rows = _rows(num_draft)
    processed = torch.stack([_oracle_row(logits[i], tree, meta, r, n)
                             for i, (r, n) in enumerate(rows)])
    assert torch.equal(sample_rows(logits, None, None, features=built), processed.argmax(-1))
    # min_p after the temperature: tokens below min_p x the top probability are never drawn
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.9])
    sampling = SamplingBatch(temperature=temperature, top_k=None, top_p=None)
    row_sampling = RowSampling.expand(sampling, cu, num_draft, VOCAB, all_random=True)
    request = torch.tensor([r for r, _ in rows])
    probs = (processed / temperature[request, None]).softmax(-1)
    min_p = torch.from_numpy(meta.logitsprocs.argmax_invariant[0].min_p_cpu[:4].copy())
    allowed = probs >= probs.amax(-1, keepdim=True) * min_p[request, None]
    seen = torch.zeros_like(allowed)

    def draw(chunk, generators, k, p):
        return torch.multinomial(chunk.softmax(-1), 1, generator=gen)[:, 0], None

    for _ in range(200):
        tokens = sample_rows(logits, row_sampling, draw, all_random=True, features=built)
        seen[torch.arange(len(rows)), tokens] = True
    assert not (seen & ~allowed).any()
    assert (allowed.sum(-1) < (probs > 0).sum(-1)).any(), "min_p masked nothing"


def _oracle_forced(tree, outputs, num_draft) -> list[int]:
    """Plain decoding's forced token per flat row (-1: none), from each row's explicit history."""
    meta = types.SimpleNamespace(output_token_ids=outputs)
    return [-1 if r not in THINKING else (lambda f: -1 if f is None else f)(
                _plain_forced(*THINKING[r], _row_history(tree, meta, r, n)))
            for r, n in _rows(num_draft)]


@pytest.mark.parametrize("seed", [0, 5])
def test_thinking_budget_follows_the_output_across_steps(seed):
    """Four verify steps of one batch, each emitting a path of its tree (as the walk does):
    every step's forced rows are plain decoding's after the row's history, so the state kept
    between steps (advanced by the emitted tokens) is right, with trees and without drafts
    (``ForcedRows``, vLLM's sampler interface); and the forcing depends on the path (some
    request has forced and free rows in one step)."""
    gen = torch.Generator().manual_seed(seed)
    outputs = [[], [1], [3, 0], [6, 3]]
    holder = _thinking_holder({r: (prompt, budget, outputs[r])
                               for r, (prompt, budget) in THINKING.items()}, num_spec_tokens=16)
    mixed = False
    for step in range(4):
        num_draft = [0] * 4 if step == 2 else [10, 6, 0, 10]
        tree = build_tree(torch.randn(4, 4, VOCAB, generator=gen) * 2, 10)
        got = forced_tokens(holder, outputs, tree.token_ids.tolist(), tree.parents.tolist(),
                            num_draft, DEVICE)
        want = _oracle_forced(tree, outputs, num_draft)
        assert (got.tolist() if got is not None else [-1] * len(want)) == want, step
        if step == 2:  # no drafts: vLLM's sampler gets the forced rows through ForcedRows
            logits = torch.zeros(4, VOCAB)
            ForcedRows(got).apply_to_logits(logits)
            assert [int(row.argmax()) if row.max() > 0 else -1 for row in logits] == want
        rows = _rows(num_draft)
        for r in range(4):
            mine = {want[i] >= 0 for i, (q, _) in enumerate(rows) if q == r}
            mixed |= mine == {True, False}
        for r, m in enumerate(num_draft):  # emit the path to a random node (or the root)
            node = int(torch.randint(-1, m, (1,), generator=gen)) if m else -1
            path = _row_history(tree, types.SimpleNamespace(output_token_ids=[[]] * 4), r, node)
            outputs[r].extend(path + [int(torch.randint(0, VOCAB, (1,), generator=gen))])
    assert mixed, "no request had forced and free rows in one step: the path never mattered"
    assert any(len(outputs[r]) > 8 for r in THINKING)


def test_thinking_state_of_a_finished_request_is_not_inherited():
    """vLLM's condense() moves a request into a finished one's slot without reporting the
    removal; its holder then keeps the finished request's state there. The moved request has
    no budget: none of its rows is forced, and the stale entry is dropped."""
    from vllm.v1.sample.logits_processor.interface import MoveDirectionality

    finished, moved = [3, 1, 1, 1, 1, 1], [2, 2]
    holder = _thinking_holder({0: ([3], 1, finished)}, num_spec_tokens=16)
    outputs = [finished, moved]
    assert forced_tokens(holder, outputs, [[]] * 2, [[]] * 2, [0, 0], DEVICE).tolist() == [7, -1]
    holder.sync_batch(BatchUpdate(batch_size=1, removed=[], added=[],
                                  moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    assert 0 in holder._state  # vLLM's leftover
    assert forced_tokens(holder, [moved], [[]], [[]], [0], DEVICE) is None
    assert not holder.has_tracked_requests()
