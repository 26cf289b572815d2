"""The public functions: Flash-MSA's ``flash_msa_func`` / ``flash_msa_warmup_func`` and the
decomposed ``select_blocks`` + ``sparse_attention``.

Tensors are head-major (B, heads, S, D) as in Flash-MSA; the attention output is token-major
(B, S, H*D). Every argument is checked here, before the C++ extension, so that a mistake is
reported in the caller's terms; values that only the data can reveal (cu_seqlens offsets,
user-supplied indices) are checked by the C++ core on the CPU, never on the GPU (that would
need a host sync).

Every function takes its tensors and its selection (``top_k`` in tokens, ``top_k_blocks`` in
blocks, or ``indices``) positionally; everything after them is keyword-only, in one order:
``scale``, ``proxy_scale``, ``cu_seqlens``, then the flags. Flash-MSA's own two functions,
``flash_msa_func`` and ``flash_msa_warmup_func`` (also under Flash-MSA's other names
``flash_msa_func_warmup`` and ``sparse_attention_warmup``), take ``scale`` positionally too, as
the seventh argument, so that Flash-MSA's documented call runs unchanged
(docs/from_flash_msa.md).
"""

import math
import numbers
import operator
from typing import Optional

import torch
from torch import Tensor

from . import ops

BLOCK_SIZE = 128  # tokens per key block, fixed by the method
# float32 and float64 run on the CPU backend only (float64: double precision throughout, e.g.
# for gradcheck).
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_DIM_NAMES = ("batch", "heads", "seqlen", "head_dim")
_PROXY_DIM_NAMES = ("batch", "proxy heads", "seqlen", "proxy head_dim")


def _fail(message: str):
    raise ValueError(f"flash_msa: {message}")


