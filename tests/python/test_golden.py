"""The golden cases (computed in float64 by an independent reference; conftest.GOLDEN_DIR says
where they are: by default the in-repo tests/golden/golden.tar.xz, unpacked)."""

import json

import numpy as np
import pytest
import torch

import flash_msa
import reference as ref
from conftest import GOLDEN_DIR, GOLDEN_SKIP_REASON, NAMES, check_rule, has_golden, max_err
from test_select import check_selection

CASES = sorted(p.parent.name for p in GOLDEN_DIR.glob("case_*/meta.json")) if has_golden() else []
pytestmark = pytest.mark.skipif(not CASES, reason=GOLDEN_SKIP_REASON)
SPARSE_CASES = [
    name for name in CASES
    if json.loads((GOLDEN_DIR / name / "meta.json").read_text())["mode"] == "sparse"
]


def load(name: str):
    case = GOLDEN_DIR / name
    meta = json.loads((case / "meta.json").read_text())
    arrays = {p.stem: torch.from_numpy(np.load(p)) for p in case.glob("*.npy")}
    return meta, arrays


def run_case(meta, arrays, dtype, indices):
    """Package out (as [B, H, S, D]), kl and gradients of sum(out * dout) + w * kl."""
    leaves = {n: arrays[n].to(dtype).requires_grad_() for n in NAMES}
    b, h, s, d = arrays["q"].shape
    common = dict(scale=meta["scale"], proxy_scale=meta["proxy_scale"],
                  cu_seqlens=arrays.get("cu_seqlens"), compute_kl=True)
    if meta["mode"] == "warmup":
        out, kl = flash_msa.flash_msa_warmup_func(*leaves.values(), **common)
    else:
        out, kl = flash_msa.sparse_attention(*leaves.values(), indices, **common)
    out = out.view(b, s, h, d).transpose(1, 2)
    ((out * arrays["dout"].to(dtype)).sum() + meta["kl_grad_weight"] * kl).backward()
    return out, kl, {n: t.grad for n, t in leaves.items()}


def golden_grads(arrays):
    return {n: arrays[f"d{n}"] for n in NAMES}


@pytest.mark.parametrize("name", SPARSE_CASES)
def test_selection(name):
    meta, arrays = load(name)
    scores = arrays["block_scores"].double()
    finite = scores[scores.isfinite()].abs().max().item()
    for dtype, tol in ((torch.float32, 1e-5 * finite), (torch.bfloat16, 2.0 ** -7 * finite)):
        indices = flash_msa.select_blocks(arrays["qp"].to(dtype), arrays["kp"].to(dtype),
                                          meta["top_k_blocks"], proxy_scale=meta["proxy_scale"],
                                          cu_seqlens=arrays.get("cu_seqlens"))
        check_selection(indices, scores, meta["top_k_blocks"], tol)


@pytest.mark.parametrize("name", CASES)
def test_float32_reproduces_golden(name):
    meta, arrays = load(name)
    indices = arrays.get("indices")
    out, kl, grads = run_case(meta, arrays, torch.float32, indices)
    want = dict(out=arrays["out"], **golden_grads(arrays))
    got = dict(out=out, **grads)
    for n, w in want.items():
        err = max_err(got[n], w)
        assert err <= 1e-4 * w.abs().max().item() + 1e-7, f"{n}: error {err:.3g}"
    assert abs(kl.item() - meta["kl"]) <= 1e-5 * meta["kl"]
    lse = flash_msa.ops.forward(*(arrays[n] for n in NAMES), indices, meta["scale"],
                                meta["proxy_scale"], arrays.get("cu_seqlens"), True, None)[2]
    assert max_err(lse, arrays["lse"]) <= 1e-5 * arrays["lse"].abs().max().item()


@pytest.mark.parametrize("name", CASES)
def test_bfloat16_meets_the_tolerance_rule(name):
    meta, arrays = load(name)
    indices = arrays.get("indices")
    out, kl, grads = run_case(meta, arrays, torch.bfloat16, indices)
    mask = ref.attended(indices, meta["B"], meta["S"], arrays.get("cu_seqlens"))
    base_out, _, _, base_kl, base_grads = ref.msa_with_grads(
        {n: arrays[n] for n in NAMES}, mask, meta["scale"], meta["proxy_scale"],
        arrays["dout"].transpose(1, 2).flatten(2), meta["kl_grad_weight"], torch.bfloat16)
    b, h, s, d = arrays["q"].shape
    base_out = base_out.view(b, s, h, d).transpose(1, 2)
    check_rule("out", out, arrays["out"].double(), base_out, 1e-5)
    check_rule("kl", kl, torch.tensor(meta["kl"], dtype=torch.float64), base_kl, 1e-5)
    for n, w in golden_grads(arrays).items():
        check_rule(f"d{n}", grads[n], w.double(), base_grads[n], 1e-5 * w.abs().max().item())


@pytest.mark.parametrize("name", CASES)
def test_reference_agrees_with_golden(name):
    """Validates tests/python/reference.py itself against the independent float64 reference."""
    meta, arrays = load(name)
    cu = arrays.get("cu_seqlens")
    indices = arrays.get("indices")
    if indices is not None:
        scores = ref.block_scores(arrays["qp"], arrays["kp"], meta["proxy_scale"], cu)
        torch.testing.assert_close(scores, arrays["block_scores"].double(), rtol=1e-6, atol=1e-6)
        assert torch.equal(ref.select(scores, meta["top_k_blocks"]), indices)
    mask = ref.attended(indices, meta["B"], meta["S"], cu)
    out, lse, _, kl, grads = ref.msa_with_grads(
        {n: arrays[n] for n in NAMES}, mask, meta["scale"], meta["proxy_scale"],
        arrays["dout"].transpose(1, 2).flatten(2), meta["kl_grad_weight"], torch.float64)
    b, h, s, d = arrays["q"].shape
    torch.testing.assert_close(out.view(b, s, h, d).transpose(1, 2), arrays["out"].double(),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), arrays["lse"].double(), rtol=1e-5, atol=1e-6)
    assert abs(kl.item() - meta["kl"]) <= 1e-9
    for n, w in golden_grads(arrays).items():
        torch.testing.assert_close(grads[n], w.double(), rtol=1e-5, atol=1e-7 * w.abs().max().item() + 1e-9)
