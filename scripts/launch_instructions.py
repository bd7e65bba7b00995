"""Instructions per call of the launch path's layers, counted by valgrind's
callgrind: unlike time, the count does not move with the load of a shared
machine, so two trees can be compared on it (it is a proxy: cache misses,
syscalls and the GPU driver are not in it; CPU backend only).

    N=16 .venv/bin/python scripts/launch_instructions.py

Needs valgrind (with valgrind/callgrind.h) and a C compiler. Runs itself
under callgrind with instrumentation off, switched on (by a client
request from a tiny C library built here) only around each timed loop;
prints, per graph of scripts/launch_cpu_time.py, torch.compile, partition,
run: instructions per call, net of the empty loop's. Takes a few minutes.
"""
import ctypes
import glob
import os
import re
import subprocess
import sys
import tempfile

CALLS = 2000
MARKER = r"""
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void cg_stop(const char* label) { CALLGRIND_DUMP_STATS_AT(label); CALLGRIND_STOP_INSTRUMENTATION; }
"""


def measure(lib_path):
    """Inside callgrind: the loops, each dumped under its label."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from launch_cpu_time import chain, find_partition, multi

    lib = ctypes.CDLL(lib_path)
    lib.cg_stop.argtypes = [ctypes.c_char_p]
    torch.set_num_threads(1)

    def region(label, fn):
        for _ in range(300):
            fn()
        lib.cg_start()
        for _ in range(CALLS):
            fn()
        lib.cg_stop(label.encode())

    n = int(os.environ.get("N", "16"))
    graphs = {f"chain-{n}": (chain, tuple(torch.randn(n) for _ in range(3))),
              "multi-64x64": (multi, (torch.randn(64, 64), torch.randn(64)))}
    for name, (fn, args) in graphs.items():
        torch._dynamo.reset()
        f = torch.compile(fn, backend="opfuse")
        f(*args)
        part, pargs = find_partition(f, args)
        tensors = [pargs[i] for i in part.tensor_positions]
        lay = part.layout_of(tensors)
        outs = [torch.empty_strided(s, st, dtype=d) for s, st, d in lay.out_specs]
        ptrs = [t.data_ptr() for t in tensors] + [o.data_ptr() for o in outs]
        region(f"{name}|torch.compile", lambda: f(*args))
        region(f"{name}|partition", lambda: part(*pargs))
        region(f"{name}|run", lambda: lay.prepared.launch(ptrs, 0))
        region(f"{name}|empty loop", lambda: None)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--inside":
        import opfuse  # noqa: F401  (registers the backend)
        measure(sys.argv[2])
        return
    work = tempfile.mkdtemp(prefix="opfuse-cg-")
    src, lib = os.path.join(work, "marker.c"), os.path.join(work, "libmarker.so")
    with open(src, "w") as f:
        f.write(MARKER)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", lib, src], check=True)
    out = os.path.join(work, "cg.out")
    subprocess.run(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
                    sys.executable, os.path.abspath(__file__), "--inside", lib], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    counts = {}
    for p in glob.glob(out + ".*"):
        text = open(p).read()
        label = re.search(r"Client Request: (.*)", text)
        total = re.search(r"^(?:totals|summary): (\d+)", text, re.M)
        if label and total:
            counts[label.group(1).strip()] = int(total.group(1)) / CALLS
    for label in sorted(counts, key=lambda k: (k.split("|")[0], k)):
        graph, layer = label.split("|")
        if layer != "empty loop":
            print(f"{graph:14s} {layer:14s} {counts[label] - counts[graph + '|empty loop']:10.0f} instructions/call")


if __name__ == "__main__":
    main()
