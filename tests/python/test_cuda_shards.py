"""Query shards on the GPU (the kernels' query_offset, which context parallelism runs on): every
stage called on a shard of the queries against the whole key sequence equals the whole-sequence
call on the shard's rows; the shards' key gradients and KL values add up to the whole ones. Both
kernel sets (Hopper where D = 128, portable), sparse and warmup, shards cut inside key blocks,
packed documents crossing the cuts, B = 2. Also flash_msa.distributed over a one-rank NCCL
group."""


import pytest
import torch
import torch.distributed as dist

import flash_msa
from conftest import NAMES, Shape, random_inputs
from flash_msa import ops

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and flash_msa.built_with_cuda()),
    reason="needs a CUDA device and flash_msa built with CUDA",
)

SHAPES = [
    Shape(B=2, S=896, H=16, Hk=2, Hp=2, Hpk=1, D=128, Dp=128, K=4,
          cu_seqlens=(0, 250, 600, 896, 1000, 1792)),
    Shape(B=1, S=700, H=8, Hk=2, Hp=2, Hpk=1, D=64, Dp=64, K=3),
]
CUTS = (0, 200, 333, 512)  # shards [0, 200), [200, 333), [333, 512), [512, S)
REL_L2 = 1e-2


def rel_l2(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def call(inputs, shape, offset, length, warmup, w):
    """select + forward + backward of queries [offset, offset + length); q-side inputs are
    views of the whole tensors (no copy)."""
    rows = slice(offset, offset + length)
    qp, q = inputs["qp"][:, :, rows], inputs["q"][:, :, rows]
    kp, k, v = inputs["kp"], inputs["k"], inputs["v"]
    cu = shape.cu("cuda")
    sc, psc = shape.D ** -0.5, shape.Dp ** -0.5
    idx = None if warmup else ops.select(qp, kp, shape.K, psc, cu, offset)
    out, kl, lse, lse_p = ops.forward(qp, kp, q, k, v, idx, sc, psc, cu, True, None, offset)
    kl_back = torch.zeros((), device="cuda")
    dout = inputs["dout"][:, rows]
    grads = ops.backward(dout, w, qp, kp, q, k, v, out, lse, lse_p, idx, sc, psc, cu, kl_back,
                         offset)
    return dict(idx=idx, out=out, kl=kl, kl_back=kl_back, lse=lse, lse_p=lse_p,
                **dict(zip(("dqp", "dkp", "dq", "dk", "dv"), grads)))


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("mode", ["sparse", "warmup"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shards_equal_the_whole(shape, mode, portable, monkeypatch):
    if portable:
        monkeypatch.setenv("FLASH_MSA_PORTABLE_KERNELS", "1")
    inputs = random_inputs(shape, torch.bfloat16, seed=7, device="cuda")
    w = torch.tensor(0.5 * shape.N, device="cuda")
    whole = call(inputs, shape, 0, shape.S, mode == "warmup", w)
    cuts = CUTS + (shape.S,)
    shards = [call(inputs, shape, a, b - a, mode == "warmup", w) for a, b in zip(cuts, cuts[1:])]
    for (a, b), part in zip(zip(cuts, cuts[1:]), shards):
        if mode == "sparse":
            assert torch.equal(part["idx"], whole["idx"][:, :, a:b]), (a, b)
        assert rel_l2(part["out"], whole["out"][:, a:b]) < REL_L2, (a, b)
        for name in ("lse", "lse_p", "dqp", "dq"):
            assert rel_l2(part[name], whole[name][:, :, a:b]) < REL_L2, (name, a, b)
    for name in ("dkp", "dk", "dv"):
        total = sum(part[name].float() for part in shards)
        assert rel_l2(total, whole[name]) < REL_L2, name
    for name in ("kl", "kl_back"):
        total = sum(part[name] for part in shards)
        assert abs(total.item() - whole[name].item()) < 1e-4 * abs(whole[name].item()) + 1e-6, name


def test_distributed_over_one_nccl_rank(tmp_path):
    """The NCCL code path of flash_msa.distributed (gathers, all-to-all, all-reduce) on one
    rank, against flash_msa_func."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    try:
        shape = SHAPES[0]
        inputs = random_inputs(shape, torch.bfloat16, seed=8, device="cuda")
        cu = shape.cu("cuda")
        results = []
        for sharded in (False, True):
            leaves = {n: inputs[n].clone().requires_grad_() for n in NAMES if n != "dout"}
            kl_out = torch.zeros((), device="cuda")
            if sharded:
                cp = flash_msa.distributed.ContextParallel()
                out, kl = flash_msa.distributed.msa_func(
                    *leaves.values(), shape.K * 128, context_parallel=cp, cu_seqlens=cu,
                    compute_kl=True, kl_out=kl_out)
            else:
                out, kl = flash_msa.flash_msa_func(*leaves.values(), shape.K * 128, cu_seqlens=cu,
                                                   compute_kl=True, kl_out=kl_out)
            ((out.float() * inputs["dout"].float()).sum() + 3.0 * kl).backward()
            results.append([out, kl, kl_out] + [t.grad for t in leaves.values()])
        for got, want in zip(results[1], results[0]):
            assert rel_l2(got, want) < REL_L2
    finally:
        dist.destroy_process_group()
