"""The backward against finite differences of the float64 reference forward.

Selection is not differentiable, so the indices are fixed inputs. The teacher of the KL is
detached (SPEC section 3), so the KL has no gradient w.r.t. q, k, v by design while its value
does depend on them: the two branches are checked separately, out w.r.t. q, k, v with the proxy
fixed, and N * kl (N = B*Hp*S, so that its gradients are O(1)) w.r.t. q_proxy, k_proxy.

For every input x of a branch, the analytic gradient g = J^T w of the package (fp32, random
cotangent w) is projected on directions u: the normalised g itself (which exposes any error in
its length) and two random unit vectors (errors in its direction). Each projection <g, u> must
match the central difference of <w, F(x + eps u)> where F is the float64 reference over the
same indices, to within RTOL * |g|. fp32 accumulation keeps the true error near 1e-7 of |g|,
float64 differences near 1e-9; the last test shows that a 10% wrong gradient fails the check.
"""

import pytest
import torch

import flash_msa
import reference as ref
from conftest import NAMES, Shape, random_inputs

TINY = [
    Shape(B=1, S=130, H=2, Hk=1, Hp=1, Hpk=1, D=8, Dp=8, K=1),
    Shape(B=1, S=260, H=4, Hk=2, Hp=2, Hpk=1, D=8, Dp=4, K=2),
    Shape(B=2, S=140, H=2, Hk=1, Hp=2, Hpk=2, D=4, Dp=8, K=2, cu_seqlens=(0, 70, 140, 150, 280)),
]
RTOL = 1e-4
EPS = 1e-5  # float64 central differences


class WrongGradient(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by 1.1: a deliberately wrong gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.1


def branch_errors(shape: Shape, seed: int, mode: str, branch: str, wrong=False) -> list:
    """|<g, u> - finite difference| / |g| for every input of the branch and direction u."""
    inputs = random_inputs(shape, torch.float32, seed=seed)
    tensors = {n: inputs[n] for n in NAMES}
    cu = shape.cu()
    indices = None
    if mode == "sparse":
        indices = flash_msa.select_blocks(tensors["qp"], tensors["kp"], shape.K, cu_seqlens=cu)
    mask = ref.attended(indices, shape.B, shape.S, cu)
    scale, proxy_scale = shape.D ** -0.5, shape.Dp ** -0.5
    names = ("q", "k", "v") if branch == "main" else ("qp", "kp")
    g = torch.Generator().manual_seed(seed + 1)
    cotangent = torch.randn(shape.B, shape.S, shape.H * shape.D, generator=g, dtype=torch.float64)

    def reduce(out, kl):  # the scalar whose gradient is checked
        return (out.double() * cotangent).sum() if branch == "main" else kl.double() * shape.N

    leaves = {n: tensors[n].clone().requires_grad_() for n in names}
    args = {**tensors, **leaves}
    if wrong:
        first = names[0]
        args[first] = WrongGradient.apply(args[first])
    attend_args = [args[n] for n in NAMES]
    if indices is None:
        out, kl = flash_msa.flash_msa_warmup_func(*attend_args, cu_seqlens=cu, compute_kl=True)
    else:
        out, kl = flash_msa.sparse_attention(*attend_args, indices, cu_seqlens=cu, compute_kl=True)
    grads = torch.autograd.grad(reduce(out, kl), [leaves[n] for n in names])

    base = {n: tensors[n].double() for n in NAMES}

    def reference(name, delta):
        x = dict(base, **{name: base[name] + delta})
        out, _, _, kl = ref.msa(*(x[n] for n in NAMES), mask, scale, proxy_scale)
        return reduce(out, kl).item()

    errors = []
    for name, grad in zip(names, grads):
        grad = grad.double()
        norm = grad.norm().item()
        assert norm > 0, f"{name}: zero gradient"
        directions = [grad / norm]
        for _ in range(2):
            u = torch.randn(grad.shape, generator=g, dtype=torch.float64)
            directions.append(u / u.norm())
        for u in directions:
            numeric = (reference(name, EPS * u) - reference(name, -EPS * u)) / (2 * EPS)
            errors.append(abs((grad * u).sum().item() - numeric) / norm)
    return errors


@pytest.mark.parametrize("branch", ["main", "proxy"])
@pytest.mark.parametrize("mode", ["sparse", "warmup"])
@pytest.mark.parametrize("shape", TINY, ids=str)
def test_gradient_matches_finite_differences(shape, mode, branch):
    errors = branch_errors(shape, 20, mode, branch)
    assert max(errors) < RTOL, errors


@pytest.mark.parametrize("branch", ["main", "proxy"])
def test_check_catches_a_wrong_gradient(branch):
    """The same check on a 10% wrong gradient of the first input of each branch must fail."""
    shape = TINY[1]
    assert max(branch_errors(shape, 21, "sparse", branch)) < RTOL
    errors = branch_errors(shape, 21, "sparse", branch, wrong=True)
    assert max(errors) > 10 * RTOL, errors
