"""CUDA code generation checked without a GPU: NVRTC compiles every kernel
the suite's graphs produce for sm_80 and sm_90; the PTX of the contiguous
float32 chain has 128-bit global loads; ptxas reports no spills for the
reduction kernels at the benchmarked shapes."""
import re

import pytest

from opfuse import _C
from opfuse.testing import contiguous_strides, ptxas_report

from conftest import nvrtc_or_skip


def chain_ir(dtype, n):
    return f"""graph {{
  %0 = input() {{name="x"}} : {dtype}[{n}]
  %1 = input() {{name="b1"}} : {dtype}[{n}]
  %2 = input() {{name="b2"}} : {dtype}[{n}]
  %3 = scalar() {{value=0.5, weak=true}} : f64[]
  %4 = add(%0, %1) : {dtype}[{n}]
  %5 = relu(%4) : {dtype}[{n}]
  %6 = mul(%5, %3) : {dtype}[{n}]
  %7 = add(%6, %2) : {dtype}[{n}]
  return (%7)
}}"""


def row_ir(op, dtype, rows, cols):
    extra = {"softmax": "{dim=-1}", "log_softmax": "{dim=-1}", "layer_norm": "{normalized_ndim=1, eps=0.00001}",
             "rms_norm": "{normalized_ndim=1, eps=0.000001}"}[op]
    return f"""graph {{
  %0 = input() {{name="x"}} : {dtype}[{rows}, {cols}]
  %1 = {op}(%0) {extra} : {dtype}[{rows}, {cols}]
  return (%1)
}}"""


def backward_ir(rows, cols):
    return f"""graph {{
  %0 = input() {{name="dy"}} : bf16[{rows}, {cols}]
  %1 = input() {{name="y"}} : bf16[{rows}, {cols}]
  %2 = input() {{name="x"}} : bf16[{rows}, {cols}]
  %3 = input() {{name="w"}} : bf16[{cols}]
  %4 = softmax_backward(%0, %1) {{dim=-1}} : bf16[{rows}, {cols}]
  %5 = layer_norm_stats(%2) {{normalized_ndim=1, eps=0.00001, which="mean"}} : f32[{rows}, 1]
  %6 = layer_norm_stats(%2) {{normalized_ndim=1, eps=0.00001, which="rstd"}} : f32[{rows}, 1]
  %7 = layer_norm_backward(%0, %2, %5, %6, %3) {{normalized_ndim=1}} : bf16[{rows}, {cols}]
  return (%4, %7)
}}"""


