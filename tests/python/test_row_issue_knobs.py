"""The OPFUSE_ROW_ISSUE knobs (branch lnbwd-4, on by default since session
9's H200 run: fewer instructions a row in row kernels; see
cuda_row_schedule.cpp, row_issue):
each knob changes the source the way it says, and with each on (and all
four) the row kernels compile with NVRTC for sm_80 and sm_90 without
spills. Their results against float64 are GPU tests
(test_cuda_row_schedules.py, test_row_issue_knobs_keep_results)."""
import os
import sys

import numpy as np
import pytest

from opfuse import _C
from opfuse.testing import contiguous_strides, ptxas_report
from test_column_partials import layer_norm_backward_ir, nvrtc_or_skip

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from row_source import softmax_backward_ir  # noqa: E402

KNOBS = ["OPFUSE_ROW_INDEX32", "OPFUSE_ROW_EXACT_COLS", "OPFUSE_ROW_RAW_LANES", "OPFUSE_ROW_SUM2_CONST", "OPFUSE_ROW_ISSUE"]


def layer_norm_ir(rows, cols, dt="bf16"):
    return f"""graph {{
  %0 = input() {{name="x"}} : {dt}[{rows}, {cols}]
  %1 = input() {{name="w"}} : {dt}[{cols}]
  %2 = input() {{name="b"}} : {dt}[{cols}]
  %3 = layer_norm(%0, %1, %2) {{normalized_ndim=1, eps=1e-5}} : {dt}[{rows}, {cols}]
  return (%3)
}}"""


def _case(kind, lead, cols, dt):
    lead = list(lead)
    rows = int(np.prod(lead))
    if kind == "lnb":
        return layer_norm_backward_ir(rows, cols, dt=dt, lead=lead), [lead + [cols], lead + [cols], lead + [1], lead + [1], [cols]]
    if kind == "smb":
        return softmax_backward_ir(rows, cols, dt), [[rows, cols], [rows, cols]]
    return layer_norm_ir(rows, cols, dt), [[rows, cols], [cols], [cols]]


def _source(kind, lead, cols, dt, arch):
    ir, shapes = _case(kind, lead, cols, dt)
    cg = _C.CompiledGraph(ir, target="cuda")
    return cg, shapes, cg.cuda_source(shapes, contiguous_strides(shapes), arch)


def _dx_vector_kernel(src):
    i = src.rindex("extern", 0, src.index("column_partials_v8("))
    return src[i:].split("\n}\n")[0]


def test_each_knob_changes_the_dx_kernel_as_it_says(monkeypatch):
    for k in KNOBS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OPFUSE_ROW_ISSUE", "0")
    _, _, base = _source("lnb", [32768], 4096, "bf16", 90)
    v = _dx_vector_kernel(base)
    assert "int64_t row_" in v and "if (c_ < cols)" in v and "opf_vload<8>" in v and "opf_block_sum2(" in v
    assert "__launch_bounds__(512, 1)" in v
    expect = {
        # int indices; the output's offset (fixed strides, 2^27 elements) as an int; two blocks an SM asked for
        "OPFUSE_ROW_INDEX32": lambda v: "for (int row_ = blockIdx.x;" in v and "const int c_ =" in v and
        "b5 + (int)(" in v and "__launch_bounds__(512, 2)" in v and "(uint32_t)x0 * st0_0" in v,
        "OPFUSE_ROW_EXACT_COLS": lambda v: "if (c_ < cols)" not in v,
        "OPFUSE_ROW_RAW_LANES": lambda v: "const opf_vec<16> rl0 = " in v and "opf_raw_lane<opf_bf16>(rl0, j_)" in v and
        "opf_vload<8>" not in v,
        "OPFUSE_ROW_SUM2_CONST": lambda v: "opf_block_sum2_w<16>(" in v,
    }
    for k, ok in expect.items():
        monkeypatch.setenv(k, "1")
        _, _, src = _source("lnb", [32768], 4096, "bf16", 90)
        assert ok(_dx_vector_kernel(src)), (k, _dx_vector_kernel(src)[:3000])
        monkeypatch.delenv(k)
    monkeypatch.delenv("OPFUSE_ROW_ISSUE")  # the defaults: all four
    _, _, src = _source("lnb", [32768], 4096, "bf16", 90)
    assert all(ok(_dx_vector_kernel(src)) for ok in expect.values())
    monkeypatch.setenv("OPFUSE_ROW_INDEX32", "0")  # each knob overrides the umbrella
    assert "int64_t row_" in _dx_vector_kernel(_source("lnb", [32768], 4096, "bf16", 90)[2])


