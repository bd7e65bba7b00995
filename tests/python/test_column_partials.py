"""Column partials: a sum over leading dims that a row kernel over the same
rows computes as it reads them (split_column_sums.cpp). Checked without a
GPU: the op's reference semantics, the plan the CUDA target makes for a
layer_norm backward (dx, dweight and dbias in one pass over dy and x), that
the CPU target and small or symbolic shapes keep the plain sums, and that
the kernels compile for sm_80 and sm_90 without spills. The GPU tests
against float64 are in test_cuda_row_schedules.py."""
import re

import numpy as np
import pytest

from opfuse import _C
from opfuse.testing import contiguous_strides

from conftest import nvrtc_or_skip


def layer_norm_backward_ir(rows, cols, dt="bf16", lead=None):
    """dx, dweight, dbias of layer_norm as AOTAutograd's graph has them."""
    lead = lead or [rows]
    shape = ", ".join(str(d) for d in lead + [cols])
    stat = ", ".join(str(d) for d in lead + [1])
    dims = ", ".join(str(i) for i in range(len(lead)))
    return f"""graph {{
  %0 = input() {{name="dy"}} : {dt}[{shape}]
  %1 = input() {{name="x"}} : {dt}[{shape}]
  %2 = input() {{name="mean"}} : f32[{stat}]
  %3 = input() {{name="rstd"}} : f32[{stat}]
  %4 = input() {{name="w"}} : {dt}[{cols}]
  %5 = layer_norm_backward(%0, %1, %2, %3, %4) {{normalized_ndim=1}} : {dt}[{shape}]
  %6 = cast(%0) {{dtype=f32}} : f32[{shape}]
  %7 = cast(%1) {{dtype=f32}} : f32[{shape}]
  %8 = sub(%7, %2) : f32[{shape}]
  %9 = mul(%8, %3) : f32[{shape}]
  %10 = mul(%6, %9) : f32[{shape}]
  %11 = sum(%10) {{dims=[{dims}], keepdim=false}} : f32[{cols}]
  %12 = cast(%11) {{dtype={dt}}} : {dt}[{cols}]
  %13 = sum(%6) {{dims=[{dims}], keepdim=false}} : f32[{cols}]
  %14 = cast(%13) {{dtype={dt}}} : {dt}[{cols}]
  return (%5, %12, %14)
}}"""


def kernels_of(plan_text):
    return [line for line in plan_text.splitlines() if line.startswith("kernel ")]


def test_column_partials_reference_semantics():
    ir = """graph {
  %0 = input() {name="x"} : f32[5, 3, 4]
  %1 = column_partials(%0) {dims=[0, 1], parts=4} : f32[4, 4]
  return (%1)
}"""
    x = np.random.default_rng(0).standard_normal((5, 3, 4))
    ((_, out),) = _C.evaluate(ir, [x])
    rows = x.reshape(15, 4)
    want = np.stack([rows[p::4].sum(0) for p in range(4)])
    np.testing.assert_allclose(np.asarray(out).reshape(4, 4), want.astype(np.float32), rtol=1e-6)  # stored as float32


@pytest.mark.parametrize("bad,why", [("dims=[1], parts=4", "leading"), ("dims=[0], parts=0", "positive"),
                                     ("dims=[0, 1, 2], parts=4", "kept")])
def test_column_partials_rejects_bad_attributes(bad, why):
    ir = f"""graph {{
  %0 = input() {{name="x"}} : f32[5, 3, 4]
  %1 = column_partials(%0) {{{bad}}} : f32[4, 4]
  return (%1)
}}"""
    with pytest.raises(Exception, match=why):
        _C.verify(ir)


