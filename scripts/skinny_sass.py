#!/usr/bin/env python3
"""The order of weight loads and MMAs in the skinny GEMM's SASS, without a
GPU: each config compiled by NVRTC as the launcher does, the cubin
disassembled (nvdisasm, or cuobjdump -sass; NVDISASM=path to pick one), and
every backward branch's loop body printed as runs of W loads (L, the
ld.global.nc.L1::no_allocate 128-bit loads) and MMAs (H), e.g. "L8 H16 L8
H16" for a loop unrolled twice with every load ahead of the MMAs it does not
feed.

Why: the pipelined configs (p1) mean to keep a warp's next chunk in flight
while it runs this chunk's MMAs, but ptxas may schedule an MMA ahead of the
next chunk's loads (register reuse); then the warp waits with one chunk in
flight, not two. p2 writes the same pipeline as a ping-pong that keeps the
order (docs/perf-notes.md, "H200, session 15").

  python3 scripts/skinny_sass.py n8u1w8b1c2p1 n8u1w8b1c2p2 [--arch 90] [--elem bf16]
"""
import argparse
import os
import re
import shutil
import subprocess
import tempfile

from opfuse import _C


def disassemble(cubin: bytes) -> str:
    tool = os.environ.get("NVDISASM") or shutil.which("nvdisasm") or shutil.which("cuobjdump")
    if not tool:
        raise SystemExit("needs nvdisasm or cuobjdump (pip install nvidia-cuda-nvdisasm, then NVDISASM=...)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        args = [tool, "-sass", f.name] if tool.endswith("cuobjdump") else [tool, "-c", f.name]
        return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def runs(body: list[str]) -> str:
    """Runs of W loads (L) and MMAs (H), other instructions left out."""
    seq = []
    for text in body:
        kind = "L" if "LDG" in text and ".NA." in text else "H" if "HMMA" in text else None
        if not kind:
            continue
        if seq and seq[-1][0] == kind:
            seq[-1][1] += 1
        else:
            seq.append([kind, 1])
    return " ".join(f"{k}{n}" for k, n in seq)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--elem", default="bf16")
    args = ap.parse_args()
    for tag in args.configs:
        cubin, log = _C.skinny_gemm_compile(args.elem, tag, args.arch)
        regs = re.search(r"Used (\d+) registers", log)
        sass = disassemble(cubin)
        print(f"{tag} sm_{args.arch} {args.elem}: {regs.group(1) if regs else '?'} registers")
        for start, end, body in loop_bodies(sass):
            print(f"  loop {start:#06x}-{end:#06x}: {body}")


def loop_bodies(sass: str) -> list[tuple[int, int, str]]:
    """Each backward branch's body [target, branch] as runs of L and H."""
    label_at, pending = {}, []
    rows = []
    for line in sass.splitlines():
        lab = re.match(r"\s*(\.L_x_\d+):", line)
        if lab:
            pending.append(lab.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            addr = int(m.group(1), 16)
            for name in pending:
                label_at[name] = addr
            pending = []
            rows.append((addr, m.group(2)))
    out = []
    for addr, text in rows:
        if "BRA" not in text:
            continue
        t = re.search(r"(\.L_x_\d+)", text)
        target = label_at.get(t.group(1)) if t else None
        if target is None:
            a = re.search(r"0x([0-9a-f]+)", text)
            target = int(a.group(1), 16) if a else None
        if target is not None and target < addr:
            body = [x for a, x in rows if target <= a <= addr]
            out.append((target, addr, runs(body)))
    return out


if __name__ == "__main__":
    main()
