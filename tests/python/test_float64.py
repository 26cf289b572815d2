"""float64 on the CPU backend: computed in double precision throughout (statistics included),
so that torch.autograd.gradcheck runs on the ops, and the results match the float64 reference to
rounding.

What is differentiable (see test_gradcheck.py): out w.r.t. q, k, v, and kl w.r.t. q_proxy,
k_proxy. The KL's teacher is detached by design, so kl has no gradient w.r.t. q, k, v although
its value depends on them: the gradcheck of kl holds q, k, v fixed, that of out holds the proxy
fixed. Selection is piecewise constant in the proxy, so the sparse checks of kl either take the
indices as fixed inputs (sparse_attention) or select every visible block (flash_msa_func with
top_k covering the sequence), where the selection cannot change under a perturbation.
"""

import pytest
import torch
from torch.autograd.gradcheck import GradcheckError

import flash_msa
import reference as ref
from conftest import NAMES, Shape, random_inputs

# Scales that float32 holds exactly: the C++ API takes float scales, and the reference below
# uses the same values.
SCALE, PROXY_SCALE = 0.5, 0.25
TINY = [
    Shape(B=1, S=130, H=2, Hk=1, Hp=1, Hpk=1, D=4, Dp=4, K=1),
    Shape(B=1, S=260, H=4, Hk=2, Hp=2, Hpk=1, D=2, Dp=2, K=2),
    Shape(B=2, S=140, H=2, Hk=1, Hp=2, Hpk=2, D=2, Dp=4, K=2, cu_seqlens=(0, 70, 140, 150, 280)),
]
MODES = ["sparse", "sparse_func", "warmup"]


@pytest.fixture(autouse=True)
def few_cpu_threads(monkeypatch):
    """gradcheck calls the ops thousands of times on problems of a few hundred tokens; the CPU
    backend starts its worker threads per call, which on a many-core machine costs more than the
    work itself."""
    monkeypatch.setenv("FLASH_MSA_NUM_THREADS", "2")


def attend(mode: str, shape: Shape, tensors: dict, indices, **kw):
    """(out, kl) of one public entry point: sparse_attention over fixed indices, flash_msa_func
    (its own selection) or flash_msa_warmup_func."""
    args = [tensors[n] for n in NAMES]
    common = dict(scale=SCALE, proxy_scale=PROXY_SCALE, cu_seqlens=shape.cu(),
                  **{"compute_kl": True, **kw})
    if mode == "sparse":
        return flash_msa.sparse_attention(*args, indices, **common)
    if mode == "sparse_func":
        return flash_msa.flash_msa_func(*args, shape.K * 128, **common)
    return flash_msa.flash_msa_warmup_func(*args, **common)


def problem(shape: Shape, seed: int):
    inputs = random_inputs(shape, torch.float64, seed=seed)
    tensors = {n: inputs[n] for n in NAMES}
    indices = flash_msa.select_blocks(tensors["qp"], tensors["kp"], shape.K,
                                      proxy_scale=PROXY_SCALE, cu_seqlens=shape.cu())
    return inputs, tensors, indices


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", TINY, ids=str)
def test_gradcheck_out_wrt_q_k_v(shape, mode):
    _, tensors, indices = problem(shape, seed=60)

    def out_of(q, k, v):
        return attend(mode, shape, dict(tensors, q=q, k=k, v=v), indices)[0]

    leaves = [tensors[n].clone().requires_grad_() for n in ("q", "k", "v")]
    # fast_mode checks a random projection of the Jacobian (one column and one row through the
    # backward); the first shape also gets the full Jacobian, entry by entry.
    assert torch.autograd.gradcheck(out_of, leaves, fast_mode=shape is not TINY[0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", TINY, ids=str)
def test_gradcheck_kl_wrt_q_proxy_k_proxy(shape, mode):
    # flash_msa_func selects inside: with K covering every block, the selection is every
    # visible block whatever the proxy, so kl is smooth in q_proxy, k_proxy.
    if mode == "sparse_func":
        shape = shape.with_(K=(shape.S + 127) // 128)
    _, tensors, indices = problem(shape, seed=61)

    def kl_of(qp, kp):
        # N * kl (N = B*Hp*S) keeps its gradients O(1) against gradcheck's absolute tolerance.
        return attend(mode, shape, dict(tensors, qp=qp, kp=kp), indices)[1] * shape.N

    leaves = [tensors[n].clone().requires_grad_() for n in ("qp", "kp")]
    assert torch.autograd.gradcheck(kl_of, leaves, fast_mode=shape.S > 130)


def test_gradcheck_sees_the_detached_teacher():
    """kl depends on q through the teacher, but its gradient w.r.t. q is 0 by design (the
    teacher is detached): gradcheck must see the difference, which shows that the checks above
    notice a missing gradient term."""
    shape = TINY[0]
    _, tensors, indices = problem(shape, seed=62)

    def kl_of(q):
        return attend("sparse", shape, dict(tensors, q=q), indices)[1] * shape.N

    leaf = tensors["q"].clone().requires_grad_()
    with pytest.raises(GradcheckError, match="Jacobian mismatch"):
        torch.autograd.gradcheck(kl_of, [leaf], fast_mode=True)


@pytest.mark.parametrize("mode", ["sparse", "warmup"])
@pytest.mark.parametrize("shape", TINY, ids=str)
def test_matches_the_float64_reference(shape, mode):
    """Values, statistics and gradients agree with the float64 reference to double rounding."""
    inputs, tensors, indices = problem(shape, seed=63)
    indices = indices if mode == "sparse" else None
    weight = 0.75 * shape.N
    leaves = {n: tensors[n].clone().requires_grad_() for n in NAMES}
    out, kl = attend(mode, shape, leaves, indices)
    ((out * inputs["dout"]).sum() + weight * kl).backward()
    _, _, lse, lse_proxy = flash_msa.ops.forward(
        *(tensors[n] for n in NAMES), indices, SCALE, PROXY_SCALE, shape.cu(), True, None)
    mask = ref.attended(indices, shape.B, shape.S, shape.cu())
    r_out, r_lse, r_lse_p, r_kl, r_grads = ref.msa_with_grads(
        tensors, mask, SCALE, PROXY_SCALE, inputs["dout"], weight, torch.float64)

    for t in (out, kl, lse, lse_proxy, *(leaves[n].grad for n in NAMES)):
        assert t.dtype == torch.float64
    for name, got, want in [("out", out, r_out), ("kl", kl, r_kl), ("lse", lse, r_lse),
                            ("lse_proxy", lse_proxy, r_lse_p),
                            *((f"d{n}", leaves[n].grad, r_grads[n]) for n in NAMES)]:
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)


def test_float64_agrees_with_float32():
    """The same problem in float32 (fp32 arithmetic) stays within fp32 rounding of float64."""
    shape = TINY[1]
    inputs, tensors, indices = problem(shape, seed=64)
    out64, kl64 = attend("sparse", shape, tensors, indices)
    out32, kl32 = attend("sparse", shape, {n: t.float() for n, t in tensors.items()}, indices)
    assert out32.dtype == kl32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), out64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(kl32.double(), kl64, rtol=1e-5, atol=1e-7)


def test_float64_on_another_device_is_refused_clearly():
    """float64 runs on the CPU backend only; the Python layer says so before any kernel runs
    (the meta device stands in for CUDA here)."""
    shape = TINY[0]
    _, tensors, indices = problem(shape, seed=65)
    moved = {n: t.to("meta") for n, t in tensors.items()}
    with pytest.raises(ValueError, match="q_proxy: float64 runs on the CPU backend only"):
        attend("sparse_func", shape, moved, None)
