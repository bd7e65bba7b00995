"""The extension exports nothing of a statically linked C++ runtime. A
toolchain that links libstdc++ statically (the H200 machine's /opt/gcc g++)
made _C export that copy's symbols, and the process's shared libstdc++
(PyTorch's) interposed them: an intermittent SIGSEGV in `ostream << long`
inside print_graph (perf-notes, session 13). CMakeLists.txt keeps the
symbols of static archives local to _C."""
import shutil
import subprocess
import sys

import pytest

from opfuse import _C

# Non-template parts of libstdc++ (and the instantiations it declares
# extern): in _C's dynamic symbols only if a static libstdc++ was exported.
RUNTIME_PREFIXES = ("_ZNSt6locale", "_ZNSt8ios_base", "_ZNSo9_M_insert", "_ZNSi10_M_extract")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads ELF dynamic symbols")
def test_no_cxx_runtime_symbols_exported():
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not installed")
    out = subprocess.run([nm, "-D", "--defined-only", _C.__file__], capture_output=True, text=True, check=True).stdout
    names = [line.split()[-1] for line in out.splitlines() if line.strip()]
    assert "PyInit__C" in names
    runtime = [n for n in names if n.startswith(RUNTIME_PREFIXES) or "codecvt" in n]
    assert not runtime, runtime[:10]
