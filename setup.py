# Builds the flash_msa PyTorch extension (flash_msa._C). CMake is the one build definition of the
# C++ and CUDA code (sources, flags, target architectures): this script configures and builds its
# static libraries flash_msa_core (validation, CPU backend) and, when the toolkit matches torch's
# CUDA, flash_msa_cuda (the kernels) in the CMake build directory (build/, or the environment's
# FLASH_MSA_BUILD_DIR), then compiles only the bindings in python/csrc with torch's cpp_extension
# and links them against those libraries. A build directory that scripts/build.sh has already
# built is reused as it is. Install with `pip install --no-build-isolation .` so that the build
# compiles against the torch already installed (see docs/python.md).
#
# Environment: FLASH_MSA_CUDA=0 (CPU backend only), FLASH_MSA_CUDA_ARCHS (e.g. "90a", passed to
# CMake), FLASH_MSA_BUILD_DIR, FLASH_MSA_CMAKE_ARGS (extra configure arguments), MAX_JOBS.
import glob
import json
import os
import re
import shlex
import shutil
import subprocess

import torch
from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD_DIR = os.path.abspath(os.environ.get("FLASH_MSA_BUILD_DIR") or os.path.join(ROOT, "build"))
BINDING_SOURCES = sorted(glob.glob("python/csrc/*.cpp", root_dir=ROOT))
CXX_FLAGS = ["-O3", "-std=c++20", "-Wall", "-Wextra", "-Wno-unused-parameter"]


def nvcc_major():
    """Major version of the toolkit torch's cpp_extension would use, or None without one."""
    if cpp_extension.CUDA_HOME is None:
        return None
    try:
        text = subprocess.check_output([nvcc_path(), "--version"], text=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    match = re.search(r"release (\d+)\.", text)
    return int(match.group(1)) if match else None


def nvcc_path():
    return os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc")


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
    return True


def tool(name):
    """A build tool from the PATH, else from its PyPI package (cmake, ninja), else None."""
    path = shutil.which(name)
    if path:
        return path
    try:
        module = __import__(name)
    except ImportError:
        return None
    bin_dir = getattr(module, "BIN_DIR", None) or getattr(module, "CMAKE_BIN_DIR", None)
    path = os.path.join(bin_dir, name) if bin_dir else None
    return path if path and os.path.exists(path) else None


def cmake_build(with_cuda):
    """Configures and builds the libraries the extension links; returns the build's description
    (cmake/python.cmake writes it)."""
    cmake = tool("cmake")
    if cmake is None:
        raise RuntimeError("flash_msa: CMake 3.24 or newer is needed to build the C++ libraries "
                           "(apt install cmake, or pip install cmake)")
    configure = [cmake, "-S", ROOT, "-B", BUILD_DIR]
    env = dict(os.environ)
    if not os.path.exists(os.path.join(BUILD_DIR, "CMakeCache.txt")):
        # A new build directory builds no tests and, for a CPU-only extension, looks for no nvcc.
        # An existing one (e.g. from scripts/build.sh) keeps its generator, tests and options.
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        elif tool("ninja"):
            configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={tool('ninja')}"]
        configure.append("-DFLASH_MSA_TESTS=OFF")
        if not with_cuda:
            configure.append("-DFLASH_MSA_CUDA=OFF")
    if with_cuda:
        configure.append("-DFLASH_MSA_CUDA=ON")
        env.setdefault("CUDACXX", nvcc_path())  # read by CMake when it first looks for nvcc
    if os.environ.get("FLASH_MSA_CUDA_ARCHS"):
        configure.append(f"-DFLASH_MSA_CUDA_ARCHS={os.environ['FLASH_MSA_CUDA_ARCHS']}")
    # The libraries' std::string and friends must match the extension's (torch's) C++ ABI; CMake
    # adds the define only where this differs from the compiler's default.
    configure.append(f"-DFLASH_MSA_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
    configure += shlex.split(os.environ.get("FLASH_MSA_CMAKE_ARGS", ""))
    subprocess.run(configure, check=True, env=env)

    targets = ["flash_msa_core"] + (["flash_msa_cuda"] if with_cuda else [])
    build = [cmake, "--build", BUILD_DIR, "--target", *targets]
    if os.environ.get("MAX_JOBS"):
        build += ["--parallel", os.environ["MAX_JOBS"]]
    with open(os.path.join(BUILD_DIR, "flash_msa_build.json")) as f:
        info = json.load(f)
    if with_cuda and not info["cuda"]:
        raise RuntimeError(f"flash_msa: the CMake build in {BUILD_DIR} found no usable nvcc "
                           f"(wanted {nvcc_path()}); remove that directory to look again, or set "
                           "FLASH_MSA_CUDA=0 for the CPU backend only")
    if with_cuda:
        built_major = int(info["cuda_version"].split(".")[0])
        torch_major = int(torch.version.cuda.split(".")[0])
        if built_major != torch_major:
            raise RuntimeError(f"flash_msa: the CMake build in {BUILD_DIR} uses CUDA "
                               f"{info['cuda_version']}, torch needs {torch_major}.x; use another "
                               "FLASH_MSA_BUILD_DIR or set CUDACXX and remove that directory")
    subprocess.run(build, check=True, env=env)
    return info


class BuildExtension(cpp_extension.BuildExtension):
    """Builds the CMake libraries first, then the bindings linked against them."""

    def run(self):
        for ext in self.extensions:
            info = cmake_build(ext.flash_msa_cuda)
            # Dependents first: flash_msa_cuda needs flash_msa_core.
            libraries = [info["cuda_library"]] if ext.flash_msa_cuda else []
            ext.extra_objects = libraries + [info["core_library"]]
            ext.depends = list(ext.extra_objects)  # relink when a library changes
        super().run()


def extension():
    with_cuda = want_cuda()
    common = dict(
        name="flash_msa._C",
        sources=BINDING_SOURCES,
        include_dirs=[os.path.join(ROOT, "include")],
        extra_compile_args={"cxx": CXX_FLAGS},
    )
    if with_cuda:
        ext = cpp_extension.CUDAExtension(**common, define_macros=[("FLASH_MSA_WITH_CUDA", "1")])
    else:
        ext = cpp_extension.CppExtension(**common)
    ext.flash_msa_cuda = with_cuda
    return ext


setup(
    ext_modules=[extension()],
    # Ninja (when installed) compiles the bindings in parallel and honours MAX_JOBS.
    cmdclass={"build_ext": BuildExtension},
)
