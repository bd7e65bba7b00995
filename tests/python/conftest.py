import os
import tempfile

import pytest
import torch

# Every test run gets its own kernel cache unless one is given.
os.environ.setdefault("OPFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="opfuse-test-cache-"))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def launches(fn, *args):
    """Runs fn once warm and returns (result, opfuse kernel launches)."""
    import opfuse

    fn(*args)
    opfuse.reset_stats()
    out = fn(*args)
    return out, opfuse.stats()["kernel_launches"]


def nvrtc_or_skip():
    """NVRTC's version, or the test skips (no libnvrtc on this machine: the
    compile-only tests need NVRTC, not a GPU)."""
    from opfuse import _C

    try:
        return _C.nvrtc_version()
    except Exception as e:
        pytest.skip(f"NVRTC not available: {e}")


@pytest.fixture
def nvrtc():
    return nvrtc_or_skip()


# Decorator form of nvrtc_or_skip.
needs_nvrtc = pytest.mark.usefixtures("nvrtc")


@pytest.fixture
def partitions(monkeypatch):
    """The IR text of every partition opfuse compiles meanwhile, by name
    ("forward_fused_0", "backward_fused_0", "inference_fused_0", ...)."""
    from opfuse.frontend import backend

    texts = {}
    original = backend._compile_partition

    def record(sub, name, dump):
        fused, compiled_graph = original(sub, name, dump)
        texts[name] = fused.ir_text
        return fused, compiled_graph

    monkeypatch.setattr(backend, "_compile_partition", record)
    return texts


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """The same test on the CPU and, where there is one, on a CUDA device."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return request.param
