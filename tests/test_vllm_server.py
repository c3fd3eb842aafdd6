"""ddtree through vLLM's OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``).

One server for the module: the committed tiny pair, ``--dtype float32``, ``--speculative-config``
with method ddtree and budget 16, started and stopped with scripts/demo.py's helpers. Oracle for the
greedy checks: an in-process engine *without* speculation (same target, float32, same renderer as
the server), run once and closed before the server starts; the server returns its ids with
``return_token_ids``. The fixture's teardown is the shutdown check: SIGTERM to the API server alone,
exit in time, no traceback in the log (bar vLLM's own shutdown race, see
without_vllm_shutdown_race), nothing left of its process group.
"""

import importlib.util
import os
import signal
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("vllm")
pytest.importorskip("openai")

from vllm_utils import PAIR, close, make_llm  # noqa: E402

BUDGET = 16
MAX_TOKENS = 32
# two prompts in one request (a batch in the server); the tiny target's greedy text varies on these
# (on many prompts its greedy text degenerates into blank lines)
PROMPTS = ["class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
           "    for i in range("]
CHAT = [{"role": "user", "content": "import"}]
GREEDY = dict(temperature=0.0, max_tokens=MAX_TOKENS)
EXTRA = {"ignore_eos": True, "return_token_ids": True}
STARTUP_TIMEOUT = 300.0
SHUTDOWN_TIMEOUT = 30.0  # SIGTERM to the API server alone must stop it and its engine core within this


def load_demo():
    spec = importlib.util.spec_from_file_location("ddtree_demo", os.path.join(ROOT, "scripts", "demo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


demo = load_demo()


def group_members(pgid: int) -> set[int]:
    """Live (not zombie) processes of the process group ``pgid``."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # state ppid pgrp ...
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in "ZX":
            out.add(int(pid))
    return out


_RACE_HEAD = "AsyncLLM output_handler failed."


def without_vllm_shutdown_race(log: str) -> str:
    """The log less vLLM 0.32's own shutdown race, which is not ddtree's: the API server runs
    AsyncLLM.shutdown in an executor thread; it closes the engine client (whose cancelled output
    task queues an EngineDeadError) *before* it cancels the output handler, so the handler may
    read that error and log it with a traceback first. Only that traceback, logged after
    "[shutdown] MPClient: complete", is dropped; any other one stays."""
    lines = log.splitlines()
    stopped = next((i for i, line in enumerate(lines) if "[shutdown] MPClient: complete" in line), len(lines))
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        if i > stopped and line.endswith(_RACE_HEAD) and "[async_llm.py:" in line:
            prefix = line[: -len(_RACE_HEAD)]  # every line of a logged traceback carries it
            j = i + 1
            while j < len(lines) and lines[j].startswith(prefix):
                j += 1
            if "EngineDeadError" in lines[j - 1]:
                i = j
                continue
        out.append(line)
        i += 1
    return "\n".join(out)


def test_shutdown_race_filter_drops_only_that_traceback():
    tag = "(APIServer pid=7) ERROR 11-22 21:09:55 [async_llm.py:906] "
    race = [
        "(APIServer pid=7) INFO 11-22 21:09:55 [core_client.py:777] [shutdown] MPClient: complete",
        tag + "AsyncLLM output_handler failed.",
        tag + "Traceback (most recent call last):",
        tag + '  File "async_llm.py", line 849, in output_handler',
        tag + "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
        "INFO:     Shutting down",
    ]
    assert "Traceback" not in without_vllm_shutdown_race("\n".join(race))
    assert "Traceback" in without_vllm_shutdown_race("\n".join(race[1:]))  # engine not stopped first
    other = [tag + "AsyncLLM output_handler failed.", tag + "Traceback (most recent call last):",
             tag + "RuntimeError: ddtree"]
    assert "Traceback" in without_vllm_shutdown_race("\n".join(race[:1] + other))
    crash = ["(EngineCore pid=8) ERROR 11-22 [core.py:1] Traceback (most recent call last):"]
    assert "Traceback" in without_vllm_shutdown_race("\n".join(race + crash))


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain():
    """Greedy decoding WITHOUT speculation, in-process, through the same renderer as the server
    (text prompts tokenised as /v1/completions does, the chat template applied as /v1/chat does)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = make_llm(None)
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False) + llm.chat(CHAT, params, use_tqdm=False)
    finally:
        close(llm)  # before the server starts: the two never compete for the 2 cores
    got = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]
    return {"completions": got[:-1], "chat": got[-1]}


