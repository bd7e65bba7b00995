"""Host time of the compiled layer_norm backward whose node the frontend
routes to opfuse.ops.layer_norm_backward (the wide-row kernel), step by
step, and a cProfile of the calls (perf-notes, session 13: the suite's
"host us" was 134-157 against 44 for softmax backward).

  python3 scripts/routed_host_profile.py [ROWSxCOLS ...]
"""
import cProfile
import os
import pstats
import sys
import time

import torch

import opfuse  # noqa: F401
from opfuse.bench.cases import layer_norm_backward
from opfuse.ops import layer_norm_wide


def host_us(fn, args, calls=200):
    """Host time per call while the GPU runs behind (a sleep queued first)."""
    for _ in range(5):
        fn(*args)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1.5e9 * 0.05))  # ~50 ms of GPU work ahead of the calls
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn(*args)
    t = (time.perf_counter_ns() - t0) / calls / 1e3
    torch.cuda.synchronize()
    return t


def main():
    shapes = [tuple(map(int, s.split("x"))) for s in (sys.argv[1:] or ["65536x384", "32768x4096"])]
    for rows, cols in shapes:
        dt = torch.bfloat16
        x = torch.randn(rows, cols, device="cuda", dtype=dt)
        dy, w, b = torch.randn_like(x), torch.randn(cols, device="cuda", dtype=dt), torch.randn(cols, device="cuda", dtype=dt)
        _, mean, rstd = torch.ops.aten.native_layer_norm(x, [cols], w, b, 1e-5)
        args = (dy, x, mean, rstd, w, b)
        compiled = torch.compile(layer_norm_backward, backend="opfuse")
        print(f"== bf16 {rows}x{cols}", flush=True)
        steps = {
            "compiled graph": (compiled, args),
            "torch.ops.opfuse.layer_norm_backward": (
                lambda *a: torch.ops.opfuse.layer_norm_backward(*a, 1, [True, True, True]), args),
            "layer_norm_wide.try_run": (lambda *a: layer_norm_wide.try_run(*a, 1, (True, True, True)), args),
            "4 x torch.empty": (lambda *a: [torch.empty(x.shape, dtype=dt, device=x.device), torch.empty(cols, dtype=dt, device=x.device),
                                            torch.empty(cols, dtype=dt, device=x.device), torch.empty(528 * cols, dtype=torch.float32, device=x.device)], args),
            "torch.cuda.current_stream(dev).cuda_stream": (lambda *a: torch.cuda.current_stream(x.device).cuda_stream, args),
            "aten.native_layer_norm_backward (eager)": (layer_norm_backward, args),
        }
        for name, (fn, a) in steps.items():
            print(f"  {name:45s} {host_us(fn, a):8.1f} us host", flush=True)
        prof = cProfile.Profile()
        torch.cuda._sleep(int(1.5e9 * 0.05))
        prof.enable()
        for _ in range(200):
            compiled(*args)
        prof.disable()
        torch.cuda.synchronize()
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(25)
        st.sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    os.environ.setdefault("OPFUSE_LNBWD_WIDE", "1")
    main()
