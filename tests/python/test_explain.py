"""flash_msa.explain: the kernels of a call, without running it (docs/design.md, Variants)."""

import pytest
import torch

import flash_msa
from conftest import NAMES, Shape, random_inputs

CUDA = torch.cuda.is_available() and flash_msa.built_with_cuda()
SHAPE = Shape(B=1, S=1024, H=8, Hk=2, Hp=2, Hpk=1, D=128, Dp=128, K=4)


def tensors(device, dtype):
    x = random_inputs(SHAPE, dtype, seed=3, device=device)
    return [x[n] for n in NAMES]


def test_cpu_tensors_run_the_reference_backend():
    args = tensors("cpu", torch.float32)
    sparse = flash_msa.explain(*args, 512)
    assert [c["stage"] for c in sparse] == ["select", "sparse_forward", "sparse_backward"]
    assert {c["variant"] for c in sparse} == {"cpu"}
    warmup = flash_msa.explain(*args, warmup=True)
    assert [c["stage"] for c in warmup] == ["warmup_forward", "warmup_backward"]


@pytest.mark.parametrize("bad, match", [
    (dict(top_k=100), "top_k"),
    (dict(top_k=512, warmup=1), "warmup: expected a bool"),
    (dict(top_k=512, select_dtype=torch.int8), "select_dtype"),
])
def test_explain_refuses_what_the_call_refuses(bad, match):
    with pytest.raises(ValueError, match=match):
        flash_msa.explain(*tensors("cpu", torch.float32), **bad)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device and flash_msa built with CUDA")
def test_cuda_reports_each_part_with_a_reason():
    args = tensors("cuda", torch.bfloat16)
    hopper = torch.cuda.get_device_capability()[0] == 9
    plan = {c["stage"]: c for c in flash_msa.explain(*args, 512)}
    assert list(plan) == ["select", "sparse_forward", "forward_proxy_lse", "forward_tile_path",
                          "sparse_backward", "proxy_gradient"]
    assert all(c["reason"] for c in plan.values())
    assert plan["sparse_forward"]["variant"] == ("hopper" if hopper else "portable")
    assert plan["forward_tile_path"]["variant"] == ("on" if hopper else "off")
    with_kl = {c["stage"]: c for c in flash_msa.explain(*args, 512, compute_kl=True)}
    assert with_kl["forward_tile_path"]["variant"] == "off"
    warmup = [c["stage"] for c in flash_msa.explain(*args, warmup=True)]
    assert warmup == ["warmup_forward", "warmup_backward"]
    with pytest.raises(ValueError, match="float32 runs on the CPU backend only"):
        flash_msa.explain(*tensors("cuda", torch.float32), 512)
