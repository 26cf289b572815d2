"""Continued pretraining of a Hugging Face Llama model with MSA (flash_msa.hf), against dense.

    python examples/continue_pretraining.py --out examples/results/cpt-cpu     # ~6 min, 2-core CPU
    python examples/continue_pretraining.py --device cuda --context 32768 --top-k 4096 \\
        --hidden 1024 --layers 4 --heads 8 --kv-heads 2 --head-dim 128 --batch 1 \\
        --pretrain-steps 300 --steps 200 --warmup-steps 80 --out cpt-32k       # one GPU

The text is the Python standard library's own sources: every *.py file under
sysconfig.get_paths()["stdlib"] (site-packages left out), sorted by path, as bytes (vocabulary
256). Every --val-every-th file goes to the validation text, the others to the training text, so
no validation file is trained on. Training batches are windows of --context bytes at random
offsets of the training text (fixed seeds); validation is --val-seqs windows at evenly spaced
offsets of the validation text.

1. pretrain: a LlamaForCausalLM built from a LlamaConfig here (random init) trains dense for
   --pretrain-steps steps. Its weights are the checkpoint both continuations start from.
2. dense: the checkpoint continues dense for --steps steps.
3. msa: the checkpoint is converted with flash_msa.hf.convert(top_k=--top-k) and continues for
   the same --steps steps on the same batches: --warmup-steps in warmup mode (dense attention;
   the KL loss trains the proxy from the main attention), then sparse. The loss is the LM loss
   plus --kl-weight * flash_msa.hf.kl_loss(model) (convert's kl_weight: the model's loss adds
   it); the KL value logged is the sum over layers of
   each layer's msa_kl_value after the backward. The proxy projections, new and randomly
   initialised among pretrained weights, train at their own --proxy-lr.

Every --eval-every steps: the validation loss of both continuations and, for msa, the proxy's
block recall on the first --recall-seqs validation windows: per layer, for every query that sees
more than K = top_k / 128 blocks, the share of the main attention's K heaviest blocks (causal,
the mean attention of the proxy head's group of query heads, the KL's teacher) that the proxy
selects (flash_msa.select_blocks), averaged. The same figure for a sliding window (the query's
own block and the K - 1 before it) is the baseline a proxy has to beat. Writes results.json,
cpt.png and prints a summary table.
"""

import argparse
import copy
import hashlib
import json
import math
import os
import pathlib
import platform
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import flash_msa
import flash_msa.hf
from flash_msa import BLOCK_SIZE, select_blocks


# ----------------------------------------------------------------------------------------------
# The text.


