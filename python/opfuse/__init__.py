"""opfuse: an operator-fusion compiler for PyTorch with a C++ core.

    import opfuse
    fast = torch.compile(model, backend="opfuse")   # or opfuse.compile(model)
    opfuse.stats()                                   # exact counters
    print(opfuse.explain(fn, *inputs))               # what fused, what fell back
"""
import logging as _logging

import torch as _torch

from . import _C
from .stats import reset_stats, stats
from .frontend.backend import compile, opfuse_backend
from .explain import explain

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
