"""Programmatic dependent launch of the generated kernels (sm_90, on by
default since session 15; OPFUSE_PDL=0 turns it off): every generated kernel
begins with griddepcontrol.wait (opf_grid_dependency_wait) and lets its
dependents start (opf_launch_dependents), and the C++ launcher gives those
kernels, and only those, the programmatic serialization attribute. Without
a GPU: the source and an NVRTC compile; on a GPU (marked gpu): the same bits
as with OPFUSE_PDL=0 in a graph of several dependent kernels."""
import os
import re
import sys

import pytest
import torch

import opfuse
from opfuse import _C

from conftest import nvrtc_or_skip

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import row_source  # noqa: E402


def _source(op, rows, cols, arch):
    ir = row_source.forward_ir(op, rows, cols)
    shapes = [[rows, cols]] + [[cols]] * {"layer_norm": 2}.get(op, 0)
    cg = _C.CompiledGraph(ir, target="cuda")
    st = row_source.strides(shapes)
    return cg.cuda_source(shapes, st, arch), cg.compile_cuda(shapes, st, arch, False)[2]


def _kernel_bodies(src):
    """The first statement after each generated kernel's argument binding."""
    names = re.findall(r'__global__ void .*?(opfuse_k\w+)\(const ', src)
    return names, [src.split(f" {n}(const", 1)[1] for n in names]


@pytest.mark.parametrize("op,rows,cols", [("softmax", 32768, 4096), ("layer_norm", 4096, 262144), ("softmax", 262144, 256)])
def test_every_kernel_waits_first_by_default(op, rows, cols, monkeypatch):
    nvrtc_or_skip()
    monkeypatch.setenv("OPFUSE_PDL", "0")
    src, _ = _source(op, rows, cols, 90)
    assert "opf_grid_dependency_wait();" not in src  # off with the knob
    monkeypatch.delenv("OPFUSE_PDL")
    src, log = _source(op, rows, cols, 90)
    names, bodies = _kernel_bodies(src)
    assert names
    for n, body in zip(names, bodies):
        first = [ln.strip() for ln in body.split("\n")[1:3]]
        assert first == ["opf_grid_dependency_wait();", "opf_launch_dependents();"], (n, body[:300])
    assert "0 bytes spill stores" in log and not re.search(r"[1-9]\d* bytes spill stores", log), log[-1500:]
    src80, _ = _source(op, rows, cols, 80)  # griddepcontrol is sm_90's
    assert "opf_grid_dependency_wait();" not in src80


@pytest.mark.gpu
def test_dependent_kernels_give_the_same_bits(monkeypatch):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs an sm_90 GPU")
    torch.manual_seed(0)
    x = torch.randn(4099, 1531, device="cuda")

    def fn(x):
        s = torch.softmax(x, -1)
        return s - s.mean(0)  # a row kernel, then a column sum and the subtraction that wait for it

    monkeypatch.setenv("OPFUSE_PDL", "0")
    plain = torch.compile(fn, backend="opfuse")(x)
    monkeypatch.delenv("OPFUSE_PDL")
    torch._dynamo.reset()
    f = torch.compile(fn, backend="opfuse")
    f(x)
    opfuse.reset_stats()
    for _ in range(5):
        got = f(x)
        assert torch.equal(got, plain)
    assert opfuse.stats()["kernel_launches"] >= 10  # at least two dependent kernels a call
