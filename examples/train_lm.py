"""Train a small long-context language model with MSA and, for comparison, with dense attention.

    python examples/train_lm.py --out examples/results/mqar-8k          # both runs, on the GPU
    python examples/train_lm.py --device cpu --seqlen 1024 --steps 8 --tiny --out /tmp/smoke
    python examples/train_lm.py --replot examples/results/mqar-8k/results.json

The task is multi-query associative recall over the whole context (docs/training.md): a sequence
is S/2 pairs (key, value); every sequence draws its own key -> value table, keys are drawn
uniformly from --keys of them, so a key comes back on average --keys pairs (2 * --keys tokens)
later, and the model must predict the value after every key it has seen before. Only those
positions are scored. A key's last occurrence is often further back than the sparse budget of
K * 128 tokens, so the model can only solve the task if the proxy selects the right blocks.

Two runs of the same model (same initial weights, same batches), one after the other:
  dense: every layer is causal GQA attention through torch SDPA;
  msa:   every layer is flash_msa.MSAAttention, in warmup mode (dense attention, the proxy learns
         from the KL loss) for --warmup-steps steps, then sparse (top_k = --top-k-blocks * 128
         tokens per query and proxy head).
Per step: training loss, KL value (msa), step time. Every --eval-every steps and at the end:
accuracy on a held-out batch and, for msa, the proxy's block recall: the share of the dense
teacher's attention mass (the main heads of the proxy head's group, averaged, as in the KL loss)
that the selected blocks cover, and the overlap of the selected blocks with the teacher's top
blocks. At the end: the statistics of the trained proxy's selections (what bench/msa_bench.py's
trained-selection configuration is fitted to), results.json with every figure and PNG plots.
"""

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import flash_msa
from flash_msa import BLOCK_SIZE, MSAAttention, apply_rope, select_blocks, selection_stats


# ----------------------------------------------------------------------------------------------
# The task: multi-query associative recall over the whole context.


def make_batch(gen, batch, seqlen, keys, values, device, active=None):
    """tokens (B, S) int64 and targets (B, S) int64 with -100 where nothing is scored.

    Token ids: keys 0..keys-1, values keys..keys+values-1. Position 2t holds a key, 2t+1 its
    value under the sequence's own table. The target at 2t is the value when the key occurred
    before in the sequence (the only predictable positions). Each sequence draws its keys from
    `active` keys (default all) picked at random from the vocabulary."""
    pairs = seqlen // 2
    table = torch.randint(values, (batch, keys), generator=gen) + keys
    pool = torch.rand(batch, keys, generator=gen).argsort(dim=1)[:, : active or keys]
    k = torch.gather(pool, 1, torch.randint(pool.shape[1], (batch, pairs), generator=gen))
    v = torch.gather(table, 1, k)
    tokens = torch.stack((k, v), dim=2).view(batch, seqlen)
    # A key is "seen" when an earlier pair holds it: compare with the first occurrence.
    first = torch.full((batch, keys), pairs, dtype=torch.int64)
    first.scatter_reduce_(1, k, torch.arange(pairs).expand(batch, -1), reduce="amin")
    seen = torch.arange(pairs) > torch.gather(first, 1, k)
    targets = torch.full((batch, seqlen), -100, dtype=torch.int64)
    targets[:, 0::2] = torch.where(seen, v, -100)
    return tokens.to(device), targets.to(device)


# ----------------------------------------------------------------------------------------------
# The model: a pre-norm decoder; attention is MSAAttention or its dense twin.


class DenseAttention(nn.Module):
    """MSAAttention's main branch with dense causal attention (torch SDPA): the baseline."""

    def __init__(self, hidden, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.rope_base = heads, kv_heads, 10000.0
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x):
        split = MSAAttention._heads
        q = apply_rope(split(self.q_proj(x), self.heads), self.rope_base)
        k = apply_rope(split(self.k_proj(x), self.kv_heads), self.rope_base)
        v = split(self.v_proj(x), self.kv_heads)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2)), None


