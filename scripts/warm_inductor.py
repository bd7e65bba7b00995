#!/usr/bin/env python3
"""Compiles a bench suite's cases with torch.compile's default backend once,
without importing opfuse (so it can run while opfuse builds): Inductor's
on-disk caches then serve the bench's own compile, and a short GPU session
spends its time on measurements.
  python3 scripts/warm_inductor.py rows_bwd [layer_norm]   (only cases whose name holds the second word)"""
import importlib.util
import os
import sys

import torch

here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("bench_cases", os.path.join(here, "..", "python", "opfuse", "bench", "cases.py"))
cases = importlib.util.module_from_spec(spec)
sys.modules["bench_cases"] = cases  # dataclasses look their module up there
spec.loader.exec_module(cases)
dev = torch.device("cuda")
for c in cases.SUITES[sys.argv[1] if len(sys.argv) > 1 else "rows_bwd"](dev, False):
    if len(sys.argv) > 2 and sys.argv[2] not in c.name:
        continue
    torch._dynamo.reset()
    torch.compile(c.fn)(*c.make_inputs(dev, 0))
    torch.cuda.synchronize()
    print("warm", c.name, flush=True)
