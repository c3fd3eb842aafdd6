"""benchmarks/vllm_gpu.py --smoke: every code path of the GPU script, on the CPU, smallest settings.

One subprocess (about 2 minutes on 2 cores): the tiny pair (plain + ddtree) and the scaled-down
Qwen3-8B-shaped pair with random dummy weights (plain + ddtree B=16; greedy identity, a T > 0
run, the host-sync capture, the cost loop with stage hooks, the prediction, the PNG), on vLLM's
Model Runner V2 (its Triton kernels interpreted: tests/v2_harness.py), and ddtree B=16 again on
the V1 runner. The JSON goes to a temporary folder, never over benchmarks/results/.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUDGET, CONCURRENCY = 16, 2


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_gpu") / "smoke.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("OUT", None)
    cmd = [sys.executable, str(REPO / "benchmarks" / "vllm_gpu.py"), "--smoke",
           "--methods", "plain,ddtree", "--budgets", str(BUDGET),
           "--concurrency", str(CONCURRENCY), "--warmup-steps", "1", "--measure-steps", "2",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text()), proc.stdout, out


def test_json_structure(smoke):
    result, _, out = smoke
    for key in ("device", "smoke", "command", "settings", "shape", "stage_hooks", "correctness",
                "cost", "prediction", "jobs", "seconds"):
        assert key in result, key
    assert result["smoke"] is True and result["device"].startswith("cpu")
    assert result["settings"]["budgets"] == [BUDGET]
    assert {j["name"]: j["status"] for j in result["jobs"]} == {
        "tiny_fp32_plain": "done", "tiny_fp32_ddtree_b16": "done",
        "8b_fp32_plain": "done", "8b_fp32_ddtree_b16": "done", "8b_fp32_ddtree_b16_v1": "done"}
    assert result["settings"]["runners"] == ["v2", "v1"]
    assert result["png"] and (out.parent / result["png"]).stat().st_size > 0


def test_correctness_verdicts(smoke):
    result, stdout, _ = smoke
    corr = result["correctness"]
    tiny = corr["tiny_fp32"]
    assert tiny["verdict"] == "PASS" and tiny["identical"] == tiny["prompts"] == 6
    big = corr["qwen3_8b_identity"]
    assert big["verdict"] == "PASS", big
    assert big["per_budget"][f"B={BUDGET}"]["identical"] == result["settings"]["identity_prompts"]
    sampling = corr["sampling"]
    assert sampling["verdict"] == "PASS", sampling
    assert sampling["lengths"] == [sampling["expected_length"]] * len(sampling["lengths"])
    sync = corr["no_host_sync"]
    assert sync["verdict"] == "SKIP" and sync["emulated"] is True  # no CUDA here
    assert set(sync["by_owner"]) == {"plugin", "vllm", "other"} and sync["steps"] > 0
    for line in ("PASS  tiny_fp32", "PASS  qwen3_8b_identity", "PASS  sampling",
                 "SKIP  no_host_sync"):
        assert line in stdout


def test_cost_rows_and_stages(smoke):
    result, _, _ = smoke
    rows = {(r["method"], r["budget"], r["concurrency"], r["runner"]): r
            for r in result["cost"]["rows"]}
    assert set(rows) == {("plain", 0, CONCURRENCY, "v2"), ("ddtree", BUDGET, CONCURRENCY, "v2"),
                         ("ddtree", BUDGET, CONCURRENCY, "v1")}
    assert result["cost"]["skipped"] == []
    for row in rows.values():
        assert 0 < row["median_ms"] <= row["p90_ms"]
        assert row["steps"] == result["settings"]["measure_steps"]
        assert row["tokens_per_step"] >= 1.0
    for runner in ("v2", "v1"):
        ddtree = rows[("ddtree", BUDGET, CONCURRENCY, runner)]["stages"]
        expected = {"draft", "tree", "verify", "logits", "sample"}
        if "compaction" not in result["stages_skipped"]:
            expected.add("compaction")
        assert expected <= set(ddtree), (runner, ddtree)
        assert all(v["median_ms"] is not None and v["median_ms"] >= 0 for v in ddtree.values())
        assert ddtree["tree"]["median_ms"] <= ddtree["draft"]["median_ms"]  # inside draft


def test_prediction_uses_paper_tau(smoke):
    result, _, _ = smoke
    pred = result["prediction"]
    assert "2604.12989" in pred["tau_source"]["source"] and pred["assumptions"]
    (row,) = pred["rows"]
    assert row["budget"] == BUDGET and row["concurrency"] == CONCURRENCY
    assert row["tau_ddtree"] == pred["tau_source"]["ddtree"][str(BUDGET)]
    assert row["ddtree_over_plain"] == pytest.approx(
        row["tau_ddtree"] * row["plain_ms"] / row["ddtree_ms"])
    assert row["ddtree_over_dflash"] is None  # dflash not run here
    assert row["ddtree_v1_over_v2_step"] == pytest.approx(row["ddtree_v1_ms"] / row["ddtree_ms"])


# --- the verdict logic on hand-made inputs (no engine) ------------------------------------------


@pytest.fixture(scope="module")
def script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_gpu_script",
                                                  REPO / "benchmarks" / "vllm_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _outputs(*token_lists, gaps=None):
    rows = []
    for i, tokens in enumerate(token_lists):
        row = {"tokens": list(tokens)}
        if gaps is not None:
            row["top2_gap"] = gaps[i]
        rows.append(row)
    return {"outputs": rows, "tau": 2.0}


def test_compare_outputs_verdicts(script):
    plain = _outputs([1, 2, 3, 4], [5, 6, 7, 8], gaps=[[2.0, 0.1, 3.0, 1.0], [1.0, 2.0, 2.0, 0.9]])
    same = script.compare_outputs(plain, _outputs([1, 2, 3, 4], [5, 6, 7, 8]), allow_ties=False)
    assert same["verdict"] == "PASS" and same["identical"] == 2
    # prompt 0 diverges at position 1, where plain's top-2 gap is 0.1 nats: a near-tie
    tie = _outputs([1, 9, 9, 9], [5, 6, 7, 8])
    assert script.compare_outputs(plain, tie, allow_ties=True)["verdict"] == "PASS_NEAR_TIES"
    strict = script.compare_outputs(plain, tie, allow_ties=False)
    assert strict["verdict"] == "FAIL" and strict["first_divergence"] == [1, None]
    assert strict["plain_top2_gap_at_divergence"] == [0.1, None]
    # a divergence at a 3-nat margin is never a tie; a shorter output diverges where it ends
    wide = script.compare_outputs(plain, _outputs([1, 2, 9, 4], [5, 6, 7]), allow_ties=True)
    assert wide["verdict"] == "FAIL" and wide["first_divergence"] == [2, 3]


def test_sync_attribution(script):
    import traceback

    frame = traceback.FrameSummary
    vllm = "/x/site-packages/vllm/v1/worker/gpu_model_runner.py"
    plugin = str(REPO / "vllm_ddtree" / "plugin" / "patches.py")
    kernels = str(REPO / "kernels" / "compact_kv.py")
    torch_file = "/x/site-packages/torch/cuda/__init__.py"
    # innermost project frame decides: a vLLM sync under a plugin wrapper stays vLLM's
    through = script.classify_sync([frame(vllm, 1, "step"), frame(plugin, 2, "_prepare_inputs"),
                                    frame(vllm, 3, "_prepare_inputs"), frame(torch_file, 4, "f")])
    assert through["owner"] == "vllm" and through["via_plugin"]
    own = script.classify_sync([frame(vllm, 1, "step"), frame(kernels, 5, "compact_kv"),
                                frame(torch_file, 4, "f")])
    assert own["owner"] == "plugin" and own["site"].startswith("kernels/compact_kv.py:5")


def test_plan_orders_and_sizes_jobs(script):
    defaults = script.default_settings(smoke=False, cuda=True)
    st = script.Settings(smoke=False, cuda=True, parts=script.PARTS, methods=script.METHODS,
                         **defaults)
    names = [j["name"] for j in script.plan_jobs(st)]
    assert names == ["tiny_fp32_plain", "tiny_fp32_ddtree_b32", "8b_bf16_plain",
                     "8b_bf16_ddtree_b64", "8b_bf16_dflash", "8b_bf16_ddtree_b64_v1",
                     "tiny_bf16_plain", "tiny_bf16_ddtree_b32", "8b_bf16_ddtree_b256",
                     "8b_bf16_ddtree_b512", "8b_bf16_ddtree_b16"]
    runners = {j["name"]: j["runner"] for j in script.plan_jobs(st)}
    assert runners["8b_bf16_ddtree_b64_v1"] == "v1"
    assert {r for n, r in runners.items() if not n.endswith("_v1")} == {"v2"}
    job = next(j for j in script.plan_jobs(st) if j["name"] == "8b_bf16_ddtree_b512")
    args = script.engine_args(job, st, {"target": "t", "drafter": "d"})
    assert args["max_num_batched_tokens"] >= 32 * 513  # the verify rows of B=512 at c=32
    assert 32 * 513 in args["compilation_config"]["cudagraph_capture_sizes"]
    assert args["enforce_eager"] is False and args["load_format"] == "dummy"
    assert args["speculative_config"]["num_speculative_tokens"] == 512
    assert args["async_scheduling"] is None  # V2: vLLM's default, on
    v1 = next(j for j in script.plan_jobs(st) if j["runner"] == "v1")
    assert script.engine_args(v1, st, {"target": "t", "drafter": "d"})["async_scheduling"] is False


def test_compile_mode_fallback(script, tmp_path):
    """On CUDA a job whose engine fails to start runs again without AOT compile, then eager; the
    mode that ran is kept for the later batches and every job records its mode and failed
    attempts."""
    defaults = script.default_settings(smoke=False, cuda=True)
    st = script.Settings(smoke=False, cuda=True, parts=["tiny"], methods=script.METHODS, **defaults)
    st.deadline = script.time.time() + 3600
    jobs = script.plan_jobs(st)  # tiny fp32 plain + ddtree (one worker), then tiny bf16's
    assert [len(b) for b in ([jobs[:2], jobs[2:]])] == [2, 2]
    calls = []

    def run_batch(batch, *args):
        modes = {j["mode"] for j in batch}
        assert len(modes) == 1
        calls.append((batch[0]["name"], *modes))
        # the default mode's compile fails; without AOT artifacts the engines start
        status = "engine_failed" if modes == {"default"} else "done"
        return {j["name"]: {"job": j, "status": status,
                            "errors": {"engine": "InductorError: boom"} if status != "done" else {}}
                for j in batch}

    results = script.run_jobs(jobs, st, {}, [], {}, tmp_path, tmp_path, run_batch=run_batch)
    assert calls == [("tiny_fp32_plain", "default"), ("tiny_fp32_plain", "no_aot_compile"),
                     ("tiny_bf16_plain", "no_aot_compile")]
    assert {n: r["mode"] for n, r in results.items()} == dict.fromkeys(results, "no_aot_compile")
    assert results["tiny_fp32_ddtree_b32"]["failed_modes"] == [
        {"mode": "default", "status": "engine_failed", "error": "InductorError: boom"}]
    assert results["tiny_bf16_plain"]["failed_modes"] == []
    # every mode failing: three tries, the last result stands; eager is an engine argument
    calls.clear()
    results = script.run_jobs(jobs[:2], st, {}, [], {}, tmp_path, tmp_path,
                              run_batch=lambda batch, *a: {
                                  j["name"]: {"status": "engine_failed", "errors": {"engine": j["mode"]}}
                                  for j in (calls.append(batch[0]["mode"]) or batch)})
    assert calls == ["default", "no_aot_compile", "eager"]
    assert results["tiny_fp32_plain"]["mode"] == "eager" and len(results["tiny_fp32_plain"]["failed_modes"]) == 2
    # only ddtree's engine fails: only it runs again; plain keeps its result and mode
    calls.clear()
    results = script.run_jobs(jobs[:2], st, {}, [], {}, tmp_path, tmp_path,
                              run_batch=lambda batch, *a: {
                                  j["name"]: {"status": "engine_failed" if j["method"] == "ddtree"
                                              and j["mode"] == "default" else "done"}
                                  for j in (calls.append([k["name"] for k in batch]) or batch)})
    assert calls == [["tiny_fp32_plain", "tiny_fp32_ddtree_b32"], ["tiny_fp32_ddtree_b32"]]
    assert {n: (r["mode"], r["status"], len(r["failed_modes"])) for n, r in results.items()} == {
        "tiny_fp32_plain": ("default", "done", 0), "tiny_fp32_ddtree_b32": ("no_aot_compile", "done", 1)}
    eager = script.engine_args(dict(jobs[0], mode="eager"), st, {"target": "t", "drafter": "d"})
    assert eager["enforce_eager"] is True
    assert script.engine_args(dict(jobs[0], mode="no_aot_compile"), st, {"target": "t"})["enforce_eager"] is False
    assert script.COMPILE_MODES["no_aot_compile"]["env"] == {"VLLM_USE_AOT_COMPILE": "0"}
