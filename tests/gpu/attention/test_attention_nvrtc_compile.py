"""CI (no GPU): every attention_fwd instantiation (unmasked and, for the
default tiles, with each attn_mask kind) compiles with NVRTC for sm_80 and
sm_90, and ptxas's resource report is sane; the Hopper kernel's for sm_90a.

Finds libnvrtc in the CUDA toolkit or the nvidia pip wheel (attn_runtime.load_nvrtc);
skips with the reason when there is none. Prints a resource table (pytest -s).
"""

from __future__ import annotations

import concurrent.futures as cf
import re

import pytest

import attn_runtime as ar
from nvrtc_checks import nvrtc_or_skip, spill_free_problems


def _compile_all(arch: str):
    """One NVRTC program holding every instantiation; returns (expr -> resources, log)."""
    nv = ar.Nvrtc()
    inst = ar.all_instantiations(include_variants=True) + ar.masked_instantiations(arch)
    exprs = [ar.name_expression(*i) for i in inst]
    cubin, log, lowered = nv.compile(ar.kernel_source(), "attention_fwd.cu", ar.compile_options(arch), exprs)
    per_fn = ar.split_ptxas_log(log)
    res = {e: ar.parse_ptxas(per_fn.get(lowered[e], "")) for e in exprs}
    return res, len(cubin), log