class Block(nn.Module):
    def __init__(self, args, msa):
        super().__init__()
        h = args.hidden
        self.norm1, self.norm2 = nn.RMSNorm(h), nn.RMSNorm(h)
        if msa:
            self.attn = MSAAttention(
                h, args.heads, args.kv_heads, args.head_dim, args.proxy_heads, 1, args.head_dim,
                top_k=args.top_k_blocks * BLOCK_SIZE, warmup=True,
                select_dtype=torch.float8_e4m3fn if args.fp8_select else None)
        else:
            self.attn = DenseAttention(h, args.heads, args.kv_heads, args.head_dim)
        # A short causal depthwise convolution mixes each token with the two before it (a
        # "token shift", as in H3, Based or RWKV): it hands the value position its key, so that
        # recall needs one attention hop and is learnt in hundreds of steps, not thousands.
        self.conv = nn.Conv1d(h, h, kernel_size=3, padding=2, groups=h, bias=False)
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h, bias=False), nn.GELU(),
                                 nn.Linear(4 * h, h, bias=False))

    def forward(self, x):
        y = self.norm1(x)
        y = y + self.conv(y.transpose(1, 2))[..., : y.shape[1]].transpose(1, 2)
        a, kl = self.attn(y)
        x = x + a
        return x + self.mlp(self.norm2(x)), kl


class LM(nn.Module):
    def __init__(self, args, msa):
        super().__init__()
        self.embed = nn.Embedding(args.keys + args.values, args.hidden)
        self.blocks = nn.ModuleList(Block(args, msa) for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.hidden)
        self.head = nn.Linear(args.hidden, args.keys + args.values, bias=False)

    def forward(self, tokens):
        """-> (logits (B, S, vocab), the KL loss terms summed over the layers, or None when
        dense). The terms carry the proxy gradient; their value is 0 (MSAAttention's default,
        compute_kl=False): each backward writes the KL value into the layer's kl_value."""
        x, kl = self.embed(tokens), None
        for block in self.blocks:
            x, layer_kl = block(x)
            if layer_kl is not None:
                kl = layer_kl if kl is None else kl + layer_kl
        return self.head(self.norm(x)), kl

    def msa_layers(self):
        return [b.attn for b in self.blocks if isinstance(b.attn, MSAAttention)]


# ----------------------------------------------------------------------------------------------
# What the proxy selects, against the dense teacher.


