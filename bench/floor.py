"""The floor of each stage of the sparse training step, from a benchmark result.

    python3 bench/floor.py bench/results/RUN.json        # a markdown table per sequence length

For select, the forward, the backward and the whole step of every sparse configuration of a
bench/msa_bench.py result, this computes the work the stage cannot avoid and the time it
implies on the GPU of that run:
  - FLOPs executed by an ideal kernel. Select: 2 * Dp * Hp * (the visible keys of every query).
    Forward: 4 * D * P (main attention, P = the keys attended summed over (head, query), read
    from the run's main_forward_flop) plus 2 * Dp * P / G (the proxy's scores over the selected
    keys for its log-sum-exp; G = H / Hp query heads share a proxy head's selection). Backward:
    2.5 times the main forward plus 6 * Dp * P / G (the proxy's scores again, dQp and dKp).
  - Bytes: each input read once and each output written once, nothing else. Select reads
    q_proxy and k_proxy and writes the indices (int32, K per query and proxy head). The forward
    reads the five inputs and the indices and writes out, lse and lse_proxy (fp32). The backward
    reads the five inputs, out, dout, lse, lse_proxy and the indices, and writes the five
    gradients.
  - The floor: the larger of FLOPs over the run's bf16 matmul ceiling and bytes over its copy
    bandwidth (both measured in that run, result["ceilings"]); "bound" says which.
  - measured / floor: how far the stage is from it. The step's floor is the sum of the three
    (they run one after another).
And, where the run profiled the kernels (result["configs"][i]["kernels"]), the time of the
forward and backward spent outside their main attention kernels (merge, reductions, the
proxy-gradient kernel, Delta, the schedule).
"""

import argparse
import json

# The main attention kernels of the forward and the backward, by the start of their profiler
# names (Hopper and portable).
MAIN_KERNELS = ("sparse_forward::forward_kernel", "sparse_backward::backward_kernel")


def visible_keys(cfg):
    """Sum over the queries of every batch row of the keys each sees (causal, per document)."""
    docs = cfg.get("documents") or [cfg["seqlen"]]
    return cfg["batch"] * sum(n * (n + 1) // 2 for n in docs)


def stage_work(cfg, heads, dtype_bytes=2):
    """{stage: (FLOPs, bytes)} for select, the forward and the backward."""
    H, Hk, Hp, Hpk = heads["H"], heads["Hk"], heads["Hp"], heads["Hpk"]
    D, Dp, K = heads["D"], heads["Dp"], heads["K"]
    rows = cfg["batch"] * cfg["seqlen"]  # tokens
    t = dtype_bytes
    pairs = cfg["main_forward_flop"] / (4 * D)  # keys attended, summed over (head, query)
    proxy_pairs = pairs / (H // Hp)
    proxy_in = t * rows * (Hp + Hpk) * Dp  # q_proxy, k_proxy
    main_in = t * rows * (H + 2 * Hk) * D  # q, k, v
    out = t * rows * H * D
    indices = 4 * rows * Hp * K
    stats = 4 * rows * (H + Hp)  # lse, lse_proxy
    select = (2 * Dp * Hp * visible_keys(cfg), proxy_in + indices)
    forward = (4 * D * pairs + 2 * Dp * proxy_pairs,
               proxy_in + main_in + indices + out + stats)
    backward = (10 * D * pairs + 6 * Dp * proxy_pairs,
                2 * proxy_in + 2 * main_in + indices + 2 * out + stats)
    return {"select": select, "forward": forward, "backward": backward}


def floor_ms(flop, nbytes, ceilings):
    """(floor in ms, "matmul" or "memory")."""
    compute = flop / (ceilings["bf16_matmul_tflops"] * 1e12) * 1e3
    memory = nbytes / (ceilings["copy_tbps"] * 1e12) * 1e3
    return (compute, "matmul") if compute >= memory else (memory, "memory")


def outside_main_kernels(cfg):
    """ms of the forward's and the backward's profiled kernels other than the main attention
    kernels, or None where the run did not profile them."""
    kernels = cfg.get("kernels")
    if not kernels:
        return None
    total = 0.0
    for part in ("forward", "backward"):
        for name, ms in kernels.get(part, {}).items():
            if not any(main in name for main in MAIN_KERNELS):
                total += ms
    return total


def floors(result):
    """One row per (sparse configuration, stage): the work, the floor and measured / floor."""
    heads, ceilings = result["environment"]["heads"], result["ceilings"]
    rows = []
    for cfg in result["configs"]:
        if cfg.get("warmup") or "main_forward_flop" not in cfg or "step" not in cfg:
            continue
        stages = []
        for stage, (flop, nbytes) in stage_work(cfg, heads).items():
            floor, bound = floor_ms(flop, nbytes, ceilings)
            stages.append({"stage": stage, "tflop": flop / 1e12, "gb": nbytes / 1e9,
                           "floor_ms": floor, "bound": bound})
        # The step runs the three stages one after another: its floor is the sum of theirs.
        stages.append({"stage": "step", "bound": "-",
                       **{k: sum(s[k] for s in stages) for k in ("tflop", "gb", "floor_ms")}})
        for s in stages:
            measured = (cfg.get(s["stage"]) or {}).get("ms")
            rows.append({"config": cfg["name"], **s, "measured_ms": measured,
                         "over_floor": measured / s["floor_ms"] if measured else None})
    return rows


def markdown(result, configs=None):
    """The floors of ``result`` as a markdown table (``configs``: names to keep)."""
    ceil = result["ceilings"]
    env = result["environment"]
    lines = [f"Floors on {env.get('gpu')} (commit {env.get('commit')}): bf16 matmul "
             f"{ceil['bf16_matmul_tflops']} TFLOP/s and copy {ceil['copy_tbps']} TB/s, "
             "both measured in the run.", "",
             "| config | stage | TFLOP | GB | floor ms | bound | measured ms | measured / floor |",
             "|---|---|---|---|---|---|---|---|"]
    for r in floors(result):
        if configs and r["config"] not in configs:
            continue
        measured = f"{r['measured_ms']:.2f}" if r["measured_ms"] else "-"
        ratio = f"{r['over_floor']:.2f}x" if r["over_floor"] else "-"
        lines.append(f"| {r['config']} | {r['stage']} | {r['tflop']:.2f} | {r['gb']:.2f} | "
                     f"{r['floor_ms']:.2f} | {r['bound']} | {measured} | {ratio} |")
    outside = [(c["name"], outside_main_kernels(c)) for c in result["configs"]
               if not configs or c["name"] in configs]
    outside = [(name, ms) for name, ms in outside if ms is not None]
    if outside:
        lines += ["", "Forward and backward kernels other than the main attention kernels "
                  "(profiler): " + ", ".join(f"{n} {ms:.2f} ms" for n, ms in outside) + "."]
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", help="a bench/msa_bench.py JSON result")
    parser.add_argument("--configs", default="", help="comma-separated configuration names")
    args = parser.parse_args()
    with open(args.result) as f:
        result = json.load(f)
    print("\n".join(markdown(result, set(filter(None, args.configs.split(","))))))


if __name__ == "__main__":
    main()
