"""Row-kernel schedules chosen by default from the H200 measurements of
branch rows-bwd (docs/perf-notes.md), checked without a GPU on the generated
source and ptxas's report: the L2 prefetch of the next row in kernels with a
block per row, and 1024-thread loop stages that run their later stages
backwards for rows whose re-reads overflow L2. Their results are checked
against float64 on the GPU in test_cuda_row_schedules.py."""
import os
import re
import sys

import pytest

from opfuse import _C

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import row_source  # noqa: E402


def nvrtc_or_skip():
    try:
        return _C.nvrtc_version()
    except Exception as e:  # no NVRTC on this machine
        pytest.skip(f"NVRTC not available: {e}")


def source_and_log(op, rows, cols, arch=90):
    if op == "softmax_backward":
        ir, shapes = row_source.softmax_backward_ir(rows, cols), [[rows, cols]] * 2
    elif op == "layer_norm_backward":
        ir, shapes = row_source.layer_norm_backward_ir(rows, cols), [[rows, cols]] * 2 + [[rows, 1]] * 2 + [[cols]]
    else:
        ir = row_source.forward_ir(op, rows, cols)
        shapes = [[rows, cols]] + [[cols]] * {"layer_norm": 2, "rms_norm": 1}.get(op, 0)
    cg = _C.CompiledGraph(ir, target="cuda")
    st = row_source.strides(shapes)
    src = cg.cuda_source(shapes, st, arch)
    _, _, log = cg.compile_cuda(shapes, st, arch, False)
    return src, log


def vector_twin(src):
    """The source of the first kernel whose name ends in _v<n>."""
    m = re.search(r"extern \"C\" __global__ void __launch_bounds__\(([^)]*)\) (?:__cluster_dims__\([^)]*\) )?(\w+_v\d+)\(.*?\n}\n",
                  src, re.S)
    assert m, src[-2000:]
    return m.group(1), m.group(0)


def no_spills(log):
    spills = re.findall(r"(\d+) bytes spill stores", log)
    return spills and all(int(s) == 0 for s in spills)


@pytest.mark.parametrize("arch", [80, 90])
def test_overflowing_rows_loop_backwards_in_1024_thread_blocks(arch, monkeypatch):
    nvrtc_or_skip()
    # By default on sm_90 dy and y are staged in shared memory (one 128 KB
    # block a row); with OPFUSE_ROW_SMEM_TENSORS=1 (sm_80's default) they
    # run the loop stages:
    # 128 KB a row, 4 x 132 rows overflow 50 MB, 2 x 132 fit.
    if arch >= 90:
        bounds, body = vector_twin(source_and_log("softmax_backward", 8192, 32768, arch)[0])
        assert bounds == "512, 1" and "k_--" not in body and "opf_cp_async16(sr1" in body, body
    monkeypatch.setenv("OPFUSE_ROW_SMEM_TENSORS", "1")
    src, log = source_and_log("softmax_backward", 8192, 32768, arch)
    bounds, body = vector_twin(src)
    assert bounds == "1024, 2" and "k_-- > 0" in body, body
    assert no_spills(log), log[-2000:]
    # The forward's 64 KB rows are staged in shared memory (three blocks an
    # SM on sm_90, two on sm_80): forwards.
    src, _ = source_and_log("softmax", 8192, 32768, arch)
    bounds, body = vector_twin(src)
    assert bounds == ("512, 3" if arch == 90 else "512, 2") and "k_--" not in body
    # 512 KB rows overflow L2 either way: unchanged.
    src, _ = source_and_log("softmax", 4096, 262144, arch)
    assert "k_--" not in vector_twin(src)[1]


def test_reverse_knob_forces_either_way(monkeypatch):
    nvrtc_or_skip()
    monkeypatch.setenv("OPFUSE_ROW_REVERSE_LOOPS", "0")
    assert "k_--" not in vector_twin(source_and_log("softmax_backward", 8192, 32768)[0])[1]
    monkeypatch.setenv("OPFUSE_ROW_REVERSE_LOOPS", "1")
    assert "k_-- > 0" in vector_twin(source_and_log("softmax", 8192, 32768)[0])[1]


@pytest.mark.parametrize("arch", [80, 90])
def test_l2_hints_knob(arch, monkeypatch):
    """OPFUSE_ROW_L2_HINTS=1: the loop stages of rows overflowing L2 load
    with evict_last but the last, whose loads and stores go evict_first; the
    rows that fit (or are cached) get no hints; off by default."""
    nvrtc_or_skip()
    monkeypatch.setenv("OPFUSE_ROW_SMEM_TENSORS", "1")  # the loop stages (dy and y not staged)
    assert "_hint" not in vector_twin(source_and_log("softmax_backward", 8192, 32768, arch)[0])[1]
    monkeypatch.setenv("OPFUSE_ROW_L2_HINTS", "1")
    src, log = source_and_log("softmax_backward", 8192, 32768, arch)
    _, body = vector_twin(src)
    first, last = body.split("opf_l2_policy<false>")
    assert "opf_l2_policy<true>" in first and first.count("opf_ld16_hint(") == 2, body
    assert last.count("opf_ld16_hint(") == 2 and "opf_vstore_w_hint<8>" in last, body
    assert no_spills(log), log[-2000:]
    assert "_hint" not in vector_twin(source_and_log("softmax_backward", 32768, 4096, arch)[0])[1]


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("op", ["softmax", "log_softmax", "layer_norm", "rms_norm", "softmax_backward",
                                "layer_norm_backward"])
def test_block_per_row_kernels_prefetch_the_next_row(op, arch):
    """32768x4096: the row a block takes next (column partials: the block's
    own next row; one row a block: one wave on) is prefetched after the first
    stage's loads, in both twins' vector loops only; no spills."""
    nvrtc_or_skip()
    src, log = source_and_log(op, 32768, 4096, arch)
    _, body = vector_twin(src)
    assert "pf_ok_" in body and "opf_prefetch_l2(b" in body, body
    if op == "layer_norm_backward":
        assert re.search(r"row_ \+ \((int64_t|int)\)gridDim.x < rows", body), body  # (int: OPFUSE_ROW_INDEX32)
    else:
        assert re.search(r"pf_ok_ = row_ \+ \d+ < rows", body), body
    assert no_spills(log), log[-2000:]


def test_lane_groups_do_not_prefetch_unless_asked(monkeypatch):
    nvrtc_or_skip()
    assert "opf_prefetch_l2(b" not in source_and_log("layer_norm_backward", 262144, 256)[0]
    monkeypatch.setenv("OPFUSE_ROW_PREFETCH", "1")
    assert "opf_prefetch_l2(b" in source_and_log("layer_norm_backward", 262144, 256)[0]
    monkeypatch.setenv("OPFUSE_ROW_PREFETCH", "0")
    assert "opf_prefetch_l2(b" not in source_and_log("softmax", 32768, 4096)[0]
