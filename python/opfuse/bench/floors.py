"""The floor of a memory-bound case: every input read once, every output written once.

A fused kernel can do no better than moving those bytes at the measured copy
bandwidth, so floor time = bytes / bandwidth, and achieved GB/s over the
measured bandwidth says how close a run came.
"""
from __future__ import annotations

from typing import Iterable

import torch


def tensor_footprint_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel must touch to read t once.

    Broadcast (stride-0) dimensions hold one copy of the data, so they do not
    multiply the footprint: an expanded bias costs its own size, not the output's.
    """
    elems = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            elems *= size
    return elems * t.element_size() if t.numel() else 0


def _tensors(values) -> Iterable[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        yield values
    elif isinstance(values, (list, tuple)):
        for v in values:
            yield from _tensors(v)
    elif isinstance(values, dict):
        for v in values.values():
            yield from _tensors(v)


def bytes_moved(inputs, outputs) -> int:
    """Bytes read (each distinct input once) plus bytes written (each output once)."""
    seen: set[int] = set()
    total = 0
    for t in list(_tensors(inputs)) + list(_tensors(outputs)):
        key = id(t)
        if key not in seen:
            seen.add(key)
            total += tensor_footprint_bytes(t)
    return total


def floor_ms(nbytes: int, bandwidth_bytes_per_s: float) -> float:
    return nbytes / bandwidth_bytes_per_s * 1e3


def achieved_gb_per_s(nbytes: int, time_ms: float) -> float:
    return nbytes / (time_ms / 1e3) / 1e9


def fraction_of_bandwidth(nbytes: int, time_ms: float, bandwidth_bytes_per_s: float) -> float:
    """Achieved over measured bandwidth; 1.0 means the run sat on its floor."""
    return floor_ms(nbytes, bandwidth_bytes_per_s) / time_ms