def test_lane_groups_keep_plain_loads_unless_raw_lanes_is_forced(monkeypatch):
    """The raw lanes cost 4% in the lane-group kernel at 262144x256 on the
    H200 (session 9), so the defaults leave them out of lane groups only."""
    for k in KNOBS:
        monkeypatch.delenv(k, raising=False)
    v = _dx_vector_kernel(_source("lnb", [262144], 256, "bf16", 90)[2])
    assert "const opf_vec<16> rl" not in v and "opf_vload<8>(b4" in v and "int row_" in v  # (32-bit indices: on)
    monkeypatch.setenv("OPFUSE_ROW_RAW_LANES", "1")
    v = _dx_vector_kernel(_source("lnb", [262144], 256, "bf16", 90)[2])
    assert "const opf_vec<16> rl" in v and "opf_vload<8>(b4" not in v


def test_exact_cols_keeps_the_bounds_test_where_the_row_is_not_covered_exactly(monkeypatch):
    monkeypatch.setenv("OPFUSE_ROW_EXACT_COLS", "1")
    _, _, src = _source("lnb", [4099], 1000, "f16", 90)  # lane groups, 125 vectors over 32 lanes x 4
    assert "if (c_ < cols)" in _dx_vector_kernel(src)


def test_index32_keeps_64_bit_indices_past_2_to_30_rows(monkeypatch):
    monkeypatch.setenv("OPFUSE_ROW_INDEX32", "1")
    _, _, src = _source("smb", [(1 << 30) + 1], 8, "bf16", 90)
    assert "int row_" not in src.replace("int64_t row_", "")


CASES = [("lnb", (32768,), 4096, "bf16"), ("lnb", (262144,), 256, "bf16"), ("lnb", (8192,), 32768, "bf16"),
         ("lnb", (2048,), 1031, "bf16"), ("lnb", (3, 1401), 768, "f16"), ("lnb", (2111,), 4096, "f32"),
         ("lnb", (4099,), 5000, "bf16"), ("smb", (32768,), 4096, "bf16"), ("smb", (8192,), 32768, "bf16"),
         ("ln", (4096,), 262144, "bf16")]


def _spills(kind, lead, cols, dt, arch):
    """{kernel: spill-store bytes} from ptxas -v."""
    cg, shapes, _ = _source(kind, lead, cols, dt, arch)
    cubin, _, log = cg.compile_cuda(shapes, contiguous_strides(shapes), arch, False)
    assert len(cubin) > 0
    out = {k: spill for k, (_, spill) in ptxas_report(log).items()}
    assert out, log[-2000:]
    return out


_DEFAULT_SPILLS = {}


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("knob", KNOBS)
def test_issue_knobs_compile_without_spills(arch, knob, monkeypatch):
    """No spills with the knob where the kernels without the four have none
    (sm_80's 1024-thread loop kernel of 8192x32768 spills 4 bytes without
    them: no more with the knob). OPFUSE_ROW_ISSUE=1 is the defaults."""
    nvrtc_or_skip()
    for k in KNOBS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OPFUSE_ROW_ISSUE", "0")
    for case in CASES:
        if (case, arch) not in _DEFAULT_SPILLS:
            _DEFAULT_SPILLS[(case, arch)] = _spills(*case, arch)
    monkeypatch.setenv(knob, "1")
    for case in CASES:
        base, got = _DEFAULT_SPILLS[(case, arch)], _spills(*case, arch)
        assert got.keys() == base.keys(), (case, got, base)
        assert all(got[k] <= base[k] for k in got), (case, got, base)


def _butterfly(v, offsets):
    """Lane values after xor-shuffle add steps (float32, as the warp does)."""
    v = v.copy()
    for o in offsets:
        v = (v + v[np.arange(32) ^ o]).astype(np.float32)
    return v


@pytest.mark.parametrize("nw", [1, 4, 8, 16, 32])
def test_sum2_known_warps_gives_the_same_bits(nw):
    """opf_block_sum2_w's second tree (lane l takes warp l % NW's sum,
    log2(NW) steps) against opf_block_sum2's (lanes past NW hold +0, five
    steps), emulated in float32 on warp sums as the first tree leaves them
    (sums started from +0: never -0), with cancellations, huge and tiny values."""
    rng = np.random.default_rng(0)
    for trial in range(2000):
        scale = 10.0 ** rng.integers(-30, 30, size=nw)
        s = (rng.standard_normal(nw) * scale).astype(np.float32)
        if trial % 7 == 0:
            s[rng.integers(0, nw)] = 0.0
        if trial % 11 == 0 and nw > 1:
            s[1] = -s[0]
        s = (s + np.float32(0)).astype(np.float32)  # as a sum from +0 leaves it
        old = _butterfly(np.where(np.arange(32) < nw, s[np.arange(32) % nw], np.float32(0)).astype(np.float32),
                         [16, 8, 4, 2, 1])
        new = _butterfly(s[np.arange(32) % nw], [o for o in [16, 8, 4, 2, 1] if o < nw])
        assert old.tobytes() == new.tobytes(), (nw, s)
