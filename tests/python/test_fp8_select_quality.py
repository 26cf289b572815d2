"""bench/fp8_select_quality.py: its bf16 reference selects what flash_msa.select_blocks selects,
and the FP8 comparison reports full agreement exactly when the scores agree."""

import pytest
import torch

import flash_msa
from conftest import import_bench


@pytest.fixture(scope="module")
def study():
    return import_bench("fp8_select_quality")


@pytest.mark.parametrize("kind", ["random", "outliers", "clustered"])
def test_reference_selection_is_select_blocks(study, kind):
    gen = torch.Generator().manual_seed(3)
    qp, kp = study.make_inputs(kind, 3000, gen)
    scores = study.block_scores(qp.float(), kp.float())          # (Hp, S, blocks)
    ours = study.select(scores)
    theirs = flash_msa.select_blocks(qp, kp, study.K)[0]         # (Hp, S, K), own block last
    for p in range(study.HP):
        for i in range(0, 3000, 7):
            own = i // study.BS
            want = sorted(b for b in theirs[p, i].tolist() if 0 <= b < own)
            got = sorted(b for b in ours[p, i].tolist() if torch.isfinite(scores[p, i, b]))
            assert got == want, (p, i)


def test_comparison_measures_disagreement(study):
    gen = torch.Generator().manual_seed(4)
    qp, kp = study.make_inputs("random", 4096, gen)
    true = study.block_scores(qp.float(), kp.float()).flatten(0, 1)
    ref = study.select(true)
    overlap, regret = study.compare(true, ref, ref)
    assert overlap.numel() > 0 and (overlap == 1).all() and (regret == 0).all()
    # A selection of the worst candidates overlaps little and regrets a lot.
    worst = study.select(torch.where(torch.isfinite(true), -true, -torch.inf))
    overlap, regret = study.compare(true, ref, worst)
    assert overlap.mean() < 0.5 and regret.mean() > 1
    # FP8 with per-token scales stays close on random inputs.
    fp8 = study.block_scores(study.fp8(qp, "token", False), study.fp8(kp, "token", True))
    overlap, _ = study.compare(true, ref, study.select(fp8.flatten(0, 1)))
    assert 0.8 < overlap.mean() < 1


def test_rescoring_a_shortlist_recovers_the_selection(study):
    """The exact second look over an FP8 shortlist of 4 (K - 1) blocks can only do better than
    the FP8 ranking alone, and with the true scores as the shortlist it is exact."""
    gen = torch.Generator().manual_seed(5)
    qp, kp = study.make_inputs("random", 4096, gen)
    true = study.block_scores(qp.float(), kp.float()).flatten(0, 1)
    ref = study.select(true)
    exact, _ = study.compare(true, ref, study.rescore(true, study.select(true, 4 * (study.K - 1))))
    assert (exact == 1).all()
    fp8 = study.block_scores(study.fp8(qp, "token", False),
                             study.fp8(kp, "token", True)).flatten(0, 1)
    plain, _ = study.compare(true, ref, study.select(fp8))
    shortlisted, _ = study.compare(true, ref,
                                   study.rescore(true, study.select(fp8, 4 * (study.K - 1))))
    assert shortlisted.mean() > plain.mean()
