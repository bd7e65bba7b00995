"""Partitions with GEMM steps on the C++ launcher (_C.Launcher, as
kernel-only ones): the layout checks, written buffers and GEMM pair blocks,
pointers, the GEMM steps (PyTorch's matmul through a callback on the CPU),
counts and results without Python's _miss per call; GemmUnsupported still
reaching the fallback; and the same values and counts as Python's path.
The path is the default on both devices (OPFUSE_GEMM_CPP_LAUNCH=0 turns
it off); the cases set the knob anyway, so a changed default cannot turn
them into tests of Python's path."""
import math

import pytest
import torch
import torch.nn.functional as F

import opfuse
from opfuse import _C
from opfuse.bench.launch import find_partition
from opfuse.frontend import runtime


def mlp(x, w1, b1, w2, b2):
    return F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)


def llama(x, w1, w3, w2):
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


@pytest.fixture
def cpp_launch(monkeypatch, device):
    """The C++ path on `device` (CUDA: the knob; read when a partition is built)."""
    monkeypatch.setenv("OPFUSE_GEMM_CPP_LAUNCH", "1")
    return torch.device(device)


def mlp_args(device, m=5, k=24, h=40):
    return (torch.randn(m, k, device=device), torch.randn(h, k, device=device) / k ** 0.5,
            torch.randn(h, device=device), torch.randn(k, h, device=device) / h ** 0.5, torch.randn(k, device=device))


def llama_args(device, m=7, k=24, h=40):
    return (torch.randn(m, k, device=device), torch.randn(h, k, device=device) / k ** 0.5,
            torch.randn(h, k, device=device) / k ** 0.5, torch.randn(k, h, device=device) / h ** 0.5)


def partition(fn, args):
    f = torch.compile(fn, backend="opfuse")
    f(*args)
    part, part_args = find_partition(f, args)
    assert part.num_library_calls
    return f, part, part_args


def test_both_devices_take_the_cpp_path_by_default(monkeypatch):
    monkeypatch.delenv("OPFUSE_GEMM_CPP_LAUNCH", raising=False)
    assert runtime.gemm_cpp_launch()
    monkeypatch.setenv("OPFUSE_GEMM_CPP_LAUNCH", "0")
    assert not runtime.gemm_cpp_launch()
    monkeypatch.setenv("OPFUSE_GEMM_CPP_LAUNCH", "1")
    assert runtime.gemm_cpp_launch()


@pytest.mark.parametrize("fn, make", [(mlp, mlp_args), (llama, llama_args)])
def test_repeated_gemm_calls_never_reach_python(fn, make, cpp_launch):
    args = make(cpp_launch)
    f, part, _ = partition(fn, args)
    assert part.gemm_cpp and len(part.recent) == 1 and part._recent == []
    slow = part.slow_calls
    calls = []
    original = runtime.FusedPartition._miss
    runtime.FusedPartition._miss = lambda self, *a: (calls.append(1), original(self, *a))[1]
    try:
        opfuse.reset_stats()
        for _ in range(6):
            out = f(*args)
        s = opfuse.stats()
    finally:
        runtime.FusedPartition._miss = original
    assert calls == [] and part.slow_calls == slow
    ref = fn(*[a.double() for a in args])
    torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-4)
    # Per call: the generated kernels, and every GEMM step a library call on
    # the CPU (on CUDA a skinny GEMM kernel or a pair's batched call moves
    # some; the two add up to the steps less the merged ones).
    if cpp_launch.type == "cpu":
        assert s["library_calls"] == 6 * part.num_library_calls
        assert s["kernel_launches"] == 6 * part.num_kernels


