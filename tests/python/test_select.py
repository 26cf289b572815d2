"""Block selection (SPEC section 1), checked by score against float64 block scores."""

import pytest
import torch

import flash_msa
import reference as ref
from conftest import SHAPES, random_inputs


def check_selection(indices: torch.Tensor, scores: torch.Tensor, top_k: int, tol: float) -> None:
    """Per row: valid entries strictly ascending then -1s, the own block present, as many valid
    entries as min(K, visible blocks), each selected block visible and scoring at least the
    K-th best score minus `tol`. `scores` are the float64 block scores (B, Hp, S, NB)."""
    indices = indices.cpu().long()
    seqlen, nb = scores.shape[2], scores.shape[3]
    assert indices.shape == (*scores.shape[:3], top_k)
    valid = indices >= 0
    assert ((indices >= -1) & (indices < nb)).all(), "entry out of [-1, NB)"
    assert (valid[..., 1:] <= valid[..., :-1]).all(), "-1 before a valid entry"
    pairs = valid[..., 1:] & valid[..., :-1]
    assert (indices[..., 1:] > indices[..., :-1])[pairs].all(), "valid entries not ascending"
    own = (torch.arange(seqlen) // 128)[:, None]
    assert (indices == own).any(-1).all(), "own block missing"
    visible = (scores > float("-inf")).sum(-1)
    assert torch.equal(valid.sum(-1), visible.clamp(max=top_k)), "wrong number of valid entries"
    picked = torch.gather(scores, -1, indices.clamp(min=0))
    assert (picked[valid] > float("-inf")).all(), "selected a block without visible keys"
    kth = scores.sort(-1, descending=True).values[..., min(top_k, nb) - 1 : min(top_k, nb)]
    short = (picked < kth - tol) & valid
    assert not short.any(), f"{int(short.sum())} selected blocks score below the K-th best"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_selection_by_score(shape, dtype):
    inputs = random_inputs(shape, dtype, seed=11)
    proxy_scale = shape.Dp ** -0.5
    indices = flash_msa.select_blocks(inputs["qp"], inputs["kp"], shape.K, cu_seqlens=shape.cu())
    assert indices.dtype == torch.int32
    scores = ref.block_scores(inputs["qp"], inputs["kp"], proxy_scale, shape.cu())
    finite = scores[scores.isfinite()].abs().max().item()
    # A kernel may rank scores rounded to the input dtype (as Flash-MSA does): allow that much.
    tol = finite * (2.0 ** -7 if dtype != torch.float32 else 1e-5)
    check_selection(indices, scores, shape.K, tol)


def test_selection_matches_reference_on_distinct_scores():
    """fp32 inputs with well-separated block scores: the exact reference selection."""
    shape = SHAPES[0].with_(S=1024, K=3)
    inputs = random_inputs(shape, torch.float32, seed=12)
    indices = flash_msa.select_blocks(inputs["qp"], inputs["kp"], shape.K)
    scores = ref.block_scores(inputs["qp"], inputs["kp"], shape.Dp ** -0.5)
    assert torch.equal(indices, ref.select(scores, shape.K))


def test_ties_go_to_the_lower_block():
    shape = SHAPES[0].with_(S=700, K=3)
    inputs = random_inputs(shape, torch.float32, seed=13)
    kp = torch.zeros_like(inputs["kp"])  # every visible score is exactly 0
    indices = flash_msa.select_blocks(inputs["qp"], kp, shape.K)
    want = ref.select(ref.block_scores(inputs["qp"], kp, 1.0), shape.K)
    assert torch.equal(indices, want)
    # Query 650 (block 5) with every score tied keeps the lowest blocks besides its own.
    assert indices[0, 0, 650].tolist() == [0, 1, 5]


def test_positive_proxy_scale_does_not_change_the_ranking():
    shape = SHAPES[3]
    inputs = random_inputs(shape, torch.float32, seed=14)
    a = flash_msa.select_blocks(inputs["qp"], inputs["kp"], shape.K, cu_seqlens=shape.cu())
    b = flash_msa.select_blocks(inputs["qp"], inputs["kp"], shape.K, proxy_scale=4.0,
                                cu_seqlens=shape.cu())
    assert torch.equal(a, b)
