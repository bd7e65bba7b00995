import pathlib
import sys

import pytest

# The attention harness modules live beside the tests.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")


# The harnesses of the GPU tests, one per test module (a module may define its
# own fixture of the same name to override these). Imported lazily: the CPU
# tests in this folder must not need torch with CUDA.
@pytest.fixture(scope="module")
def fwd():
    """attn_runtime.AttentionForward, with TF32 off for the float32 references."""
    import torch

    import attn_runtime as ar

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return ar.AttentionForward()


@pytest.fixture(scope="module")
def bwd():
    import attn_bwd_runtime as br

    return br.AttentionBackward()
