"""`opfuse bench`: measure the ceiling once, run the chosen suites, print, write JSON."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from . import compile_time
from .cases import SUITES
from .ceilings import Bandwidth, measure_copy_bandwidth
from .plot import plot_roofline
from .records import RunInfo, default_results_dir, make_record, run_info, write_records
from .runner import TABLE_HEADERS, bandwidth_record, run_case, table_rows, to_records
from .table import format_table, fmt
from .timing import summarize

ALL_SUITES = ("chain", "rows", "rows_bwd", "gemm", "launch", "compile")


def pick_device(name: str | None = None) -> torch.device:
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def busy_warning(device: torch.device) -> str | None:
    """Other processes on the cores stall every parallel region (gaps of a
    scheduler time slice, ~4 ms, on this kind of VM), so say so instead of
    publishing noise as if it were a measurement."""
    load = os.getloadavg()[0]
    if device.type == "cpu" and load > 0.5:
        return (f"WARNING: load average {load:.2f} before starting: other processes are "
                "using the CPU, so timings will be noisy (recorded as 'loadavg').")
    return None


def run_timed_suite(suite: str, device: torch.device, impls: list[str], bw: Bandwidth,
                    info: RunInfo, quick: bool) -> list[dict]:
    budget_s, min_reps = (0.2, 5) if quick else (2.0, 20)
    records, rows = [bandwidth_record(bw, info, suite)], []
    for case in SUITES[suite](device, quick):
        results = run_case(case, impls, device, budget_s=budget_s, min_reps=min_reps)
        records += to_records(results, bw, info)
        rows += table_rows(results, bw)
        done = ", ".join(f"{r.impl} {'ERROR' if r.error else f'{r.timing.median_ms:.3g} ms'}"
                         for r in results)
        print(f"{case.name}: {done}", flush=True)
    print(f"\n== {suite} (measured copy bandwidth {bw.gb_per_s:.1f} GB/s) ==")
    print(format_table(TABLE_HEADERS, rows))
    return records


def run_compile_suite(impls: list[str], info: RunInfo, quick: bool) -> list[dict]:
    cases = ("chain",) if quick else compile_time.COMPILE_CASES
    repeats = 1 if quick else 3
    records, rows = [], []
    for case in cases:
        for impl in [i for i in impls if i in compile_time.CACHE_ENV]:
            print(f"compile: {case} / {impl} ...", flush=True)
            phases = compile_time.measure(impl, case, repeats)
            for phase, probes in phases.items():
                ok = [p for p in probes if "error" not in p]
                name = f"{case}-{phase}"
                if len(ok) < len(probes):
                    error = next(p["error"] for p in probes if "error" in p)
                    records.append(make_record(info, suite="compile", case=name, impl=impl,
                                               metric="ms", value=None, error=error))
                    rows.append([name, impl, None, None, None, "ERROR " + error[:70]])
                    continue
                t = summarize([p["compile_ms"] for p in ok])
                first = summarize([p["first_graph_ms"] for p in ok]).median_ms
                records.append(make_record(info, suite="compile", case=name, impl=impl,
                                           metric="ms", value=t.median_ms, spread=t.spread(),
                                           first_graph_ms=first))
                rows.append([name, impl, t.median_ms, t.min_ms, t.max_ms, fmt(first)])
    print("\n== compile (ms per graph; first-graph = one-time process cost, apart) ==")
    print(format_table(("case", "impl", "median ms", "min ms", "max ms", "first-graph ms"),
                       rows))
    return records


def run_bench(suites: list[str], impls: list[str], *, quick: bool = False,
              out_dir: str | None = None, device_name: str | None = None,
              write: bool = True) -> int:
    """Returns the number of failed (error) records."""
    device = pick_device(device_name)
    info = run_info(device)
    print(f"opfuse bench on {info.device}, commit {info.commit}, {info.threads} "
          f"threads, torch {torch.__version__}")
    if busy_warning(device):
        print(busy_warning(device))
    bw = None
    failures = 0
    for suite in suites:
        if suite == "compile":
            records = run_compile_suite(impls, info, quick)
        elif suite == "launch":
            from .launch import run_launch_suite
            records = run_launch_suite(device, info, quick)
        else:
            if bw is None:
                bw = measure_copy_bandwidth(device, budget_s=0.5 if quick else 2.0)
                print(f"measured copy bandwidth: {bw.gb_per_s:.2f} GB/s "
                      f"(median of {bw.timing.reps}, {bw.copy_bytes >> 20} MB copied)")
            records = run_timed_suite(suite, device, impls, bw, info, quick)
        failures += sum(1 for r in records if r.get("error"))
        if write:
            target = Path(out_dir) if out_dir else default_results_dir(info)
            path = write_records(records, info, suite, target)
            print(f"wrote {path}")
            if suite not in ("compile", "launch") and plot_roofline(records, path.with_suffix(".png"),
                                                    f"{suite} on {info.device}"):
                print(f"wrote {path.with_suffix('.png')}")
    return failures
