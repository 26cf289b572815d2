"""Every bad input is rejected with a ValueError that names the argument."""

import re

import numpy as np
import pytest
import torch

import flash_msa
from conftest import NAMES, Shape, random_inputs

SHAPE = Shape(B=2, S=256, H=4, Hk=2, Hp=2, Hpk=1, D=16, Dp=8, K=2)


@pytest.fixture
def inputs():
    return random_inputs(SHAPE, torch.bfloat16, seed=40)


def call(inputs, top_k=256, **kw):
    args = [kw.pop(n, inputs[n]) for n in NAMES]
    return flash_msa.flash_msa_func(*args, top_k, **kw)


def raises(match):
    return pytest.raises(ValueError, match=re.escape(match))


BAD_TENSORS = [
    ("q", lambda t: t[0], "q: expected a 4-D tensor"),
    ("k", lambda t: t.float(), "k: expected dtype torch.bfloat16"),
    ("q_all", lambda t: t.int(),
     "expected bfloat16, float16, float32 or float64 (CPU only), got torch.int32"),
    ("q_all", lambda t: t.double().to("meta"), "q_proxy: float64 runs on the CPU backend only"),
    ("q_all", lambda t: t.float().to("meta"), "q_proxy: float32 runs on the CPU backend only"),
    ("q", lambda t: t[..., :0], "q: expected head_dim >= 1, got shape (2, 4, 256, 0)"),
    ("q_all", lambda t: t[..., :0], "q_proxy: expected proxy head_dim >= 1"),
    ("q_all", lambda t: t[:, :, :0], "q_proxy: expected seqlen >= 1"),
    ("q_all", lambda t: t[:0], "q_proxy: expected batch >= 1"),
    ("k", lambda t: t[:, :0], "k: expected heads >= 1"),
    ("v", lambda t: t.to("meta"), "v: expected device cpu"),
    ("q", lambda t: t[:1], "q: expected batch 2 and seqlen 256"),
    ("kp", lambda t: t[:, :, :100], "k_proxy: expected batch 2 and seqlen 256"),
    ("v", lambda t: t[:, :1], "v: expected the shape of k"),
    ("k", lambda t: t[..., :8], "v: expected the shape of k"),
    ("kp", lambda t: t[..., :4], "k_proxy: expected proxy head_dim 8"),
    ("q", lambda t: t[:, :3], "heads (3) must be a multiple of kv heads (2)"),
    ("kp", lambda t: t.repeat(1, 4, 1, 1), "proxy heads (2) must be a multiple of proxy kv heads (4)"),
    ("qp", lambda t: t.repeat(1, 4, 1, 1), "heads (4) must be a multiple of proxy heads (8)"),
    ("k", lambda t: t.tolist(), "k: expected a torch.Tensor, got list"),
]


@pytest.mark.parametrize("name,bad,message", BAD_TENSORS, ids=[m for _, _, m in BAD_TENSORS])
def test_bad_tensor(inputs, name, bad, message):
    kw = {n: bad(inputs[n]) for n in NAMES} if name == "q_all" else {name: bad(inputs[name])}
    with raises(message):
        call(inputs, **kw)


@pytest.mark.parametrize("top_k", [0, 100, 129, -128, 128.0, True, None, np.float64(256.0),
                                   torch.tensor(256.0), torch.tensor([256, 256]),
                                   torch.tensor(True), np.True_, "256"], ids=repr)
def test_bad_top_k(inputs, top_k):
    with raises("top_k: expected a positive multiple of 128 tokens"):
        call(inputs, top_k=top_k)


@pytest.mark.parametrize("top_k", [np.int64(256), np.int32(256), torch.tensor(256),
                                   torch.tensor(256, dtype=torch.int32)], ids=repr)
