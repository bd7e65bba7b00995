"""Checks shared by the attention NVRTC compile tests (CPU only, no GPU)."""

from __future__ import annotations

import pytest

import attn_runtime as ar


def nvrtc_or_skip():
    """An attn_runtime.Nvrtc, or the test skips with the reason libnvrtc was not found."""
    try:
        return ar.Nvrtc()
    except OSError as e:
        pytest.skip(f"libnvrtc not found: {str(e).splitlines()[0]}")


def spill_free_problems(label: str, rows, smem_limit: int, width: int) -> list[str]:
    """Prints a resource table (pytest -s) of `rows`, (name expression, ptxas
    resources of its kernel, its dynamic shared memory), and returns what is
    wrong: no ptxas report, any stack or spill, or more shared memory than
    smem_limit."""
    problems = []
    print(f"\n{label}: {'instantiation':{width}} regs stack spill_st spill_ld smem")
    for e, r, smem in rows:
        print(f"{label}: {e[len('opfuse_attn::'):]:{width}} {r['registers']} {r['stack']} {r['spill_stores']} "
              f"{r['spill_loads']} {smem}")
        if r["registers"] is None:
            problems.append(f"{e}: no ptxas report")
        elif r["stack"] or r["spill_stores"] or r["spill_loads"]:
            problems.append(f"{e}: spills ({r})")
        if smem > smem_limit:
            problems.append(f"{e}: {smem} bytes of shared memory")
    return problems