def compile_for(ir, shapes, arch):
    cg = _C.CompiledGraph(ir, target="cuda")
    cubin, ptx, log = cg.compile_cuda(shapes, contiguous_strides(shapes), arch, True)
    assert len(cubin) > 0
    return ptx, log


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_chain_compiles_with_vector_loads(arch, dtype):
    nvrtc_or_skip()
    n = 4 * 1024 * 1024
    ptx, _ = compile_for(chain_ir(dtype, n), [[n]] * 3, arch)
    loads = set(re.findall(r"ld\.global(?:\.nc)?\.v4\.[a-z0-9]+", ptx))
    assert loads, "no 128-bit global loads in the chain's PTX"
    assert re.search(r"st\.global\.v4\.[a-z0-9]+", ptx) or re.search(r"st\.global\.v2\.[a-z0-9]+", ptx)


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("op", ["softmax", "log_softmax", "layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape", [(32768, 4096), (8192, 32768), (4096, 262144), (262144, 256)])
def test_row_kernels_compile_without_spills(arch, op, shape):
    nvrtc_or_skip()
    _, log = compile_for(row_ir(op, "bf16", *shape), [list(shape)], arch)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    assert spills and all(int(s) == 0 for s in spills), log[-2000:]


@pytest.mark.parametrize("arch", [80, 90])
def test_backward_kernels_compile_without_spills(arch):
    nvrtc_or_skip()
    _, log = compile_for(backward_ir(32768, 4096), [[32768, 4096]] * 3 + [[4096]], arch)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    assert spills and all(int(s) == 0 for s in spills), log[-2000:]


def test_strided_and_dynamic_graphs_compile():
    nvrtc_or_skip()
    ir = """graph {
  %0 = input() {name="x"} : f32[s0, s1]
  %1 = input() {name="b"} : f32[s1]
  %2 = add(%0, %1) : f32[s0, s1]
  %3 = permute(%2) {dims=[1, 0]} : f32[s1, s0]
  %4 = sum(%3) {dims=[1], keepdim=false} : f32[s1]
  %5 = argmax(%2) {dims=[0], keepdim=false} : i64[s1]
  %6 = var(%2) {dims=[1], keepdim=true, correction=1} : f32[s0, 1]
  return (%3, %4, %5, %6)
}"""
    cg = _C.CompiledGraph(ir, target="cuda")
    cubin, ptx, log = cg.compile_cuda([[7, 9], [9]], [[1, 7], [1]], 90, False)
    assert len(cubin) > 0


SIZE_SCALAR_IR = """graph {
  %0 = input() {name="dy"} : bf16[s0]
  %1 = unsqueeze(%0) {dim=-1} : bf16[s0, 1]
  %2 = expand(%1) {shape=<s0, s1>} : bf16[s0, s1]
  %3 = scalar() {size=<s1>, weak=true} : i64[]
  %4 = div(%2, %3) {rounding_mode="true"} : bf16[s0, s1]
  %5 = input() {name="m"} : b8[s1]
  %6 = full() {dtype=bf16, shape=<>, value=0.0} : bf16[]
  %7 = where(%5, %4, %6) : bf16[s0, s1]
  %8 = sum(%7) {dims=[0], keepdim=true} : bf16[1, s1]
  return (%7, %8)
}"""


@pytest.mark.parametrize("arch", [80, 90])
def test_size_scalars_compile_and_read_their_symbol(arch):
    # A SymInt used as a number (mean's backward: dy / s1) is a scalar the
    # kernel computes from its size arguments.
    nvrtc_or_skip()
    cg = _C.CompiledGraph(SIZE_SCALAR_IR, target="cuda")
    src = cg.cuda_source([[5], [5]], [[1], [1]], arch)
    assert re.search(r"= \(int64_t\)\(s1\);", src), src
    cubin, ptx, log = cg.compile_cuda([[5], [5]], [[1], [1]], arch, False)
    assert len(cubin) > 0


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("cols", [1, 7, 33, 256, 1000, 1025, 5000, 40000, 40001, 70000])
@pytest.mark.parametrize("max_cluster", ["1", "8"])
def test_row_schedules_compile(arch, cols, max_cluster, monkeypatch):
    """Every row schedule (lane groups, block per row, clusters on sm_90) for
    each row op compiles, with no spills on sm_90 (ptxas for sm_80 spills a
    few bytes in some short-row kernels at 48 registers: a heuristic of its
    own, not register pressure)."""
    nvrtc_or_skip()
    monkeypatch.setenv("OPFUSE_ROW_MAX_CLUSTER", max_cluster)
    for op in ["softmax", "log_softmax", "layer_norm", "rms_norm"]:
        for dtype in ["f32", "bf16"]:
            _, log = compile_for(row_ir(op, dtype, 5, cols), [[5, cols]], arch)
            spills = re.findall(r"(\d+) bytes spill stores", log)
            assert arch == 80 or all(int(s) == 0 for s in spills), log[-2000:]


def test_long_rows_use_a_cluster_on_sm90_only(monkeypatch):
    monkeypatch.setenv("OPFUSE_ROW_MAX_CLUSTER", "8")  # off by default (slower on the H200)
    shapes = [[4096, 262144]]
    cg = _C.CompiledGraph(row_ir("softmax", "bf16", 4096, 262144), target="cuda")
    assert "__cluster_dims__(8, 1, 1)" in cg.cuda_source(shapes, contiguous_strides(shapes), 90)
    assert "__cluster_dims__" not in cg.cuda_source(shapes, contiguous_strides(shapes), 80)


def vector_loads(kernel, pointer):
    """16-byte loads from `pointer` (a prefix: "" for any; "sr0 +" for the
    staged row in shared memory): into a lane array (opf_vload) or kept as
    the raw vector (OPFUSE_ROW_RAW_LANES)."""
    return kernel.count(f"opf_vload<8>({pointer}") + kernel.count(f"opf_vec<16>*>({pointer}")


def test_softmax_computes_one_exp_per_element():
    """The output stage reads exp(x - max) kept in registers by the sum stage
    instead of recomputing it (row_cache_plan.h)."""
    shapes = [[32768, 4096]]
    cg = _C.CompiledGraph(row_ir("softmax", "bf16", 32768, 4096), target="cuda")
    src = cg.cuda_source(shapes, contiguous_strides(shapes), 90)
    vector_kernel = src[src.index("_v8_args"):]
    # (opf_exp_fast: every output is bfloat16, see prelude_cuda.h)
    assert len(re.findall(r"opf_exp(_fast)?\(", vector_kernel)) == 1
    assert vector_loads(vector_kernel, "") == 1


@pytest.mark.parametrize("arch", [80, 90])
def test_column_reductions_compile_coalesced(arch):
    """An outer reduction puts lanes on the kept innermost axis (one warp
    reads 32 neighbouring elements), clusters split the reduced axis on sm_90."""
    nvrtc_or_skip()
    ir = """graph {
  %0 = input() {name="x"} : bf16[32768, 4096]
  %1 = cast(%0) {dtype=f32} : f32[32768, 4096]
  %2 = sum(%1) {dims=[0], keepdim=false} : f32[4096]
  %3 = amax(%1) {dims=[0], keepdim=false} : f32[4096]
  return (%2, %3)
}"""
    shapes = [[32768, 4096]]
    cg = _C.CompiledGraph(ir, target="cuda")
    src = cg.cuda_source(shapes, contiguous_strides(shapes), arch)
    assert "opf_column_reduce<opf_sum" in src and "(threadIdx.x & 31)" in src
    assert ("__cluster_dims__" in src) == (arch == 90)
    _, log = compile_for(ir, shapes, arch)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    assert all(int(s) == 0 for s in spills), log[-2000:]


def test_loop_stages_fuse_softmax_max_and_sum_into_one_online_pass(monkeypatch):
    """Rows too long for the register cache re-read memory each stage; the
    max and sum-of-exp stages become one pass with an online (max, sum) pair
    (where the row is not staged in shared memory: OPFUSE_ROW_SMEM_KB=0)."""
    monkeypatch.setenv("OPFUSE_ROW_SMEM_KB", "0")
    long_rows, short_rows = [[4096, 262144]], [[8192, 32768]]
    for op in ("softmax", "log_softmax"):
        cg = _C.CompiledGraph(row_ir(op, "bf16", *long_rows[0]), target="cuda")
        src = cg.cuda_source(long_rows, contiguous_strides(long_rows), 90)
        assert "opf_online_add<true>" in src and "opf_block_online<true>" in src
        cg = _C.CompiledGraph(row_ir(op, "f32", *long_rows[0]), target="cuda")
        assert "opf_online_add<false>" in cg.cuda_source(long_rows, contiguous_strides(long_rows), 90)  # expf for float32
        cg = _C.CompiledGraph(row_ir(op, "bf16", *short_rows[0]), target="cuda")
        # 64 KB rows: the later stages re-read them from L2, which was faster on the H200
        assert "opf_online_add<" not in cg.cuda_source(short_rows, contiguous_strides(short_rows), 90)


def _vector_kernel(src):
    return src[src.index("_v8_args"):] if "_v8_args" in src else src[src.index("_v4_args"):]


def test_long_rows_staged_in_shared_memory_read_each_element_once():
    """Rows past the register cache are copied once into shared memory
    (cp.async) and every stage reads them there: one block of 512 threads
    per 64 KB row, three an SM; 512 KB rows split over a cluster of 8 on
    sm_90, whose statistics combine through distributed shared memory; on
    sm_80 (no clusters) such rows keep the loop stages. (One exchange a
    row, rms_norm's one reduction and softmax's pair against each block's
    own max: eight blocks that are not a cluster, see
    test_group_exchange_by_default_for_one_reduction_over_clusters_of_8.)"""
    for op in ("softmax", "log_softmax", "layer_norm", "rms_norm"):
        shapes = [[8192, 32768]]
        cg = _C.CompiledGraph(row_ir(op, "bf16", 8192, 32768), target="cuda")
        for arch in (80, 90):
            v = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), arch))
            assert "opf_cp_async16(sr0" in v and vector_loads(v, "b0") == 0, v
            assert "__cluster_dims__" not in v
            stages = 2 if op == "rms_norm" else 3
            assert vector_loads(v, "sr0 +") == stages, v
            assert f"__launch_bounds__(512, {3 if arch == 90 else 2})" in v
        shapes = [[4096, 262144]]
        cg = _C.CompiledGraph(row_ir(op, "bf16", 4096, 262144), target="cuda")
        v = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
        assert "opf_cp_async16(sr0" in v and vector_loads(v, "b0") == 0
        if op == "rms_norm":  # one reduction a row: eight blocks exchanging through global memory
            assert "__cluster_dims__" not in v and "opf_group_reduce<opf_sum, 8, " in v and "opf_cluster" not in v
        elif op != "layer_norm":  # one exchange of the blocks' (max, sum) pairs
            assert "__cluster_dims__" not in v and "opf_group_local_online<" in v and "opf_cluster" not in v
        else:  # the ring's cluster reductions push into the peers' slots (OPFUSE_ROW_CLUSTER_PUSH)
            assert "__cluster_dims__(8, 1, 1)" in v and "opf_cluster_reduce_push<" in v and "opf_block_reduce<" not in v
        v = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 80))
        assert "opf_cp_async16(sr" not in v and vector_loads(v, "b0") > 0


