#!/usr/bin/env python3
"""What the cluster-staged long rows (issue 3: bf16 4096x262144, 77-85% of the
copy where a block-per-row kernel with the same 64 KB slice reaches 96%) pay for
being a cluster: opfuse's generated kernel is timed as generated and with its
cluster reductions cut down. The cut variants compute WRONG results on purpose:
they measure what the synchronisation costs and are never kernels to ship.

Variants (textual edits of the generated source, compiled with nvcc -cubin,
launched through the driver API beside a device copy of the same bytes):
  generated    the kernel opfuse launches (checked against float64 on 4 rows)
  first_only   the first cluster reduction of a row real, later ones block-only
  copies_after the in-place ring (correct) with the next row's copies sent
               after the output pass, not interleaved with its stores
               (block_only_copies_after: the same with block-only reductions)
  pair         correct, ONE cluster reduction a row: softmax / log_softmax
               combine per-thread (max, sum of exp) pairs, layer_norm
               per-thread (count, mean, squared deviations) (pair_variant)
  block_only   every reduction block-only; still clusters of 8 (co-scheduled,
               the kernel's last cluster barrier kept)
  no_cluster   block_only without __cluster_dims__: the same persistent grid,
               blocks scheduled alone (rank = blockIdx.x % 8)
  no_cluster_full   no_cluster on every block slot of the GPU (3 an SM, not
               the 45 clusters of 8 the GPCs hold); the ring only
With --env "OPFUSE_ROW_STAGE_RING=0" the kernels are the ones without the
in-place ring: a cluster a row, one launch block a slice, no loop over rows.
With --env "OPFUSE_ROW_CLUSTER_PUSH=1" `generated` is the kernel whose cluster
reductions push their partials with st.async; only it and copies_after run.

  python3 scripts/micro/staged_rows_sync_cost.py [--ops softmax,rms_norm] [--shape 4096x262144]
Needs a GPU, nvcc and an opfuse build (for the generator)."""
import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from row_source import forward_ir, strides  # noqa: E402

