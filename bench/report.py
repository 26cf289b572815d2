"""Turns a bench/msa_bench.py result into docs/benchmarks.md and two plots beside the JSON.

    python3 bench/report.py bench/results/RUN.json [--doc docs/benchmarks.md]

Every number in the page and the plots comes from the JSON; nothing is typed by hand. The plots
need matplotlib (scripts/install_deps.sh installs it into .venv); without it the page is still written.
"""

import argparse
import json
import os

STAGES = [("select", "select"), ("forward", "forward"), ("backward", "backward"), ("step", "step")]


def share(c):
    """ [+x.x %]: the step's extra time for the backward's KL value."""
    s = c.get("kl_value_share_of_step")
    return "" if s is None else f" [{100 * s:+.1f} %]"


def growth(c):
    """ (+x.xx GB): the step's memory growth above its inputs, where the run measured it."""
    g = c.get("step_memory_growth_gb")
    return "" if g is None else f" (+{g} GB)"


def fmt_ms(e):
    if not e or "ms" not in e:
        return "-"
    t = f" ({e['tflops']:.0f})" if e.get("tflops") else ""
    return f"{e['ms']:.2f}{t}"


def step_of(peer):
    return (peer or {}).get("step", {}).get("ms")


def kernel_name(key, with_template=False):
    """A profiler kernel name without return type, arguments, template arguments and the
    namespaces up to the stage and chip folders, e.g. sm90::sparse_forward::forward_kernel.
    with_template keeps the template arguments as far as the profiler key holds them (for two
    instantiations of one kernel in a list)."""
    name = key.replace("(anonymous namespace)::", "").replace("void ", "", 1).split("(")[0]
    name, _, template = name.partition("<")
    parts = [p for p in name.split("::") if p not in ("flash_msa", "cuda", "detail")]
    short = "::".join(parts[-3:])
    if with_template and template:
        short += "<" + template.rstrip(", ") + ("" if template.endswith(">") else "...>")
    return short


def kernel_list(kernels):
    """`name` ms; ... for a {profiler key: ms} dict, template arguments where names repeat."""
    names = [kernel_name(k) for k in kernels]
    return "; ".join(f"`{kernel_name(k, names.count(kernel_name(k)) > 1)}` {t:.2f}"
                     for k, t in kernels.items())


def selection_section(configs):
    """Proxy selections on random inputs against selections drawn like a trained model's."""
    rows = []
    for c in configs:
        stats = c.get("selection_stats") or c.get("selection_fit", {}).get("drawn")
        if "step" not in c or not stats:
            continue
        rows.append(f"| {c['name']} | {c['selection']} | {stats['neighbour_overlap']:.2f} | "
                    f"{stats['tile_union_over_k']:.1f} | {stats['sink_share']:.2f} | "
                    f"{fmt_ms(c['forward'])} | {fmt_ms(c['backward'])} | {fmt_ms(c['step'])} |")
    if not rows:
        return []
    out = [
        "## Selections: the proxy's on random inputs against a trained model's",
        "",
        "| config | selection | neighbour overlap | blocks per query block / K | sink share | "
        "forward | backward | step |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Neighbour overlap: the share of a token's K blocks that the next token selects too; "
        "blocks per query block: how many distinct blocks the 128 tokens of a query block select "
        "together, over K (1 when they share one selection, up to 128); sink share: rows that "
        "select block 0 (`flash_msa.selection_stats`). \"trained\" selections are drawn by "
        "bench/trained_selection.py to follow the statistics measured on the trained example "
        "model (docs/training.md):",
        "",
    ]
    for c in configs:
        fit = c.get("selection_fit")
        if not fit or "step" not in c:
            continue
        t, d = fit["target"], fit["drawn"]
        out.append(
            f"- {c['name']}: target (from `{t['source']}`, mean of {t['layers']} layers) "
            f"neighbour overlap {t['neighbour_overlap']:.3f}, sink share {t['sink_share']:.3f}, "
            f"blocks per query block / K {t['tile_union_over_k']:.2f} at K = {t['top_k_blocks']}; drawn "
            f"{d['neighbour_overlap']:.3f}, {d['sink_share']:.3f}, {d['tile_union_over_k']:.2f} at "
            f"K = {d['top_k_blocks']} (segments of {fit['segment_tokens']} tokens on average).")
    return out + [""]


