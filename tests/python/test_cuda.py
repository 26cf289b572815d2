"""The CUDA backend against the CPU backend of the same package, on the GPU.

Each CUDA result in bf16/fp16 is compared with the CPU path run in fp32 on the same (rounded)
inputs and, for attention, on the indices the CUDA selection returned, so every comparison is
exact up to arithmetic: relative L2 error below 1e-2. The CUDA backend requires Hp % Hk == 0,
G = H / Hp <= 64 (in warmup: 64 on the Hopper kernels, D = Dp = 128; 16 on the portable ones
and for the forward's KL value) and (D, Dp) in {(32, 32), (64, 32), (64, 64), (128, 64),
(128, 128)}.
"""

import os

import pytest
import torch

import flash_msa
import reference as ref
from conftest import NAMES, Shape, random_inputs
from test_compile import train_step
from test_select import check_selection

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and flash_msa.built_with_cuda()),
    reason="needs a CUDA device and flash_msa built with CUDA",
)

SHAPES = [
    Shape(B=2, S=700, H=16, Hk=2, Hp=2, Hpk=1, D=64, Dp=64, K=3),  # GQA, ragged last block
    Shape(B=1, S=512, H=4, Hk=1, Hp=1, Hpk=1, D=128, Dp=128, K=8),  # K > NB
    Shape(B=2, S=384, H=4, Hk=2, Hp=2, Hpk=1, D=128, Dp=64, K=2,
          cu_seqlens=(0, 100, 384, 500, 768)),  # packed documents
    Shape(B=1, S=256, H=8, Hk=4, Hp=4, Hpk=2, D=32, Dp=32, K=1),
    Shape(B=1, S=300, H=2, Hk=1, Hp=1, Hpk=1, D=64, Dp=32, K=2),
]
DTYPES = [torch.bfloat16, torch.float16]
REL_L2 = 1e-2


