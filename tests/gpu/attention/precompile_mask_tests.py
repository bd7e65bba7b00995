"""Fills the cubin caches with what the attn_mask GPU tests and benchmark
launch (scripts/attention-mask-gpu-check), in parallel, so that the tests
do not compile one instantiation at a time on the GPU machine.

    python precompile_mask_tests.py harness [-j N]   # OPFUSE_ATTN_CUBIN_DIR (attn_runtime's cache)
    python precompile_mask_tests.py launcher [-j N]  # OPFUSE_CACHE_DIR (the C++ launcher's; needs opfuse built)

Entries already in a cache are skipped.
"""
import argparse
import concurrent.futures as cf
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attn_bwd_runtime as br  # noqa: E402
import attn_runtime as ar  # noqa: E402
import attn_runtime_sm90 as sm  # noqa: E402


def fjobs():
    """(kernel, elem, D, causal, mask kind) of the forward instantiations used."""
    J = []
    for d in (64, 128):
        for c in (False, True):
            for m in ("full-bf16", "full-f32", "full-bool", "keypad"):
                J.append(("mma", "bf16", d, c, m))
    for d in (96, 256):
        for c in (False, True):
            for m in ("full-f32", "keypad", None):
                J.append(("mma", "bf16", d, c, m))
    for c in (False, True):
        for m in ("full-f16", "keypad"):
            J.append(("mma", "f16", 64, c, m))
        J.append(("mma", "bf16", 128, c, None))
        J.append(("mma", "bf16", 64, c, None))
        for m in ("full-bf16", "full-f32", "full-bool", "keypad", None):
            J.append(("sm90", "bf16", 128, c, m))
        J.append(("sm90", "bf16", 64, c, None))
    return J

def bjobs():
    """(elem, D, causal, mask kind) of the backward problems used."""
    J = []
    for d in (64, 128):
        for c in (False, True):
            for m in ("full-bf16", "full-f32", "full-bool", "keypad", None):
                J.append(("bf16", d, c, m))
    for d in (96, 256):
        for c in (False, True):
            for m in ("full-f32", "keypad", None):
                J.append(("bf16", d, c, m))
    for c in (False, True):
        for m in ("full-f16", "keypad"):
            J.append(("f16", 64, c, m))
    return J

def fone(j):
    kind, elem, d, c, m = j
    nv = ar.Nvrtc()
    if kind == "mma":
        info = ar.compile_kernel(nv, "sm_90", elem, d, c, ar.default_config(d, "sm_90", masked=m is not None), mask=m)
    else:
        info = sm.compile_kernel_sm90(nv, elem, d, c, sm.default_config_sm90(d, c, masked=True), mask=m)
    return j, info["resources"], info["cached"]

def bone(j):
    elem, d, c, m = j
    kv, q = br.choose_tiles(d, "sm_90", masked=m is not None)
    info = br.compile_problem(ar.Nvrtc(), "sm_90", elem, d, c, kv, q, mask=m)
    return j, {r: (v["registers"], v["spill_stores"]) for r, v in info["resources"].items() if r in ("dkdv", "dkdv_atomic", "dq")}, info["cached"]


# The C++ launcher's instantiations of test_attention_mask_op_gpu.py (sm_90).
LAUNCHER_FWD = [("bf16", 128, c, m, "wg128x128s2p") for c in (False, True) for m in ("keypad", "full-bf16", "full-bool")] + \
    [("bf16", 64, False, m, "128x64w4b2") for m in ("keypad", "full-bf16")]
LAUNCHER_BWD = [("bf16", 128, c, m) for c in (False, True) for m in ("keypad", "full-bf16", "full-bool")]


def launcher(j):
    from opfuse import _C

    if len(j) == 5:
        elem, d, c, m, tile = j
        if tile.startswith("wg"):  # the Hopper kernel (D = 128 takes masks on sm_90)
            return j, _C.attention_sm90_compile(elem, d, c, tile, True, m)[4]
        return j, _C.attention_compile(elem, d, c, tile, 90, True, m)[4]
    elem, d, c, m = j
    return j, _C.attention_backward_compile(elem, d, c, 90, True, m)[4]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["harness", "launcher"])
    ap.add_argument("-j", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    if a.what == "launcher":  # NVRTC releases the GIL: threads suffice
        with cf.ThreadPoolExecutor(a.j) as ex:
            for r in ex.map(launcher, LAUNCHER_FWD + LAUNCHER_BWD):
                print(*r, flush=True)
        return
    with cf.ProcessPoolExecutor(a.j) as ex:  # the backward problems (the longest) first
        futs = [ex.submit(bone, j) for j in bjobs()] + [ex.submit(fone, j) for j in fjobs()]
        for f in cf.as_completed(futs):
            print(*f.result(), flush=True)


if __name__ == "__main__":
    main()
