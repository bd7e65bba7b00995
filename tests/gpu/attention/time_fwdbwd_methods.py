"""One forward+backward case of the FlashAttention setup (bf16, hidden 2048,
16k tokens) timed three ways, for the product's op and SDPA's backends:

- "do_bench": triton.testing.do_bench's median, as bench_attention_*.py time
  (the L2 is cleared before each call, CUDA events around each call);
- "back-to-back": CUDA events around N calls in a row, no clearing (what
  FlashAttention's own benchmarks time, torch.utils.benchmark over repeats);
- "trace": a torch.profiler trace of do_bench-like iterations (clear, call):
  per iteration the span from the call's first kernel start to its last
  kernel end, the kernels' summed time, and the idle gaps inside the span.

The question (docs/perf-notes.md, session 25): the op's fwd+bwd read 515
TFLOP/s under do_bench where its kernels add up to ~553; where do the
~250 us a call go?

    python tests/gpu/attention/time_fwdbwd_methods.py [--d 128] [--s 4096] [--causal] [--calls 20]
"""

import argparse
import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench_attention_fwd import bench_ms, product_op  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--d", type=int, default=128)
ap.add_argument("--s", type=int, default=4096)
ap.add_argument("--causal", action="store_true")
ap.add_argument("--calls", type=int, default=20)
a = ap.parse_args()
D, S = a.d, a.s
B, H = 16384 // S, 2048 // D
flops = 3.5 * 4 * B * H * S * S * D / (2 if a.causal else 1)
g = torch.Generator(device="cuda").manual_seed(S + D)
q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))


def sdpa(backend):
    def run():
        with sdpa_kernel(backend):
            out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=a.causal)
        torch.autograd.grad(out, (qg, kg, vg), dout)
    return run


impls = {}
op = product_op()
if op is not None:
    impls["opfuse-op"] = lambda: torch.autograd.grad(op(qg, kg, vg, causal=a.causal), (qg, kg, vg), dout)
impls["sdpa-cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
impls["sdpa-flash"] = sdpa(SDPBackend.FLASH_ATTENTION)


def back_to_back_ms(fn, n):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def trace(fn, iters=4):
    """[(span us, kernels us, [gaps > 2 us])] per iteration of (clear the L2, fn)."""
    cache = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            cache.zero_()
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    # iterations: the kernels after each clearing of the cache buffer (the one fill of 256 MB, > 40 us)
    its = []
    for e in kernels:
        if "fill" in e["name"].lower() and e["dur"] > 40:
            its.append([])
        elif its:
            its[-1].append(e)
    out = []
    for ks in its:
        if not ks:
            continue
        span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
        busy = sum(k["dur"] for k in ks)
        gaps = [round(b["ts"] - (x["ts"] + x["dur"]), 1) for x, b in zip(ks, ks[1:]) if b["ts"] - (x["ts"] + x["dur"]) > 2]
        out.append((span, busy, gaps, [(k["name"][:60], round(k["dur"], 1)) for k in ks]))
    return out


print(f"D={D} S={S} causal={a.causal} B={B} H={H}; TFLOP/s = 3.5 x 4 B H S^2 D / time", flush=True)
for name, fn in impls.items():
    try:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        db = bench_ms(fn)
        bb = back_to_back_ms(fn, a.calls)
        tr = trace(fn)
    except RuntimeError as e:
        print(f"{name}: unavailable ({e})", flush=True)
        continue
    print(f"{name:11} do_bench {db * 1e3:8.1f} us ({flops / db / 1e9:5.0f})   back-to-back {bb * 1e3:8.1f} us "
          f"({flops / bb / 1e9:5.0f})", flush=True)
    for i, (span, busy, gaps, ks) in enumerate(tr):
        print(f"    trace iteration {i}: span {span:8.1f} us, kernels {busy:8.1f} us, gaps > 2 us: {gaps}", flush=True)
    if tr:
        for kname, dur in tr[-1][3]:
            print(f"        {dur:8.1f} us  {kname}")
