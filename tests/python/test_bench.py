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
