"""Run a suite of memory-bound cases over several implementations.

For each case: build inputs (plus rotated copies if they would fit in cache),
compute the eager reference, then for each implementation compile, check
against the reference, and only then time it. Nothing that fails is dropped:
it becomes an error record and an error row in the table.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from . import floors
from .cases import Case
from .ceilings import Bandwidth
from .checks import check, reference
from .impls import IMPLS
from .records import RunInfo, make_record
from .timing import Timing, benchmark, last_level_cache_bytes, rotation_copies


@dataclass
class CaseResult:
    case: Case
    impl: str
    nbytes: int
    timing: Timing | None = None
    error: str | None = None
    # opfuse only: kernel launches and library calls of one call (opfuse.stats()),
    # so a table says which route a case took, not only how fast it was.
    launches: tuple[int, int] | None = None


def _short(message: str, limit: int = 600) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit] + " ..."


def run_case(case: Case, impl_names: list[str], device: torch.device, *,
             budget_s: float, min_reps: int) -> list[CaseResult]:
    torch._dynamo.reset()  # a case's compile must not see another case's shapes
    first = case.make_inputs(device, 0)
    eager_out = case.fn(*first)
    expected = reference(case.fn, first, eager_out)
    nbytes = floors.bytes_moved(first, eager_out)
    copies = rotation_copies(nbytes, last_level_cache_bytes(device))
    arg_sets = [first] + [case.make_inputs(device, seed) for seed in range(1, copies)]

    results = []
    for name in impl_names:
        result = CaseResult(case, name, nbytes)
        try:
            compiled = IMPLS[name](case.fn)
            result.error = check(compiled(*first), expected)
            if result.error is None and name == "opfuse":
                result.launches = _launches_of_one_call(compiled, first)
            if result.error is None:
                result.timing = benchmark(compiled, arg_sets, device,
                                          budget_s=budget_s, min_reps=min_reps)
        except Exception as exc:  # compile failures are results too
            result.error = f"{type(exc).__name__}: {exc}"
        if result.error:
            result.error = _short(result.error)
        results.append(result)
    del arg_sets, first, expected, eager_out
    gc.collect()
    return results


def _launches_of_one_call(compiled, args) -> tuple[int, int]:
    import opfuse
    opfuse.reset_stats()
    compiled(*args)
    s = opfuse.stats()
    return s["kernel_launches"], s["library_calls"]


def _launch_note(r: CaseResult) -> str:
    return "" if r.launches is None else f"{r.launches[0]} kernels, {r.launches[1]} library calls"


def eager_ms(results: list[CaseResult]) -> float | None:
    for r in results:
        if r.impl == "eager" and r.timing:
            return r.timing.median_ms
    return None


def to_records(results: list[CaseResult], bw: Bandwidth, info: RunInfo) -> list[dict]:
    records = []
    base = eager_ms(results)
    for r in results:
        common = dict(info=info, suite=r.case.suite, case=r.case.name, impl=r.impl,
                      dtype=str(r.case.dtype).replace("torch.", ""), shape=list(r.case.shape),
                      bytes=r.nbytes, flops=r.case.flops)
        if r.timing is None:
            records.append(make_record(metric="ms", value=None, error=r.error, **common))
            continue
        ms = r.timing.median_ms
        frac = floors.fraction_of_bandwidth(r.nbytes, ms, bw.bytes_per_s)
        speedup = base / ms if base else None
        records.append(make_record(metric="ms", value=ms,
                                   floor=floors.floor_ms(r.nbytes, bw.bytes_per_s),
                                   spread=r.timing.spread(), fraction=frac,
                                   speedup_vs_eager=speedup, host_us=_host_us(r.timing),
                                   **({} if r.launches is None else
                                      {"kernel_launches": r.launches[0], "library_calls": r.launches[1]}),
                                   **common))
        records.append(make_record(metric="GB/s",
                                   value=floors.achieved_gb_per_s(r.nbytes, ms),
                                   ceiling=bw.gb_per_s, fraction=frac, **common))
        if r.case.flops is not None:
            tflops = r.case.flops / (ms / 1e3) / 1e12
            records.append(make_record(metric="TFLOP/s", value=tflops, **common))
    return records


def _host_us(timing: Timing) -> float | None:
    """CUDA only: host time per call (Python, guards, launches), GPU time excluded."""
    return None if timing.host_ms is None else timing.host_ms * 1e3


def bandwidth_record(bw: Bandwidth, info: RunInfo, suite: str) -> dict:
    return make_record(info, suite=suite, case=f"copy-{bw.copy_bytes >> 20}MB",
                       impl="torch.copy_", metric="GB/s", value=bw.gb_per_s,
                       spread=bw.timing.spread(), bytes=2 * bw.copy_bytes)


TABLE_HEADERS = ("case", "impl", "median ms", "IQR ms", "floor ms", "GB/s",
                 "% of BW", "vs eager", "host us", "note")


def table_rows(results: list[CaseResult], bw: Bandwidth) -> list[list]:
    rows = []
    base = eager_ms(results)
    for r in results:
        if r.timing is None:
            rows.append([r.case.name, r.impl, None, None, None, None, None, None, None,
                         "ERROR " + (r.error or "")[:70]])
            continue
        ms = r.timing.median_ms
        rows.append([r.case.name, r.impl, ms, r.timing.iqr_ms,
                     floors.floor_ms(r.nbytes, bw.bytes_per_s),
                     floors.achieved_gb_per_s(r.nbytes, ms),
                     100 * floors.fraction_of_bandwidth(r.nbytes, ms, bw.bytes_per_s),
                     f"{base / ms:.2f}x" if base else None, _host_us(r.timing),
                     "; ".join(n for n in (f"{r.case.flops / ms / 1e9:.0f} TFLOP/s" if r.case.suite == "gemm" else "",
                                           _launch_note(r)) if n)])
    return rows
