"""scripts/compare_sass.py: the levels it reports for pairs of instruction lists, and (where nvcc
and nvdisasm are installed) one CUDA source compared with itself."""

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load():
    spec = importlib.util.spec_from_file_location("compare_sass",
                                                  REPO / "scripts" / "compare_sass.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cs = load()

KERNEL = ["LDC R1, c[0x0][0x28]", "ULDC.64 UR4, c[0x0][0x210]", "IMAD R2, R3, 0x80, RZ",
          "@P0 BRA .L", "EXIT"]


def test_identical_kernels_are_the_same():
    assert cs.level(KERNEL, list(KERNEL)) == "same"


def test_moved_parameters_are_told_apart_from_other_changes():
    moved = [i.replace("0x210", "0x2b0") for i in KERNEL]
    assert cs.level(KERNEL, moved) == "params"
    other_register = [i.replace("R2,", "R4,") for i in KERNEL]
    assert cs.level(KERNEL, other_register) == "operands 1 of 5 instructions"
    other_constant = [i.replace("0x80", "0x40") for i in KERNEL]
    assert cs.level(KERNEL, other_constant).startswith("operands 1 ")


def test_other_instructions_differ_with_their_opcode_counts():
    got = cs.level(KERNEL, KERNEL[:2] + ["IADD3 R2, R3, 0x80, RZ"] + KERNEL[3:])
    assert got.startswith("DIFFERS 5 -> 5 instructions")
    assert "'IADD3': (0, 1)" in got and "'IMAD': (1, 0)" in got


def test_predicated_instructions_count_by_their_opcode():
    assert cs.opcode("@!P2 LOP3.LUT R0, RZ, R1, RZ, 0x33, !PT") == "LOP3.LUT"


def test_anonymous_namespaces_lose_their_hash():
    name = "_ZN9flash_msa4cuda6passes41_GLOBAL__N__9cb367e4_9_reduce_cu_cc5d9a2112delta_kernel"
    assert cs.anon(name) == cs.anon(name.replace("9cb367e4", "928463a8"))


def tool_path():
    try:
        return cs.find_nvdisasm()
    except SystemExit:
        return None


@pytest.mark.skipif(shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists()
                    or tool_path() is None, reason="needs nvcc and nvdisasm")
def test_a_source_built_twice_is_the_same(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    source = "src/cuda/passes/kl.cu"
    a = cs.build(REPO, source, "90a", first, tool_path())
    b = cs.build(REPO, source, "90a", second, tool_path())
    assert a and a.keys() == b.keys()
    for name in a:
        assert cs.level(a[name][0], b[name][0]) == "same"
        assert a[name][1] != "?"  # ptxas reported its registers