def warmup_section(configs):
    """Warmup (dense) steps against cuDNN dense attention of the main branch alone."""
    rows = [c for c in configs if c.get("warmup") and "step" in c]
    if not rows:
        return []
    out = [
        "## Warmup against dense attention",
        "",
        "| config | warmup step | with the KL value (backward's) | KL value share | cuDNN dense "
        "causal forward + backward | warmup / cuDNN |",
        "|---|---|---|---|---|---|",
    ]
    for c in rows:
        dense = step_of(c.get("peers", {}).get("cudnn"))
        ratio = f"{c['step_with_kl_value']['ms'] / dense:.2f}x" if dense else "- (no dense peer)"
        share = c.get("kl_value_share_of_step")
        out.append(
            f"| {c['name']} | {fmt_ms(c['step'])} | {fmt_ms(c['step_with_kl_value'])} | "
            f"{'-' if share is None else f'{100 * share:+.1f} %'} | "
            f"{fmt_ms(c.get('peers', {}).get('cudnn', {}).get('step'))} | {ratio} |")
    out += [
        "",
        "The warmup step is the dense forward (without the KL value) and the dense backward, "
        "which computes the main gradients, the teacher and the proxy gradients, and with "
        "`kl_out` the KL value, in one pass; the ratio takes the step with the KL value. cuDNN "
        "runs the main "
        "attention alone (causal, kv heads repeated to 64): no proxy branch, no teacher. With "
        "documents there is no dense peer (cuDNN would attend across the packed documents).",
        "",
    ]
    return out


