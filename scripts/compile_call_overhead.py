"""Where torch.compile's call time goes around an opfuse partition: the
seed chain on 4096 elements, host us per call (median of batches, as the
launch bench), for

  eager                 the three PyTorch ops
  dynamo only           torch.compile with a backend that returns the FX
                        graph's forward: Dynamo's guards and frame handling
  dynamo + aot          + AOTAutograd's runtime wrappers around the same
                        forward (a trivial compiler)
  opfuse                torch.compile(backend="opfuse"): Dynamo, AOTAutograd
                        and opfuse's partition
  partition             opfuse's partition call alone

each with grad enabled and under torch.no_grad(). "dynamo only" and
"dynamo + aot" run the chain's three ops eagerly inside, so Dynamo's own
cost is "dynamo only" minus "eager", AOTAutograd's wrappers "dynamo + aot"
minus "dynamo only", and everything around opfuse's partition "opfuse"
minus "partition". It says how much of a
compiled call opfuse could win by skipping AOTAutograd for inference graphs,
and how much is Dynamo's alone.

    python3 scripts/compile_call_overhead.py [--device cuda] [--out file.json]
"""
from __future__ import annotations

import argparse
import contextlib
import json

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import opfuse  # noqa: F401  (registers the backend)
from opfuse.bench.cases import seed_chain
from opfuse.bench.launch import _host_us, find_partition


def _generated_forward(gm):
    """The FX graph's generated forward itself (a lazy GraphModule's forward
    is a trampoline until it is generated), as opfuse's backend returns it."""
    real_recompile = getattr(gm, "real_recompile", None)
    if real_recompile is not None:
        real_recompile()
    return gm.forward


def dynamo_only(gm, example_inputs):
    return _generated_forward(gm)


def dynamo_aot(gm, example_inputs):
    return aot_autograd(fw_compiler=lambda g, e: make_boxed_func(_generated_forward(g)))(gm, example_inputs)


def measure(device: torch.device, batches: int, calls: int) -> dict:
    args = tuple(torch.randn(4096, device=device) for _ in range(3))
    out = {}
    for grad in (True, False):
        ctx = contextlib.nullcontext() if grad else torch.no_grad()
        with ctx:
            rows = {"eager": lambda: seed_chain(*args)}
            for name, backend in (("dynamo only", dynamo_only), ("dynamo + aot", dynamo_aot), ("opfuse", "opfuse")):
                torch._dynamo.reset()
                f = torch.compile(seed_chain, backend=backend)
                torch.testing.assert_close(f(*args), seed_chain(*args))
                rows[name] = f
                if name == "opfuse":
                    part, part_args = find_partition(f, args)
                    rows["partition"] = (lambda p, a: lambda: p(*a))(part, part_args)
            compiled = {k: v for k, v in rows.items()}
            res = {}
            for name, fn in compiled.items():
                call = fn if name in ("eager", "partition") else (lambda g: lambda: g(*args))(fn)
                res[name] = _host_us(call, device, batches, calls)
        out["grad" if grad else "no_grad"] = res
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, default=41)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out")
    a = ap.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cpu":
        torch.set_num_threads(1)
    res = measure(dev, a.batches, a.calls)
    print(f"host us per call on {dev} (median over batches, min):")
    for mode, rows in res.items():
        for name, (med, best) in rows.items():
            print(f"  {mode:8s} {name:14s} {med:8.2f} {best:8.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": str(dev), "torch": torch.__version__, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
