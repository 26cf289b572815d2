"""How many blocks a query tile would walk (CPU): the case for a query-outer path.

A query-outer kernel runs a tile of T tokens x G heads (the paper's G = 16: 8 tokens fill an
m128 tile) over the union of the blocks its tokens select, masking per token the blocks a token
did not select. Its tensor-core work is the union U times the tile, of which a share K / U is
attention the tokens asked for; the key-outer kernels do only that share, but pay for per-block
partials and their merge (docs/performance.md). So query-outer pays only where tiles have a
small union. This measures U / K per tile of T = 4, 8 and 16 tokens on four kinds of
selections, at the paper's proxy heads (Hp = 4) and K = 16:

  - per_block: one selection per 128-query block (FlexAttention's pattern, the same-mask
    comparison of bench/msa_bench.py): U = K for every tile;
  - trained: bench/trained_selection.py's generator, fitted to the trained example model;
  - independent: the same generator with no runs of shared selections (every token draws its
    own blocks);
  - proxy: select_blocks on random normal bf16 proxies (the CPU backend; --proxy-seqlen tokens,
    as the select is quadratic: under a minute at 32K on two cores).

Rows whose own block is among the first 2 K blocks are left out: they see fewer than 2 K blocks,
so their tiles' unions are small whatever the selection. Writes a JSON result:

    python3 bench/tile_union.py --out bench/results/RUN.json
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import msa_bench  # noqa: E402
import trained_selection  # noqa: E402

import flash_msa  # noqa: E402

BS = flash_msa.BLOCK_SIZE
HP, DP, K = 4, 128, 16
TILES = (4, 8, 16)
SMALL_UNION = 1.5  # U <= 1.5 K: the tiles a hybrid would run query-outer


def union_over_k(indices, tile):
    """(B, Hp, tiles) U / K of each tile of `tile` consecutive tokens, over the rows whose own
    block is 2 K or later (whole tiles only)."""
    batch, heads, seqlen, top_k = indices.shape
    nb = (seqlen + BS - 1) // BS
    first = 2 * top_k * BS
    rows = (seqlen - first) // tile * tile
    sel = indices[:, :, first:first + rows].long()
    chosen = torch.zeros(batch, heads, rows, nb + 1, dtype=torch.bool)
    chosen.scatter_(-1, torch.where(sel < 0, nb, sel), True)  # -1 padding: a spare column
    chosen = chosen[..., :nb]
    return chosen.unflatten(2, (rows // tile, tile)).any(3).sum(-1).float() / top_k


def summary(u):
    u = u.flatten()
    q = lambda p: round(torch.quantile(u, p).item(), 3)  # noqa: E731
    return {"tiles": u.numel(), "union_over_k_mean": round(u.mean().item(), 3),
            "union_over_k_p10": q(0.1), "union_over_k_p50": q(0.5), "union_over_k_p90": q(0.9),
            f"share_union_at_most_{SMALL_UNION}k": round((u <= SMALL_UNION).float().mean().item(), 4)}


def per_block(seqlen, gen):
    """The own block and K - 1 random earlier blocks per 128-query block, every token of it:
    the same-mask comparison's pattern (bench/msa_bench.py)."""
    count, idx = msa_bench.random_block_mask_indices(1, seqlen, gen)
    return msa_bench.per_token_indices(count, idx, seqlen)


def proxy(seqlen, gen):
    qp = torch.randn(1, HP, seqlen, DP, generator=gen).to(torch.bfloat16)
    kp = torch.randn(1, 1, seqlen, DP, generator=gen).to(torch.bfloat16)
    return flash_msa.select_blocks(qp, kp, K)


def run(seqlen, proxy_seqlen, seed=0, log=print):
    gen = torch.Generator().manual_seed(seed)
    target = trained_selection.load_target()
    trained, fit = trained_selection.trained_selection(target, 1, HP, seqlen, K, gen, device="cpu")
    sources = {
        "per_block": per_block(seqlen, gen),
        "trained": trained,
        "independent": trained_selection._draw(target, 1, HP, seqlen, K, 1.0, gen, "cpu"),
    }
    started = time.monotonic()
    sources["proxy"] = proxy(proxy_seqlen, gen)
    log(f"proxy select at {proxy_seqlen} tokens (CPU): {time.monotonic() - started:.1f} s")
    result = {"seqlen": seqlen, "proxy_seqlen": proxy_seqlen, "proxy_heads": HP,
              "top_k_blocks": K, "tile_tokens": list(TILES),
              "trained_fit": {"segment_tokens": fit["segment_tokens"],
                              "neighbour_overlap": fit["drawn"]["neighbour_overlap"]},
              "sources": {}}
    for name, indices in sources.items():
        result["sources"][name] = {
            "neighbour_overlap": flash_msa.selection_stats(indices)["neighbour_overlap"],
            "tiles": {str(t): summary(union_over_k(indices, t)) for t in TILES}}
        for t in TILES:
            s = result["sources"][name]["tiles"][str(t)]
            log(f"{name:12s} T = {t:2d}: U/K mean {s['union_over_k_mean']:.2f}, "
                f"p50 {s['union_over_k_p50']:.2f}, "
                f"tiles with U <= {SMALL_UNION} K {s[f'share_union_at_most_{SMALL_UNION}k']:.3f}")
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seqlen", type=int, default=32768)
    parser.add_argument("--proxy-seqlen", type=int, default=32768)
    args = parser.parse_args()
    if min(args.seqlen, args.proxy_seqlen) < 4 * K * BS:
        raise SystemExit(f"--seqlen and --proxy-seqlen: at least {4 * K * BS} tokens, so that "
                         "half the rows or more see 2 K blocks or more")
    result = run(args.seqlen, args.proxy_seqlen)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
