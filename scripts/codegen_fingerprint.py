#!/usr/bin/env python3
"""Fingerprints of the generated row and column kernels, without a GPU: the
CUDA source of forward norms and softmaxes (with and without weights),
statistics, and the row backward kernels, at 11 shapes, 3 dtypes, sm_80 and
sm_90 and 26 settings of the OPFUSE_ROW_* knobs. One line a case,
key<TAB>hash of the source. For refactors of the emitter that must not
change what it prints:
  .venv/bin/python scripts/codegen_fingerprint.py /tmp/before.txt
  (change, rebuild)
  .venv/bin/python scripts/codegen_fingerprint.py /tmp/after.txt && diff /tmp/before.txt /tmp/after.txt
(A change to the prelude's text changes every hash.)"""
import hashlib
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from test_cuda_codegen import row_ir, backward_ir
from opfuse import _C
from opfuse.testing import contiguous_strides

def affine_ir(op, dt, rows, cols):
    if op == "layer_norm":
        body = f"""  %1 = input() {{name="w"}} : {dt}[{cols}]
  %2 = input() {{name="b"}} : {dt}[{cols}]
  %3 = layer_norm(%0, %1, %2) {{normalized_ndim=1, eps=0.00001}} : {dt}[{rows}, {cols}]
  return (%3)"""
    else:
        body = f"""  %1 = input() {{name="w"}} : {dt}[{cols}]
  %2 = rms_norm(%0, %1) {{normalized_ndim=1, eps=0.000001}} : {dt}[{rows}, {cols}]
  return (%2)"""
    return f"""graph {{
  %0 = input() {{name="x"}} : {dt}[{rows}, {cols}]
{body}
}}"""

def stats_ir(dt, rows, cols):
    return f"""graph {{
  %0 = input() {{name="x"}} : {dt}[{rows}, {cols}]
  %1 = sum(%0) {{dims=[1], keepdim=false}} : {dt}[{rows}]
  %2 = amax(%0) {{dims=[1], keepdim=false}} : {dt}[{rows}]
  %3 = argmax(%0) {{dims=[1], keepdim=false}} : i64[{rows}]
  %4 = var(%0) {{dims=[1], keepdim=true, correction=1}} : {dt}[{rows}, 1]
  %5 = sum(%0) {{dims=[0], keepdim=false}} : {dt}[{cols}]
  return (%1, %2, %3, %4, %5)
}}"""

SHAPES = [(32768, 4096), (8192, 32768), (4096, 262144), (262144, 256), (401, 32776), (211, 70000), (7, 1000), (13, 40001),
          (5, 33), (97, 131072), (3, 1025)]
KNOBS = [{}, {"OPFUSE_ROW_GROUP_EXCHANGE": "1"}, {"OPFUSE_ROW_GROUP_EXCHANGE": "0"}, {"OPFUSE_ROW_GROUP_LOCAL": "1"}, {"OPFUSE_ROW_GROUP_LOCAL": "0"},
         {"OPFUSE_ROW_GROUP_EXCHANGE": "1", "OPFUSE_ROW_GROUP_LOCAL": "1"},
         {"OPFUSE_ROW_STAGE_ONLINE": "1", "OPFUSE_ROW_STAGE_MOMENTS": "1"},
         {"OPFUSE_ROW_GROUP_EXCHANGE": "1", "OPFUSE_ROW_STAGE_ONLINE": "1", "OPFUSE_ROW_STAGE_MOMENTS": "1"},
         {"OPFUSE_ROW_SMEM_KB": "0"}, {"OPFUSE_ROW_CLUSTER_PUSH": "0"}, {"OPFUSE_ROW_STAGE_RING": "0"},
         {"OPFUSE_ROW_ISSUE": "0"}, {"OPFUSE_ROW_LEAN": "0"}, {"OPFUSE_ROW_LEAN": "1"}, {"OPFUSE_ROW_MAX_CLUSTER": "8"},
         {"OPFUSE_ROW_GROUP_LOOP": "1"}, {"OPFUSE_ROW_PIPELINE": "1"}, {"OPFUSE_ROW_ALTERNATE": "1"},
         {"OPFUSE_ROW_L2_HINTS": "1"}, {"OPFUSE_ROW_SMEM_KB": "32", "OPFUSE_ROW_SMEM_CLUSTER": "16"},
         {"OPFUSE_ROW_SMEM_TENSORS": "1"}, {"OPFUSE_ROW_PREFETCH": "1"}, {"OPFUSE_ROW_SMEM_PREFETCH": "1"},
         {"OPFUSE_ROW_BLOCK_PARTIALS": "0"}, {"OPFUSE_ROW_REVERSE_LOOPS": "0"}, {"OPFUSE_ROW_RAW_LANES": "0"}]

def graphs():
    for rows, cols in SHAPES:
        for dt in ("bf16", "f16", "f32"):
            for op in ("softmax", "log_softmax", "layer_norm", "rms_norm"):
                yield f"{op}-{dt}-{rows}x{cols}", row_ir(op, dt, rows, cols), [[rows, cols]]
            for op in ("layer_norm", "rms_norm"):
                yield f"{op}-affine-{dt}-{rows}x{cols}", affine_ir(op, dt, rows, cols), [[rows, cols], [cols]] + ([[cols]] if op == "layer_norm" else [])
            if rows * cols <= 2 ** 26:
                yield f"stats-{dt}-{rows}x{cols}", stats_ir(dt, rows, cols), [[rows, cols]]
        yield f"backward-{rows}x{cols}", backward_ir(rows, cols), [[rows, cols]] * 3 + [[cols]]

out = open(sys.argv[1], "w")
errors = 0
for (name, ir, shapes), knobs in itertools.product(list(graphs()), KNOBS):
    for k in list(os.environ):
        if k.startswith("OPFUSE_ROW"):
            del os.environ[k]
    os.environ.update(knobs)
    cg = _C.CompiledGraph(ir, target="cuda")
    for arch in (80, 90):
        key = f"{name}|{arch}|{','.join(f'{k}={v}' for k, v in sorted(knobs.items()))}"
        try:
            src = cg.cuda_source(shapes, contiguous_strides(shapes), arch)
            h = hashlib.sha256(src.encode()).hexdigest()[:16]
        except Exception as e:
            h = "ERR " + str(e).splitlines()[0][:80]
            errors += 1
        out.write(f"{key}\t{h}\n")
print("errors", errors)