def test_integral_top_k(inputs, top_k):
    """Any integral type counts, as a plain int does."""
    out, kl = call(inputs, top_k=top_k)
    want_out, want_kl = call(inputs, top_k=256)
    assert torch.equal(out, want_out) and torch.equal(kl, want_kl)
    indices = flash_msa.select_blocks(inputs["qp"], inputs["kp"], top_k // 128)
    assert indices.shape[-1] == 2


@pytest.mark.parametrize("top_k_blocks", [0, -1, 1.5, "2", True, torch.tensor(2.0)], ids=repr)
def test_bad_top_k_blocks(inputs, top_k_blocks):
    with raises("top_k_blocks: expected an int >= 1"):
        flash_msa.select_blocks(inputs["qp"], inputs["kp"], top_k_blocks)


def test_arguments_after_the_selection_are_keyword_only(inputs):
    """No positional value can land in the wrong one of scale, proxy_scale, cu_seqlens. Only
    Flash-MSA's two functions take the scale positionally, seventh, as Flash-MSA does."""
    tensors = [inputs[n] for n in NAMES]
    indices = good_indices(inputs)
    with pytest.raises(TypeError):
        flash_msa.flash_msa_func(*tensors, 256, 0.25, 0.25)
    with pytest.raises(TypeError):
        flash_msa.flash_msa_warmup_func(*tensors, None, 0.25, 0.25)
    with pytest.raises(TypeError):
        flash_msa.sparse_attention(*tensors, indices, 0.25)
    with pytest.raises(TypeError):
        flash_msa.select_blocks(inputs["qp"], inputs["kp"], 2, 0.25)
    with pytest.raises(TypeError):
        flash_msa.MSAAttention(32, 8, 2, 16, 2, 1, 16, 256)


def test_top_k_counts_tokens_and_top_k_blocks_counts_blocks(inputs):
    """top_k = 2 (blocks, by mistake) is refused with the unit spelled out."""
    with raises("top_k: expected a positive multiple of 128 tokens (an integer; top_k // 128 "
                "blocks are selected), got 2"):
        call(inputs, top_k=2)


@pytest.mark.parametrize("arg", ["scale", "proxy_scale"])
@pytest.mark.parametrize("value", [0.0, -0.1, float("nan"), float("inf")])
def test_bad_scale(inputs, arg, value):
    with raises(f"{arg}: expected a finite positive number"):
        call(inputs, **{arg: value})


def test_bad_scale_type(inputs):
    with raises("scale: expected a float or None, got str"):
        call(inputs, scale="0.1")


BAD_CU = [
    (torch.tensor([0, 256, 512]), "cu_seqlens: expected a 1-D int32 tensor"),
    (torch.tensor([[0, 256, 512]], dtype=torch.int32), "cu_seqlens: expected a 1-D int32 tensor"),
    (torch.tensor([0], dtype=torch.int32), "cu_seqlens: expected a 1-D int32 tensor"),
    (torch.tensor([0, 256, 512], dtype=torch.int32, device="meta"), "cu_seqlens: expected device cpu"),
    ([0, 256, 512], "cu_seqlens: expected a torch.Tensor or None, got list"),
    # Values only the C++ core checks (on the CPU):
    (torch.tensor([0, 256, 500], dtype=torch.int32), "cu_seqlens: expected cu_seqlens[num_docs] == batch * seqlen (512)"),
    (torch.tensor([0, 200, 512], dtype=torch.int32), "cu_seqlens: expected every multiple of seqlen"),
    (torch.tensor([0, 100, 50, 256, 512], dtype=torch.int32), "cu_seqlens: expected non-decreasing offsets"),
    (torch.tensor([5, 256, 512], dtype=torch.int32), "cu_seqlens: expected cu_seqlens[0] == 0"),
]


@pytest.mark.parametrize("cu,message", BAD_CU, ids=[m for _, m in BAD_CU])
def test_bad_cu_seqlens(inputs, cu, message):
    with raises(message):
        call(inputs, cu_seqlens=cu)


def good_indices(inputs):
    return flash_msa.select_blocks(inputs["qp"], inputs["kp"], SHAPE.K)


BAD_INDICES = [
    (lambda i: i.long(), "indices: expected int32 of shape (2, 2, 256, K)"),
    (lambda i: i[:, :1], "indices: expected int32 of shape (2, 2, 256, K)"),
    (lambda i: i[..., :0], "indices: expected int32 of shape (2, 2, 256, K)"),
    (lambda i: i.to("meta"), "indices: expected device cpu"),
    (lambda i: i.flip(-1).contiguous(), "flash_msa: indices: expected"),  # C++ value check
    (lambda i: torch.where(i == (torch.arange(256) // 128)[:, None], -1, i).sort(-1, descending=True).values,
     "flash_msa: indices: expected"),  # own block missing
    (lambda i: i + 5, "flash_msa: indices: expected a block in"),
]


@pytest.mark.parametrize("bad,message", BAD_INDICES)
def test_bad_indices(inputs, bad, message):
    indices = bad(good_indices(inputs))
    with raises(message):
        flash_msa.sparse_attention(*(inputs[n] for n in NAMES), indices)


def test_errors_reach_the_decomposed_api_and_warmup(inputs):
    with raises("q: expected a 4-D tensor"):
        flash_msa.flash_msa_warmup_func(inputs["qp"], inputs["kp"], inputs["q"][0], inputs["k"],
                                        inputs["v"])
    with raises("q_proxy: expected a 4-D tensor"):
        flash_msa.select_blocks(inputs["qp"][0], inputs["kp"], 1)


def test_cpp_core_errors_surface_as_value_error(inputs):
    """A direct call of the extension skips the Python checks: the C++ message still arrives."""
    with raises("flash_msa: "):
        flash_msa.ops.select(inputs["qp"], inputs["kp"], 0, 1.0, None)
    with raises("flash_msa: scale: expected a finite value > 0"):
        flash_msa.ops.forward(*(inputs[n] for n in NAMES), None, -1.0, 1.0, None, True, None)


@pytest.mark.parametrize("value", ["abc", "0", "-2", "4x", "1.5", " ", "99999999999999999999"])
def test_bad_thread_count_variable(inputs, monkeypatch, value):
    """FLASH_MSA_NUM_THREADS is read by every CPU operation; a bad value is an error, never
    silently ignored."""
    monkeypatch.setenv("FLASH_MSA_NUM_THREADS", value)
    with raises(f'flash_msa: FLASH_MSA_NUM_THREADS: expected a whole number of threads in '
                f'[1, 65536] (or the variable unset), got "{value}"'):
        call(inputs)


@pytest.mark.parametrize("value", ["1", "3", ""])
def test_good_thread_count_variable(inputs, monkeypatch, value):
    want = call(inputs)
    monkeypatch.setenv("FLASH_MSA_NUM_THREADS", value)
    got = call(inputs)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_heads=6, num_kv_heads=4), "num_heads (6) must be a multiple of 4"),
    (dict(num_proxy_heads=3), "num_heads (8) must be a multiple of 3"),
    (dict(num_proxy_heads=4, num_proxy_kv_heads=3), "num_proxy_heads (4) must be a multiple of 3"),
    (dict(head_dim=15), "RoPE needs even head dims"),
    (dict(top_k=100), "MSAAttention: top_k: expected a positive multiple of 128 tokens"),
    (dict(top_k=256.0), "MSAAttention: top_k: expected a positive multiple of 128 tokens"),
    (dict(head_dim=0), "MSAAttention: head_dim: expected an int >= 1, got 0"),
    (dict(proxy_head_dim=0), "MSAAttention: proxy_head_dim: expected an int >= 1, got 0"),
    (dict(num_kv_heads=0), "MSAAttention: num_kv_heads: expected an int >= 1, got 0"),
    (dict(hidden_size=32.0), "MSAAttention: hidden_size: expected an int >= 1, got 32.0"),
])
def test_bad_module_config(kwargs, message):
    config = dict(hidden_size=32, num_heads=8, num_kv_heads=2, head_dim=16) | kwargs
    with raises(message):
        flash_msa.MSAAttention(**config)


def test_module_integral_config():
    model = flash_msa.MSAAttention(np.int64(32), 8, 2, np.int32(16), top_k=torch.tensor(256))
    assert model.top_k == 256 and type(model.top_k) is int and model.head_dim == 16


@pytest.mark.parametrize("shape", [(300, 32), (1, 2, 300, 32), (2, 300, 16)])
def test_module_input_shape(shape):
    model = flash_msa.MSAAttention(32, 8, 2, 16, top_k=256)
    with raises(f"flash_msa: MSAAttention: hidden: expected a 3-D tensor (B, S, hidden_size=32), "
                f"got shape {shape}"):
        model(torch.randn(shape))