def block_recall(layer, q, k, qp, kp, queries):
    """Recall of the proxy's selection at the query positions `queries` (1-D, int64):
    (mass, top): the mean share of the teacher's attention mass inside the selected blocks, and
    the mean share of the teacher's top-K blocks (by mass) that are selected. The teacher is the
    dense causal attention of the main heads of the proxy head's group, averaged (the KL's
    teacher in warmup mode), in fp32. `queries` should see more than K blocks."""
    top_k_blocks = layer.top_k // BLOCK_SIZE
    sel = select_blocks(qp, kp, top_k_blocks)[:, :, queries]            # (B, Hp, n, K)
    seqlen, nb = k.shape[2], -(-k.shape[2] // BLOCK_SIZE)
    kr = k.repeat_interleave(layer.num_heads // layer.num_kv_heads, dim=1).float()
    logits = (q[:, :, queries].float() @ kr.transpose(-1, -2)) * layer.head_dim ** -0.5
    logits.masked_fill_(torch.arange(seqlen, device=q.device) > queries[:, None], -math.inf)
    probs = logits.softmax(-1)                                           # (B, H, n, S)
    teacher = probs.unflatten(1, (layer.num_proxy_heads, -1)).mean(2)    # (B, Hp, n, S)
    mass = F.pad(teacher, (0, nb * BLOCK_SIZE - seqlen)).unflatten(-1, (nb, BLOCK_SIZE)).sum(-1)
    chosen = torch.zeros_like(mass, dtype=torch.bool).scatter_(-1, sel.clamp(min=0).long(),
                                                               (sel >= 0))
    best = mass.topk(top_k_blocks, dim=-1).indices
    top = torch.gather(chosen, -1, best).float().mean(-1)
    return (mass * chosen).sum(-1).mean().item(), top.mean().item()


# ----------------------------------------------------------------------------------------------
# Training.


def evaluate(model, batches, args, full=False):
    """Held-out accuracy (and, for msa, block recall per layer; with full, the statistics of the
    selections too)."""
    model.eval()
    correct = total = 0
    recall, stats = [], []
    captured = {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, i=i: captured.__setitem__(i, a[0]))
             for i, layer in enumerate(model.msa_layers())]
    with torch.no_grad():
        with autocast(args):
            for tokens, targets in batches:
                logits, _ = model(tokens)
                scored = targets >= 0
                correct += (logits.argmax(-1)[scored] == targets[scored]).sum().item()
                total += scored.sum().item()
            # The layers' inputs of the last batch, projected as the layers do.
            projected = [layer.projections(captured[i]) for i, layer in enumerate(model.msa_layers())]
        # Recall at queries from the second half, strided; the teacher in fp32, outside autocast.
        seqlen = tokens.shape[1]
        queries = torch.arange(seqlen // 2, seqlen, max(1, seqlen // 1024), device=tokens.device)
        for layer, (qp, kp, q, k, _) in zip(model.msa_layers(), projected):
            mass, top = block_recall(layer, q, k, qp, kp, queries)
            recall.append({"mass": round(mass, 4), "top_blocks": round(top, 4)})
            if full:
                stats.append(selection_stats(select_blocks(qp, kp, layer.top_k // BLOCK_SIZE)))
    for h in hooks:
        h.remove()
    model.train()
    return correct / max(total, 1), recall, stats


def autocast(args):
    return torch.autocast(device_type=args.device, dtype=torch.bfloat16, enabled=args.device == "cuda")


def train(name, model, args, eval_batches, log):
    """One run; returns its record (per-step and per-eval figures)."""
    msa = bool(model.msa_layers())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))
    gen = torch.Generator().manual_seed(args.seed + 1)  # the same batches for both runs
    rec = {"steps": [], "evals": []}
    start = time.monotonic()
    for step in range(args.steps):
        warmup = msa and step < args.warmup_steps
        if msa and step in (0, args.warmup_steps):  # warmup first, then sparse
            flash_msa.set_warmup(model, warmup)
        if step < args.short_steps:  # the length curriculum: as many tokens, shorter sequences
            shape = (args.batch * args.seqlen // args.short_seqlen, args.short_seqlen)
            active = max(1, args.keys * args.short_seqlen // args.seqlen)
        else:
            shape, active = (args.batch, args.seqlen), None
        tokens, targets = make_batch(gen, *shape, args.keys, args.values, args.device, active)
        sync(args)
        t0 = time.perf_counter()
        with autocast(args):
            logits, kl = model(tokens)
            ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            loss = ce if kl is None else ce + args.kl_weight * kl
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        sync(args)
        ms = (time.perf_counter() - t0) * 1e3
        entry = {"step": step, "phase": "warmup" if warmup else ("sparse" if msa else "dense"),
                 "seqlen": shape[1], "loss": round(ce.item(), 5), "ms": round(ms, 3)}
        if kl is not None:  # the KL value of this step's backward, summed over the layers
            kl = sum(layer.kl_value for layer in model.msa_layers())
            entry["kl"] = round(kl.item(), 5)
        rec["steps"].append(entry)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            acc, recall, _ = evaluate(model, eval_batches, args)
            rec["evals"].append({"step": step, "accuracy": round(acc, 4), "recall": recall})
            elapsed = time.monotonic() - start
            eta = elapsed / (step + 1) * (args.steps - step - 1)
            extra = "" if kl is None else f" kl {kl.item():.4f} recall(mass) " + \
                " ".join(f"{r['mass']:.3f}" for r in recall)
            log(f"{name} step {step + 1}/{args.steps} [{entry['phase']}] loss {ce.item():.4f} "
                f"acc {acc:.4f}{extra} {ms:.1f} ms/step, ETA {eta:.0f} s")
    acc, recall, stats = evaluate(model, eval_batches, args, full=msa)
    rec["final"] = {"accuracy": round(acc, 4), "recall": recall}
    if stats:
        rec["selection_stats"] = stats
    times = {}
    for phase in ("dense", "warmup", "sparse"):
        ms = sorted(s["ms"] for s in rec["steps"][1:]
                    if s["phase"] == phase and s["seqlen"] == args.seqlen)
        if ms:
            times[phase] = round(ms[len(ms) // 2], 3)
    rec["median_step_ms"] = times
    return rec


def sync(args):
    if args.device == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------
# Plots.


def plot(result, folder):
    """loss.png, accuracy.png, kl.png, recall.png, step_time.png from a results record."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    warmup_steps = result["args"]["warmup_steps"]

    def figure(fname, ylabel, series, logy=False):
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, xs, ys in series:
            ax.plot(xs, ys, label=label, linewidth=1)
        if "msa" in runs and warmup_steps < result["args"]["steps"]:
            ax.axvline(warmup_steps, color="gray", linestyle=":", label="msa: warmup -> sparse")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(folder, fname), dpi=110)
        plt.close(fig)

    def steps(run, key):
        pts = [(s["step"], s[key]) for s in runs[run]["steps"] if key in s]
        return [p[0] for p in pts], [p[1] for p in pts]

    figure("loss.png", "training loss (cross-entropy on scored positions)",
           [(run, *steps(run, "loss")) for run in runs], logy=True)
    figure("accuracy.png", "held-out accuracy",
           [(run, [e["step"] for e in runs[run]["evals"]], [e["accuracy"] for e in runs[run]["evals"]])
            for run in runs])
    if "msa" in runs:
        figure("kl.png", "KL value (sum over layers)", [("msa", *steps("msa", "kl"))], logy=True)
        evals = runs["msa"]["evals"]
        series = []
        for layer in range(len(evals[0]["recall"])):
            xs = [e["step"] for e in evals]
            series.append((f"layer {layer}: teacher mass in selected blocks", xs,
                           [e["recall"][layer]["mass"] for e in evals]))
            series.append((f"layer {layer}: teacher's top-K blocks selected", xs,
                           [e["recall"][layer]["top_blocks"] for e in evals]))
        figure("recall.png", "block recall of the proxy's selection", series)
    figure("step_time.png", "time per training step (ms)",
           [(run, *steps(run, "ms")) for run in runs], logy=True)


# ----------------------------------------------------------------------------------------------


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="train_lm_out", help="output folder (results.json, *.png)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--short-steps", type=int, default=None,
                   help="first steps on sequences of --short-seqlen tokens, as many tokens a step "
                        "(default: 20%% of --steps); both runs, in warmup for msa")
    p.add_argument("--short-seqlen", type=int, default=1024)
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="msa steps in warmup mode (default: 40%% of --steps)")
    p.add_argument("--seqlen", type=int, default=8192, help="context length (tokens)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--keys", type=int, default=None, help="key vocabulary (default: seqlen / 8)")
    p.add_argument("--values", type=int, default=64, help="value vocabulary")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--proxy-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128, help="128: the Hopper kernels")
    p.add_argument("--top-k-blocks", type=int, default=None,
                   help="blocks of 128 tokens per query (default: seqlen / 8 tokens' worth)")
    p.add_argument("--fp8-select", action="store_true",
                   help="rank the blocks on FP8 scores in sparse mode (select_dtype, Hopper, "
                        "head dim 128, or the CPU)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--kl-weight", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=2)
    p.add_argument("--runs", default="dense,msa", help="which runs, comma-separated")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke test)")
    p.add_argument("--replot", metavar="JSON", help="only redraw the plots of a results.json")
    args = p.parse_args(argv)
    if args.tiny:
        args.hidden, args.heads, args.kv_heads, args.proxy_heads, args.head_dim = 64, 2, 1, 1, 32
    args.keys = args.keys or max(8, args.seqlen // 8)
    args.top_k_blocks = args.top_k_blocks or max(1, args.seqlen // 8 // BLOCK_SIZE)
    if args.warmup_steps is None:
        args.warmup_steps = int(0.4 * args.steps)
    if args.short_steps is None:
        args.short_steps = int(0.2 * args.steps)
    runs = args.runs.split(",")
    if not runs or any(r not in ("dense", "msa") for r in runs):
        p.error(f"--runs: expected dense, msa or both, got {args.runs!r}")
    if args.seqlen % 2 or args.seqlen < 2 * BLOCK_SIZE:
        p.error("--seqlen: expected an even number of at least 256 tokens")
    if args.short_steps and (args.seqlen % args.short_seqlen or args.short_seqlen % 256):
        p.error(f"--short-seqlen {args.short_seqlen}: expected a multiple of 256 that divides "
                f"--seqlen ({args.seqlen})")
    if "msa" in runs and args.short_steps > args.warmup_steps:
        p.error("--short-steps: the short sequences are for the warmup phase: expected at most "
                f"--warmup-steps ({args.warmup_steps}), got {args.short_steps}")
    if "msa" in runs and args.top_k_blocks * BLOCK_SIZE * 8 > args.seqlen:
        p.error(f"--top-k-blocks {args.top_k_blocks}: K * 128 must be at most an eighth of "
                f"--seqlen ({args.seqlen})")
    if args.device == "cuda" and not (torch.cuda.is_available() and flash_msa.built_with_cuda()):
        p.error("--device cuda: needs a GPU and flash_msa built with CUDA")
    if "msa" in runs and args.device == "cuda" and args.proxy_heads % args.kv_heads:
        p.error(f"--proxy-heads {args.proxy_heads}: the CUDA kernels keep each proxy group inside "
                f"one kv group: expected a multiple of --kv-heads ({args.kv_heads})")
    return args, runs


def main(argv=None):
    args, runs = parse(argv)
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), os.path.dirname(os.path.abspath(args.replot)))
        return
    os.makedirs(args.out, exist_ok=True)
    t_start = time.monotonic()

    def log(msg):
        print(f"[{time.monotonic() - t_start:7.1f}s] {msg}", flush=True)

    eval_gen = torch.Generator().manual_seed(args.seed + 10_000)
    eval_batches = [make_batch(eval_gen, args.batch, args.seqlen, args.keys, args.values, args.device)
                    for _ in range(args.eval_batches)]
    torch.manual_seed(args.seed)
    dense_init = LM(args, msa=False).state_dict()
    result = {"argv": sys.argv, "args": vars(args), "runs": {}}
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    for name in runs:
        torch.manual_seed(args.seed + 1)
        model = LM(args, msa=(name == "msa"))
        # The same initial weights for what both models share (all but the proxy projections).
        missing = model.load_state_dict(dense_init, strict=False).missing_keys
        assert all("proxy" in key for key in missing), missing
        model.to(args.device)
        log(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")
        result["runs"][name] = train(name, model, args, eval_batches, log)
        log(f"{name}: final held-out accuracy {result['runs'][name]['final']['accuracy']:.4f}, "
            f"median step {result['runs'][name]['median_step_ms']} ms")
        del model
        with open(os.path.join(args.out, "results.json"), "w") as f:  # after each run
            json.dump(result, f, indent=1)
    try:
        plot(result, args.out)
    except ImportError:
        log("matplotlib is not installed: no plots (make them later with --replot)")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
