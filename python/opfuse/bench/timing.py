"""Median-of-many timing with one API for CPU and CUDA.

Why medians: single runs are dominated by noise (page faults, frequency
changes, other processes), and means are dragged by outliers; the seed asks
for the median and a spread. Why rotation: if a case's inputs and outputs fit
in the last-level cache, repeated calls measure the cache, not memory, so we
cycle through enough copies of the inputs to spill it.
"""
from __future__ import annotations

import glob
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass(frozen=True)
class Timing:
    """Summary of per-call times in milliseconds."""

    median_ms: float
    q1_ms: float
    q3_ms: float
    min_ms: float
    max_ms: float
    reps: int

    @property
    def iqr_ms(self) -> float:
        return self.q3_ms - self.q1_ms

    def spread(self) -> dict:
        return {"q1_ms": self.q1_ms, "q3_ms": self.q3_ms,
                "min_ms": self.min_ms, "max_ms": self.max_ms, "reps": self.reps}


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        raise ValueError("percentile of an empty sample")
    pos = p * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples_ms: Sequence[float]) -> Timing:
    s = sorted(samples_ms)
    return Timing(median_ms=percentile(s, 0.5), q1_ms=percentile(s, 0.25),
                  q3_ms=percentile(s, 0.75), min_ms=s[0], max_ms=s[-1], reps=len(s))


def last_level_cache_bytes(device: torch.device) -> int:
    """Size of the cache a working set must exceed to be measured from memory."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    best = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        text = open(path).read().strip()  # e.g. "32768K"
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        value = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        best = max(best, value)
    return best or (32 << 20)  # unknown: assume a typical 32 MB L3


def rotation_copies(working_set_bytes: int, cache_bytes: int, max_copies: int = 64) -> int:
    """How many input copies to cycle so that consecutive calls miss the cache."""
    if working_set_bytes <= 0 or working_set_bytes >= 2 * cache_bytes:
        return 1
    return min(max_copies, math.ceil(2 * cache_bytes / working_set_bytes))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_calls(fn: Callable, arg_sets: Sequence[tuple], device: torch.device,
                reps: int, start: int = 0) -> list[float]:
    """Per-call milliseconds; CUDA uses events so host overhead overlaps as in real use."""
    out: list[float] = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
        for i, (begin, end) in enumerate(events):
            args = arg_sets[(start + i) % len(arg_sets)]
            begin.record()
            fn(*args)
            end.record()
        torch.cuda.synchronize(device)
        return [b.elapsed_time(e) for b, e in events]
    for i in range(reps):
        args = arg_sets[(start + i) % len(arg_sets)]
        t0 = time.perf_counter_ns()
        fn(*args)
        out.append((time.perf_counter_ns() - t0) / 1e6)
    return out


def benchmark(fn: Callable, arg_sets: Sequence[tuple], device: torch.device, *,
              budget_s: float = 1.0, min_reps: int = 10, max_reps: int = 1000,
              warmup_calls: int = 3) -> Timing:
    """Warm up, size the repetition count to the time budget, return the summary."""
    warm = _time_calls(fn, arg_sets, device, max(warmup_calls, len(arg_sets)))
    per_call_s = max(sorted(warm)[len(warm) // 2] / 1e3, 1e-7)
    reps = int(min(max_reps, max(min_reps, budget_s / per_call_s)))
    _sync(device)
    return summarize(_time_calls(fn, arg_sets, device, reps, start=len(warm)))
