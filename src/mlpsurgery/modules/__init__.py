"""Plain PyTorch modules that the methods swap into models, and the registry that lets a saved
model be rebuilt from its manifest (an allowlist: only registered classes are ever constructed).

Every file here imports only torch, transformers, mlpsurgery.errors and its siblings (names from the rest
of the library only inside methods the forward does not need): saved folders carry copies of them so that
stock transformers rebuilds the model (standalone.py). tests/test_standalone.py holds the rule.
"""

from .base import MODULES, SurgeryModule, build, module_config, register

__all__ = ["MODULES", "SurgeryModule", "build", "module_config", "register", "attention", "dense", "dlr", "fused",
           "nested"]

# Importing the module files registers their classes.
from . import attention, dense, dlr, fused, nested  # noqa: E402,F401


def _dlr_kernel(net, x):
    """The fused Triton forward of a DLRNet where it may apply (CUDA, or Triton's CPU interpreter), else None;
    triton is imported only then."""
    import os

    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"):
        return None
    from ..kernels.dlr_triton import module_forward

    return module_forward(net, x)


dlr.KERNEL = _dlr_kernel