@pytest.mark.parametrize("fn, make", [(mlp, mlp_args), (llama, llama_args)])
def test_both_paths_compute_and_count_the_same(fn, make, cpp_launch):
    args = make(cpp_launch)
    f, part, part_args = partition(fn, args)
    got = {}
    for cpp in (False, True, False):
        part.use_gemm_cpp(cpp)
        part(*part_args)  # a slow call (the layout is kept: nothing is prepared)
        opfuse.reset_stats()
        out = [part(*part_args) for _ in range(3)]
        s = opfuse.stats()
        got.setdefault(cpp, []).append((out[-1], s["kernel_launches"], s["library_calls"]))
    (py, k_py, l_py), (cc, k_cc, l_cc) = got[False][0], got[True][0]
    assert (k_py, l_py) == (k_cc, l_cc) == got[False][1][1:]
    assert torch.equal(py, cc)  # the same kernels and GEMMs on the same inputs


def _gemm_outputs(part, tensors):
    """Indices among the written buffers of two GEMM results of one shape."""
    syms = part.compiled.bind([list(t.shape) for t in tensors])
    outs = [g["out"] - part.n_inputs for g in part.compiled.gemms(syms)]
    shapes = [part.compiled.buffer_shape(part.n_inputs + o, syms) for o in outs]
    same = [(outs[i], outs[j]) for i in range(len(outs)) for j in range(i + 1, len(outs)) if shapes[i] == shapes[j]]
    assert same, "the graph has no two GEMM results of one shape"
    return same[0]


def test_paired_results_share_one_block_on_either_path(monkeypatch):
    """The C++ allocation of a GEMM pair (CUDA's batched call; forced here on
    the CPU, where its matmuls write into the views): both results in one
    block, the second at the next 256-byte boundary; the values right."""
    monkeypatch.setenv("OPFUSE_GEMM_CPP_LAUNCH", "1")
    args = llama_args("cpu", m=3, k=8, h=13)  # 3 x 13 floats: 156 bytes, so the second starts at 256
    f, part, part_args = partition(llama, args)
    tensors = [part_args[i] for i in part.tensor_positions]
    first, second = _gemm_outputs(part, tensors)
    part.paired = [(first, second)]
    part._by_layout.clear()
    part.use_gemm_cpp(True)
    torch.testing.assert_close(part(*part_args), llama(*args))
    lay = part.layout_of(tensors)
    for bufs in (lay.prepared.call(tensors), part._written_buffers(lay)):
        a, b = bufs[first], bufs[second]
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        per = math.ceil(a.numel() * a.element_size() / 256) * 256
        assert b.data_ptr() - a.data_ptr() == per and a.is_contiguous() and b.is_contiguous()
        assert a.shape == b.shape == tuple(part.compiled.buffer_shape(part.n_inputs + first, part.compiled.bind(
            [list(t.shape) for t in tensors])))
    part.use_gemm_cpp(False)
    torch.testing.assert_close(part(*part_args), llama(*args))


def test_gemm_unsupported_reaches_the_fallback(monkeypatch):
    """GemmUnsupported from a run (cuBLASLt's refusal on CUDA; raised here by
    the CPU's GEMM callback) forgets the layout and runs the call through
    _gemm_fallback, as Python's path did; later calls prepare it again."""
    monkeypatch.setenv("OPFUSE_GEMM_CPP_LAUNCH", "1")
    args = mlp_args("cpu")
    f, part, part_args = partition(mlp, args)
    refused, fallbacks = [], []
    original, fallback = runtime._cpu_gemm, runtime.FusedPartition._gemm_fallback

    def refuse(spec, everything):
        if not refused:
            refused.append(spec["name"])
            raise _C.GemmUnsupported("not this one")
        return original(spec, everything)

    def spy(self, key, a, reason):
        fallbacks.append((key, reason))
        return fallback(self, key, a, reason)

    monkeypatch.setattr(runtime, "_cpu_gemm", refuse)
    monkeypatch.setattr(runtime.FusedPartition, "_gemm_fallback", spy)
    tensors = [part_args[i] for i in part.tensor_positions]
    key = runtime._layout_key(tensors, False)
    torch.testing.assert_close(part(*part_args), mlp(*args))  # eager's (the CPU's fallback)
    assert fallbacks == [(key, "not this one")]
    assert part.recent == [] and key not in part._by_layout
    torch.testing.assert_close(part(*part_args), mlp(*args))
    assert len(fallbacks) == 1 and len(part.recent) == 1


