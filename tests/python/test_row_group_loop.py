"""Forward lane groups that step through rows with the next row's vectors
in registers (OPFUSE_ROW_GROUP_LOOP, cuda_row_schedule.cpp), checked without
a GPU on the generated source and ptxas's report. Their results are checked
against float64, and bit for bit against a block a row group, on the GPU in
test_cuda_row_schedules.py."""
import re

import pytest

from test_row_prefetch_reverse import no_spills, nvrtc_or_skip, source_and_log, vector_twin

OPS = ["softmax", "log_softmax", "layer_norm", "rms_norm"]


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("op", OPS)
def test_group_loop_pipelines_the_next_row(op, arch, monkeypatch):
    nvrtc_or_skip()
    # Off by default: one row group a block, no loop over rows.
    bounds, body = vector_twin(source_and_log(op, 262144, 256, arch)[0])
    assert "rbase_" not in body and "nx0" not in body
    monkeypatch.setenv("OPFUSE_ROW_GROUP_LOOP", "1")
    src, log = source_and_log(op, 262144, 256, arch)
    bounds, body = vector_twin(src)
    assert bounds == "256, 3", bounds
    # The block's groups step through the rows by the grid; the first pass
    # reads row_'s vectors from nx0, and row_ + the grid's loads into nx0
    # follow that pass, before the row's first shuffle.
    assert re.search(r"for \(int rbase_ = \(int\)blockIdx\.x \* 32; rbase_ < rows; rbase_ \+= \(int\)gridDim\.x \* 32\)", body), body
    first_use = body.index("opf_vunpack<8>(nx0[it_]")
    refill = body.index("nx0[it_] = *reinterpret_cast<const opf_vec<16>*>(b0 + ((uint32_t)c_ + ((uint32_t)pfx0")
    shuffle = body.index("opf_warp_")
    assert first_use < refill < shuffle
    assert "pfxrem_ = (row_ + (int)gridDim.x * 32 < rows ? row_ + (int)gridDim.x * 32 : rows - 1)" in body
    assert no_spills(log), log[-2000:]


def test_group_loop_leaves_other_schedules_alone(monkeypatch):
    nvrtc_or_skip()
    monkeypatch.setenv("OPFUSE_ROW_GROUP_LOOP", "1")
    # A block a row (4096) and the staged rows (32768) do not loop this way.
    for cols in (4096, 32768):
        _, body = vector_twin(source_and_log("layer_norm", 8192, cols)[0])
        assert "rbase_" not in body and "nx0" not in body
