"""Context parallelism (flash_msa.distributed) on the CPU with the gloo backend, 2 and 4 processes:
the sharded op equals the single-process op on the same global inputs, for both layouts, with
documents crossing shard boundaries, B > 1 and K above the shard's block count; bad input raises
ValueError on every rank instead of hanging."""

import datetime
import json
import os
import socket
import subprocess
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flash_msa
from conftest import REPO
from flash_msa import distributed as fd

# (B, S, H, Hk, Hp, Hpk, D, Dp): S = 768 splits into 8 chunks of 96 tokens (shard boundaries
# inside key blocks) and S = 1024 into chunks of 128.
SHAPES = {768: (2, 768, 4, 2, 2, 1, 32, 16), 1024: (2, 1024, 4, 2, 2, 1, 32, 16)}
TOP_K = 6 * 128  # 6 blocks: more than the 2 to 4 blocks a shard of 2 or 4 ranks holds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, errors):
    os.environ["FLASH_MSA_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # A rank stuck in a collective that its peer never joins fails after a minute, not never.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world, *args)
    except BaseException:  # reported by the parent, which fails the test
        errors[rank] = traceback.format_exc()
    finally:
        # Every rank's collectives are over before any rank tears its gloo pairs down.
        dist.barrier()
        dist.destroy_process_group()
    # The rank's work and report are done. Leave without the interpreter's finalisation, where
    # gloo's threads can still abort the process ("terminate called without an active
    # exception", seen rarely in CI after a complete run) and fail a test that passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(world, fn, *args):
    errors = mp.Manager().dict()
    mp.spawn(_entry, args=(world, _free_port(), fn, args, errors), nprocs=world, join=True)
    assert not errors, "\n".join(f"rank {r}:\n{e}" for r, e in sorted(errors.items()))


def _inputs(S, dtype=torch.float32):
    B, S, H, Hk, Hp, Hpk, D, Dp = SHAPES[S]
    g = torch.Generator().manual_seed(S)
    randn = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    tensors = dict(qp=randn(B, Hp, S, Dp), kp=randn(B, Hpk, S, Dp), q=randn(B, H, S, D),
                   k=randn(B, Hk, S, D), v=randn(B, Hk, S, D))
    # Documents of 300, 400, ... tokens: they cross every shard boundary of both layouts.
    cu = list(range(0, B * S, 300)) + [S] + [B * S]
    cu = torch.tensor(sorted(set(cu)), dtype=torch.int32)
    dout = randn(B, S, H * D)
    return tensors, cu, dout


def _reference(tensors, cu, dout, warmup, w=0.7):
    leaves = {n: t.clone().requires_grad_() for n, t in tensors.items()}
    fn = flash_msa.flash_msa_warmup_func if warmup else flash_msa.flash_msa_func
    kl_out = torch.zeros(())
    out, kl = fn(*leaves.values(), TOP_K, cu_seqlens=cu, compute_kl=True, kl_out=kl_out)
    ((out * dout).sum() + w * kl).backward()
    return out.detach(), kl.detach(), kl_out, {n: t.grad for n, t in leaves.items()}


def _sharded(cp, tensors, cu, dout, warmup, w=0.7):
    leaves = {n: cp.shard(t).clone().requires_grad_() for n, t in tensors.items()}
    kl_out = torch.zeros(())
    out, kl = fd.msa_func(*leaves.values(), TOP_K, context_parallel=cp, cu_seqlens=cu,
                          warmup=warmup, compute_kl=True, kl_out=kl_out)
    ((out * cp.shard(dout, dim=1)).sum() + w * kl).backward()
    return out.detach(), kl.detach(), kl_out, {n: t.grad for n, t in leaves.items()}


def _close(got, want, what):
    assert got.shape == want.shape, what
    err = (got - want).abs().max().item()
    assert err <= 2e-5 * (1 + want.abs().max().item()), f"{what}: max error {err}"


def _equal_to_single_process(rank, world, S, layout, warmup):
    tensors, cu, dout = _inputs(S)
    want_out, want_kl, want_kl_out, want_grads = _reference(tensors, cu, dout, warmup)
    cp = fd.ContextParallel(layout=layout)
    out, kl, kl_out, grads = _sharded(cp, tensors, cu, dout, warmup)
    _close(out, cp.shard(want_out, dim=1), "out")
    _close(kl, want_kl, "kl")
    _close(kl_out, want_kl_out, "kl_out")
    for name, grad in grads.items():
        _close(grad, cp.shard(want_grads[name]), f"d{name}")
    _close(cp.unshard(out, dim=1), want_out, "unshard(out)")
    # Bitwise reproducible, the key-side gradients' cross-rank sums included.
    _, _, _, again = _sharded(cp, tensors, cu, dout, warmup)
    for name, grad in grads.items():
        assert torch.equal(grad, again[name]), name


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", fd.LAYOUTS)
def test_sparse_equals_single_process(world, layout):
    _run(world, _equal_to_single_process, 768 if world == 4 else 1024, layout, False)


@pytest.mark.parametrize("layout", fd.LAYOUTS)
def test_warmup_equals_single_process(layout):
    _run(2, _equal_to_single_process, 768, layout, True)


def test_segments_of_the_layouts():
    assert fd.shard_segments(8, 2, 0) == [fd.Segment(0, 0, 2), fd.Segment(6, 2, 2)]
    assert fd.shard_segments(8, 2, 1) == [fd.Segment(2, 0, 2), fd.Segment(4, 2, 2)]
    assert fd.shard_segments(8, 2, 1, "contiguous") == [fd.Segment(4, 0, 4)]
    with pytest.raises(ValueError, match="multiple of 4"):
        fd.shard_segments(6, 2, 0)
    with pytest.raises(ValueError, match="layout"):
        fd.shard_segments(8, 2, 0, "striped")


def _module(rank, world, layout):
    torch.manual_seed(0)
    layer = flash_msa.MSAAttention(64, 4, 2, 32, 2, 1, 16, top_k=TOP_K).double()
    hidden = torch.randn(2, 1024, 64, dtype=torch.float64)
    cu = torch.tensor([0, 700, 1024, 1500, 2048], dtype=torch.int32)
    out, kl = layer(hidden, cu)
    (out.square().mean() + kl).backward()
    want = {n: p.grad.clone() for n, p in layer.named_parameters()}
    want_out, want_kl = out.detach(), layer.kl_value.clone()
    layer.zero_grad()

    cp = fd.ContextParallel(layout=layout)
    assert fd.set_context_parallel(layer, cp) == 1
    out, kl = layer(cp.shard(hidden, dim=1), cu)
    # The mean over the whole sequence: each rank's part, then the gradients summed.
    (out.square().sum() / want_out.numel() + kl).backward()
    for n, p in layer.named_parameters():
        dist.all_reduce(p.grad)
        _close(p.grad, want[n], f"grad {n}")
    _close(cp.unshard(out.detach(), dim=1), want_out, "out")
    _close(layer.kl_value, want_kl, "kl_value")


@pytest.mark.parametrize("layout", fd.LAYOUTS)
def test_module_equals_single_process(layout):
    _run(2, _module, layout)


def _bad_inputs(rank, world):
    tensors, cu, _ = _inputs(1024)
    cp = fd.ContextParallel()
    shards = {n: cp.shard(t) for n, t in tensors.items()}
    # Shards of unequal length: rank 1 drops its last token.
    if rank == 1:
        shards = {n: t[:, :, :-2] for n, t in shards.items()}
    with pytest.raises(ValueError, match="ranks disagree.*local tokens"):
        fd.msa_func(*shards.values(), TOP_K, context_parallel=fd.ContextParallel())
    # Mismatched dtypes across ranks.
    shards = {n: cp.shard(t) for n, t in tensors.items()}
    if rank == 1:
        shards = {n: t.double() for n, t in shards.items()}
    with pytest.raises(ValueError, match="ranks disagree.*dtype"):
        fd.msa_func(*shards.values(), TOP_K, context_parallel=fd.ContextParallel())
    # An odd shard cannot hold the two equal chunks of the load-balanced layout.
    odd = {n: t[:, :, :-1] for n, t in tensors.items()}
    with pytest.raises(ValueError, match="equal chunks"):
        fd.msa_func(*odd.values(), TOP_K, context_parallel=fd.ContextParallel())
    # Local cu_seqlens (over one shard) instead of the global offsets.
    shards = {n: cp.shard(t) for n, t in tensors.items()}
    local_cu = torch.tensor([0, 512, 1024], dtype=torch.int32)
    with pytest.raises(ValueError, match="global offsets"):
        fd.msa_func(*shards.values(), TOP_K, context_parallel=cp, cu_seqlens=local_cu)
    with pytest.raises(ValueError, match="ContextParallel"):
        fd.msa_func(*shards.values(), TOP_K, context_parallel=dist.group.WORLD)
    # Tensors sharded for another group size: quarters of the sequence on a group of two ranks.
    quarter = fd.shard_segments(1024, 4, rank)
    shards = {n: torch.cat([t[:, :, s.position:s.position + s.length] for s in quarter], 2)
              for n, t in tensors.items()}
    with pytest.raises(ValueError, match="global offsets over batch \\* seqlen = 1024"):
        fd.msa_func(*shards.values(), TOP_K, context_parallel=cp, cu_seqlens=cu)
    # A group this rank is not a member of (new_group is called by every rank).
    only_rank_0 = dist.new_group([0])
    if rank == 1:
        with pytest.raises(ValueError, match="not a member of the group"):
            fd.ContextParallel(only_rank_0)
    with pytest.raises(ValueError, match="layout"):
        fd.ContextParallel(layout="striped")


def test_bad_input_raises_on_every_rank():
    _run(2, _bad_inputs)


def test_needs_an_initialised_group():
    with pytest.raises(ValueError, match="not initialised"):
        fd.ContextParallel()


def test_query_offset_checks():
    tensors, _, _ = _inputs(1024)
    qp, kp = tensors["qp"][:, :, :256], tensors["kp"]
    with pytest.raises(ValueError, match="needs query_offset"):
        flash_msa.select_blocks(qp, kp, 4)
    with pytest.raises(ValueError, match="query_offset"):
        flash_msa.select_blocks(qp, kp, 4, query_offset=800)
    whole = flash_msa.select_blocks(tensors["qp"], kp, 4)
    assert torch.equal(flash_msa.select_blocks(qp, kp, 4, query_offset=0), whole[:, :, :256])
    shard = tensors["qp"][:, :, 300:556]  # a view: no copy of the queries
    assert torch.equal(flash_msa.select_blocks(shard, kp, 4, query_offset=300),
                       whole[:, :, 300:556])


def _torchrun(script: str, *args: str) -> subprocess.CompletedProcess:
    """`script` (relative to the repository) under torchrun, two CPU processes, each of which
    prints "rank R: finished" once it has torn its process group down.

    A process may still abort after that line, at interpreter exit, with "terminate called
    without an active exception" from gloo's threads (seen rarely in CI, after a complete
    run); that exit is accepted, any other failure is not."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           f"--master-port={_free_port()}", str(REPO / script), "--device", "cpu", *args]
    env = dict(os.environ, FLASH_MSA_NUM_THREADS="1", OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    finished = all(f"rank {r}: finished" in done.stdout for r in range(2))
    at_exit = finished and "terminate called without an active exception" in done.stderr
    assert done.returncode == 0 or at_exit, done.stdout[-2000:] + done.stderr[-3000:]
    assert finished, done.stdout[-2000:]
    return done


def test_torchrun_benchmark_runs_on_gloo(tmp_path):
    """bench/cp_bench.py under torchrun (the multi-GPU benchmark's code path on gloo)."""
    out = tmp_path / "cp.json"
    _torchrun("bench/cp_bench.py", "--seqlen", "1K", "--heads", "4,2,2,1", "--dim", "32",
              "--top-k", "384", "--steps", "1", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["world"] == 2 and report["backend"] == "gloo"
    assert report["step_ms"] > 0 and report["kl_value"] > 0


def test_context_parallel_example_trains_on_gloo():
    """examples/context_parallel.py (DeviceMesh, MSAAttention) under torchrun: the loss and the
    KL value of the whole sequence are printed and finite."""
    done = _torchrun("examples/context_parallel.py", "--seqlen", "1K", "--steps", "2")
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 2, done.stdout
    assert all("nan" not in line for line in lines), lines
