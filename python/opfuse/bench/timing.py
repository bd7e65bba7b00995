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
    host_ms: float | None = None  # CUDA: host time to enqueue one call (launch overhead)

    @property
    def iqr_ms(self) -> float:
        return self.q3_ms - self.q1_ms

    def spread(self) -> dict:
        out = {"q1_ms": self.q1_ms, "q3_ms": self.q3_ms,
               "min_ms": self.min_ms, "max_ms": self.max_ms, "reps": self.reps}
        if self.host_ms is not None:
            out["host_ms"] = self.host_ms
        return out


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        raise ValueError("percentile of an empty sample")
    pos = p * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples_ms: Sequence[float], host_ms: float | None = None) -> Timing:
    s = sorted(samples_ms)
    return Timing(median_ms=percentile(s, 0.5), q1_ms=percentile(s, 0.25),
                  q3_ms=percentile(s, 0.75), min_ms=s[0], max_ms=s[-1], reps=len(s),
                  host_ms=host_ms)


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


_SLEEP_CYCLES_PER_MS: dict[int, float] = {}


def _sleep_cycles_per_ms(device: torch.device) -> float:
    """Calibrate torch.cuda._sleep (it spins a number of GPU clock cycles)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SLEEP_CYCLES_PER_MS:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # wake the clocks up first
        begin.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_MS[index] = 10_000_000 / max(begin.elapsed_time(end), 1e-3)
    return _SLEEP_CYCLES_PER_MS[index]


def _time_calls_cpu(fn, arg_sets, reps, start) -> list[float]:
    out = []
    for i in range(reps):
        args = arg_sets[(start + i) % len(arg_sets)]
        t0 = time.perf_counter_ns()
        fn(*args)
        out.append((time.perf_counter_ns() - t0) / 1e6)
    return out


def _time_calls_cuda(fn, arg_sets, device, reps, start, host_ms_guess,
                     chunk: int = 64) -> tuple[list[float], float]:
    """(GPU ms per call, host ms per call).

    A GPU sleep is queued ahead of each chunk of calls so the host enqueues
    them while the GPU is busy: the events then bracket the GPU work alone
    (triton's do_bench gets the same effect from its cache-flush kernel), and
    the host's enqueue time is measured apart, as launch overhead.
    """
    gpu_ms: list[float] = []
    host_ns = 0
    for first in range(0, reps, chunk):
        n = min(chunk, reps - first)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(n)]
        torch.cuda._sleep(int(_sleep_cycles_per_ms(device) * min(2.0 * n * host_ms_guess, 500)))
        t0 = time.perf_counter_ns()
        for i, (begin, end) in enumerate(events):
            args = arg_sets[(start + first + i) % len(arg_sets)]
            begin.record()
            fn(*args)
            end.record()
        host_ns += time.perf_counter_ns() - t0
        torch.cuda.synchronize(device)
        gpu_ms += [b.elapsed_time(e) for b, e in events]
    return gpu_ms, host_ns / 1e6 / reps


def back_to_back_us(fn: Callable, iters: int = 40, trials: int = 5) -> float:
    """CUDA: the median over `trials` of the mean time of `iters` calls of
    fn() between two events, in us. Kernels overlap across calls here (a
    programmatic dependent launch starts before the previous call ends),
    unlike benchmark(), which brackets every call with events."""
    fn()
    torch.cuda.synchronize()
    means = []
    for _ in range(trials):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        stop.synchronize()
        means.append(start.elapsed_time(stop) * 1000 / iters)
    return sorted(means)[len(means) // 2]


def benchmark(fn: Callable, arg_sets: Sequence[tuple], device: torch.device, *,
              budget_s: float = 1.0, min_reps: int = 10, max_reps: int = 1000,
              warmup_calls: int = 3) -> Timing:
    """Warm up, size the repetition count to the time budget, return the summary.

    CPU: wall time per call. CUDA: GPU time per call, host time apart (host_ms).
    """
    warm = max(warmup_calls, len(arg_sets))
    _sync(device)
    t0 = time.perf_counter()
    for i in range(warm):
        fn(*arg_sets[i % len(arg_sets)])
    enqueued_s = time.perf_counter() - t0  # CUDA: host time only, the GPU may still run
    _sync(device)
    per_call_s = max((time.perf_counter() - t0) / warm, 1e-7)
    reps = int(min(max_reps, max(min_reps, budget_s / per_call_s)))
    if device.type == "cuda":
        samples, host_ms = _time_calls_cuda(fn, arg_sets, device, reps, warm,
                                            enqueued_s / warm * 1e3)
        return summarize(samples, host_ms)
    return summarize(_time_calls_cpu(fn, arg_sets, reps, warm))