def fp8_section(res):
    """The FP8 select against the exact one: time, step, and what it keeps of the selection."""
    rows = [c for c in res["configs"] if "select_fp8" in c]
    if not rows:
        return []
    out = [
        "## FP8 select (`select_dtype=torch.float8_e4m3fn`, Hopper)",
        "",
        "| config | select | FP8 select | speedup | blocks kept | step | step with FP8 select |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in rows:
        f = c["select_fp8"]
        kept = f"{f['kept_share']:.3f}" if "kept_share" in f else "-"
        out.append(f"| {c['name']} | {fmt_ms(c['select'])} | {fmt_ms(f)} | "
                   f"{c['select']['ms'] / f['ms']:.2f}x | {kept} | {fmt_ms(c['step'])} | "
                   f"{fmt_ms(c['step_fp8_select'])} |")
    out += [
        "",
        "TFLOP/s of both selects count the same executed FLOPs (2 Dp per visible key and "
        "query), whatever the operand type. Blocks kept: the share of the exact selection's "
        "K - 1 earlier blocks that the FP8 selection holds too, over the rows with more than "
        "K - 1 earlier blocks (random inputs). The step runs without the KL value.",
        "",
    ]
    quality = res.get("fp8_select_quality")
    if quality:
        out += [
            f"Selection quality at S = {quality['seqlen']} on the inputs of "
            "bench/fp8_select_quality.py, from the kernels' own selections:",
            "",
            "| inputs | overlap (mean) | overlap (1st percentile) | rows identical | "
            "regret (99th percentile) | regret (max) |",
            "|---|---|---|---|---|---|",
        ]
        for kind, q in quality["kinds"].items():
            out.append(f"| {kind} | {q['overlap_mean']:.4f} | {q['overlap_p01']:.3f} | "
                       f"{q['rows_identical']:.3f} | {q['regret_p99']:.3f} | "
                       f"{q['regret_max']:.3f} |")
        out += [
            "",
            "Overlap: the share of the exact selection's K - 1 earlier blocks that the FP8 "
            "selection holds; regret: how far the worst block FP8 took falls below the exact "
            "(K - 1)-th best, in standard deviations of the row's block scores.",
            "",
        ]
    return out


def flash_msa_peer_table(shapes):
    """Markdown lines of bench/against_flash_msa.py's comparison: the step through Flash-MSA's
    documented call, first step, memory growth, reproducibility and the selection."""
    lines = ["| shape | flash-msa step | Flash-MSA 0.1.1 step | speedup | first step (s) | "
             "memory growth (GB) | bitwise reproducible | rows with the same blocks |",
             "|---|---|---|---|---|---|---|---|"]
    for c in shapes:
        ours, peer = c["flash_msa"], c["flash_msa_0_1_1"]
        if "step_ms" not in ours or "step_ms" not in peer:
            lines.append(f"| {c['name']} | {ours.get('error', '')} | {peer.get('error', '')} "
                         "| | | | | |")
            continue
        same = c.get("selection", {}).get("rows_with_the_same_blocks")
        lines.append(
            f"| {c['name']} | {ours['step_ms']:.2f} ms | {peer['step_ms']:.2f} ms | "
            f"{c['speedup']:.2f}x | {ours['first_step_s']} / {peer['first_step_s']} | "
            f"{ours['memory_growth_gb']} / {peer['memory_growth_gb']} | "
            f"{ours['bitwise_reproducible']} / {peer['bitwise_reproducible']} | "
            f"{'' if same is None else f'{100 * same:.1f} %'} |")
    lines += ["", "Pairs are flash-msa / Flash-MSA. Both through "
              "`flash_msa_func(q_proxy, k_proxy, q, k, v, 2048, 128 ** -0.5)` and autograd, bf16, "
              "on the same tensors in one process (bench/against_flash_msa.py)."]
    return lines


def page(res, json_name, plots, note):
    env, ceil = res["environment"], res["ceilings"]
    heads = env["heads"]
    out = [
        "# Benchmarks",
        "",
        f"Generated by `python3 bench/report.py bench/results/{json_name}` from the run of "
        f"`python3 bench/msa_bench.py` on {env['date']}: {env['gpu']} ({env['sms']} SMs), driver "
        f"{env['driver']}, torch {env['torch']}, CUDA {env['cuda']}, commit {env['commit']}.",
        "",
        f"Shape: H={heads['H']}, Hk={heads['Hk']}, Hp={heads['Hp']}, Hpk={heads['Hpk']}, "
        f"D={heads['D']}, Dp={heads['Dp']}, K={heads['K']} blocks of 128, {env['dtype']}; random "
        "normal inputs, selections from the proxy select on them. Times are medians of CUDA-event "
        "timed calls after warm-up; TFLOP/s (in parentheses) count executed FLOPs as the "
        "docstring of bench/msa_bench.py defines them.",
        "",
        f"Ceilings measured in the same run: bf16 matmul {ceil['bf16_matmul_tflops']} TFLOP/s, "
        f"device copy {ceil['copy_tbps']} TB/s.",
        "",
    ]
    if note:
        out += [f"Run note: {note}", ""]
    out += [
        "## flash-msa per stage (ms, TFLOP/s)",
        "",
        "| config | select | scheduling | forward | forward + KL value | backward | "
        "backward + KL value | step | step + KL value (backward's) | peak memory (growth) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in res["configs"]:
        if "step" not in c:
            why = c.get("skipped") or c.get("error") or "incomplete"
            out.append(f"| {c['name']} | not measured: {why} |||||||||")
            continue
        sched = c.get("kernels", {}).get("forward_scheduling_ms")
        out.append(
            f"| {c['name']} | {fmt_ms(c.get('select'))} | "
            f"{'-' if sched is None else f'{sched:.2f}'} | {fmt_ms(c['forward'])} | "
            f"{fmt_ms(c.get('forward_with_kl_value'))} | {fmt_ms(c['backward'])} | "
            f"{fmt_ms(c.get('backward_with_kl_value'))} | {fmt_ms(c['step'])} | "
            f"{fmt_ms(c.get('step_with_kl_value'))}{share(c)} | {c['step_peak_memory_gb']} GiB"
            f"{growth(c)} |")
    out += [
        "",
        "The step is select + forward (without the KL value) + backward (with the proxy "
        "gradients); \"+ KL value\" columns compute the KL value too: in the forward "
        "(`compute_kl=True`, an extra pass over the selected blocks) or in the backward "
        "(`kl_out`, from the teacher the backward recomputes; MSAAttention's default), with the "
        "backward's cost as a share of the step in brackets; scheduling is the forward's share spent building the reverse index and the "
        "work items (profiler, one call; measured at 32K and 128K). Warmup rows run the dense "
        "kernels. Peak memory counts every tensor of the step, inputs included.",
        "",
        "## Training step against peers (forward + backward, ms; speedup of flash-msa)",
        "",
        "| config | flash-msa | cuDNN dense | speedup | FlashAttention-2 dense | FlexAttention "
        "block-sparse | MSA from torch ops |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in res["configs"]:
        if "step" not in c:
            continue
        p = c.get("peers", {})
        ours = c["step"]["ms"]
        dense = step_of(p.get("cudnn"))
        speed = f"{dense / ours:.2f}x" if dense else "-"
        cells = [fmt_ms(p.get(n, {}).get("step")) if "step" in p.get(n, {})
                 else (p.get(n, {}).get("skipped") or p.get(n, {}).get("error", "-")[:40])
                 for n in ("cudnn", "flash2", "flex_block_sparse", "torch_ops_msa")]
        out.append(f"| {c['name']} | {fmt_ms(c['step'])} | {cells[0]} | {speed} | {cells[1]} | "
                   f"{cells[2]} | {cells[3]} |")
    out += [
        "",
        "Dense peers run causal attention over the whole sequence with the kv heads repeated to "
        "64 (no documents). A dash means the peer was not run for that configuration, to keep "
        "the whole run inside one 10-minute call: dense attention is quadratic (one cuDNN "
        "forward + backward takes about 30 s at 512K and two minutes at 1M), so cuDNN runs up to "
        "128K and FlashAttention-2 up to 32K; FlexAttention compiles per shape and runs at 32K "
        "and 128K when the run's time budget allows; the torch composition materialises masks "
        "and runs at 8K. FlexAttention gets 16 blocks per 128-query block, coarser than MSA's "
        "per-token selection.",
        "",
    ]
    same = [c for c in res["configs"] if "same_pattern_as_flex" in c]
    if same:
        out += [
            "## The same block mask: flash-msa against FlexAttention",
            "",
            "| config | FlexAttention forward | flash-msa forward | speedup | FlexAttention "
            "forward + backward | flash-msa forward + backward | speedup | max abs. difference "
            "of out |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for c in same:
            f, m = c["peers"]["flex_block_sparse"], c["same_pattern_as_flex"]
            out.append(
                f"| {c['name']} | {fmt_ms(f['forward'])} | {fmt_ms(m['forward'])} | "
                f"{m['forward_speedup_over_flex']:.2f}x | {fmt_ms(f['step'])} | "
                f"{fmt_ms(m['step'])} | {m['step_speedup_over_flex']:.2f}x | "
                f"{m['max_abs_diff_from_flex']} |")
        out += [
            "",
            "Both run main attention over one random block mask (per 128-query block its own "
            "block and 15 earlier ones), flash-msa given it as per-token indices (every token of "
            "a query block selects the block's blocks). flash-msa's forward also computes the "
            "proxy branch's lse; its backward runs without the proxy gradient, as Flex has none.",
            "",
        ]
    if res.get("flash_msa_0_1_1"):
        out += ["## Against Flash-MSA 0.1.1 (PyPI)", ""] + flash_msa_peer_table(
            res["flash_msa_0_1_1"]) + [""]
    gh = res.get("gh200_shape")
    if gh:
        hd = gh["heads"]
        out += [
            "## The shape of Flash-MSA's GH200 figures",
            "",
            f"S = {gh['seqlen']}, H={hd['H']}, Hk={hd['Hk']}, Hp={hd['Hp']}, Hpk={hd['Hpk']}, "
            f"D=Dp={hd['D']}, top-k {gh['top_k_tokens']} tokens; the training step through "
            "`flash_msa_func` and autograd, as a user calls it.",
            "",
            "| flash-msa step (no KL value, the default) | with the KL value from the backward "
            "(`kl_out`) | cuDNN dense causal forward + backward |",
            "|---|---|---|",
            f"| {gh['step']['ms']:.2f} ms ({gh['step_speedup_over_cudnn']:.2f}x) | "
            f"{gh['step_with_kl_value']['ms']:.2f} ms "
            f"({gh['step_with_kl_value_speedup_over_cudnn']:.2f}x) | "
            f"{gh['cudnn_dense_step']['ms']:.2f} ms |",
            "",
        ]
    out += warmup_section(res["configs"])
    out += fp8_section(res)
    out += selection_section(res["configs"])
    for c in res["configs"]:
        if "kernels" not in c:
            continue
        out += [f"## Where the time goes at {c['name']} (ms per call, top kernels)", ""]
        for part in ("forward", "backward"):
            out.append(f"- {part}: " + kernel_list(dict(list(c["kernels"][part].items())[:8])))
        out.append("")
    for title, name in plots:
        out += [f"![{title}](../bench/results/{name})", ""]
    return "\n".join(out)


def make_plots(res, base):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    sparse = sorted((c for c in res["configs"] if "step" in c and c["batch"] == 1
                     and not c["documents"] and not c["warmup"]), key=lambda c: c["seqlen"])
    plots = []
    pts = [(c["seqlen"], step_of(c["peers"].get("cudnn")) / c["step"]["ms"])
           for c in sparse if step_of(c.get("peers", {}).get("cudnn"))]
    if pts:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-")
        for s, r in pts:
            ax.annotate(f"{r:.1f}x", (s, r), textcoords="offset points", xytext=(0, 6), ha="center")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("speedup of the training step over cuDNN dense")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"flash-msa vs cuDNN dense causal, {res['environment']['gpu']}")
        fig.tight_layout()
        name = f"{base}-speedup.png"
        fig.savefig(name, dpi=120)
        plots.append(("speedup over dense", os.path.basename(name)))
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.2
    for x, (key, label) in enumerate([("select", "select"), ("forward", "forward"),
                                      ("backward", "backward"), ("step", "step")]):
        xs = [i + (x - 1.5) * width for i in range(len(sparse))]
        ys = [c.get(key, {}).get("tflops", 0) for c in sparse]
        ax.bar(xs, ys, width, label=label)
    ax.axhline(res["ceilings"]["bf16_matmul_tflops"], color="k", ls="--", lw=1,
               label="bf16 matmul ceiling")
    ax.set_xticks(range(len(sparse)), [c["name"] for c in sparse])
    ax.set_ylabel("TFLOP/s (executed FLOPs)")
    ax.set_title("flash-msa per stage")
    ax.legend(fontsize=8)
    fig.tight_layout()
    name = f"{base}-tflops.png"
    fig.savefig(name, dpi=120)
    plots.append(("TFLOP/s per stage", os.path.basename(name)))
    return plots


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("result")
    parser.add_argument("--doc", default=os.path.join(os.path.dirname(__file__), "..", "docs",
                                                      "benchmarks.md"))
    parser.add_argument("--note", default="", help="a sentence on the run, printed on the page")
    args = parser.parse_args()
    with open(args.result) as f:
        res = json.load(f)
    plots = make_plots(res, os.path.splitext(args.result)[0])
    with open(args.doc, "w") as f:
        f.write(page(res, os.path.basename(args.result), plots, args.note) + "\n")
    print(f"wrote {args.doc}" + "".join(f" and bench/results/{p[1]}" for p in plots))


if __name__ == "__main__":
    main()
