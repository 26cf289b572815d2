"""What a proxy selects: statistics of a block selection (docs/training.md reads them for a
trained model; bench/msa_bench.py draws selections that follow them)."""

import torch
from torch import Tensor

from .interface import BLOCK_SIZE, _fail

# Distance buckets (in blocks) of selection_stats: 1, 2, 3-4, 5-8, ... (powers of two).
_EDGES = [1, 2, 3, 5, 9, 17, 33, 65, 129, 257, 513, 1025, 2049, 4097, 8193, 16385]


def selection_stats(indices: Tensor) -> dict:
    """Statistics of a selection ``indices`` int32 (B, Hp, S, K) in the form
    :func:`select_blocks` returns, for a batch without documents (no ``cu_seqlens``). Only the
    rows that see more than K blocks count (the others select every visible block). Returns a
    dict of plain numbers:

    - ``neighbour_overlap``: the share of a token's K blocks that the next token (in the same
      query block) selects too; 1 when neighbours share their selection;
    - ``tile_union_over_k``: the number of blocks that at least one of the 128 tokens of a query
      block selects, over K: 1 when they all select the same blocks, up to 128;
    - ``sink_share``: the share of rows that select block 0;
    - ``distance_buckets``: ``[lo, hi]`` ranges of the distance d = own block - selected block,
      d >= 1: [1, 1], [2, 2], [3, 4], [5, 8], ...;
    - ``distance_share``: the share of the selected blocks other than the own block and block 0
      that fall in each bucket (a histogram);
    - ``select_probability``: per bucket, the probability that a row selects a block at that
      distance (block 0 left out), i.e. the histogram over the number of rows that have a
      block at that distance: what a generator of such selections draws from.
    """
    if not isinstance(indices, Tensor) or indices.dtype != torch.int32 or indices.dim() != 4:
        _fail("selection_stats: indices: expected an int32 tensor (B, Hp, S, K)")
    batch, heads, seqlen, top_k = indices.shape
    own = torch.arange(seqlen, device=indices.device) // BLOCK_SIZE
    counted = own >= top_k
    if not bool(counted.any()):
        _fail(f"selection_stats: no row sees more than K = {top_k} blocks (seqlen {seqlen})")
    sel = indices[:, :, counted].long()                                 # (B, Hp, R, K)
    if bool((sel < 0).any()) or bool((sel > own[counted].view(1, 1, -1, 1)).any()):
        _fail("selection_stats: indices: a row that sees more than K blocks holds -1 or a future "
              "block (a selection with documents, or not from select_blocks)")
    ow = own[counted]
    nb = int(own[-1]) + 1
    chosen = torch.zeros(*sel.shape[:3], nb, dtype=torch.bool, device=sel.device)
    chosen.scatter_(-1, sel, True)
    same_tile = ow[1:] == ow[:-1]
    shared = (chosen[:, :, 1:] & chosen[:, :, :-1])[:, :, same_tile].sum(-1).float()
    first = int(ow[0]) * BLOCK_SIZE           # rows of whole query blocks from here on
    tiles = (seqlen - first) // BLOCK_SIZE
    union = chosen[:, :, : tiles * BLOCK_SIZE].unflatten(2, (tiles, BLOCK_SIZE)).any(3).sum(-1)

    dist = ow.view(1, 1, -1, 1) - sel
    other = (dist > 0) & (sel > 0)            # neither the own block nor block 0
    picked = torch.bincount(dist[other], minlength=nb).double()          # per distance d
    own_count = torch.bincount(ow, minlength=nb).double() * batch * heads
    # Rows with a block at distance d other than block 0: own block >= d + 1.
    having = own_count.flip(0).cumsum(0).flip(0)
    having = torch.cat((having[1:], having.new_zeros(1)))
    edges = [e for e in _EDGES if e < nb] + [nb]
    buckets, share, probability = [], [], []
    total = picked.sum().item()
    for lo, hi in zip(edges[:-1], edges[1:]):
        buckets.append([lo, hi - 1])
        share.append(round(picked[lo:hi].sum().item() / max(total, 1.0), 5))
        probability.append(round(picked[lo:hi].sum().item() / max(having[lo:hi].sum().item(), 1.0), 5))
    return {
        "rows": int(sel.shape[2]) * batch * heads,
        "top_k_blocks": int(top_k),
        "blocks": nb,
        "neighbour_overlap": round(shared.mean().item() / top_k, 4),
        "tile_union_over_k": round(union.float().mean().item() / top_k, 3),
        "sink_share": round(chosen[..., 0].float().mean().item(), 4),
        "distance_buckets": buckets,
        "distance_share": share,
        "select_probability": probability,
    }
