"""benchmarks/tree_replay.py's replay, on hand-made recorded trees (no engine): a fixed width
keeps the recorded path's nodes below it, and a step costs the recorded model's time of its
rows, priced at each node scale. One subprocess (seconds); the JSON goes to a temporary
folder, never over benchmarks/results/."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def test_replay_prices_fixed_widths_by_the_recorded_model(tmp_path):
    width, steps = 24, 40
    scores = torch.linspace(-0.2, -6.0, width)  # best first
    depths = torch.tensor([1, 2, 1, 2, 3, 2] * 4)
    accepted = torch.tensor([0, 5, 18, -1])  # the walk's path in the full tree: depths 1-3
    trees = [(scores.clone(), depths.clone(), accepted.clone()) for _ in range(steps)]
    # verify: 10 ms + 1 ms a row beyond the first; drafter 1 ms; no learned overhead
    cost = {"verify_tokens": [1, 100], "verify_seconds": [0.010, 0.010 + 99 * 0.001],
            "draft_requests": [1], "draft_seconds": [0.001]}
    trees_path, out = tmp_path / "trees.pt", tmp_path / "replay.json"
    torch.save({"trees": trees, "cost": cost, "on_overhead": 0.0, "budget": width}, trees_path)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tree_replay.py"),
                           "--trees", str(trees_path), "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["trees"] == steps and "--trees" in result["command"]
    rows = {(r["rule"], r["node_scale"]): r for r in result["rows"]}
    for scale in (1.0, 1.5, 2.0):
        # (kept nodes, accepted among them): full keeps the path's 3, B = 16 nodes 0 and 5
        for rule, kept, path in (("full", 24, 3), ("B=16", 16, 2), ("B=20", 20, 3)):
            want = (1 + path) / (0.011 + scale * kept * 0.001)
            assert rows[(rule, scale)]["tokens_per_s"] == pytest.approx(want, abs=0.01), rule
            assert rows[(rule, scale)]["mean_nodes"] == kept
        # auto's rules learn each its own calibration from the nodes it keeps: their trees
        # need not nest, but each is a tree of the recorded ones
        tie0, tie = rows[("auto, tie 0", scale)], rows[("auto, tie 0.01", scale)]
        assert 0 < tie0["mean_nodes"] <= width and 0 < tie["mean_nodes"] <= width
        # every rule's rate lies between the worst and the best of a step's possible trees
        rates = [(1 + sum(1 for n in accepted if 0 <= n < k)) / (0.011 + scale * k * 0.001)
                 for k in range(width + 1)]
        for row in (tie0, tie):
            assert min(rates) - 0.01 <= row["tokens_per_s"] <= max(rates) + 0.01
    assert not math.isnan(rows[("auto, tie 0", 1.0)]["cut_nodes_predicted_each"])
