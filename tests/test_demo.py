"""scripts/demo.py end to end: vLLM's OpenAI server with the tiny pair and method "ddtree"
(the plugin), one chat request, acceptance scraped from /metrics, server stopped."""

import importlib.util
import os
import socket

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("vllm")
pytest.importorskip("openai")


def load_demo():
    spec = importlib.util.spec_from_file_location("ddtree_demo", os.path.join(ROOT, "scripts", "demo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_scrape_parses_prometheus_counters(monkeypatch):
    demo = load_demo()
    text = (
        "# TYPE vllm:spec_decode_num_drafts_total counter\n"
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 10.0\n'
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 320.0\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 25.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9.0\n'
    )

    class Resp:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def read(self):
            return text.encode()

    monkeypatch.setattr(demo.urllib.request, "urlopen", lambda *a, **k: Resp())
    m = demo.scrape_spec_metrics(1)
    assert m["num_drafts"] == 10 and m["num_accepted_tokens"] == 25 and m["num_draft_tokens"] == 320
    assert m["mean_acceptance_length"] == pytest.approx(3.5)  # 1 + 25 / 10


def test_demo_ddtree_server_round_trip():
    demo = load_demo()
    r = demo.run_demo(method="ddtree", max_tokens=24, verbose=False)
    assert r["completion_tokens"] == 24 and r["answer"]
    m = r["metrics"]
    # B = 32 draft nodes per verify step, fewer in the last steps before max_tokens
    assert m["num_drafts"] >= 1 and m["num_drafts"] <= m["num_draft_tokens"] <= 32 * m["num_drafts"]
    assert 1.0 <= m["mean_acceptance_length"] <= 8.0  # at most L + 1 = 8 tokens per step
    assert r["server_returncode"] is not None  # stopped
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):  # nobody listens any more
        s.connect(("127.0.0.1", r["port"]))
