"""Shared helpers of the flash_msa pytest suite: random problems and the SPEC section 6 rule."""

import hashlib
import importlib
import os
import shutil
import sys
import tarfile
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import pytest
import torch

import reference as ref

REPO = Path(__file__).resolve().parents[2]
GOLDEN_ARCHIVE = REPO / "tests" / "golden" / "golden.tar.xz"


def _golden_dir() -> tuple:
    """(directory, where it comes from) of the golden cases (docs/testing.md): the directory
    FLASH_MSA_GOLDEN_DIR names, else the in-repo archive as the CMake build in build/ unpacked it,
    else unpacked here once per content into .golden/<digest>/ in the checkout (in the temporary
    directory where that is not writable)."""
    if os.environ.get("FLASH_MSA_GOLDEN_DIR"):
        return Path(os.environ["FLASH_MSA_GOLDEN_DIR"]), "FLASH_MSA_GOLDEN_DIR"
    if not GOLDEN_ARCHIVE.is_file():
        return GOLDEN_ARCHIVE, "the in-repo archive, which is missing"
    sha256 = hashlib.sha256(GOLDEN_ARCHIVE.read_bytes()).hexdigest()
    source = f"unpacked from {GOLDEN_ARCHIVE.relative_to(REPO)}"
    cmake_copy = REPO / "build" / "tests" / "golden"  # tests/CMakeLists.txt unpacks it there
    stamp = cmake_copy / ".unpacked"
    if stamp.is_file() and stamp.read_text().strip() == sha256:
        return cmake_copy, source
    digest = sha256[:16]
    for root in (REPO / ".golden", Path(tempfile.gettempdir()) / "flash-msa-golden"):
        target = root / digest
        if (target / ".complete").is_file():
            return target, source
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f"{digest}.", dir=root))
        except OSError:
            continue
        with tarfile.open(GOLDEN_ARCHIVE, "r:xz") as tar:
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(tmp, **safe)
        tmp.chmod(0o755)
        (tmp / ".complete").touch()
        try:
            tmp.rename(target)
        except OSError:  # another process unpacked the same archive meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
        return target, source
    return GOLDEN_ARCHIVE, "the in-repo archive, with nowhere writable to unpack it"


GOLDEN_DIR, GOLDEN_SOURCE = _golden_dir()


def import_bench(name: str):
    """A module of bench/ (its scripts import each other by name), for the tests that guard
    them."""
    path = str(REPO / "bench")
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(name)
NAMES = ("qp", "kp", "q", "k", "v")


@dataclass(frozen=True)
class Shape:
    B: int = 1
    S: int = 256
    H: int = 4
    Hk: int = 2
    Hp: int = 2
    Hpk: int = 1
    D: int = 32
    Dp: int = 32
    K: int = 2  # selected blocks
    cu_seqlens: Optional[tuple] = None  # offsets over the flattened B*S axis

    def with_(self, **kw) -> "Shape":
        return replace(self, **kw)

    @property
    def N(self) -> int:  # the KL normaliser B*Hp*S
        return self.B * self.Hp * self.S

    def cu(self, device="cpu") -> Optional[torch.Tensor]:
        if self.cu_seqlens is None:
            return None
        return torch.tensor(self.cu_seqlens, dtype=torch.int32, device=device)

    def __str__(self) -> str:
        docs = f"-docs{len(self.cu_seqlens) - 1}" if self.cu_seqlens else ""
        return (f"B{self.B}S{self.S}H{self.H}Hk{self.Hk}Hp{self.Hp}Hpk{self.Hpk}"
                f"D{self.D}Dp{self.Dp}K{self.K}{docs}")


# Small problems covering GQA, Dp != D, a partial last block, K = 1, K > NB and packed documents.
SHAPES = [
    Shape(B=1, S=384, H=4, Hk=2, Hp=2, Hpk=1, D=32, Dp=16, K=2),
    Shape(B=2, S=300, H=2, Hk=1, Hp=1, Hpk=1, D=16, Dp=16, K=1),
    Shape(B=1, S=256, H=4, Hk=1, Hp=2, Hpk=2, D=16, Dp=16, K=4),
    Shape(B=2, S=256, H=4, Hk=2, Hp=2, Hpk=1, D=16, Dp=16, K=2, cu_seqlens=(0, 100, 256, 300, 512)),
]


def random_inputs(shape: Shape, dtype=torch.float32, seed=0, device="cpu") -> dict:
    """Fresh normal inputs {qp, kp, q, k, v, dout}, rounded to `dtype`, returned in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    s = shape
    dims = dict(qp=(s.B, s.Hp, s.S, s.Dp), kp=(s.B, s.Hpk, s.S, s.Dp), q=(s.B, s.H, s.S, s.D),
                k=(s.B, s.Hk, s.S, s.D), v=(s.B, s.Hk, s.S, s.D), dout=(s.B, s.S, s.H * s.D))
    return {n: torch.randn(d, generator=g).to(dtype).to(device) for n, d in dims.items()}


def max_err(x: torch.Tensor, reference: torch.Tensor) -> float:
    return (x.detach().double().cpu() - reference.detach().double().cpu()).abs().max().item()


def check_rule(name: str, got, ref64, baseline, atol: float) -> None:
    """SPEC section 6: error vs float64 <= 2x the error of the plain PyTorch implementation in
    the input dtype, plus an absolute allowance for fp32 rounding; every value finite."""
    got = torch.as_tensor(got).detach().cpu()
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    assert got.shape == ref64.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref64.shape)}"
    err, base = max_err(got, ref64), max_err(baseline, ref64)
    assert err <= 2 * base + atol, f"{name}: error {err:.3g} > 2 * {base:.3g} + {atol:.1g}"


def reference_run(inputs: dict, shape: Shape, indices, dtype, scale, proxy_scale, kl_weight):
    """The reference (float64) or the baseline (dtype) of both branches with gradients, over
    the given indices (None: warmup)."""
    mask = ref.attended(indices, shape.B, shape.S, shape.cu())
    cpu = {n: inputs[n].detach().cpu() for n in NAMES}
    return ref.msa_with_grads(cpu, mask, scale, proxy_scale, inputs["dout"].cpu(), kl_weight, dtype)


def has_golden() -> bool:
    return GOLDEN_DIR.is_dir() and any(GOLDEN_DIR.glob("case_*/meta.json"))


GOLDEN_SKIP_REASON = (f"no golden cases (case_*/meta.json) in {GOLDEN_DIR} ({GOLDEN_SOURCE}); "
                      "FLASH_MSA_GOLDEN_DIR names another directory of cases, "
                      "e.g. ../shared/golden")
requires_golden = pytest.mark.skipif(not has_golden(), reason=GOLDEN_SKIP_REASON)
