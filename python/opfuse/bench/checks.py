"""Correctness before speed: every implementation is compared with eager first.

float32/float64: assert_close against eager with PyTorch's per-dtype tolerances,
or, where a long reduction's summation order matters (a weight gradient summed
over thousands of rows), at most twice eager's own largest error against the
same computation in float64.
bfloat16/float16: eager rounds after every op while a fused kernel rounds once,
so eager is not the better answer. The yardstick is eager computed in float32;
an implementation passes if it is assert_close to that (rounded to its dtype),
or if its largest error against it is at most twice eager's own (the
FlashAttention rule product.md uses).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass
class Reference:
    value: object            # what assert_close compares with (the inputs' dtype)
    high: object = None      # float32 result, low precision only
    eager_error: float = 0.0  # eager's max abs error against `high`


def _map(value, f):
    if isinstance(value, torch.Tensor):
        return f(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map(v, f) for v in value)
    return value


def reference(fn, inputs: tuple, eager_out=None) -> Reference:
    low = [t.dtype for t in inputs if isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION]
    if eager_out is None:
        eager_out = fn(*inputs)
    if not low:
        if not any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in inputs):
            return Reference(eager_out)
        up = tuple(_map(t, lambda x: x.double() if x.is_floating_point() else x) for t in inputs)
        high = fn(*up)
        return Reference(eager_out, high, max_abs_diff(eager_out, high))
    up = tuple(_map(t, lambda x: x.float() if x.is_floating_point() else x) for t in inputs)
    high = fn(*up)
    value = _map(high, lambda x: x.to(low[0]) if x.is_floating_point() else x)
    return Reference(value, high, max_abs_diff(eager_out, high))


def check(actual, ref: Reference, rtol: float | None = None, atol: float | None = None) -> str | None:
    """None if actual passes (see module docstring), else why not."""
    message = check_close(actual, ref.value, rtol=rtol, atol=atol)
    if message is None or ref.high is None:
        return message
    error = max_abs_diff(actual, ref.high)
    if error <= 2 * ref.eager_error:
        return None
    return f"{message} [max abs error {error:.3g} > 2x eager's {ref.eager_error:.3g}]"


def check_close(actual, expected, rtol: float | None = None, atol: float | None = None) -> str | None:
    """None if close (torch.testing.assert_close, per-dtype defaults), else the message."""
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError as exc:
        return str(exc).strip()
    return None


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def max_abs_diff(actual, expected) -> float:
    """The largest absolute difference over all output tensors."""
    worst = 0.0
    for a, e in zip(_tensors(actual), _tensors(expected)):
        if a.numel() and a.is_floating_point():
            worst = max(worst, (a.double() - e.double()).abs().max().item())
    return worst
