"""bench/tile_union.py: the union of a tile's selected blocks, counted on selections whose
unions are known, and the whole study on a short sequence."""

import pytest
import torch

from conftest import import_bench


@pytest.fixture(scope="module")
def study():
    return import_bench("tile_union")


def test_union_of_shared_and_of_disjoint_selections(study):
    K, BS, tile = 2, study.BS, 4
    seqlen = 8 * BS  # rows from block 2 K = 4 on count: 4 blocks of 128 rows, 128 tiles
    own = torch.arange(seqlen) // BS
    shared = torch.stack((own, torch.zeros_like(own)), -1)  # own block and block 0
    # Token i picks its own block (4 or later) and block i % 4: a tile of 4 tokens selects its
    # own block and blocks 0 to 3, 5 blocks.
    disjoint = torch.stack((own, torch.arange(seqlen) % 4), -1)
    for indices, want in ((shared, 1.0), (disjoint, 2.5)):
        u = study.union_over_k(indices.view(1, 1, seqlen, K).to(torch.int32), tile)
        assert u.shape == (1, 1, (seqlen - 2 * K * BS) // tile)
        assert torch.allclose(u, torch.full_like(u, want)), u.unique()
    # Padding (-1, rows that see fewer than K blocks) is no block.
    padded = torch.stack((own, torch.full_like(own, -1)), -1)
    u = study.union_over_k(padded.view(1, 1, seqlen, K).to(torch.int32), tile)
    assert torch.allclose(u, torch.full_like(u, 0.5))


def test_study_on_a_short_sequence(study):
    result = study.run(4 * study.K * study.BS, 4 * study.K * study.BS, log=lambda *_: None)
    sources = result["sources"]
    assert set(sources) == {"per_block", "trained", "independent", "proxy"}
    key = f"share_union_at_most_{study.SMALL_UNION}k"
    for t in map(str, study.TILES):
        block = sources["per_block"]["tiles"][t]
        assert block["union_over_k_mean"] == 1.0 and block[key] == 1.0
        for name in ("trained", "independent", "proxy"):
            s = sources[name]["tiles"][t]
            assert 1.0 < s["union_over_k_mean"] <= int(t), (name, t)
