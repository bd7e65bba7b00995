"""The CUDA runtime on a GPU: launches on the caller's stream, CUDA graph
capture of a compiled function, vector and scalar paths, large tensors."""
import pytest
import torch

import opfuse

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def chain(x, b1, b2):
    return torch.relu(x + b1) * 0.5 + b2


def test_cuda_graph_capture_of_compiled_function():
    fn = torch.compile(chain, backend="opfuse")
    x, b1, b2 = (torch.randn(4096, 1000, device="cuda") for _ in range(3))
    fn(x, b1, b2)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(x, b1, b2)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = fn(x, b1, b2)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, chain(x, b1, b2))


def test_runs_on_the_callers_stream():
    fn = torch.compile(lambda x: torch.softmax(x * 2, -1), backend="opfuse")
    x = torch.randn(512, 4096, device="cuda")
    fn(x)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = fn(x)
    s.synchronize()
    torch.testing.assert_close(y, torch.softmax(x * 2, -1))


@pytest.mark.parametrize("offset", [0, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vector_and_scalar_paths(offset, dtype):
    fn = torch.compile(chain, backend="opfuse")
    n = 1 << 20
    base = torch.randn(3, n + 8, device="cuda", dtype=dtype)
    x, b1, b2 = (base[i, offset:offset + n] for i in range(3))
    out = fn(x, b1, b2)
    ref = chain(x.double(), b1.double(), b2.double()).to(dtype)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("shape", [(1024, 4096), (64, 32768), (16, 262144), (8192, 256), (7, 3001)])
@pytest.mark.parametrize("op", ["softmax", "log_softmax", "layer_norm", "rms_norm"])
def test_row_ops_at_benchmark_like_shapes(op, shape):
    f = {"softmax": lambda x: torch.softmax(x, -1), "log_softmax": lambda x: torch.log_softmax(x, -1),
         "layer_norm": lambda x: torch.nn.functional.layer_norm(x, (x.shape[-1],)),
         "rms_norm": lambda x: torch.nn.functional.rms_norm(x, (x.shape[-1],))}[op]
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    fn = torch.compile(f, backend="opfuse")
    opfuse.reset_stats()
    out = fn(x)
    ref = f(x.float()).to(torch.bfloat16)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    assert opfuse.stats()["kernel_launches"] == 1


def test_training_step_on_gpu_matches_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.LayerNorm(128), torch.nn.Linear(128, 8)).cuda()
    x = torch.randn(32, 64, device="cuda")
    ref = model(x).square().mean()
    ref.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    out = torch.compile(model, backend="opfuse")(x).square().mean()
    out.backward()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-3, atol=1e-5)
