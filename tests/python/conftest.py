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


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """The same test on the CPU and, where there is one, on a CUDA device."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return request.param
