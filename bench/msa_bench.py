"""flash-msa against dense and block-sparse peers on one GPU, in one process.

    python3 bench/msa_bench.py --out bench/results/RUN.json [--commit SHA] [--budget-s 480]

Measures, on the paper's heads (H=64, Hk=4, Hp=4, Hpk=1, D=Dp=128, K=16 blocks), bf16:
  - the card's ceilings: a bf16 8192^3 matmul (random inputs) and a device-to-device copy;
  - flash-msa per stage (select, scheduling, main forward with and without the KL value,
    backward with and without the KL value) and the training step (select + forward + backward,
    without the KL value and with it computed by the backward: MSAAttention's default), with the
    peak GPU memory;
  - peers on the same tensors: cuDNN and FlashAttention-2 dense causal attention through torch
    SDPA (kv heads repeated to 64), FlexAttention with a block mask of the same per-query-block
    budget (16 blocks of 128 keys per 128-query block: the own block and 15 random earlier
    ones) and flash-msa's sparse attention on that very block mask (as per-token indices:
    identical work, outputs compared), and MSA composed from plain torch ops (chunked proxy scores, block max, torch.topk,
    masked SDPA) where it fits in memory;
  - the same stages on selections drawn to follow what the trained example model selects
    (neighbours sharing blocks, near blocks, a sink block; bench/trained_selection.py), next to
    the proxy's selections on random inputs, with the statistics of both;
  - on Hopper, the FP8 select (select_dtype=torch.float8_e4m3fn): its time, the step with it,
    the share of the exact selection's blocks it keeps, and at 32K its overlap and score regret
    on the three input kinds of bench/fp8_select_quality.py (random, outlier channels,
    clustered keys);
  - the shape of Flash-MSA's published GH200 figures (S=16K, H=16, Hk=2, Hp=4, Hpk=1, top-k
    2048 tokens): the training step through flash_msa_func and autograd, as a user calls it
    (no KL value, the default; and the KL value from the backward, MSAAttention's default),
    against cuDNN dense causal attention with the kv heads repeated;
  - where Flash-MSA 0.1.1 is installed as flash_msa_peer (bench/install_flash_msa_peer.sh),
    the comparison of bench/against_flash_msa.py: step, first step, memory, reproducibility and
    selection against Flash-MSA's own kernels.
Timing: CUDA events around each call, warm-up calls first, the median of several calls; inputs
are random normal (never zeros) and, for each configuration, larger than the 60 MB L2.

FLOPs are executed FLOPs of the main branch: forward 4 * D * sum over (head, query) of the
keys attended (from the selection, causal and document masks included), backward 2.5x that;
select 2 * Dp * Hp * sum over queries of the visible keys; dense causal 4 * H * D * S (S + 1) / 2
forward, 3.5x that for forward + backward. Scheduling is the share of the forward spent in the
schedule's kernels (reverse index and work items), read from the PyTorch profiler.

Writes one JSON file with the run's environment and every figure; bench/report.py turns it into
docs/benchmarks.md and the plots. Prints a progress line per measurement and, last, each
stage against its floor (bench/floor.py).
"""

import argparse
import datetime
import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_msa
import floor
import against_flash_msa
import fp8_select_quality as fp8_study
from timing import time_ms
from trained_selection import load_target, trained_selection

H, HK, HP, HPK, D, DP, K, BS = 64, 4, 4, 1, 128, 128, 16, 128
DT = torch.bfloat16
SCALE, PROXY_SCALE = D ** -0.5, DP ** -0.5

