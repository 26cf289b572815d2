"""Context-parallel training of an MSA layer with torchrun and a DeviceMesh.

    torchrun --nproc-per-node 8 examples/context_parallel.py --seqlen 128K
    torchrun --nproc-per-node 2 examples/context_parallel.py --device cpu --seqlen 2K  # gloo

Each rank holds its shard of every sequence (the load-balanced layout); the MSA layer gathers the
key side inside its call, and the gradients of the layer's parameters are summed over the
context-parallel group after the backward, as a data-parallel gradient all-reduce would. Every
rank draws the same whole batch from one seed and takes its shard, so the run equals one process
on the whole sequence; the loss and the KL value printed are those of the whole sequence.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import flash_msa
from flash_msa import distributed as fd


def parse_len(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1024, "M": 1024 * 1024}.get(text[-1], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlen", default="32K")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = parser.parse_args()

    world = int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
        device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        device, dtype = torch.device("cpu"), torch.float32
    cp = fd.ContextParallel(mesh, mesh_dim="cp")  # TorchTitan style; or ContextParallel(group)

    torch.manual_seed(0)  # the same parameters on every rank
    hidden_size, S = 512, parse_len(args.seqlen)
    layer = flash_msa.MSAAttention(hidden_size, 8, 2, 64, 2, 1, 64, top_k=1024,
                                   device=device, dtype=dtype)
    fd.set_context_parallel(layer, cp)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    for step in range(args.steps):
        g = torch.Generator(device=device).manual_seed(step)  # one batch, drawn by every rank
        batch = torch.randn(1, S, hidden_size, device=device, dtype=dtype, generator=g)
        target = torch.randn(1, S, hidden_size, device=device, dtype=dtype, generator=g)
        hidden, want = cp.shard(batch, dim=1), cp.shard(target, dim=1)

        out, kl = layer(hidden)
        # This rank's part of the whole sequence's mean squared error; kl is the whole value.
        loss = (out.float() - want.float()).square().sum() / target.numel() + 0.1 * kl
        loss.backward()
        for p in layer.parameters():  # the gradient of the whole sequence
            dist.all_reduce(p.grad, group=cp.group)
        optimizer.step()
        optimizer.zero_grad()

        whole = loss.detach() - 0.1 * kl.detach()
        dist.all_reduce(whole, group=cp.group)
        if cp.rank == 0:
            print(f"step {step}: mse {whole.item():.5f}, KL {layer.kl_value.item():.4f}",
                  flush=True)
    # Every rank's collectives are over before any rank tears its process group down.
    rank = cp.rank
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: finished", flush=True)


if __name__ == "__main__":
    main()
