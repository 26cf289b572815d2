"""bench/floor.py: the work and floor of each stage, checked by hand on a small problem and
against the FLOPs a committed benchmark run reported (no GPU needed)."""

import json
import pathlib

import pytest

from conftest import import_bench

HEADS = {"H": 8, "Hk": 2, "Hp": 2, "Hpk": 1, "D": 64, "Dp": 32, "K": 4}
RUN = pathlib.Path(__file__).parents[2] / "bench/results/2026-12-04-h200-bench-tma.json"


def test_stage_work_by_hand():
    floor = import_bench("floor")
    # B = 2 rows of S = 512 tokens, two documents of 200 and 312 per row; every query attends 100
    # keys on each of its 8 heads: P = 2 * 512 * 8 * 100.
    pairs = 2 * 512 * 8 * 100
    cfg = {"batch": 2, "seqlen": 512, "documents": [200, 312], "main_forward_flop": 4 * 64 * pairs}
    work = floor.stage_work(cfg, HEADS)
    visible = 2 * (200 * 201 // 2 + 312 * 313 // 2)
    proxy_pairs = pairs / 4  # G = 8 / 2 heads share a proxy head's selection
    tokens = 2 * 512
    proxy_in, main_in = 2 * tokens * 3 * 32, 2 * tokens * 12 * 64
    out, indices, stats = 2 * tokens * 8 * 64, 4 * tokens * 2 * 4, 4 * tokens * 10
    assert work["select"] == (2 * 32 * 2 * visible, proxy_in + indices)
    assert work["forward"] == (4 * 64 * pairs + 2 * 32 * proxy_pairs,
                               proxy_in + main_in + indices + out + stats)
    assert work["backward"] == (10 * 64 * pairs + 6 * 32 * proxy_pairs,
                                2 * proxy_in + 2 * main_in + indices + 2 * out + stats)


def test_floor_is_the_larger_of_compute_and_memory():
    floor = import_bench("floor")
    ceilings = {"bf16_matmul_tflops": 500.0, "copy_tbps": 2.0}
    assert floor.floor_ms(1e12, 1e9, ceilings) == pytest.approx((2.0, "matmul"))
    assert floor.floor_ms(1e9, 1e10, ceilings) == pytest.approx((5.0, "memory"))


def test_a_committed_run():
    """The select FLOPs equal what the run reported; the forward's main part is the run's own
    main_forward_flop; the step's floor is the sum of its stages'; warmup runs are left out."""
    floor = import_bench("floor")
    result = json.loads(RUN.read_text())
    rows = {(r["config"], r["stage"]): r for r in floor.floors(result)}
    assert not any(name.endswith("warmup") for name, _ in rows)
    for cfg in result["configs"]:
        if cfg.get("warmup"):
            continue
        sel = rows[cfg["name"], "select"]
        reported = cfg["select"]["tflops"] * cfg["select"]["ms"] / 1e3  # TFLOP
        assert sel["tflop"] == pytest.approx(reported, rel=2e-3), cfg["name"]
        fwd = rows[cfg["name"], "forward"]
        assert fwd["tflop"] == pytest.approx(cfg["main_forward_flop"] / 1e12 * (1 + 1 / 32))
        step = rows[cfg["name"], "step"]
        parts = [rows[cfg["name"], s]["floor_ms"] for s in ("select", "forward", "backward")]
        assert step["floor_ms"] == pytest.approx(sum(parts))
        assert step["over_floor"] == pytest.approx(cfg["step"]["ms"] / step["floor_ms"])
    s32k = rows["S32K", "forward"]
    assert s32k["bound"] == "matmul" and 2.5 < s32k["over_floor"] < 3.5
    text = "\n".join(floor.markdown(result, {"S32K"}))
    assert "| S32K | forward | 2.13 | 1.20 | 2.85 | matmul | 8.42 | 2.95x |" in text
    assert "S128K" not in text and "S32K 8.58 ms" in text
