"""How much an FP8 (E4M3) proxy changes the selection: a CPU study against the bf16 select.

    python3 bench/fp8_select_quality.py --out bench/results/RUN.json [--seqlens 16384,32768]

For each input kind and scale granularity, q_proxy and k_proxy (bf16, RoPE applied) are
quantised to E4M3 with scales amax / 448. The scores are then computed in fp32 from the
dequantised values. An FP8 tensor-core product with fp32 accumulation computes the same values,
up to the order of its sums. The selection follows SPEC section 1: the max score of each block
before the own block, the top K - 1 of them (ties to the lower block), plus the own block. It is
compared with the selection on the bf16 inputs, scored the same way, per row that has more than
K - 1 earlier blocks:
  - overlap: the share of the K - 1 chosen earlier blocks that both selections hold (the own
    block is in both);
  - regret: how far the worst block the FP8 selection took falls below the true (K - 1)-th best
    block score, in units of the standard deviation of the row's block scores (0 when the
    selections agree).

Input kinds:
  - random: normal q_proxy and k_proxy;
  - outliers: the same with 4 of the 128 channels scaled by 20 in both, as activation outliers
    in language models;
  - clustered: the keys of each block share a random centre (keys = centre + 0.5 * noise), so
    that blocks differ as they do in trained models.
Granularities of the scales:
  - tensor: one scale per proxy head for q_proxy and one for k_proxy;
  - token: one scale per token (row of Dp channels) for both;
  - block: one per token for q_proxy, one per 128-key block for k_proxy, so that a key tile of
    the kernel shares one scale.
The paper's proxy heads (Hp = 4 query heads sharing Hpk = 1 key head, Dp = 128) and K = 16 blocks.
Each granularity is also measured with an exact second look: FP8 ranks every block, the best
2 (K - 1) or 4 (K - 1) blocks form a shortlist, and the shortlist is ranked again by the bf16
scores ("<granularity>_rescored_top<M>").
"""

import argparse
import json
import sys
import time

import torch

import flash_msa

BS, HP, HPK, DP, K = 128, 4, 1, 128, 16
FP8_MAX = 448.0
KINDS = ("random", "outliers", "clustered")
GRANULARITIES = ("tensor", "token", "block")
SHORTLISTS = (2, 4)  # FP8 shortlists of 2 (K - 1) and 4 (K - 1) blocks, rescored exactly


