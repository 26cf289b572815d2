"""flash-msa: MiniMax Sparse Attention (MSA) training ops for PyTorch.

CPU tensors run the C++ reference backend; CUDA tensors run the CUDA kernels when the package
was built with them (``flash_msa.built_with_cuda()``). See docs/python.md.
``flash_msa.hf`` (Hugging Face transformers models, docs/integrations.md) is imported on first
use, so that the package works without transformers.
"""

import importlib

import torch  # noqa: F401  (loads libtorch, which the extension _C links against)

from . import _C, distributed, ops
from .analysis import selection_stats
from .interface import (
    BLOCK_SIZE,
    check_indices,
    explain,
    flash_msa_func,
    flash_msa_func_warmup,
    flash_msa_warmup_func,
    select_blocks,
    sparse_attention,
    sparse_attention_warmup,
)
from .modules import MSAAttention, apply_rope, set_warmup

built_with_cuda = _C.built_with_cuda

__version__ = "0.1.0"


def __getattr__(name):
    if name == "hf":
        return importlib.import_module(".hf", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BLOCK_SIZE",
    "MSAAttention",
    "apply_rope",
    "built_with_cuda",
    "check_indices",
    "distributed",
    "explain",
    "flash_msa_func",
    "flash_msa_func_warmup",
    "flash_msa_warmup_func",
    "ops",
    "select_blocks",
    "selection_stats",
    "set_warmup",
    "sparse_attention",
    "sparse_attention_warmup",
]
