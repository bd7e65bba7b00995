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
  piece_waits  the ring (correct) with a copy group a 16-byte piece and the
               first pass waiting for each piece just before reading it, not
               for the whole row at the loop's top (block_only_piece_waits)
  no_cluster   block_only without __cluster_dims__: the same persistent grid,
               blocks scheduled alone (rank = blockIdx.x % 8)
  no_cluster_full   no_cluster on every block slot of the GPU (3 an SM, not
               the 45 clusters of 8 the GPCs hold); the ring only
  no_cluster_full_dyn   no_cluster_full with each block's rows taken from a
               counter (atomicAdd), not every (grid / 8)-th: a faster
               block takes more rows (dynamic_rows)
With --timeline each variant also runs once instrumented: when each block
ends, and how that depends on how many blocks share its SM.
With --env "OPFUSE_ROW_STAGE_RING=0" the kernels are the ones without the
in-place ring: a cluster a row, one launch block a slice, no loop over rows.
On sm_90 the ring's cluster reductions push their partials with st.async
(OPFUSE_ROW_CLUSTER_PUSH, the default there); first_only and pair are
written for the barrier.cluster form (--env OPFUSE_ROW_CLUSTER_PUSH=0).

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
    head += TIMELINE_GLOBALS + PIECE_WAIT
    # Both forms of a cluster reduction: barrier.cluster (opf_cluster_reduce) and pushed (OPFUSE_ROW_CLUSTER_PUSH).
    red = re.compile(r"opf_cluster_reduce(?:_push)?<(\w+), 8>\((\w+), opf_smem, [^;]*\);")
    block = lambda m: f"opf_block_reduce<{m.group(1)}>({m.group(2)}, opf_smem);"  # noqa: E731
    pushed = "opf_cluster_reduce_push<" in kern
    found = list(red.finditer(kern))
    n_red = len(found)
    first = kern if n_red < 2 else kern[:found[0].end()] + red.sub(block, kern[found[0].end():])
    only = red.sub(block, kern)
    alone = only.replace("(int)opf_cluster_rank()", "(int)(blockIdx.x % 8)").replace("opf_mbar_init_cluster(opf_xbar);", "")
    alone = re.sub(r"opf_cluster_(sync|arrive|wait)\(\);", "", alone)
    out = [("generated", head + sep + kern, True)]
    if n_red > 1 and not pushed:
        out.append(("first_only", head + sep + first, True))
    pair = None if pushed else pair_variant(kern)
    if pair:
        out.append(("pair", head + sep + pair, True))
    out.append(("block_only", head + sep + only, True))
    after = copies_after(kern)
    if after:
        out.append(("copies_after", head + sep + after, True))
        out.append(("block_only_copies_after", head + sep + copies_after(only), True))
    waits = piece_waits(kern)
    if waits:
        out.append(("piece_waits", head + sep + waits, True))
        out.append(("block_only_piece_waits", head + sep + piece_waits(only), True))
    bare = 'extern "C" __global__ void __launch_bounds__(512, 3)'
    out.append(("no_cluster", head + bare + alone, False))
    out.append(("no_cluster_full", head + bare + alone, False))
    dyn = dynamic_rows(alone)
    if dyn:
        out.append(("no_cluster_full_dyn", head + bare + dyn, False))
    return out


# Per-block start and end times (globaltimer) and SM, written by the
# instrumented copy of each variant (--timeline), and the row tickets of
# dynamic_rows.
TIMELINE_GLOBALS = """
__device__ unsigned long long opf_tl_[3 * 4096];
__device__ int opf_cnt_[8];
__device__ unsigned opf_done_;
static __device__ __forceinline__ unsigned long long opf_gtime_() {
  unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t;
}
static __device__ __forceinline__ unsigned opf_smid_() { unsigned s; asm volatile("mov.u32 %0, %smid;" : "=r"(s)); return s; }
"""


def _body_end(src, start):
    """The index of the "}" closing the brace block opened first at or after start."""
    depth, pos = 0, src.index("{", start)
    for pos in range(pos, len(src)):
        depth += {"{": 1, "}": -1}.get(src[pos], 0)
        if depth == 0:
            return pos
    raise ValueError("unbalanced braces")


