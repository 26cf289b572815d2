"""Block indices from outside the library: the same check, error and words on CPU and CUDA
(flash_msa.check_indices, sparse_attention), and no check where select made them."""

import pytest
import torch

import flash_msa
from conftest import NAMES, Shape, random_inputs

CUDA = torch.cuda.is_available() and flash_msa.built_with_cuda()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA"))]
# Documents cut the second batch row at 100: block 0 holds no key of a query at 300 there.
SHAPE = Shape(B=2, S=384, H=4, Hk=2, Hp=2, Hpk=1, D=32, Dp=32, K=3,
              cu_seqlens=(0, 384, 484, 768))
ROW = (1, 1, 300)  # (b, p, i): own block 2, first visible block 0 (document from 384 = row 1, 0)


def valid(device):
    """The inputs (bf16 on CUDA) and select's own indices, which are valid."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = random_inputs(SHAPE, dtype=dtype, seed=11, device=device)
    cu = torch.tensor(SHAPE.cu_seqlens, dtype=torch.int32, device=device)
    return x, cu, flash_msa.select_blocks(x["qp"], x["kp"], SHAPE.K, cu_seqlens=cu)


# How a valid row [0, 1, 2] (own block 2) is broken, and the words of the error.
BROKEN = {
    "future block": ([0, 1, 3], "a block in [0, 2] or -1"),
    "negative": ([-5, 1, 2], "a block in [0, 2] or -1"),
    "huge": ([0, 2**31 - 1, 2], "a block in [0, 2] or -1"),
    "duplicate": ([1, 1, 2], "strictly ascending blocks"),
    "not ascending": ([1, 0, 2], "strictly ascending blocks"),
    "no own block": ([0, 1, -1], "the own block 2"),
    "after padding": ([0, -1, 2], "-1 only after every valid block"),
}


def broken(indices, values):
    out = indices.clone()
    out[ROW] = torch.tensor(values, dtype=torch.int32)
    return out


def error_text(device, values, call):
    x, cu, indices = valid(device)
    with pytest.raises(ValueError) as info:
        call(x, cu, broken(indices, values))
    return str(info.value)


def attend(x, cu, indices, **options):
    return flash_msa.sparse_attention(*(x[n] for n in NAMES), indices, cu_seqlens=cu,
                                      **options)


def check(x, cu, indices):
    flash_msa.check_indices(indices, cu_seqlens=cu)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(BROKEN))
@pytest.mark.parametrize("call", [check, attend], ids=["check_indices", "sparse_attention"])
def test_a_broken_row_is_named_in_the_cpu_backend_s_words(device, kind, call):
    values, words = BROKEN[kind]
    text = error_text(device, values, call)
    assert text.startswith("flash_msa: indices: expected " + words), text
    assert "at (b 1, p 1, i 300)" in text, text
    if device == "cuda":  # the very message of the CPU backend
        assert text == error_text("cpu", values, call)


@pytest.mark.parametrize("device", DEVICES)
def test_a_block_of_another_document_is_refused(device):
    x, _, _ = valid(device)
    # Row 1 holds the documents [0, 256) and [256, 384): query 300 sees blocks 2..2 only.
    cu = torch.tensor((0, 384, 640, 768), dtype=torch.int32, device=device)
    indices = flash_msa.select_blocks(x["qp"], x["kp"], SHAPE.K, cu_seqlens=cu)
    assert indices[1, 0, 300].tolist() == [2, -1, -1]
    indices[1, 0, 300, :2] = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(ValueError) as info:
        flash_msa.check_indices(indices, cu_seqlens=cu)
    assert str(info.value) == ("flash_msa: indices: expected a block holding a key of the "
                               "query's document (blocks 2..2) at (b 1, p 0, i 300), got 1")


@pytest.mark.parametrize("device", DEVICES)
def test_the_first_bad_row_is_reported_as_on_the_cpu(device):
    x, cu, indices = valid(device)
    bad = broken(indices, BROKEN["duplicate"][0])
    bad[0, 1, 5, 0] = 7  # an earlier row (b 0) breaks too
    with pytest.raises(ValueError, match=r"at \(b 0, p 1, i 5\)"):
        flash_msa.check_indices(bad, cu_seqlens=cu)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_offsets_are_reported_before_the_rows(device):
    x, cu, indices = valid(device)
    wrong = torch.tensor((0, 384, 300, 768), dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="flash_msa: cu_seqlens: expected non-decreasing offsets"):
        flash_msa.check_indices(broken(indices, BROKEN["duplicate"][0]), cu_seqlens=wrong)


@pytest.mark.parametrize("device", DEVICES)
def test_valid_indices_pass_and_give_select_s_result(device):
    x, cu, indices = valid(device)
    flash_msa.check_indices(indices, cu_seqlens=cu)
    out, _ = attend(x, cu, indices)
    want, _ = flash_msa.flash_msa_func(*(x[n] for n in NAMES), SHAPE.K * 128, cu_seqlens=cu)
    assert torch.equal(out, want)


@pytest.mark.parametrize("bad", [torch.zeros(2, 2, 3), torch.zeros(2, 2, 3, 1, dtype=torch.int64),
                                 "indices"])
def test_check_indices_refuses_what_is_not_indices(bad):
    with pytest.raises(ValueError, match="flash_msa: indices: expected an int32 tensor"):
        flash_msa.check_indices(bad)


@pytest.mark.parametrize("device", DEVICES)
def test_check_indices_without_documents(device):
    """A regression of the fuzz suite: without cu_seqlens the check failed on its own
    arguments ("tensor does not have a device") instead of checking."""
    x, _, _ = valid(device)
    indices = flash_msa.select_blocks(x["qp"], x["kp"], SHAPE.K)
    flash_msa.check_indices(indices)
    indices[0, 0, 200, 0] = 5
    with pytest.raises(ValueError, match=r"flash_msa: indices: expected a block in \[0, 1\] or -1 "
                                         r"at \(b 0, p 0, i 200\), got 5"):
        flash_msa.check_indices(indices)


@pytest.mark.parametrize("seqlen, query_offset", [(100, None), (384, -1), (384, 1.5), ("384", 0),
                                                  (None, "0"), (500, 200)])
def test_check_indices_refuses_a_shard_outside_the_sequence(seqlen, query_offset):
    _, _, indices = valid("cpu")  # 384 queries
    with pytest.raises(ValueError, match="flash_msa: seqlen: expected ints with 0 <= query_offset"):
        flash_msa.check_indices(indices, seqlen, query_offset=query_offset)


def test_check_indices_of_a_shard():
    """Queries 256.. of a 640-token sequence: their own blocks are 2 to 4."""
    x, _, _ = valid("cpu")
    keys = {n: torch.cat([x[n], x[n][:, :, :256]], dim=2) for n in ("qp", "kp")}
    indices = flash_msa.select_blocks(x["qp"], keys["kp"], SHAPE.K, query_offset=256)
    flash_msa.check_indices(indices, 640, query_offset=256)
    with pytest.raises(ValueError, match=r"expected a block in \[0, 0\] or -1 at \(b 0, p 0, i 0\), "
                                         r"got 1"):
        flash_msa.check_indices(indices, 640)  # read as queries 0.. of the same sequence


@pytest.mark.skipif(not CUDA, reason="no CUDA")
def test_skipping_the_check_captures_a_cuda_graph():
    """check_indices=False: no wait for the device, so the call can be captured."""
    x, cu, indices = valid("cuda")
    flash_msa.check_indices(indices, cu_seqlens=cu)  # once, before the capture
    eager, _ = attend(x, cu, indices, check_indices=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attend(x, cu, indices, check_indices=False)  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = attend(x, cu, indices, check_indices=False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
