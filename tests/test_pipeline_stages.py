"""Pipeline parallelism, stage by stage, without an engine (vllm_ddtree/plugin/stages.py).

A stage before the last verifies the trees the scheduler relays and moves its own layers' K/V
along the accepted path the scheduler's tokens give, one step later. Oracles: the last stage's
own code on the same trees (its recorded proposal and ``begin_verify``; its walk,
``finish_verify`` and the K/V compactor), and the trees' paths written out by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_cpu_kv_layout import random_kv

from vllm_ddtree.plugin import grammar, stages
from vllm_ddtree.plugin.compaction import KVCompactor
from vllm_ddtree.plugin.cpu_attention import _write_with_vllm
from vllm_ddtree.plugin.options import DDTreeOptions
from vllm_ddtree.plugin.state import TreeState
from vllm_ddtree.tree import build_tree
from vllm_ddtree.walk import walk

BUDGET, DEPTH, VOCAB = 12, 4, 6
BLOCK, NUM_BLOCKS, ISA = 16, 81, "vec"


def new_state(send_all_trees: bool = False) -> TreeState:
    state = TreeState(DDTreeOptions(budget=BUDGET, depth=DEPTH, budget_policy="static"),
                      torch.device("cpu"))
    state.send_all_trees = send_all_trees
    return state


def samples_to(tree, gen: torch.Generator) -> torch.Tensor:
    """``[R, B + 1]`` target samples that accept the path to a random node of each request's
    tree (request 0: no node), then a token that no child there carries."""
    num, width = tree.token_ids.shape
    sampled = torch.full((num, width + 1), VOCAB, dtype=torch.int64)  # VOCAB: in no tree
    for r in range(1, num):
        tokens, parents = tree.token_ids[r].tolist(), tree.parents[r].tolist()
        node = int(torch.randint(0, int(tree.num_nodes[r]), (1,), generator=gen))
        while node >= 0:
            sampled[r, parents[node] + 1] = tokens[node]
            node = parents[node]
    return sampled


def random_trees(seed: int, num: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num, DEPTH, VOCAB, generator=gen) * 2
    return build_tree(logits, BUDGET), gen


def test_accepted_nodes_follow_the_tokens_from_the_root():
    """Every root-to-node path of random best-first trees is found from its tokens alone;
    a token that no child carries is an error, not a guess."""
    tree, _ = random_trees(1, 6)
    for r in range(6):
        n = int(tree.num_nodes[r])
        tokens, parents = tree.token_ids[r, :n].tolist(), tree.parents[r, :n].tolist()
        for node in range(n):
            path = [node]
            while parents[path[0]] >= 0:
                path.insert(0, parents[path[0]])
            assert stages.accepted_nodes(tokens, parents, [tokens[i] for i in path]) == path
        assert stages.accepted_nodes(tokens, parents, []) == []
        missing = next(t for t in range(VOCAB + 1)
                       if t not in {tokens[i] for i in range(n) if parents[i] == -1})
        with pytest.raises(RuntimeError, match="not in the tree"):
            stages.accepted_nodes(tokens, parents, [missing])


def test_a_stage_verifies_the_trees_the_last_stage_verifies():
    """The last stage sends every tree's parents (clip_drafts under pipeline parallelism), the
    scheduler relays the scheduled nodes' parents (a token budget cut one request's drafts to
    a prefix), and a stage before the last records them: its verify trees (tokens, parents,
    depths, ancestor rows) and position shifts equal the last stage's."""
    tree, _ = random_trees(2, 3)
    last = new_state(send_all_trees=True)
    req_ids = ["a", "b", "c"]
    last.record_proposal(req_ids, tree)
    drafts = [tree.token_ids[r, : int(tree.num_nodes[r])].tolist() for r in range(3)]
    trees = last.clip_drafts(req_ids, drafts, {}, max_model_len=10_000)
    assert sorted(trees) == req_ids and all(len(trees[r]) == len(d) for r, d in zip(req_ids,
                                                                                     drafts))
    # the scheduler: what update_draft_token_ids keeps on each request, then a cut
    requests = {r: SimpleNamespace(**{grammar.TREE_ATTR: (list(range(len(d))), trees[r])})
                for r, d in zip(req_ids, drafts)}
    scheduled = {"a": drafts[0], "b": drafts[1][:5], "c": drafts[2]}
    relayed = stages.scheduled_trees(requests, scheduled, grammar.TREE_ATTR)
    assert relayed["b"] == trees["b"][:5]
    stage = new_state()
    stage.stage = stages.StageMoves(DEPTH)
    lists = [scheduled[r] for r in req_ids]
    stages.record_trees(stage, req_ids, lists, relayed)
    num_draft = [len(d) for d in lists]
    rows = [m + 1 for m in num_draft]  # each request's root and nodes, one after the other
    starts = np.cumsum([0] + rows[:-1]).tolist()
    num_tokens = sum(rows)
    row_req = np.repeat(np.arange(3), rows)
    row_pos = np.concatenate([np.arange(n) for n in rows])
    verified = []
    for state in (last, stage):
        verified.append(state.begin_verify(
            req_ids, num_draft, torch.tensor(sum(lists, [])), starts, num_tokens,
            scheduled=lists, token_rows=(row_req, row_pos)))
    want, got = verified
    # the last stage matches b's cut on the device; the stage's trees are b's scheduled nodes
    assert got.exact and bool(want.matched.all()) and bool(got.matched.all())
    for name in ("token_ids", "parents", "depths", "num_nodes", "ancestor_mask"):
        assert torch.equal(getattr(got.tree, name), getattr(want.tree, name)), name
    assert torch.equal(got.position_shift, want.position_shift)


