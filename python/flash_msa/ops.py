"""The torch custom ops of flash_msa (namespace ``flash_msa``) over the C++ extension.

Three ops: ``select`` (proxy top-k block selection), ``forward`` (both branches, sparse over
indices or dense when indices is None) and ``backward``. Each has a fake implementation, so
``torch.compile(fullgraph=True)`` traces through them, and ``forward`` has an autograd formula
that calls ``backward``. None of them reads a tensor value on the host: on CUDA they only
enqueue kernels on the current stream, so they can be captured in a CUDA graph.

The arguments are checked by the public functions in ``interface.py``; these ops are the raw
layer underneath. Their arguments are positional (torch custom ops cannot take tensors as
keyword-only arguments), in the order of the public functions: ``scale``, ``proxy_scale``,
``cu_seqlens``, then ``query_offset``. ``select`` takes ``top_k_blocks`` in blocks of 128 keys
and, last, ``fp8``: rank on FP8 E4M3 scores (the public ``select_dtype=torch.float8_e4m3fn``).

``query_offset`` (0 for a whole sequence) places a shard of the queries: the query-side tensors
(``qp``, ``q``, ``out``, ``dout``, ``lse``, ``lse_proxy``, ``indices``) hold Sq tokens, query i at
position ``query_offset + i`` of the S tokens of the key-side tensors (``kp``, ``k``, ``v``). The
KL value keeps the mean over all B * Hp * S rows, so the shards' values add up, and the key
gradients are the shard's part (``flash_msa.distributed`` sums them over the ranks).

The statistics (kl, lse, lse_proxy, kl_grad) are float32, or float64 for float64 inputs (which
run on the CPU only, in double precision throughout).
"""

from typing import Optional

import torch
from torch import Tensor

from . import _C


def check_indices(indices: Tensor, cu_seqlens: Optional[Tensor], seqlen: int,
                  query_offset: int) -> None:
    """Checks indices made outside the library (flash_msa.check_indices). A plain function, not
    a custom op: on CUDA it waits for the device, so it stays out of compiled graphs."""
    _C.check_indices(indices, cu_seqlens, seqlen, query_offset)


def explain(q_proxy: Tensor, k_proxy: Tensor, q: Tensor, k: Tensor, top_k_blocks: int,
            warmup: bool, kl_value_in_forward: bool, fp8: bool, query_offset: int) -> list:
    """The (stage, variant, reason) triples of a call on CUDA tensors (flash_msa.explain). A plain
    function: it reads shapes and the device, no tensor values."""
    return _C.explain(q_proxy, k_proxy, q, k, top_k_blocks, warmup, kl_value_in_forward, fp8,
                      query_offset)


def _stats_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("flash_msa::select", mutates_args=())
def select(
    qp: Tensor,
    kp: Tensor,
    top_k_blocks: int,
    proxy_scale: float,
    cu_seqlens: Optional[Tensor],
    query_offset: int = 0,
    fp8: bool = False,
) -> Tensor:
    """Indices int32 [B, Hp, Sq, top_k_blocks]: selected blocks ascending, then -1 padding."""
    return _C.select(qp, kp, top_k_blocks, proxy_scale, cu_seqlens, query_offset, fp8)


@select.register_fake
def _select_fake(qp, kp, top_k_blocks, proxy_scale, cu_seqlens, query_offset=0, fp8=False):
    batch, proxy_heads, seqlen, _ = qp.shape
    return qp.new_empty((batch, proxy_heads, seqlen, top_k_blocks), dtype=torch.int32)


