#!/usr/bin/env python3
"""The long-row cells of the rows suite (8192x32768 and 4096x262144, bf16)
in one device call, most important first: opfuse at its defaults and with
rows not staged in shared memory (OPFUSE_ROW_SMEM_KB=0, the loop stages
before), then eager and torch.compile (Inductor). The bench's own cases,
checks (against the float64 reference), timing and record format
(opfuse.bench); records are written after each phase, so a timeout keeps
what ran.
  OPFUSE_COMMIT=<sha> python3 scripts/sessions/rows_long_session.py --out DIR [--shapes 8192x32768,4096x262144]
"""
import argparse
import json
import os
from pathlib import Path

import torch

from opfuse.bench.cases import ROW_FUNCTIONS, row_case
from opfuse.bench.ceilings import measure_copy_bandwidth
from opfuse.bench.impls import IMPLS
from opfuse.bench.records import run_info
from opfuse.bench.runner import bandwidth_record, run_case, to_records


def with_env(name, value, make):
    """An impl whose compile (at its first call) sees `name`=`value`: the
    emitter reads its knobs when it generates a kernel."""
    def wrap(fn):
        inner = make(fn)

        def call(*args):
            old = os.environ.get(name)
            os.environ[name] = value
            try:
                return inner(*args)
            finally:
                if old is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = old
        return call
    return wrap


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="8192x32768,4096x262144")
    ap.add_argument("--phases", default="opfuse,opfuse-loop,baselines")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds of timing per impl and case")
    a = ap.parse_args()
    IMPLS["opfuse-loop"] = with_env("OPFUSE_ROW_SMEM_KB", "0", IMPLS["opfuse"])
    device = torch.device(a.device)
    info = run_info(device)
    bw = measure_copy_bandwidth(device, budget_s=0.5)
    print(f"copy {bw.gb_per_s:.0f} GB/s, commit {info.commit}", flush=True)
    records = [bandwidth_record(bw, info, "rows")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    cases = [row_case(op, r, c, torch.bfloat16) for (r, c) in shapes for op in ROW_FUNCTIONS]
    out = Path(a.out) / "rows-long.json"
    phases = {"opfuse": ["opfuse"], "opfuse-loop": ["opfuse-loop"], "baselines": ["eager", "torch.compile"]}
    for phase in a.phases.split(","):
        for case in cases:
            # A case per run_case call: it resets dynamo first, so each impl compiles afresh.
            results = run_case(case, phases[phase], device, budget_s=a.budget, min_reps=10)
            records += to_records(results, bw, info)
            for r in results:
                gbs = f"{r.nbytes / r.timing.median_ms / 1e6:7.0f} GB/s" if r.timing else f"ERROR {r.error}"
                print(f"{case.name:28s} {r.impl:14s} {gbs}", flush=True)
            out.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
