"""opfuse: an operator-fusion compiler for PyTorch with a C++ core.

    import opfuse
    fast = torch.compile(model, backend="opfuse")   # or opfuse.compile(model)
    opfuse.stats()                                   # exact counters
    print(opfuse.explain(fn, *inputs))               # what fused, what fell back
"""
import glob as _glob
import logging as _logging
import os as _os

import torch as _torch


def _cuda_library_dirs():
    # NVRTC and the driver are loaded at run time (dlopen); point the C++
    # runtime at the copies PyTorch's pip wheels ship.
    here = _os.path.dirname(_os.path.dirname(_torch.__file__))
    dirs = sorted(set(_os.path.dirname(p) for p in _glob.glob(_os.path.join(here, "nvidia", "*", "lib", "libnvrtc.so*"))))
    dirs += sorted(set(_os.path.dirname(p) for p in _glob.glob(_os.path.join(here, "nvidia", "*", "lib", "libcuda*.so*"))))
    return dirs


if "OPFUSE_CUDA_LIB_DIRS" not in _os.environ:
    _os.environ["OPFUSE_CUDA_LIB_DIRS"] = ":".join(_cuda_library_dirs())

from . import _C
from .stats import reset_stats, stats
from .frontend.backend import compile, opfuse_backend
from .explain import explain
from . import ops
from .frontend.convert import register_opfuse_ops as _register_opfuse_ops

_register_opfuse_ops()

_logging.getLogger("opfuse").addHandler(_logging.NullHandler())
try:  # TORCH_LOGS=+opfuse shows opfuse's log
    from torch._logging._internal import register_log as _register_log

    _register_log("opfuse", ["opfuse"])
except Exception:
    pass

try:
    from torch._dynamo import register_backend as _register_backend

    _register_backend(name="opfuse")(opfuse_backend)
except Exception:  # already registered through the entry point
    pass

__all__ = ["compile", "stats", "reset_stats", "explain", "opfuse_backend"]
__version__ = "0.1.0"
