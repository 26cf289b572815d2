"""Block selection (SPEC section 1), checked by score against float64 block scores."""

import pytest
import torch

import flash_msa
import reference as ref
from conftest import SHAPES, import_bench, random_inputs


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp8_selection_ranks_the_quantised_scores(shape, dtype):
    """select_dtype=torch.float8_e4m3fn: a top-K of the scores of the proxies as torch's
    float8_e4m3fn quantises them, one amax / 448 scale per token row."""
    inputs = random_inputs(shape, dtype, seed=12)
    for x in ("qp", "kp"):  # token rows of magnitudes 2^-4 .. 2^4
        rows = inputs[x].shape[2]
        inputs[x] = inputs[x] * 2.0 ** (torch.arange(rows) % 9 - 4).to(dtype)[:, None]
    indices = flash_msa.select_blocks(inputs["qp"], inputs["kp"], shape.K, cu_seqlens=shape.cu(),
                                      select_dtype=torch.float8_e4m3fn)
    scores = ref.block_scores(ref.fp8_dequantised(inputs["qp"]), ref.fp8_dequantised(inputs["kp"]),
                              shape.Dp ** -0.5, shape.cu())
    finite = scores[scores.isfinite()].abs().max().item()
    check_selection(indices, scores, shape.K, finite * 1e-5)


def test_fp8_selection_is_an_approximation():
    """On random inputs the FP8 ranking differs from the exact one on some rows, but keeps most
    of its blocks; select_dtype equal to the inputs' dtype is the exact selection."""
    study = import_bench("fp8_select_quality")
    qp, kp = study.make_inputs("random", 4096, torch.Generator().manual_seed(7))
    exact = flash_msa.select_blocks(qp, kp, study.K)
    assert torch.equal(flash_msa.select_blocks(qp, kp, study.K, select_dtype=torch.bfloat16), exact)
    fp8 = flash_msa.select_blocks(qp, kp, study.K, select_dtype=torch.float8_e4m3fn)
    rows = exact[0, :, 128 * study.K:]  # rows with more earlier blocks than K - 1
    shared = (fp8[0, :, 128 * study.K:, :, None] == rows[..., None, :]).any(-1).sum(-1)
    overlap = (shared - 1).double().mean().item() / (study.K - 1)  # the own block aside
    assert not torch.equal(fp8, exact)
    assert 0.9 < overlap < 1


def test_select_dtype_errors():
    qp = torch.randn(1, 1, 256, 16, dtype=torch.bfloat16)
    for bad in (torch.float16, torch.float8_e5m2, "fp8"):
        with pytest.raises(ValueError, match="select_dtype"):
            flash_msa.select_blocks(qp, qp, 2, select_dtype=bad)


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
