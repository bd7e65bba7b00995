#!/usr/bin/env python3
"""Prints the generated CUDA source and ptxas report of the row-backward
kernels (softmax_backward, layer_norm_backward) for a shape, without a GPU:
  python3 scripts/row_source.py softmax_backward 8192x32768 [--arch 90] [--src]
The env knobs (OPFUSE_ROW_*) apply as in a real run."""
import argparse
import re

from opfuse import _C


def softmax_backward_ir(rows, cols, dt="bf16"):
    return f"""graph {{
  %0 = input() {{name="dy"}} : {dt}[{rows}, {cols}]
  %1 = input() {{name="y"}} : {dt}[{rows}, {cols}]
  %2 = softmax_backward(%0, %1) {{dim=1}} : {dt}[{rows}, {cols}]
  return (%2)
}}"""


def layer_norm_backward_ir(rows, cols, dt="bf16"):
    return f"""graph {{
  %0 = input() {{name="dy"}} : {dt}[{rows}, {cols}]
  %1 = input() {{name="x"}} : {dt}[{rows}, {cols}]
  %2 = input() {{name="mean"}} : f32[{rows}, 1]
  %3 = input() {{name="rstd"}} : f32[{rows}, 1]
  %4 = input() {{name="w"}} : {dt}[{cols}]
  %5 = layer_norm_backward(%0, %1, %2, %3, %4) {{normalized_ndim=1}} : {dt}[{rows}, {cols}]
  %6 = cast(%0) {{dtype=f32}} : f32[{rows}, {cols}]
  %7 = cast(%1) {{dtype=f32}} : f32[{rows}, {cols}]
  %8 = sub(%7, %2) : f32[{rows}, {cols}]
  %9 = mul(%8, %3) : f32[{rows}, {cols}]
  %10 = mul(%6, %9) : f32[{rows}, {cols}]
  %11 = sum(%10) {{dims=[0], keepdim=false}} : f32[{cols}]
  %12 = cast(%11) {{dtype={dt}}} : {dt}[{cols}]
  %13 = sum(%6) {{dims=[0], keepdim=false}} : f32[{cols}]
  %14 = cast(%13) {{dtype={dt}}} : {dt}[{cols}]
  return (%5, %12, %14)
}}"""


def forward_ir(op, rows, cols, dt="bf16"):
    if op in ("layer_norm", "rms_norm"):  # with a weight (and bias), eps as the bench's
        ins = '  %1 = input() {name="w"} : ' + f"{dt}[{cols}]\n"
        args = "%0, %1"
        if op == "layer_norm":
            ins += '  %2 = input() {name="b"} : ' + f"{dt}[{cols}]\n"
            args += ", %2"
        n = 3 if op == "layer_norm" else 2
        return (f"graph {{\n  %0 = input() {{name=\"x\"}} : {dt}[{rows}, {cols}]\n{ins}"
                f"  %{n} = {op}({args}) {{normalized_ndim=1, eps=1e-5}} : {dt}[{rows}, {cols}]\n  return (%{n})\n}}")
    return f"""graph {{
  %0 = input() {{name="x"}} : {dt}[{rows}, {cols}]
  %1 = {op}(%0) {{dim=1}} : {dt}[{rows}, {cols}]
  return (%1)
}}"""


def strides(shapes):
    out = []
    for s in shapes:
        st, acc = [], 1
        for d in reversed(s):
            st.insert(0, acc)
            acc *= d
        out.append(st)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("op")
    ap.add_argument("shape")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--src", action="store_true")
    a = ap.parse_args()
    r, c = (int(v) for v in a.shape.split("x"))
    if a.op == "softmax_backward":
        ir, shapes = softmax_backward_ir(r, c), [[r, c], [r, c]]
    elif a.op == "layer_norm_backward":
        ir, shapes = layer_norm_backward_ir(r, c), [[r, c], [r, c], [r, 1], [r, 1], [c]]
    else:
        ir = forward_ir(a.op, r, c)
        shapes = [[r, c]] + [[c]] * {"layer_norm": 2, "rms_norm": 1}.get(a.op, 0)
    cg = _C.CompiledGraph(ir, target="cuda")
    print(cg.plan_text())
    src = cg.cuda_source(shapes, strides(shapes), a.arch)
    if a.src:
        print(src)
    _, _, log = cg.compile_cuda(shapes, strides(shapes), a.arch, False)
    for line in log.splitlines():
        if re.search(r"Compiling entry|registers|spill", line):
            print(line.strip())


if __name__ == "__main__":
    main()
