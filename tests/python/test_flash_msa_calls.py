"""Flash-MSA's own calls run unchanged: the scale as the seventh positional argument, the warmup
function under its three names, and a small model written as a Flash-MSA user writes it
(projections, RoPE on pairs of even and odd channels, the positional call) against the eager
reference, forward and backward, on the CPU and (where there is one) on the GPU."""

import pytest
import torch
from torch import nn

import flash_msa
import reference as ref
from conftest import check_rule
from test_select import check_selection

HIDDEN = 96
HEAD_DIM = 128  # Flash-MSA's only head dim, for the main and the proxy heads
TOP_K = 256
# Flash-MSA's limits: S a multiple of 128, Hp >= Hk with Hk | Hp.
MODEL_SHAPES = [dict(batch=1, seqlen=384, heads=4, kv_heads=2, proxy_heads=2, proxy_kv_heads=1),
                dict(batch=2, seqlen=256, heads=8, kv_heads=2, proxy_heads=4, proxy_kv_heads=2)]
WARMUP_NAMES = ("flash_msa_warmup_func", "flash_msa_func_warmup", "sparse_attention_warmup")
CUDA = torch.cuda.is_available() and flash_msa.built_with_cuda()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA"))]


def rope_pairs(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of x (B, heads, S, d): channels 2c and 2c+1 rotate together at the
    frequency base**(-2c/d), angles in fp32 at least."""
    seqlen, dim = x.shape[2], x.shape[3]
    compute = torch.promote_types(x.dtype, torch.float32)
    inv_freq = base ** (-torch.arange(0, dim, 2, device=x.device, dtype=compute) / dim)
    angles = torch.arange(seqlen, device=x.device, dtype=compute)[:, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    even, odd = x.to(compute)[..., 0::2], x.to(compute)[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


class FlashMSAStyleModel(nn.Module):
    """One attention layer as Flash-MSA's users write it: every projection reads the hidden
    states, RoPE on the four attention inputs, and ``attend(q_proxy, k_proxy, q, k, v)``."""

    def __init__(self, heads, kv_heads, proxy_heads, proxy_kv_heads, **_):
        super().__init__()
        self.counts = dict(q=heads, k=kv_heads, v=kv_heads, q_proxy=proxy_heads,
                           k_proxy=proxy_kv_heads)
        self.proj = nn.ModuleDict({n: nn.Linear(HIDDEN, c * HEAD_DIM, bias=False)
                                   for n, c in self.counts.items()})
        self.out = nn.Linear(heads * HEAD_DIM, HIDDEN, bias=False)

    def forward(self, hidden, attend):
        x = {n: self.proj[n](hidden).unflatten(-1, (c, HEAD_DIM)).transpose(1, 2)
             for n, c in self.counts.items()}
        for n in ("q", "k", "q_proxy", "k_proxy"):
            x[n] = rope_pairs(x[n])
        out, kl = attend(x["q_proxy"], x["k_proxy"], x["q"], x["k"], x["v"])
        return self.out(out), kl, x


def eager(indices, batch, seqlen):
    """The reference attention over ``indices`` (None: warmup), in the inputs' dtype."""
    def attend(qp, kp, q, k, v):
        mask = ref.attended(indices, batch, seqlen)
        out, _, _, kl = ref.msa(qp, kp, q, k, v, mask, HEAD_DIM ** -0.5, HEAD_DIM ** -0.5)
        return out, kl
    return attend


def run(model, hidden, dout, attend, kl_weight=0.5):
    """out, kl and the gradients of sum(out * dout) + kl_weight * kl w.r.t. every weight and
    the hidden states, in the model's dtype, on the model's device."""
    hidden = hidden.detach().clone().requires_grad_()
    model.zero_grad()
    out, kl, x = model(hidden, attend)
    ((out * dout).sum() + kl_weight * kl).backward()
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
    grads["hidden"] = hidden.grad.detach().cpu()
    return out.detach().cpu(), kl.detach().cpu(), grads, x


@pytest.mark.parametrize("warmup", [False, True], ids=["sparse", "warmup"])
@pytest.mark.parametrize("shape", MODEL_SHAPES, ids=lambda s: "B{batch}S{seqlen}H{heads}".format(**s))
@pytest.mark.parametrize("device", DEVICES)
def test_a_flash_msa_model_matches_the_eager_reference(device, shape, warmup):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(7)
    master = FlashMSAStyleModel(**shape).double()
    hidden = torch.randn(shape["batch"], shape["seqlen"], HIDDEN, dtype=torch.float64)
    dout = torch.randn(shape["batch"], shape["seqlen"], HIDDEN, dtype=torch.float64)

    def call(*tensors):  # Flash-MSA's documented call, scale seventh and positional
        if warmup:
            return flash_msa.flash_msa_warmup_func(*tensors, TOP_K, HEAD_DIM ** -0.5)
        return flash_msa.flash_msa_func(*tensors, TOP_K, HEAD_DIM ** -0.5)

    model = FlashMSAStyleModel(**shape).to(device=device, dtype=dtype)
    model.load_state_dict(master.state_dict())
    low = dict(dtype=dtype, device=device)
    out, kl, grads, x = run(model, hidden.to(**low), dout.to(**low), call)

    indices = None
    if not warmup:  # the reference attends where the op's own selection attends
        indices = flash_msa.select_blocks(x["q_proxy"], x["k_proxy"], TOP_K // 128,
                                          proxy_scale=HEAD_DIM ** -0.5)
        scores = ref.block_scores(x["q_proxy"].detach().cpu(), x["k_proxy"].detach().cpu(),
                                  HEAD_DIM ** -0.5)
        check_selection(indices, scores, TOP_K // 128, tol=1e-3 if device == "cpu" else 0.1)
    attend = eager(indices, shape["batch"], shape["seqlen"])
    # The baseline: the same eager model in the input dtype (SPEC section 6).
    base = FlashMSAStyleModel(**shape).to(dtype)
    base.load_state_dict(master.state_dict())
    b_out, b_kl, b_grads, _ = run(base, hidden.to(dtype), dout.to(dtype), attend)
    r_out, r_kl, r_grads, _ = run(master, hidden, dout, attend)

    check_rule("out", out, r_out, b_out, atol=1e-5)
    assert kl.item() == 0.0  # Flash-MSA's placeholder: the value is 0, the gradient is the KL's
    for name in r_grads:
        check_rule(f"grad {name}", grads[name], r_grads[name], b_grads[name], atol=1e-5)
    assert all(g.abs().max() > 0 for g in grads.values())


def small_inputs(seed=3):
    g = torch.Generator().manual_seed(seed)
    dims = dict(qp=(1, 2, 256, 32), kp=(1, 1, 256, 32), q=(1, 4, 256, 32), k=(1, 2, 256, 32),
                v=(1, 2, 256, 32))
    return [torch.randn(d, generator=g) for d in dims.values()]


def test_top_k_and_scale_positional_or_by_keyword_give_the_same_bits():
    inputs = small_inputs()
    scale = 0.21
    for function in (flash_msa.flash_msa_func, *(getattr(flash_msa, n) for n in WARMUP_NAMES)):
        forms = [function(*inputs, 128, scale), function(*inputs, 128, scale=scale),
                 function(*inputs, top_k=128, scale=scale)]
        for out, kl in forms[1:]:
            assert torch.equal(out, forms[0][0]) and torch.equal(kl, forms[0][1])
    # The single scale is the proxy's too (Flash-MSA's one sigma), as with scale=.
    out, _ = flash_msa.flash_msa_func(*inputs, 128, scale, compute_kl=True)
    want, _ = flash_msa.flash_msa_func(*inputs, 128, scale=scale, proxy_scale=scale,
                                       compute_kl=True)
    assert torch.equal(out, want)


def test_the_warmup_function_has_flash_msa_s_three_names():
    assert all(getattr(flash_msa, n) is flash_msa.flash_msa_warmup_func for n in WARMUP_NAMES)
    assert set(WARMUP_NAMES) <= set(flash_msa.__all__)


def test_options_after_the_scale_stay_keyword_only():
    inputs = small_inputs()
    with pytest.raises(TypeError):
        flash_msa.flash_msa_func(*inputs, 128, 0.2, None)
    with pytest.raises(TypeError):
        flash_msa.flash_msa_warmup_func(*inputs, 128, 0.2, None)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), "0.1"])
def test_a_bad_positional_scale_names_the_argument(scale):
    with pytest.raises(ValueError, match="flash_msa: scale: expected"):
        flash_msa.flash_msa_func(*small_inputs(), 128, scale)