def test_launcher_checks_alignment_on_the_pointers():
    """push's align: a layout whose check accepts runs only for inputs at
    the same addresses modulo 16 (cuBLASLt's layouts depend on them)."""
    from test_launch_path import ADD, _Counting

    g = _C.CompiledGraph(ADD)
    lau = _Counting(g)
    base = torch.randn(40)
    x, y = base[:8], torch.randn(8)
    lau.push(lambda *a: True, lau.prepared_for([x, y]), [x.data_ptr() % 16, y.data_ptr() % 16])
    torch.testing.assert_close(lau(x, y), x + y)
    assert lau.misses == 0
    x1 = base[1:9]  # 4 bytes further: another residue
    torch.testing.assert_close(lau(x1, y), x1 + y)
    assert lau.misses == 1
    x4 = base[4:12]  # 16 bytes further: the same residue
    torch.testing.assert_close(lau(x4, y), x4 + y)
    assert lau.misses == 1
    with pytest.raises(ValueError, match="one alignment per input"):
        lau.push(lambda *a: True, lau.prepared_for([x, y]), [0])
    with pytest.raises(ValueError, match="modulo 16"):
        lau.push(lambda *a: True, lau.prepared_for([x, y]), [0, 16])


def test_library_calls_need_their_arguments():
    args = mlp_args("cpu")
    f, part, part_args = partition(mlp, args)
    tensors = [part_args[i] for i in part.tensor_positions]
    lay = part.layout_of(tensors)
    syms = part.compiled.bind([list(t.shape) for t in tensors])
    bare = _C.PreparedRun(part.compiled, lay.prepared.variant, syms, [list(t.stride()) for t in tensors], -1,
                          part._empty, lay.out_specs)
    with pytest.raises(RuntimeError, match="cpu_gemm"):
        bare.call(tensors)
    with pytest.raises(ValueError, match="cpu_gemm"):
        part.push(lambda *a: True, bare)
    with pytest.raises(ValueError, match="two written buffers"):
        bare.set_library([(0, 0, ((4,), (1,), torch.float32), ((2,), (1,), 0), ((2,), (1,), 2))])
    with pytest.raises(ValueError, match="come together"):
        _C.Launcher(False, None, None, None, lambda d, s: None)
    with pytest.raises(ValueError, match="workspaces"):
        _C.Launcher(True, None, lambda: 0, lambda d: 0).push(lambda *a: True, lay.prepared)


def test_gemm_step_rows_call_what_the_partition_does(device):
    """The launch bench's rows for a partition with GEMM steps: the check
    accepts, "run" writes the result, both partition rows return it."""
    from opfuse.bench import launch_gemm

    dev = torch.device(device)
    fn, args = launch_gemm.gemm_graphs(dev, quick=True)["mlp-16x256x1024" if dev.type == "cuda" else "mlp-16x32x64"]
    torch._dynamo.reset()
    f, part, part_args = partition(fn, args)
    steps = launch_gemm.gemm_step_calls(part, part_args, dev)
    assert steps["layout check"]() is True
    tol = dict(rtol=2e-2, atol=2e-2) if args[0].dtype == torch.bfloat16 else {}
    expected = fn(*args)
    torch.testing.assert_close(steps["partition python"](), expected, **tol)
    torch.testing.assert_close(steps["partition c++"](), expected, **tol)
    bufs = steps["run"]()
    lay = part.layout_of([part_args[i] for i in part.tensor_positions])
    b, view = lay.outs[0]
    out = bufs[b - part.n_inputs]
    torch.testing.assert_close(out if view is None else out.view(view), expected, **tol)
