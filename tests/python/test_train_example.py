"""The training example (examples/train_lm.py) in a tiny configuration on the CPU: both runs
train (the loss falls), every logged figure and the selection statistics are written, and the
plots are drawn, so that the example cannot rot."""

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = REPO / "examples" / "train_lm.py"


def test_train_example_cpu_smoke(tmp_path):
    steps = 16
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--seqlen", "2048",
           "--batch", "4", "--steps", str(steps), "--warmup-steps", "8", "--eval-every", "8",
           "--eval-batches", "1", "--lr", "3e-3", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["runs"]) == {"dense", "msa"}
    for name, run in result["runs"].items():
        losses = [s["loss"] for s in run["steps"]]
        assert len(losses) == steps
        first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        assert last < first - 0.05, f"{name}: the loss did not fall: {losses}"
        assert [e["step"] for e in run["evals"]] == [7, 15]
        assert 0.0 <= run["final"]["accuracy"] <= 1.0
    msa = result["runs"]["msa"]
    assert [s["phase"] for s in msa["steps"]] == ["warmup"] * 8 + ["sparse"] * 8
    assert all(s["kl"] > 0 for s in msa["steps"])
    for layer in msa["final"]["recall"]:
        assert 0.0 < layer["mass"] <= 1.0 + 1e-6 and 0.0 <= layer["top_blocks"] <= 1.0
    stats = msa["selection_stats"]
    assert len(stats) == 2
    for s in stats:
        assert s["top_k_blocks"] == 2 and s["blocks"] == 16
        assert sum(s["distance_share"]) == pytest.approx(1.0, abs=1e-3) or s["sink_share"] == 1
        assert 0.5 <= s["neighbour_overlap"] <= 1.0 and 1.0 <= s["tile_union_over_k"] <= 16 / 2
    if importlib.util.find_spec("matplotlib") is None:  # scripts/install_deps.sh installs it
        assert "matplotlib is not installed" in done.stdout
        return
    for png in ("loss.png", "accuracy.png", "kl.png", "recall.png", "step_time.png"):
        assert (tmp_path / png).stat().st_size > 1000, png


def test_train_example_fp8_select(tmp_path):
    """--fp8-select: the sparse phase ranks on FP8 scores (the CPU backend's FP8 path here)."""
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--seqlen", "2048",
           "--batch", "2", "--steps", "6", "--warmup-steps", "3", "--eval-every", "6",
           "--eval-batches", "1", "--runs", "msa", "--fp8-select", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    steps = json.loads((tmp_path / "results.json").read_text())["runs"]["msa"]["steps"]
    assert [s["phase"] for s in steps] == ["warmup"] * 3 + ["sparse"] * 3
    assert all(s["kl"] > 0 for s in steps)


def test_train_example_rejects_a_budget_over_an_eighth(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--seqlen", "2048",
           "--top-k-blocks", "3", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "at most an eighth" in done.stderr
