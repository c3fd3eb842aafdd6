"""TreeState's per-request draft clipping near max_tokens / max_model_len (no engine).

Oracle: the rule written out per request (keep the nodes of depth <= the usable depth, in
order) and the verify tree rebuilt from those nodes by hand.
"""

from types import SimpleNamespace

import pytest
import torch

from vllm_ddtree.plugin.options import DDTreeOptions
from vllm_ddtree.plugin.state import TreeState, best_path
from vllm_ddtree.tree import _ancestor_mask, build_tree, unpack_mask

DEPTH, BUDGET = 4, 12


def depths_from_parents(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[R, B]`` depth of each node (1 for root children, 0 for padding), by pointer jumping.

    Each node keeps an ancestor and its distance to it; every round jumps to the ancestor's
    ancestor, so ceil(log2(B)) + 1 rounds reach the root. Example: chain parents [-1, 0, 1]
    -> depths [1, 2, 3].
    """
    ancestor = parents
    distance = torch.ones_like(parents)
    for _ in range(parents.shape[1].bit_length() + 1):
        has = ancestor >= 0
        hop = ancestor.clamp(min=0)
        distance = torch.where(has, distance + distance.gather(1, hop), distance)
        ancestor = torch.where(has, ancestor.gather(1, hop), ancestor)
    return torch.where(valid, distance, 0)


def request(num_prompt, num_out, max_tokens):
    return SimpleNamespace(num_tokens=num_prompt + num_out, output_token_ids=[0] * num_out,
                           sampling_params=SimpleNamespace(max_tokens=max_tokens))


def proposed_state():
    state = TreeState(DDTreeOptions(budget=BUDGET, depth=DEPTH), torch.device("cpu"))
    logits = torch.randn(3, DEPTH, 5, generator=torch.Generator().manual_seed(1)) * 2
    tree = build_tree(logits, BUDGET)
    state.record_proposal(["a", "b", "c"], tree)
    return state, tree


def test_clip_drafts_keeps_the_usable_nodes_in_order():
    state, tree = proposed_state()
    requests = {
        "a": request(2, 5, max_tokens=100),  # far from every limit: all nodes
        "b": request(2, 5, max_tokens=8),  # 3 more tokens: accept <= 2 -> depth <= 2
        "c": request(10, 5, max_tokens=100),  # max_model_len 17: 17 - 15 - 1 = 1 -> depth 1
    }
    drafts = [tree.token_ids[r].tolist() for r in range(3)]
    state.clip_drafts(["a", "b", "c", "gone"], drafts + [[1, 2]], requests, max_model_len=17)
    depths = tree.depths.tolist()
    assert drafts[0] == tree.token_ids[0].tolist()
    keep_b = [i for i in range(BUDGET) if depths[1][i] <= 2]
    keep_c = [i for i in range(BUDGET) if depths[2][i] <= 1]
    assert 0 < len(keep_c) < len(keep_b) < BUDGET, "the random trees must exercise the cut"
    assert drafts[1] == [tree.token_ids[1, i].item() for i in keep_b]
    assert drafts[2] == [tree.token_ids[2, i].item() for i in keep_c]

    # the verify step sees exactly the kept nodes, with their parents re-indexed
    scheduled = torch.tensor(sum(drafts, []))
    verify = state.begin_verify(["a", "b", "c"], [len(d) for d in drafts], scheduled,
                                [0, 20, 40], 60)
    assert verify.matched.tolist() == [True, True, True]
    for row, keep in ((1, keep_b), (2, keep_c)):
        new_of = {old: new for new, old in enumerate(keep)}
        parents = [-1 if tree.parents[row, i] < 0 else new_of[tree.parents[row, i].item()]
                   for i in keep]
        assert verify.tree.parents[row, : len(keep)].tolist() == parents
        assert verify.tree.token_ids[row, : len(keep)].tolist() == drafts[row]
        assert (verify.tree.token_ids[row, len(keep):] == -1).all()
        mask = unpack_mask(verify.tree.ancestor_mask[row:row + 1], BUDGET + 1)[0]
        for new, old in enumerate(keep):  # ancestors = the same nodes, re-indexed
            old_mask = unpack_mask(tree.ancestor_mask[row:row + 1], BUDGET + 1)[0, old + 1]
            ancestors = {new_of[j - 1] + 1 for j in range(1, BUDGET + 1) if old_mask[j]} | {0}
            assert {j for j in range(BUDGET + 1) if mask[new + 1, j]} == ancestors


def test_structured_output_requests_send_their_tree_and_verify_the_scheduler_cut():
    """A request with structured outputs sends its tree's first L nodes (cut near its end like
    any request) and their parents, for the scheduler's grammar check; the scheduler keeps a
    subtree (not a prefix: a pruned node takes its descendants along) and the verify step sees
    exactly those nodes, parents and ancestor rows re-indexed."""
    state, tree = proposed_state()
    requests = {"a": request(2, 5, max_tokens=100), "b": request(2, 5, max_tokens=100),
                "c": request(2, 5, max_tokens=8)}
    requests["b"].sampling_params = SimpleNamespace(max_tokens=100, structured_outputs=object())
    requests["c"].sampling_params = SimpleNamespace(max_tokens=8, structured_outputs=object())
    drafts = [tree.token_ids[r].tolist() for r in range(3)]
    trees = state.clip_drafts(["a", "b", "c"], drafts, requests, max_model_len=1000)
    assert set(trees) == {"b", "c"}
    assert drafts[0] == tree.token_ids[0].tolist()
    assert drafts[1] == tree.token_ids[1, :DEPTH].tolist()
    assert trees["b"] == tree.parents[1, :DEPTH].tolist()
    keep_c = [i for i in range(BUDGET) if 0 < tree.depths[2, i] <= 2][:DEPTH]  # 3 more tokens
    assert drafts[2] == [tree.token_ids[2, i].item() for i in keep_c]
    new_of = {old: new for new, old in enumerate(keep_c)}
    assert trees["c"] == [-1 if tree.parents[2, i] < 0 else new_of[tree.parents[2, i].item()]
                          for i in keep_c]
    # the scheduler prunes b's first depth-1 node with its subtree (a grammar rejected it)
    parents_b = trees["b"]
    pruned = {0}
    for node, parent in enumerate(parents_b):
        if parent in pruned:
            pruned.add(node)
    kept_b = [n for n in range(len(parents_b)) if n not in pruned]
    assert kept_b[0] != 0 and 0 < len(kept_b) < DEPTH
    state.keep_scheduled({"b": kept_b, "c": list(range(len(keep_c)))})
    drafts[1] = [drafts[1][n] for n in kept_b]
    verify = state.begin_verify(["a", "b", "c"], [len(d) for d in drafts],
                                torch.tensor(sum(drafts, [])), [0, 20, 40], 60)
    assert verify.matched.tolist() == [True, True, True]
    new_of = {old: new for new, old in enumerate(kept_b)}
    m = len(kept_b)
    assert verify.tree.token_ids[1, :m].tolist() == drafts[1]
    assert verify.tree.parents[1, :m].tolist() == [
        -1 if parents_b[n] < 0 else new_of[parents_b[n]] for n in kept_b]
    assert verify.tree.depths[1, :m].tolist() == [tree.depths[1, n].item() for n in kept_b]
    mask = unpack_mask(verify.tree.ancestor_mask[1:2], BUDGET + 1)[0]
    for new, old in enumerate(kept_b):
        old_mask = unpack_mask(tree.ancestor_mask[1:2], BUDGET + 1)[0, old + 1]
        ancestors = {new_of[j - 1] + 1 for j in range(1, BUDGET + 1) if old_mask[j]} | {0}
        assert {j for j in range(BUDGET + 1) if mask[new + 1, j]} == ancestors
    assert best_path([-1, -1, 0, 1, 2, 0], 3) == [0, 2, 4]
    assert best_path([-1, -1, 0, 1, 2, 0], 2) == [0, 2]
    # a structured request the grammar keeps whole: its verify tree is its L nodes, the
    # proposal's other nodes padding (the walk must never see them)
    state, tree = proposed_state()
    drafts = [tree.token_ids[r].tolist() for r in range(3)]
    state.clip_drafts(["a", "b", "c"], drafts, {"b": requests["b"]}, max_model_len=1000)
    state.keep_scheduled({"b": list(range(DEPTH))})
    verify = state.begin_verify(["a", "b", "c"], [len(d) for d in drafts],
                                torch.tensor(sum(drafts, [])), [0, 20, 40], 60,
                                scheduled=drafts)
    assert verify.exact and len(drafts[1]) == DEPTH
    assert verify.tree.token_ids[1, :DEPTH].tolist() == tree.token_ids[1, :DEPTH].tolist()
    assert (verify.tree.token_ids[1, DEPTH:] == -1).all() and (verify.tree.depths[1, DEPTH:] == 0).all()


def test_verify_trees_carry_the_proposals_structure():
    """begin_verify takes each matched tree's depths and ancestor rows from its proposal (also
    after clipping) and builds chains from tables, instead of pointer jumping over B nodes.
    Oracle: depths and ancestor rows recomputed from the verify tree's parents by pointer
    jumping over all B nodes. Chains (unmatched drafts) are cut at the drafting depth L."""
    state, tree = proposed_state()
    requests = {"a": request(2, 5, max_tokens=100), "b": request(2, 5, max_tokens=8),
                "c": request(2, 5, max_tokens=100)}
    drafts = [tree.token_ids[r].tolist() for r in range(3)]
    state.clip_drafts(["a", "b", "c"], drafts, requests, max_model_len=1000)
    drafts[2] = drafts[2][:7]  # the scheduler kept 7 of c's nodes
    chain = [3, 1, 4, 1, 5, 9]  # drafts of a request without a proposal: longer than L = 4
    num_draft = [len(d) for d in drafts] + [len(chain)]
    verify = state.begin_verify(["a", "b", "c", "z"], num_draft,
                                torch.tensor(sum(drafts, []) + chain), [0, 20, 40, 60], 70)
    assert verify.matched.tolist() == [True, True, True, False]
    got = verify.tree
    assert got.max_depth == DEPTH
    assert got.parents[3].tolist() == [-1, 0, 1, 2] + [-1] * (BUDGET - 4)
    assert got.token_ids[3].tolist() == chain[:DEPTH] + [-1] * (BUDGET - DEPTH)
    assert got.num_nodes.tolist() == [len(drafts[0]), len(drafts[1]), 7, DEPTH]
    valid = got.token_ids >= 0
    assert torch.equal(got.depths, depths_from_parents(got.parents, valid))
    assert torch.equal(got.ancestor_mask, _ancestor_mask(got.parents, BUDGET))


def test_last_token_gets_no_drafts():
    state, tree = proposed_state()
    drafts = [tree.token_ids[1].tolist()]
    state.clip_drafts(["b"], drafts, {"b": request(10, 7, max_tokens=8)}, max_model_len=1000)
    assert drafts == [[]]  # one token left: it is the next bonus


def test_a_step_without_a_query_pass_forgets_the_proposals_of_its_requests():
    """A paused step (no query pass, no drafts sent): the older proposals of the step's
    requests can never be matched again (the scheduler cleared their drafts when it scheduled
    them), and the policy counts one request-step of 0 nodes per request. A request that was
    not in the step ("c": the token budget ran out) keeps its proposal: the scheduler still
    holds its drafts and will verify them (forgetting it made those rows unmatched chains)."""
    state, tree = proposed_state()
    state.no_drafts(["a", "b"])
    assert not any(r in state.proposals for r in "ab") and "c" in state.proposals
    stats = state.budgets.stats
    assert (stats.steps, stats.requests, stats.nodes, stats.budgets) == (1, 2, 0, {0: 2})
    drafts_c = tree.token_ids[2].clamp(min=0)
    assert state.begin_verify(["c"], [BUDGET], drafts_c, [0], BUDGET + 1).matched.tolist() == [True]
    # drafts equal to the forgotten proposal are verified as a chain, not as its tree
    drafts = tree.token_ids[0, :3]
    verify = state.begin_verify(["a"], [3], drafts, [0], 4)
    assert verify.matched.tolist() == [False]


def test_a_proposal_waits_for_its_verify_step():
    """"a" is left out of the step after its proposal (the token budget ran out) while "b" is
    verified and proposed again; when "a" is scheduled later with the drafts it was given, it
    is verified with its own tree, not as a chain. Finished requests free their slots."""
    state = TreeState(DDTreeOptions(budget=BUDGET, depth=DEPTH), torch.device("cpu"),
                      max_num_reqs=1)  # the store grows past its initial capacity
    gen = torch.Generator().manual_seed(3)
    first = build_tree(torch.randn(2, DEPTH, 9, generator=gen) * 2, BUDGET)
    state.record_proposal(["a", "b"], first)
    second = build_tree(torch.randn(1, DEPTH, 9, generator=gen) * 2, BUDGET)
    state.record_proposal(["b"], second)  # step t + 1: only "b" ran
    drafts_a = first.token_ids[0].clamp(min=0)
    verify = state.begin_verify(["a", "b"], [BUDGET, BUDGET],
                                torch.cat([drafts_a, second.token_ids[0].clamp(min=0)]),
                                [0, BUDGET + 1], 2 * (BUDGET + 1))
    assert verify.matched.tolist() == [True, True]
    assert torch.equal(verify.tree.parents[0], first.parents[0])
    assert torch.equal(verify.tree.parents[1], second.parents[0])
    assert torch.equal(verify.tree.scores[0], first.scores[0])
    # drafts that are not the recorded tree (e.g. vLLM's zeros) are verified as a chain
    verify = state.begin_verify(["a"], [3], torch.zeros(3, dtype=torch.int64), [0], 4)
    assert verify.matched.tolist() == [False]
    assert verify.tree.parents[0, :3].tolist() == [-1, 0, 1]
    state.proposals.keep_only({"b"})
    assert "a" not in state.proposals and "b" in state.proposals


def test_context_is_complete_only_where_no_cold_step_wrote():
    """Drafter context validity per K/V slot: before any cold step every request is complete
    (None: nothing to check); a cold step's slots lose their context, a context pass writing
    them again restores it. Oracle: the slots of each request's computed positions, by hand
    (block_size 4: position p of a request with blocks [b0, b1] is slot b_(p // 4) * 4 + p % 4)."""
    state = TreeState(DDTreeOptions(budget=BUDGET, depth=DEPTH), torch.device("cpu"))
    state.allocate_context_validity(6 * 4)
    table = torch.tensor([[3, 1], [2, 5], [4, 0]], dtype=torch.int32)
    assert state.context_complete(table, [6, 5, 3], 4) is None
    state.context_written(torch.tensor([12, 13]))  # before any cold step: nothing to record
    assert state.plan_step(["a", "b"]) == "draft"  # static: always drafts
    # a cold step writes position 5 of request "a" (slot 1 * 4 + 1) and position 4 of "b"
    # (slot 5 * 4 + 0): both requests can no longer draft
    state.went_cold(["a", "b"], torch.tensor([5, 20]))
    assert state.cold_reqs == {"a", "b"}
    assert state.context_complete(table, [6, 5, 3], 4).tolist() == [False, False, True]
    assert state.context_complete(table, [5, 4, 3], 4).tolist() == [True, True, True]
    state.context_written(torch.tensor([5]))
    assert state.context_complete(table, [6, 5, 3], 4).tolist() == [True, False, True]
    assert state.context_complete(table[:0], [], 4).tolist() == []
    # fewer than half of the requests can draft: the drafter keeps its context instead
    assert state.plan_step(["a", "b", "c"]) == "context"
    assert state.plan_step(["a", "c"]) == "draft"
    assert state.plan_step(["a", "b"]) == "cold"  # nobody can use the drafter's context
    state.forget_finished({"b": None, "c": None})
    assert state.cold_reqs == {"b"}


def _same_verify(a, b):
    for field in ("token_ids", "parents", "depths", "scores", "num_nodes", "ancestor_mask"):
        assert torch.equal(getattr(a.tree, field), getattr(b.tree, field)), field
    assert torch.equal(a.matched, b.matched)


def test_exact_steps_read_the_proposals_as_the_device_match_builds_them():
    """A step whose requests got exactly the drafts they were sent (the scheduler's host lists)
    takes each tree straight from its proposal; oracle: the device match of the same drafts
    (no host lists). A request the scheduler cut, or drafts that are not the sent ones, make
    the step inexact (the device match decides). Position shifts: each token row's depth
    minus its query position for node rows, 0 for the root and for rows of a prefill chunk."""
    state, tree = proposed_state()
    requests = {"a": request(2, 5, max_tokens=100), "b": request(2, 5, max_tokens=8),
                "c": request(2, 5, max_tokens=100)}
    drafts = [tree.token_ids[r].tolist() for r in range(3)]
    state.clip_drafts(["a", "b", "c"], drafts, requests, max_model_len=1000)
    # "p" is a prefill chunk of 3 tokens without drafts, between the requests
    req_ids, num_draft = ["a", "p", "b", "c"], [len(drafts[0]), 0, len(drafts[1]), len(drafts[2])]
    scheduled = [drafts[0], [], drafts[1], drafts[2]]
    q_lens = [num_draft[0] + 1, 3, num_draft[2] + 1, num_draft[3] + 1]
    starts = [0, q_lens[0], q_lens[0] + 3, q_lens[0] + 3 + q_lens[2]]
    row_req = torch.repeat_interleave(torch.arange(4), torch.tensor(q_lens)).numpy()
    row_pos = torch.cat([torch.arange(n) for n in q_lens]).numpy()
    flat = torch.tensor(sum(scheduled, []))
    args = (req_ids, num_draft, flat, starts, sum(q_lens))
    exact = state.begin_verify(*args, scheduled=scheduled, token_rows=(row_req, row_pos))
    assert exact.exact
    expect = state.begin_verify(*args)
    assert not expect.exact
    _same_verify(exact, expect)
    shift = [0 if q == 0 or q > num_draft[r] else expect.tree.depths[r, q - 1].item() - q
             for r, q in zip(row_req.tolist(), row_pos.tolist())]
    assert exact.position_shift.tolist() == shift
    assert any(shift), "the trees must move some rows"
    # the scheduler kept 7 of c's nodes: inexact, the same trees as the device match
    cut = [drafts[0], [], drafts[1], drafts[2][:7]]
    num_cut = [len(d) for d in cut]
    args = (req_ids, num_cut, torch.tensor(sum(cut, [])), starts, sum(q_lens))
    got = state.begin_verify(*args, scheduled=cut, token_rows=(row_req, row_pos))
    assert not got.exact
    _same_verify(got, state.begin_verify(*args))
    assert got.tree.num_nodes.tolist() == num_cut
    # drafts that were never sent (placeholders) are a chain, matched False
    other = [drafts[0], [], [7] * 3, drafts[2]]
    args = (req_ids, [len(d) for d in other], torch.tensor(sum(other, [])), starts, sum(q_lens))
    got = state.begin_verify(*args, scheduled=other)
    assert not got.exact and got.matched.tolist() == [True, False, False, True]  # "p": none
    _same_verify(got, state.begin_verify(*args))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the pinned copy and its event need CUDA"))])
def test_unmatched_rows_are_reported_one_period_late_without_reading_the_device(
        caplog, monkeypatch, device):
    """The periodic report of unmatched rows reads only the host copy that the previous report
    started (no device read in the step's code): a report warns about what was counted up to
    the report before it, once, and adds the same count to the Prometheus counter. On CUDA the
    copy is a pinned non-blocking one with an event (gpu_all.sh runs this case)."""
    from sync_checker import NoHostSync, no_host_sync

    import vllm_ddtree.plugin.state as state_module

    counted = []
    monkeypatch.setattr(state_module, "_unmatched_counter",
                        lambda: SimpleNamespace(inc=counted.append))
    state = TreeState(DDTreeOptions(budget=BUDGET, depth=DEPTH), torch.device(device))
    checker = NoHostSync(scope=("vllm_ddtree/plugin/state.py",), allowed_reads={
        ("plugin/state.py", "_read_host_count"): "the previous report's host copy"})
    warned = []
    for added in (3, 0, 2, 0, 0):
        state._unmatched += added  # rows counted since the last report (count_unmatched)
        caplog.clear()
        with no_host_sync(checker):
            state.report_unmatched()
        warned.append([r.getMessage().split(" scheduled")[0] for r in caplog.records
                       if "verified as chains" in r.getMessage()])
    assert checker.num_checked > 0
    assert warned == [[], ["ddtree: 3"], [], ["ddtree: 2"], []]
    assert counted == [3, 2]
