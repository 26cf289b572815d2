"""MSAAttention: a GQA attention layer with the MSA proxy (index) branch."""

import math
from typing import Optional

import torch
from torch import Tensor, nn

from .distributed import ContextParallelLayer, msa_func
from .interface import _check_top_k, _integer, flash_msa_func, flash_msa_warmup_func


def apply_rope(x: Tensor, base: float, positions: Optional[Tensor] = None) -> Tensor:
    """NeoX-style rotary embedding of x (B, heads, S, d) at positions 0..S-1, or at
    ``positions`` (S integers; a context-parallel shard's global positions).

    Channel c < d/2 is rotated with channel c + d/2 at frequency base**(-2c/d); the angles and
    the rotation are computed in fp32 (float64 stays float64). With packed documents the positions still count from the
    start of the batch row: attention never crosses a document and RoPE scores depend only on
    i - j, so per-document positions would give the same scores.
    """
    seqlen, dim = x.shape[2], x.shape[3]
    half = dim // 2
    compute = torch.promote_types(x.dtype, torch.float32)
    inv_freq = base ** (-torch.arange(half, device=x.device, dtype=compute) / half)
    if positions is None:
        positions = torch.arange(seqlen, device=x.device)
    angles = positions.to(device=x.device, dtype=compute)[:, None] * inv_freq
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.to(compute).chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


def _size(name: str, value) -> int:
    size = _integer(value)
    if size is None or size < 1:
        raise ValueError(f"flash_msa: MSAAttention: {name}: expected an int >= 1, got {value!r}")
    return size


