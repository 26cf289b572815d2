"""The continued-pretraining example (examples/continue_pretraining.py) in a tiny configuration
on the CPU: pretraining, both continuations, the warmup-to-sparse switch, the KL values, the
block recall and the results file, so that the example cannot rot."""

import importlib.util
import json
import math
import subprocess
import sys

import pytest

from conftest import REPO

pytest.importorskip("transformers")

SCRIPT = REPO / "examples" / "continue_pretraining.py"


def test_cpt_example_cpu_smoke(tmp_path):
    steps, warmup = 6, 3
    cmd = [sys.executable, str(SCRIPT), "--context", "512", "--top-k", "128", "--hidden", "64",
           "--heads", "2", "--kv-heads", "1", "--batch", "1", "--pretrain-steps", "4",
           "--steps", str(steps), "--warmup-steps", str(warmup), "--eval-every", "3",
           "--val-seqs", "2", "--recall-seqs", "1", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["corpus"]["files"] > 100 and result["corpus"]["val_bytes"] > 0
    assert [e["step"] for e in result["pretrain"]["evals"]] == [0, 3, 4]
    dense, msa = result["runs"]["dense"], result["runs"]["msa"]
    for run in (result["pretrain"], dense, msa):
        assert all(math.isfinite(s["loss"]) for s in run["steps"])
        assert all(math.isfinite(e["val_loss"]) for e in run["evals"])
    # Both continuations start from the pretrained checkpoint; in warmup mode the converted
    # model computes the dense model's function, and both see the same batches.
    assert dense["evals"][0]["val_loss"] == pytest.approx(result["pretrain"]["evals"][-1]["val_loss"],
                                                          abs=1e-4)
    assert msa["evals"][0]["val_loss"] == pytest.approx(dense["evals"][0]["val_loss"], abs=1e-4)
    assert msa["steps"][0]["loss"] == pytest.approx(dense["steps"][0]["loss"], abs=1e-4)
    assert math.isfinite(msa["evals"][0]["val_loss_sparse"])
    assert [e["step"] for e in msa["evals"]] == [0, 3, 6]
    assert [s["phase"] for s in msa["steps"]] == ["warmup"] * warmup + ["sparse"] * (steps - warmup)
    assert [e["phase"] for e in msa["evals"]] == ["warmup", "warmup", "sparse"]
    for s in msa["steps"]:
        assert len(s["kl_layers"]) == 2 and all(0 <= kl < 10 for kl in s["kl_layers"])
        assert s["kl"] > 0
    for e in msa["evals"]:
        assert len(e["recall"]) == 2
        for r in e["recall"]:
            assert 0.0 <= r["top_blocks"] <= 1.0 and 0.0 <= r["window"] <= 1.0
            assert 0.0 < r["mass"] <= 1.0 + 1e-4
    summary = result["summary"]
    assert summary["val_loss_dense"] == dense["evals"][-1]["val_loss"]
    assert summary["val_loss_msa"] == msa["evals"][-1]["val_loss"]
    assert summary["gap_percent"] == pytest.approx(
        100 * (summary["val_loss_msa"] / summary["val_loss_dense"] - 1), abs=1e-3)
    assert 0.0 <= summary["block_recall"] <= 1.0
    assert "validation loss at the end" in done.stdout
    if importlib.util.find_spec("matplotlib") is None:  # scripts/install_deps.sh installs it
        assert "matplotlib is not installed" in done.stdout
        return
    assert (tmp_path / "cpt.png").stat().st_size > 1000


def test_cpt_example_rejects_a_top_k_that_is_not_sparse(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--context", "512", "--top-k", "512",
           "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "below --context" in done.stderr
