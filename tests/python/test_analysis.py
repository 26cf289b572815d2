"""flash_msa.selection_stats on selections whose statistics are known by construction."""

import pytest
import torch

import flash_msa

BS = flash_msa.BLOCK_SIZE


def _rows(seqlen, top_k, pick):
    """A selection (1, 1, S, K): row i holds sorted(pick(i, own block)), padded with -1 where the
    row sees at most K blocks (those rows are not counted)."""
    rows = []
    for i in range(seqlen):
        own = i // BS
        blocks = sorted(pick(i, own)) if own >= top_k else list(range(own + 1))
        rows.append((blocks + [-1] * top_k)[:top_k])
    return torch.tensor(rows, dtype=torch.int32).view(1, 1, seqlen, top_k)


def test_sink_and_own_block():
    s = flash_msa.selection_stats(_rows(8 * BS, 2, lambda i, o: [0, o]))
    assert s["blocks"] == 8 and s["top_k_blocks"] == 2 and s["rows"] == 6 * BS
    assert s["sink_share"] == 1.0 and s["neighbour_overlap"] == 1.0
    assert s["tile_union_over_k"] == 1.0
    assert sum(s["distance_share"]) == 0.0 and sum(s["select_probability"]) == 0.0


def test_previous_block():
    s = flash_msa.selection_stats(_rows(8 * BS, 2, lambda i, o: [o - 1, o]))
    assert s["sink_share"] == 0.0 and s["neighbour_overlap"] == 1.0
    assert s["distance_buckets"][:3] == [[1, 1], [2, 2], [3, 4]]
    assert s["distance_share"][0] == 1.0 and s["select_probability"][0] == 1.0
    assert s["select_probability"][1] == 0.0


def test_alternating_neighbours():
    # Even tokens: own and previous block; odd tokens: own and the one before that.
    s = flash_msa.selection_stats(_rows(8 * BS, 2, lambda i, o: [o - 1 - i % 2, o]))
    assert s["neighbour_overlap"] == 0.5          # only the own block is shared
    assert s["tile_union_over_k"] == 1.5          # own, o-1, o-2 per query block
    # Odd tokens of query block 2 pick block 0: the sink, left out of the distances.
    assert s["sink_share"] == pytest.approx(0.5 / 6, abs=1e-4)
    assert s["distance_share"][0] == pytest.approx(6 / 11, abs=1e-4)  # d=1: 6 of 11 half-tiles
    # d = 1: every counted row has it, half select it; d = 2: rows with own >= 3 (5 of 6
    # tiles), half select it.
    assert s["select_probability"][0] == pytest.approx(0.5)
    assert s["select_probability"][1] == pytest.approx(0.5)


def test_errors():
    good = _rows(4 * BS, 2, lambda i, o: [o - 1, o])
    with pytest.raises(ValueError, match="int32"):
        flash_msa.selection_stats(good.long())
    bad = good.clone()
    bad[0, 0, -1, 0] = -1
    with pytest.raises(ValueError, match="holds -1 or a future block"):
        flash_msa.selection_stats(bad)
    with pytest.raises(ValueError, match="no row sees more than K"):
        flash_msa.selection_stats(_rows(2 * BS, 2, lambda i, o: [o]))