class MSAAttention(nn.Module, ContextParallelLayer):
    """hidden (B, S, hidden_size) -> (out (B, S, hidden_size), kl_loss).

    Main branch: q/k/v projections (num_heads query heads sharing num_kv_heads key/value heads,
    head_dim each), RoPE, MSA attention, output projection. Proxy branch: q/k index projections
    (num_proxy_heads heads sharing num_proxy_kv_heads key heads, proxy_head_dim each) with RoPE,
    fed from ``hidden.detach()`` so the KL trains only the index projections (the paper's
    gradient detach). Add ``kl_loss`` (times a weight) to the training loss; ``warmup=True``
    (or :func:`set_warmup` on a whole model) runs the dense warmup phase. ``top_k`` counts tokens (a multiple of 128); it and
    every argument after it are keyword-only.

    The KL value: every backward writes it into the buffer ``kl_value`` (0-dim fp32, float64
    for a float64 module; NaN until the first backward), from the teacher the backward
    recomputes, at a few percent of the step. ``compute_kl=True`` also makes the returned
    ``kl_loss`` hold it right after the forward, at the cost of an extra pass; by default
    ``kl_loss`` is 0 in value and only carries the proxy gradient.

    ``select_dtype=torch.float8_e4m3fn`` ranks the blocks on FP8 scores in sparse mode
    (:func:`flash_msa.select_blocks`); warmup selects nothing and ignores it.

    Context parallelism: after :func:`flash_msa.distributed.set_context_parallel` the layer
    takes this rank's shard of the hidden states (in the group's layout), applies RoPE at the
    tokens' global positions and runs :func:`flash_msa.distributed.msa_func`; ``cu_seqlens``
    is then the global one (docs/distributed.md).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        num_proxy_heads: Optional[int] = None,
        num_proxy_kv_heads: int = 1,
        proxy_head_dim: Optional[int] = None,
        *,
        top_k: int = 2048,
        rope_base: float = 10000.0,
        warmup: bool = False,
        bias: bool = False,
        compute_kl: bool = False,
        select_dtype: Optional[torch.dtype] = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        num_proxy_heads = num_kv_heads if num_proxy_heads is None else num_proxy_heads
        proxy_head_dim = head_dim if proxy_head_dim is None else proxy_head_dim
        hidden_size, head_dim = _size("hidden_size", hidden_size), _size("head_dim", head_dim)
        num_heads, num_kv_heads = _size("num_heads", num_heads), _size("num_kv_heads", num_kv_heads)
        num_proxy_heads = _size("num_proxy_heads", num_proxy_heads)
        num_proxy_kv_heads = _size("num_proxy_kv_heads", num_proxy_kv_heads)
        proxy_head_dim = _size("proxy_head_dim", proxy_head_dim)
        for name, a, b in (
            ("num_heads", num_heads, num_kv_heads),
            ("num_heads", num_heads, num_proxy_heads),
            ("num_proxy_heads", num_proxy_heads, num_proxy_kv_heads),
        ):
            if a % b:
                raise ValueError(f"flash_msa: MSAAttention: {name} ({a}) must be a multiple of {b}")
        if head_dim % 2 or proxy_head_dim % 2:
            raise ValueError(
                f"flash_msa: MSAAttention: RoPE needs even head dims, got head_dim {head_dim}, "
                f"proxy_head_dim {proxy_head_dim}"
            )
        top_k = _check_top_k(top_k, "MSAAttention: ")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.num_proxy_heads, self.num_proxy_kv_heads = num_proxy_heads, num_proxy_kv_heads
        self.proxy_head_dim = proxy_head_dim
        self.top_k, self.rope_base, self.warmup = top_k, rope_base, warmup
        self.compute_kl, self.select_dtype = compute_kl, select_dtype
        factory = dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, **factory)
        self.q_proxy_proj = nn.Linear(hidden_size, num_proxy_heads * proxy_head_dim, bias=bias, **factory)
        self.k_proxy_proj = nn.Linear(hidden_size, num_proxy_kv_heads * proxy_head_dim, bias=bias, **factory)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias, **factory)
        self.context_parallel = None  # a flash_msa.distributed.ContextParallel, or None
        stats = torch.float64 if dtype == torch.float64 else torch.float32
        self.register_buffer("kl_value", torch.full((), math.nan, dtype=stats, device=device),
                             persistent=False)

    def _apply(self, fn, recurse=True):
        # .to(), .half(), .cuda() ... apply to the buffer too; keep it in a statistics dtype.
        super()._apply(fn, recurse)
        if self.kl_value.dtype not in (torch.float32, torch.float64):
            self.kl_value = self.kl_value.float()
        return self

    @staticmethod
    def _heads(x: Tensor, heads: int) -> Tensor:
        # (B, S, heads*d) -> (B, heads, S, d) as a strided view: the kernels take the strides.
        return x.unflatten(-1, (heads, -1)).transpose(1, 2)

    def projections(self, hidden: Tensor, positions: Optional[Tensor] = None
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(q_proxy, k_proxy, q, k, v) head-major, RoPE applied to all but v (at ``positions``,
        by default 0..S-1); the proxy ones from ``hidden.detach()``: what the attention call
        gets."""
        def rope(x):
            return apply_rope(x, self.rope_base, positions)

        q = rope(self._heads(self.q_proj(hidden), self.num_heads))
        k = rope(self._heads(self.k_proj(hidden), self.num_kv_heads))
        v = self._heads(self.v_proj(hidden), self.num_kv_heads)
        detached = hidden.detach()
        q_proxy = rope(self._heads(self.q_proxy_proj(detached), self.num_proxy_heads))
        k_proxy = rope(self._heads(self.k_proxy_proj(detached), self.num_proxy_kv_heads))
        return q_proxy, k_proxy, q, k, v

    def forward(self, hidden: Tensor, cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        hidden_size = self.q_proj.in_features
        if not isinstance(hidden, Tensor) or hidden.dim() != 3 or hidden.shape[-1] != hidden_size:
            got = (f"shape {tuple(hidden.shape)}" if isinstance(hidden, Tensor)
                   else type(hidden).__name__)
            raise ValueError(
                f"flash_msa: MSAAttention: hidden: expected a 3-D tensor (B, S, hidden_size="
                f"{hidden_size}), got {got}"
            )
        cp = self.context_parallel
        if cp is not None:
            q_proxy, k_proxy, q, k, v = self.projections(
                hidden, cp.positions(hidden.shape[1], hidden.device))
            out, kl = msa_func(
                q_proxy, k_proxy, q, k, v, self.top_k, context_parallel=cp,
                cu_seqlens=cu_seqlens, warmup=self.warmup, compute_kl=self.compute_kl,
                kl_out=self.kl_value, select_dtype=self.select_dtype,
            )
            return self.o_proj(out), kl
        q_proxy, k_proxy, q, k, v = self.projections(hidden)
        sparse = {} if self.warmup else {"select_dtype": self.select_dtype}
        attend = flash_msa_warmup_func if self.warmup else flash_msa_func
        out, kl = attend(
            q_proxy, k_proxy, q, k, v, self.top_k, cu_seqlens=cu_seqlens,
            compute_kl=self.compute_kl, kl_out=self.kl_value, **sparse,
        )
        return self.o_proj(out), kl


def set_warmup(module: nn.Module, enabled: bool) -> int:
    """Switches every MSAAttention in ``module`` (itself included) to the dense warmup phase
    (``enabled=True``) or to sparse attention (False); returns how many layers it set.

    Under ``torch.compile`` each phase compiles once: the phase is a Python attribute that the
    compiled graph is guarded on, so the first step after a switch compiles the other phase's
    graph and later switches reuse both (tests/python/test_compile.py)."""
    if not isinstance(enabled, bool):
        raise ValueError(f"flash_msa: set_warmup: enabled: expected a bool, got {enabled!r}")
    layers = [m for m in module.modules() if isinstance(m, MSAAttention)]
    if not layers:
        raise ValueError(f"flash_msa: set_warmup: no MSAAttention in {type(module).__name__}")
    for layer in layers:
        layer.warmup = enabled
    return len(layers)