def test_the_scheduler_relays_each_requests_recent_tokens():
    """recent_tokens: the last L tokens before each running request's computed length (fewer
    at the start); a request resumed after preemption (its K/V is recomputed) gets its whole
    output instead."""
    requests = {"a": SimpleNamespace(all_token_ids=list(range(100, 130))),
                "b": SimpleNamespace(all_token_ids=[7, 8, 9]),
                "c": SimpleNamespace(all_token_ids=list(range(50)),
                                     output_token_ids=list(range(40, 50)))}
    cached = SimpleNamespace(req_ids=["a", "b", "c"], num_computed_tokens=[29, 2, 40],
                             resumed_req_ids={"c"})
    recent, outputs = stages.recent_tokens(requests, cached, DEPTH)
    assert recent == {"a": [125, 126, 127, 128], "b": [7, 8]}
    assert outputs == {"c": list(range(40, 50))}
    with pytest.raises(RuntimeError, match="without the tree"):
        stages.scheduled_trees({"a": SimpleNamespace()}, {"a": [1, 2]}, grammar.TREE_ATTR)


def test_a_stage_drops_trees_it_cannot_replay_and_refuses_impossible_lengths():
    """A request resumed after preemption recomputes its K/V: its verified tree is dropped. A
    request back at a computed length its tree could not produce is an error; so is a
    request that verified a tree and comes back without its accepted tokens."""
    moves = stages.StageMoves(DEPTH)
    moves.verified(["a", "b", "c"], [10, 10, 10], [[1, 2], [1, 2], [3]],
                   {"a": [-1, 0], "b": [-1, 0], "c": [-1]})
    cached = SimpleNamespace(req_ids=["a"], num_computed_tokens=[13], resumed_req_ids={"a"})
    assert moves.take(cached, {}) == [] and len(moves) == 2
    cached = SimpleNamespace(req_ids=["b"], num_computed_tokens=[14], resumed_req_ids=set())
    with pytest.raises(RuntimeError, match="more than its tree could accept"):
        moves.take(cached, {"b": [1, 2, 3, 4]})
    cached = SimpleNamespace(req_ids=["c"], num_computed_tokens=[12], resumed_req_ids=set())
    with pytest.raises(RuntimeError, match="no accepted tokens"):
        moves.take(cached, {})
    moves.verified(["d"], [5], [[4, 5]], {"d": [-1, -1]})
    moves.keep_only({"e"})
    assert len(moves) == 0


