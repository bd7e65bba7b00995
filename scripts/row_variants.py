#!/usr/bin/env python3
"""Row-kernel schedules side by side on a GPU: each variant (a setting of
the emitter's tuning knobs OPFUSE_ROW_MAX_CLUSTER / OPFUSE_ROW_CACHE_VALUES)
runs in its own process, times every op and shape with CUDA events, and
prints TB/s (input read once + output written once, over the time).

  python3 scripts/row_variants.py [--variants 8:32,1:32,4:16] [--shapes 8192x32768,4096x262144]
  python3 scripts/row_variants.py --envs 'OPFUSE_ROW_PREFETCH=1|' --ops layer_norm_backward --shapes 32768x4096
(--envs: variants of any OPFUSE_* knobs in one process, '|' between them;
the variant 'inductor' times torch.compile's default backend instead.)

A variant is max_cluster:cache_values[:cache_row_invariant[:column_partials]]
(OPFUSE_ROW_CACHE_INVARIANT, OPFUSE_COLUMN_PARTIALS; defaults -1 = by row length, and 1).
"""
import argparse
import os
import subprocess
import sys

OPS = ("softmax", "log_softmax", "layer_norm", "rms_norm")
# Also: layer_norm_noaffine, layer_norm_w, rms_norm_noaffine (fewer
# row-invariant operands), softmax_backward (dx from dy, y) and layer_norm_backward (dx,
# dweight, dbias from dy, x, mean, rstd, w),
# whose weight and bias sums are column partials inside the dx kernel.


def child(shapes, ops, once=False, backend="opfuse"):
    import torch
    import torch.nn.functional as F
    import opfuse  # noqa: F401
    fns = {"softmax": lambda x, w, b: torch.softmax(x, -1), "log_softmax": lambda x, w, b: torch.log_softmax(x, -1),
           "layer_norm": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5),
           "rms_norm": lambda x, w, b: F.rms_norm(x, (x.shape[-1],), w, eps=1e-6),
           # Without (some of) the row-invariant operands: how much of a norm's
           # time goes to reading its weight and bias again for every row.
           "layer_norm_noaffine": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), None, None, eps=1e-5),
           "layer_norm_w": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, None, eps=1e-5),
           "rms_norm_noaffine": lambda x, w, b: F.rms_norm(x, (x.shape[-1],), None, eps=1e-6),
           "softmax_backward": lambda dy, y: torch.ops.aten._softmax_backward_data(dy, y, -1, y.dtype),
           "layer_norm_backward": lambda dy, x, mean, rstd, w, b: torch.ops.aten.native_layer_norm_backward(
               dy, x, [x.shape[-1]], mean, rstd, w, b, [True, True, True])}
    floats = {"softmax_backward": lambda x, w, b: (torch.randn_like(x).float(), torch.softmax(x.float(), -1)),
              "layer_norm_backward": lambda x, w, b: (torch.randn_like(x).float(), x.float(),
                                                      *torch.ops.aten.native_layer_norm(x.float(), [x.shape[-1]], None, None, 1e-5)[1:],
                                                      w.float(), b.float())}
    for shape in shapes:
        r, c = shape
        x = torch.randn(r, c, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(c, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(c, device="cuda", dtype=torch.bfloat16)
        for op in ops:
            torch._dynamo.reset()
            fn = torch.compile(fns[op], backend=backend, dynamic=False)
            if op in floats:
                ref_args = floats[op](x, w, b)
                args = tuple(a.to(x.dtype) if a.shape == x.shape or a.dim() == 1 else a for a in ref_args)
            else:
                ref_args, args = (x.float(), w.float(), b.float()), (x, w, b)
            out = fn(*args)
            if once:
                torch.cuda.synchronize()
                print(f"  {op} {r}x{c} ran once", flush=True)
                continue
            ref = fns[op](*ref_args)
            outs, refs = (out, ref) if isinstance(out, (tuple, list)) else ((out,), (ref,))
            err = max((o.float() - r).abs().max().item() / max(1.0, r.abs().max().item()) for o, r in zip(outs, refs))
            times = []
            for _ in range(30):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(5):
                    fn(*args)
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e) / 5)
            ms = sorted(times)[len(times) // 2]
            nbytes = (3 if op in floats else 2) * x.numel() * x.element_size()
            print(f"  {op:12s} {r}x{c:<7d} {ms * 1000:8.1f} us {nbytes / ms / 1e9:6.2f} TB/s  max rel err {err:.3g}", flush=True)


def with_env(settings, run):
    """Runs `run` with the env knobs in `settings` ("K=V K=V") set in this
    process (the emitter reads them when it generates a kernel; os.environ
    reaches its getenv), then restores them."""
    saved = {}
    for kv in settings.split():
        k, v = kv.split("=", 1)
        saved[k] = os.environ.get(k)
        os.environ[k] = v
    try:
        run()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--envs", default=None,
                    help="in-process variants: env settings 'K=V K=V' separated by '|' ('' = the defaults)")
    ap.add_argument("--once", action="store_true", help="one call a variant, no timing (for ncu)")
    ap.add_argument("--variants", default="8:32,1:32,4:32,8:16,2:16")
    ap.add_argument("--shapes", default="32768x4096,8192x32768,4096x262144")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    if a.child:
        child(shapes, a.ops.split(","))
        return
    if a.envs is not None:
        for settings in a.envs.split("|"):
            print(f"variant {settings.strip() or 'defaults'}", flush=True)
            if settings.strip() == "inductor":
                child(shapes, a.ops.split(","), once=a.once, backend="inductor")
            else:
                with_env(settings, lambda: child(shapes, a.ops.split(","), once=a.once))
        return
    for v in a.variants.split(","):
        # cluster:values[:invariant[:partials]]
        cluster, values, *rest = v.split(":")
        invariant = rest[0] if rest else "-1"
        partials = rest[1] if len(rest) > 1 else "1"
        env = dict(os.environ, OPFUSE_ROW_MAX_CLUSTER=cluster, OPFUSE_ROW_CACHE_VALUES=values,
                   OPFUSE_ROW_CACHE_INVARIANT=invariant, OPFUSE_COLUMN_PARTIALS=partials)
        print(f"variant max_cluster={cluster} cache_values={values} cache_row_invariant={invariant} "
              f"column_partials={partials}", flush=True)
        subprocess.run([sys.executable, __file__, "--child", "--shapes", a.shapes, "--ops", a.ops], env=env, check=False)


if __name__ == "__main__":
    main()
