"""The 'compile' suite: how long a graph takes to compile, cold and warm.

cold: a fresh cache directory (OPFUSE_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR), so
      nothing can be reused from disk;
warm: a new process pointed at the cache the cold run just filled, i.e. what
      a user pays on the second run of a program.
Each measurement is its own subprocess so no in-memory cache leaks between
them. Inside it a different warm-up graph is compiled first, so one-time
process costs (lazy imports, compiler discovery) are reported apart
('first_graph_ms') and not charged to the graph being measured. Compile time
= first call - a steady-state call of the same function.

Run a single probe by hand:
    python -m opfuse.bench.compile_time --impl opfuse --case chain
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from .timing import summarize

COMPILE_CASES = ("chain", "softmax", "layer_norm")
CACHE_ENV = {"opfuse": "OPFUSE_CACHE_DIR", "torch.compile": "TORCHINDUCTOR_CACHE_DIR"}


def _case_inputs(case: str):
    import torch
    from . import cases
    torch.manual_seed(0)
    if case == "chain":
        return cases.seed_chain, tuple(torch.randn(1 << 16) for _ in range(3))
    x = torch.randn(256, 1024)
    if case == "layer_norm":
        return cases.layer_norm, (x, torch.randn(1024), torch.randn(1024))
    return cases.ROW_FUNCTIONS[case], (x,)


def _warmup_graph(x):
    # Deliberately unlike every measured case, so its cache entries never match.
    return (x.cos() * 3.0).sum(dim=0)


def probe(impl: str, case: str) -> dict:
    """Runs inside the subprocess; returns milliseconds."""
    import torch
    from .impls import IMPLS

    t0 = time.perf_counter()
    IMPLS[impl](_warmup_graph)(torch.randn(8, 8))
    first_graph_ms = (time.perf_counter() - t0) * 1e3
    torch._dynamo.reset()

    fn, inputs = _case_inputs(case)
    compiled = IMPLS[impl](fn)
    t0 = time.perf_counter()
    compiled(*inputs)
    first_call_ms = (time.perf_counter() - t0) * 1e3
    steady = []
    for _ in range(5):
        t0 = time.perf_counter()
        compiled(*inputs)
        steady.append((time.perf_counter() - t0) * 1e3)
    steady_ms = summarize(steady).median_ms
    return {"compile_ms": first_call_ms - steady_ms, "first_call_ms": first_call_ms,
            "steady_ms": steady_ms, "first_graph_ms": first_graph_ms}


def run_probe(impl: str, case: str, cache_dir: str, timeout_s: float = 600) -> dict:
    """Spawn one probe process with its cache pointed at cache_dir."""
    import torch
    # Same thread count as the parent (--threads), since Inductor bakes it into its code.
    env = dict(os.environ, **{CACHE_ENV[impl]: cache_dir,
                              "OMP_NUM_THREADS": str(torch.get_num_threads())})
    proc = subprocess.run([sys.executable, "-m", "opfuse.bench.compile_time",
                           "--impl", impl, "--case", case],
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"probe exited {proc.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1])


def measure(impl: str, case: str, repeats: int) -> dict[str, list[dict]]:
    """{'cold': [probe results], 'warm': [...]}, each repeat with a fresh cache."""
    out: dict[str, list[dict]] = {"cold": [], "warm": []}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="opfuse-bench-cache-") as cache_dir:
            out["cold"].append(run_probe(impl, case, cache_dir))
            out["warm"].append(run_probe(impl, case, cache_dir))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", required=True, choices=sorted(CACHE_ENV))
    parser.add_argument("--case", required=True, choices=COMPILE_CASES)
    args = parser.parse_args(argv)
    print(json.dumps(probe(args.impl, args.case)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
