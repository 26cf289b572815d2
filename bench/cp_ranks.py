"""Context-parallel ranks simulated on one GPU: every rank's kernel calls (its queries against
the whole key sequence, the kernels' query_offset) run one after another in one process and are
compared with the unsharded computation; their times are recorded.

    python3 bench/cp_ranks.py --out bench/results/RUN.json [--ranks 2,4,8] [--seqlens 128K,1M]

For each sequence length: the whole sequence's select + forward + backward (bf16, random normal
inputs, the KL value from the backward), then for each rank count R and each rank r of the
load-balanced layout (chunks r and 2R - 1 - r) the same three stages on the rank's query
segments, with the gathered key side as input. Checked against the whole computation: the
selections equal exactly; out, lse, dq and dqp on the rank's rows, and dk, dv, dkp summed over
the ranks in fp32, within a relative L2 error of 1e-2 (bf16 outputs of different partial sums);
the KL values summed over the ranks. Heads: the paper's (H=64, Hk=4, Hp=4, Hpk=1, D=Dp=128) up to
128K tokens, H=16, Hk=2, Hp=2 above (so that the whole computation and the comparisons fit in
one GPU's memory at 1M). K = 16 blocks. Times: CUDA events around each rank's calls, after one
warm-up call of the rank; the step time of a rank is its select + forward + backward, which on
R GPUs would run in parallel (the collectives are modelled in docs/distributed.md).

--rank-cost S/R (default 1M/8) adds, on the paper's heads, each rank's step alone at that
length and rank count (its queries against all S keys, as on R GPUs, without the whole
computation, which would not fit) with its peak GPU memory: the per-rank figures of the cost
model in docs/distributed.md.
"""

import argparse
import datetime
import json
import subprocess
import sys

import torch

from flash_msa import ops
from flash_msa.distributed import shard_segments

K, D, DP = 16, 128, 128
SCALE, PROXY_SCALE = D ** -0.5, DP ** -0.5
PAPER_HEADS = (64, 4, 4, 1)
LONG_HEADS = (16, 2, 2, 1)  # above 128K tokens


