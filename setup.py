# Builds the flash_msa PyTorch extension (flash_msa._C) from the C++ core (src/common, src/cpu),
# the CUDA kernels (src/cuda, only when a usable toolkit is present) and the bindings in
# python/csrc. Install with `pip install --no-build-isolation .` so that the build compiles
# against the torch already installed (see docs/python.md).
import glob
import os
import re
import subprocess

import torch
from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))

# Sources are globbed so the list follows the C++ tree without edits here. Paths stay relative
# to ROOT: the build then mirrors the source tree for object files, and two kernels with the
# same file name in different stage folders do not overwrite each other's objects.
CORE_SOURCES = ["src/common/*.cc", "src/cpu/*.cc"]
BINDING_SOURCES = ["python/csrc/*.cpp"]
CUDA_SOURCES = ["src/cuda/**/*.cu"]


def sources(patterns):
    found = []
    for pattern in patterns:
        found += sorted(glob.glob(pattern, root_dir=ROOT, recursive=True))
    return found


def nvcc_major():
    """Major version of the toolkit torch's cpp_extension would use, or None without one."""
    if cpp_extension.CUDA_HOME is None:
        return None
    nvcc = os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")
    try:
        text = subprocess.check_output([nvcc, "--version"], text=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    match = re.search(r"release (\d+)\.", text)
    return int(match.group(1)) if match else None


def want_cuda():
    """CUDA kernels are built when asked for (default) and the toolkit matches torch's CUDA."""
    if os.environ.get("FLASH_MSA_CUDA", "1") == "0":
        print("flash_msa: FLASH_MSA_CUDA=0, building the CPU backend only")
        return False
    if torch.version.cuda is None:
        print("flash_msa: torch has no CUDA support, building the CPU backend only")
        return False
    major = nvcc_major()
    torch_major = int(torch.version.cuda.split(".")[0])
    if major != torch_major:
        found = "no nvcc" if major is None else f"nvcc {major}.x"
        print(f"flash_msa: torch needs CUDA {torch_major}.x, found {found}; "
              "building the CPU backend only")
        return False
    if not sources(CUDA_SOURCES):
        print("flash_msa: no CUDA sources under src/cuda, building the CPU backend only")
        return False
    return True


def extension():
    with_cuda = want_cuda()
    # -fopenmp-simd: the CPU loops' `omp simd` hints without an OpenMP runtime (the CPU backend
    # runs on std::thread, so the extension adds no second OpenMP runtime beside torch's).
    cxx_flags = ["-O3", "-std=c++20", "-fopenmp-simd", "-Wall", "-Wextra", "-Wno-unused-parameter"]
    common = dict(
        name="flash_msa._C",
        sources=sources(BINDING_SOURCES + CORE_SOURCES),
        include_dirs=[os.path.join(ROOT, "include"), os.path.join(ROOT, "src")],
    )
    if not with_cuda:
        return cpp_extension.CppExtension(**common, extra_compile_args={"cxx": cxx_flags})
    common["sources"] += sources(CUDA_SOURCES)
    nvcc_flags = [
        "-gencode=arch=compute_90a,code=sm_90a",
        "-O3",
        "-std=c++20",
        "--expt-relaxed-constexpr",
        "-lineinfo",
        # torch adds these defines to every nvcc call; the kernels are written (and built by
        # CMake) with the normal cuda_fp16/cuda_bf16 operators, so undo them.
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-U__CUDA_NO_HALF2_OPERATORS__",
    ]
    return cpp_extension.CUDAExtension(
        **common,
        define_macros=[("FLASH_MSA_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )


setup(
    ext_modules=[extension()],
    # Ninja (when installed) compiles in parallel and honours MAX_JOBS.
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
