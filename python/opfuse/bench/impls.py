"""The implementations a case is run with; opfuse is just one entry among them.

Each entry turns a plain function into a callable. Making one may raise
ImplUnavailable (opfuse not built, no backend registered); the runner records
that as an error row instead of dropping the implementation.
"""
from __future__ import annotations

from typing import Callable

import torch


class ImplUnavailable(RuntimeError):
    pass


def eager(fn: Callable) -> Callable:
    return fn


def inductor(fn: Callable) -> Callable:
    """torch.compile's default backend (Triton on CUDA, its C++ backend on CPU)."""
    return torch.compile(fn)


def inductor_max_autotune(fn: Callable) -> Callable:
    """torch.compile(mode="max-autotune"): Inductor also benchmarks Triton GEMM templates."""
    return torch.compile(fn, mode="max-autotune")


def inductor_max_autotune_no_cudagraphs(fn: Callable) -> Callable:
    """max-autotune without its CUDA graphs: a graph captured around weights
    passed as arguments copies them into the graph's static inputs every
    call (seen on the H200 at M = 16: 280 us a call against its kernels'
    ~92), which times the copy, not Inductor's GEMMs."""
    return torch.compile(fn, mode="max-autotune-no-cudagraphs")


def opfuse(fn: Callable) -> Callable:
    try:
        import opfuse as _opfuse  # importing registers the "opfuse" backend
    except Exception as exc:  # a broken build must not stop eager/Inductor rows
        raise ImplUnavailable(f"import opfuse failed: {exc!r}") from exc
    if not hasattr(_opfuse, "compile"):
        raise ImplUnavailable("opfuse is importable but not built (no opfuse.compile)")
    return torch.compile(fn, backend="opfuse")


IMPLS: dict[str, Callable[[Callable], Callable]] = {
    "eager": eager,
    "torch.compile": inductor,
    "torch.compile-max-autotune": inductor_max_autotune,
    "torch.compile-max-autotune-no-cudagraphs": inductor_max_autotune_no_cudagraphs,
    "opfuse": opfuse,
}
DEFAULT_IMPLS = ("eager", "torch.compile", "opfuse")


def parse_impls(text: str | None) -> list[str]:
    """'eager,opfuse' -> ['eager', 'opfuse']; eager always comes first (it is the baseline)."""
    names = [n.strip() for n in text.split(",") if n.strip()] if text else list(DEFAULT_IMPLS)
    unknown = [n for n in names if n not in IMPLS]
    if unknown:
        raise ValueError(f"unknown impl(s) {unknown}; choose from {sorted(IMPLS)}")
    return ["eager"] + [n for n in dict.fromkeys(names) if n != "eager"]