def _integer(value) -> Optional[int]:
    """``value`` as an int when it is integral (int, numpy integer, 0-d integer tensor), else
    None. Booleans are not integers here."""
    if isinstance(value, bool) or (
        isinstance(value, Tensor) and (value.dtype == torch.bool or value.dim() != 0)
    ):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _check_tensor(name: str, t, ref: Optional[Tensor] = None) -> None:
    if not isinstance(t, Tensor):
        _fail(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        _fail(f"{name}: expected a 4-D tensor (B, heads, S, head_dim), got shape {tuple(t.shape)}")
    dim_names = _PROXY_DIM_NAMES if name in ("q_proxy", "k_proxy") else _DIM_NAMES
    for dim_name, size in zip(dim_names, t.shape):
        if size < 1:
            _fail(f"{name}: expected {dim_name} >= 1, got shape {tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        _fail(f"{name}: expected bfloat16, float16, float32 or float64 (CPU only), got {t.dtype}")
    if t.dtype in (torch.float32, torch.float64) and t.device.type != "cpu":
        kind = str(t.dtype).removeprefix("torch.")
        _fail(f"{name}: {kind} runs on the CPU backend only (the CUDA kernels take bfloat16 or "
              f"float16), got {kind} on {t.device}")
    if ref is not None:
        if t.dtype != ref.dtype:
            _fail(f"{name}: expected dtype {ref.dtype} (that of q_proxy), got {t.dtype}")
        if t.device != ref.device:
            _fail(f"{name}: expected device {ref.device} (that of q_proxy), got {t.device}")
        # q has q_proxy's batch and seqlen; the key side (k_proxy, k, v) has its batch here
        # and its seqlen is checked in _check_query_offset and _check_all.
        if name == "q" and (t.shape[0] != ref.shape[0] or t.shape[2] != ref.shape[2]):
            _fail(f"q: expected batch {ref.shape[0]} and seqlen {ref.shape[2]} (those of "
                  f"q_proxy), got shape {tuple(t.shape)}")
        if t.shape[0] != ref.shape[0]:
            _fail(f"{name}: expected batch {ref.shape[0]} (that of q_proxy), got shape "
                  f"{tuple(t.shape)}")


def _check_divides(what: str, a: int, a_name: str, b: int, b_name: str) -> None:
    if b == 0 or a % b != 0:
        _fail(f"{what}: {a_name} ({a}) must be a multiple of {b_name} ({b})")


def _check_cu_seqlens(cu_seqlens: Optional[Tensor], ref: Tensor) -> None:
    if cu_seqlens is None:
        return
    if not isinstance(cu_seqlens, Tensor):
        _fail(f"cu_seqlens: expected a torch.Tensor or None, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        _fail(
            "cu_seqlens: expected a 1-D int32 tensor of at least 2 offsets over the flattened "
            f"B*S token axis, got {cu_seqlens.dtype} of shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device != ref.device:
        _fail(f"cu_seqlens: expected device {ref.device} (that of the inputs), got {cu_seqlens.device}")


def _check_scale(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(f"{name}: expected a float or None, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        _fail(f"{name}: expected a finite positive number, got {value}")
    return float(value)


def _check_query_offset(query_offset, q_proxy: Tensor, k_proxy: Tensor) -> int:
    """The position of the first query: 0 for a whole sequence (``query_offset`` None, q_proxy
    and k_proxy of one seqlen), else a shard of queries inside k_proxy's sequence."""
    queries, keys = q_proxy.shape[2], k_proxy.shape[2]
    if query_offset is None:
        if queries != keys:
            _fail(f"k_proxy: expected batch {q_proxy.shape[0]} and seqlen {queries} (those of "
                  f"q_proxy), got shape {tuple(k_proxy.shape)} (a shard of queries against "
                  f"longer keys needs query_offset)")
        return 0
    value = _integer(query_offset)
    if value is None or value < 0 or value + queries > keys:
        _fail(f"query_offset: expected an int with 0 <= query_offset and query_offset + "
              f"{queries} (the queries) <= {keys} (the keys), got {query_offset!r}")
    return value


def _check_proxy(q_proxy: Tensor, k_proxy: Tensor, query_offset=None) -> int:
    _check_tensor("q_proxy", q_proxy)
    _check_tensor("k_proxy", k_proxy, q_proxy)
    if k_proxy.shape[3] != q_proxy.shape[3]:
        _fail(
            f"k_proxy: expected proxy head_dim {q_proxy.shape[3]} (that of q_proxy), "
            f"got {k_proxy.shape[3]}"
        )
    _check_divides("heads", q_proxy.shape[1], "proxy heads", k_proxy.shape[1], "proxy kv heads")
    return _check_query_offset(query_offset, q_proxy, k_proxy)


def _check_all(q_proxy, k_proxy, q, k, v, cu_seqlens, query_offset=None) -> int:
    """Checks every argument; returns the position of the first query."""
    offset = _check_proxy(q_proxy, k_proxy, query_offset)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, q_proxy)
    if k.shape[2] != k_proxy.shape[2]:
        _fail(f"k: expected seqlen {k_proxy.shape[2]} (that of k_proxy), got shape "
              f"{tuple(k.shape)}")
    if k.shape != v.shape:
        _fail(f"v: expected the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[3] != q.shape[3]:
        _fail(f"k: expected head_dim {q.shape[3]} (that of q), got {k.shape[3]}")
    heads, kv_heads, proxy_heads = q.shape[1], k.shape[1], q_proxy.shape[1]
    _check_divides("heads", heads, "heads", kv_heads, "kv heads")
    _check_divides("heads", heads, "heads", proxy_heads, "proxy heads")
    _check_cu_seqlens(cu_seqlens, q_proxy)
    return offset


def _scales(q_proxy: Tensor, q: Tensor, scale, proxy_scale) -> tuple[float, float]:
    """Main scale: D**-0.5 unless given. Proxy scale: given, else the main scale when that was
    given (Flash-MSA's single scale), else Dp**-0.5."""
    main = q.shape[3] ** -0.5 if scale is None else _check_scale("scale", scale)
    if proxy_scale is not None:
        return main, _check_scale("proxy_scale", proxy_scale)
    return main, (q_proxy.shape[3] ** -0.5 if scale is None else main)


def _check_top_k_blocks(top_k_blocks) -> int:
    """The number of selected blocks (of BLOCK_SIZE tokens each)."""
    value = _integer(top_k_blocks)
    if value is None or value < 1:
        _fail(
            f"top_k_blocks: expected an int >= 1 (a number of blocks of {BLOCK_SIZE} tokens), "
            f"got {top_k_blocks!r}"
        )
    return value


def _check_select_dtype(select_dtype, q_proxy: Tensor) -> bool:
    """Whether select ranks on FP8 E4M3 scores: select_dtype is torch.float8_e4m3fn (else None
    or the inputs' own dtype, the exact scores)."""
    if select_dtype is None or select_dtype == q_proxy.dtype:
        return False
    if select_dtype == torch.float8_e4m3fn:
        return True
    _fail(f"select_dtype: expected None, the inputs' dtype ({q_proxy.dtype}) or "
          f"torch.float8_e4m3fn, got {select_dtype!r}")


def _check_top_k(top_k, where: str = "") -> int:
    """A token count ``top_k`` (a positive multiple of BLOCK_SIZE, any integral type) as an int;
    ``where`` prefixes the argument's name in the message."""
    value = _integer(top_k)
    if value is None or value < BLOCK_SIZE or value % BLOCK_SIZE:
        _fail(
            f"{where}top_k: expected a positive multiple of {BLOCK_SIZE} tokens (an integer; "
            f"top_k // {BLOCK_SIZE} blocks are selected), got {top_k!r}"
        )
    return value


def _check_indices(indices, q_proxy: Tensor) -> None:
    if not isinstance(indices, Tensor):
        _fail(f"indices: expected a torch.Tensor, got {type(indices).__name__}")
    batch, proxy_heads, seqlen, _ = q_proxy.shape
    if (
        indices.dtype != torch.int32
        or indices.dim() != 4
        or tuple(indices.shape[:3]) != (batch, proxy_heads, seqlen)
        or indices.shape[3] < 1
    ):
        _fail(
            f"indices: expected int32 of shape ({batch}, {proxy_heads}, {seqlen}, K) with K >= 1, "
            f"got {indices.dtype} of shape {tuple(indices.shape)}"
        )
    if indices.device != q_proxy.device:
        _fail(f"indices: expected device {q_proxy.device} (that of q_proxy), got {indices.device}")


def select_blocks(
    q_proxy: Tensor,
    k_proxy: Tensor,
    top_k_blocks: int,
    *,
    proxy_scale: Optional[float] = None,
    cu_seqlens: Optional[Tensor] = None,
    query_offset: Optional[int] = None,
    select_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """Top-k block selection of the proxy branch (SPEC section 1).

    q_proxy (B, Hp, S, Dp), k_proxy (B, Hpk, S, Dp) -> int32 (B, Hp, S, top_k_blocks): the
    selected blocks of 128 keys per query and proxy head, ascending, the own block always
    among them, then -1 where fewer blocks are visible. Ties go to the lower block index.
    ``top_k_blocks`` counts blocks (``flash_msa_func``'s ``top_k`` counts tokens:
    ``top_k_blocks = top_k // 128``). ``proxy_scale`` defaults to Dp**-0.5 (a positive scale
    does not change the ranking).

    ``query_offset`` (keyword, every function here takes it): q_proxy (and q) may hold a shard
    of Sq queries of a longer sequence, query i at position ``query_offset + i`` of the S
    tokens of k_proxy (and k, v); the results have Sq tokens. ``flash_msa.distributed`` builds
    context parallelism on it (docs/distributed.md). None (the default): one sequence, all
    tensors of one seqlen.

    ``select_dtype`` (keyword; :func:`flash_msa_func` takes it too): None (the default) ranks
    the exact scores. ``torch.float8_e4m3fn`` ranks FP8 scores, for long contexts: q_proxy and
    k_proxy are quantised to E4M3 inside the op (one scale per token and head, amax / 448), the
    products summed in fp32. It is an approximation: the selection keeps about 93 to 97 % of
    the exact one's blocks on random inputs, the misses being near-ties (docs/performance.md).
    Forward and backward still read the unquantised inputs. On CUDA it needs the Hopper select
    kernel (compute capability 9.x) and Dp = 128, and raises ValueError otherwise; the CPU
    backend quantises the same way.
    """
    query_offset = _check_proxy(q_proxy, k_proxy, query_offset)
    _check_cu_seqlens(cu_seqlens, q_proxy)
    top_k_blocks = _check_top_k_blocks(top_k_blocks)
    fp8 = _check_select_dtype(select_dtype, q_proxy)
    if proxy_scale is None:
        proxy_scale = q_proxy.shape[3] ** -0.5
    proxy_scale = _check_scale("proxy_scale", proxy_scale)
    return ops.select(q_proxy, k_proxy, top_k_blocks, proxy_scale, cu_seqlens, query_offset, fp8)


def _check_kl_out(kl_out, q: Tensor) -> None:
    if kl_out is None:
        return
    stats = torch.float64 if q.dtype == torch.float64 else torch.float32
    if not isinstance(kl_out, Tensor) or kl_out.dim() != 0 or kl_out.dtype != stats:
        got = (f"{kl_out.dtype} of shape {tuple(kl_out.shape)}" if isinstance(kl_out, Tensor)
               else type(kl_out).__name__)
        _fail(f"kl_out: expected a 0-dim {stats} tensor (the KL value's dtype for {q.dtype} "
              f"inputs), got {got}")
    if kl_out.device != q.device:
        _fail(f"kl_out: expected device {q.device} (that of q), got {kl_out.device}")
    if kl_out.requires_grad:
        _fail("kl_out: expected a tensor that does not require grad (the backward writes into it)")


def _attention(q_proxy, k_proxy, q, k, v, indices, scale, proxy_scale, cu_seqlens, compute_kl,
               kl_out, query_offset):
    _check_kl_out(kl_out, q)
    main_scale, proxy = _scales(q_proxy, q, scale, proxy_scale)
    out, kl, _, _ = ops.forward(
        q_proxy, k_proxy, q, k, v, indices, main_scale, proxy, cu_seqlens, bool(compute_kl), kl_out,
        query_offset,
    )
    return out, kl


def check_indices(
    indices: Tensor,
    seqlen: Optional[int] = None,
    *,
    cu_seqlens: Optional[Tensor] = None,
    query_offset: Optional[int] = None,
) -> None:
    """Checks block indices made outside the library, int32 (B, Hp, Sq, K), against a sequence
    of ``seqlen`` tokens (default: ``query_offset + Sq``): per row, strictly ascending blocks
    holding a key of the query's document, ending with the query's own block, then -1 padding
    (the form :func:`select_blocks` returns). Raises ValueError naming the batch, proxy head and
    query of the first bad row and its value, the same on CPU and CUDA. On CUDA it waits for
    the device once (a kernel finds the bad row; the host reads one word), so it cannot run
    under CUDA graph capture or torch.compile: check there once beforehand and pass
    ``check_indices=False`` to :func:`sparse_attention`.
    """
    if not isinstance(indices, Tensor) or indices.dtype != torch.int32 or indices.dim() != 4:
        got = (f"{indices.dtype} of shape {tuple(indices.shape)}" if isinstance(indices, Tensor)
               else type(indices).__name__)
        _fail(f"indices: expected an int32 tensor (B, Hp, Sq, K), got {got}")
    offset = 0 if query_offset is None else _integer(query_offset)
    queries = indices.shape[2]
    length = (offset or 0) + queries if seqlen is None else _integer(seqlen)
    if offset is None or length is None or offset < 0 or offset + queries > length:
        _fail(f"seqlen: expected ints with 0 <= query_offset and query_offset + {queries} (the "
              f"queries) <= seqlen, got seqlen {seqlen!r} and query_offset {query_offset!r}")
    _check_cu_seqlens(cu_seqlens, indices)
    ops.check_indices(indices, cu_seqlens, length, offset)


def sparse_attention(
    q_proxy: Tensor,
    k_proxy: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    indices: Tensor,
    *,
    scale: Optional[float] = None,
    proxy_scale: Optional[float] = None,
    cu_seqlens: Optional[Tensor] = None,
    compute_kl: bool = False,
    kl_out: Optional[Tensor] = None,
    query_offset: Optional[int] = None,
    check_indices: bool = True,
) -> tuple[Tensor, Tensor]:
    """Main attention over given blocks plus the KL alignment loss (SPEC sections 2-4).

    ``indices`` int32 (B, Hp, S, K) in the form :func:`select_blocks` returns: per row,
    strictly ascending visible blocks (of 128 keys) that include the query's own block, then
    -1 padding. Indices that break this raise ValueError naming the batch, proxy head, query
    and value, on CPU and CUDA alike (:func:`check_indices`). The CPU backend checks them as it
    reads them; on CUDA ``check_indices=True`` (the default) waits for the device once to
    check them before the kernels run. Under CUDA graph capture or torch.compile that wait is
    not possible: check the indices beforehand with :func:`check_indices` and pass
    ``check_indices=False``, which skips the CUDA check (invalid rows then attend only their
    valid blocks, with no error). :func:`flash_msa_func` never checks: select's indices are
    valid by construction.
    Returns (out (B, S, H*D), kl 0-dim fp32, float64 for float64 inputs), differentiable
    w.r.t. q, k, v (through out) and q_proxy, k_proxy (through kl). The KL value, as in
    :func:`flash_msa_func`: in ``kl_out`` after the backward, or in kl with ``compute_kl=True``.
    """
    query_offset = _check_all(q_proxy, k_proxy, q, k, v, cu_seqlens, query_offset)
    _check_indices(indices, q_proxy)
    if not isinstance(check_indices, bool):
        _fail(f"check_indices: expected a bool, got {check_indices!r}")
    if check_indices and indices.is_cuda:
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            _fail("check_indices: the check of indices on CUDA waits for the device, which "
                  "torch.compile and CUDA graph capture cannot; check them beforehand with "
                  "flash_msa.check_indices and pass check_indices=False")
        ops.check_indices(indices, cu_seqlens, k_proxy.shape[2], query_offset)
    return _attention(q_proxy, k_proxy, q, k, v, indices, scale, proxy_scale, cu_seqlens,
                      compute_kl, kl_out, query_offset)


def flash_msa_func(
    q_proxy: Tensor,
    k_proxy: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    top_k: int,
    scale: Optional[float] = None,
    *,
    proxy_scale: Optional[float] = None,
    cu_seqlens: Optional[Tensor] = None,
    return_kl: bool = True,
    compute_kl: bool = False,
    kl_out: Optional[Tensor] = None,
    query_offset: Optional[int] = None,
    select_dtype: Optional[torch.dtype] = None,
):
    """MiniMax Sparse Attention, Flash-MSA's call: select, then sparse attention + KL.

    q_proxy (B, Hp, S, Dp), k_proxy (B, Hpk, S, Dp), q (B, H, S, D), k and v (B, Hk, S, D),
    all of one dtype on one device. ``top_k`` counts tokens: a positive multiple of 128 (any
    integral type), K = top_k // 128 blocks (K may exceed the number of blocks). Returns
    (out (B, S, H*D), kl_loss) where kl_loss (0-dim fp32, float64 for float64 inputs) is the
    KL loss term: adding it to the loss trains the proxy, with gradients scaled by its upstream
    gradient. ``return_kl=False`` returns out alone.

    The KL value (for logging; it changes no gradient) comes one of two ways:
    - ``kl_out``, a 0-dim fp32 tensor (float64 for float64 inputs) on the inputs' device: the
      backward writes the value into it, from the teacher it recomputes anyway (a few percent of
      the step). It is there once the backward has run, and equals the forward's value up to
      rounding.
    - ``compute_kl=True``: kl_loss holds the value right after the forward, which then makes an
      extra pass over the selected blocks (about half a forward; docs/python.md).
    By default (``compute_kl=False``) kl_loss is 0 in value, as Flash-MSA's placeholder. out
    and the gradients are bitwise the same with ``kl_out`` as without; with ``compute_kl=True``
    they can differ by rounding (on H100/H200 at D = Dp = 128 the forward then runs other
    kernels; docs/python.md).

    ``select_dtype=torch.float8_e4m3fn`` ranks the blocks on FP8 scores (see
    :func:`select_blocks`); attention, KL and gradients stay in the inputs' dtype.
    """
    query_offset = _check_all(q_proxy, k_proxy, q, k, v, cu_seqlens, query_offset)
    top_k = _check_top_k(top_k)
    fp8 = _check_select_dtype(select_dtype, q_proxy)
    main_scale, proxy = _scales(q_proxy, q, scale, proxy_scale)
    indices = ops.select(q_proxy, k_proxy, top_k // BLOCK_SIZE, proxy, cu_seqlens, query_offset,
                         fp8)
    out, kl = _attention(q_proxy, k_proxy, q, k, v, indices, main_scale, proxy, cu_seqlens,
                         compute_kl, kl_out, query_offset)
    return (out, kl) if return_kl else out


def flash_msa_warmup_func(
    q_proxy: Tensor,
    k_proxy: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    top_k: Optional[int] = None,
    scale: Optional[float] = None,
    *,
    proxy_scale: Optional[float] = None,
    cu_seqlens: Optional[Tensor] = None,
    return_kl: bool = True,
    compute_kl: bool = False,
    kl_out: Optional[Tensor] = None,
    query_offset: Optional[int] = None,
):
    """Warmup phase (SPEC section 5): dense causal attention, KL against the dense teacher.

    Same arguments and results as :func:`flash_msa_func`; ``top_k`` (tokens) is ignored, kept
    so that the two functions are interchangeable.
    """
    query_offset = _check_all(q_proxy, k_proxy, q, k, v, cu_seqlens, query_offset)
    out, kl = _attention(q_proxy, k_proxy, q, k, v, None, scale, proxy_scale, cu_seqlens,
                         compute_kl, kl_out, query_offset)
    return (out, kl) if return_kl else out


def explain(
    q_proxy: Tensor,
    k_proxy: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    top_k: Optional[int] = None,
    *,
    warmup: bool = False,
    compute_kl: bool = False,
    select_dtype: Optional[torch.dtype] = None,
    cu_seqlens: Optional[Tensor] = None,
    query_offset: Optional[int] = None,
) -> list:
    """The kernels :func:`flash_msa_func` (or, with ``warmup=True``,
    :func:`flash_msa_warmup_func`) runs for these arguments, forward and backward, in the order
    it runs them: a list of ``{"stage", "variant", "reason"}`` dicts. Nothing runs and nothing
    waits for the device. On CUDA the choice is the one the call makes (one function per stage
    picks it, from the GPU, the shapes and the options; docs/design.md); CPU tensors run the C++
    reference backend. Raises what the call would raise for these arguments (an FP8 select the
    GPU cannot run, say).
    """
    query_offset = _check_all(q_proxy, k_proxy, q, k, v, cu_seqlens, query_offset)
    for name, flag in (("warmup", warmup), ("compute_kl", compute_kl)):
        if not isinstance(flag, bool):
            _fail(f"{name}: expected a bool, got {flag!r}")
    top_k_blocks = 0 if warmup else _check_top_k(top_k) // BLOCK_SIZE
    fp8 = False if warmup else _check_select_dtype(select_dtype, q_proxy)
    if not q.is_cuda:
        stages = (("warmup_forward", "warmup_backward") if warmup
                  else ("select", "sparse_forward", "sparse_backward"))
        return [{"stage": s, "variant": "cpu", "reason": "CPU tensors run the C++ reference "
                 "backend"} for s in stages]
    return [{"stage": s, "variant": v, "reason": r} for s, v, r in ops.explain(
        q_proxy, k_proxy, q, k, top_k_blocks, warmup, compute_kl, fp8, query_offset)]


# Flash-MSA exports its warmup function under these names too.
flash_msa_func_warmup = flash_msa_warmup_func
sparse_attention_warmup = flash_msa_warmup_func
