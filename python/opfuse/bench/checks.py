"""Correctness before speed: every implementation is compared with eager first."""
from __future__ import annotations

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)


def reference(fn, inputs: tuple):
    """Eager result; for bf16/fp16 computed in float32 and rounded once.

    Eager bf16 rounds after every op while a fused kernel rounds once, so the
    two can differ by more than bf16's tolerance although the fused one is the
    more accurate; the float32 computation is the fair yardstick.
    """
    if any(isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION for t in inputs):
        up = tuple(t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                   for t in inputs)
        out_dtype = next(t.dtype for t in inputs if isinstance(t, torch.Tensor))
        return _cast(fn(*up), out_dtype)
    return fn(*inputs)


def _cast(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def check_close(actual, expected, rtol: float | None = None, atol: float | None = None) -> str | None:
    """None if close (torch.testing.assert_close, per-dtype defaults), else the message."""
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as exc:
        return str(exc).strip()
    return None


def max_abs_diff(actual, expected) -> float:
    a = actual if isinstance(actual, torch.Tensor) else actual[0]
    e = expected if isinstance(expected, torch.Tensor) else expected[0]
    return (a.double() - e.double()).abs().max().item() if a.numel() else 0.0
