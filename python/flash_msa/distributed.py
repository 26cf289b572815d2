"""Context parallelism: MSA over a sequence split across the ranks of a torch.distributed group.

Each rank holds a shard of the tokens of every tensor (the head-major (B, heads, S_local, d)
tensors of :func:`flash_msa.flash_msa_func`, and out (B, S_local, H*D)). The queries stay where
they are; the key side (k_proxy, k, v: 1152 values per token at the paper's heads, against
8192 for q) is all-gathered, each rank selects blocks for and attends from its own queries at
their global positions (the kernels' ``query_offset``: no copy of q), and in the backward the
key-side gradients go back to their owners by an all-to-all summed in rank order, so the result
is bitwise the same run to run. docs/distributed.md has the layouts, the cost model and examples
for ``torchrun`` and a ``DeviceMesh``.

Layouts of the S tokens of a batch row over R ranks (every rank holds S / R tokens):

- ``"load_balanced"`` (the default; Megatron-LM's and TorchTitan's): the sequence is cut into 2R
  chunks and rank r holds chunks r and 2R - 1 - r, so every rank has the same causal work.
- ``"contiguous"``: rank r holds tokens [r S / R, (r + 1) S / R).

``cu_seqlens`` (packed documents) is the global one, over the B * S tokens of the whole batch;
documents may cross shard boundaries. The KL value returned is that of the whole sequence on
every rank (one all-reduce of a scalar). Its backward feeds each rank's own query rows only, so
with the parameters' gradients summed over the group, as for the per-rank parts of the main
loss, the proxy branch gets the single-process gradient.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import ops
from .interface import (
    BLOCK_SIZE,
    _check_all,
    _check_kl_out,
    _check_select_dtype,
    _check_top_k,
    _fail,
    _scales,
)

LAYOUTS = ("load_balanced", "contiguous")
_DTYPE_CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3, torch.float64: 4}


def _resolve_group(group, mesh_dim):
    """A ProcessGroup from a ProcessGroup, a DeviceMesh (and its dimension), or None (WORLD)."""
    if group is not None and hasattr(group, "get_group") and hasattr(group, "mesh"):
        return group.get_group(mesh_dim) if mesh_dim is not None else group.get_group()
    if mesh_dim is not None:
        _fail("ContextParallel: mesh_dim is given but group is not a DeviceMesh")
    return group if group is not None else dist.group.WORLD


@dataclass(frozen=True)
class Segment:
    """A run of a rank's tokens: local tokens [local, local + length) are global positions
    [position, position + length) of the batch row."""

    position: int
    local: int
    length: int


def shard_segments(seqlen: int, world: int, rank: int, layout: str = "load_balanced"):
    """The segments of rank ``rank``'s shard of a ``seqlen``-token sequence over ``world``
    ranks, in local order."""
    if layout not in LAYOUTS:
        _fail(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    parts = 2 * world if layout == "load_balanced" else world
    if seqlen % parts:
        _fail(f"layout {layout!r}: the sequence of {seqlen} tokens must split into {parts} equal "
              f"chunks over {world} ranks (seqlen a multiple of {parts})")
    chunk = seqlen // parts
    if layout == "contiguous":
        return [Segment(rank * chunk, 0, chunk)]
    return [Segment(rank * chunk, 0, chunk), Segment((parts - 1 - rank) * chunk, chunk, chunk)]


class ContextParallel:
    """A context-parallel process group and layout.

    ``group``: a ProcessGroup (None: the default group) or a DeviceMesh with ``mesh_dim`` naming
    its context-parallel dimension (a name or an index; None for a 1-D mesh). ``check``: when
    the ranks' shapes, dtypes, layout and selection size are compared (one small all-gather and
    a host read): ``"first"`` on the first call only (the default: later calls stay free of host
    syncs), ``"always"``, or ``"never"``. A mismatch raises ValueError on every rank rather than
    hanging in a collective of mismatched tensors.
    """

    def __init__(self, group=None, layout: str = "load_balanced", *, mesh_dim=None,
                 check: str = "first"):
        if not dist.is_available() or not dist.is_initialized():
            _fail("ContextParallel: torch.distributed is not initialised "
                  "(call torch.distributed.init_process_group first)")
        if layout not in LAYOUTS:
            _fail(f"ContextParallel: layout: expected one of {LAYOUTS}, got {layout!r}")
        if check not in ("first", "always", "never"):
            _fail(f"ContextParallel: check: expected 'first', 'always' or 'never', got {check!r}")
        self.group = _resolve_group(group, mesh_dim)
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            _fail("ContextParallel: this process is not a member of the group")
        self.world = dist.get_world_size(self.group)
        self.layout = layout
        self.check = check
        self._checked = False

    def segments(self, seqlen: int):
        """This rank's segments of a ``seqlen``-token sequence."""
        return shard_segments(seqlen, self.world, self.rank, self.layout)

    def positions(self, local_len: int, device=None) -> Tensor:
        """The global positions (int64) of this rank's ``local_len`` tokens, e.g. for RoPE."""
        return torch.cat([torch.arange(s.position, s.position + s.length, device=device)
                          for s in self.segments(local_len * self.world)])

    def shard(self, x: Tensor, dim: int = 2) -> Tensor:
        """This rank's shard of a whole-sequence tensor (a view for the contiguous layout)."""
        parts = [x.narrow(dim, s.position, s.length) for s in self.segments(x.shape[dim])]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)

    def unshard(self, x: Tensor, dim: int = 2) -> Tensor:
        """The whole sequence from every rank's shard ``x`` (an all-gather; not differentiable)."""
        return self._gather(x, dim)

    # ---- collectives ----

    def _gather(self, x: Tensor, dim: int = 2) -> Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x, group=self.group)
        seqlen = x.shape[dim] * self.world
        pieces = []
        for r in range(self.world):
            for s in shard_segments(seqlen, self.world, r, self.layout):
                pieces.append((s.position, parts[r].narrow(dim, s.local, s.length)))
        pieces.sort(key=lambda p: p[0])
        return torch.cat([p for _, p in pieces], dim)

    def _scatter_sum(self, full: Tensor, dim: int = 2) -> Tensor:
        """Every rank's part of a whole-sequence tensor, summed over the ranks for each owner:
        an all-to-all, then a sum in rank order (fixed, so bitwise reproducible)."""
        seqlen = full.shape[dim]
        send = torch.stack([
            torch.cat([full.narrow(dim, s.position, s.length)
                       for s in shard_segments(seqlen, self.world, r, self.layout)], dim)
            for r in range(self.world)
        ])
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        total = recv[0].clone()
        for r in range(1, self.world):
            total += recv[r]
        return total

    def _all_reduce(self, x: Tensor) -> Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def _gpus_only(self) -> bool:
        """The group's backend runs CUDA tensors only (NCCL without gloo)."""
        backend = str(dist.get_backend(self.group)).lower()
        return "nccl" in backend and "gloo" not in backend

    def _check_ranks(self, meta: list[int], device: torch.device) -> None:
        """Compares `meta` across the ranks, with a tensor on `device` (the inputs' device,
        which the group's backend runs)."""
        if self.check == "never" or (self.check == "first" and self._checked):
            return
        mine = torch.tensor(meta, dtype=torch.int64, device=device)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        rows = [t.tolist() for t in every]
        names = ("batch", "local tokens", "heads", "kv heads", "proxy heads", "proxy kv heads",
                 "head_dim", "proxy head_dim", "dtype", "top_k blocks", "layout", "cu_seqlens size")
        for r, row in enumerate(rows):
            if row != rows[0]:
                diff = [f"{n}: rank 0 {a}, rank {r} {b}"
                        for n, a, b in zip(names, rows[0], row) if a != b]
                _fail("context parallel: the ranks disagree (shards of unequal length, "
                      "mismatched dtypes or shapes): " + "; ".join(diff))
        self._checked = True


