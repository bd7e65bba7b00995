"""Builds a CPU reference of src/kernels/attention with its C shim into a
shared library for ctypes (the two *_reference_cpu.py tests)."""

from __future__ import annotations

import ctypes
import os
import pathlib
import shutil
import subprocess

import pytest

HERE = pathlib.Path(__file__).resolve().parent
SRC = HERE.parents[2] / "src" / "kernels" / "attention"


def build_reference_lib(out_dir: pathlib.Path, name: str, reference_cpp: str, shim_cpp: str, entry: str):
    """g++ -std=c++20 -Werror of SRC/reference_cpp and HERE/shim_cpp into
    out_dir/lib<name>.so; returns the library with `entry` returning int.
    Skips without a C++ compiler; a build error fails with the compiler's output."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if not cxx:
        pytest.skip("no C++ compiler found (g++/c++/clang++)")
    out = out_dir / f"lib{name}.so"
    cmd = [cxx, "-std=c++20", "-O2", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", f"-I{SRC}",
           str(SRC / reference_cpp), str(HERE / shim_cpp), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"
    lib = ctypes.CDLL(str(out))
    getattr(lib, entry).restype = ctypes.c_int
    return lib
