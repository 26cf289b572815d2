"""Context-parallel MSA on any number of GPUs (one process each), launched by torchrun:

    torchrun --nproc-per-node 8 bench/cp_bench.py --seqlen 1M --out bench/results/RUN.json

Every rank holds its shard (load-balanced layout by default) of random bf16 inputs of one
sequence and runs flash_msa.distributed.msa_func forward and backward with the KL value from the
backward, as MSAAttention calls it. Reported per step, as the maximum over the ranks (the step
ends with the slowest): forward, backward, and the collectives alone (the all-gather of kp, k, v
and the all-to-all of their gradients, timed on the same tensors). Timing: CUDA events, warm-up
steps first, the median of --steps steps. Rank 0 writes the JSON. With --device cpu the same
script runs on the gloo backend (a functional check, e.g. for CI: ``--seqlen 2K --heads 4,2,2,1
--dim 32``).
"""

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from cp_ranks import parse_len
from flash_msa import distributed as fd


class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, steps: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(steps):
            if self.cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlen", default="1M", help="tokens of the whole sequence")
    parser.add_argument("--heads", default="64,4,4,1", help="H,Hk,Hp,Hpk")
    parser.add_argument("--dim", type=int, default=128, help="D = Dp")
    parser.add_argument("--top-k", type=int, default=2048, help="tokens (16 blocks)")
    parser.add_argument("--layout", default="load_balanced", choices=fd.LAYOUTS)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out")
    args = parser.parse_args()

    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
        dtype = torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
        dist.init_process_group("gloo")
    cp = fd.ContextParallel(layout=args.layout)
    S = parse_len(args.seqlen)
    H, Hk, Hp, Hpk = (int(x) for x in args.heads.split(","))
    D = args.dim
    local = S // cp.world
    g = torch.Generator(device=device).manual_seed(1000 + cp.rank)
    randn = lambda *s: torch.randn(*s, device=device, dtype=dtype, generator=g)  # noqa: E731
    leaves = dict(qp=randn(1, Hp, local, D), kp=randn(1, Hpk, local, D), q=randn(1, H, local, D),
                  k=randn(1, Hk, local, D), v=randn(1, Hk, local, D))
    for t in leaves.values():
        t.requires_grad_()
    dout = randn(1, local, H * D)
    kl_out = torch.zeros((), device=device)
    timer = Timer(device)
    state = {}

    def forward():
        state["out"], state["kl"] = fd.msa_func(*leaves.values(), args.top_k, context_parallel=cp,
                                                kl_out=kl_out)

    def backward():
        torch.autograd.backward((state["out"], state["kl"]),
                                (dout, torch.ones((), device=device)))

    def fwd_bwd():
        forward()
        backward()

    step_ms = timer(fwd_bwd, args.steps)
    fwd_ms = timer(forward, args.steps)
    gather_ms = timer(lambda: [cp._gather(leaves[n].detach()) for n in ("kp", "k", "v")],
                      args.steps)
    full = [torch.zeros(1, h, S, D, device=device) for h in (Hpk, Hk, Hk)]
    scatter_ms = timer(lambda: [cp._scatter_sum(t) for t in full], args.steps)
    mine = torch.tensor([step_ms, fwd_ms, gather_ms, scatter_ms], device=device,
                        dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    step_ms, fwd_ms, gather_ms, scatter_ms = mine.tolist()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    report = dict(
        date=datetime.date.today().isoformat(), world=cp.world, layout=args.layout, seqlen=S,
        heads=dict(H=H, Hk=Hk, Hp=Hp, Hpk=Hpk, D=D, Dp=D), top_k=args.top_k,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        backend=dist.get_backend(), step_ms=round(step_ms, 2), forward_ms=round(fwd_ms, 2),
        backward_ms=round(step_ms - fwd_ms, 2), all_gather_kp_k_v_ms=round(gather_ms, 2),
        all_to_all_dkp_dk_dv_ms=round(scatter_ms, 2), kl_value=kl_out.item(),
        peak_memory_gib_rank=None if peak is None else round(peak, 2))
    if cp.rank == 0:
        print(json.dumps(report, indent=1), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    # Every rank's collectives are over before any rank tears its process group down.
    rank = cp.rank
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: finished", flush=True)


if __name__ == "__main__":
    main()
