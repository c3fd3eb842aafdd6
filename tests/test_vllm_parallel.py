"""ddtree under tensor, pipeline and data parallelism on vLLM's CPU backend, with the default
policy.

Every rank of a tensor-parallel group must make the same decisions (vllm_ddtree/plugin/ranks.py):
a rank that planned a different step computed a different attention mask (wrong text) or waited
in a collective the other rank never entered (a hang). Each parallel engine here runs in its
own process (tests/parallel_run.py) under a watchdog: a run that prints nothing for
``WATCHDOG_S`` seconds is killed and the test fails as a hang, well before two minutes; vLLM's
own step timeout is set below it as well.

Oracles (engines in this process, TP = 1): greedy decoding without speculation (8 prompts x 128
tokens, token for token; the static policy's TP = 2 run generates 64 tokens, compared with the
first 64, also with request features: penalties, bad words, min_tokens, allowed ids,
logit_bias), and for seeded requests at T = 0.8 the same seeds on another engine (ddtree with
the default policy): a seeded request's text must not depend on its company, on the policy's
choices, on its length or on the ranks. Rows verified as chains because their drafts were not
a proposal must be zero on every rank.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")

from parallel_run import PROMPTS, SEEDED, cache_sizes, run_jobs  # noqa: E402
from test_vllm_server import demo  # noqa: E402
from vllm_utils import DRAFTER, PAIR  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "tests", "parallel_run.py")
WATCHDOG_S = 90.0  # no output line for this long: a hang
MAX_TOKENS = 128  # ~40 verify steps per request: several of auto's measure-and-pause cycles
SEEDED_PROMPTS = [1, 3, 5, 7]


def ddtree(**extra) -> dict:
    return {"method": "ddtree", "model": DRAFTER, "num_speculative_tokens": 32, **extra}


def run_engine(tmp_path, tp: int, spec: dict | None, short: bool = False,
               max_tokens: int = MAX_TOKENS, pp: int = 1, num_blocks: int = 0,
               extra_args: tuple[str, ...] = (), **env) -> dict:
    """tests/parallel_run.py in its own process group, under the watchdog; its JSON result.
    ``extra_args``: more of its arguments (``--v2``, ``--jobs``, ...)."""
    out = tmp_path / f"tp{tp}_pp{pp}_{os.urandom(4).hex()}.json"
    cmd = [sys.executable, RUN, "--out", str(out), "--tp", str(tp), "--pp", str(pp),
           "--max-tokens", str(max_tokens), *extra_args]
    if short:
        cmd.append("--short")
    if num_blocks:
        cmd += ["--num-blocks", str(num_blocks)]
    if spec is not None:
        cmd += ["--spec", json.dumps(spec)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=str(int(WATCHDOG_S) - 15), **env)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)],
                     daemon=True).start()
    log: list[str] = []
    try:
        while True:
            try:
                line = lines.get(timeout=WATCHDOG_S)
            except queue.Empty:
                pytest.fail(f"no progress for {WATCHDOG_S:.0f} s (a hang):\n{''.join(log[-40:])}")
            if line is None:
                break
            log.append(line)
        assert proc.wait(timeout=60) == 0, f"the engine failed:\n{''.join(log[-60:])}"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not any("Traceback" in line for line in log), "".join(log[-60:])
    with open(out) as f:
        return json.load(f)


def run_here(spec: dict | None, max_tokens: int = MAX_TOKENS, num_blocks: int = 0) -> dict:
    """The short job list on an engine in this process (TP = 1: nothing to hang on; saves a
    process's start, ~25 s, per oracle)."""
    from vllm_utils import close, make_llm

    llm = make_llm(spec, max_num_seqs=8, **cache_sizes(num_blocks))
    try:
        return run_jobs(llm, max_tokens, short=True)
    finally:
        close(llm)


@pytest.fixture(scope="module")
def plain():
    """Greedy decoding without speculation at TP = 1: the greedy oracle."""
    return run_here(None)["outputs"]


@pytest.fixture(scope="module")
def seeded():
    """ddtree (default policy) at TP = 1, the short job list: its seeded texts, checked there,
    are the seeded oracle of the other runs."""
    result = run_here(ddtree())
    check_run(result, None)
    return {i: result["outputs"]["mixed"][str(i)] for i in SEEDED_PROMPTS}


def check_run(result: dict, plain: dict | None, seeded: dict | None = None,
              max_tokens: int = MAX_TOKENS) -> None:
    """A run's outputs against the oracles; a run of fewer ``max_tokens`` than theirs against
    their first ``max_tokens`` tokens (a greedy or seeded text does not depend on its length)."""
    outputs = result["outputs"]
    assert result["unmatched_rows_per_rank"] == [0] * len(result["unmatched_rows_per_rank"])
    if plain is not None:
        greedy = {i: ids[:max_tokens] for i, ids in plain["greedy"].items()}
        for job in ("greedy", "greedy_reversed"):
            for i, ids in greedy.items() if job in outputs else ():
                assert outputs[job][i] == ids, f"{job}: prompt {i} differs from plain decoding"
        for job in ("features", "structured"):
            for i, ids in plain[job].items() if job in outputs else ():
                assert outputs[job][i] == ids, f"{job}: prompt {i} differs from plain decoding"
        for i in range(0, len(PROMPTS), 2):  # greedy requests batched with seeded ones
            assert outputs["mixed"][str(i)] == greedy[str(i)], f"mixed: prompt {i}"
            assert outputs["pairs"].get(str(i), greedy[str(i)]) == greedy[str(i)], f"pairs: {i}"
    for i in SEEDED_PROMPTS:
        mine = outputs["mixed"][str(i)]
        assert len(mine) == max_tokens
        alone = outputs.get(f"alone_{i}", {}).get(str(i), mine)  # short runs: none alone
        assert alone == mine, f"seeded prompt {i}: alone != in a batch"
        assert outputs["pairs"][str(i)] == mine, f"seeded prompt {i}: in pairs != in a batch"
        if seeded is not None:
            assert mine == seeded[i][:max_tokens], f"seeded prompt {i} differs from TP = 1"


def test_tp2_default_policy(tmp_path, plain, seeded):
    """TP = 2 with "auto" (the default), every step's plan compared across the ranks."""
    result = run_engine(tmp_path, 2, ddtree(), VLLM_DDTREE_CHECK_RANKS="1")
    check_run(result, plain, seeded)


def test_tp2_static(tmp_path, plain, seeded):
    """TP = 2 with "static" (trees in every step); the short job list, with request features,
    64 tokens (static needs no long runs: it has no measure-and-pause cycles)."""
    result = run_engine(tmp_path, 2, ddtree(ddtree_budget_policy="static"), short=True,
                        max_tokens=64)
    check_run(result, plain, seeded, max_tokens=64)


@pytest.mark.parametrize("num_blocks", [0, 10], ids=["roomy", "preempting"])
def test_pp2_default_policy(tmp_path, plain, seeded, num_blocks):
    """--pipeline-parallel-size 2 ("static", the default there): the short job list, 64
    tokens, against plain decoding and the TP = 1 seeds; with a K/V cache of 10 blocks of 32
    tokens, requests are preempted and resumed (the first stage rebuilds them from its token
    history, stages.complete_histories). The stages draft, accept and move exactly as one
    engine at TP = 1 with the same policy and cache: as many preemptions, and the last stage as
    many K/V moves (so the same drafts: its drafter embeds with the target's embedding,
    proposer.load_target_embedding); the first stage moved its layers' K/V by the accepted
    paths the scheduler relayed (stages.py), all of them but those of each request's final
    step (never scheduled again) and of the steps before a preemption (recomputed). (PP = 2
    with TP = 2 is four ranks: more than this machine's two cores hold reliably; it is run by
    hand, docs/parallelism.md.)"""
    result = run_engine(tmp_path, 1, ddtree(), short=True, max_tokens=64, pp=2,
                        num_blocks=num_blocks)
    check_run(result, plain, seeded, max_tokens=64)
    one_engine = run_here(ddtree(ddtree_budget_policy="static"), 64, num_blocks)
    assert result["preemptions"] == one_engine["preemptions"]
    assert (result["preemptions"] > 0) == bool(num_blocks), result["preemptions"]
    first, last = result["moved_slots_per_rank"]
    assert last == one_engine["moved_slots_per_rank"][0]
    # the last stage's drafter embeds tokens with the target's embedding (vLLM shares it only
    # without pipeline parallelism; the tiny drafter has none of its own)
    from safetensors import safe_open

    with safe_open(str(PAIR / "target" / "model.safetensors"), "pt") as f:
        want = float(f.get_tensor("model.embed_tokens.weight").double().sum())
    assert result["drafter_embedding_sum_per_rank"][-1] == want
    num_steps = sum(map(len, result["outputs"].values())) + result["preemptions"]
    depth = 7  # the tiny drafter's block_size - 1: at most 7 moves in a verify step
    assert 0 < first <= last <= first + depth * num_steps, (first, last)


def start_server_with(cmd: list[str], log_path: str, env: dict[str, str]):
    """demo.start_server with ``env`` set while the server process starts (then restored)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with open(log_path, "w") as log:
            return demo.start_server(cmd, log)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def ask_concurrently(port: int, seeded_prompts, max_tokens: int) -> list[tuple[int, list[int]]]:
    """Every prompt of PROMPTS to the server at ``port``, 8 at a time (with DP = 2 both engines
    serve), ``max_tokens`` each: greedy, or sampled with SEEDED's parameters and seed 1000 + i for
    ``seeded_prompts``; -> [(prompt index, token ids)]."""
    from openai import OpenAI

    # a new connection per request: a pooled keep-alive connection that the server closes
    # (uvicorn's 5 s idle timeout) just as a thread reuses it fails the request without a
    # response ("Server disconnected"), and retries are off
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", max_retries=0,
                    timeout=WATCHDOG_S, default_headers={"Connection": "close"})
    extra = {"ignore_eos": True, "return_token_ids": True}

    def ask(i: int):
        params = dict(temperature=0.0, extra_body=extra)
        if i in seeded_prompts:
            params = dict(temperature=SEEDED["temperature"], top_p=SEEDED["top_p"],
                          seed=1000 + i, extra_body=dict(extra, top_k=SEEDED["top_k"]))
        out = client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=max_tokens, **params)
        return i, out.choices[0].token_ids

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(ask, range(len(PROMPTS))))


def test_dp2_server_default_policy(tmp_path, plain, seeded):
    """--data-parallel-size 2 through the OpenAI server with the default policy: greedy
    requests equal plain decoding, seeded ones the TP = 1 engine's text, sent concurrently so
    that both engines serve."""
    port = demo.free_port()
    cmd = demo.server_command(str(PAIR), "ddtree", 32, port)
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    del spec["ddtree_budget_policy"]  # the default policy
    cmd[cmd.index("--speculative-config") + 1] = json.dumps(spec)
    cmd += ["--data-parallel-size", "2", "--max-num-seqs", "8"]
    log_path = str(tmp_path / "server.log")
    proc = start_server_with(cmd, log_path, {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        demo.wait_healthy(proc, port, 300.0, log_path)
        start = time.time()
        answers = ask_concurrently(port, SEEDED_PROMPTS, MAX_TOKENS)
        print(f"{len(answers)} requests in {time.time() - start:.0f} s")
        for i, ids in answers:
            want = seeded[i] if i in SEEDED_PROMPTS else plain["greedy"][str(i)]
            assert ids == want, f"prompt {i} differs"
        assert proc.poll() is None, demo.tail(log_path, 60)
    finally:
        demo.stop_server(proc, grace=10.0)
    with open(log_path, errors="replace") as f:
        text = f.read()
    assert "unmatched" not in text and "disagree" not in text, demo.tail(log_path, 60)


def test_a_request_joining_running_ones_gets_no_placeholder_drafts():
    """vLLM pads a new request with one token to compute ("x": a one-token prompt) with B
    placeholder drafts when others run; ddtree turns that off (patches.py, Scheduler.__init__):
    no unmatched rows, and the seeded text is the same whenever the request arrives."""
    from vllm import SamplingParams
    from vllm_utils import close, ddtree_spec, ddtree_state, make_llm

    llm = make_llm(ddtree_spec(32))
    try:
        engine, texts = llm.llm_engine, []
        params = SamplingParams(temperature=0.8, seed=123, max_tokens=24)
        for join_after in (0, 2):
            for i, prompt in enumerate(PROMPTS[:4]):
                engine.add_request(f"r{join_after}_{i}", prompt, params)
            for _ in range(join_after):
                engine.step()
            engine.add_request(f"x{join_after}", "x", params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.request_id == f"x{join_after}" and out.finished:
                        texts.append(list(out.outputs[0].token_ids))
        assert len(texts) == 2 and texts[0] == texts[1] and len(texts[0]) == 24
        assert ddtree_state(llm).num_unmatched_rows == 0
    finally:
        close(llm)