# (name, batch, seqlen, documents, warmup, selection); documents: lengths of the packed
# documents; selection: "proxy" (select_blocks on the random inputs) or "trained" (drawn to follow
# the selection statistics of the trained example model, bench/trained_selection.py). In the
# order they run: the headline lengths first, so that a run cut short keeps them.
CONFIGS = [
    ("S32K", 1, 32768, None, False, "proxy"),
    ("S32K_trained", 1, 32768, None, False, "trained"),
    ("S128K", 1, 131072, None, False, "proxy"),
    ("S128K_trained", 1, 131072, None, False, "trained"),
    ("S8K", 1, 8192, None, False, "proxy"),
    ("S512K", 1, 524288, None, False, "proxy"),
    ("S1M", 1, 1048576, None, False, "proxy"),
    ("B8_S8K", 8, 8192, None, False, "proxy"),
    ("S32K_docs", 1, 32768, [3000, 9000, 700, 12000, 4100, 3968], False, "proxy"),
    ("S32K_warmup", 1, 32768, None, True, "proxy"),
    ("S128K_warmup", 1, 131072, None, True, "proxy"),
    ("S32K_docs_warmup", 1, 32768, [3000, 9000, 700, 12000, 4100, 3968], True, "proxy"),
]
STATS_MAX_S = 131072      # selection_stats holds a (rows, blocks) mask: quadratic in S
DENSE_MAX_S = 131072      # dense fwd+bwd is quadratic: ~30 s a call at 512K, ~2 min at 1M
FA2_MAX_S = 32768
FLEX_S = (32768, 131072)  # each shape compiles FlexAttention anew (tens of seconds)
TORCH_MSA_MAX_S = 8192    # the plain-torch composition materialises score chunks and masks

FP8_QUALITY_S = 32768     # the regret needs every row's block scores: quadratic in S

START = time.monotonic()


def log(msg):
    print(f"[{time.monotonic() - START:6.1f}s] {msg}", flush=True)


def entry(ms, flop=None):
    out = {"ms": round(ms, 4)}
    if flop:
        out["tflops"] = round(flop / ms / 1e9, 1)
    return out


def ceilings():
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=DT) for _ in range(2))
    mm = time_ms(lambda: a @ b, iters=10, warmup=3)
    x = torch.randn(2 ** 30, device="cuda", dtype=DT)  # 2 GiB
    y = torch.empty_like(x)
    cp = time_ms(lambda: y.copy_(x), iters=10, warmup=3)
    return {"bf16_matmul_tflops": round(2 * 8192 ** 3 / mm / 1e9, 1),
            "copy_tbps": round(2 * x.numel() * 2 / cp / 1e9, 3)}


def fp8_select_runs():
    """The FP8 select runs on the Hopper select kernel (compute capability 9.x)."""
    return torch.cuda.get_device_capability()[0] == 9


def earlier_blocks(indices):
    """(B * Hp * S, K - 1): each row's selected blocks before its own (the first K - 1 entries,
    ascending; only rows with at least K - 1 earlier blocks are meaningful)."""
    return indices[..., : K - 1].flatten(0, 2).clamp(min=0).long()


def kept_share(indices, exact):
    """The share of the exact selection's earlier blocks that `indices` keeps, over the rows
    with more than K - 1 earlier blocks (no documents)."""
    rows = torch.arange(indices.shape[2], device=indices.device) // BS >= K
    a, b = indices[:, :, rows, : K - 1], exact[:, :, rows, : K - 1]
    return round((a[..., :, None] == b[..., None, :]).any(-1).float().mean().item(), 5)


def fp8_quality(seqlen):
    """Overlap and regret of the FP8 select against the exact one (bench/fp8_select_quality.py's
    measures) on each input kind, from the kernels' own selections."""
    gen = torch.Generator().manual_seed(3)
    out = {}
    for kind in fp8_study.KINDS:
        qp, kp = (x.cuda() for x in fp8_study.make_inputs(kind, seqlen, gen))
        exact = flash_msa.ops.select(qp, kp, K, PROXY_SCALE, None)
        fp8 = flash_msa.ops.select(qp, kp, K, PROXY_SCALE, None, 0, True)
        true = fp8_study.block_scores(qp.float(), kp.float()).flatten(0, 1)
        out[kind] = fp8_study.summary(*fp8_study.compare(
            true, earlier_blocks(exact), earlier_blocks(fp8)))
        log(f"FP8 select at {seqlen}, {kind} inputs: {out[kind]}")
    return out


