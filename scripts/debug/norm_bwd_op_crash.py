"""Session 13: where the layer_norm/rms_norm backward op crashes on CUDA
with graphs built for the concrete shape (5754a98, perf-notes session 12).
Each step prints before it runs, so the last line before a crash names it."""
import faulthandler
import os
import sys

faulthandler.enable()
os.environ.setdefault("OPFUSE_LNBWD_WIDE", "0")
import torch  # noqa: E402

import opfuse  # noqa: E402,F401
from opfuse import _C  # noqa: E402
from opfuse.ops import _kernel, norms  # noqa: E402


def say(*a):
    print(*a, flush=True)


DEV = os.environ.get("DEV", "cuda")  # cpu: a dry run of the same steps
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
shapes = [(64, 256), (7, 33), (32768, 4096)] if len(sys.argv) < 2 else [tuple(map(int, s.split("x"))) for s in sys.argv[1:]]
for dt in (torch.float32, torch.bfloat16):
    for r, c in shapes:
        say(f"== {dt} {r}x{c}")
        x = torch.randn(r, c, device=DEV, dtype=dt)
        w = torch.randn(c, device=DEV, dtype=dt)
        b = torch.randn(c, device=DEV, dtype=dt)
        dy = torch.randn_like(x)
        y, mean, rstd = torch.ops.opfuse.layer_norm(x, 1, w, b, 1e-5)
        sync()
        say("forward ok; mean", tuple(mean.shape), mean.stride(), "rstd", tuple(rstd.shape))
        text = norms._layer_norm_backward_graph(_kernel.dtype_name(dt), "f32", 2, 1, _kernel.dtype_name(dt),
                                                _kernel.dtype_name(dt), (True, True, True), (r, c))
        cg = _C.CompiledGraph(text, target="cuda" if DEV == "cuda" else "cpu")
        say(cg.plan_text())
        k = _kernel.GraphKernel(text, x.device)
        say("GraphKernel built; kernels", k.num_kernels, "buffers", k.compiled.buffers())
        tensors = [dy, x, mean, rstd, w]
        shapes_ = [list(t.shape) for t in tensors]
        strides = [list(t.stride()) for t in tensors]
        syms = k.compiled.bind(shapes_)
        say("syms", syms)
        if DEV == "cuda":
            with torch.cuda.device(x.device):
                variant, compiled, hit = k.compiled.variant(shapes_, strides)
        else:
            variant, compiled, hit = k.compiled.variant(shapes_, strides)
        say("variant", variant, compiled, hit)
        for i in range(len(k.out_dtypes)):
            say("buffer", k.n_inputs + i, k.compiled.buffer_shape(k.n_inputs + i, syms))
        prepared = k._prepare(tensors)
        say("prepared")
        outs = prepared.finish(tensors, torch.cuda.current_stream().cuda_stream if DEV == "cuda" else 0)
        sync()
        say("finish ok", [tuple(o.shape) for o in outs])
        outs = k(*tensors)
        sync()
        say("call ok")
        ref = torch.ops.aten.native_layer_norm_backward(dy.double(), x.double(), [c], mean.double(), rstd.double(),
                                                        w.double(), b.double(), [True, True, True])
        say("max err", [float((o.double() - e).abs().max()) for o, e in zip(outs, ref)])
        os.environ["OPFUSE_NORM_BWD_SHAPES"] = "16"
        got = torch.ops.opfuse.layer_norm_backward(dy, x, mean, rstd, w, b, 1, [True, True, True])
        sync()
        say("op ok", [float((o.double() - e).abs().max()) for o, e in zip(got, ref)])
say("done")
