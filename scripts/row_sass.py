#!/usr/bin/env python3
"""SASS instruction counts of the row-backward kernels for a shape, without
a GPU (branch lnbwd-4): the generated source compiled by NVRTC as the
runtime does (compile_cuda), the cubin disassembled with cuobjdump -sass,
and each kernel's loops counted by instruction class.

  python3 scripts/row_sass.py layer_norm_backward 32768x4096 [--arch 90] [--kernel v8] [--list]

Counting method: a loop is the address range [target, branch] of a
backward branch (`BRA` to a lower address); its body is every instruction
in that range but NOPs. In the kernels counted here no instruction of a
loop body is skipped in steady state (the forward branches inside skip
only bounds-failing columns and the last row's prefetch), so the static
count of the outermost loop is what one warp issues a loop iteration. A
block per row: a warp issues that count a row; lane groups (L lanes a
row): 32 / L rows a warp an iteration. Inner loops (loop stages) are
listed separately with their own counts. The env knobs (OPFUSE_*) apply as
in a real run."""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from row_source import forward_ir, layer_norm_backward_ir, softmax_backward_ir, strides  # noqa: E402


def cuobjdump():
    for p in [os.environ.get("CUOBJDUMP", ""), "/usr/local/cuda/bin/cuobjdump"]:
        if p and os.path.exists(p):
            return p
    try:
        import triton  # ships cuobjdump beside its ptxas
        p = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        if os.path.exists(p):
            return p
    except ImportError:
        pass
    raise SystemExit("no cuobjdump (set CUOBJDUMP)")


LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*(/\*.*)?$")


def functions(sass):
    """{name: [(address, text)]} from cuobjdump -sass output."""
    out, name = {}, None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        m = LINE.match(line)
        if name and m and m.group(2):
            out[name].append((int(m.group(1), 16), m.group(2).rstrip(" ;")))
    return out


def opcode(text):
    t = re.sub(r"^@!?U?P\w+\s+", "", text)
    return t.split()[0] if t else ""


def category(text):
    """The class an instruction counts in (see the module doc)."""
    op = opcode(text)
    base = op.split(".")[0]
    if base == "NOP":
        return None
    if base in ("LDG", "LD", "LDS", "LDSM", "LDL"):
        return "load"
    if base in ("STG", "ST", "STS", "STL"):
        return "store"
    if base in ("CCTL",):
        return "prefetch"
    if base in ("SHFL",):
        return "shuffle"
    if base in ("BAR", "MEMBAR", "WARPSYNC", "ERRBAR", "CCTL"):
        return "barrier"
    if base in ("FADD", "FMUL", "FFMA", "FMNMX", "MUFU", "FCHK", "HFMA2", "HADD2", "HMUL2") and "MMA" not in op:
        return "fp math"
    if base in ("F2F", "F2FP", "PRMT", "I2F", "F2I", "I2FP", "F2IP"):
        return "convert/pack"
    if base == "SHF" and re.search(r"SHF\.L\.U32 \S+, \S+, 0x10, RZ", text):
        return "convert/pack"  # bf16 -> float (the 16 bits up)
    if base == "LOP3" and "0xffff0000" in text:
        return "convert/pack"  # bf16 -> float (the high lane in place)
    operands = text.split(None, 1)[1] if " " in text and opcode(text) == text.split()[0] else re.sub(r"^@\S+\s+\S+\s*", "", text)
    if (base == "IMAD" and "WIDE" in op) or "X" in op.split(".")[1:] or "EX" in op.split(".") or "U64" in op or \
            (base in ("IADD3", "LEA") and re.match(r"\S+, !?P\d", operands)):
        return "64-bit index"  # (the high word's IMADs of a 64-bit product count as int)
    if base in ("ISETP", "FSETP", "PLOP3", "P2R", "R2P", "BRA", "BSSY", "BSYNC", "EXIT", "SEL", "FSEL", "BRX", "RET", "CALL"):
        return "predicate/branch"
    if base.startswith("U") or base in ("S2UR", "R2UR"):
        return "uniform"
    if base in ("MOV", "CS2R", "S2R", "LDC", "IMAD") and (op == "IMAD.MOV.U32" or base != "IMAD"):
        return "move/special"
    return "int"


def loops(instrs):
    """(start, end) address ranges of backward branches, outermost first."""
    out = []
    for addr, text in instrs:
        m = re.match(r"(@!?P\w+\s+)?BRA(\.\w+)* (0x[0-9a-f]+)", text)
        if m and int(m.group(3), 16) <= addr:
            out.append((int(m.group(3), 16), addr))
    return sorted(out, key=lambda r: r[0] - r[1])


def count(instrs, lo, hi):
    c = Counter()
    for addr, text in instrs:
        if lo <= addr <= hi:
            k = category(text)
            if k:
                c[k] += 1
    return c


ORDER = ["load", "store", "prefetch", "fp math", "convert/pack", "shuffle", "64-bit index", "int", "move/special", "uniform",
         "predicate/branch", "barrier"]


def sass_of(op, shape, arch):
    from opfuse import _C
    r, c = (int(v) for v in shape.split("x"))
    if op == "softmax_backward":
        ir, shapes = softmax_backward_ir(r, c), [[r, c], [r, c]]
    elif op in ("softmax", "log_softmax", "layer_norm", "rms_norm"):
        ir = forward_ir(op, r, c)
        shapes = [[r, c]] + [[c]] * {"layer_norm": 2, "rms_norm": 1}.get(op, 0)
    else:
        ir, shapes = layer_norm_backward_ir(r, c), [[r, c], [r, c], [r, 1], [r, 1], [c]]
    cg = _C.CompiledGraph(ir, target="cuda")
    cubin, _, log = cg.compile_cuda(shapes, strides(shapes), arch, False)
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.cubin")
        with open(p, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([cuobjdump(), "-sass", p], capture_output=True, text=True, check=True).stdout
    from opfuse.testing import ptxas_report
    regs = {}
    for name, (nregs, spill) in ptxas_report(log).items():
        regs[name] = nregs
        if spill:
            regs[name + " SPILLS"] = spill
    return functions(sass), regs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("op")
    ap.add_argument("shape")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--kernel", default="", help="only kernels whose name contains this")
    ap.add_argument("--list", action="store_true", help="print each loop's instructions")
    a = ap.parse_args()
    funcs, regs = sass_of(a.op, a.shape, a.arch)
    for name, instrs in funcs.items():
        if "take_error" in name or a.kernel not in name:
            continue
        total = sum(1 for _, t in instrs if category(t))
        spill = regs.get(name + " SPILLS", 0)
        print(f"{name}: {total} instructions, {regs.get(name, '?')} registers{', SPILLS ' + str(spill) if spill else ''}")
        for lo, hi in loops(instrs):
            c = count(instrs, lo, hi)
            print(f"  loop [{lo:#x}, {hi:#x}]: {sum(c.values())}  " + "  ".join(f"{k} {c[k]}" for k in ORDER if c[k]))
            if a.list:
                for addr, text in instrs:
                    if lo <= addr <= hi and category(text):
                        print(f"    {addr:05x} {category(text):16s} {text}")


if __name__ == "__main__":
    main()