def gh200_shape(gen):
    """The training step at the shape of Flash-MSA's GH200 figures, through the public call
    and autograd, against cuDNN dense causal forward + backward on the same tensors."""
    s, h, hk, hp, hpk = 16384, 16, 2, 4, 1
    mk = lambda *shape: torch.randn(*shape, device="cuda", dtype=DT,
                                    generator=gen).requires_grad_()
    qp, kp, q, k, v = mk(1, hp, s, DP), mk(1, hpk, s, DP), mk(1, h, s, D), mk(1, hk, s, D), \
        mk(1, hk, s, D)
    dout = torch.randn(1, s, h * D, device="cuda", dtype=DT, generator=gen)
    kl_value = torch.empty((), device="cuda")

    def step(kl_out=None):
        out, kl = flash_msa.flash_msa_func(qp, kp, q, k, v, K * BS, kl_out=kl_out)
        torch.autograd.backward((out, kl), (dout, torch.ones_like(kl)))

    res = {"seqlen": s, "heads": {"H": h, "Hk": hk, "Hp": hp, "Hpk": hpk, "D": D, "Dp": DP},
           "top_k_tokens": K * BS, "step": entry(time_ms(step)),
           "step_with_kl_value": entry(time_ms(lambda: step(kl_value)))}
    kd = k.detach().repeat_interleave(h // hk, dim=1).requires_grad_()
    vd = v.detach().repeat_interleave(h // hk, dim=1).requires_grad_()
    qd, dd = q.detach().requires_grad_(), dout.view(1, s, h, D).transpose(1, 2)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        res["cudnn_dense_step"] = entry(time_ms(lambda: torch.autograd.backward(
            F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=SCALE), dd)))
    for key in ("step", "step_with_kl_value"):
        res[f"{key}_speedup_over_cudnn"] = round(res["cudnn_dense_step"]["ms"] / res[key]["ms"], 3)
    log(f"GH200 shape: {res}")
    return res


def doc_layout(batch, seqlen, docs):
    """cu_seqlens (or None) and the in-row start of each token's document, [B, S] int64."""
    if docs is None:
        return None, torch.zeros(batch, seqlen, dtype=torch.int64, device="cuda")
    assert sum(docs) == seqlen and batch == 1
    offsets = [0]
    for n in docs:
        offsets.append(offsets[-1] + n)
    starts = torch.repeat_interleave(torch.tensor(offsets[:-1]), torch.tensor(docs))
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    return cu, starts.view(1, seqlen).to("cuda")


def select_flop(doc_start, seqlen):
    i = torch.arange(seqlen, device="cuda")
    visible = (i - doc_start + 1).sum().item()
    return 2 * DP * HP * visible


def sparse_flop(indices, doc_start):
    """4 * D * G * sum over (b, p, i) of the keys the selection attends."""
    n = indices.long()
    i = torch.arange(n.shape[2], device="cuda").view(1, 1, -1, 1)
    ds = doc_start.view(n.shape[0], 1, -1, 1)
    lo = torch.maximum(n * BS, ds)
    hi = torch.minimum((n + 1) * BS, i + 1)
    keys = ((hi - lo).clamp(min=0) * (n >= 0)).sum().item()
    return 4 * D * (H // HP) * keys


def dense_flop(batch, seqlen):
    return 4 * batch * H * D * seqlen * (seqlen + 1) / 2


def random_block_mask_indices(batch, seqlen, gen):
    """Per 128-query block: its own block and 15 random earlier ones. FlexAttention's layout:
    counts [B, 1, nq] and indices [B, 1, nq, nkv] holding the selected blocks first (ascending),
    then the other blocks (ignored past the count). On the generator's device."""
    nb = (seqlen + BS - 1) // BS
    device = gen.device
    scores = torch.rand(batch, 1, nb, nb, device=device, generator=gen)
    scores = scores.masked_fill(torch.ones(nb, nb, device=device, dtype=torch.bool).triu(1), -1.0)
    scores.diagonal(dim1=-2, dim2=-1).fill_(2.0)
    top = scores.topk(min(K, nb), dim=-1)
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top.indices, top.values >= 0)
    col = torch.arange(nb, device=device).expand_as(scores)
    idx = torch.where(chosen, col, col + nb).sort(dim=-1).values % nb
    return chosen.sum(-1).to(torch.int32), idx.to(torch.int32)


def per_token_indices(count, idx, seqlen):
    """The block mask as flash-msa's per-token indices [B, Hp, S, K]: every token of a
    128-query block selects the block's blocks (ascending, -1 padded)."""
    batch, _, nb, _ = idx.shape
    first = F.pad(idx[:, 0, :, :K], (0, max(0, K - nb)), value=-1)  # [B, nb, K]
    slots = torch.arange(K, device=idx.device)
    blocks = torch.where(slots < count[:, 0, :, None], first, -1)
    tokens = blocks.repeat_interleave(BS, dim=1)[:, :seqlen]
    return tokens[:, None].expand(batch, HP, seqlen, K).contiguous().to(torch.int32)


def run_flex(qp, kp, q, k, v, dout, gen):
    """FlexAttention on a random block mask (16 blocks per 128-query block), and flash-msa's
    sparse attention on the same blocks given as per-token indices (identical work: main
    attention over the same keys; flash-msa also computes the proxy lse in the forward, and
    its backward runs without the proxy gradient, as Flex has none)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    batch, _, seqlen, _ = q.shape
    count, idx = random_block_mask_indices(batch, seqlen, gen)
    nb = (seqlen + BS - 1) // BS

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask = BlockMask.from_kv_blocks(count, idx, BLOCK_SIZE=BS, mask_mod=causal, seq_lengths=(seqlen, seqlen))
    flex = torch.compile(flex_attention)
    keys = (count.sum().item() - nb) * BS * BS + nb * BS * (BS + 1) / 2  # per head, causal own block
    flop = 4 * batch * H * D * keys

    def fwd():
        return flex(q, k, v, block_mask=mask, scale=SCALE, enable_gqa=True)

    def step():
        torch.autograd.backward(fwd(), dout)

    # The forward runs with gradients enabled too: one compiled graph serves both timings.
    step_ms = time_ms(step, iters=5, warmup=2)
    fwd_ms = time_ms(fwd, iters=5, warmup=1)
    flex_result = {"forward": entry(fwd_ms, flop), "step": entry(step_ms, 3.5 * flop)}

    indices = per_token_indices(count, idx, seqlen)
    tensors = (qp, kp, q.detach(), k.detach(), v.detach())
    dout_tokens = dout.transpose(1, 2).reshape(batch, seqlen, H * D)

    def ours():
        return flash_msa.ops.forward(*tensors, indices, SCALE, PROXY_SCALE, None, False, None)

    o, _, lse, lse_proxy = ours()

    def ours_step():
        out, _, l, lp = ours()
        flash_msa.ops.backward(dout_tokens, None, *tensors, out, l, lp, indices, SCALE,
                               PROXY_SCALE, None, None)

    with torch.no_grad():
        ref = fwd().transpose(1, 2).reshape(batch, seqlen, H * D)
    ours_fwd = time_ms(ours, iters=5, warmup=1)
    ours_st = time_ms(ours_step, iters=5, warmup=1)
    same = {"forward": entry(ours_fwd, flop), "step": entry(ours_st, 3.5 * flop),
            "max_abs_diff_from_flex": round((o.float() - ref.float()).abs().max().item(), 5),
            "forward_speedup_over_flex": round(fwd_ms / ours_fwd, 3),
            "step_speedup_over_flex": round(step_ms / ours_st, 3)}
    return flex_result, same


def torch_msa_step(qp, kp, q, k, v, dout):
    """MSA from plain torch ops: chunked proxy scores, block max, topk, masked SDPA."""
    batch, _, seqlen, _ = q.shape
    nb = (seqlen + BS - 1) // BS
    chunk = 1024
    i_all = torch.arange(seqlen, device="cuda")
    outs = []
    kr = k.repeat_interleave(H // HK, dim=1)
    vr = v.repeat_interleave(H // HK, dim=1)
    for c0 in range(0, seqlen, chunk):
        c1 = min(seqlen, c0 + chunk)
        qi = i_all[c0:c1].view(-1, 1)
        with torch.no_grad():
            s = (qp[:, :, c0:c1].float() @ kp.float().transpose(-1, -2)) * PROXY_SCALE
            s = s.masked_fill(i_all.view(1, -1) > qi, float("-inf"))
            pad = nb * BS - seqlen
            blocks = F.pad(s, (0, pad), value=float("-inf")).view(batch, HP, c1 - c0, nb, BS).amax(-1)
            own = (qi // BS).view(1, 1, -1, 1).expand(batch, HP, -1, 1)
            blocks.scatter_(-1, own, float("inf"))
            top = blocks.topk(min(K, nb), dim=-1)
            chosen = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
            allowed = chosen.repeat_interleave(BS, dim=-1)[..., :seqlen] & (i_all.view(1, -1) <= qi)
            allowed = allowed.repeat_interleave(H // HP, dim=1)
        outs.append(F.scaled_dot_product_attention(q[:, :, c0:c1], kr, vr, attn_mask=allowed,
                                                   scale=SCALE))
    out = torch.cat(outs, dim=2)
    torch.autograd.backward(out, dout)


def measure_config(name, batch, seqlen, docs, warmup, selection, gen, results, deadline):
    cfg = {"name": name, "batch": batch, "seqlen": seqlen, "documents": docs, "warmup": warmup,
           "selection": selection}
    results.append(cfg)
    cu, doc_start = doc_layout(batch, seqlen, docs)
    mk = lambda *shape: torch.randn(*shape, device="cuda", dtype=DT, generator=gen)
    qp, kp = mk(batch, HP, seqlen, DP), mk(batch, HPK, seqlen, DP)
    q, k, v = mk(batch, H, seqlen, D), mk(batch, HK, seqlen, D), mk(batch, HK, seqlen, D)
    dout = mk(batch, seqlen, H * D)
    kl_grad = torch.ones((), device="cuda")
    tensors = (qp, kp, q, k, v)

    indices = None
    if not warmup:
        indices = flash_msa.ops.select(qp, kp, K, PROXY_SCALE, cu)
        if selection == "trained":
            indices, cfg["selection_fit"] = trained_selection(
                load_target(), batch, HP, seqlen, K, gen)
        elif docs is None and seqlen <= STATS_MAX_S:
            cfg["selection_stats"] = flash_msa.selection_stats(indices)
        sflop = select_flop(doc_start, seqlen)
        cfg["select"] = entry(time_ms(lambda: flash_msa.ops.select(qp, kp, K, PROXY_SCALE, cu)),
                              sflop)
        flop = sparse_flop(indices, doc_start)
    else:
        sflop = 0
        i = torch.arange(seqlen, device="cuda")
        flop = 4 * D * H * (i - doc_start + 1).sum().item()
    cfg["main_forward_flop"] = flop

    def forward(compute_kl):
        return flash_msa.ops.forward(*tensors, indices, SCALE, PROXY_SCALE, cu, compute_kl, None)

    # Warmup is quadratic: fewer repetitions past 32K; its forward with the KL value runs the
    # portable kernels' second walk (the default takes the value from the backward), timed at
    # 32K only.
    reps = {"iters": 2, "warmup": 1} if warmup and seqlen > 32768 else {}
    forward_kl = not warmup or seqlen <= 32768
    out, _, lse, lse_proxy = forward(forward_kl)

    kl_value = torch.empty((), device="cuda")

    def backward(kl_out=None):
        return flash_msa.ops.backward(dout, kl_grad, *tensors, out, lse, lse_proxy, indices,
                                      SCALE, PROXY_SCALE, cu, kl_out)

    def step(kl_out=None, fp8=False):
        idx = flash_msa.ops.select(qp, kp, K, PROXY_SCALE, cu, 0, fp8) if not warmup else None
        if selection == "trained":  # select runs (and is timed); attention takes the drawn ones
            idx = indices
        o, _, l, lp = flash_msa.ops.forward(*tensors, idx, SCALE, PROXY_SCALE, cu, False, None)
        flash_msa.ops.backward(dout, kl_grad, *tensors, o, l, lp, idx, SCALE, PROXY_SCALE, cu,
                               kl_out)

    cfg["forward"] = entry(time_ms(lambda: forward(False), **reps), flop)
    if forward_kl:
        cfg["forward_with_kl_value"] = entry(time_ms(lambda: forward(True), **reps), flop)
    cfg["backward"] = entry(time_ms(backward, **reps), 2.5 * flop)
    cfg["backward_with_kl_value"] = entry(time_ms(lambda: backward(kl_value), **reps), 2.5 * flop)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step_ms = time_ms(step, **reps)
    cfg["step"] = entry(step_ms, sflop + 3.5 * flop)
    cfg["step_peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
    # The step's memory growth: its peak above what was allocated before it (the inputs), in GB
    # (1e9 bytes) as bench/against_flash_msa.py measures it for both libraries.
    cfg["step_memory_growth_gb"] = round((torch.cuda.max_memory_allocated() - before) / 1e9, 2)
    # The KL value from the backward (kl_out; MSAAttention's default) against no value.
    cfg["step_with_kl_value"] = entry(time_ms(lambda: step(kl_value), **reps), sflop + 3.5 * flop)
    cfg["kl_value_share_of_step"] = round(cfg["step_with_kl_value"]["ms"] / step_ms - 1, 4)
    if not warmup and selection == "proxy" and fp8_select_runs():
        fp8 = lambda: flash_msa.ops.select(qp, kp, K, PROXY_SCALE, cu, 0, True)
        cfg["select_fp8"] = entry(time_ms(fp8), sflop)
        if docs is None:
            cfg["select_fp8"]["kept_share"] = kept_share(fp8(), indices)
        cfg["step_fp8_select"] = entry(time_ms(lambda: step(fp8=True)), sflop + 3.5 * flop)
        log(f"{name}: FP8 select {cfg['select_fp8']}, step with it {cfg['step_fp8_select']}")
    log(f"{name}: select {cfg.get('select', {}).get('ms', '-')} ms, forward {cfg['forward']['ms']} ms "
        f"({cfg['forward'].get('tflops')} TFLOP/s), backward {cfg['backward']['ms']} ms "
        f"({cfg['backward'].get('tflops')} TFLOP/s), step {step_ms:.1f} ms, with the KL value "
        f"{cfg['step_with_kl_value']['ms']} ms")

    if not warmup and seqlen in (32768, 131072) and docs is None and batch == 1 \
            and selection == "proxy":
        cfg["kernels"] = kernel_breakdown(lambda: forward(False), backward)

    del out, lse, lse_proxy
    if selection != "proxy":  # the peers' work does not depend on the selection
        return
    peers = cfg["peers"] = {}
    dense_ok = docs is None and not warmup and seqlen <= DENSE_MAX_S
    if dense_ok or (docs is None and warmup and seqlen <= DENSE_MAX_S):
        dflop = dense_flop(batch, seqlen)
        qd = q.detach().requires_grad_()
        kd = k.repeat_interleave(H // HK, dim=1).detach().requires_grad_()
        vd = v.repeat_interleave(H // HK, dim=1).detach().requires_grad_()
        dd = dout.view(batch, seqlen, H, D).transpose(1, 2)
        backends = [("cudnn", SDPBackend.CUDNN_ATTENTION)]
        if seqlen <= FA2_MAX_S:
            backends.append(("flash2", SDPBackend.FLASH_ATTENTION))
        for peer, backend in backends:
            if time.monotonic() > deadline:
                peers[peer] = {"skipped": "time budget"}
                continue
            slow = seqlen > 131072
            with sdpa_kernel(backend):
                fwd = lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=SCALE)
                with torch.no_grad():
                    f_ms = time_ms(fwd, iters=1 if slow else 5, warmup=1)
                s_ms = time_ms(lambda: torch.autograd.backward(fwd(), dd), iters=1 if slow else 5,
                               warmup=0 if slow else 2)
            peers[peer] = {"forward": entry(f_ms, dflop), "step": entry(s_ms, 3.5 * dflop)}
            log(f"{name}: {peer} dense causal forward {f_ms:.1f} ms, forward+backward {s_ms:.1f} ms")
        del qd, kd, vd
    if not warmup and docs is None and batch == 1 and seqlen <= TORCH_MSA_MAX_S:
        qt, kt, vt = (t.detach().requires_grad_() for t in (q, k, v))
        dd = dout.view(batch, seqlen, H, D).transpose(1, 2)
        ms = time_ms(lambda: torch_msa_step(qp, kp, qt, kt, vt, dd), iters=3, warmup=1)
        peers["torch_ops_msa"] = {"step": entry(ms, sflop + 3.5 * flop)}
        log(f"{name}: MSA from torch ops, step {ms:.1f} ms")


def kernel_breakdown(forward, backward):
    """Device time per kernel (ms) of one forward and one backward call, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for part, fn in (("forward", forward), ("backward", backward)):
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        kernels = {}
        for evt in prof.key_averages():
            t = evt.device_time_total / 1000.0
            if t > 0:
                kernels[evt.key[:90]] = round(t, 4)
        out[part] = dict(sorted(kernels.items(), key=lambda kv: -kv[1]))
        sched = sum(t for n, t in kernels.items()
                    if any(s in n for s in ("edges_kernel", "doc_start_kernel", "items_kernel",
                                            "DeviceRadixSort", "DeviceScan", "Memset")))
        out[f"{part}_scheduling_ms"] = round(sched, 4)
    return out


def environment(commit):
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.check_output(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], text=True
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        driver = "unknown"
    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "driver": driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "heads": {"H": H, "Hk": HK, "Hp": HP, "Hpk": HPK, "D": D, "Dp": DP, "K": K},
        "dtype": "bfloat16",
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="no new peer measurement starts after this many seconds")
    parser.add_argument("--configs", default="", help="comma-separated subset of names")
    args = parser.parse_args()
    wanted = set(filter(None, args.configs.split(",")))
    deadline = START + args.budget_s
    gen = torch.Generator(device="cuda").manual_seed(2026)
    result = {"environment": environment(args.commit)}
    result["ceilings"] = ceilings()
    log(f"ceilings: {result['ceilings']}")
    if fp8_select_runs():
        result["fp8_select_quality"] = {"seqlen": FP8_QUALITY_S,
                                        "kinds": fp8_quality(FP8_QUALITY_S)}
    result["gh200_shape"] = gh200_shape(gen)
    peer = against_flash_msa.load_peer()
    if peer is not None:  # Flash-MSA 0.1.1, installed by bench/install_flash_msa_peer.sh
        result["flash_msa_0_1_1"] = against_flash_msa.compare(peer, log=log)
    configs = result["configs"] = []
    todo = [c for c in CONFIGS if not wanted or c[0] in wanted]
    for n, (name, batch, seqlen, docs, warmup, selection) in enumerate(todo, 1):
        log(f"({n}/{len(todo)}) {name}")
        if time.monotonic() > deadline + 60:
            configs.append({"name": name, "skipped": "time budget"})
            continue
        try:
            measure_config(name, batch, seqlen, docs, warmup, selection, gen, configs, deadline)
        except Exception as exc:  # noqa: BLE001  (recorded in the results; the run goes on)
            configs[-1]["error"] = f"{type(exc).__name__}: {exc}"[:400]
            log(f"{name}: {configs[-1]['error']}")
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:  # after every configuration: a partial run keeps its data
            json.dump(result, f, indent=1)
    # FlexAttention last: it compiles per shape, and a failure inside it can end the process.
    for cfg in configs:
        if cfg.get("seqlen") not in FLEX_S or cfg.get("batch") != 1 or cfg.get("documents") \
                or cfg.get("warmup") or "peers" not in cfg:
            continue
        if time.monotonic() > deadline + 60:
            cfg["peers"]["flex_block_sparse"] = {"skipped": "time budget"}
            continue
        s = cfg["seqlen"]
        mk = lambda *shape: torch.randn(*shape, device="cuda", dtype=DT, generator=gen).requires_grad_()
        q, k, v = mk(1, H, s, D), mk(1, HK, s, D), mk(1, HK, s, D)
        qp, kp = (mk(1, h, s, DP).detach() for h in (HP, HPK))
        dout = torch.randn(1, H, s, D, device="cuda", dtype=DT, generator=gen)
        try:
            flex, same = run_flex(qp, kp, q, k, v, dout, gen)
            cfg["peers"]["flex_block_sparse"] = flex
            cfg["same_pattern_as_flex"] = same
        except Exception as exc:  # noqa: BLE001  (recorded; the run goes on)
            cfg["peers"]["flex_block_sparse"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        log(f"{cfg['name']}: FlexAttention block-sparse {cfg['peers']['flex_block_sparse']}, "
            f"flash-msa on the same blocks {cfg.get('same_pattern_as_flex')}")
        del q, k, v, qp, kp, dout
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    log(f"wrote {args.out}")
    print("\n".join(floor.markdown(result)))


if __name__ == "__main__":
    main()