def timeline(src):
    """The variant with thread 0 of each block of the staged (_v8) kernel recording its start, end and SM."""
    k = re.search(r"__launch_bounds__\(512, 3\)[^\n]*_v8\(", src).start()
    start = src.index("opf_launch_dependents();\n", k) + len("opf_launch_dependents();\n")
    end = _body_end(src, k)
    return (src[:start] + "  if (threadIdx.x == 0) opf_tl_[3 * blockIdx.x] = opf_gtime_();\n" + src[start:end]
            + "  __syncthreads();\n  if (threadIdx.x == 0) { opf_tl_[3 * blockIdx.x + 1] = opf_gtime_();"
            " opf_tl_[3 * blockIdx.x + 2] = opf_smid_(); }\n" + src[end:])


PIECE_WAIT = """
// Wait for the oldest k + 1 of a thread's 8 copy groups (one a 16-byte piece).
static __device__ __forceinline__ void opf_wait_piece_(int k) {
  switch (k) {
    case 0: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
  }
}
"""


def piece_waits(kern):
    """The in-place ring (correct) with one copy group a piece (a thread's 8
    16-byte pieces of a row) in place of one a row, and the first pass over
    a row waiting for each piece just before reading it (cp.async.wait_group
    7 - k), not for all 8 at the loop's top: the first pass starts while the
    row's last pieces, sent at the end of the previous row's output pass,
    are still in flight. None without the ring."""
    pro = re.search(r"(opf_cp_async16\(sr0_ring_ \+ 0 \* \d+ \+ [^;]*\);)", kern)
    refill = re.search(r"if \(nr_ok_\) (opf_cp_async16\([^;]*\);)", kern)
    top = "opf_cp_async_wait_all();\n"
    if not pro or not refill or top not in kern or "c_ += 4096" not in kern:
        return None
    k = kern.replace(pro.group(1), pro.group(1) + " opf_cp_async_commit();", 1)
    k = k.replace("  opf_cp_async_commit();\n  int par_", "  int par_", 1)  # the prologue's pieces are closed one by one
    k = k.replace(refill.group(0), "{ " + refill.group(0) + " opf_cp_async_commit(); }", 1)
    i = k.index(top)
    k = k[:i] + k[i + len(top):]
    # The first pass as 8 counted pieces (a 32768-column slice, 512 threads), so
    # that unrolling makes each wait's group count a constant.
    loop = "for (int c_ = cbegin_ + (int)tid_ * 8; c_ < cend_; c_ += 4096) {\n"
    j = k.index(loop, i)
    k = (k[:j] + "for (int k_ = 0; k_ < 8; ++k_) {\n      const int c_ = cbegin_ + (int)tid_ * 8 + k_ * 4096;\n"
         "      opf_wait_piece_(k_);\n" + k[j + len(loop):])
    return k


def dynamic_rows(kern):
    """The ring's rows taken from a counter per slice rank (atomicAdd) in
    place of row_ += gridDim.x / 8: a block that runs faster takes more rows,
    as the hardware's block scheduler gives a launch-a-slice kernel. Thread 0
    takes the ticket two rows ahead at the top of each row and publishes it
    before the row's first reduction (whose barrier makes it visible); the
    last block to finish resets the counters for the next launch. For the
    block-only kernels (no cluster); None if the loop is not the ring's."""
    hdr = "for (int row_ = blockIdx.x / 8; row_ < rows; row_ += gridDim.x / 8, par_ ^= 1"
    pro = "if ((int)blockIdx.x / 8 < rows) {\n    int frxrem_ = (int)blockIdx.x / 8;"
    nr = "const int nr_ = row_ + (int)(gridDim.x / 8);"
    if hdr not in kern or pro not in kern or nr not in kern or "opf_block_reduce<" not in kern:
        return None
    take = "atomicAdd(&opf_cnt_[blockIdx.x % 8], 1)"
    k = kern.replace(pro, "__shared__ int opf_tk_[2];\n  if (threadIdx.x == 0) { opf_tk_[0] = " + take + "; opf_tk_[1] = " + take
                     + "; }\n  __syncthreads();\n  const int first_ = opf_tk_[0];\n  int nxt_ = opf_tk_[1];\n"
                     "  if (first_ < rows) {\n    int frxrem_ = first_;")
    k = k.replace(hdr, "for (int row_ = first_; row_ < rows; par_ ^= 1")
    k = k.replace(nr, "const int nr_ = nxt_;\n    int tk_ = 0;\n    if (threadIdx.x == 0) tk_ = " + take + ";")
    i = k.index("opf_block_reduce<", k.index("const int nr_ = nxt_;"))
    i = k.rindex("\n", 0, i) + 1
    k = k[:i] + "    if (threadIdx.x == 0) opf_tk_[par_] = tk_;\n" + k[i:]
    pos = _body_end(k, k.index("for (int row_ = first_;"))
    k = k[:pos] + "  row_ = nr_;\n    nxt_ = opf_tk_[par_];\n  " + k[pos:]
    end = _body_end(k, 0)  # kern starts at the kernel's parameter list
    return (k[:end] + "\n  __syncthreads();\n  if (threadIdx.x == 0) {\n    __threadfence();\n"
            "    if (atomicAdd(&opf_done_, 1u) == gridDim.x - 1) {\n      for (int r = 0; r < 8; ++r) opf_cnt_[r] = 0;\n"
            "      opf_done_ = 0;\n      __threadfence();\n    }\n  }\n" + k[end:])


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


