"""bench/msa_bench.py stays in step with the ops: one small configuration of each kind runs on
the GPU (skipped without one), through the same code as a benchmark run."""

import time

import pytest
import torch

import flash_msa
from conftest import import_bench

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and flash_msa.built_with_cuda()),
    reason="needs a CUDA device and flash_msa built with CUDA",
)


@pytest.fixture(scope="module")
def bench():
    return import_bench("msa_bench")


# 4096 tokens: 32 blocks, more than K = 16, so that rows choose (the trained generator fits
# statistics of such rows).
@pytest.mark.parametrize("docs, warmup, selection", [(None, False, "proxy"),
                                                     (None, False, "trained"),
                                                     ([700, 2000, 1396], False, "proxy"),
                                                     (None, True, "proxy")],
                         ids=["proxy", "trained", "documents", "warmup"])
def test_one_small_configuration(bench, docs, warmup, selection):
    results = []
    gen = torch.Generator(device="cuda").manual_seed(7)
    bench.measure_config("small", 1, 4096, docs, warmup, selection, gen, results,
                         time.monotonic() + 60)
    cfg = results[0]
    for stage in ("forward", "forward_with_kl_value", "backward", "backward_with_kl_value",
                  "step", "step_with_kl_value"):
        assert cfg[stage]["ms"] > 0, stage
    assert "error" not in cfg
    if selection == "trained":
        assert cfg["selection_fit"]["drawn"]["rows"] > 0
    if not warmup and selection == "proxy" and bench.fp8_select_runs():
        assert cfg["select_fp8"]["ms"] > 0 and cfg["step_fp8_select"]["ms"] > 0
        if docs is None:
            assert 0.8 < cfg["select_fp8"]["kept_share"] < 1


def test_fp8_select_quality(bench):
    if not bench.fp8_select_runs():
        pytest.skip("the FP8 select runs on the Hopper select kernel (compute capability 9.x)")
    for kind, s in bench.fp8_quality(4096).items():
        assert 0.8 < s["overlap_mean"] < 1 and s["regret_max"] >= 0, kind


def test_gh200_shape(bench):
    res = bench.gh200_shape(torch.Generator(device="cuda").manual_seed(8))
    assert res["step"]["ms"] > 0 and res["cudnn_dense_step"]["ms"] > 0