def test_staging_knobs_and_limits(monkeypatch):
    """float32 rows of 32768 take a cluster of 2 (128 KB); OPFUSE_ROW_SMEM_KB=0
    turns staging off; rows that fit the register cache are not staged; the
    backward's two re-read tensors are staged only with OPFUSE_ROW_SMEM_TENSORS=2."""
    shapes = [[64, 32768]]
    cg = _C.CompiledGraph(row_ir("softmax", "f32", 64, 32768), target="cuda")
    v = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
    assert "__cluster_dims__(2, 1, 1)" in v and "opf_cp_async16(sr" in v
    monkeypatch.setenv("OPFUSE_ROW_SMEM_KB", "0")
    assert "opf_cp_async16(sr" not in cg.cuda_source(shapes, contiguous_strides(shapes), 90)
    monkeypatch.delenv("OPFUSE_ROW_SMEM_KB")
    shapes = [[64, 4096]]
    cg = _C.CompiledGraph(row_ir("softmax", "bf16", 64, 4096), target="cuda")
    assert "opf_cp_async16(sr" not in cg.cuda_source(shapes, contiguous_strides(shapes), 90)
    shapes = [[64, 32768]] * 3 + [[32768]]
    cg = _C.CompiledGraph(backward_ir(64, 32768), target="cuda")
    assert "opf_cp_async16(sr" not in cg.cuda_source(shapes, contiguous_strides(shapes), 90)


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("cols", [20000, 32768, 40000, 70000, 262144])
def test_staged_rows_compile_without_spills(arch, dtype, cols, monkeypatch):
    nvrtc_or_skip()
    for op in ["softmax", "log_softmax", "layer_norm", "rms_norm"]:
        _, log = compile_for(row_ir(op, dtype, 64, cols), [[64, cols]], arch)
        spills = re.findall(r"(\d+) bytes spill stores", log)
        assert spills and all(int(s) == 0 for s in spills), log[-2000:]


@pytest.mark.parametrize("ring", ["1", "2"])
@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("cols", [20000, 32768, 70000, 262144])
def test_staged_ring_compiles_without_spills(arch, dtype, cols, ring, monkeypatch):
    """OPFUSE_ROW_STAGE_RING=1 (two slots a staged buffer, persistent row
    groups, 1024 threads) and =2 (one slot refilled in place, 512 threads):
    every row op compiles with no spills."""
    nvrtc_or_skip()
    monkeypatch.setenv("OPFUSE_ROW_STAGE_RING", ring)
    for op in ["softmax", "log_softmax", "layer_norm", "rms_norm"]:
        _, log = compile_for(row_ir(op, dtype, 64, cols), [[64, cols]], arch)
        spills = re.findall(r"(\d+) bytes spill stores", log)
        assert spills and all(int(s) == 0 for s in spills), log[-2000:]


def test_staged_ring_copies_the_next_row_while_reducing_this_one(monkeypatch):
    """The ring on sm_90: the first row's copies before the row loop, the
    next row's into the other slot at the top of each iteration, a wait for
    all but the newest copy group, the stages reading this row's slot, the
    cluster reductions' slots alternating by row parity; one 1024-thread
    block an SM. A block per row at 32768 (no cluster), a cluster of 8 at
    262144 (the cluster's reductions: OPFUSE_ROW_GROUP_EXCHANGE=0). sm_80
    has no ring (the knob changes nothing there)."""
    monkeypatch.setenv("OPFUSE_ROW_GROUP_EXCHANGE", "0")
    for rows, cols, cluster in ((8192, 32768, 1), (4096, 262144, 8)):
        shapes = [[rows, cols]]
        cg = _C.CompiledGraph(row_ir("softmax", "bf16", rows, cols), target="cuda")
        off = cg.cuda_source(shapes, contiguous_strides(shapes), 90)
        off80 = cg.cuda_source(shapes, contiguous_strides(shapes), 80)
        monkeypatch.setenv("OPFUSE_ROW_STAGE_RING", "1")
        v = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
        assert cg.cuda_source(shapes, contiguous_strides(shapes), 80) == off80
        monkeypatch.delenv("OPFUSE_ROW_STAGE_RING")
        assert v != _vector_kernel(off)
        chunk = cols // cluster
        assert "__launch_bounds__(1024, 1)" in v
        assert ("__cluster_dims__(8, 1, 1)" in v) == (cluster == 8)
        loop = v.index(f" row_ = blockIdx.x / {cluster}; row_ < rows; row_ += gridDim.x / {cluster}, par_ ^= 1")
        assert v.index(f"opf_cp_async16(sr0_ring_ + 0 * {chunk} +") < loop
        assert v.index(f"opf_cp_async16(sr0_ring_ + (par_ ^ 1) * {chunk} +") > loop
        nxt = v.index("opf_cp_async_wait_prior();")
        assert v.index(f"opf_bf16* const sr0 = sr0_ring_ + par_ * {chunk};") > nxt
        assert vector_loads(v, "sr0 +") == 3 and vector_loads(v, "b0") == 0 and "opf_cp_async_wait_all" not in v
        if cluster > 1:  # the mbarriers of the pushed reductions alternate by row parity
            assert "&opf_xbar[0 + par_]" in v and "&opf_xbar[2 + par_]" in v and "opf_cluster_arrive" not in v


@pytest.mark.parametrize("ring", ["default", "0"], ids=["ring", "cluster_a_row"])
def test_cluster_push_reductions_replace_the_cluster_barriers(ring, monkeypatch):
    """OPFUSE_ROW_CLUSTER_PUSH (sm_90, rows staged over a cluster; default
    in the ring, opt-in for a cluster a row): every cluster reduction pushes
    its partial into the peers' slots (st.async, completing on their
    mbarriers) and waits on its own mbarrier, so no barrier.cluster is left
    between the mbarriers' set-up and the kernel's last barrier. In the
    ring slots and mbarriers alternate by row parity and the phase is the
    parity's use count; a cluster a row (OPFUSE_ROW_STAGE_RING=0) uses each
    once. No spills; sm_80 unchanged by the knob; 0 gives barrier.cluster."""
    nvrtc_or_skip()
    monkeypatch.setenv("OPFUSE_ROW_GROUP_EXCHANGE", "0")  # the cluster's reductions, rms_norm's too
    if ring != "default":
        monkeypatch.setenv("OPFUSE_ROW_STAGE_RING", ring)
    in_ring = ring == "default"
    for op in ("softmax", "log_softmax", "layer_norm", "rms_norm"):
        for dtype in ("bf16", "f16"):
            shapes = [[4096, 262144]]
            cg = _C.CompiledGraph(row_ir(op, dtype, 4096, 262144), target="cuda")
            default = cg.cuda_source(shapes, contiguous_strides(shapes), 90)
            default80 = cg.cuda_source(shapes, contiguous_strides(shapes), 80)
            monkeypatch.setenv("OPFUSE_ROW_CLUSTER_PUSH", "0")
            off = cg.cuda_source(shapes, contiguous_strides(shapes), 90)
            assert cg.cuda_source(shapes, contiguous_strides(shapes), 80) == default80
            monkeypatch.setenv("OPFUSE_ROW_CLUSTER_PUSH", "1")
            on = cg.cuda_source(shapes, contiguous_strides(shapes), 90)
            assert cg.cuda_source(shapes, contiguous_strides(shapes), 80) == default80
            _, log = compile_for(row_ir(op, dtype, 4096, 262144), shapes, 90)
            monkeypatch.delenv("OPFUSE_ROW_CLUSTER_PUSH")
            assert default == (on if in_ring else off) and on != off
            v, v_off = _vector_kernel(on), _vector_kernel(off)
            n = v_off.count("opf_cluster_reduce<")
            assert n >= 1 and "opf_cluster_reduce<" not in v and v.count("opf_cluster_reduce_push<") == n
            assert "opf_xbar" not in v_off and "opf_cluster_reduce_push<" not in v_off
            for k in range(n):
                slot = f"{2 * k} + par_" if in_ring else f"{k}"
                phase = "(unsigned)(xit_ >> 1) & 1u" if in_ring else "0u"
                assert f"opf_xslot[{slot}]), &opf_xbar[{slot}], {phase});" in v
            slots = 2 * n if in_ring else n
            assert f"opf_xbar[{slots}];" in v and f"opf_xslot[{slots}][8];" in v
            init = v.index("opf_mbar_init_cluster(opf_xbar);")
            assert init < v.index("opf_cluster_reduce_push<")
            assert ("par_ ^= 1, ++xit_)" in v) == in_ring
            # Past the set-up, the kernel's only cluster barrier is its last statement.
            assert v.count("opf_cluster_sync();") == 1 and v.rstrip().endswith("opf_cluster_sync();\n}")
            assert "opf_cluster_arrive" not in v
            spills = re.findall(r"(\d+) bytes spill stores", log)
            assert spills and all(int(x) == 0 for x in spills), log[-2000:]


