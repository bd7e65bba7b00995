"""`opfuse demo`: the seed's examples, checked against eager, then timed.

Examples: the chain y = relu(x + b1) * 0.5 + b2; softmax; layer_norm;
rms_norm; an MLP block relu(x @ w1 + b1) @ w2 + b2 (GEMMs stay in PyTorch,
bias + relu are fused); a small transformer block. For each: PASS/FAIL
against eager, eager's launches vs opfuse's (fused kernels + ops it left to
PyTorch), the bytes floor, and time for eager / opfuse / torch.compile with
achieved GB/s against the bandwidth measured on this machine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .bench import floors
from .bench.cases import layer_norm, rms_norm, seed_chain, softmax
from .bench.ceilings import measure_copy_bandwidth
from .bench.checks import check_close, max_abs_diff
from .bench.impls import IMPLS, parse_impls
from .bench.launches import count_eager_launches
from .bench.suites import busy_warning, pick_device
from .bench.table import format_table
from .bench.timing import benchmark, last_level_cache_bytes, rotation_copies


def mlp_block(x, w1, b1, w2, b2):
    return torch.relu(x @ w1 + b1) @ w2 + b2


def transformer_block(x, ln1_w, ln1_b, w_qkv, w_out, ln2_w, ln2_b, w_fc1, b_fc1, w_fc2, b_fc2,
                      n_heads: int = 4):
    """Pre-norm block: attention written as matmul + softmax, MLP with gelu, residuals."""
    batch, seq, dim = x.shape
    head_dim = dim // n_heads
    h = F.layer_norm(x, (dim,), ln1_w, ln1_b)
    q, k, v = (h @ w_qkv).split(dim, dim=-1)
    q, k, v = (t.view(batch, seq, n_heads, head_dim).transpose(1, 2) for t in (q, k, v))
    probs = torch.softmax((q @ k.transpose(-2, -1)) * head_dim ** -0.5, dim=-1)
    attn = (probs @ v).transpose(1, 2).reshape(batch, seq, dim)
    x = x + attn @ w_out
    h = F.layer_norm(x, (dim,), ln2_w, ln2_b)
    return x + F.gelu(h @ w_fc1 + b_fc1) @ w_fc2 + b_fc2


@dataclass
class Example:
    name: str
    fn: Callable
    shapes: Callable[[bool], list[tuple]]  # quick -> input shapes
    tol: dict | None = None                # assert_close rtol/atol; None = per-dtype defaults
    weight_scale: bool = False             # scale matrices by 1/sqrt(fan_in) to keep values O(1)


def _mlp_shapes(quick):
    m, k, h = (128, 256, 512) if quick else (512, 512, 2048)
    return [(m, k), (k, h), (h,), (h, k), (k,)]


def _block_shapes(quick):
    b, t, c = (2, 64, 128) if quick else (4, 256, 256)
    return [(b, t, c), (c,), (c,), (c, 3 * c), (c, c), (c,), (c,), (c, 4 * c), (4 * c,),
            (4 * c, c), (c,)]


def _rows(quick):
    return (256, 512) if quick else (2048, 2048)


# GEMMs reorder long sums, so the blocks get the seed's 1e-4 budget instead of
# float32's default 1.3e-6 relative tolerance.
EXAMPLES = [
    Example("chain", seed_chain, lambda q: [((1 << 18) if q else (4 << 20),)] * 3),
    Example("softmax", softmax, lambda q: [_rows(q)]),
    Example("layer_norm", layer_norm, lambda q: [_rows(q), _rows(q)[1:], _rows(q)[1:]]),
    Example("rms_norm", rms_norm, lambda q: [_rows(q), _rows(q)[1:]]),
    Example("mlp_block", mlp_block, _mlp_shapes, dict(rtol=1e-4, atol=1e-4), True),
    Example("transformer_block", transformer_block, _block_shapes, dict(rtol=1e-4, atol=1e-4),
            True),
]


def make_inputs(example: Example, device: torch.device, quick: bool, seed: int = 0) -> tuple:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    inputs = []
    for shape in example.shapes(quick):
        t = torch.randn(shape, generator=gen, device=device)
        if example.weight_scale and len(shape) == 2 and inputs:  # a weight matrix
            t = t * shape[0] ** -0.5
        inputs.append(t)
    return tuple(inputs)


def _opfuse_launches(compiled, inputs) -> tuple[int | None, int | None, object]:
    """(fused kernel launches, ops left to PyTorch, output) for one first call.

    The call that compiles is also the one counted, so the numbers hold
    whether opfuse counts fallback ops per compile or per call.
    """
    import opfuse
    if not hasattr(opfuse, "stats"):  # counts unknown, but correctness still checked
        return None, None, compiled(*inputs)
    opfuse.reset_stats()
    out = compiled(*inputs)
    stats = opfuse.stats()
    return stats.get("kernel_launches"), stats.get("fallback_ops"), out


def run_example(example: Example, impls: list[str], device: torch.device, quick: bool) -> dict:
    inputs = make_inputs(example, device, quick)
    with torch.no_grad():
        expected = example.fn(*inputs)
        row = {"name": example.name, "ok": True, "launches_eager":
               count_eager_launches(example.fn, inputs, device),
               "bytes": floors.bytes_moved(inputs, expected), "ms": {}}
        budget, min_reps = (0.1, 3) if quick else (0.5, 5)
        # Rotate input copies when one set would sit in cache (see bench/timing.py).
        copies = rotation_copies(row["bytes"], last_level_cache_bytes(device), max_copies=8)
        arg_sets = [inputs] + [make_inputs(example, device, quick, s) for s in range(1, copies)]
        for impl in impls:
            torch._dynamo.reset()
            try:
                compiled = IMPLS[impl](example.fn)
                if impl == "opfuse":
                    fused, left, out = _opfuse_launches(compiled, inputs)
                    row["launches_opfuse"] = (fused, left)
                else:
                    out = compiled(*inputs)
                error = check_close(out, expected, **(example.tol or {}))
            except Exception as exc:  # ImplUnavailable, compile errors: a FAIL row
                error = f"{type(exc).__name__}: {exc}"
            verdict = "PASS" if error is None else "FAIL"
            diff = f"max abs diff {max_abs_diff(out, expected):.2e}" if error is None else \
                " ".join(error.split())[:300]
            print(f"{verdict}  {example.name:<18} {impl:<14} {diff}", flush=True)
            if error is not None:
                row["ok"] = False
                continue
            row["ms"][impl] = benchmark(compiled, arg_sets, device, budget_s=budget,
                                        min_reps=min_reps).median_ms
    return row


def _launch_cell(row) -> str:
    fused, left = row.get("launches_opfuse", (None, None))
    if fused is None:
        return "-"
    return f"{fused + (left or 0)} ({fused} fused + {left or 0} torch)"


def summary_table(rows: list[dict], bw) -> str:
    headers = ("example", "check", "launches eager", "launches opfuse", "floor MB",
               "eager ms", "opfuse ms", "torch.compile ms", "opfuse GB/s", "% of BW",
               "opfuse vs eager")
    out = []
    for r in rows:
        ms = r["ms"]
        fused_ms = ms.get("opfuse")
        out.append([r["name"], "PASS" if r["ok"] else "FAIL", r["launches_eager"],
                    _launch_cell(r), r["bytes"] / 1e6, ms.get("eager"), fused_ms,
                    ms.get("torch.compile"),
                    floors.achieved_gb_per_s(r["bytes"], fused_ms) if fused_ms else None,
                    100 * floors.fraction_of_bandwidth(r["bytes"], fused_ms, bw.bytes_per_s)
                    if fused_ms else None,
                    f"{ms['eager'] / fused_ms:.2f}x" if fused_ms and "eager" in ms else None])
    return format_table(headers, out)


def run_demo(quick: bool = False, impls_text: str | None = None,
             device_name: str | None = None) -> int:
    """Returns the number of examples that failed a correctness check."""
    device = pick_device(device_name)
    # --quick leaves Inductor out by default: its C++ compile takes tens of seconds here.
    impls = parse_impls(impls_text or ("eager,opfuse" if quick else None))
    small_copy = quick and device.type == "cpu"  # a GPU copies the full 1 GB in ms
    bw = measure_copy_bandwidth(device, copy_bytes=(64 << 20) if small_copy else None,
                                budget_s=0.2 if quick else 1.0)
    print(f"opfuse demo on {device} ({torch.get_num_threads()} threads); measured copy "
          f"bandwidth {bw.gb_per_s:.1f} GB/s; impls: {', '.join(impls)}")
    print((busy_warning(device) or "") + "\n")
    rows = [run_example(ex, impls, device, quick) for ex in EXAMPLES]
    print()
    print(summary_table(rows, bw))
    print("\nlaunches: eager = ATen ops that do work (CPU) or kernels (CUDA), from "
          "torch.profiler;\n          opfuse = opfuse.stats() kernel_launches + fallback_ops "
          "for one call.\nfloor MB = each input read once + each output written once; "
          "% of BW = floor time / opfuse time.")
    failed = sum(1 for r in rows if not r["ok"])
    print(f"\n{len(rows) - failed}/{len(rows)} examples passed")
    return failed