def make_inputs(kind, seqlen, gen):
    """q_proxy (1, Hp, S, Dp) and k_proxy (1, Hpk, S, Dp), bf16, RoPE applied."""
    qp = torch.randn(1, HP, seqlen, DP, generator=gen)
    kp = torch.randn(1, HPK, seqlen, DP, generator=gen)
    if kind == "outliers":
        channels = torch.randperm(DP, generator=gen)[:4]
        qp[..., channels] *= 20
        kp[..., channels] *= 20
    elif kind == "clustered":
        centres = torch.randn(1, HPK, (seqlen + BS - 1) // BS, DP, generator=gen)
        kp = centres.repeat_interleave(BS, dim=2)[:, :, :seqlen] + 0.5 * kp
    qp, kp = (flash_msa.apply_rope(x.to(torch.bfloat16), 10000.0) for x in (qp, kp))
    return qp, kp


def fp8(x, granularity, is_key):
    """x (bf16) quantised to E4M3 and dequantised in fp32, with scales of the granularity."""
    x = x.float()
    if granularity == "tensor":
        amax = x.abs().amax(dim=(2, 3), keepdim=True)
    elif granularity == "token" or not is_key:
        amax = x.abs().amax(dim=3, keepdim=True)
    else:  # one scale per 128-key block
        pad = (-x.shape[2]) % BS
        blocks = torch.nn.functional.pad(x, (0, 0, 0, pad)).unflatten(2, (-1, BS))
        amax = blocks.abs().amax(dim=(3, 4), keepdim=True).expand(-1, -1, -1, BS, 1)
        amax = amax.flatten(2, 3)[:, :, : x.shape[2]]
    scale = amax.clamp(min=1e-30) / FP8_MAX
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


def block_scores(qp, kp, rows=512):
    """Per proxy head: (S, blocks) max score of each block strictly before the query's own
    block, -inf elsewhere (fp32 from the given values), on the inputs' device."""
    seqlen, device = qp.shape[2], qp.device
    nb = (seqlen + BS - 1) // BS
    out = torch.full((HP, seqlen, nb), -torch.inf, device=device)
    for p in range(HP):
        k = kp[0, p // (HP // HPK)]
        for i0 in range(0, seqlen, rows):
            i1 = min(seqlen, i0 + rows)
            keys = (i1 - 1) // BS * BS  # keys of every block before the chunk's last own block
            if keys == 0:
                continue
            s = qp[0, p, i0:i1] @ k[:keys].T
            m = s.unflatten(1, (-1, BS)).amax(dim=2)
            own = torch.arange(i0, i1, device=device) // BS
            m = m.masked_fill(torch.arange(m.shape[1], device=device) >= own[:, None], -torch.inf)
            out[p, i0:i1, : m.shape[1]] = m
    return out


def select(scores, count=K - 1):
    """(rows, count): the best `count` earlier blocks of each row, ties to the lower block (a
    stable sort of the negated scores); rows with fewer candidates end in blocks scored -inf."""
    order = torch.sort(-scores, dim=-1, stable=True).indices
    return order[..., :count]


def rescore(true_scores, candidates):
    """The best K - 1 of the given candidate blocks by their true (bf16) scores, ties to the
    lower block: FP8 ranking of every block, then an exact second look at the shortlist."""
    candidates = candidates.sort(dim=-1).values  # block order, so that ties go as in select
    picked = select(true_scores.gather(-1, candidates))
    return candidates.gather(-1, picked)


def compare(true_scores, ref_sel, sel):
    """overlap and regret per row with more than K - 1 earlier blocks."""
    candidates = torch.isfinite(true_scores).sum(-1)
    rows = candidates > K - 1
    t, r, f = true_scores[rows], ref_sel[rows], sel[rows]
    ref_mask = torch.zeros_like(t, dtype=torch.bool).scatter_(1, r, True)
    overlap = ref_mask.gather(1, f).float().mean(1)
    kth = t.gather(1, r).amin(1)  # the true (K-1)-th best score
    worst = t.gather(1, f).amin(1)
    finite = torch.where(torch.isfinite(t), t, torch.nan)
    std = (finite - finite.nanmean(1, keepdim=True)).pow(2).nanmean(1).sqrt()
    regret = ((kth - worst).clamp(min=0) / std.clamp(min=1e-30))
    return overlap, regret


def summary(overlap, regret):
    q = lambda x, p: round(torch.quantile(x, p).item(), 5)
    return {"rows": overlap.numel(), "overlap_mean": round(overlap.mean().item(), 5),
            "overlap_p01": q(overlap, 0.01), "overlap_min": round(overlap.min().item(), 5),
            "rows_identical": round((overlap == 1).float().mean().item(), 5),
            "regret_mean": round(regret.mean().item(), 5), "regret_p99": q(regret, 0.99),
            "regret_max": round(regret.max().item(), 5)}


def study(seqlen, kind, gen):
    qp, kp = make_inputs(kind, seqlen, gen)
    true_scores = block_scores(qp.float(), kp.float()).flatten(0, 1)
    ref = select(true_scores)
    out = {}
    for g in GRANULARITIES:
        scores = block_scores(fp8(qp, g, False), fp8(kp, g, True)).flatten(0, 1)
        out[g] = summary(*compare(true_scores, ref, select(scores)))
        for m in SHORTLISTS:
            shortlist = select(scores, m * (K - 1))
            out[f"{g}_rescored_top{m * (K - 1)}"] = summary(
                *compare(true_scores, ref, rescore(true_scores, shortlist)))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seqlens", default="16384,32768")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    result = {"heads": {"Hp": HP, "Hpk": HPK, "Dp": DP, "K": K}, "fp8": "float8_e4m3fn",
              "torch": torch.__version__, "runs": []}
    for seqlen in (int(s) for s in args.seqlens.split(",")):
        for kind in KINDS:
            t0 = time.monotonic()
            run = {"seqlen": seqlen, "kind": kind, "granularity": study(seqlen, kind, gen)}
            result["runs"].append(run)
            print(f"S={seqlen} {kind}: " + "; ".join(
                f"{g} overlap {v['overlap_mean']:.4f} (p01 {v['overlap_p01']:.3f}), regret p99 "
                f"{v['regret_p99']:.3f}" for g, v in run["granularity"].items())
                + f" [{time.monotonic() - t0:.0f} s]", flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