@pytest.mark.parametrize("cols", [262144, 70000, 32776])
def test_group_exchange_replaces_the_cluster(cols, monkeypatch):
    """OPFUSE_ROW_GROUP_EXCHANGE=1 (sm_90, the ring over several blocks a
    row): no cluster (no __cluster_dims__, no cluster rank, barrier or
    mbarrier); each of the ring's pushed reductions becomes one
    opf_group_reduce on the zeroed workspace the kernel argument's last
    member points to (a.gx), slots by (reduction, row parity) as before; a
    block's slice is blockIdx.x % group; the stage loops unroll by 4; no
    spills at any dtype; sm_80, =0 and rows that are not staged (float32 at
    262144) unchanged. (Two exchanges a row for softmax too:
    OPFUSE_ROW_GROUP_LOCAL=0; its default is one, see the local tests.)"""
    nvrtc_or_skip()
    monkeypatch.setenv("OPFUSE_ROW_GROUP_LOCAL", "0")
    for op in ("softmax", "log_softmax", "layer_norm", "rms_norm"):
        for dtype in ("bf16", "f16", "f32"):
            shapes = [[4096, cols]]
            cg = _C.CompiledGraph(row_ir(op, dtype, 4096, cols), target="cuda")
            monkeypatch.setenv("OPFUSE_ROW_GROUP_EXCHANGE", "0")
            off = cg.cuda_source(shapes, contiguous_strides(shapes), 90)
            off80 = cg.cuda_source(shapes, contiguous_strides(shapes), 80)
            monkeypatch.setenv("OPFUSE_ROW_GROUP_EXCHANGE", "1")
            on = cg.cuda_source(shapes, contiguous_strides(shapes), 90)
            assert cg.cuda_source(shapes, contiguous_strides(shapes), 80) == off80
            _, log = compile_for(row_ir(op, dtype, 4096, cols), shapes, 90)
            monkeypatch.delenv("OPFUSE_ROW_GROUP_EXCHANGE")
            v, d = _vector_kernel(on), _vector_kernel(off)
            n = d.count("opf_cluster_reduce_push<")
            if dtype == "f32" and cols == 262144:  # 1 MB rows: not staged (more than 8 blocks of 64 KB)
                assert n == 0 and on == off
                continue
            group = int(re.search(r"__cluster_dims__\((\d+), 1, 1\)", d).group(1))
            assert n >= 1 and group > 1
            assert "__cluster_dims__" not in v and "opf_cluster" not in v and "opf_xbar" not in v and "xit_" not in v
            assert "@GROUP" not in on and "__device__ unsigned" not in on and v.count("opf_group_reduce<") == n
            assert v.split("\n")[0].endswith("int64_t st[2]; unsigned long long* gx; };")
            for k in range(n):  # the workspace's one layout: 1024 groups' counters, then 256 slots a group
                assert f", {group}, 1024, 256>(" in v and f", a.gx, {2 * k} + par_);" in v
            assert f"(blockIdx.x % {group}) * " in v and "#pragma unroll 4" in v and "#pragma unroll 8" not in v
            spills = re.findall(r"(\d+) bytes spill stores", log)
            assert spills and all(int(x) == 0 for x in spills), (op, dtype, log[-2000:])


def test_group_exchange_one_exchange_a_row_with_online_and_moments(monkeypatch):
    """OPFUSE_ROW_GROUP_EXCHANGE=1 with OPFUSE_ROW_STAGE_ONLINE=1 and
    OPFUSE_ROW_STAGE_MOMENTS=1 (6-9% slower on the H200, session 30): softmax's and
    log_softmax's (max, sum) pair in one opf_group_online, layer_norm's
    (count, mean, m2) in one opf_group_moments over two slots a parity,
    rms_norm's one sum as before; no cluster, no spills. Unset, the
    default keeps the cluster with either knob set (their group versions
    are opt-in)."""
    nvrtc_or_skip()
    monkeypatch.setenv("OPFUSE_ROW_STAGE_ONLINE", "1")
    monkeypatch.setenv("OPFUSE_ROW_STAGE_MOMENTS", "1")
    calls = {"softmax": "opf_group_online<true, 8, 1024, 256>(a2, a7, opf_smem, a.gx, 0 + par_);",
             "log_softmax": "opf_group_online<true, 8, 1024, 256>(a2, a7, opf_smem, a.gx, 0 + par_);",
             "layer_norm": "opf_group_moments<8, 1024, 256>(wn_, a2, a7, opf_smem, a.gx, 0 + 2 * par_);",
             "rms_norm": "a3 = opf_group_reduce<opf_sum, 8, 1024, 256>(a3, opf_smem, a.gx, 0 + par_);"}
    for op, call in calls.items():
        shapes = [[4096, 262144]]
        cg = _C.CompiledGraph(row_ir(op, "bf16", 4096, 262144), target="cuda")
        default = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
        assert "__cluster_dims__(8, 1, 1)" in default  # with either knob set the default keeps every cluster
        monkeypatch.setenv("OPFUSE_ROW_GROUP_EXCHANGE", "1")
        v = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
        _, log = compile_for(row_ir(op, "bf16", 4096, 262144), shapes, 90)
        monkeypatch.delenv("OPFUSE_ROW_GROUP_EXCHANGE")
        assert v.count("opf_group_") == 1 and call in v and "opf_cluster" not in v and "__cluster_dims__" not in v
        spills = re.findall(r"(\d+) bytes spill stores", log)
        assert spills and all(int(x) == 0 for x in spills), (op, log[-2000:])


