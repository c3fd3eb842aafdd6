"""benchmarks/cuda_stages.py --smoke: the GPU stage script's code paths on the CPU.

One subprocess (seconds): the torch path of the stages against the fused CPU ops on the same
inputs, op counting per stage through launches.py's counter. The CUDA-only parts (profiler,
sync debug mode, graph capture) need a GPU; the committed H200 result comes from there. The
JSON goes to a temporary folder, never over benchmarks/results/.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("build_tree", "record_proposal", "clip_drafts", "begin_verify", "walk",
          "finish_verify")


def test_smoke_run_matches_the_fused_ops_and_counts_every_stage(tmp_path):
    out = tmp_path / "cuda_stages_smoke.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cuda_stages.py"), "--smoke",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["smoke"] is True and "--smoke" in result["command"]
    assert "fused" in result["reference"], result["reference"]  # torch path vs the C++ ops
    assert len(result["results"]) == 4  # B in {16, 64} x 1 and 2 requests
    for run in result["results"]:
        assert run["correct"], run["mismatches"]
        assert run["mean_accepted"] > 1  # the walk followed real paths, not the root alone
        for stage in STAGES:
            assert stage in run["stages"], stage
        # the torch path really runs ops (the counter sees them)
        assert run["stages"]["build_tree"]["aten_ops"] > 0
        assert run["stages"]["walk"]["aten_ops"] > 0
        assert run["per_step"]["aten_ops"] == sum(run["stages"][s]["aten_ops"] for s in STAGES)