class _ContextParallelMSA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_proxy, k_proxy, q, k, v, cp, top_k_blocks, scale, proxy_scale, cu_seqlens,
                compute_kl, kl_out, fp8):
        seqlen = q.shape[2] * cp.world
        kp_all, k_all, v_all = cp._gather(k_proxy), cp._gather(k), cp._gather(v)
        segments = cp.segments(seqlen)
        outs, saved = [], []
        kl = None
        for s in segments:
            part = slice(s.local, s.local + s.length)
            qp_s, q_s = q_proxy[:, :, part], q[:, :, part]
            indices = None
            if top_k_blocks is not None:
                indices = ops.select(qp_s, kp_all, top_k_blocks, proxy_scale, cu_seqlens,
                                     s.position, fp8)
            out, kl_s, lse, lse_proxy = ops.forward(
                qp_s, kp_all, q_s, k_all, v_all, indices, scale, proxy_scale, cu_seqlens,
                compute_kl, None, s.position)
            outs.append(out)
            saved += [lse, lse_proxy] + ([indices] if indices is not None else [])
            kl = kl_s if kl is None else kl + kl_s
        if compute_kl:
            kl = cp._all_reduce(kl)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
        ctx.save_for_backward(q_proxy, q, kp_all, k_all, v_all, out, cu_seqlens, *saved)
        ctx.cp, ctx.segments, ctx.sparse = cp, segments, top_k_blocks is not None
        ctx.scale, ctx.proxy_scale, ctx.kl_out = scale, proxy_scale, kl_out
        return out, kl

    @staticmethod
    def backward(ctx, dout, kl_grad):
        q_proxy, q, kp_all, k_all, v_all, out, cu_seqlens, *saved = ctx.saved_tensors
        cp = ctx.cp
        per = 3 if ctx.sparse else 2
        kl_parts = [] if ctx.kl_out is not None else None
        dqp, dq = [], []
        dkp_all = dk_all = dv_all = None
        for x, s in enumerate(ctx.segments):
            lse, lse_proxy, *rest = saved[per * x: per * (x + 1)]
            indices = rest[0] if ctx.sparse else None
            part = slice(s.local, s.local + s.length)
            kl_s = None
            if kl_parts is not None:
                kl_s = torch.empty_like(ctx.kl_out)
                kl_parts.append(kl_s)
            dqp_s, dkp_s, dq_s, dk_s, dv_s = ops.backward(
                dout[:, part], kl_grad, q_proxy[:, :, part], kp_all, q[:, :, part], k_all, v_all,
                out[:, part], lse, lse_proxy, indices, ctx.scale, ctx.proxy_scale, cu_seqlens,
                kl_s, s.position)
            dqp.append(dqp_s)
            dq.append(dq_s)
            # The key-side parts in fp32, summed over segments and then ranks in a fixed order.
            if dk_all is None:
                dkp_all, dk_all, dv_all = dkp_s.float(), dk_s.float(), dv_s.float()
            else:
                dkp_all += dkp_s
                dk_all += dk_s
                dv_all += dv_s
        if kl_parts is not None:
            total = kl_parts[0]
            for kl_s in kl_parts[1:]:
                total = total + kl_s
            ctx.kl_out.copy_(cp._all_reduce(total))
        dtype = q.dtype
        dkp = cp._scatter_sum(dkp_all).to(dtype)
        dk = cp._scatter_sum(dk_all).to(dtype)
        dv = cp._scatter_sum(dv_all).to(dtype)
        cat = lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs, 2)  # noqa: E731
        return (cat(dqp), dkp, cat(dq), dk, dv) + (None,) * 8


