#!/usr/bin/env python3
"""Packs the golden cases into the repository's compact copy, tests/golden/golden.tar.xz.

The source is a directory of case_*/ folders (meta.json plus NumPy .npy arrays, computed in
float64 by an independent reference; by default ../shared/golden beside the checkout). Only the
files the tests read go in, byte for byte: the archive unpacks to the same files, so every reader
(the C++ tests, the CUDA tests, tests/python) reads the in-repo copy and the source alike. The
archive is deterministic (sorted members, fixed metadata) and xz-compressed with LZMA2 settings
for 4-byte data; after writing, every member is read back and compared with its source file bit
for bit.

    python3 scripts/pack_golden.py                       # refresh from ../shared/golden
    python3 scripts/pack_golden.py --from DIR --out FILE
    python3 scripts/pack_golden.py --check               # compare the archive with the source

Only the standard library is needed.
"""

import argparse
import io
import json
import lzma
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = REPO.parent / "shared" / "golden"
DEFAULT_ARCHIVE = REPO / "tests" / "golden" / "golden.tar.xz"

# The files of a case that the tests read (tests/cpu/golden_test.cc, tests/cuda/*_test.cu,
# tests/python/test_golden.py), by the case's mode and layout.
INPUTS = ("qp", "kp", "q", "k", "v", "dout")
OUTPUTS = ("out", "lse", "dqp", "dkp", "dq", "dk", "dv")
SPARSE = ("indices", "block_scores")
VARLEN = ("cu_seqlens",)

# LZMA2 with literal coding aligned to 4-byte values (lp=2, pb=2): the arrays are float32 and
# int32 after a 128-byte .npy header, at 512-byte tar offsets.
FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "lc": 2, "lp": 2,
            "pb": 2}]


def case_files(case: Path) -> list:
    """The file names of one case that the tests read; raises if one is missing."""
    meta = json.loads((case / "meta.json").read_text())
    names = ["meta.json"] + [f"{n}.npy" for n in INPUTS + OUTPUTS]
    if meta["mode"] == "sparse":
        names += [f"{n}.npy" for n in SPARSE]
    if meta.get("varlen"):
        names += [f"{n}.npy" for n in VARLEN]
    missing = [n for n in names if not (case / n).is_file()]
    if missing:
        raise SystemExit(f"{case}: missing {', '.join(missing)}")
    return names


def members(source: Path) -> list:
    """(name in the archive, source file) of every file to pack, in archive order."""
    cases = sorted(p.parent for p in source.glob("case_*/meta.json"))
    if not cases:
        raise SystemExit(f"no golden cases (case_*/meta.json) in {source}")
    out = []
    if (source / "README.md").is_file():
        out.append(("README.md", source / "README.md"))
    for case in cases:
        wanted = case_files(case)
        skipped = sorted(p.name for p in case.iterdir() if p.name not in wanted)
        if skipped:
            print(f"{case.name}: not packed (no test reads them): {', '.join(skipped)}")
        out += [(f"{case.name}/{n}", case / n) for n in sorted(wanted)]
    return out


def tar_bytes(files: list) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        dirs = sorted({name.rsplit("/", 1)[0] for name, _ in files if "/" in name})
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
            tar.addfile(info)
        for name, path in files:
            data = path.read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def check(archive: Path, files: list) -> None:
    """Every file to pack is in `archive` with the same bytes, and nothing else is."""
    want = {name: path for name, path in files}
    seen = set()
    with tarfile.open(archive, "r:xz") as tar:
        for info in tar:
            if info.isdir():
                continue
            if info.name not in want:
                raise SystemExit(f"{archive}: unexpected member {info.name}")
            if tar.extractfile(info).read() != want[info.name].read_bytes():
                raise SystemExit(f"{archive}: {info.name} differs from {want[info.name]}")
            seen.add(info.name)
    missing = sorted(set(want) - seen)
    if missing:
        raise SystemExit(f"{archive}: missing {', '.join(missing)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", type=Path, default=DEFAULT_SOURCE,
                        help=f"directory of case_*/ folders (default {DEFAULT_SOURCE})")
    parser.add_argument("--out", type=Path, default=DEFAULT_ARCHIVE,
                        help=f"archive to write (default {DEFAULT_ARCHIVE})")
    parser.add_argument("--check", action="store_true",
                        help="only compare the existing archive with the source, bit for bit")
    args = parser.parse_args()
    files = members(args.source)
    raw = sum(path.stat().st_size for _, path in files)
    if not args.check:
        data = tar_bytes(files)
        dict_size = max(1 << 20, 1 << (len(data) - 1).bit_length())
        filters = [dict(FILTERS[0], dict_size=dict_size)]
        packed = lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, filters=filters)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_bytes(packed)
    check(args.out, files)
    cases = len({name.split("/")[0] for name, _ in files if "/" in name})
    print(f"{args.out}: {cases} cases, {len(files)} files, {raw / 2**20:.1f} MiB -> "
          f"{args.out.stat().st_size / 2**20:.1f} MiB; every member equals its source bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
