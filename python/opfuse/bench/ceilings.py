"""Measured ceilings of this machine, the denominators of every fraction we report.

We measure instead of quoting datasheets because a VM, a NUMA layout or a
power cap can put the real ceiling far below the nominal one, and a fraction
of an unreachable number says nothing about our kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .timing import Timing, benchmark

# Large enough to spill any CPU L3 and the H200's 50 MB L2 many times over.
CPU_COPY_BYTES = 256 << 20
GPU_COPY_BYTES = 1 << 30


@dataclass(frozen=True)
class Bandwidth:
    """Copy bandwidth, counting the bytes read plus the bytes written."""

    bytes_per_s: float
    copy_bytes: int
    timing: Timing

    @property
    def gb_per_s(self) -> float:
        return self.bytes_per_s / 1e9


def measure_copy_bandwidth(device: torch.device, copy_bytes: int | None = None,
                           budget_s: float = 1.0) -> Bandwidth:
    """Time dst.copy_(src) (all CPU threads / one device-to-device copy).

    On the CPU, stores to dst usually also read dst into cache first
    (write-allocate), so the hardware moves ~3x copy_bytes; we count 2x like
    every kernel's floor does, which keeps the fractions comparable.
    """
    if copy_bytes is None:
        copy_bytes = GPU_COPY_BYTES if device.type == "cuda" else CPU_COPY_BYTES
    src = torch.ones(copy_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)  # written once below so page faults are not timed
    dst.copy_(src)
    timing = benchmark(lambda a, b: b.copy_(a), [(src, dst)], device,
                       budget_s=budget_s, min_reps=10)
    moved = 2 * src.numel() * src.element_size()
    return Bandwidth(bytes_per_s=moved / (timing.median_ms / 1e3),
                     copy_bytes=moved // 2, timing=timing)