def msa_func(
    q_proxy: Tensor,
    k_proxy: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    top_k: Optional[int],
    *,
    context_parallel: ContextParallel,
    scale: Optional[float] = None,
    proxy_scale: Optional[float] = None,
    cu_seqlens: Optional[Tensor] = None,
    warmup: bool = False,
    return_kl: bool = True,
    compute_kl: bool = False,
    kl_out: Optional[Tensor] = None,
    select_dtype: Optional[torch.dtype] = None,
):
    """:func:`flash_msa.flash_msa_func` (``warmup=True``: :func:`flash_msa.flash_msa_warmup_func`)
    on this rank's shard of a context-parallel sequence.

    Every tensor is this rank's shard in ``context_parallel``'s layout: q_proxy (B, Hp, S/R, Dp),
    k_proxy (B, Hpk, S/R, Dp), q (B, H, S/R, D), k and v (B, Hk, S/R, D); ``cu_seqlens`` is global
    (over B * S) and the same on every rank. Returns (out (B, S/R, H*D), kl) as flash_msa_func,
    out in the shard's token order, kl (with ``compute_kl``, and ``kl_out`` after the backward)
    the value of the whole sequence. Every rank of the group must call it with the same shapes.
    """
    cp = context_parallel
    if not isinstance(cp, ContextParallel):
        _fail(f"context_parallel: expected a flash_msa.distributed.ContextParallel, got "
              f"{type(cp).__name__}")
    _check_all(q_proxy, k_proxy, q, k, v, cu_seqlens)
    _check_kl_out(kl_out, q)
    top_k_blocks = None if warmup else _check_top_k(top_k) // BLOCK_SIZE
    fp8 = _check_select_dtype(select_dtype, q_proxy)
    local = q.shape[2]
    cp.segments(local * cp.world)  # the layout's constraint on the length
    if cp._gpus_only() and q.device.type != "cuda":
        _fail(f"context parallel: the group's backend is NCCL but the tensors are on {q.device}")
    if cu_seqlens is not None and cu_seqlens.device.type == "cpu":
        total = q.shape[0] * local * cp.world
        if int(cu_seqlens[-1]) != total:
            _fail(f"cu_seqlens: expected the global offsets over batch * seqlen = {total} tokens "
                  f"({cp.world} ranks of {local}), got a last offset of {int(cu_seqlens[-1])}")
    cp._check_ranks([
        q.shape[0], local, q.shape[1], k.shape[1], q_proxy.shape[1], k_proxy.shape[1],
        q.shape[3], q_proxy.shape[3], _DTYPE_CODES[q.dtype], top_k_blocks or 0,
        LAYOUTS.index(cp.layout), -1 if cu_seqlens is None else cu_seqlens.numel(),
    ], q.device)
    main_scale, proxy = _scales(q_proxy, q, scale, proxy_scale)
    out, kl = _ContextParallelMSA.apply(q_proxy, k_proxy, q, k, v, cp, top_k_blocks, main_scale,
                                        proxy, cu_seqlens, bool(compute_kl), kl_out, fp8)
    return (out, kl) if return_kl else out


