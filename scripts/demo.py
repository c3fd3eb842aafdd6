#!/usr/bin/env python
"""DDTree in vLLM's OpenAI-compatible server, end to end, with the committed tiny pair.

Starts ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 (a free port) with
``--speculative-config '{"method": "ddtree", "model": <drafter>, "num_speculative_tokens": 32,
"ddtree_budget_policy": "static"}'``, waits for /health, sends one chat request with the
``openai`` client, prints the answer and the acceptance figures scraped from /metrics, and stops
the server (also on error or Ctrl-C).

Usage::

    .venv/bin/python scripts/demo.py                       # DDTree, static budget 32
    .venv/bin/python scripts/demo.py --method dflash       # vLLM's own DFlash chain (7 drafts)
    .venv/bin/python scripts/demo.py --prompt "def fibonacci(n):" --max-tokens 96 --temperature 0
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIR = os.path.join(REPO, "vllm_ddtree", "assets", "tiny_pair")
DEFAULT_PROMPT = "class Stack:\n    def __init__(self):"
# NOTE: the tiny target (2.4M parameters, ~1M training tokens) writes Python-looking text when sampled;
# greedy decoding mostly degenerates into blank lines (high acceptance, dull answer), hence T = 0.7.
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(pair: str, method: str, num_spec: int, port: int) -> list[str]:
    spec = {"method": method, "model": os.path.join(pair, "drafter"), "num_speculative_tokens": num_spec}
    if method == "ddtree":
        # trees in every step, to show them at work: the default policy ("auto") would rightly
        # pause this drafter on a CPU, where it does not pay (docs/budget-policy.md)
        spec["ddtree_budget_policy"] = "static"
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", os.path.join(pair, "target"), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
        # a K/V cache of 0.25 GiB (~100k tokens of the tiny pair), not a share of the RAM: the
        # server allocates and fills it at start, ~13 s for the 5 GiB that 30 % of 18 GiB made
        "--kv-cache-memory-bytes", str(1 << 28), "--max-num-seqs", "4",
        "--speculative-config", json.dumps(spec),
    ]


def start_server(cmd: list[str], log) -> subprocess.Popen:
    """Start ``cmd`` logging to the open file ``log``, offline, in its own session (and process group,
    so that stop_server reaches vLLM's engine-core subprocess too)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the tests set it to 0 for their in-process engines
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float, log_path: str) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before becoming healthy:\n{tail(log_path)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"server not healthy after {timeout:.0f}s:\n{tail(log_path)}")


def tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def scrape_spec_metrics(port: int) -> dict:
    """Sum the vllm:spec_decode_* counters of /metrics; mean acceptance length = 1 + accepted / drafts."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {name: 0.0 for name in SPEC_COUNTERS}
    for line in text.splitlines():
        m = re.match(r"^vllm:spec_decode_(num_drafts|num_draft_tokens|num_accepted_tokens)(?:_total)?(?:\{.*\})?\s+(\S+)$", line)
        if m:
            out[m.group(1)] += float(m.group(2))
    drafts = out["num_drafts"]
    out["mean_acceptance_length"] = 1 + out["num_accepted_tokens"] / drafts if drafts else None
    out["draft_acceptance_rate"] = out["num_accepted_tokens"] / out["num_draft_tokens"] if out["num_draft_tokens"] else None
    return out


def stop_server(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGINT, then SIGTERM, then SIGKILL to the server's own process group (start_server's session);
    once the server has exited, SIGKILL whatever is left of the group, so that nothing outlives it."""
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_demo(pair: str = PAIR, method: str = "ddtree", num_spec: int | None = None, prompt: str = DEFAULT_PROMPT,
             max_tokens: int = 64, startup_timeout: float = 300.0, verbose: bool = True,
             temperature: float = 0.7, top_p: float = 0.95, seed: int = 0) -> dict:
    """Start the server, chat once, scrape /metrics, stop the server. Returns a summary dict."""
    from openai import OpenAI

    if num_spec is None:
        block = json.load(open(os.path.join(pair, "drafter", "config.json")))["block_size"]
        num_spec = 32 if method == "ddtree" else block - 1
    port = free_port()
    cmd = server_command(pair, method, num_spec, port)
    log = tempfile.NamedTemporaryFile("w", prefix="ddtree_demo_server_", suffix=".log", delete=False)
    if verbose:
        print(f"starting: {' '.join(cmd)}\n(server log: {log.name})", flush=True)
    proc = start_server(cmd, log)
    try:
        t0 = time.time()
        wait_healthy(proc, port, startup_timeout, log.name)
        if verbose:
            print(f"server healthy on 127.0.0.1:{port} after {time.time() - t0:.0f}s", flush=True)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY")
        t1 = time.time()
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, seed=seed,
        )
        latency = time.time() - t1
        metrics = scrape_spec_metrics(port)
        result = {
            "method": method, "num_speculative_tokens": num_spec, "port": port,
            "answer": reply.choices[0].message.content,
            "completion_tokens": reply.usage.completion_tokens if reply.usage else None,
            "latency_s": latency, "metrics": metrics,
        }
    finally:
        stop_server(proc)
        log.close()
    result["server_returncode"] = proc.returncode
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default=PAIR, help="directory with target/ and drafter/")
    ap.add_argument("--method", default="ddtree", choices=["ddtree", "dflash"])
    ap.add_argument("--num-spec", type=int, default=None, help="tree budget (ddtree, default 32) or chain length")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    args = ap.parse_args()
    r = run_demo(args.pair, args.method, args.num_spec, args.prompt, args.max_tokens, args.startup_timeout,
                 temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    m = r["metrics"]
    print("\n=== prompt ===\n" + args.prompt)
    print("=== answer ===\n" + (r["answer"] or ""))
    print("=== speculative decoding ===")
    print(f"method {r['method']}, num_speculative_tokens {r['num_speculative_tokens']}, T={args.temperature:g}, "
          f"{r['completion_tokens']} tokens in {r['latency_s']:.2f}s")
    print(f"drafts (verify steps) {m['num_drafts']:.0f}, draft tokens {m['num_draft_tokens']:.0f}, "
          f"accepted {m['num_accepted_tokens']:.0f}")
    if m["mean_acceptance_length"] is not None:
        print(f"mean acceptance length (tokens per step, bonus included): {m['mean_acceptance_length']:.2f}")
    print(f"server stopped (exit code {r['server_returncode']})")


if __name__ == "__main__":
    main()
