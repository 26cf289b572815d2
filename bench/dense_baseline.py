"""Dense causal attention through torch SDPA (cuDNN backend) at MSA's main-branch shape: the
baseline that a sparse MSA training step is compared with. Prints forward and forward+backward
medians (CUDA events) and TFLOP/s counted as 4*B*H*D*S*S/2 (forward, causal), 2.5x for backward.
"""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def median_ms(fn, iters):
    times = []
    for _ in range(iters + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqlen", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    s, h, d = args.seqlen, args.heads, args.head_dim
    q, k, v = (torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def step():
        torch.autograd.backward(fwd(), dout)

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        fwd_ms, step_ms = median_ms(fwd, args.iters), median_ms(step, args.iters)
    flop = 4 * h * d * s * s / 2
    print(f"cudnn dense causal S={s} H={h} D={d}: forward {fwd_ms:.2f} ms "
          f"({flop / fwd_ms / 1e9:.0f} TFLOP/s), forward+backward {step_ms:.2f} ms "
          f"({3.5 * flop / step_ms / 1e9:.0f} TFLOP/s)")


if __name__ == "__main__":
    main()
