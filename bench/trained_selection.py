"""Selections that look like a trained proxy's, at any shape: a generator fitted to the
statistics that flash_msa.selection_stats measured on the trained example model
(examples/train_lm.py; docs/training.md reads them).

Random inputs make every token pick its own unrelated blocks; a trained proxy picks the own
block, blocks at short distances more often than far ones, a sink block (block 0) and, above all,
the same blocks as its neighbours. The generator reproduces those statistics rather than
replaying the trained model's indices, because the model is smaller (8K tokens, 2 proxy heads,
K = 8) than the benchmark's shape (32K and 128K tokens, 4 proxy heads, K = 16): replayed indices
would not fit, while the statistics are per row and per distance and carry over. It draws, per
(batch, proxy head):
  - segments of neighbouring tokens that share one selection: a new segment starts at every
    query block and after each token with probability 1/L, L fitted to the measured neighbour
    overlap;
  - per segment, block 0 with the measured sink share, the own block, and the rest of the K
    blocks without replacement with weights = the measured probability that a row selects a
    block at that distance (Gumbel top-k); distances beyond the measured range take the weight
    of the farthest bucket.
The statistics of what it draws are measured with the same function and reported next to the
target ones, so the fit can be read in the results.
"""

import json
import math
import os

import torch

import flash_msa

BS = flash_msa.BLOCK_SIZE
STATS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "results",
                          "mqar-8k", "results.json")


def load_target(path=STATS_FILE):
    """The trained model's selection statistics, averaged over its layers."""
    with open(path) as f:
        layers = json.load(f)["runs"]["msa"]["selection_stats"]
    mean = lambda key: sum(s[key] for s in layers) / len(layers)
    buckets = layers[-1]["distance_buckets"]
    prob = [sum(s["select_probability"][i] for s in layers) / len(layers) for i in range(len(buckets))]
    return {"source": os.path.relpath(path), "layers": len(layers),
            "top_k_blocks": layers[-1]["top_k_blocks"], "neighbour_overlap": mean("neighbour_overlap"),
            "tile_union_over_k": mean("tile_union_over_k"), "sink_share": mean("sink_share"),
            "distance_buckets": buckets, "select_probability": prob}


def _log_weights(target, nb, device):
    """log weight per distance d = 0 .. nb-1 (index 0 unused)."""
    w = torch.empty(nb, dtype=torch.float32)
    buckets, prob = target["distance_buckets"], target["select_probability"]
    for d in range(1, nb):
        i = next((j for j, (lo, hi) in enumerate(buckets) if lo <= d <= hi), len(buckets) - 1)
        w[d] = prob[i]
    return w.clamp(min=1e-6).log().to(device)


def _draw(target, batch, heads, seqlen, top_k, new_prob, gen, device):
    nb = (seqlen + BS - 1) // BS
    logw = _log_weights(target, nb, device)
    own = torch.arange(seqlen, device=device) // BS
    starts = torch.rand(batch, heads, seqlen, device=device, generator=gen) < new_prob
    starts[..., ::BS] = True                                    # every query block starts one
    seg = starts.flatten().cumsum(0) - 1                         # segment of each row
    seg_own = own.repeat(batch * heads)[starts.flatten()]        # own block of each segment
    nseg = seg_own.numel()
    sink = torch.rand(nseg, device=device, generator=gen) < target["sink_share"]
    sel = torch.empty(nseg, top_k, dtype=torch.int32, device=device)
    blocks = torch.arange(nb, device=device)
    chunk = max(1, (1 << 26) // nb)
    for c0 in range(0, nseg, chunk):
        o = seg_own[c0:c0 + chunk, None]
        dist = o - blocks
        u = torch.rand(o.shape[0], nb, device=device, generator=gen).clamp(1e-12, 1 - 1e-7)
        score = logw[dist.clamp(min=0)] - torch.log(-torch.log(u))           # Gumbel top-k
        score = torch.where(blocks == 0, torch.where(sink[c0:c0 + chunk, None], 1e9, -math.inf), score)
        score = torch.where(dist == 0, 2e9, score)                            # the own block
        score = torch.where(o < top_k, torch.where(dist >= 0, 3e9, -math.inf), score)  # all visible
        score = score.masked_fill(dist < 0, -math.inf)
        top = score.topk(min(top_k, nb), dim=-1)
        picked = torch.where(top.values > -math.inf, top.indices, nb + 1)
        picked = picked.sort(dim=-1).values
        picked = torch.where(picked > nb, -1, picked).to(torch.int32)
        sel[c0:c0 + chunk, : picked.shape[1]] = picked
        sel[c0:c0 + chunk, picked.shape[1]:] = -1
    return sel[seg].view(batch, heads, seqlen, top_k)


def trained_selection(target, batch, heads, seqlen, top_k, gen, device="cuda"):
    """(indices int32 (B, heads, S, K) in select_blocks' form, {"target", "drawn", "segment_tokens"}).

    Draws once with a new segment at every token to learn the overlap of independent rows, fits
    the mean segment length L to the target's neighbour overlap (overlap = (1 - 1/L) + overlap of
    independent rows / L), and draws again with it."""
    fresh = _draw(target, batch, heads, seqlen, top_k, 1.0, gen, device)
    independent = flash_msa.selection_stats(fresh)["neighbour_overlap"]
    del fresh
    want = min(target["neighbour_overlap"], 0.9999)
    new_prob = 1.0 if want <= independent else (1 - want) / (1 - independent)
    indices = _draw(target, batch, heads, seqlen, top_k, new_prob, gen, device)
    drawn = flash_msa.selection_stats(indices)
    return indices, {"target": target, "segment_tokens": round(1 / new_prob, 2),
                     "independent_rows_overlap": independent, "drawn": drawn}