@torch.library.custom_op("flash_msa::forward", mutates_args=())
def forward(
    qp: Tensor,
    kp: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    indices: Optional[Tensor],
    scale: float,
    proxy_scale: float,
    cu_seqlens: Optional[Tensor],
    compute_kl: bool,
    kl_out: Optional[Tensor],
    query_offset: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out [B, Sq, H*D], kl 0-dim, lse [B, H, Sq], lse_proxy [B, Hp, Sq]).

    ``indices`` None runs warmup (dense). ``kl`` holds the KL value when ``compute_kl``, else 0
    (its gradient drives the proxy branch either way). ``kl_out`` (0-dim, the statistics'
    dtype) is not read here: the autograd backward passes it to :func:`backward`, which writes
    the KL value into it.
    """
    return _C.forward(
        qp, kp, q, k, v, indices, scale, proxy_scale, cu_seqlens, compute_kl, query_offset
    )


@forward.register_fake
def _forward_fake(
    qp, kp, q, k, v, indices, scale, proxy_scale, cu_seqlens, compute_kl, kl_out, query_offset=0
):
    batch, heads, seqlen, head_dim = q.shape
    stats = _stats_dtype(q)
    return (
        q.new_empty((batch, seqlen, heads * head_dim)),
        q.new_empty((), dtype=stats),
        q.new_empty((batch, heads, seqlen), dtype=stats),
        q.new_empty((batch, qp.shape[1], seqlen), dtype=stats),
    )


@torch.library.custom_op("flash_msa::backward", mutates_args=("kl_out",))
def backward(
    dout: Tensor,
    kl_grad: Optional[Tensor],
    qp: Tensor,
    kp: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    lse_proxy: Tensor,
    indices: Optional[Tensor],
    scale: float,
    proxy_scale: float,
    cu_seqlens: Optional[Tensor],
    kl_out: Optional[Tensor],
    query_offset: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dqp, dkp, dq, dk, dv), contiguous and shaped like qp, kp, q, k, v; writes the KL value
    into ``kl_out`` when given, from the teacher the backward recomputes (equal to the forward's
    value up to rounding), with or without ``kl_grad``.

    Main gradients come from ``dout`` [B, S, H*D]; proxy gradients from the KL weight
    ``kl_grad`` (0-dim on the device; None means 0). Bitwise reproducible: no path uses
    floating-point atomics, and the CPU backend sums per-thread parts in a fixed order.
    """
    return _C.backward(
        dout, kl_grad, qp, kp, q, k, v, out, lse, lse_proxy, indices, scale, proxy_scale,
        cu_seqlens, kl_out, query_offset,
    )


@backward.register_fake
def _backward_fake(dout, kl_grad, qp, kp, q, k, v, *rest):
    return tuple(t.new_empty(t.shape) for t in (qp, kp, q, k, v))


def _forward_setup_context(ctx, inputs, output):
    qp, kp, q, k, v, indices, scale, proxy_scale, cu_seqlens, _, kl_out, query_offset = inputs
    out, _, lse, lse_proxy = output
    ctx.save_for_backward(qp, kp, q, k, v, out, lse, lse_proxy, indices, cu_seqlens)
    # Held outside the saved tensors: every backward writes into it, and a saved tensor's
    # version check would refuse a second backward through the same graph.
    ctx.kl_out = kl_out
    ctx.scale = scale
    ctx.proxy_scale = proxy_scale
    ctx.query_offset = query_offset
    # The statistics are outputs only so that the backward can reuse them.
    ctx.mark_non_differentiable(lse, lse_proxy)
    # An unused output (out or kl) then reaches the backward as None, and the branch it feeds
    # gets no gradient at all rather than zeros: the main loss leaves the index projections'
    # .grad None, and the KL alone leaves the main projections' .grad None.
    ctx.set_materialize_grads(False)


def _forward_backward(ctx, dout, kl_grad, _dlse, _dlse_proxy):
    qp, kp, q, k, v, out, lse, lse_proxy, indices, cu_seqlens = ctx.saved_tensors
    kl_out = ctx.kl_out
    # kl_grad stays a device tensor: the proxy gradients are scaled by it inside the kernels,
    # without a host sync. kl_out, when given, receives the KL value.
    dqp, dkp, dq, dk, dv = backward(
        torch.zeros_like(out) if dout is None else dout, kl_grad, qp, kp, q, k, v, out, lse,
        lse_proxy, indices, ctx.scale, ctx.proxy_scale, cu_seqlens, kl_out, ctx.query_offset,
    )
    if dout is None:
        dq = dk = dv = None
    if kl_grad is None:
        dqp = dkp = None
    return (dqp, dkp, dq, dk, dv, None, None, None, None, None, None, None)


forward.register_autograd(_forward_backward, setup_context=_forward_setup_context)
