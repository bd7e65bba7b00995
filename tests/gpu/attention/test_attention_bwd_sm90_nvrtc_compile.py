"""CI (no GPU): every instantiation of the Hopper backward (attention_bwd_sm90.cu)
compiles with NVRTC for sm_90a in one program, with no spills, no ptxas
warnings (wgmma serialisation, ignored setmaxnreg), and the SASS holds
HGMMA, TMA and bulk loads and nothing in local memory. Skips without libnvrtc.
"""

from __future__ import annotations

import re
import subprocess

import pytest

import attn_bwd_runtime as br
import attn_bwd_runtime_sm90 as b90
import attn_runtime as ar
import attn_runtime_sm90 as fs
from nvrtc_checks import nvrtc_or_skip, spill_free_problems


def _main_expressions():
    return [b90.expressions(*p)["main"] for p in b90.all_problems()]


@pytest.fixture(scope="module")
def compiled():
    nv = nvrtc_or_skip()
    exprs = _main_expressions()
    # The launch sequence's other two kernels come from attention_bwd.cu: one of each too.
    extra = list(b90.expressions("bf16", 128, False, b90.DEFAULT[128]).values())
    exprs_all = exprs + [e for e in extra if e not in exprs]
    cubin, log, lowered = nv.compile(b90.source(), b90.SOURCE_NAME, ar.compile_options(fs.ARCH_SM90), exprs_all)
    return dict(exprs=exprs, cubin=cubin, log=log, lowered=lowered, per_fn=br.split_ptxas_log(log))


def test_every_instantiation_compiles_without_spills(compiled):
    c = compiled
    # ptxas reports serialised wgmma (C7512 and kin) as "info": as bad as a warning here.
    warnings = [l for l in c["log"].splitlines()
                if "ptxas" in l.lower() and ("warning" in l.lower() or "performance loss" in l.lower())]
    assert not warnings, "\n".join(warnings[:20])
    rows = [(e, ar.parse_ptxas(c["per_fn"].get(c["lowered"][e], "")), b90.smem_bytes(d, cfg))
            for (elem, d, causal, cfg), e in zip(b90.all_problems(), c["exprs"])]
    problems = spill_free_problems("sm_90a", rows, b90.SMEM_LIMIT, 76)
    assert not problems, "\n".join(problems)


def test_sass_uses_hgmma_tma_and_no_local_memory(compiled, tmp_path):
    import test_attention_nvrtc_compile as fwd_ci  # its cuobjdump finder

    tool = fwd_ci._cuobjdump()
    if not tool:
        pytest.skip("no cuobjdump")
    path = tmp_path / "bwd90.cubin"
    path.write_bytes(compiled["cubin"])
    sass = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    funcs = {f.split()[0]: f for f in re.split(r"Function : ", sass)[1:]}
    for e in compiled["exprs"]:
        f = funcs[compiled["lowered"][e]]
        # S^T, dP^T: D / 16 steps each; dV, dK: BLOCK_M / 16 each; dQ: 128 / 16.
        m = re.search(r", (\d+), (?:true|false), (\d+), \d+, (\d)(?:, (\d+))?>", e)
        d, bm, mode, opts = int(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4) or 0)
        # The deferred dQ (opts & 2) issues dQ in the loop and once more after it;
        # the early S^T (opts & 16) issues S^T in the loop and once before it.
        assert f.count("HGMMA.64x") == (2 + (1 if opts & 16 else 0)) * (d // 16) + 2 * (bm // 16) + \
            8 * (2 if opts & 2 else 1), e
        assert "tnspA.tnspB" in f and "UTMALDG.4D" in f and "UBLKCP" in f, e
        assert " HMMA" not in f and "LDL" not in f and "STL" not in f, e
        assert "USETMAXREG" in f, e
        # dQ: red.global from registers (mode 0), else bulk reductions from shared memory.
        assert ("REDG.E.ADD.F32x2" in f) == (mode == 0 and not opts & 8) and ("UBLKRED" in f) == (mode > 0), e
        assert ("REDG.E.ADD.F32x4" in f) == bool(opts & 8), e


def test_smem_and_tiles_match_the_kernel_limits():
    for d in b90.HEAD_DIMS:
        for cfg in b90.configs(d):
            assert b90.smem_bytes(d, cfg) <= b90.SMEM_LIMIT
    nv = nvrtc_or_skip()
    bad = b90.expressions("bf16", 64, False, b90.BwdSm90Config(64, 2))["main"]
    with pytest.raises(ar.NvrtcError, match="BLOCK_M = 64 needs HEAD_DIM = 128"):
        nv.compile(b90.source(), b90.SOURCE_NAME, ar.compile_options(fs.ARCH_SM90), [bad])


def test_sources_include_no_header():
    for f in ("attention_sm90_ptx.cu", "attention_bwd_sm90.cu"):
        assert not re.search(r"^\s*#\s*include", (b90.KERNEL_DIR / f).read_text(), re.M), f
