"""flash-msa against the published Flash-MSA (PyPI flash-msa 0.1.1) on one GPU, in one process,
on the same tensors.

    bash bench/install_flash_msa_peer.sh WHEELS SITE
    PYTHONPATH=SITE:SITE/nvidia_cutlass_dsl/dsl_packages \
        python3 bench/against_flash_msa.py --out bench/results/RUN.json

Flash-MSA installs as a package named flash_msa, as this library does; the install script puts
it under the name flash_msa_peer. bench/msa_bench.py runs the same comparison when that module
is importable. Per shape (Flash-MSA's GH200 figures: S=16K, H=16, Hk=2, Hp=4, Hpk=1; the
paper's heads H=64, Hk=4, Hp=4, Hpk=1 at 32K and 128K; D=Dp=128, top_k 2048 tokens, bf16,
random normal inputs), both through Flash-MSA's documented call
``flash_msa_func(q_proxy, k_proxy, q, k, v, top_k, D ** -0.5)`` and autograd (upstream: a
random gradient of out and 1 for kl):
  - the first step's wall time (Flash-MSA compiles its CuTe DSL kernels on first use);
  - the step: the median of CUDA-event timed steps after warm-up steps on the same inputs
    (Flash-MSA's backward recompiles when the data gives a task count it has not seen);
  - the step's memory growth: peak allocated during the step minus allocated before it;
  - bitwise reproducibility: the gradients of two steps compared bit for bit;
  - the selection: the share of (query, proxy head) rows where both pick the same set of
    blocks (Flash-MSA's select_blocks against select_blocks here); and, given Flash-MSA's
    blocks (this library's sparse_attention over them), the largest difference of out and of
    each gradient, next to the largest value of each.
"""

import argparse
import importlib
import json
import time

import torch

import flash_msa
from timing import time_ms

PEER = "flash_msa_peer"
D, TOP_K = 128, 2048
SHAPES = [  # (name, S, H, Hk, Hp, Hpk)
    ("gh200_16K", 16384, 16, 2, 4, 1),
    ("paper_32K", 32768, 64, 4, 4, 1),
    ("paper_128K", 131072, 64, 4, 4, 1),
]
NAMES = ("q_proxy", "k_proxy", "q", "k", "v")


def load_peer():
    """Flash-MSA's package under its other name, or None where it is not installed."""
    try:
        return importlib.import_module(PEER)
    except ImportError:
        return None