@pytest.mark.parametrize("cols", [262144, 65544, 131072])
def test_group_local_reference_one_exchange_a_row(cols, monkeypatch):
    """OPFUSE_ROW_GROUP_EXCHANGE=1 with OPFUSE_ROW_GROUP_LOCAL=1:
    softmax's and log_softmax's max and layer_norm's mean reduce across
    the block only (opf_block_reduce), the second loop runs against that
    block value (0 for a block whose max is -inf), and the one exchange
    (opf_group_local_online, opf_group_local_moments) comes before the
    loop that writes the output; =0 leaves two exchanges; unset (the
    default) is =1 for softmax and log_softmax and =0 for layer_norm;
    rms_norm is the same kernel in all three; no spills at any dtype."""
    nvrtc_or_skip()
    for dtype in ("bf16", "f16", "f32"):
        for op in ("softmax", "log_softmax", "layer_norm", "rms_norm"):
            shapes = [[401, cols]]
            ir = row_ir(op, dtype, 401, cols)
            cg = _C.CompiledGraph(ir, target="cuda")
            monkeypatch.setenv("OPFUSE_ROW_GROUP_EXCHANGE", "1")
            unset = cg.cuda_source(shapes, contiguous_strides(shapes), 90)
            monkeypatch.setenv("OPFUSE_ROW_GROUP_LOCAL", "0")
            off = cg.cuda_source(shapes, contiguous_strides(shapes), 90)
            monkeypatch.setenv("OPFUSE_ROW_GROUP_LOCAL", "1")
            v = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
            _, log = compile_for(ir, shapes, 90)
            monkeypatch.delenv("OPFUSE_ROW_GROUP_EXCHANGE")
            monkeypatch.delenv("OPFUSE_ROW_GROUP_LOCAL")
            if "opf_group_" not in _vector_kernel(off):  # float32 at 262144: 1 MB rows are not staged
                assert dtype == "f32" and cols == 262144 and _vector_kernel(off) == v == _vector_kernel(unset)
                continue
            if op in ("softmax", "log_softmax"):
                assert _vector_kernel(unset) == v and v != _vector_kernel(off), (op, dtype)
            else:
                assert unset == off, (op, dtype)
            if op == "rms_norm":
                assert v == _vector_kernel(off) and v.count("opf_group_reduce<") == 1
                continue
            call = "opf_group_local_moments<" if op == "layer_norm" else "opf_group_local_online<"
            block = "opf_block_reduce<opf_sum>(a" if op == "layer_norm" else "opf_block_reduce<opf_max>(a"
            assert v.count("opf_group_") == 1 and v.count(call) == 1 and "opf_cluster" not in v, (op, dtype)
            first, second, store = v.index(block), v.index("#pragma unroll 4", v.index(block)), v.index("opf_vstore")
            assert first < second < v.index(call) < store
            if op == "layer_norm":
                assert "/ (float)(cend_ - cbegin_) : 0.0f;" in v and "_n *= " not in v
            else:
                assert "== opf_lowest<float>() ? 0.0f : a" in v
            spills = re.findall(r"(\d+) bytes spill stores", log)
            assert spills and all(int(x) == 0 for x in spills), (op, dtype, log[-2000:])


@pytest.mark.parametrize("local", [None, "1", "0"], ids=["default", "local", "two"])
def test_group_exchange_by_default_for_one_reduction_over_clusters_of_8(local, monkeypatch):
    """The default (OPFUSE_ROW_GROUP_EXCHANGE unset): the ring's rows over
    clusters of 8 with one exchange across the row exchange through global
    memory: rms_norm, and softmax and log_softmax, whose max is the block's
    own before the one exchange (OPFUSE_ROW_GROUP_LOCAL unset). layer_norm
    (two exchanges unless OPFUSE_ROW_GROUP_LOCAL=1), every op with
    OPFUSE_ROW_GROUP_LOCAL=0 but rms_norm, and clusters of 2 and 4 keep the
    cluster's pushed reductions; OPFUSE_ROW_GROUP_EXCHANGE=0 keeps the
    cluster everywhere."""
    if local:
        monkeypatch.setenv("OPFUSE_ROW_GROUP_LOCAL", local)
    for dtype, cols in (("bf16", 262144), ("f16", 262144), ("f32", 131072), ("bf16", 70000), ("bf16", 32776)):
        for op in ("softmax", "log_softmax", "layer_norm", "rms_norm"):
            shapes = [[4096, cols]]
            cg = _C.CompiledGraph(row_ir(op, dtype, 4096, cols), target="cuda")
            v = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
            monkeypatch.setenv("OPFUSE_ROW_GROUP_EXCHANGE", "0")
            v0 = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
            monkeypatch.delenv("OPFUSE_ROW_GROUP_EXCHANGE")
            eight = "__cluster_dims__(8, 1, 1)" in v0
            assert eight == (cols >= 131072)
            one_exchange = op == "rms_norm" or local == "1" or (local is None and op != "layer_norm")
            grouped = eight and one_exchange
            assert (op == "rms_norm") == (v0.count("opf_cluster_reduce_push<") == 1)
            call = "opf_group_reduce<" if op == "rms_norm" else "opf_group_local_"
            assert (call in v) == grouped and (v == v0) == (not grouped), (dtype, cols, op)


def test_staged_rows_in_a_non_portable_cluster_of_16(monkeypatch):
    """OPFUSE_ROW_SMEM_KB=32 with OPFUSE_ROW_SMEM_CLUSTER=16 (an experiment):
    a 512 KB row in 16 slices of 32 KB, 256-thread blocks, six an SM, with
    the in-place ring; no spills. At most 8 by default (the portable size)."""
    nvrtc_or_skip()
    shapes = [[4096, 262144]]
    for op in ("softmax", "layer_norm"):
        cg = _C.CompiledGraph(row_ir(op, "bf16", 4096, 262144), target="cuda")
        monkeypatch.setenv("OPFUSE_ROW_SMEM_KB", "32")
        v = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
        # 32 KB slices need 16 blocks: without the cluster knob the row is not staged (loop stages).
        assert "opf_cp_async16(sr" not in v and "__cluster_dims__" not in v
        monkeypatch.setenv("OPFUSE_ROW_SMEM_CLUSTER", "16")
        v = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
        assert "__launch_bounds__(256, 6) __cluster_dims__(16, 1, 1)" in v and "opf_cluster_reduce_push<opf_sum, 16>" in v, v
        assert "opf_cp_async16(sr0_ring_ + 0 * 16384 +" in v
        for name, (regs, spill) in ptxas_report(cg.compile_cuda(shapes, contiguous_strides(shapes), 90, False)[2]).items():
            assert spill == 0, (op, name)
        monkeypatch.delenv("OPFUSE_ROW_SMEM_KB")
        monkeypatch.delenv("OPFUSE_ROW_SMEM_CLUSTER")


def softmax_backward_ir(rows, cols):
    return f"""graph {{
  %0 = input() {{name="dy"}} : bf16[{rows}, {cols}]
  %1 = input() {{name="y"}} : bf16[{rows}, {cols}]
  %2 = softmax_backward(%0, %1) {{dim=-1}} : bf16[{rows}, {cols}]
  return (%2)
}}"""