from opfuse import _C  # noqa: E402
from opfuse.bench.timing import back_to_back_us  # noqa: E402


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gx", ctypes.c_uint), ("gy", ctypes.c_uint), ("gz", ctypes.c_uint), ("bx", ctypes.c_uint),
                ("by", ctypes.c_uint), ("bz", ctypes.c_uint), ("smem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("nattrs", ctypes.c_uint)]


CU = None  # libcuda, loaded in main() (the generator part runs without a GPU)


def ck(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


def variants(src):
    """(name, source, cluster) for each variant; the kernel is the _v8 (staged) entry."""
    head, sep, kern = src.partition('extern "C" __global__ void __launch_bounds__(512, 3) __cluster_dims__(8, 1, 1)')
    assert sep, "no cluster-staged kernel in the generated source"
    head = head.replace("typedef long long int64_t;", "")  # nvcc has <stdint.h>'s (long)
    red = re.compile(r"opf_cluster_reduce<(\w+), 8>\((\w+), opf_smem, [^;]*\);")
    block = lambda m: f"opf_block_reduce<{m.group(1)}>({m.group(2)}, opf_smem);"  # noqa: E731
    found = list(red.finditer(kern))
    n_red = len(found)
    first = kern if n_red < 2 else kern[:found[0].end()] + red.sub(block, kern[found[0].end():])
    only = red.sub(block, kern)
    alone = only.replace("(int)opf_cluster_rank()", "(int)(blockIdx.x % 8)")
    alone = re.sub(r"opf_cluster_(sync|arrive|wait)\(\);", "", alone)
    out = [("generated", head + sep + kern, True)]
    if "opf_cluster_reduce_push<" in kern:  # OPFUSE_ROW_CLUSTER_PUSH: nothing to cut, and no kernel without its cluster
        after = copies_after(kern)
        return out + ([("copies_after", head + sep + after, True)] if after else [])
    if n_red > 1:
        out.append(("first_only", head + sep + first, True))
    pair = pair_variant(kern)
    if pair:
        out.append(("pair", head + sep + pair, True))
    out.append(("block_only", head + sep + only, True))
    after = copies_after(kern)
    if after:
        out.append(("copies_after", head + sep + after, True))
        out.append(("block_only_copies_after", head + sep + copies_after(only), True))
    bare = 'extern "C" __global__ void __launch_bounds__(512, 3)'
    out.append(("no_cluster", head + bare + alone, False))
    out.append(("no_cluster_full", head + bare + alone, False))
    return out


def copies_after(kern):
    """The in-place ring (correct) with the next row's copies sent in a loop of
    their own after the output pass, not one after each output vector's
    store. None without the ring."""
    m = re.search(r"\n(\s*)if \(nr_ok_\) (opf_cp_async16\([^;]*\);)\n(\s*)\}\n", kern)
    if not m:
        return None
    loop = (f"{m.group(3)}if (nr_ok_) {{\n{m.group(3)}  #pragma unroll 8\n"
            f"{m.group(3)}  for (int c_ = cbegin_ + (int)tid_ * 8; c_ < cend_; c_ += 4096) {m.group(2)}\n{m.group(3)}}}\n")
    return kern[:m.start()] + f"\n{m.group(3)}}}\n" + loop + kern[m.end():]


def pair_variant(kern):
    """softmax / log_softmax with ONE cluster reduction a row (correct, not a
    measurement trick): each thread's max over its own values, then its sum of
    exp(x - that max), with no barrier between; the (max, sum) pairs then
    combine across the block and cluster (opf_cluster_online), and the output
    pass uses the row's max. None for other kernels."""
    if "opf_max" not in kern:
        return moments_pair_variant(kern)
    m = re.search(r"(\w+) = opf_cluster_reduce<opf_max, 8>\(\1, opf_smem, [^;]*\);\n\s*const float (\w+) = \(float\)\1;", kern)
    s = re.search(r"(\w+) = opf_cluster_reduce<opf_sum, 8>\(\1, opf_smem, [^;]*\);", kern)
    if not m or not s or s.start() < m.end():
        return None
    mx, mv, sm = m.group(1), m.group(2), s.group(1)
    slot = "0 + par_" if "par_" in kern else "0"  # the in-place ring alternates slots by row parity
    before = kern[:m.start()] + f"const float {mv} = {mx};" + kern[m.end():s.start()]
    combine = (f"opf_cluster_online<true, 8>({mx}, {sm}, opf_smem, reinterpret_cast<float*>(&opf_cslot[{slot}]));\n"
               f"    const float {mv}r_ = {mx};")
    after = re.sub(r"\b" + mv + r"\b", mv + "r_", kern[s.end():])
    return before + combine + after


def moments_pair_variant(kern):
    """layer_norm with ONE cluster reduction a row: each thread's mean of its
    own values, then its squared deviations around that mean, with no
    barrier between; (count, mean, squared deviations) then combine across
    the block and cluster (Chan's update, opf_cluster_moments), and the
    output pass uses the row's mean. None for other kernels."""
    m = re.search(r"(\w+) = opf_cluster_reduce<opf_sum, 8>\(\1, opf_smem, [^;]*\);\n"
                  r"\s*const float (\w+) = \(float\)\(\1 / \(float\)\((\d+)LL\)\);", kern)
    if not m:
        return None
    s = re.search(r"(\w+) = opf_cluster_reduce<opf_sum, 8>\(\1, opf_smem, [^;]*\);", kern[m.end():])
    if not s or f"- {m.group(2)})" not in kern[m.end():m.end() + s.start()]:
        return None
    sm, mv, sq = m.group(1), m.group(2), s.group(1)
    count = "const float wn_ = (float)(8 * ((cend_ - cbegin_ - (int)tid_ * 8 + 4095) / 4096));\n    "
    before = kern[:m.start()] + count + f"const float {mv} = wn_ > 0.0f ? {sm} / wn_ : 0.0f;"
    mid = kern[m.end():m.end() + s.start()]
    slot = "2 * par_" if "par_" in kern else "0"  # 12 bytes: two 8-byte slots (a pair of them in the ring)
    combine = (f"float n_ = wn_, mm_ = {mv};\n"
               f"    opf_cluster_moments<8>(n_, mm_, {sq}, opf_smem, reinterpret_cast<float*>(&opf_cslot[{slot}]));\n"
               f"    const float {mv}r_ = mm_;")
    after = re.sub(r"\b" + mv + r"\b", mv + "r_", kern[m.end() + s.end():])
    return before + mid + combine + after


def reference(op, x, w, b):
    x = x.double()
    if op == "softmax":
        return torch.softmax(x, -1)
    if op == "log_softmax":
        return torch.log_softmax(x, -1)
    if op == "rms_norm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w.double(), b.double(), 1e-5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="softmax,rms_norm,layer_norm")
    ap.add_argument("--shape", default="4096x262144")
    ap.add_argument("--env", default="", help="knobs for the generator, e.g. OPFUSE_ROW_STAGE_RING=0")
    a = ap.parse_args()
    for kv in a.env.split():
        k, v = kv.split("=", 1)
        os.environ[k] = v
    rows, cols = (int(v) for v in a.shape.split("x"))
    global CU
    CU = ctypes.CDLL("libcuda.so.1")
    torch.cuda.init()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, cols, device=dev, generator=g).to(torch.bfloat16)
    w = (torch.rand(cols, device=dev, generator=g) + 0.5).to(torch.bfloat16)
    bias = torch.randn(cols, device=dev, generator=g).to(torch.bfloat16)
    y = torch.empty_like(x)
    cpy = torch.empty_like(x)
    stream = torch.cuda.current_stream().cuda_stream
    nbytes = 2 * x.numel() * x.element_size()
    copy_us = back_to_back_us(lambda: cpy.copy_(x), iters=5, trials=25)
    print(f"{rows}x{cols} bf16 {a.env}: copy {copy_us:.1f} us = {nbytes / copy_us / 1e3:.0f} GB/s")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tmp = tempfile.mkdtemp()
    for op in a.ops.split(","):
        ir = forward_ir(op, rows, cols)
        ins = [x] + {"layer_norm": [w, bias], "rms_norm": [w]}.get(op, [])
        shapes = [list(t.shape) for t in ins]
        src = _C.CompiledGraph(ir, target="cuda").cuda_source(shapes, strides(shapes), 90)
        name = re.search(r'__cluster_dims__\(8, 1, 1\) (\w+)\(', src).group(1)
        nb = int(re.search(name + r"_args \{ const void\* b\[(\d+)\]", src).group(1))
        assert "+ 32768 < cols" in src, "expected 32768-column slices (64 KB a block)"
        smem = 65536
        ref = reference(op, x[[0, 1, rows // 2, rows - 1]], w, bias)

        class Args(ctypes.Structure):
            _fields_ = [("b", ctypes.c_void_p * nb), ("s", ctypes.c_int64 * 1), ("st", ctypes.c_int64 * nb)]

        args = Args()
        for i, t in enumerate(ins + [y]):
            args.b[i] = t.data_ptr()
        args.st[0] = cols
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(args), ctypes.c_void_p))
        cluster_grid = 0
        for vname, vsrc, cluster in variants(src):
            cu, cubin = os.path.join(tmp, f"{op}_{vname}.cu"), os.path.join(tmp, f"{op}_{vname}.cubin")
            open(cu, "w").write(vsrc)
            r = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-O3", "-w", "-Xptxas", "-v", "-o", cubin, cu],
                               capture_output=True, text=True)
            if r.returncode:
                print(f"  {op} {vname}: nvcc failed\n{r.stderr[-2000:]}")
                continue
            regs = re.findall(r"entry function '" + name + r"'[^\n]*\n(?:[^\n]*\n)*?[^\n]*Used (\d+) registers", r.stderr)
            mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
            ck(CU.cuModuleLoad(ctypes.byref(mod), cubin.encode()), "cuModuleLoad")
            ck(CU.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), "cuModuleGetFunction")
            ck(CU.cuFuncSetAttribute(fn, 8, smem), "cuFuncSetAttribute")
            if "gridDim.x / 8" not in vsrc:  # not the ring: a cluster (or 8 blocks) a row, no loop over rows
                if vname.endswith("full"):
                    continue
                grid = rows * 8
            elif cluster:
                cfg = LaunchConfig(8, 1, 1, 512, 1, 1, smem, None, None, 0)
                n = ctypes.c_int()
                ck(CU.cuOccupancyMaxActiveClusters(ctypes.byref(n), fn, ctypes.byref(cfg)), "cuOccupancyMaxActiveClusters")
                grid = min(n.value, rows) * 8
            else:
                n = ctypes.c_int()
                ck(CU.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), fn, 512, ctypes.c_size_t(smem)),
                   "cuOccupancyMaxActiveBlocksPerMultiprocessor")
                full = n.value * sms // 8 * 8
                grid = full if vname.endswith("full") else min(full, cluster_grid)
            if cluster:
                cluster_grid = grid

            def launch(fn=fn, grid=grid):
                ck(CU.cuLaunchKernel(fn, grid, 1, 1, 512, 1, 1, smem, ctypes.c_void_p(stream), params, None),
                   "cuLaunchKernel")

            y.zero_()
            launch()
            torch.cuda.synchronize()
            err = ((y[[0, 1, rows // 2, rows - 1]].double() - ref).abs() / (ref.abs() + 1e-2)).max().item()
            us = back_to_back_us(launch, iters=5, trials=25)
            print(f"  {op:<11} {vname:<16} grid {grid:4d}  regs {','.join(regs):<6} {us:8.1f} us "
                  f"{nbytes / us / 1e3:6.0f} GB/s {100 * copy_us / us:5.1f}% of the copy   max rel err {err:.2g}"
                  + ("" if vname in ("generated", "pair", "copies_after") else " (wrong on purpose)"))
            ck(CU.cuModuleUnload(mod), "cuModuleUnload")


if __name__ == "__main__":
    main()
