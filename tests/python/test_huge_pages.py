"""Large buffers a CPU run writes are advised to use transparent huge pages
before the kernel first touches them (src/runtime/huge_pages.h): the mapping
holding a 64 MB output carries the kernel's 'hg' flag (MADV_HUGEPAGE);
OPFUSE_HUGE_PAGES=0 leaves it alone; values are unchanged either way."""
import os
import subprocess
import sys

import pytest
import torch

import opfuse  # noqa: F401

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_available() -> bool:
    return sys.platform.startswith("linux") and os.path.exists(THP) and "[never]" not in open(THP).read()


pytestmark = pytest.mark.skipif(not thp_available(), reason="needs Linux with transparent huge pages")


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    current = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(v, 16) for v in head.split("-"))
                current = lo <= address < hi
            elif current and line.startswith("VmFlags:"):
                return line.split()[1:]
    return []


CHILD = r"""
import os, sys, torch, opfuse
from test_huge_pages import vm_flags
n = 16 << 20  # 64 MB of float32: its own mapping, from mmap
x, b1, b2 = (torch.randn(n) for _ in range(3))
fn = torch.compile(lambda x, b1, b2: torch.relu(x + b1) * 0.5 + b2, backend="opfuse")
out = fn(x, b1, b2)
torch.testing.assert_close(out, torch.relu(x + b1) * 0.5 + b2)
middle = out.data_ptr() + out.numel() * out.element_size() // 2
print("hg" in vm_flags(middle))
"""


def run_child(env_extra):
    env = dict(os.environ, **env_extra)
    env.pop("THP_MEM_ALLOC_ENABLE", None)  # PyTorch's own switch would advise every allocation
    env["PYTHONPATH"] = os.path.dirname(__file__) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1]


def test_large_outputs_are_advised_huge_pages():
    assert run_child({}) == "True"


def test_opfuse_huge_pages_0_leaves_them_alone():
    assert run_child({"OPFUSE_HUGE_PAGES": "0"}) == "False"