def test_softmax_backward_stages_both_tensors(monkeypatch):
    """Softmax backward re-reads dy and y: on sm_90 both staged, 64 KB a
    tensor: one 128 KB block a 32768-column row, eight at 262144 (not a
    cluster: its one reduction a row goes through global memory);
    on sm_80 only with OPFUSE_ROW_SMEM_TENSORS=2 (not measured there), and
    never on sm_86, whose blocks take at most 99 KB (the loop stages);
    OPFUSE_ROW_SMEM_TENSORS=1 gives the loop stages back. No spills."""
    nvrtc_or_skip()
    for rows, cols, arch, expect in ((8192, 32768, 90, "__launch_bounds__(512, 1) opfuse"),
                                     (8192, 32768, 80, "__launch_bounds__(512, 1) opfuse"),
                                     (4096, 262144, 90, "__launch_bounds__(512, 1) opfuse"),
                                     (8192, 32768, 86, None)):
        shapes = [[rows, cols], [rows, cols]]
        cg = _C.CompiledGraph(softmax_backward_ir(rows, cols), target="cuda")
        if arch < 90:
            assert "opf_cp_async16(sr" not in _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), arch))
            monkeypatch.setenv("OPFUSE_ROW_SMEM_TENSORS", "2")
        v = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), arch))
        if expect is None:
            assert "opf_cp_async16(sr" not in v, v
            monkeypatch.delenv("OPFUSE_ROW_SMEM_TENSORS")
            continue
        assert expect in v, v
        assert ("opf_group_reduce<opf_sum, 8, " in v) == (cols == 262144)
        assert "opf_cp_async16(sr0" in v and "opf_cp_async16(sr1" in v, v
        for name, (regs, spill) in ptxas_report(cg.compile_cuda(shapes, contiguous_strides(shapes), arch, False)[2]).items():
            assert spill == 0, (rows, cols, arch, name)
        monkeypatch.setenv("OPFUSE_ROW_SMEM_TENSORS", "1")
        assert "opf_cp_async16(sr" not in _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), arch))
        monkeypatch.delenv("OPFUSE_ROW_SMEM_TENSORS")


def test_staged_last_stage_alternates_by_row_parity(monkeypatch):
    """OPFUSE_ROW_ALTERNATE=1 (an experiment): the last stage of a staged row
    (a block a row) walks the thread's columns backwards on odd rows; the
    earlier stages keep the forward loop; rows split over a cluster are left
    as they are; no spills."""
    nvrtc_or_skip()
    for op in ("softmax", "layer_norm"):
        for rows, cols, applies in ((8192, 32768, True), (4096, 262144, False)):
            shapes = [[rows, cols]]
            cg = _C.CompiledGraph(row_ir(op, "bf16", rows, cols), target="cuda")
            plain = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
            assert "nk_" not in plain
            monkeypatch.setenv("OPFUSE_ROW_ALTERNATE", "1")
            v = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
            walk = "const int c_ = cbegin_ + (int)tid_ * 8 + ((row_ & 1) ? nk_ - 1 - k_ : k_) * 4096;"
            assert v.count(walk) == (1 if applies else 0), v
            if applies:
                # Only the last stage: the earlier ones still walk forwards.
                assert v.index(walk) > v.rindex("for (int c_ = cbegin_ + (int)tid_ * 8; c_ < cend_; c_ += 4096) {")
                for name, (regs, spill) in ptxas_report(cg.compile_cuda(shapes, contiguous_strides(shapes), 90, False)[2]).items():
                    assert spill == 0, (op, name)
            monkeypatch.delenv("OPFUSE_ROW_ALTERNATE")


def test_cluster_staged_loops_are_unrolled(monkeypatch):
    """Rows split over a cluster unroll their staged stage loops 8 times
    (layer_norm's weight and bias loads go out together; 9% faster at
    4096x262144 on the H200), a block per row keeps the plain loop, and
    OPFUSE_ROW_STAGE_UNROLL=0 turns it off; no spills either way. (Rows in
    groups unroll by 4: test_group_exchange_replaces_the_cluster; here the
    cluster's, OPFUSE_ROW_GROUP_EXCHANGE=0.)"""
    monkeypatch.setenv("OPFUSE_ROW_GROUP_EXCHANGE", "0")
    for op in ("softmax", "layer_norm"):
        for rows, cols, unrolled in ((8192, 32768, False), (4096, 262144, True)):
            shapes = [[rows, cols]]
            cg = _C.CompiledGraph(row_ir(op, "bf16", rows, cols), target="cuda")
            v = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
            # Three stages each (the first row's copy loop of the ring is not a stage).
            assert v.count("#pragma unroll 8\n    for (int c_ = cbegin_ + (int)tid_ * 8; c_ < cend_; c_ += 4096) {") == (3 if unrolled else 0), v
            monkeypatch.setenv("OPFUSE_ROW_STAGE_UNROLL", "0")
            assert "#pragma unroll 8\n" not in _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
            monkeypatch.delenv("OPFUSE_ROW_STAGE_UNROLL")
    nvrtc_or_skip()
    shapes = [[4096, 262144]]
    cg = _C.CompiledGraph(row_ir("layer_norm", "bf16", 4096, 262144), target="cuda")
    for name, (regs, spill) in ptxas_report(cg.compile_cuda(shapes, contiguous_strides(shapes), 90, False)[2]).items():
        assert spill == 0, name


def test_staged_layer_norm_moments_in_one_pass(monkeypatch):
    """OPFUSE_ROW_STAGE_MOMENTS=1: a staged layer_norm row (16-bit outputs)
    takes its mean and variance in one pass of shifted sums and one
    reduction of (count, mean, m2) across the block or the cluster (two
    8-byte slots by row parity in the in-place ring): two reads of the staged
    row, not three; float32 rows keep the two passes; no spills. Off by
    default."""
    nvrtc_or_skip()
    for rows, cols, cluster in ((8192, 32768, 1), (4096, 262144, 8)):
        shapes = [[rows, cols]]
        cg = _C.CompiledGraph(row_ir("layer_norm", "bf16", rows, cols), target="cuda")
        default = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
        assert "opf_shifted_moments(" not in default and vector_loads(default, "sr0 +") == 3
        monkeypatch.setenv("OPFUSE_ROW_STAGE_MOMENTS", "1")
        v = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
        assert vector_loads(v, "sr0 +") == 2 and v.count("opf_shifted_moments(wn_, wk_, a") == 1, v
        if cluster > 1:
            assert "opf_cluster_moments<8>(wn_, " in v and "&opf_cslot[0 + 2 * par_]" in v and "opf_cluster_reduce<" not in v
            assert "unsigned long long opf_cslot[4]" in v
        else:
            assert "opf_block_moments(wn_, " in v and "opf_block_reduce<" not in v
        for name, (regs, spill) in ptxas_report(cg.compile_cuda(shapes, contiguous_strides(shapes), 90, False)[2]).items():
            assert spill == 0, (rows, cols, name)
        cg32 = _C.CompiledGraph(row_ir("layer_norm", "f32", rows, cols), target="cuda")
        assert "opf_shifted_moments(wn_" not in cg32.cuda_source(shapes, contiguous_strides(shapes), 90)
        sm = _C.CompiledGraph(row_ir("softmax", "bf16", rows, cols), target="cuda")
        assert "opf_shifted_moments(wn_" not in sm.cuda_source(shapes, contiguous_strides(shapes), 90)
        monkeypatch.delenv("OPFUSE_ROW_STAGE_MOMENTS")


