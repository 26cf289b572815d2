#!/usr/bin/env python3
"""Compares the machine code of every CUDA kernel in the working tree with a git revision's,
without a GPU.

Each CUDA source under src/cuda of both trees is built for one architecture (nvcc -cubin, the
library's flags, ptxas -v for the registers and spills) and disassembled (nvdisasm, from the
pinned pip package nvidia-cuda-nvdisasm). Kernels are matched by name and compared instruction
by instruction at three levels:
  same         the same instructions;
  params       the same but for the constant-bank offsets of kernel parameters (a parameter
               struct laid out anew moves them);
  operands     the same opcodes in the same order, N instructions with other operands
               (registers, immediates: read them before trusting the kernel unchanged);
  DIFFERS      anything else, with the opcode counts that changed.
A kernel at "same" or "params" runs the same code on the same values: a refactor that leaves
every kernel there changes no result and no kernel's speed beyond its parameter loads.

usage: python3 scripts/compare_sass.py REV [--arch 90a] [--jobs N] [--only SUBSTRING]
nvcc: $NVCC, on PATH or /usr/local/cuda/bin/nvcc. nvdisasm: on PATH, or the pip package
nvidia-cuda-nvdisasm that scripts/install_deps.sh installs into .venv (run this script with
.venv/bin/python). Exit status 1 where a kernel DIFFERS.
"""
import argparse
import collections
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NVDISASM_PACKAGE = "nvidia-cuda-nvdisasm==13.5.37"


def find_nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    for entry in sys.path:
        for candidate in sorted(Path(entry).glob("nvidia/cu*/bin/nvdisasm")):
            candidate.chmod(0o755)
            return str(candidate)
    sys.exit(f"compare_sass: nvdisasm not found; python3 -m pip install {NVDISASM_PACKAGE}")


def sources(tree: Path) -> list:
    return sorted(str(p.relative_to(tree)) for p in (tree / "src" / "cuda").rglob("*.cu"))


def anon(name: str) -> str:
    """A kernel name without the per-file hash of anonymous namespaces."""
    return re.sub(r"_GLOBAL__N__[0-9a-f]+_", "_GLOBAL__N_", name)


def build(tree: Path, source: str, arch: str, out: Path, nvdisasm: str):
    """{kernel: (instructions, registers, spill text)} of one source."""
    cubin = out / (source.replace("/", "_") + ".cubin")
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    cmd = [nvcc, f"-I{tree}/include",
           f"-I{tree}/src", "-O3", "-DNDEBUG", "--expt-relaxed-constexpr", "-std=c++20",
           f"-arch=sm_{arch}", "-cubin", "-Xptxas=-v", str(tree / source), "-o", str(cubin)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: {source}: nvcc failed\n{done.stderr[-3000:]}")
    usage, current = {}, None
    for line in done.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            current = anon(m.group(1))
            usage[current] = ["?", ""]
        elif current and "bytes spill" in line:
            usage[current][1] = line.split(":", 1)[-1].strip()
        elif current and "Used" in line:
            usage[current][0] = re.search(r"Used (\d+) registers", line).group(1)
    text = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    kernels, current = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*\.text\.(\S+):", line)
        if m:
            current = anon(m.group(1))
            kernels[current] = []
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if current and m:
            kernels[current].append(anon(re.sub(r"\.L_x_\d+", ".L", m.group(1))))
    return {k: (v, *usage.get(k, ["?", ""])) for k, v in kernels.items()}


def opcode(instruction: str) -> str:
    words = instruction.split()
    return words[1] if words[0].startswith("@") else words[0]


def level(a: list, b: list) -> str:
    if a == b:
        return "same"
    blank = lambda ins: [re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[P]", i) for i in ins]
    pa, pb = blank(a), blank(b)
    if pa == pb:
        return "params"
    if [opcode(i) for i in a] == [opcode(i) for i in b]:
        return f"operands {sum(x != y for x, y in zip(pa, pb))} of {len(a)} instructions"
    ca = collections.Counter(opcode(i) for i in a)
    cb = collections.Counter(opcode(i) for i in b)
    changed = {o: (ca[o], cb[o]) for o in sorted(set(ca) | set(cb)) if ca[o] != cb[o]}
    return f"DIFFERS {len(a)} -> {len(b)} instructions, opcodes {changed}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev")
    parser.add_argument("--arch", default="90a")
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--only", default="", help="sources whose path contains this")
    args = parser.parse_args()
    nvdisasm = find_nvdisasm()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "worktree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(base),
                        args.rev], check=True)
        try:
            trees = {"base": base, "tree": ROOT}
            jobs = {}
            with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
                for tag, tree in trees.items():
                    out = Path(tmp) / tag
                    out.mkdir()
                    for source in sources(tree):
                        if args.only in source:
                            jobs[(tag, source)] = pool.submit(build, tree, source, args.arch,
                                                              out, nvdisasm)
                results = {key: job.result() for key, job in jobs.items()}
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)])
    counts = collections.Counter()
    for source in sorted({s for _, s in results}):
        a = results.get(("base", source), {})
        b = results.get(("tree", source), {})
        print(f"== {source}")
        for name in sorted(set(a) | set(b)):
            if name not in a or name not in b:
                verdict = "only in " + ("the tree" if name not in a else args.rev)
                print(f"  {verdict:8s} {name}")
                counts[verdict] += 1
                continue
            verdict = level(a[name][0], b[name][0])
            regs = f"regs {a[name][1]} -> {b[name][1]}"
            spills = "" if a[name][2] == b[name][2] else f"; {a[name][2]} -> {b[name][2]}"
            print(f"  {verdict.split()[0]:8s} {name[:100]}  {regs}{spills}")
            if not verdict.startswith(("same", "params")):
                print(f"           {verdict}")
            counts[verdict.split()[0]] += 1
    print("kernels: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 1 if counts["DIFFERS"] else 0


if __name__ == "__main__":
    sys.exit(main())