@pytest.mark.parametrize("lead,cols", [([32768], 4096), ([262144], 256), ([4, 1031], 1000)])
def test_cuda_plan_computes_weight_and_bias_gradients_beside_dx(lead, cols):
    rows = int(np.prod(lead))
    cg = _C.CompiledGraph(layer_norm_backward_ir(rows, cols, lead=lead), target="cuda")
    ks = kernels_of(cg.plan_text())
    # One pass over dy and x (dx and both partials), then two small column sums.
    assert len(ks) == 3, cg.plan_text()
    assert ks[0].split("stores=")[1].count("column_partials") == 2 and "reads=(%0:input,%1:input" in ks[0], ks[0]
    parts = min(8192 if cols <= 1024 else 1024, max(256, 1 << (rows // 8).bit_length() - 1))
    if 2048 < cols <= 4096:
        parts = 256  # one wave of two 512-thread blocks an SM (parts_for)
    elif cols <= 256 and rows >= 528 * 8:
        parts = 528  # one wave of four lane-group blocks an SM, each writing one part
    for k in ks[1:]:
        assert f"row [{parts}, {cols}] reduce=[0]" in k, k


def test_cpu_plan_and_small_or_unknown_shapes_keep_plain_sums():
    cpu = _C.CompiledGraph(layer_norm_backward_ir(32768, 4096), target="cpu")
    assert "column_partials" not in cpu.plan_text()
    small = _C.CompiledGraph(layer_norm_backward_ir(1000, 4096), target="cuda")
    assert "column_partials" not in small.plan_text()  # fewer than 2048 rows
    wide = _C.CompiledGraph(layer_norm_backward_ir(8192, 16384), target="cuda")
    assert "column_partials" not in wide.plan_text()  # partials would not fit in registers
    sym = layer_norm_backward_ir(1, 1).replace("[1, 1]", "[s0, s1]").replace("[1]", "[s1]")
    assert "column_partials" not in _C.CompiledGraph(sym, target="cuda").plan_text()


@pytest.mark.parametrize("lead", [[4099], [3, 1401]])
def test_keepdim_sums_split_too(lead):
    """rms_norm's weight gradient in AOTAutograd's graph: sum(keepdim=True)."""
    shape = ", ".join(str(d) for d in lead + [768])
    kept = ", ".join("1" for _ in lead) + ", 768"
    dims = ", ".join(str(i) for i in range(len(lead)))
    ir = f"""graph {{
  %0 = input() {{name="dy"}} : f32[{shape}]
  %1 = input() {{name="x"}} : f32[{shape}]
  %2 = mul(%0, %1) : f32[{shape}]
  %3 = sum(%2) {{dims=[{dims}], keepdim=true}} : f32[{kept}]
  %4 = sum(%2) {{dims=[{len(lead)}], keepdim=true}} : f32[{", ".join(str(d) for d in lead)}, 1]
  return (%3, %4)
}}"""
    cg = _C.CompiledGraph(ir, target="cuda")
    ks = kernels_of(cg.plan_text())
    assert len(ks) == 2 and "column_partials" in ks[0], cg.plan_text()
    assert list(cg.output_shape(0, [])) == [1] * len(lead) + [768]


def test_switch_turns_column_partials_off(monkeypatch):
    monkeypatch.setenv("OPFUSE_COLUMN_PARTIALS", "0")
    cg = _C.CompiledGraph(layer_norm_backward_ir(32768, 4096), target="cuda")
    assert "column_partials" not in cg.plan_text()


def test_split_graph_evaluates_like_the_original():
    """The CUDA plan's graph (partials, then a sum over them) against the
    original graph on the float64 oracle."""
    rows, cols = 2600, 24
    ir = layer_norm_backward_ir(rows, cols, dt="f32")
    cg = _C.CompiledGraph(ir, target="cuda")
    split = cg.graph_text()
    assert "column_partials" in split
    rng = np.random.default_rng(1)
    x = rng.standard_normal((rows, cols))
    mean = x.mean(1, keepdims=True)
    rstd = 1 / np.sqrt(x.var(1, keepdims=True) + 1e-5)
    args = [np.ascontiguousarray(a) for a in (rng.standard_normal((rows, cols)), x, mean, rstd, rng.standard_normal(cols))]
    want = _C.evaluate(ir, args)
    got = _C.evaluate(split, args)
    for (_, g), (_, w) in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("lead,cols", [([32768], 4096), ([262144], 256), ([2048], 1031), ([4, 1031], 1000),
                                       ([8192], 8192)])
def test_partials_kernels_compile_without_spills(arch, lead, cols):
    nvrtc_or_skip()
    rows = int(np.prod(lead))
    cg = _C.CompiledGraph(layer_norm_backward_ir(rows, cols, lead=lead), target="cuda")
    assert "column_partials" in cg.plan_text()
    shapes = [lead + [cols], lead + [cols], lead + [1], lead + [1], [cols]]
    src = cg.cuda_source(shapes, contiguous_strides(shapes), arch)
    assert "pp" in src and "real_" in src
    cubin, _, log = cg.compile_cuda(shapes, contiguous_strides(shapes), arch, False)
    assert len(cubin) > 0
    spills = re.findall(r"(\d+) bytes spill stores", log)
    assert spills and all(int(s) == 0 for s in spills), log[-3000:]


@pytest.mark.parametrize("lead,cols", [([8192], 32768), ([2111], 20000), ([2049], 8193), ([3, 701], 9000)])
def test_wide_rows_split_into_cluster_kernels(lead, cols, monkeypatch):
    """OPFUSE_COLUMN_PARTIALS_WIDE=1: rows of 8193 to 32768 elements split
    into 64 parts; the row kernel is a cluster of 512-thread blocks per row
    (sm_90), no spills; sm_80 (no clusters) refuses it."""
    nvrtc_or_skip()
    monkeypatch.setenv("OPFUSE_COLUMN_PARTIALS_WIDE", "1")
    rows = int(np.prod(lead))
    cg = _C.CompiledGraph(layer_norm_backward_ir(rows, cols, lead=lead), target="cuda")
    ks = kernels_of(cg.plan_text())
    assert len(ks) == 3 and ks[0].split("stores=")[1].count("column_partials") == 2, cg.plan_text()
    assert f"row [64, {cols}] reduce=[0]" in ks[1], ks[1]
    shapes = [lead + [cols], lead + [cols], lead + [1], lead + [1], [cols]]
    src = cg.cuda_source(shapes, contiguous_strides(shapes), 90)
    assert "__cluster_dims__(" + str(-(-cols // 4096)) + ", 1, 1)" in src and "par_" in src
    _, _, log = cg.compile_cuda(shapes, contiguous_strides(shapes), 90, False)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    assert spills and all(int(s) == 0 for s in spills), log[-3000:]
    with pytest.raises(Exception, match="sm_90"):
        cg.cuda_source(shapes, contiguous_strides(shapes), 80)
    monkeypatch.delenv("OPFUSE_COLUMN_PARTIALS_WIDE")
    assert "column_partials" not in _C.CompiledGraph(layer_norm_backward_ir(rows, cols, lead=lead), target="cuda").plan_text()


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("knobs", [{"OPFUSE_ROW_PREFETCH": "1"},
                                   {"OPFUSE_ROW_PARTIAL_VALUES": "8", "OPFUSE_ROW_PREFETCH": "1"}])
def test_row_knobs_compile_without_spills(arch, knobs, monkeypatch):
    """The L2 prefetch (the next row's columns, pf_ok_) and the partial-value
    cap keep the partials kernels free of spills."""
    nvrtc_or_skip()
    for n, v in knobs.items():
        monkeypatch.setenv(n, v)
    for lead, cols in [([32768], 4096), ([262144], 256), ([3, 1401], 768)]:
        rows = int(np.prod(lead))
        cg = _C.CompiledGraph(layer_norm_backward_ir(rows, cols, lead=lead), target="cuda")
        shapes = [lead + [cols], lead + [cols], lead + [1], lead + [1], [cols]]
        src = cg.cuda_source(shapes, contiguous_strides(shapes), arch)
        assert "opf_prefetch_l2(b" in src and "pf_ok_" in src
        _, _, log = cg.compile_cuda(shapes, contiguous_strides(shapes), arch, False)
        spills = re.findall(r"(\d+) bytes spill stores", log)
        assert spills and all(int(s) == 0 for s in spills), (lead, cols, log[-3000:])


# OPFUSE_ROW_LEAN=1 (rows-bwd-2): the pair reduction (opf_block_sum2),
# partials in shared memory (opf_pps, where they fit in 40 KB), the raw
# 16-bit cache (rr<slot>) and, on sm_90 where all apply, 3 blocks of 512 or
# 4 of 256 an SM: no spills on either arch. 768 (f16: 48 KB) and 5000 (64
# KB, rows not cached) keep register partials; float32 has no raw cache
# (bound unchanged).
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("lead,cols,dt,smem,bound", [([32768], 4096, "bf16", True, "512, 3"),
                                                     ([262144], 256, "bf16", True, "256, 4"),
                                                     ([2048], 1032, "bf16", True, "256, 4"),
                                                     ([3, 1401], 768, "f16", False, "256, 1"),
                                                     ([4099], 5000, "bf16", False, "512, 1"),
                                                     ([32768], 4096, "f32", True, "512, 1")])
def test_lean_row_knobs_compile_without_spills(arch, lead, cols, dt, smem, bound, monkeypatch):
    nvrtc_or_skip()
    monkeypatch.setenv("OPFUSE_ROW_LEAN", "1")
    monkeypatch.setenv("OPFUSE_ROW_ISSUE", "0")  # the lean knobs' own text (the issue knobs: test_row_issue_knobs.py)
    rows = int(np.prod(lead))
    cg = _C.CompiledGraph(layer_norm_backward_ir(rows, cols, dt=dt, lead=lead), target="cuda")
    shapes = [lead + [cols], lead + [cols], lead + [1], lead + [1], [cols]]
    src = cg.cuda_source(shapes, contiguous_strides(shapes), arch)
    vec = src[src.index("column_partials_v"):].split("\n}\n")[0]
    assert ("opf_pps[" in vec) == smem
    if cols > 1024:  # a block per row: the two sums in one reduction
        assert "opf_block_sum2(" in vec
    if dt != "f32" and cols <= 4096:  # 16-bit loads cached raw, not as floats (5000: not cached, loop stages)
        assert "rr0[it_] = *reinterpret_cast<const opf_vec<16>*>" in vec and "float rc" not in vec
    want = bound if arch >= 90 else bound.split(",")[0] + ", 1"
    assert f"__launch_bounds__({want})" in vec, vec[:400]
    _, _, log = cg.compile_cuda(shapes, contiguous_strides(shapes), arch, False)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    assert spills and all(int(s) == 0 for s in spills), (lead, cols, log[-3000:])


@pytest.mark.parametrize("arch", [80, 90])
def test_lean_defaults_where_measured(arch, monkeypatch):
    """Defaults from the H200 run at 333d743: the pair reduction in a block
    per row with the row cached (32768x4096), not in loop stages (8192x32768,
    not split); the whole lean combination for lane groups on sm_90
    (262144x256: partials in shared memory, raw cache, 4 blocks of 256), not
    on sm_80 (its ptxas spilled); OPFUSE_ROW_LEAN=0 turns all of it off.
    (With the issue knobs off: they change the same text, and
    test_row_issue_knobs.py pins theirs.)"""
    nvrtc_or_skip()
    monkeypatch.setenv("OPFUSE_ROW_ISSUE", "0")

    def vec_kernel(rows, cols):
        cg = _C.CompiledGraph(layer_norm_backward_ir(rows, cols), target="cuda")
        shapes = [[rows, cols], [rows, cols], [rows, 1], [rows, 1], [cols]]
        src = cg.cuda_source(shapes, contiguous_strides(shapes), arch)
        return src[src.index("opfuse_k0_"):].split("\n}\n")[0] if "_v8" not in src else \
            src[src.index("_v8_args a) {") - 200:].split("\n}\n")[0]

    wide, short, loops = vec_kernel(32768, 4096), vec_kernel(262144, 256), vec_kernel(8192, 32768)
    assert "opf_block_sum2(a" in wide and "opf_pps[" not in wide and "__launch_bounds__(512, 1)" in wide
    assert "opf_block_sum2(a" not in loops
    assert ("opf_pps[" in short and "rr0[it_]" in short and "__launch_bounds__(256, 4)" in short) == (arch >= 90)
    monkeypatch.setenv("OPFUSE_ROW_LEAN", "0")
    wide, short = vec_kernel(32768, 4096), vec_kernel(262144, 256)
    assert "opf_block_sum2(a" not in wide and "opf_pps[" not in short and "rr0[" not in short