def test_staged_online_pass_takes_the_pair_a_vector_at_a_time(monkeypatch):
    """OPFUSE_ROW_STAGE_ONLINE=1: softmax and log_softmax rows staged in
    shared memory read it twice, not three times; the (max, sum) pair folds
    in once a 16-byte vector (opf_online_add_vec: fast exp for bf16, expf
    for float32), across the block (a block per row) or through
    distributed shared memory (a cluster, one 8-byte slot a block by row
    parity in the in-place ring); no spills. Off by default."""
    nvrtc_or_skip()
    for op in ("softmax", "log_softmax"):
        for rows, cols, cluster in ((8192, 32768, 1), (4096, 262144, 8)):
            shapes = [[rows, cols]]
            cg = _C.CompiledGraph(row_ir(op, "bf16", rows, cols), target="cuda")
            default = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
            assert "opf_online_add_vec" not in default and vector_loads(default, "sr0 +") == 3
            monkeypatch.setenv("OPFUSE_ROW_STAGE_ONLINE", "1")
            v = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
            assert vector_loads(v, "sr0 +") == 2 and v.count("opf_online_add_vec<true, 8>(a") == 1, v
            if cluster > 1:
                assert "opf_cluster_online<true, 8>(" in v and "&opf_cslot[0 + par_]" in v and "opf_cluster_reduce<" not in v
            else:
                assert "opf_block_online<true>(" in v and "opf_block_reduce<" not in v
            for name, (regs, spill) in ptxas_report(cg.compile_cuda(shapes, contiguous_strides(shapes), 90, False)[2]).items():
                assert spill == 0, (op, rows, cols, name)
            # float32: 128 KB rows staged over a cluster of 2 (expf, 4 lanes); 1 MB rows are not staged
            # and keep the loop stages' element-wise online pair.
            cg32 = _C.CompiledGraph(row_ir(op, "f32", rows, cols), target="cuda")
            v32 = _vector_kernel(cg32.cuda_source(shapes, contiguous_strides(shapes), 90))
            if cols == 32768:
                assert "opf_online_add_vec<false, 4>(a" in v32 and "__cluster_dims__(2, 1, 1)" in v32
            else:
                assert "opf_online_add<false>(a" in v32 and "opf_cp_async16" not in v32
            monkeypatch.delenv("OPFUSE_ROW_STAGE_ONLINE")


def test_staged_ring_in_place_refills_each_piece_after_its_store(monkeypatch):
    """OPFUSE_ROW_STAGE_RING=2 on sm_90 (the default for rows split over a
    cluster): one slot (64 KB a block, three
    512-thread blocks an SM, as without a ring), the first row's copies
    before the persistent row loop, a wait for the thread's own copies at
    the top of each iteration, and in the last stage's loop the next row's
    copy of each piece into the same place right after that piece's output
    is stored (and only there); the cluster slots alternate by row parity.
    Every op (layer_norm's and rms_norm's last stage reads the weight from
    global memory too). sm_80 has no ring."""
    for op in ("softmax", "log_softmax", "layer_norm", "rms_norm"):
        for rows, cols, cluster in ((8192, 32768, 1), (4096, 262144, 8)):
            shapes = [[rows, cols]]
            cg = _C.CompiledGraph(row_ir(op, "bf16", rows, cols), target="cuda")
            off80 = cg.cuda_source(shapes, contiguous_strides(shapes), 80)
            default = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
            monkeypatch.setenv("OPFUSE_ROW_STAGE_RING", "2")
            v = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
            assert cg.cuda_source(shapes, contiguous_strides(shapes), 80) == off80
            monkeypatch.delenv("OPFUSE_ROW_STAGE_RING")
            # The default where the row takes a cluster (measured faster), not a block per row.
            assert (default == v) == (cluster > 1)
            chunk = cols // cluster
            assert "__launch_bounds__(512, 3)" in v and "(par_ ^ 1)" not in v and "opf_cp_async_wait_prior" not in v
            loop = v.index(f"row_ < rows; row_ += gridDim.x / {cluster}, par_ ^= 1")
            assert v.index(f"opf_cp_async16(sr0_ring_ + 0 * {chunk} +") < loop
            top = v.index("opf_cp_async_wait_all();", loop)
            assert v.index("opf_bf16* const sr0 = sr0_ring_;") > top
            refill = "if (nr_ok_) opf_cp_async16(sr0 + (c_ - cbegin_), b0 + "
            assert v.count(refill) == 1
            last_store = v.rindex("opf_vstore_w<8>(b")
            assert max(v.rfind("opf_vload<8>(sr0 +"), v.rfind("opf_vec<16>*>(sr0 +")) < last_store < v.index(refill)
            assert v.index(refill) < v.index("}", v.index(refill))  # inside the last stage's loop
            if cluster > 1:  # one exchange a row (all but layer_norm): eight blocks exchanging through global memory
                assert ("&opf_xbar[0 + par_]" in v) == (op == "layer_norm") and "opf_cluster_arrive" not in v
                assert (", a.gx, 0 + par_);" in v) == (op != "layer_norm")


def _vector_ptx(ptx):
    """The PTX of the vector twin (the entry whose name ends in _v8 or _v4)."""
    m = re.search(r"\.entry (opfuse_\w+_v[48])\(", ptx)
    start = m.start()
    # Up to the next entry: inline asm blocks close with a "}" of their own at a line's start.
    end = ptx.find(".entry ", start + 1)
    return ptx[start:end if end > 0 else len(ptx)]


@pytest.mark.parametrize("shape", [(8192, 32768), (4096, 262144), (64, 70000)])
def test_vstore_words_keeps_128_bit_stores(shape, monkeypatch):
    """NVVM split opf_vstore's 16-byte stores into 4-byte st.global.v2.u16 in
    the unrolled output loops of log_softmax 8192x32768 and the cluster-staged
    rows of 4096x262144; opf_vstore_w (the default; OPFUSE_VSTORE_WORDS=0 is
    the old opf_vstore) keeps every vector store of 16-bit values one
    st.global.v4.b32."""
    nvrtc_or_skip()
    rows, cols = shape
    monkeypatch.setenv("OPFUSE_VSTORE_WORDS", "1")
    for op in ("softmax", "log_softmax", "layer_norm", "rms_norm"):
        ir = row_ir(op, "bf16", rows, cols)
        shapes = [[rows, cols]]
        cg = _C.CompiledGraph(ir, target="cuda")
        assert "opf_vstore_w<8>(" in _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
        ptx, _ = compile_for(ir, shapes, 90)
        v = _vector_ptx(ptx)
        assert "st.global.v4.b32" in v, (op, v[-3000:])
        assert not re.search(r"st\.global(\.v2)?\.(u16|u32|b16|b32)\s", v), (op, re.findall(r"st\.global\S*", v))


def test_cluster_early_arrive(monkeypatch):
    """By default (OPFUSE_ROW_CLUSTER_EARLY_ARRIVE=1) a row split over a cluster arrives at
    its exit barrier right after its last cluster reduction and waits at the
    end; as many arrives as waits (one per reduction and the exit). (A
    cluster with one row: without the in-place ring, the default there.)"""
    nvrtc_or_skip()
    monkeypatch.setenv("OPFUSE_ROW_CLUSTER_EARLY_ARRIVE", "1")
    monkeypatch.setenv("OPFUSE_ROW_STAGE_RING", "0")
    shapes = [[4096, 262144]]
    for op, reductions in (("softmax", 2), ("layer_norm", 2), ("rms_norm", 1)):
        ir = row_ir(op, "bf16", 4096, 262144)
        cg = _C.CompiledGraph(ir, target="cuda")
        v = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
        last = v.rindex("opf_cluster_reduce<")
        assert v.index("opf_cluster_arrive();") > last and v.count("opf_cluster_arrive();") == 1
        assert v.rstrip().endswith("opf_cluster_wait();\n}") and "opf_cluster_sync();" not in v
        ptx = _vector_ptx(compile_for(ir, shapes, 90)[0])
        assert ptx.count("barrier.cluster.arrive") == ptx.count("barrier.cluster.wait") == reductions + 1


