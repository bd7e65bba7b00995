"""Compiling on threads that have no CUDA driver context yet.

AOTAutograd compiles a backward lazily, on autograd's device thread, and a
user may call a compiled function first from a new thread. Neither has a
current driver context before its first CUDA op, and opfuse compiles (NVRTC
for the device's architecture, module load) before any. Each case must
fuse, not fall back to eager: the fallback counter stays at zero and the
kernels run."""
import threading

import pytest
import torch
import torch.nn.functional as F

import opfuse

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def chain(x, b):
    return torch.relu(x + b) * 0.5 + 1.0


def run_on_new_thread(fn):
    box = {}

    def body():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised on the test's thread
            box["error"] = e

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_first_compile_on_a_fresh_thread_fuses():
    x = torch.randn(4099, 77, device="cuda")
    b = torch.randn(77, device="cuda")
    torch._dynamo.reset()
    opfuse.reset_stats()
    out = run_on_new_thread(lambda: torch.compile(chain, backend="opfuse", dynamic=False)(x, b))
    s = opfuse.stats()
    assert s["fallback_ops"] == 0 and s["graphs_compiled"] >= 1 and s["kernel_launches"] >= 1, s
    torch.testing.assert_close(out, chain(x.double(), b.double()).float())


def test_backward_compiled_on_autograd_thread_fuses():
    # A fresh process's first backward is what showed the bug; in a test
    # process autograd's thread may already hold a context, so this also runs
    # the compile and the backward on a new thread of its own.
    x = torch.randn(3001, 1000, device="cuda", requires_grad=True)
    w = torch.randn(1000, device="cuda", requires_grad=True)
    dy = torch.randn(3001, 1000, device="cuda")

    def step():
        torch._dynamo.reset()
        opfuse.reset_stats()
        f = torch.compile(lambda x, w: F.rms_norm(x, (1000,), w, eps=1e-6), backend="opfuse", dynamic=False)
        return torch.autograd.grad(f(x, w), (x, w), dy), opfuse.stats()

    (dx, dw), s = run_on_new_thread(step)
    assert s["fallback_ops"] == 0 and s["graphs_compiled"] >= 2, s
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    rx, rw = torch.autograd.grad(F.rms_norm(xd, (1000,), wd, eps=1e-6), (xd, wd), dy.double())
    torch.testing.assert_close(dx.double(), rx, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dw.double(), rw, rtol=1e-4, atol=1e-3)