@pytest.fixture(scope="module")
def server(plain, tmp_path_factory):
    """The ddtree server. Teardown: the shutdown check, then the process group is killed whatever failed."""
    port = demo.free_port()
    log_path = str(tmp_path_factory.mktemp("vllm_server") / "server.log")
    log = open(log_path, "w")
    proc = demo.start_server(demo.server_command(str(PAIR), "ddtree", BUDGET, port), log)
    tail = lambda: demo.tail(log_path, 60)  # noqa: E731
    try:
        t0 = time.time()
        demo.wait_healthy(proc, port, STARTUP_TIMEOUT, log_path)
        print(f"server healthy after {time.time() - t0:.0f}s")
        yield port
        assert proc.poll() is None, f"server died during the tests:\n{tail()}"
        assert len(group_members(proc.pid)) >= 2, "expected vLLM's engine-core subprocess in the group"
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)  # as `docker stop` does: the server must stop its engine core
        try:
            proc.wait(timeout=SHUTDOWN_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"server still running {SHUTDOWN_TIMEOUT:.0f}s after SIGTERM:\n{tail()}")
        deadline = time.time() + 10.0  # let the engine core finish exiting
        while group_members(proc.pid) and time.time() < deadline:
            time.sleep(0.2)
        print(f"server stopped {time.time() - t0:.1f}s after SIGTERM, exit code {proc.returncode}")
        with open(log_path, errors="replace") as f:
            text = f.read()
        assert "Traceback" not in without_vllm_shutdown_race(text), f"traceback in the server log:\n{tail()}"
        assert not group_members(proc.pid), f"processes left after shutdown: {group_members(proc.pid)}\n{tail()}"
    finally:
        demo.stop_server(proc, grace=5.0)  # no-op after a clean shutdown; kills the group otherwise
        log.close()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="EMPTY", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def completion(client):
    return client.completions.create(model="tiny", prompt=PROMPTS, **GREEDY, extra_body=EXTRA)


@pytest.fixture(scope="module")
def chat(client):
    return client.chat.completions.create(model="tiny", messages=CHAT, **GREEDY, extra_body=EXTRA)


# ---- tests ------------------------------------------------------------------------------------


def test_completion_greedy_matches_plain_decoding(completion, plain):
    """Two prompts in one request at T=0: token ids and text equal decoding without speculation."""
    choices = sorted(completion.choices, key=lambda c: c.index)
    assert len(choices) == len(PROMPTS)
    assert completion.usage.completion_tokens == MAX_TOKENS * len(PROMPTS)
    for choice, (prompt_ids, want_ids, want_text) in zip(choices, plain["completions"]):
        assert choice.finish_reason == "length"
        assert choice.prompt_token_ids == prompt_ids  # the server tokenised the prompt as the oracle did
        assert choice.token_ids == want_ids  # greedy identity: ddtree == decoding without speculation
        assert choice.text == want_text
    assert len(set(choices[0].token_ids)) > 5  # not the degenerate blank-line output


def test_completion_stream_concatenates_to_the_same_text(client, completion):
    stream = client.completions.create(model="tiny", prompt=PROMPTS, **GREEDY, stream=True,
                                       stream_options={"include_usage": True}, extra_body=EXTRA)
    texts, ids, finish, chunks = {}, {}, {}, {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            chunks[c.index] = chunks.get(c.index, 0) + 1
            texts[c.index] = texts.get(c.index, "") + c.text
            ids.setdefault(c.index, []).extend(getattr(c, "token_ids", None) or [])
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    for want in completion.choices:
        assert chunks[want.index] > 1  # streamed, not one final chunk
        assert texts[want.index] == want.text
        assert ids[want.index] == want.token_ids
        assert finish[want.index] == "length"
    assert usage is not None and usage.completion_tokens == MAX_TOKENS * len(PROMPTS)


def test_chat_greedy_matches_plain_decoding(chat, plain):
    prompt_ids, want_ids, want_text = plain["chat"]
    choice = chat.choices[0]
    assert choice.finish_reason == "length"
    assert chat.usage.completion_tokens == MAX_TOKENS
    assert choice.message.content  # non-empty
    assert chat.prompt_token_ids == prompt_ids  # the chat template applied as the oracle did
    assert choice.token_ids == want_ids
    assert choice.message.content == want_text


def test_chat_stream(client, chat):
    stream = client.chat.completions.create(model="tiny", messages=CHAT, **GREEDY, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    content, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            if choice.finish_reason is not None:
                finish = choice.finish_reason
    assert len(content) > 1 and "".join(content) == chat.choices[0].message.content
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == MAX_TOKENS


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_logprobs_rejected_with_400_then_server_keeps_serving(client, endpoint):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        if endpoint == "completions":
            client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, logprobs=1)
        else:
            client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, logprobs=True)
    assert err.value.status_code == 400
    assert "ddtree" in str(err.value) and "logprobs" in str(err.value)
    after = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 8 and after.choices[0].finish_reason == "length"


def test_metrics_show_drafts_and_accepted_tokens(server, completion):
    m = demo.scrape_spec_metrics(server)  # parses vllm:spec_decode_* from the Prometheus text
    assert m["num_drafts"] > 0
    assert m["num_accepted_tokens"] > 0
    # B draft nodes per verify step, fewer in the last steps before max_tokens
    assert m["num_drafts"] <= m["num_draft_tokens"] <= BUDGET * m["num_drafts"]