@pytest.fixture(scope="module")
def compiled():
    nvrtc_or_skip()
    archs = ["sm_80", "sm_90"]
    # The two architectures compile in parallel processes (about 40 s each on one core).
    with cf.ProcessPoolExecutor(max_workers=2) as ex:
        results = dict(zip(archs, ex.map(_compile_all, archs)))
    return results


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_instantiation_compiles_with_sane_resources(compiled, arch):
    res, cubin_size, log = compiled[arch]
    assert cubin_size > 0
    print(f"\n{arch}: {'instantiation':78} regs stack spill_st spill_ld smem")
    problems = []
    for (elem, d, causal, cfg) in ar.all_instantiations(include_variants=True):
        e = ar.name_expression(elem, d, causal, cfg)
        r = res[e]
        smem = ar.smem_bytes(d, cfg)
        print(f"{arch}: {e[len('opfuse_attn::'):]:78} {r['registers']} {r['stack']} {r['spill_stores']} "
              f"{r['spill_loads']} {smem}")
        if r["registers"] is None:
            problems.append(f"{e}: no ptxas report")
            continue
        if r["registers"] > 255:
            problems.append(f"{e}: {r['registers']} registers")
        # Small spills (a few dozen words, mostly in the masked iterations and
        # the epilogue; 140 bytes at most today) are tolerated; a spilled
        # accumulator tile (kilobytes) is not.
        if r["spill_stores"] > 256 or r["stack"] > 256:
            problems.append(f"{e}: spills {r['spill_stores']} bytes, stack {r['stack']}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_default_tiles_fit_shared_memory_and_do_not_spill(compiled, arch):
    res, _, _ = compiled[arch]
    for d in ar.HEAD_DIMS:
        cfg = ar.default_config(d, arch)
        assert ar.smem_bytes(d, cfg) <= ar.MAX_SMEM_PER_BLOCK[arch]
        for elem in ar.ELEMENTS:
            for causal in (False, True):
                r = res[ar.name_expression(elem, d, causal, cfg)]
                # ptxas at 255 registers spills a few words, mostly in the
                # masked (first) iterations; the hot loop keeps one or two
                # LDL per iteration (docs/attention.md). More means a regression.
                assert r["spill_stores"] <= 256 and r["stack"] <= 128, f"{arch} D={d} {cfg.tag()}: {r}"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_masked_instantiations_compile_without_big_spills(compiled, arch):
    # With an attn_mask the default tiles (D = 64: 128x64) keep at most a few
    # dozen spilled words (144 bytes at most, D = 128 on sm_80), as the
    # unmasked ones: the mask step adds no live tile (Q leaves registers).
    res, _, _ = compiled[arch]
    problems = []
    for (elem, d, causal, cfg, mask) in ar.masked_instantiations(arch):
        r = res[ar.name_expression(elem, d, causal, cfg, mask)]
        print(f"{arch}: {elem} D={d} causal={int(causal)} {cfg.tag()} {mask}: {r}")
        if r["registers"] is None or r["registers"] > 255 or r["spill_stores"] > 256 or r["stack"] > 128:
            problems.append(f"{elem} D={d} causal={causal} {mask}: {r}")
        assert ar.smem_bytes(d, cfg, mask) <= ar.MAX_SMEM_PER_BLOCK[arch]
    assert not problems, "\n".join(problems)


def test_nvrtc_rejects_bad_template_arguments():
    nv = nvrtc_or_skip()
    bad = ar.name_expression("bf16", 80, False, ar.FwdConfig(128, 64, 4, 2))
    with pytest.raises(ar.NvrtcError, match="HEAD_DIM must be 64, 96, 128 or 256"):
        nv.compile(ar.kernel_source(), "attention_fwd.cu", ar.compile_options("sm_90"), [bad])


def test_source_includes_no_header():
    src = ar.KERNEL_SOURCE.read_text()
    assert not re.search(r"^\s*#\s*include", src, re.M), "NVRTC on target machines has no CUDA headers"


def test_sm90_sources_include_no_header():
    import attn_runtime_sm90 as sm90

    for f in (sm90.KERNEL_SOURCE_SM90, sm90.SCHEDULE_SOURCE_SM90, sm90.PTX_SOURCE_SM90):
        assert not re.search(r"^\s*#\s*include", f.read_text(), re.M), f


# ---- the Hopper kernel (attention_fwd_sm90.cu), compiled for sm_90a ----

import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402

import attn_runtime_sm90 as sm90  # noqa: E402


def _compile_sm90(inst):
    """One NVRTC program with the sm_90a instantiations `inst` (tuples of name_expression_sm90's arguments)."""
    nv = nvrtc_or_skip()
    exprs = [sm90.name_expression_sm90(*i) for i in inst]
    ptx, cubin, log, lowered = sm90.compile_ptx_and_cubin_sm90(nv, exprs)
    return dict(inst=inst, exprs=exprs, ptx=ptx, cubin=cubin, log=log, lowered=lowered, per_fn=ar.split_ptxas_log(log))


@pytest.fixture(scope="module")
def compiled_sm90():
    """Every sm_90a instantiation (about 2 minutes on one core)."""
    return _compile_sm90(sm90.all_instantiations_sm90())


def test_sm90_every_instantiation_compiles_without_spills(compiled_sm90):
    c = compiled_sm90
    # ptxas warns (C7508, C7515...) when it ignores setmaxnreg or serialises wgmma.
    warnings = [l for l in c["log"].splitlines() if "warning" in l.lower()]
    assert not warnings, "\n".join(warnings[:20])
    # ... and only reports (C7518, C7520 "Potential Performance Loss") when a
    # wgmma sits under a branch it cannot prove uniform: every wgmma of the
    # kernel is then serialised (seen while adding OPTS; docs/attention.md).
    serialised = [l for l in c["log"].splitlines() if "serialized" in l or "Performance Loss" in l]
    assert not serialised, "\n".join(serialised[:20])
    rows = [(e, ar.parse_ptxas(c["per_fn"].get(c["lowered"][e], "")), sm90.smem_bytes_sm90(d, cfg))
            for (elem, d, causal, cfg), e in zip(c["inst"], c["exprs"])]
    problems = spill_free_problems("sm_90a", rows, ar.MAX_SMEM_PER_BLOCK["sm_90"], 86)
    assert not problems, "\n".join(problems)


def test_sm90_tags_round_trip_and_option_bits():
    # No compiler needed: tag <-> config, the OPTS bits in the name expression,
    # and the shared memory the launch asks for (176-key blocks: one Q buffer).
    for d in sm90.HEAD_DIMS_SM90:
        for cfg in sm90.configs_sm90(d):
            assert sm90.Sm90Config.parse(cfg.tag()) == cfg, cfg
    cfg = sm90.Sm90Config.parse("wg128x128s2pd")
    assert cfg.desc and not cfg.pairs and cfg.opts == 8
    assert sm90.name_expression_sm90("bf16", 128, False, cfg).endswith(", true, opfuse_attn::MaskNone, 8>")
    assert sm90.Sm90Config.parse("wg128x128s2pld").opts == 12
    with pytest.raises(ValueError):
        sm90.Sm90Config.parse("wg128x128s2pdl")
    # b (query blocks ending at Sq, bit 32) and w (split, bit 16) on pairs: the causal default.
    cfg = sm90.Sm90Config.parse("wg192x128s4plwb")
    assert cfg.pairs and cfg.split and cfg.shift and cfg.opts == 52
    assert sm90.name_expression_sm90("bf16", 64, True, cfg).endswith(", true, opfuse_attn::MaskNone, 52>")
    # 176 x 128 x 2 x 2 x 2 K/V + one 32 KB Q buffer + mbarriers (8 x 12) + 32 bytes of schedule + 1 KB
    wide = sm90.Sm90Config.parse("wg128x176s2pd")
    assert sm90.q_buffers_sm90(128, wide) == 1 and sm90.smem_bytes_sm90(128, wide) == 214144
    # t (O through TMA stores, bit 64) after b, before n; not with the overlap.
    cfg = sm90.Sm90Config.parse("wg128x128s2pdwtn")
    assert cfg.store_o and cfg.split and not cfg.persistent and cfg.opts == 88
    assert sm90.smem_bytes_sm90(128, cfg) == sm90.smem_bytes_sm90(128, sm90.Sm90Config.parse("wg128x128s2pdw"))
    with pytest.raises(ValueError):
        sm90.Sm90Config.parse("wg128x128s2potd")
    with pytest.raises(ValueError):
        sm90.Sm90Config.parse("wg128x128s2pot")
    # Masked calls keep the plain tile (neither pairs nor descriptors by offset).
    for d in sm90.HEAD_DIMS_SM90:
        for causal in (False, True):
            assert sm90.default_config_sm90(d, causal, masked=True).opts == 0


def _ptx_entries(ptx: str):
    """{entry name: its PTX text}."""
    parts = re.split(r"^\.(?:visible|weak) \.entry (\S+?)\(", ptx, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def test_sm90_ptx_uses_wgmma_tma_mbarriers_and_setmaxnreg(compiled_sm90):
    c = compiled_sm90
    entries = _ptx_entries(c["ptx"])
    for (elem, d, causal, cfg), e in zip(c["inst"], c["exprs"]):
        body = entries[c["lowered"][e]]
        # Three issue sites of each product (first block, masked and unmasked
        # loops; the last P V replaces one): D/16 steps for S, BLOCK_N/16 for P V;
        # with the overlap option (two Q buffers) a fourth S: the next tile's.
        extra = d // 16 if cfg.overlap and sm90.q_buffers_sm90(d, cfg) == 2 else 0
        assert body.count("wgmma.mma_async") == 3 * (d // 16 + cfg.block_n // 16) + extra, e
        assert "wgmma.wait_group" in body and "wgmma.commit_group" in body and "wgmma.fence" in body, e
        # Q, K, V loads: one per 64 columns of the stored row (96 is stored 128
        # wide, TMA zero-fills the rest); "t" tiles store O the same way.
        boxes = sm90.stored_dim_sm90(d) // 64
        assert body.count("cp.async.bulk.tensor.4d") == (4 if cfg.store_o else 3) * boxes, e
        assert body.count("cp.async.bulk.tensor.4d.global.shared::cta") == (boxes if cfg.store_o else 0), e
        assert "mbarrier.try_wait.parity" in body and "mbarrier.arrive.expect_tx" in body, e
        assert "setmaxnreg.dec" in body and "setmaxnreg.inc" in body, e
        assert "mma.sync" not in body and "ldmatrix" not in body, e


def _cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "cuobjdump")):
            return os.path.join(home, "bin", "cuobjdump")
    import sys

    for d in sys.path:  # Triton's wheel carries one
        hit = os.path.join(d, "triton", "backends", "nvidia", "bin", "cuobjdump")
        if os.path.exists(hit):
            return hit
    return None


def test_sm90_sass_uses_hgmma_and_tma(compiled_sm90, tmp_path):
    tool = _cuobjdump()
    if not tool:
        pytest.skip("no cuobjdump")
    path = tmp_path / "sm90.cubin"
    path.write_bytes(compiled_sm90["cubin"])
    sass = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    funcs = re.split(r"Function : ", sass)[1:]
    assert len(funcs) == len(compiled_sm90["exprs"])
    for f in funcs:
        name = f.split()[0]
        assert "HGMMA.64x" in f and "UTMALDG.4D" in f, name
        assert " HMMA" not in f, name  # no mma.sync fallback inside
        assert "LDL" not in f and "STL" not in f, name  # nothing in local memory
        assert "USETMAXREG" in f, name


# ---- the Hopper kernel with an attn_mask (sm_90 default at D = 128) ----

# D = 128 takes masked calls on sm_90 by default: bool and key padding are
# spill-free; a full additive mask spills a few words (20-60 bytes measured:
# its loads on top of the S, O and P registers), and was still 1.35-1.6x
# faster than the mma.sync kernel with the same mask (docs/attention.md,
# "attn_mask"). D = 64 (opt-in, OPFUSE_ATTN_SM90_MASK=1) only has to compile:
# three consumers at 160 registers spill hundreds of bytes with a full mask.
SM90_MASK_SPILL_FREE = {(128, "full-bool"), (128, "keypad")}
SM90_MASK_MAX_SPILL = {128: 64}


@pytest.fixture(scope="module")
def compiled_sm90_masked():
    return _compile_sm90(sm90.masked_instantiations_sm90())


def test_sm90_masked_instantiations_compile(compiled_sm90_masked):
    c = compiled_sm90_masked
    warnings = [l for l in c["log"].splitlines() if "warning" in l.lower()]
    assert not warnings, "\n".join(warnings[:20])
    problems = []
    for (elem, d, causal, cfg, mask), e in zip(c["inst"], c["exprs"]):
        r = ar.parse_ptxas(c["per_fn"].get(c["lowered"][e], ""))
        print(f"sm_90a masked: {elem} D={d} causal={int(causal)} {cfg.tag()} {mask}: {r}")
        if r["registers"] is None:
            problems.append(f"{e}: no ptxas report")
        elif (d, mask) in SM90_MASK_SPILL_FREE and (r["stack"] or r["spill_stores"]):
            problems.append(f"{e}: spills ({r})")
        elif d in SM90_MASK_MAX_SPILL and r["spill_stores"] > SM90_MASK_MAX_SPILL[d]:
            problems.append(f"{e}: spills more than {SM90_MASK_MAX_SPILL[d]} bytes ({r})")
    assert not problems, "\n".join(problems)
