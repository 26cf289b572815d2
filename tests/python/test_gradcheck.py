"""torch.autograd.gradcheck of the backward against finite differences of the forward.

The C++ core computes in fp32 at most, so the check runs on fp32 inputs with a large step
(eps 1e-3, tolerances 1e-2). Selection is not differentiable, so the indices are fixed inputs.
The teacher of the KL is detached (SPEC section 3), so the KL has no gradient w.r.t. q, k, v
by design while its value does depend on them: the two branches are checked separately, out
w.r.t. q, k, v with the proxy fixed, and the KL w.r.t. q_proxy, k_proxy with q, k, v fixed.
The KL is multiplied by N = B*Hp*S so that its gradients are O(1): at their natural size
(O(1/N)) the absolute tolerance would hide any error. The last test shows that the check
catches a 10% error in a gradient of either branch.
"""

import pytest
import torch

import flash_msa
from conftest import NAMES, Shape, random_inputs

TINY = [
    Shape(B=1, S=130, H=2, Hk=1, Hp=1, Hpk=1, D=8, Dp=8, K=1),
    Shape(B=1, S=260, H=4, Hk=2, Hp=2, Hpk=1, D=8, Dp=4, K=2),
    Shape(B=2, S=140, H=2, Hk=1, Hp=2, Hpk=2, D=4, Dp=8, K=2, cu_seqlens=(0, 70, 140, 150, 280)),
]
GRADCHECK = dict(eps=1e-3, atol=1e-2, rtol=1e-2, fast_mode=True, nondet_tol=1e-5)


def inputs_for(shape: Shape, seed: int):
    inputs = random_inputs(shape, torch.float32, seed=seed)
    return [inputs[n] for n in NAMES]


def branches(shape: Shape, tensors, indices, deterministic=False):
    """(main, proxy): out as a function of (q, k, v), N * kl as a function of (qp, kp)."""
    qp, kp, q, k, v = tensors
    attend = flash_msa.sparse_attention if indices is not None else flash_msa.flash_msa_warmup_func
    extra = (indices,) if indices is not None else ()

    def run(qp, kp, q, k, v):
        return attend(qp, kp, q, k, v, *extra, cu_seqlens=shape.cu(), deterministic=deterministic)

    def main(q, k, v):
        return run(qp, kp, q, k, v)[0]

    def proxy(qp, kp):
        return run(qp, kp, q, k, v)[1] * shape.N

    return (main, [t.clone().requires_grad_() for t in (q, k, v)]), \
        (proxy, [t.clone().requires_grad_() for t in (qp, kp)])


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("mode", ["sparse", "warmup"])
@pytest.mark.parametrize("shape", TINY, ids=str)
def test_gradcheck(shape, mode, deterministic):
    tensors = inputs_for(shape, seed=20)
    indices = None
    if mode == "sparse":
        indices = flash_msa.select_blocks(tensors[0], tensors[1], shape.K, cu_seqlens=shape.cu())
    for f, args in branches(shape, tensors, indices, deterministic):
        assert torch.autograd.gradcheck(f, args, **GRADCHECK)


class WrongGradient(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by 1.1: a deliberately wrong gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.1


def test_gradcheck_catches_a_wrong_gradient():
    shape = TINY[1]
    tensors = inputs_for(shape, seed=21)
    indices = flash_msa.select_blocks(tensors[0], tensors[1], shape.K)
    for f, args in branches(shape, tensors, indices):
        def wrong(first, *rest):
            return f(WrongGradient.apply(first), *rest)
        assert torch.autograd.gradcheck(f, args, **GRADCHECK)
        assert not torch.autograd.gradcheck(wrong, args, raise_exception=False, **GRADCHECK)
