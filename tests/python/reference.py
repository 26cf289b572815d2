"""An eager PyTorch implementation of docs/spec.md, written from the formulas with dense masks.

Run in float64 it is the reference; run in bfloat16/float16 it is the "plain PyTorch
implementation" whose error sets the tolerance (SPEC section 6). Shapes are Flash-MSA's:
inputs (B, heads, S, D), out (B, S, H*D). Gradients come from autograd through ``msa``: the
teacher is detached, so q/k/v get gradients only through out and the proxy only through kl.
"""

from typing import Optional

import torch
from torch import Tensor

BLOCK = 128


def doc_ids(batch: int, seqlen: int, cu_seqlens: Optional[Tensor]) -> Tensor:
    """Document id of every token, (B, S); one document per batch row without cu_seqlens."""
    if cu_seqlens is None:
        return torch.arange(batch)[:, None].expand(batch, seqlen)
    token = torch.arange(batch * seqlen)
    starts = cu_seqlens.cpu().long()[:-1]
    return (torch.searchsorted(starts, token, right=True) - 1).view(batch, seqlen)


def visible(batch: int, seqlen: int, cu_seqlens: Optional[Tensor]) -> Tensor:
    """(B, 1, S, S) bool: key j visible to query i (causal and same document)."""
    doc = doc_ids(batch, seqlen, cu_seqlens)
    causal = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
    return (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]


def proxy_scores(qp: Tensor, kp: Tensor, proxy_scale: float) -> Tensor:
    """s(p, i, j) = proxy_scale * <qp[p, i], kp[pk(p), j]>, (B, Hp, S, S)."""
    kp = kp.repeat_interleave(qp.shape[1] // kp.shape[1], dim=1)
    return (qp @ kp.transpose(-1, -2)) * proxy_scale


def fp8_dequantised(x: Tensor) -> Tensor:
    """x (float) as the FP8 select scores it: each token row quantised to torch.float8_e4m3fn
    with the scale amax / 448 (1 for a row of zeros), then dequantised, in float64."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (x / scale).to(torch.float8_e4m3fn).double() * scale.double()


def block_scores(qp: Tensor, kp: Tensor, proxy_scale: float, cu_seqlens=None) -> Tensor:
    """m(p, i, n) in float64, (B, Hp, S, NB): +inf on the own block, -inf without visible keys."""
    batch, _, seqlen, _ = qp.shape
    nb = (seqlen + BLOCK - 1) // BLOCK
    s = proxy_scores(qp.double(), kp.double(), proxy_scale)
    s = s.masked_fill(~visible(batch, seqlen, cu_seqlens), float("-inf"))
    pad = nb * BLOCK - seqlen
    s = torch.nn.functional.pad(s, (0, pad), value=float("-inf"))
    m = s.view(*s.shape[:3], nb, BLOCK).amax(-1)
    own = torch.arange(seqlen) // BLOCK
    m[:, :, torch.arange(seqlen), own] = float("inf")
    return m


def select(scores: Tensor, top_k: int) -> Tensor:
    """Top-k blocks per row of block scores, ties to the lower index, ascending then -1."""
    nb = scores.shape[-1]
    # A stable descending sort keeps equal scores in index order: the lower block wins a tie.
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    k = min(top_k, nb)
    chosen = order[..., :k]
    taken = torch.gather(scores, -1, chosen) > float("-inf")
    chosen = torch.where(taken, chosen, nb)  # nb sorts after every block and marks a free slot
    chosen = chosen.sort(dim=-1).values
    chosen = torch.where(chosen == nb, -1, chosen)
    if top_k > k:
        chosen = torch.nn.functional.pad(chosen, (0, top_k - k), value=-1)
    return chosen.to(torch.int32)


def attended(indices: Optional[Tensor], batch: int, seqlen: int, cu_seqlens=None) -> Tensor:
    """T(p, i) as a (B, Hp or 1, S, S) bool mask; indices None means warmup (all visible keys)."""
    vis = visible(batch, seqlen, cu_seqlens)
    if indices is None:
        return vis
    nb = (seqlen + BLOCK - 1) // BLOCK
    idx = indices.cpu().long()
    sel = torch.zeros(*idx.shape[:3], nb + 1, dtype=torch.bool)
    sel.scatter_(-1, torch.where(idx < 0, nb, idx), True)
    key_block = torch.arange(seqlen) // BLOCK
    return vis & sel[..., :nb][..., key_block]


def msa(qp, kp, q, k, v, mask: Tensor, scale: float, proxy_scale: float):
    """Both branches over the attended mask, in the dtype of the inputs.

    Returns (out (B, S, H*D), lse (B, H, S), lse_proxy (B, Hp, S), kl 0-dim).
    """
    batch, heads, seqlen, head_dim = q.shape
    proxy_heads = qp.shape[1]
    group = heads // proxy_heads
    mask = mask.to(q.device)
    main_mask = mask.expand(batch, proxy_heads, seqlen, seqlen).repeat_interleave(group, dim=1)
    kk = k.repeat_interleave(heads // k.shape[1], dim=1)
    vv = v.repeat_interleave(heads // v.shape[1], dim=1)
    a = ((q @ kk.transpose(-1, -2)) * scale).masked_fill(~main_mask, float("-inf"))
    # The statistics are fp32 at least, as a kernel keeps them.
    stat = torch.promote_types(q.dtype, torch.float32)
    lse = torch.logsumexp(a.to(stat), dim=-1)
    p = torch.softmax(a, dim=-1)
    out = (p @ vv).transpose(1, 2).reshape(batch, seqlen, heads * head_dim)

    teacher = p.detach().view(batch, proxy_heads, group, seqlen, seqlen).mean(2)
    s = proxy_scores(qp, kp, proxy_scale).masked_fill(~mask, float("-inf"))
    lse_proxy = torch.logsumexp(s.to(stat), dim=-1)
    log_student = torch.log_softmax(s, dim=-1)
    # 0 * log 0 terms are 0 (SPEC section 3); where() keeps their gradient at 0 as well.
    terms = torch.where(teacher > 0, teacher * (teacher.log() - log_student), 0)
    kl = terms.sum() / (batch * proxy_heads * seqlen)
    return out, lse, lse_proxy, kl


def msa_with_grads(inputs: dict, mask: Tensor, scale: float, proxy_scale: float, dout: Tensor,
                   kl_weight: float, dtype: torch.dtype):
    """Runs ``msa`` in ``dtype`` on leaf copies of inputs {qp, kp, q, k, v} and returns
    (out, lse, lse_proxy, kl, grads) with grads of sum(out * dout) + kl_weight * kl."""
    leaves = {n: t.detach().to(dtype).requires_grad_() for n, t in inputs.items()}
    out, lse, lse_proxy, kl = msa(*(leaves[n] for n in ("qp", "kp", "q", "k", "v")), mask,
                                  scale, proxy_scale)
    loss = (out * dout.to(dtype)).sum() + kl_weight * kl
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return out, lse, lse_proxy, kl, dict(zip(leaves, grads))