@pytest.mark.parametrize("shape", [(8192, 32768), (4096, 262144), (32768, 4096)])
def test_store_round_once(shape, monkeypatch):
    """By default a row output cast to bf16 is converted once at the store
    (the cast's operand), not rounded to a bf16 float first and converted
    again (OPFUSE_ROW_STORE_ROUND_ONCE=0, as before); the staged, cluster and
    register-cached rows alike."""
    nvrtc_or_skip()
    rows, cols = shape
    shapes = [[rows, cols]]
    for op in ("softmax", "log_softmax", "layer_norm", "rms_norm"):
        cg = _C.CompiledGraph(row_ir(op, "bf16", rows, cols), target="cuda")
        monkeypatch.setenv("OPFUSE_ROW_STORE_ROUND_ONCE", "0")
        v = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
        assert re.search(r"lv\d+\[j_\] = opf_float_to_bf16\(v\d+\);", v)
        monkeypatch.delenv("OPFUSE_ROW_STORE_ROUND_ONCE")
        v = _vector_kernel(cg.cuda_source(shapes, contiguous_strides(shapes), 90))
        assert re.search(r"lv\d+\[j_\] = opf_float_to_bf16\(\(float\)\(v\d+\)\);", v), (op, v[-1500:])
        _, log = compile_for(row_ir(op, "bf16", rows, cols), shapes, 90)
        assert all(int(n) == 0 for n in re.findall(r"(\d+) bytes spill stores", log))


def _slice_ir(dtype, rows, cols, start, end, op):
    """x[:, start:end] through `op` (mul by 2, or softmax over the row)."""
    n = cols - start + (end if end < 0 else 0)
    body = (f"%2 = scalar() {{value=2.0, weak=true}} : i64[]\n  %3 = mul(%1, %2) : {dtype}[{rows}, {n}]" if op == "mul"
            else f"%2 = softmax(%1) {{dim=-1}} : {dtype}[{rows}, {n}]")
    end_attr = f"end={end}, " if end < 0 else ""
    return f"""graph {{
  %0 = input() {{name="x"}} : {dtype}[{rows}, {cols}]
  %1 = slice(%0) {{dim=1, {end_attr}start={start}, step=1}} : {dtype}[{rows}, {n}]
  {body}
  return (%{3 if op == "mul" else 2})
}}"""


@pytest.mark.parametrize("op", ["mul", "softmax"])
def test_vector_accesses_only_at_offsets_the_vector_divides(op):
    """A slice that starts inside a 16-byte vector (x[:, 1:-3] of 12
    floats, x[:, 2:-6] of 16-bit rows) is read element by element: as float4
    at xl_ + 1 it was a misaligned address on the GPU (the fused slices'
    test under dynamic shapes, session 33: the input was a strided buffer,
    whose sizes the run time does not check). A start the vector divides
    keeps the vector twin, reading at the shifted offset."""
    for dtype, cols, bad, good, vec in (("f32", 12, (1, -3), (4, -4), 4), ("bf16", 4096, (2, -6), (8, -8), 8),
                                        ("f32", 32768, (3, -1), (4, -4), 4)):
        if op == "mul" and cols > 4096:
            continue
        for (start, end), vectors in ((bad, False), (good, True)):
            ir = _slice_ir(dtype, 6, cols, start, end, op)
            shapes = [[6, cols]]
            cg = _C.CompiledGraph(ir, target="cuda")
            for strides in (contiguous_strides(shapes), [[cols + vec, 1]]):
                src = cg.cuda_source(shapes, strides, 90)
                assert (f"_v{vec}_args" in src) == vectors, (dtype, cols, start, end, strides)
                if vectors:
                    assert f"+ {start}LL" in _vector_kernel(src) or f"+ {start})" in _vector_kernel(src)
                    assert "opf_cp_async16(sr" in src or cols <= 4096 or op == "mul"
                else:
                    kernels = src[src.index("opfuse_take_error"):]
                    assert "opf_vload<" not in kernels and "opf_cp_async16(" not in kernels


# A cat's backward slices its gradient [s2, s0 + s1] from <s0> (the first
# part's size), a symbol no size of the slice's result or the kernel's
# domain mentions; b8[s0] is the size carrier that binds it.
SYMBOLIC_START_IR = """graph {
  %0 = input() {name="g"} : f32[s2, s0 + s1]
  %1 = input() {name="size_carrier_s0"} : b8[s0]
  %2 = slice(%0) {dim=1, start=<s0>, end=<s0 + s1>, step=1, inbounds=1} : f32[s2, s1]
  %3 = scalar() {value=2.0, weak=true} : f32[]
  %4 = mul(%2, %3) : f32[s2, s1]
  return (%4)
}"""


@pytest.mark.parametrize("arch", [80, 90])
def test_slices_from_a_symbolic_start_take_its_symbol(arch):
    # The kernel reads g at s0 + ...: s0 must be among its size arguments
    # (collected from the indices, not only from sizes), and the vector
    # twin reads at that shift, which the run time checks (vec_offsets).
    nvrtc_or_skip()
    cg = _C.CompiledGraph(SYMBOLIC_START_IR, target="cuda")
    shapes, strides = [[3, 16], [8]], [[16, 1], [0]]
    src = cg.cuda_source(shapes, strides, arch)
    kernels = src[src.index("opfuse_take_error"):]
    assert kernels.count("const int64_t s0 = syms[0];") == 2, kernels
    assert "_v4_args" in kernels and "opf_vload<4>(b0 + (s0 + " in kernels, kernels
    cubin, ptx, log = cg.compile_cuda(shapes, strides, arch, False)
    assert len(cubin) > 0


@pytest.mark.parametrize("arch", [80, 90])
def test_slice_scatter_with_a_step_compiles(arch):
    # A strided slice's backward: g's elements at 1, 3, 5, ... of zeros
    # (select_lt on how far an index is from the slice's elements).
    nvrtc_or_skip()
    ir = """graph {
  %0 = input() {name="g"} : f32[s0, s1//2]
  %1 = input() {name="z"} : f32[s0, s1]
  %2 = slice_scatter(%1, %0) {dim=1, start=1, step=2, inbounds=1} : f32[s0, s1]
  return (%2)
}"""
    cg = _C.CompiledGraph(ir, target="cuda")
    shapes, strides = [[3, 4], [3, 9]], [[4, 1], [9, 1]]
    src = cg.cuda_source(shapes, strides, arch)
    assert " % 2LL" in src and " < 1LL)" in src, src
    cubin, ptx, log = cg.compile_cuda(shapes, strides, arch, False)
    assert len(cubin) > 0