def _caches(seed: int):
    """Two equal sets of target layer caches in vLLM's CPU layout, random K/V in every slot."""
    owned = torch.arange(BLOCK, NUM_BLOCKS * BLOCK)  # block 0: the null block
    caches = [_write_with_vllm(ISA, torch.float32, NUM_BLOCKS, BLOCK, 2, 32,
                               *random_kv(owned.numel(), 2, 32, torch.float32, seed=seed + i),
                               owned) for i in range(2)]
    return caches, [c.clone() for c in caches]


def _runner(caches, block_table: np.ndarray, slot_mapping: torch.Tensor, index: dict):
    layers = {f"L{i}": SimpleNamespace(kv_cache=c, isa=ISA) for i, c in enumerate(caches)}
    table = SimpleNamespace(block_table=SimpleNamespace(np=block_table), block_size=BLOCK,
                            slot_mapping=SimpleNamespace(gpu=slot_mapping))
    runner = SimpleNamespace(
        drafter=SimpleNamespace(_draft_attn_layer_names=set()),
        kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(
            layer_names=list(layers), kv_cache_spec=SimpleNamespace(head_size=32))]),
        compilation_config=SimpleNamespace(static_forward_context=layers),
        input_batch=SimpleNamespace(block_table=[table], req_id_to_index=index),
        device=torch.device("cpu"), ddtree_state=SimpleNamespace(depth=DEPTH))
    runner.ddtree_compactor = KVCompactor.of_v1_runner(runner)
    return runner