def rel_l2(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.detach().cpu().double(), expected.detach().cpu().double()
    return ((got - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def run(inputs: dict, shape: Shape, indices, device, kl_weight, compute_kl=True, kl_out=None):
    """out, kl, lse, lse_proxy and the gradients of sum(out * dout) + kl_weight * kl."""
    cu = shape.cu(device)
    leaves = {n: inputs[n].detach().to(device).requires_grad_() for n in NAMES}
    args = [leaves[n] for n in NAMES]
    common = dict(cu_seqlens=cu, compute_kl=compute_kl, kl_out=kl_out)
    if indices is None:
        out, kl = flash_msa.flash_msa_warmup_func(*args, **common)
    else:
        indices = indices.to(device)
        out, kl = flash_msa.sparse_attention(*args, indices, **common)
    ((out * inputs["dout"].to(device)).sum() + kl_weight * kl).backward()
    _, _, lse, lse_proxy = flash_msa.ops.forward(
        *(t.detach() for t in args), indices, shape.D ** -0.5, shape.Dp ** -0.5, cu, False, None)
    return dict(out=out, kl=kl, lse=lse, lse_proxy=lse_proxy,
                **{f"d{n}": t.grad for n, t in leaves.items()})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_selection_by_score(shape, dtype):
    inputs = random_inputs(shape, dtype, seed=40, device="cuda")
    indices = flash_msa.select_blocks(inputs["qp"], inputs["kp"], shape.K,
                                      cu_seqlens=shape.cu("cuda"))
    assert indices.device.type == "cuda" and indices.dtype == torch.int32
    scores = ref.block_scores(inputs["qp"].cpu(), inputs["kp"].cpu(), shape.Dp ** -0.5, shape.cu())
    finite = scores[scores.isfinite()].abs().max().item()
    check_selection(indices, scores, shape.K, finite * 2.0 ** -7)


hopper_select = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9
    or os.environ.get("FLASH_MSA_PORTABLE_KERNELS", "0") not in ("", "0"),
    reason="the FP8 select runs on the Hopper select kernel (compute capability 9.x)",
)


@hopper_select
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_selection_ranks_the_quantised_scores(dtype):
    shape = Shape(B=2, S=1500, H=4, Hk=1, Hp=2, Hpk=1, D=128, Dp=128, K=6,
                  cu_seqlens=(0, 1100, 1500, 2300, 3000))
    inputs = random_inputs(shape, dtype, seed=43, device="cuda")
    indices = flash_msa.select_blocks(inputs["qp"], inputs["kp"], shape.K,
                                      cu_seqlens=shape.cu("cuda"), select_dtype=torch.float8_e4m3fn)
    scores = ref.block_scores(ref.fp8_dequantised(inputs["qp"].cpu()),
                              ref.fp8_dequantised(inputs["kp"].cpu()), shape.Dp ** -0.5, shape.cu())
    finite = scores[scores.isfinite()].abs().max().item()
    check_selection(indices, scores, shape.K, finite * 2.0 ** -10)
    # The step takes FP8-ranked blocks like any others.
    q = inputs["q"].requires_grad_()
    out, _ = flash_msa.flash_msa_func(inputs["qp"], inputs["kp"], q, inputs["k"], inputs["v"],
                                      shape.K * 128, cu_seqlens=shape.cu("cuda"),
                                      select_dtype=torch.float8_e4m3fn)
    out.float().sum().backward()
    assert out.isfinite().all() and q.grad.isfinite().all()


@hopper_select
def test_fp8_select_needs_dp_128():
    x = torch.randn(1, 1, 256, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="proxy_head_dim"):
        flash_msa.select_blocks(x, x, 2, select_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("mode", ["sparse", "warmup"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_cpu(shape, dtype, mode):
    inputs = random_inputs(shape, dtype, seed=41, device="cuda")
    indices = None
    if mode == "sparse":
        indices = flash_msa.select_blocks(inputs["qp"], inputs["kp"], shape.K,
                                          cu_seqlens=shape.cu("cuda"))
    weight = 0.75 * shape.N  # makes the proxy gradients O(1)
    got = run(inputs, shape, indices, "cuda", weight)
    fp32 = {n: t.cpu().float() for n, t in inputs.items()}
    expected = run(fp32, shape, None if indices is None else indices.cpu(), "cpu", weight)
    assert got["out"].dtype == dtype and got["out"].shape == (shape.B, shape.S, shape.H * shape.D)
    assert got["kl"].dtype == torch.float32 and got["kl"].dim() == 0
    assert expected["kl"].item() > 0
    for name, e in expected.items():
        g = got[name]
        assert g.device.type == "cuda" and g.shape == e.shape, name
        if name.startswith("d"):
            assert g.dtype == dtype, name
        assert torch.isfinite(g).all(), name
        assert rel_l2(g, e) < REL_L2, f"{name}: rel L2 {rel_l2(g, e):.3g}"


hopper_warmup = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9
    or os.environ.get("FLASH_MSA_PORTABLE_KERNELS", "0") not in ("", "0"),
    reason="G > 16 in warmup runs on the Hopper warmup kernels (compute capability 9.x)",
)


@hopper_warmup
def test_warmup_with_64_heads_per_proxy_head():
    """G = 64 on the Hopper warmup kernels, with documents; the KL value from the backward."""
    shape = Shape(B=1, S=400, H=64, Hk=1, Hp=1, Hpk=1, D=128, Dp=128, K=1,
                  cu_seqlens=(0, 150, 400))
    inputs = random_inputs(shape, torch.bfloat16, seed=50, device="cuda")
    weight = 0.75 * shape.N
    kl_out = torch.full((), float("nan"), device="cuda")
    got = run(inputs, shape, None, "cuda", weight, compute_kl=False, kl_out=kl_out)
    fp32 = {n: t.cpu().float() for n, t in inputs.items()}
    expected = run(fp32, shape, None, "cpu", weight)
    assert rel_l2(kl_out, expected["kl"]) < 1e-3, (kl_out.item(), expected["kl"].item())
    for name, e in expected.items():
        if name != "kl":
            assert rel_l2(got[name], e) < REL_L2, f"{name}: rel L2 {rel_l2(got[name], e):.3g}"
    with pytest.raises(ValueError, match="heads"):  # the forward's KL value: G <= 16
        run(inputs, shape, None, "cuda", weight, compute_kl=True)


def test_gradients_are_bitwise_reproducible():
    """Every path is deterministic by construction (no floating-point atomics)."""
    shape = SHAPES[0]
    inputs = random_inputs(shape, torch.bfloat16, seed=42, device="cuda")
    indices = flash_msa.select_blocks(inputs["qp"], inputs["kp"], shape.K)
    first = run(inputs, shape, indices, "cuda", shape.N)
    second = run(inputs, shape, indices, "cuda", shape.N)
    for name in first:
        assert torch.equal(first[name], second[name]), name


def problem(shape: Shape, dtype, seed: int, mode: str):
    """Random CUDA inputs and, in sparse mode, the proxy's selection on them (None: warmup)."""
    inputs = random_inputs(shape, dtype, seed=seed, device="cuda")
    if mode != "sparse":
        return inputs, None
    return inputs, flash_msa.select_blocks(inputs["qp"], inputs["kp"], shape.K,
                                           cu_seqlens=shape.cu("cuda"))


def on_hopper_kernels() -> bool:
    return (torch.cuda.get_device_capability()[0] == 9
            and os.environ.get("FLASH_MSA_PORTABLE_KERNELS", "0") in ("", "0"))


@pytest.mark.parametrize("mode", ["sparse", "warmup"])
@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[1]], ids=str)
def test_skipping_the_kl_value_keeps_out_and_every_gradient(shape, mode):
    """compute_kl=True changes no result, bitwise, where it runs the same kernels. On the Hopper
    kernels with D = Dp = 128 it does not: the sparse forward leaves its tile path and the warmup
    forward runs the portable kernel, so the results agree up to rounding."""
    inputs, indices = problem(shape, torch.bfloat16, 48, mode)
    full = run(inputs, shape, indices, "cuda", shape.N)
    fast = run(inputs, shape, indices, "cuda", shape.N, compute_kl=False)
    assert full["kl"].item() > 0 and fast["kl"].item() == 0.0
    other_kernels = shape.D == shape.Dp == 128 and on_hopper_kernels()
    for name in full:
        if name == "kl":
            continue
        if other_kernels:
            assert rel_l2(fast[name], full[name]) < REL_L2, name
        else:
            assert torch.equal(full[name], fast[name]), name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tile_path_matches_cpu(dtype):
    """The sparse forward's tile path (Hopper, D = Dp = 128, no forward KL value): query tiles
    of 128 positions with one selection for all their queries, every other tile selected per
    token, documents cutting tiles; against the CPU backend, with the KL value from the backward,
    bitwise reproducible."""
    shape = Shape(B=2, S=1000, H=8, Hk=2, Hp=2, Hpk=1, D=128, Dp=128, K=3,
                  cu_seqlens=(0, 300, 1000, 1200, 2000))
    inputs, per_token = problem(shape, dtype, 51, "sparse")
    pos = torch.arange(shape.S, device="cuda")
    last = torch.clamp(pos // 128 * 128 + 127, max=shape.S - 1)  # each tile's last query
    # Its blocks are visible to every query of its tile (a document starting inside the tile
    # starts after theirs), so the tile shares them.
    shared = (pos // 128 % 2 == 0)[:, None]
    indices = torch.where(shared, per_token[:, :, last], per_token).contiguous()
    weight = 0.75 * shape.N
    results = []
    for _ in range(2):
        kl_out = torch.full((), float("nan"), device="cuda")
        results.append(run(inputs, shape, indices, "cuda", weight, compute_kl=False,
                           kl_out=kl_out))
        results[-1]["kl_out"] = kl_out
    fp32 = {n: t.cpu().float() for n, t in inputs.items()}
    cpu_kl = torch.full((), float("nan"))
    expected = run(fp32, shape, indices.cpu(), "cpu", weight, compute_kl=False, kl_out=cpu_kl)
    expected["kl_out"] = cpu_kl
    for name, e in expected.items():
        assert torch.equal(results[0][name], results[1][name]), name
        if name != "kl":
            got = results[0][name]
            assert torch.isfinite(got).all(), name
            assert rel_l2(got, e) < REL_L2, f"{name}: rel L2 {rel_l2(got, e):.3g}"


@pytest.mark.parametrize("mode", ["sparse", "warmup"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_backward_writes_the_kl_value(dtype, mode):
    """kl_out from the backward's teacher: the forward's value up to rounding (against the CPU
    too), bitwise reproducible, and out and every gradient as with compute_kl=False."""
    shape = SHAPES[2]
    inputs, indices = problem(shape, dtype, 49, mode)
    full = run(inputs, shape, indices, "cuda", shape.N)
    fast = run(inputs, shape, indices, "cuda", shape.N, compute_kl=False)
    values = []
    for _ in range(2):
        kl_out = torch.full((), float("nan"), device="cuda")
        got = run(inputs, shape, indices, "cuda", shape.N, compute_kl=False, kl_out=kl_out)
        values.append(kl_out)
        for name in fast:
            assert torch.equal(got[name], fast[name]), name
    assert torch.equal(values[0], values[1])
    assert rel_l2(values[0], full["kl"]) < 1e-4, (values[0].item(), full["kl"].item())
    cpu_out = torch.full((), float("nan"))
    run({n: t.cpu() for n, t in inputs.items()}, shape, None if indices is None else indices.cpu(),
        "cpu", shape.N, compute_kl=False, kl_out=cpu_out)
    assert rel_l2(values[0], cpu_out) < 1e-3, (values[0].item(), cpu_out.item())


def graph_step(leaves: dict, dout: torch.Tensor, shape: Shape, cu):
    out, kl = flash_msa.flash_msa_func(*(leaves[n] for n in NAMES), shape.K * 128,
                                       cu_seqlens=cu, compute_kl=True)
    loss = (out * dout).sum() + shape.N * kl
    grads = torch.autograd.grad(loss, [leaves[n] for n in NAMES])
    return [out, kl, *grads]


def test_cuda_graph_capture_matches_eager():
    shape = SHAPES[2]
    cu = shape.cu("cuda")
    static = random_inputs(shape, torch.bfloat16, seed=43, device="cuda")
    leaves = {n: static[n].clone().requires_grad_() for n in NAMES}
    dout = static["dout"].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            graph_step(leaves, dout, shape, cu)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = graph_step(leaves, dout, shape, cu)

    fresh = random_inputs(shape, torch.bfloat16, seed=44, device="cuda")
    with torch.no_grad():
        for n in NAMES:
            leaves[n].copy_(fresh[n])
        dout.copy_(fresh["dout"])
    graph.replay()
    torch.cuda.synchronize()
    eager = graph_step({n: fresh[n].clone().requires_grad_() for n in NAMES}, fresh["dout"],
                       shape, cu)
    for name, c, e in zip(["out", "kl", *NAMES], captured, eager):
        assert torch.equal(c, e), name


def test_training_step_does_not_sync_with_the_host():
    shape = SHAPES[2]
    cu = shape.cu("cuda")
    inputs = random_inputs(shape, torch.bfloat16, seed=45, device="cuda")
    leaves = {n: inputs[n].clone().requires_grad_() for n in NAMES}

    kl_value = torch.empty((), device="cuda")

    def step():
        for compute_kl, kl_out in ((True, None), (False, kl_value)):
            out, kl = flash_msa.flash_msa_func(*(leaves[n] for n in NAMES), shape.K * 128,
                                               cu_seqlens=cu, compute_kl=compute_kl, kl_out=kl_out)
            ((out * inputs["dout"]).sum() + kl).backward()

    step()  # first call: lazy initialisation may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        out = flash_msa.flash_msa_warmup_func(*(leaves[n] for n in NAMES), cu_seqlens=cu,
                                              return_kl=False)
        out.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(torch.isfinite(leaves[n].grad).all() for n in NAMES)


@pytest.mark.parametrize("warmup", [False, True])
def test_compiled_module_matches_eager(warmup):
    torch.manual_seed(46)
    shape = Shape(B=2, S=300, H=4, Hk=2, Hp=2, Hpk=1, D=64, Dp=64, K=2,
                  cu_seqlens=(0, 120, 300, 450, 600))
    cu = shape.cu("cuda")
    model = flash_msa.MSAAttention(128, shape.H, shape.Hk, shape.D, shape.Hp, shape.Hpk, shape.Dp,
                                   top_k=shape.K * 128, warmup=warmup, device="cuda",
                                   dtype=torch.bfloat16)
    hidden = torch.randn(shape.B, shape.S, 128, device="cuda", dtype=torch.bfloat16)

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

    assert rel_l2(out, eager_out) < REL_L2
    assert rel_l2(kl, eager_kl) < REL_L2
    assert rel_l2(model.kl_value, eager_kl_value) < REL_L2 and model.kl_value > 0
    assert rel_l2(compiled_hidden.grad, eager_hidden.grad) < REL_L2
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, n
        assert rel_l2(p.grad, eager_grads[n]) < REL_L2, n


def test_unsupported_head_dims_raise_a_clear_error():
    shape = Shape(B=1, S=256, H=2, Hk=1, Hp=1, Hpk=1, D=16, Dp=16, K=1)
    inputs = random_inputs(shape, torch.bfloat16, seed=47, device="cuda")
    with pytest.raises((ValueError, RuntimeError), match="limit of the CUDA backend"):
        flash_msa.flash_msa_warmup_func(*(inputs[n] for n in NAMES))


def test_float64_on_cuda_is_refused_clearly():
    """float64 runs on the CPU backend only: CUDA tensors get an error saying so."""
    shape = Shape(B=1, S=256, H=2, Hk=1, Hp=1, Hpk=1, D=64, Dp=64, K=1)
    inputs = random_inputs(shape, torch.float64, seed=49, device="cuda")
    tensors = [inputs[n] for n in NAMES]
    with pytest.raises(ValueError, match="float64 runs on the CPU backend only"):
        flash_msa.flash_msa_func(*tensors, 128)
    with pytest.raises(ValueError, match="float64 runs on the CPU backend only"):
        flash_msa.ops.forward(*tensors, None, 0.125, 0.125, None, True, None)
    tensors = [t.float() for t in tensors]  # float32 too, before any kernel
    with pytest.raises(ValueError, match="q_proxy: float32 runs on the CPU backend only"):
        flash_msa.flash_msa_func(*tensors, 128)
    with pytest.raises(ValueError, match="q: float32 runs on the CPU backend only"):
        flash_msa.ops.forward(*tensors, None, 0.125, 0.125, None, True, None)


def test_out_of_device_memory_is_torch_s_error_with_the_size():
    """A workspace that does not fit surfaces as torch.OutOfMemoryError naming the size asked
    for (the ops allocate through torch's caching allocator); the device stays usable."""
    shape = Shape(B=1, S=8192, H=64, Hk=4, Hp=4, Hpk=1, D=128, Dp=128, K=16)
    x = random_inputs(shape, torch.bfloat16, seed=5, device="cuda")
    args = [x[n] for n in NAMES]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    filler = torch.empty(free - (64 << 20), dtype=torch.uint8, device="cuda")  # leave 64 MiB
    try:
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate [0-9.]+ [GM]iB"):
            flash_msa.flash_msa_func(*args, shape.K * 128)
    finally:
        del filler
        torch.cuda.empty_cache()
    out, _ = flash_msa.flash_msa_func(*args, shape.K * 128)  # and then it runs
    assert out.isfinite().all()