def load_corpus(val_every):
    """(train bytes, validation bytes) as uint8 tensors, and a record of what was read."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for f in root.rglob("*.py")
                   if "site-packages" not in f.relative_to(root).parts)
    train, val = [], []
    for i, f in enumerate(files):
        (val if i % val_every == 0 else train).append(f.read_bytes())
    train, val = b"".join(train), b"".join(val)
    info = {"root": str(root), "python": platform.python_version(), "files": len(files),
            "train_bytes": len(train), "val_bytes": len(val),
            "sha256": hashlib.sha256(train + val).hexdigest()[:16]}
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)
    return as_tensor(train), as_tensor(val), info


def windows(data, starts, context, device):
    return torch.stack([data[s: s + context] for s in starts]).long().to(device)


def random_batch(data, gen, batch, context, device):
    starts = torch.randint(len(data) - context, (batch,), generator=gen).tolist()
    return windows(data, starts, context, device)


# ----------------------------------------------------------------------------------------------
# The model and its training.


def build_model(args):
    config = LlamaConfig(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        max_position_embeddings=args.context, tie_word_embeddings=False,
        attn_implementation="sdpa")
    return LlamaForCausalLM(config).to(args.device, args.dtype)


def lm_loss(model, tokens):
    return model(tokens, labels=tokens, use_cache=False).loss


@torch.no_grad()
def validation_loss(model, val_batches):
    model.eval()
    loss = sum(lm_loss(model, tokens).item() for tokens in val_batches) / len(val_batches)
    model.train()
    return loss


def train(name, model, args, steps, lr, gen, evaluate, log, warmup_steps=None):
    """Trains `steps` steps on batches from `gen`; `warmup_steps` is set for a converted model
    (warmup mode for that many steps, then sparse). evaluate(step) -> dict, run every
    --eval-every steps and at the end. Returns the run's record."""
    msa = warmup_steps is not None
    proxy = [p for n, p in model.named_parameters() if "_proxy_proj." in n]
    others = [p for n, p in model.named_parameters() if "_proxy_proj." not in n]
    groups = [{"params": others}]
    if proxy:  # new and randomly initialised among pretrained weights: a learning rate of its own
        groups.append({"params": proxy, "lr": args.proxy_lr})
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    ramp = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / ramp) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / steps))))
    rec = {"steps": [], "evals": [dict(step=0, **evaluate(0))]}
    for step in range(steps):
        if msa:
            flash_msa.hf.set_warmup(model, step < warmup_steps)
        tokens = random_batch(args.train_text, gen, args.batch, args.context, args.device)
        t0 = time.perf_counter()
        ce = lm_loss(model, tokens)  # a converted model adds kl_weight * its KL terms (0 in value)
        ce.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        entry = {"step": step + 1, "loss": round(ce.item(), 5),
                 "ms": round((time.perf_counter() - t0) * 1e3, 1)}
        if msa:
            entry["phase"] = "warmup" if step < warmup_steps else "sparse"
            # The backward wrote each converted layer's KL value.
            entry["kl_layers"] = [round(m.self_attn.msa_kl_value.item(), 5)
                                  for m in model.model.layers]
            entry["kl"] = round(sum(entry["kl_layers"]), 5)
        rec["steps"].append(entry)
        if (step + 1) % args.eval_every == 0 or step + 1 == steps:
            ev = evaluate(step + 1)
            rec["evals"].append(dict(step=step + 1, **ev))
            extra = f" kl {entry['kl']:.4f} [{entry['phase']}]" if msa else ""
            if "recall" in ev:
                extra += " recall " + " ".join(f"{r['top_blocks']:.3f}" for r in ev["recall"])
            log(f"{name} step {step + 1}/{steps} loss {ce.item():.4f} val {ev['val_loss']:.4f}"
                f"{extra} {entry['ms']:.0f} ms/step")
    ms = sorted(s["ms"] for s in rec["steps"][1:])
    rec["median_step_ms"] = ms[len(ms) // 2] if ms else None
    return rec


# ----------------------------------------------------------------------------------------------
# The proxy's block recall.


RECALL_CHUNK = 2048  # queries per chunk of block_recall's dense teacher


def heads(x, head_dim):
    return x.unflatten(-1, (-1, head_dim)).transpose(1, 2)  # (B, S, H*D) -> (B, H, S, D)


@torch.no_grad()
def block_recall(model, tokens):
    """Per converted layer: {"top_blocks": the mean share of the teacher's K heaviest blocks that
    the proxy selects, "window": the same for the own block and the K - 1 before it, "mass": the
    mean share of the teacher's attention mass in the selected blocks}, over the queries that see
    more than K blocks. The teacher is the main attention of the proxy head's group of query
    heads, averaged (the KL's teacher), causal, in fp32."""
    top_k_blocks = model.config.msa["top_k"] // BLOCK_SIZE
    inputs = {}

    def capture(module, args, kwargs):
        # The attention module's inputs, from which its q/k and proxy q/k are recomputed.
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        rotary = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
        inputs[module.layer_idx] = (hidden, rotary)

    attns = [layer.self_attn for layer in model.model.layers if hasattr(layer.self_attn, "q_proxy_proj")]
    hooks = [a.register_forward_pre_hook(capture, with_kwargs=True) for a in attns]
    model.eval()
    try:
        model(tokens, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        model.train()
    seqlen = tokens.shape[1]
    nb = -(-seqlen // BLOCK_SIZE)
    pos = torch.arange(seqlen, device=tokens.device)
    blocks = torch.arange(nb, device=tokens.device)
    queries = pos[top_k_blocks * BLOCK_SIZE:]  # these see more than K blocks
    out = []
    for attn in attns:
        hidden, (cos, sin) = inputs[attn.layer_idx]
        d = attn.head_dim
        q, k = apply_rotary_pos_emb(heads(attn.q_proj(hidden), d), heads(attn.k_proj(hidden), d),
                                    cos, sin)
        qp, kp = apply_rotary_pos_emb(heads(attn.q_proxy_proj(hidden), d),
                                      heads(attn.k_proxy_proj(hidden), d), cos, sin)
        selection = select_blocks(qp, kp, top_k_blocks)                    # (B, Hp, S, K)
        groups = qp.shape[1]
        kr = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1).float()
        # Query chunks of RECALL_CHUNK rows: the fp32 logits of all the queries at once would
        # take B * H * S^2 * 4 bytes (34 GB per sequence at 32K with 8 heads).
        hits = window_hits = mass = 0.0
        for chunk in queries.split(RECALL_CHUNK):
            sel = selection[:, :, chunk]                                     # (B, Hp, n, K)
            logits = (q[:, :, chunk].float() @ kr.transpose(-1, -2)) * attn.scaling
            logits.masked_fill_(pos > chunk[:, None], -math.inf)
            teacher = logits.softmax(-1).unflatten(1, (groups, -1)).mean(2)  # (B, Hp, n, S)
            block_mass = F.pad(teacher, (0, nb * BLOCK_SIZE - seqlen)).unflatten(
                -1, (nb, BLOCK_SIZE)).sum(-1)
            chosen = torch.zeros_like(block_mass, dtype=torch.bool).scatter_(
                -1, sel.clamp(min=0).long(), sel >= 0)
            best = block_mass.topk(top_k_blocks, dim=-1).indices
            qblock = chunk // BLOCK_SIZE
            window = (blocks <= qblock[:, None]) & (blocks > qblock[:, None] - top_k_blocks)
            hits += torch.gather(chosen, -1, best).double().sum().item()
            window_hits += window.expand_as(chosen).gather(-1, best).double().sum().item()
            mass += (block_mass * chosen).sum(-1).double().sum().item()
        rows = tokens.shape[0] * groups * len(queries)
        out.append({"top_blocks": round(hits / (rows * top_k_blocks), 4),
                    "window": round(window_hits / (rows * top_k_blocks), 4),
                    "mass": round(mass / rows, 4)})
    return out


# ----------------------------------------------------------------------------------------------
# Plot.


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args, runs = result["args"], result["runs"]
    offset = args["pretrain_steps"]
    fig, (ax_loss, ax_kl, ax_rec) = plt.subplots(1, 3, figsize=(15, 4))
    pre = result["pretrain"]["evals"]
    ax_loss.plot([e["step"] for e in pre], [e["val_loss"] for e in pre], label="pretrain (dense)")
    for name, run in runs.items():
        ax_loss.plot([offset + e["step"] for e in run["evals"]],
                     [e["val_loss"] for e in run["evals"]], label=f"continued {name}")
    ax_loss.set(xlabel="step", ylabel="validation loss (nats/byte)")
    msa = runs["msa"]
    ax_kl.plot([s["step"] for s in msa["steps"]], [s["kl"] for s in msa["steps"]], linewidth=1)
    ax_kl.set(xlabel="continuation step", ylabel="KL value (sum over layers)", yscale="log")
    xs = [e["step"] for e in msa["evals"]]
    for i in range(len(msa["evals"][0]["recall"])):
        ax_rec.plot(xs, [e["recall"][i]["top_blocks"] for e in msa["evals"]],
                    color=f"C{i}", label=f"layer {i}: proxy")
        ax_rec.plot(xs, [e["recall"][i]["window"] for e in msa["evals"]], linestyle=":",
                    color=f"C{i}", label=f"layer {i}: sliding window")
    ax_rec.set(xlabel="continuation step", ylabel="teacher's top-K blocks selected", ylim=(0, 1))
    for ax in (ax_kl, ax_rec):
        ax.axvline(args["warmup_steps"], color="gray", linestyle=":")
    ax_loss.axvline(offset + args["warmup_steps"], color="gray", linestyle=":",
                    label="msa: warmup -> sparse")
    for ax in (ax_loss, ax_kl, ax_rec):
        ax.grid(alpha=0.3)
    ax_loss.legend()
    ax_rec.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="cpt_out", help="output folder (results.json, cpt.png)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context", type=int, default=1024, help="tokens (bytes) per sequence")
    p.add_argument("--top-k", type=int, default=256,
                   help="MSA's top_k in tokens, a multiple of 128 below --context")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--pretrain-steps", type=int, default=150)
    p.add_argument("--pretrain-lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=100, help="steps of each continuation")
    p.add_argument("--warmup-steps", type=int, default=40,
                   help="first continuation steps of the msa model in warmup mode")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of the continuations")
    p.add_argument("--proxy-lr", type=float, default=1e-2,
                   help="peak learning rate of the proxy projections")
    p.add_argument("--kl-weight", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--val-every", type=int, default=20,
                   help="every n-th stdlib file is validation text")
    p.add_argument("--val-seqs", type=int, default=8)
    p.add_argument("--recall-seqs", type=int, default=2)
    args = p.parse_args(argv)
    if args.context % BLOCK_SIZE or args.context < 2 * BLOCK_SIZE:
        p.error(f"--context: expected a multiple of {BLOCK_SIZE} of at least {2 * BLOCK_SIZE}, "
                f"got {args.context}")
    if args.top_k % BLOCK_SIZE or not 0 < args.top_k < args.context:
        p.error(f"--top-k: expected a multiple of {BLOCK_SIZE} below --context ({args.context}), "
                f"got {args.top_k}")
    if not 0 <= args.warmup_steps <= args.steps:
        p.error(f"--warmup-steps: expected 0 .. --steps ({args.steps}), got {args.warmup_steps}")
    if args.recall_seqs > args.val_seqs:
        p.error(f"--recall-seqs: expected at most --val-seqs ({args.val_seqs})")
    if args.device == "cuda" and not (torch.cuda.is_available() and flash_msa.built_with_cuda()):
        p.error("--device cuda: needs a GPU and flash_msa built with CUDA")
    # The CUDA ops take bf16/fp16: bf16 weights on the GPU (the example keeps one dtype
    # throughout; a converted model also runs under autocast).
    args.dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    return args


def main(argv=None):
    args = parse(argv)
    os.makedirs(args.out, exist_ok=True)
    t_start = time.monotonic()

    def log(msg):
        print(f"[{time.monotonic() - t_start:7.1f}s] {msg}", flush=True)

    args.train_text, val_text, corpus = load_corpus(args.val_every)
    log(f"corpus: {corpus['files']} files of Python {corpus['python']}'s standard library, "
        f"{corpus['train_bytes']} training and {corpus['val_bytes']} validation bytes")
    starts = torch.linspace(0, len(val_text) - args.context, args.val_seqs).long().tolist()
    val_seqs = windows(val_text, starts, args.context, args.device)
    val_batches = val_seqs.split(args.batch)
    recall_tokens = val_seqs[: args.recall_seqs]
    saved_args = {k: v for k, v in vars(args).items() if k not in ("train_text", "dtype")}
    result = {"argv": sys.argv, "args": saved_args, "dtype": str(args.dtype), "corpus": corpus,
              "torch": torch.__version__, "threads": torch.get_num_threads(), "runs": {}}
    if args.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()

    torch.manual_seed(args.seed)
    model = build_model(args)
    log(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.3f} M parameters")
    dense_eval = lambda step: {"val_loss": round(validation_loss(model, val_batches), 5)}
    result["pretrain"] = train("pretrain", model, args, args.pretrain_steps, args.pretrain_lr,
                               torch.Generator().manual_seed(args.seed + 1), dense_eval, log)
    checkpoint = copy.deepcopy(model.state_dict())

    for name in ("dense", "msa"):
        model = build_model(args)
        model.load_state_dict(checkpoint)
        warmup_steps = None
        if name == "msa":
            torch.manual_seed(args.seed + 3)  # the proxy projections' initialisation
            flash_msa.hf.convert(model, top_k=args.top_k, warmup=True, kl_weight=args.kl_weight)
            warmup_steps = args.warmup_steps

        def evaluate(step, model=model, name=name):
            ev = {"val_loss": round(validation_loss(model, val_batches), 5)}
            if name == "msa":
                ev["phase"] = "warmup" if model.config.msa["warmup"] else "sparse"
                ev["recall"] = block_recall(model, recall_tokens)
                if step == 0:  # the checkpoint with the untrained proxy, sparse: what the
                    # warmup has to repair
                    ev["val_loss_sparse"] = round(validation_loss_in_mode(model, val_batches,
                                                                          False), 5)
            return ev

        # The same batches for both continuations.
        gen = torch.Generator().manual_seed(args.seed + 2)
        run = train(name, model, args, args.steps, args.lr, gen, evaluate, log, warmup_steps)
        if name == "msa":
            # The trained model with dense attention: how much of the gap is the sparsity.
            run["final_val_loss_warmup_mode"] = round(
                validation_loss_in_mode(model, val_batches, True), 5)
        result["runs"][name] = run
        with open(os.path.join(args.out, "results.json"), "w") as f:  # after each run
            json.dump(result, f, indent=1)

    dense, msa = result["runs"]["dense"], result["runs"]["msa"]
    final_recall = msa["evals"][-1]["recall"]
    summary = {
        "val_loss_checkpoint": dense["evals"][0]["val_loss"],
        "val_loss_dense": dense["evals"][-1]["val_loss"],
        "val_loss_msa": msa["evals"][-1]["val_loss"],
        "val_loss_msa_warmup_mode": msa["final_val_loss_warmup_mode"],
        "kl_final": msa["steps"][-1]["kl"],
        "block_recall": round(sum(r["top_blocks"] for r in final_recall) / len(final_recall), 4),
        "block_recall_window": round(sum(r["window"] for r in final_recall) / len(final_recall), 4),
        "seconds": round(time.monotonic() - t_start, 1)}
    summary["gap_percent"] = round(
        100 * (summary["val_loss_msa"] / summary["val_loss_dense"] - 1), 3)
    result["summary"] = summary
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)

    print(f"\n{'step':>5} {'val dense':>10} {'val msa':>10} {'phase':>7} {'kl':>8}  "
          "recall per layer (proxy / window)")
    kl_at = {s["step"]: s["kl"] for s in msa["steps"]}
    for d, m in zip(dense["evals"], msa["evals"]):
        recall = "  ".join(f"{r['top_blocks']:.3f}/{r['window']:.3f}" for r in m["recall"])
        kl = f"{kl_at[m['step']]:8.4f}" if m["step"] in kl_at else " " * 8
        print(f"{d['step']:>5} {d['val_loss']:>10.4f} {m['val_loss']:>10.4f} {m['phase']:>7} "
              f"{kl}  {recall}")
    print(f"\nvalidation loss at the end: dense {summary['val_loss_dense']:.4f}, msa "
          f"{summary['val_loss_msa']:.4f} (gap {summary['gap_percent']:+.2f} %), msa with dense "
          f"attention {summary['val_loss_msa_warmup_mode']:.4f}; final KL {summary['kl_final']:.4f}; "
          f"block recall {summary['block_recall']:.3f} (sliding window "
          f"{summary['block_recall_window']:.3f})")
    try:
        plot(result, os.path.join(args.out, "cpt.png"))
    except ImportError:
        log("matplotlib is not installed: no plot")
    log(f"wrote {args.out}")


def validation_loss_in_mode(model, val_batches, warmup):
    """The validation loss of a converted model in warmup (True) or sparse mode; the model's mode
    is left as it was."""
    saved = model.config.msa["warmup"]
    flash_msa.hf.set_warmup(model, warmup)
    try:
        return validation_loss(model, val_batches)
    finally:
        flash_msa.hf.set_warmup(model, saved)


if __name__ == "__main__":
    main()