@pytest.mark.parametrize("native", [True, False], ids=["fused_cpu_op", "torch_twin"])
@pytest.mark.parametrize("seed", range(4))
def test_a_stage_moves_its_kv_as_the_last_stage_does(monkeypatch, seed, native):
    """One verify step of random trees and paths: the last stage walks them and compacts its
    caches (finish_verify, KVCompactor); a stage before the last gets, one step later, only
    the requests' computed lengths and the scheduler's recent tokens, in another batch order,
    and moves its caches (StageMoves, move_kv). The caches end equal, slot for slot, and both
    stages count the same moves; with the fused CPU op and with its torch twin (the slot
    lookup the Triton path shares)."""
    if not native:
        from vllm_ddtree.plugin import compaction

        monkeypatch.setattr(compaction, "cpu_ops", lambda device: None)
    num = 5
    tree, gen = random_trees(10 + seed, num)
    verdict = walk(tree, samples_to(tree, gen))
    req_ids = [f"r{i}" for i in range(num)]
    computed = torch.randint(3, 200, (num,), generator=gen).tolist()
    num_draft = tree.num_nodes.tolist()
    # each request's blocks, distinct, in a random order (block 0 is the null block)
    blocks = (1 + torch.randperm(NUM_BLOCKS - 1, generator=gen)).view(num, 16).numpy()
    starts, slots = [], []
    for r in range(num):  # the verify step's rows: the root, then the nodes, chain positions
        starts.append(len(slots))
        for pos in range(computed[r], computed[r] + num_draft[r] + 1):
            slots.append(int(blocks[r, pos // BLOCK]) * BLOCK + pos % BLOCK)
    num_tokens = len(slots)
    last_caches, stage_caches = _caches(seed)
    last_runner = _runner(last_caches, blocks, torch.tensor(slots),
                          {r: i for i, r in enumerate(req_ids)})
    last = new_state()
    last.verify = SimpleNamespace(num_tokens=num_tokens, starts=torch.tensor(starts))
    src, dst = last.finish_verify(verdict)
    last_runner.ddtree_compactor.compact(src, dst, num_tokens, num)
    # the stage: it verified the same trees, then the scheduler's next step (another order)
    stage = new_state()
    stage.stage = stages.StageMoves(DEPTH)
    tokens = [tree.token_ids[r, : num_draft[r]].tolist() for r in range(num)]
    parents = {r: tree.parents[i, : num_draft[i]].tolist() for i, r in enumerate(req_ids)}
    stage.stage.verified(req_ids, computed, tokens, parents)
    accepted = verdict.num_accepted.tolist()
    history = {}
    for r, req in enumerate(req_ids):  # the request's tokens: prompt, accepted path, bonus
        path = [tokens[r][q] for q in verdict.accepted_nodes[r, : accepted[r]].tolist()]
        history[req] = SimpleNamespace(all_token_ids=(
            [0] * (computed[r] + 1) + path + [int(verdict.bonus_token[r])]))
    order = torch.randperm(num, generator=gen).tolist()
    cached = SimpleNamespace(req_ids=[req_ids[i] for i in order],
                             num_computed_tokens=[computed[i] + 1 + accepted[i] for i in order],
                             resumed_req_ids=set())
    stage_runner = _runner(stage_caches, blocks[order], torch.zeros(1, dtype=torch.int64),
                           {req_ids[i]: row for row, i in enumerate(order)})
    output = SimpleNamespace(scheduled_cached_reqs=cached,
                             ddtree_recent=stages.recent_tokens(history, cached, DEPTH)[0])
    stages.move_kv(stage_runner, stage, output)
    assert stage.stage.moved_slots == last.num_compacted_slots > 0  # these seeds move K/V
    assert len(stage.stage) == 0  # every verified tree was replayed
    for got, want in zip(stage_caches, last_caches):
        assert torch.equal(got, want)
    fresh, _ = _caches(seed)  # the moves changed the caches
    assert not any(torch.equal(a, b) for a, b in zip(fresh, last_caches))


@dataclass
class History:
    """What complete_histories reads of vLLM's CachedRequestState."""

    num_prompt_tokens: int
    output_token_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)


def test_a_stage_completes_its_token_histories_with_the_accepted_drafts():
    """vLLM keeps a stage's history from the step's first token alone; complete_histories adds
    what the last verify step accepted (the last tokens before the computed length), and a
    resumed request gets its whole output (in place: the input batch shares the list). A
    request in its prompt's chunks, or whose history is complete, is left alone."""
    prompt = list(range(10))
    full = prompt + [50, 51, 52, 53, 54]  # 50: the root of a verify step; 51-53 accepted
    states = {r: History(10, list(out))
              for r, out in (("a", [50]), ("b", [50, 51, 52, 53, 54]), ("c", [50]), ("d", []))}
    shared = states["c"].output_token_ids
    cached = SimpleNamespace(req_ids=["a", "b", "c", "d"], num_computed_tokens=[14, 14, 3, 6],
                             resumed_req_ids={"c"})
    recent = {"a": full[10:14], "b": full[10:14], "d": prompt[2:6]}
    stages.complete_histories(states, cached, recent, {"c": full[10:]})
    assert states["a"].output_token_ids == [50, 51, 52, 53]  # vLLM appends 54 next
    assert states["b"].output_token_ids == full[10:]
    assert states["c"].output_token_ids is shared and shared == full[10:]
    assert states["d"].output_token_ids == []
    states["a"].output_token_ids = [50]
    with pytest.raises(RuntimeError, match="lacks 3 tokens"):
        stages.complete_histories(states, cached, {"a": [53]}, {"c": full[10:]})


@pytest.mark.parametrize("stage", ["first", "middle", "last"])
def test_every_stage_picks_the_drafters_layers_or_the_target_is_refused(monkeypatch, stage):
    """The drafter's target layers may sit on any stage: under pipeline parallelism a stage
    before the last picks the same layers as the last stage (the drafter's, else the model's
    default), so vLLM's model relays their hidden states, and a middle stage passes on those of
    the stages before it with its own (its forward's output gets them); a target whose model
    cannot relay them is refused with the fix named. Without pipeline parallelism nothing
    changes."""
    from vllm.sequence import IntermediateTensors

    from vllm.distributed import parallel_state

    from vllm_ddtree.plugin import patches
    from vllm_ddtree.plugin.options import DDTreeConfigError

    picked = []

    class Decoder:
        supports_aux_hidden_states_over_pp = True
        AUX_HIDDEN_STATE_KEY = "aux_hidden_states_"
        _aux_slot_base_cached = 1  # one of the layers sits on the stages before (a middle one)

    class Model:
        model = Decoder()

        def set_aux_hidden_state_layers(self, layers):
            picked.append(tuple(layers))

        def get_eagle3_default_aux_hidden_state_layers(self):
            return (2, 5)

    last = stage == "last"

    def vllms_own(runner):  # vLLM's method: the last stage picks the layers itself
        if last:
            runner.model.set_aux_hidden_state_layers(
                runner._get_eagle3_aux_layers_from_config()
                or runner.model.get_eagle3_default_aux_hidden_state_layers())

    runner = SimpleNamespace(ddtree_state=object(), model=Model(),
                             _get_eagle3_aux_layers_from_config=lambda: (1, 3))
    setup = patches._wrap_setup_aux_hidden_states(vllms_own)
    pp = SimpleNamespace(world_size=1, is_first_rank=True, is_last_rank=True)
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: pp)
    setup(runner)
    assert picked == ([(1, 3)] if last else [])
    picked.clear()
    pp.world_size, pp.is_first_rank, pp.is_last_rank = 3, stage == "first", last
    setup(runner)
    assert picked == [(1, 3)]
    relayed = ("aux_hidden_states_0",) if stage == "middle" else ()
    assert runner.ddtree_relay_keys == relayed
    received = IntermediateTensors({"hidden_states": torch.zeros(2),
                                    "aux_hidden_states_0": torch.ones(2)})
    own = IntermediateTensors({"hidden_states": torch.full((2,), 2.0),
                               "aux_hidden_states_1": torch.full((2,), 3.0)})
    forward = patches._wrap_model_forward(lambda runner, **kwargs: own)
    sent = forward(runner, input_ids=None, intermediate_tensors=received)
    assert sorted(sent.tensors) == sorted(["hidden_states", "aux_hidden_states_1", *relayed])
    assert torch.equal(sent["hidden_states"], own["hidden_states"])
    picked.clear()
    runner._get_eagle3_aux_layers_from_config = lambda: None  # the model's default layers
    setup(runner)
    assert picked == [(2, 5)]
    Decoder.supports_aux_hidden_states_over_pp = False
    with pytest.raises(DDTreeConfigError, match="--tensor-parallel-size instead"):
        setup(runner)


def test_the_last_stage_loads_the_targets_embedding_from_its_checkpoint(tmp_path):
    """proposer.load_target_embedding: the target's embedding tensor, found through the
    checkpoint's index (sharded) or in its files, goes into the drafter's parameter; a
    checkpoint without one is refused with the fix named."""
    from safetensors.torch import save_file

    from vllm_ddtree.plugin.options import DDTreeConfigError
    from vllm_ddtree.plugin.proposer import load_target_embedding

    weight = torch.randn(10, 4)
    config = SimpleNamespace(model=str(tmp_path), revision=None)
    param = torch.nn.Parameter(torch.zeros(10, 4), requires_grad=False)
    save_file({"model.norm.weight": torch.ones(4)}, str(tmp_path / "a.safetensors"))
    with pytest.raises(DDTreeConfigError, match="--tensor-parallel-size instead"):
        load_target_embedding(param, config, SimpleNamespace(download_dir=None))
    save_file({"model.embed_tokens.weight": weight}, str(tmp_path / "b.safetensors"))
    load_target_embedding(param, config, SimpleNamespace(download_dir=None))
    assert torch.equal(param, weight)
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"model.language_model.embed_tokens.weight": "c.safetensors"}}')
    save_file({"model.language_model.embed_tokens.weight": 2 * weight},
              str(tmp_path / "c.safetensors"))
    load_target_embedding(param, config, SimpleNamespace(download_dir=None))
    assert torch.equal(param, 2 * weight)