class ContextParallelLayer:
    """A layer that can run context-parallel: :func:`set_context_parallel` sets its
    ``context_parallel`` (a :class:`ContextParallel`, or None for one process), which the layer
    reads in its forward. :class:`flash_msa.MSAAttention` is one."""

    context_parallel: Optional[ContextParallel] = None


def set_context_parallel(module: torch.nn.Module, context_parallel: Optional[ContextParallel]) -> int:
    """Runs every context-parallel layer in ``module`` (itself included; every
    :class:`flash_msa.MSAAttention`) over ``context_parallel`` (None: back to one process);
    returns how many layers it set. The layers then take their rank's shard of the hidden
    states, in the group's layout, and apply RoPE at the tokens' global positions."""
    if context_parallel is not None and not isinstance(context_parallel, ContextParallel):
        _fail(f"set_context_parallel: expected a ContextParallel or None, got "
              f"{type(context_parallel).__name__}")
    layers = [m for m in module.modules() if isinstance(m, ContextParallelLayer)]
    if not layers:
        _fail(f"set_context_parallel: no MSAAttention in {type(module).__name__}")
    for layer in layers:
        layer.context_parallel = context_parallel
    return len(layers)


__all__ = ["LAYOUTS", "ContextParallel", "ContextParallelLayer", "Segment", "msa_func",
           "set_context_parallel", "shard_segments"]
