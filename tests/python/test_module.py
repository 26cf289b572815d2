"""MSAAttention: gradient routing (the paper's detach), RoPE, warmup switch, varlen."""

import torch

import flash_msa
import reference as ref

MAIN = ("q_proj", "k_proj", "v_proj", "o_proj")
PROXY = ("q_proxy_proj", "k_proxy_proj")


def make(warmup=False, dtype=torch.float32, seed=50, compute_kl=True):
    torch.manual_seed(seed)
    model = flash_msa.MSAAttention(48, num_heads=4, num_kv_heads=2, head_dim=16,
                                   num_proxy_heads=2, num_proxy_kv_heads=1, proxy_head_dim=8,
                                   top_k=128, warmup=warmup, compute_kl=compute_kl, dtype=dtype)
    hidden = torch.randn(2, 300, 48, dtype=dtype, requires_grad=True)
    return model, hidden


def grads(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_kl_trains_only_the_proxy_and_main_loss_only_the_main_branch():
    model, hidden = make()
    out, kl = model(hidden)
    assert out.shape == hidden.shape and kl.dim() == 0 and kl > 0
    out.square().mean().backward(retain_graph=True)
    main = grads(model)
    hidden_grad = hidden.grad.clone()
    for n in PROXY:
        assert main[f"{n}.weight"] is None, n
    model.zero_grad()
    hidden.grad = None
    kl.backward()
    proxy = grads(model)
    for n in MAIN:
        assert proxy[f"{n}.weight"] is None, n
    for n in PROXY:
        assert proxy[f"{n}.weight"].abs().max() > 0, n
    assert hidden.grad is None  # the index projections read hidden.detach()
    assert hidden_grad.abs().max() > 0


def test_module_matches_functional_reference():
    """The module is projections + RoPE + flash_msa_func + output projection."""
    model, hidden = make()
    out, kl = model(hidden)
    x = hidden.detach()

    def heads(proj, n):
        return proj(x).unflatten(-1, (n, -1)).transpose(1, 2)

    q, k, v = heads(model.q_proj, 4), heads(model.k_proj, 2), heads(model.v_proj, 2)
    qp, kp = heads(model.q_proxy_proj, 2), heads(model.k_proxy_proj, 1)
    q, k = flash_msa.apply_rope(q, 10000.0), flash_msa.apply_rope(k, 10000.0)
    qp, kp = flash_msa.apply_rope(qp, 10000.0), flash_msa.apply_rope(kp, 10000.0)
    indices = flash_msa.select_blocks(qp, kp, 1)
    mask = ref.attended(indices, 2, 300)
    r_out, _, _, r_kl = ref.msa(*(t.double() for t in (qp, kp, q, k, v)), mask, 16 ** -0.5, 8 ** -0.5)
    r_out = model.o_proj.double()(r_out)
    torch.testing.assert_close(out.double(), r_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(kl.double(), r_kl, atol=1e-6, rtol=1e-4)


def test_the_module_keeps_the_kl_value_of_its_last_backward():
    """By default the returned kl is 0 in value and the backward writes the value into the
    kl_value buffer: that of compute_kl=True; the buffer keeps its statistics dtype."""
    exact, hidden = make(compute_kl=True)
    model, _ = make(compute_kl=False)
    model.load_state_dict(exact.state_dict())
    assert torch.isnan(model.kl_value)
    _, want = exact(hidden)
    out, kl = model(hidden)
    assert kl.item() == 0.0 and torch.isnan(model.kl_value)
    (out.square().mean() + kl).backward()
    torch.testing.assert_close(model.kl_value, want.detach(), rtol=1e-5, atol=1e-6)
    assert "kl_value" not in model.state_dict()
    model.to(torch.bfloat16)
    assert model.kl_value.dtype == torch.float32 and model.q_proj.weight.dtype == torch.bfloat16
    model.double()
    assert model.kl_value.dtype == torch.float64


def test_warmup_switches_to_dense_attention():
    model, hidden = make()
    sparse_out, _ = model(hidden)
    model.warmup = True
    dense_out, dense_kl = model(hidden)
    # With top_k = 128 the sparse layer sees only the own block; dense attention sees all keys.
    assert not torch.allclose(sparse_out, dense_out)
    assert torch.isfinite(dense_kl)


def test_varlen_module():
    model, hidden = make()
    cu = torch.tensor([0, 120, 300, 450, 600], dtype=torch.int32)
    out, kl = model(hidden, cu)
    (out.square().mean() + kl).backward()
    # The first document of row 1 (tokens 0..149) sees only itself: running it alone agrees.
    alone, _ = model(hidden[1:, :150])
    torch.testing.assert_close(out[1, :150], alone[0], atol=1e-5, rtol=1e-5)
    # Dense attention over document 2 of row 0 (tokens 120..299, RoPE positions from 120)
    # equals the document run alone (positions from 0): RoPE scores are relative.
    model.warmup = True
    dense, _ = model(hidden, cu)
    alone, _ = model(hidden[:1, 120:300])
    torch.testing.assert_close(dense[0, 120:300], alone[0], atol=1e-5, rtol=1e-4)


def test_rope_is_relative_and_neox_style():
    g = torch.Generator().manual_seed(51)
    q = torch.randn(1, 1, 64, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 64, 8, generator=g, dtype=torch.float64)
    rq, rk = flash_msa.apply_rope(q, 10000.0), flash_msa.apply_rope(k, 10000.0)
    torch.testing.assert_close(rq[..., 0, :], q[..., 0, :])  # position 0 is not rotated
    # <R_i q, R_j k> depends on i - j only: shift both positions by 7.
    shifted_q = flash_msa.apply_rope(torch.cat((q[..., :7, :] * 0, q), 2), 10000.0)[..., 7:, :]
    shifted_k = flash_msa.apply_rope(torch.cat((k[..., :7, :] * 0, k), 2), 10000.0)[..., 7:, :]
    torch.testing.assert_close(rq @ rk.transpose(-1, -2), shifted_q @ shifted_k.transpose(-1, -2))
    # NeoX pairs channel c with c + d/2: at position 1, channel 0 = (1, 0) rotates by 1 radian.
    x = torch.zeros(1, 1, 2, 8, dtype=torch.float64)
    x[..., 1, 0] = 1.0
    y = flash_msa.apply_rope(x, 10000.0)[0, 0, 1]
    one = torch.tensor(1.0, dtype=torch.float64)
    torch.testing.assert_close(y[[0, 4]], torch.stack((one.cos(), one.sin())))
    assert torch.count_nonzero(y) == 2
