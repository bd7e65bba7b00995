"""CI (no GPU): every attention_bwd instantiation compiles with NVRTC for sm_80
and sm_90, with ptxas's register and spill report checked.

One NVRTC program per architecture holds every kernel (the front end runs
once), and the two architectures compile in parallel processes. Skips when
libnvrtc is missing. Prints a resource table (pytest -s).
"""

from __future__ import annotations

import concurrent.futures as cf
import re

import pytest

import attn_bwd_runtime as br
import attn_runtime as ar
from nvrtc_checks import nvrtc_or_skip

ARCHS = ["sm_80", "sm_90"]


def _expressions(arch: str):
    """Every kernel: all problems unmasked, the default tiles with each attn_mask kind."""
    exprs = []
    for problem in br.all_problems(include_variants=True) + br.masked_problems(arch):
        for e in br.expressions(*problem).values():
            if e not in exprs:
                exprs.append(e)
    return exprs


def _compile_all(arch: str):
    nv = ar.Nvrtc()
    exprs = _expressions(arch)
    cubin, log, lowered = nv.compile(br.source(), br.SOURCE_NAME, ar.compile_options(arch), exprs)
    per_fn = ar.split_ptxas_log(log)
    return {e: ar.parse_ptxas(per_fn.get(lowered[e], "")) for e in exprs}, len(cubin)


@pytest.fixture(scope="module")
def compiled():
    nvrtc_or_skip()
    with cf.ProcessPoolExecutor(max_workers=2) as ex:
        return dict(zip(ARCHS, ex.map(_compile_all, ARCHS)))


@pytest.mark.parametrize("arch", ARCHS)
def test_every_backward_instantiation_compiles_without_big_spills(compiled, arch):
    res, cubin_size = compiled[arch]
    assert cubin_size > 0
    problems = []
    print(f"\n{arch}: {'kernel':100} regs stack spill_st spill_ld")
    for e, r in res.items():
        print(f"{arch}: {e[len('opfuse_attn::'):]:100} {r['registers']} {r['stack']} {r['spill_stores']} "
              f"{r['spill_loads']}")
        if r["registers"] is None:
            problems.append(f"{e}: no ptxas report")
        elif r["registers"] > 255 or r["spill_stores"] > 64 or r["stack"] > 64:
            # A few spilled words are tolerated (8 bytes today, in the atomic
            # dK/dV kernel at D = 128); a spilled accumulator tile is not.
            problems.append(f"{e}: {r}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("arch", ARCHS)
def test_default_tiles_fit_shared_memory(arch):
    for d in br.HEAD_DIMS:
        kv, q = br.choose_tiles(d, arch)
        assert br.dkdv_smem(d, kv) <= ar.MAX_SMEM_PER_BLOCK[arch]
        assert br.dq_smem(d, q) <= ar.MAX_SMEM_PER_BLOCK[arch]


def test_atomic_dq_uses_vector_reductions_on_sm90_only():
    # One red.global.add.v2.f32 per two dQ elements on sm_90; sm_80 has no
    # vector reduction and must get the scalar form.
    nv = nvrtc_or_skip()
    kv, q = br.choose_tiles(64)
    expr = br.expressions("bf16", 64, True, kv, q)["dkdv_atomic"]
    ptx90 = br.compile_ptx(nv, "sm_90", [expr])
    ptx80 = br.compile_ptx(nv, "sm_80", [expr])
    assert "red.global.add.v2.f32" in ptx90 and "red.global.add.f32" not in ptx90
    assert "red.global.add.f32" in ptx80 and "red.global.add.v2" not in ptx80
    assert "mma.sync.aligned.m16n8k16" in ptx90 and "ldmatrix" in ptx90


def test_nvrtc_rejects_bad_template_arguments():
    nv = nvrtc_or_skip()
    bad = br.expressions("bf16", 80, False, br.Tile(64, 128, 8, 1), br.Tile(128, 64, 8, 1))["dkdv"]
    with pytest.raises(ar.NvrtcError, match="HEAD_DIM must be 64, 96, 128 or 256"):
        nv.compile(br.source(), br.SOURCE_NAME, ar.compile_options("sm_90"), [bad])
    bad = br.expressions("bf16", 128, False, br.Tile(64, 128, 4, 1), br.Tile(128, 64, 8, 1))["dkdv"]
    with pytest.raises(ar.NvrtcError, match="key groups must divide the warps"):
        nv.compile(br.source(), br.SOURCE_NAME, ar.compile_options("sm_90"), [bad])


def test_sources_include_no_header():
    for path in (br.COMMON_SOURCE, br.BWD_SOURCE):
        assert not re.search(r"^\s*#\s*include", path.read_text(), re.M), f"{path.name}: NVRTC has no CUDA headers"