def synced_ms(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def make_inputs(seqlen, heads, kv_heads, proxy_heads, proxy_kv_heads, gen):
    dims = dict(q_proxy=proxy_heads, k_proxy=proxy_kv_heads, q=heads, k=kv_heads, v=kv_heads)
    inputs = {n: torch.randn(1, h, seqlen, D, device="cuda", dtype=torch.bfloat16,
                             generator=gen).requires_grad_() for n, h in dims.items()}
    dout = torch.randn(1, seqlen, heads * D, device="cuda", dtype=torch.bfloat16, generator=gen)
    return inputs, dout


def step(func, inputs, dout):
    """One training step through the documented call; returns out and the five gradients."""
    for t in inputs.values():
        t.grad = None
    out, kl = func(*inputs.values(), TOP_K, D ** -0.5)
    torch.autograd.backward((out, kl), (dout, torch.ones_like(kl)))
    return [out.detach()] + [inputs[n].grad for n in NAMES]


def measure(func, inputs, dout):
    first_ms = synced_ms(lambda: step(func, inputs, dout))
    step_ms = time_ms(lambda: step(func, inputs, dout), iters=10, warmup=3)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    first = step(func, inputs, dout)
    torch.cuda.synchronize()
    growth = torch.cuda.max_memory_allocated() - before
    a = [t.clone() for t in first]
    b = step(func, inputs, dout)
    return {"first_step_s": round(first_ms / 1e3, 2), "step_ms": round(step_ms, 3),
            "memory_growth_gb": round(growth / 1e9, 2),
            "bitwise_reproducible": all(torch.equal(x, y) for x, y in zip(a, b))}


def ascending(indices, num_blocks):
    """Flash-MSA's selection (descending by score, NB where a slot is free) in this library's
    form: ascending, then -1."""
    idx = torch.where((indices < 0) | (indices >= num_blocks), num_blocks, indices)
    idx = idx.sort(dim=-1).values
    return torch.where(idx == num_blocks, -1, idx).to(torch.int32)


def selection_and_same_blocks(peer, inputs, dout, peer_grads):
    qp, kp = inputs["q_proxy"].detach(), inputs["k_proxy"].detach()
    num_blocks = qp.shape[2] // 128
    theirs = ascending(peer.msa_select_cutedsl.select_blocks(
        qp, kp, scale=D ** -0.5, num_blocks=num_blocks, top_k_blocks=TOP_K // 128), num_blocks)
    ours = flash_msa.select_blocks(qp, kp, TOP_K // 128, proxy_scale=D ** -0.5)
    res = {"rows_with_the_same_blocks": round((theirs == ours).all(-1).float().mean().item(), 4)}
    for t in inputs.values():
        t.grad = None
    out, kl = flash_msa.sparse_attention(*inputs.values(), theirs, scale=D ** -0.5)
    torch.autograd.backward((out, kl), (dout, torch.ones_like(kl)))
    mine = [out.detach()] + [inputs[n].grad for n in NAMES]
    res["given_their_blocks"] = {
        name: {"max_abs_diff": round((x.float() - y.float()).abs().max().item(), 6),
               "max_abs": round(y.float().abs().max().item(), 6)}
        for name, x, y in zip(("out",) + tuple(f"d{n}" for n in NAMES), mine, peer_grads)}
    return res


def compare(peer, shapes=SHAPES, log=print):
    gen = torch.Generator(device="cuda").manual_seed(37)
    results = []
    for name, seqlen, heads, kv_heads, proxy_heads, proxy_kv_heads in shapes:
        inputs, dout = make_inputs(seqlen, heads, kv_heads, proxy_heads, proxy_kv_heads, gen)
        res = {"name": name, "seqlen": seqlen, "heads": dict(H=heads, Hk=kv_heads, Hp=proxy_heads,
                                                             Hpk=proxy_kv_heads, D=D, Dp=D),
               "top_k_tokens": TOP_K}
        for label, func in (("flash_msa", flash_msa.flash_msa_func),
                            ("flash_msa_0_1_1", peer.flash_msa_func)):
            try:
                res[label] = measure(func, inputs, dout)
            except Exception as exc:  # noqa: BLE001  (recorded in the results; the run goes on)
                res[label] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            log(f"{name} {label}: {res[label]}")
        if "step_ms" in res["flash_msa"] and "step_ms" in res["flash_msa_0_1_1"]:
            res["speedup"] = round(res["flash_msa_0_1_1"]["step_ms"] / res["flash_msa"]["step_ms"], 2)
            try:
                peer_grads = [t.clone() for t in step(peer.flash_msa_func, inputs, dout)]
                res["selection"] = selection_and_same_blocks(peer, inputs, dout, peer_grads)
            except Exception as exc:  # noqa: BLE001
                res["selection"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            log(f"{name}: speedup {res['speedup']}, selection {res['selection']}")
        results.append(res)
        del inputs, dout
        torch.cuda.empty_cache()
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default="", help="comma-separated subset of shape names")
    args = parser.parse_args()
    peer = load_peer()
    if peer is None:
        raise SystemExit(f"flash_msa_peer: {PEER} is not importable; install it with "
                         "bench/install_flash_msa_peer.sh (see this script's help)")
    wanted = set(filter(None, args.shapes.split(",")))
    shapes = [s for s in SHAPES if not wanted or s[0] in wanted]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": []}
    for shape in shapes:  # written after each shape: a run cut short keeps what it measured
        result["shapes"] += compare(peer, [shape])
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
