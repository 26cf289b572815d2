"""The custom ops under torch.library.opcheck and torch.compile(fullgraph=True)."""

import pytest
import torch

import flash_msa
from conftest import NAMES, Shape, random_inputs

SHAPE = Shape(B=1, S=200, H=4, Hk=2, Hp=2, Hpk=1, D=16, Dp=8, K=2, cu_seqlens=(0, 90, 200))


@pytest.mark.parametrize("mode", ["sparse", "warmup"])
def test_opcheck(mode):
    """Schema, fake (meta) implementations and the autograd registration, via torch.library."""
    inputs = random_inputs(SHAPE, torch.bfloat16, seed=30)
    cu = SHAPE.cu()
    proxy_scale = SHAPE.Dp ** -0.5
    select_args = (inputs["qp"], inputs["kp"], SHAPE.K, proxy_scale, cu)
    indices = None
    if mode == "sparse":
        torch.library.opcheck(flash_msa.ops.select, select_args)
        indices = flash_msa.ops.select(*select_args)
    tensors = [inputs[n].requires_grad_() for n in NAMES]
    fwd_args = (*tensors, indices, SHAPE.D ** -0.5, proxy_scale, cu, True, None)
    torch.library.opcheck(flash_msa.ops.forward, fwd_args)
    out, kl, lse, lse_proxy = flash_msa.ops.forward(*fwd_args)
    bwd_args = (inputs["dout"], torch.tensor(0.5), *(t.detach() for t in tensors), out.detach(),
                lse, lse_proxy, indices, SHAPE.D ** -0.5, proxy_scale, cu)
    torch.library.opcheck(flash_msa.ops.backward, (*bwd_args, None))
    torch.library.opcheck(flash_msa.ops.backward, (*bwd_args, torch.zeros(())))


def train_step(model, hidden, cu):
    out, kl = model(hidden, cu)
    loss = out.float().square().mean() + 0.5 * kl
    loss.backward()
    return out, kl


@pytest.mark.parametrize("warmup", [False, True])
def test_compiled_module_matches_eager(warmup):
    torch.manual_seed(31)
    cu = SHAPE.cu()
    model = flash_msa.MSAAttention(64, SHAPE.H, SHAPE.Hk, SHAPE.D, SHAPE.Hp, SHAPE.Hpk, SHAPE.Dp,
                                   top_k=SHAPE.K * 128, warmup=warmup, dtype=torch.bfloat16)
    hidden = torch.randn(SHAPE.B, SHAPE.S, 64, dtype=torch.bfloat16)

    eager_hidden = hidden.clone().requires_grad_()
    eager_out, eager_kl = train_step(model, eager_hidden, cu)
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    eager_kl_value = model.kl_value.clone()
    model.zero_grad()
    model.kl_value.fill_(float("nan"))

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    compiled_hidden = hidden.clone().requires_grad_()
    out, kl = train_step(compiled, compiled_hidden, cu)

    # Inductor may fuse the projections and RoPE differently from eager: bf16 rounding apart,
    # the results must agree.
    torch.testing.assert_close(out, eager_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(kl, eager_kl, atol=1e-3, rtol=1e-2)
    # The KL value the backward writes into the module's buffer, compiled as eager.
    assert eager_kl_value > 0
    torch.testing.assert_close(model.kl_value, eager_kl_value, atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(compiled_hidden.grad, eager_hidden.grad, atol=2e-2, rtol=5e-2)
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, n
        torch.testing.assert_close(p.grad, eager_grads[n], atol=2e-2, rtol=5e-2, msg=n)


def test_switching_phases_compiles_each_phase_once():
    """set_warmup on a compiled model: the first step of each phase compiles its graph, later
    switches reuse them; the compiled steps match eager in both phases."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(32)
    layers = torch.nn.ModuleList(
        flash_msa.MSAAttention(64, SHAPE.H, SHAPE.Hk, SHAPE.D, SHAPE.Hp, SHAPE.Hpk, SHAPE.Dp,
                               top_k=SHAPE.K * 128, dtype=torch.bfloat16) for _ in range(2))

    def step(hidden):
        kl_sum = 0
        for layer in layers:
            hidden, kl = layer(hidden)
            kl_sum = kl_sum + kl
        return hidden, kl_sum

    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    hidden = torch.randn(SHAPE.B, SHAPE.S, 64, dtype=torch.bfloat16)
    wrapper = torch.nn.Sequential(*layers)
    for warmup in (True, False, True, False):
        assert flash_msa.set_warmup(wrapper, warmup) == 2
        out, kl = compiled(hidden)
        (out.float().square().mean() + kl).backward()
        eager, _ = step(hidden)
        torch.testing.assert_close(out, eager, atol=2e-2, rtol=2e-2)
    assert counter.frame_count == 2


def test_set_warmup_checks_its_arguments():
    with pytest.raises(ValueError, match="no MSAAttention"):
        flash_msa.set_warmup(torch.nn.Linear(2, 2), True)
    layer = flash_msa.MSAAttention(64, 2, 1, 16, top_k=128)
    with pytest.raises(ValueError, match="expected a bool"):
        flash_msa.set_warmup(layer, 1)
    assert flash_msa.set_warmup(layer, True) == 1 and layer.warmup