def print_timeline(op, vname, src, tmp, name, grid, smem, stream, params, cluster):
    """One launch of the instrumented variant (after one to warm up): when its
    blocks end, relative to the first block's start, and how that depends on
    how many of the kernel's blocks share an SM."""
    cu, cubin = os.path.join(tmp, f"{op}_{vname}_tl.cu"), os.path.join(tmp, f"{op}_{vname}_tl.cubin")
    open(cu, "w").write(src)
    r = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-O3", "-w", "-o", cubin, cu], capture_output=True, text=True)
    if r.returncode:
        print(f"    timeline: nvcc failed\n{r.stderr[-1500:]}")
        return
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    ck(CU.cuModuleLoad(ctypes.byref(mod), cubin.encode()), "cuModuleLoad")
    ck(CU.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), "cuModuleGetFunction")
    ck(CU.cuFuncSetAttribute(fn, 8, smem), "cuFuncSetAttribute")
    dptr, size = ctypes.c_uint64(), ctypes.c_size_t()
    ck(CU.cuModuleGetGlobal_v2(ctypes.byref(dptr), ctypes.byref(size), mod, b"opf_tl_"), "cuModuleGetGlobal")
    for _ in range(2):
        ck(CU.cuLaunchKernel(fn, grid, 1, 1, 512, 1, 1, smem, ctypes.c_void_p(stream), params, None), "cuLaunchKernel")
    torch.cuda.synchronize()
    buf = (ctypes.c_uint64 * (3 * grid))()
    ck(CU.cuMemcpyDtoH_v2(buf, dptr, ctypes.c_size_t(8 * 3 * grid)), "cuMemcpyDtoH")
    ck(CU.cuModuleUnload(mod), "cuModuleUnload")
    t = torch.tensor(list(buf), dtype=torch.float64).view(grid, 3)
    t0 = t[:, 0].min()
    start, end, sm = (t[:, 0] - t0) / 1e3, (t[:, 1] - t0) / 1e3, t[:, 2].long()
    per_sm = torch.bincount(sm, minlength=int(sm.max()) + 1)
    q = torch.quantile(end, torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64)).tolist()
    by = {int(n): end[per_sm[sm] == n].mean().item() for n in per_sm.unique().tolist() if n > 0}
    print(f"    timeline {vname}: block ends (us after the first start) min {q[0]:.0f} p10 {q[1]:.0f} "
          f"median {q[2]:.0f} p90 {q[3]:.0f} max {q[4]:.0f}; last start {start.max():.1f}; "
          f"SMs used {(per_sm > 0).sum().item()}; mean end by blocks on the SM: "
          + ", ".join(f"{n}: {v:.0f} ({(per_sm == n).sum().item()} SMs)" for n, v in sorted(by.items())))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="softmax,rms_norm,layer_norm")
    ap.add_argument("--shape", default="4096x262144")
    ap.add_argument("--env", default="", help="knobs for the generator, e.g. OPFUSE_ROW_STAGE_RING=0")
    ap.add_argument("--timeline", action="store_true", help="also each block's start, end and SM (one launch)")
    ap.add_argument("--variants", default="", help="only these variants (comma-separated names)")
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
            if a.variants and vname not in a.variants.split(","):
                continue
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
            if "for (int row_" not in vsrc:  # not the ring: a cluster (or 8 blocks) a row, no loop over rows
                if "full" in vname:
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
                grid = full if "full" in vname else min(full, cluster_grid)
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
            if a.timeline:
                print_timeline(op, vname, timeline(vsrc), tmp, name, grid, smem, stream, params, cluster)


if __name__ == "__main__":
    main()