def parse_len(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1024, "M": 1024 * 1024}.get(text[-1], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def rel_l2(got, want) -> float:
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def step(t, offset, w):
    """select + forward + backward of the queries t["qp"], t["q"], t["dout"] (views of one
    segment) at positions from `offset`, against the whole key side t["kp"], t["k"], t["v"]."""
    qp, q = t["qp"], t["q"]
    idx = ops.select(qp, t["kp"], K, PROXY_SCALE, None, offset)
    out, _, lse, lse_p = ops.forward(qp, t["kp"], q, t["k"], t["v"], idx, SCALE, PROXY_SCALE,
                                     None, False, None, offset)
    kl = torch.zeros((), device="cuda")
    grads = ops.backward(t["dout"], w, qp, t["kp"], q, t["k"], t["v"], out, lse, lse_p, idx,
                         SCALE, PROXY_SCALE, None, kl, offset)
    return dict(idx=idx, out=out, lse=lse, kl=kl,
                **dict(zip(("dqp", "dkp", "dq", "dk", "dv"), grads)))


def segment(t, local: int, length: int) -> dict:
    """Views of the query side of t on its tokens [local, local + length)."""
    rows = slice(local, local + length)
    return dict(t, qp=t["qp"][:, :, rows], q=t["q"][:, :, rows], dout=t["dout"][:, rows])


def timed(fn):
    fn()  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    result = fn()
    end.record()
    torch.cuda.synchronize()
    return result, start.elapsed_time(end)


def run_length(S: int, ranks: list[int]) -> dict:
    H, HK, HP, HPK = PAPER_HEADS if S <= 131072 else LONG_HEADS
    g = torch.Generator(device="cuda").manual_seed(S)
    randn = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa
    t = dict(qp=randn(1, HP, S, DP), kp=randn(1, HPK, S, DP), q=randn(1, H, S, D),
             k=randn(1, HK, S, D), v=randn(1, HK, S, D), dout=randn(1, S, H * D))
    w = torch.tensor(float(HP * S), device="cuda")  # O(1) proxy gradients
    whole, whole_ms = timed(lambda: step(t, 0, w))
    result = dict(seqlen=S, heads=dict(H=H, Hk=HK, Hp=HP, Hpk=HPK, D=D, Dp=DP, K=K),
                  whole_step_ms=round(whole_ms, 2), ranks={})
    print(f"S={S} H={H} Hp={HP}: whole step {whole_ms:.1f} ms", flush=True)
    for R in ranks:
        sums = {n: torch.zeros_like(whole[n], dtype=torch.float32) for n in ("dkp", "dk", "dv")}
        kl, times, worst, same = 0.0, [], {}, True
        for r in range(R):
            segs = shard_segments(S, R, r, "load_balanced")
            parts, ms = timed(lambda: [step(segment(t, s.position, s.length), s.position, w)
                                       for s in segs])
            times.append(round(ms, 2))
            for s, part in zip(segs, parts):
                rows = slice(s.position, s.position + s.length)
                same &= torch.equal(part["idx"], whole["idx"][:, :, rows])
                checks = dict(out=(part["out"], whole["out"][:, rows]))
                for n in ("lse", "dq", "dqp"):
                    checks[n] = (part[n], whole[n][:, :, rows])
                for n, (got, want) in checks.items():
                    worst[n] = max(worst.get(n, 0.0), rel_l2(got, want))
                for n in sums:
                    sums[n] += part[n]
                kl += part["kl"].item()
            del parts
        for n in sums:
            worst[n] = rel_l2(sums[n], whole[n])
        worst = {n: float(f"{e:.3g}") for n, e in worst.items()}
        kl_err = abs(kl - whole["kl"].item()) / abs(whole["kl"].item())
        ok = same and max(worst.values()) < 1e-2 and kl_err < 1e-4
        result["ranks"][str(R)] = dict(rank_step_ms=times, max_rank_step_ms=max(times),
                                       selections_equal=same, rel_l2=worst,
                                       kl_rel_error=float(f"{kl_err:.3g}"), ok=ok)
        print(f"  R={R}: rank steps {times} ms, selections equal {same}, rel L2 {worst}, "
              f"KL rel error {kl_err:.2g} -> {'ok' if ok else 'MISMATCH'}", flush=True)
    return result


def rank_cost(S: int, R: int) -> dict:
    """Each rank's select + forward + backward at S tokens over R ranks, paper heads, with the
    peak memory of its calls (inputs and the gathered key side included)."""
    H, HK, HP, HPK = PAPER_HEADS
    local = S // R
    g = torch.Generator(device="cuda").manual_seed(S + R)
    randn = lambda *s: torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa
    w = torch.tensor(float(HP * S), device="cuda")
    keys = dict(kp=randn(1, HPK, S, DP), k=randn(1, HK, S, D), v=randn(1, HK, S, D))
    times, peaks = [], []
    for r in range(R):
        segs = shard_segments(S, R, r, "load_balanced")
        t = dict(keys, qp=randn(1, HP, local, DP), q=randn(1, H, local, D),
                 dout=randn(1, local, H * D))
        # The rank's query tensors are local: segment s is local rows [s.local, + s.length).
        def run(t=t):
            return [step(segment(t, s.local, s.length), s.position, w) for s in segs]

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        outputs, ms = timed(run)
        times.append(round(ms, 1))
        peaks.append(round(torch.cuda.max_memory_allocated() / 2**30, 2))
        del t, outputs  # before the next rank's peak is measured
    print(f"rank cost S={S} R={R} paper heads: rank steps {times} ms, peak {max(peaks)} GiB",
          flush=True)
    return dict(seqlen=S, ranks=R, heads=dict(H=H, Hk=HK, Hp=HP, Hpk=HPK, D=D, Dp=DP, K=K),
                rank_step_ms=times, max_rank_step_ms=max(times), peak_memory_gib=peaks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--seqlens", default="128K,1M")
    parser.add_argument("--rank-cost", default="1M/8", help="S/R, or 'none'")
    parser.add_argument("--commit", help="the commit measured (default: git rev-parse HEAD)")
    args = parser.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True).stdout.strip()
    runs = [run_length(parse_len(s), ranks) for s in args.seqlens.split(",")]
    cost = None
    if args.rank_cost != "none":
        S, R = args.rank_cost.split("/")
        torch.cuda.empty_cache()
        cost = rank_cost(parse_len(S), int(R))
    report = dict(date=datetime.date.today().isoformat(), commit=commit,
                  device=torch.cuda.get_device_name(), torch=torch.__version__, runs=runs,
                  rank_cost=cost)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0 if all(v["ok"] for run in runs for v in run["ranks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
