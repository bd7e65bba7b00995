"""The Hopper backward (src/kernels/attention/attention_bwd_sm90.cu) for the ctypes harness.

Configurations, NVRTC compilation for sm_90a (one program: attention_ptx.cu,
attention_sm90_ptx.cu, attention_bwd.cu for AttnBwdParams and its preprocess
and dQ-convert kernels, then attention_bwd_sm90.cu), the tensor maps and the
launch sequence. attn_bwd_runtime.AttentionBackward dispatches here on sm_90
for D = 64 and 128 in atomic (non-deterministic) mode unless
OPFUSE_ATTN_BWD_SM90=0.
"""

from __future__ import annotations

import dataclasses
import os
import re
import ctypes

import attn_runtime as ar
import attn_runtime_sm90 as fs

KERNEL_DIR = ar.REPO / "src" / "kernels" / "attention"
SOURCES = ("attention_ptx.cu", "attention_sm90_ptx.cu", "attention_bwd.cu", "attention_bwd_sm90.cu")
SOURCE_NAME = "attention_bwd_sm90.cu"
HEAD_DIMS = (64, 128)
BLOCK_N = 128  # keys per CTA
THREADS = 384  # producer + two consumer warpgroups
SMEM_LIMIT = 227 * 1024


def source() -> str:
    return "\n".join((KERNEL_DIR / f).read_text() for f in SOURCES)


# DQ_MODE of the kernel (attention_bwd_sm90.cu): 0 red.global from registers,
# 1 staged per warp in shared memory + per-row bulk reductions issued by the
# consumer lanes, 2 staged per block + bulk reductions by a writer thread of
# the producer warpgroup.
DQ_SUFFIX = {0: "", 1: "q", 2: "w"}
# OPTS of the kernel (a bit set, BwdSm90Tile): 1 early dK, 2 deferred dQ (no
# per-block barrier of the two consumers), 4 staggered consumers (with 2), 8
# red.global.add.v4 for dQ (mode 0), 16 the next block's S^T issued before
# the dQ epilogue (not with 2), 32 wgmma descriptors as base + constant offset,
# 64 (mode 2) dQ staging stores without bank conflicts.
# Tag suffix "_" + their letters, e.g. wgb64s2w_kd, wgb64s2w_ou.
OPT_LETTERS = {1: "k", 2: "d", 4: "t", 8: "v", 16: "o", 32: "u", 64: "b"}


@dataclasses.dataclass(frozen=True)
class BwdSm90Config:
    block_m: int  # query rows per step
    stages: int  # Q / dO / LSE2 / Delta ring depth
    dq_mode: int = 0
    opts: int = 0  # OPT_LETTERS bits

    def tag(self) -> str:
        letters = "".join(c for b, c in OPT_LETTERS.items() if self.opts & b)
        return f"wgb{self.block_m}s{self.stages}{DQ_SUFFIX[self.dq_mode]}" + (f"_{letters}" if letters else "")

    @staticmethod
    def parse(tag: str) -> "BwdSm90Config":
        m = re.fullmatch(r"wgb(\d+)s(\d+)([qw]?)(?:_([kdtvoub]+))?", tag)
        if not m:
            raise ValueError(f"bad sm90 backward tag {tag!r} (want e.g. wgb64s2, wgb64s2q, wgb64s2w, wgb64s2w_kd)")
        mode = {v: k for k, v in DQ_SUFFIX.items()}[m.group(3)]
        opts = sum(b for b, c in OPT_LETTERS.items() if c in (m.group(4) or ""))
        return BwdSm90Config(int(m.group(1)), int(m.group(2)), mode, opts)

    def ds_buffers(self) -> int:
        """BwdSm90Tile::kDSBufs: 2, or with the deferred dQ 4 (mode 0) / 3 (mode 2)."""
        return 2 if not self.opts & 2 else 3 if self.dq_mode == 2 else 4


# D = 128: 64 query rows per step (dK, dV: 64 + 64 float registers; S^T, dP^T 32 + 32).
# D = 64: 128 rows (32 + 32; 64 + 64), dQ split by rows. Stages: 3 at D = 64
# was 1-3% faster than 2 in all 8 cases of the H200 run at 55cc746 with dQ by
# red.global (mode 0); at D = 128 3 was no faster (0 to -9%). Modes 1 and 2
# stage dQ in shared memory, which leaves room for 2 stages only at D = 64.
# (Mode 2 was, at 1172345, a partial dQ per consumer over its own keys: 18%
# slower at D = 64, wgmma serialised at D = 128; replaced.)
# docs/attention.md, "Hopper backward".
# Modes 1 and 2 at D = 64 (BLOCK_M = 128) spill 8 bytes in the consumers
# (causal; mode 1 was spill-free and 0-2.5% faster than mode 0 at 1172345,
# before mode 2's writer was added): D = 128 only.
BY_DQ_MODE = {0: {64: BwdSm90Config(128, 3, 0), 128: BwdSm90Config(64, 2, 0)},
              1: {128: BwdSm90Config(64, 2, 1)},
              2: {128: BwdSm90Config(64, 2, 2)}}
# Defaults: D = 64 mode 0 (measured best at 1172345; mode 1 equal within 1%)
# with cheap wgmma descriptors ("u"). D = 128 mode 2, the dQ writers in the
# producer warpgroup (470 / 429 bwd TFLOP/s at S = 4096, full / causal, against
# 390 / 347 for plain mode 0 at 1edd8e0), with "u" and conflict-free dQ staging
# stores ("b"): 491 / 434 against 473 / 422 for plain wgb64s2w in the same H200
# run at fad5c51 (u alone 477 / 436, b alone 491 / 423; D = 64: wgb128s3_u
# 378 / 340 against 371 / 339, and 379 / 340 against 371 / 339 at edc04eb).
DEFAULT = {64: BwdSm90Config.parse("wgb128s3_u"), 128: BwdSm90Config.parse("wgb64s2w_ub")}
# Variants (OPT_LETTERS; docs/attention.md, "Hopper backward"): the plain tiles
# of the dQ modes (the former defaults wgb128s3 and wgb64s2w among them), the
# schedule options of branch attn-bwd-3, and of attn-bwd-4 "o" (the next
# block's S^T under the dQ epilogue: 1-2% slower at edc04eb; at D = 64 it
# spills 20 bytes, so D = 128 only) and "b" alone.
VARIANTS = {64: [BY_DQ_MODE[0][64], BwdSm90Config(128, 2, 0)],
            128: [BY_DQ_MODE[0][128], BY_DQ_MODE[1][128], BY_DQ_MODE[2][128]] +
                 [BwdSm90Config.parse(t) for t in ("wgb64s2_kdt", "wgb64s2_kdtv", "wgb64s2w_kdt", "wgb64s2w_o",
                                                   "wgb64s2w_b")]}


def default(d: int) -> BwdSm90Config:
    """DEFAULT[d], or the tile of dQ mode OPFUSE_ATTN_BWD_SM90_DQ (0, 1, 2) for A/B runs."""
    m = os.environ.get("OPFUSE_ATTN_BWD_SM90_DQ", "")
    if m:
        if m not in ("0", "1", "2"):
            raise ValueError(f"OPFUSE_ATTN_BWD_SM90_DQ={m!r}: want 0, 1 or 2")
        if d not in BY_DQ_MODE[int(m)]:
            raise ValueError(f"OPFUSE_ATTN_BWD_SM90_DQ={m}: no such tile at head dim {d}")
        return BY_DQ_MODE[int(m)][d]
    return DEFAULT[d]


def configs(d: int):
    return [DEFAULT[d]] + VARIANTS[d]


def smem_bytes(d: int, cfg: BwdSm90Config) -> int:
    """BwdSm90Tile::kSmemBytes."""
    kv, q, stat, ds = BLOCK_N * d * 2, cfg.block_m * d * 2, cfg.block_m * 4, BLOCK_N * cfg.block_m * 2
    dq_n = d if cfg.block_m == 128 else d // 2  # a consumer's dQ columns
    dq_stage = {0: 0, 1: 8 * 16 * (dq_n * 4 + 32), 2: cfg.block_m // 2 * (2 * d * 4 + 32)}[cfg.dq_mode]
    bars = 1 + 2 * cfg.stages + (2 if cfg.dq_mode == 2 else 0)
    return 2 * kv + 2 * cfg.stages * q + cfg.ds_buffers() * ds + 2 * cfg.stages * stat + dq_stage + 8 * bars + 1024


def _b(x: bool) -> str:
    return "true" if x else "false"


def expressions(elem: str, d: int, causal: bool, cfg: BwdSm90Config) -> dict:
    ns = "opfuse_attn::"
    return {
        "preprocess": f"{ns}attention_bwd_preprocess<{ns}{elem}, {d}>",
        "main": f"{ns}attention_bwd_sm90<{ns}{elem}, {d}, {_b(causal)}, {cfg.block_m}, {cfg.stages}, {cfg.dq_mode}{f', {cfg.opts}' if cfg.opts else ''}>",
        "convert": f"{ns}attention_bwd_dq_convert<{ns}{elem}, {d}>",
    }


def all_problems():
    return [(elem, d, causal, cfg) for d in HEAD_DIMS for cfg in configs(d) for elem in ar.ELEMENTS
            for causal in (False, True)]


def enabled() -> bool:
    """OPFUSE_ATTN_BWD_SM90=0 forces the mma.sync backward (for comparison)."""
    return os.environ.get("OPFUSE_ATTN_BWD_SM90", "1") != "0"


def unsupported_reason(arch: str, d: int, seqlen_q: int, seqlen_k: int, deterministic: bool) -> str:
    """Empty when the Hopper backward takes the problem, else why not."""
    if not arch.startswith("sm_90"):
        return f"{arch} is not sm_90"
    if not enabled():
        return "OPFUSE_ATTN_BWD_SM90=0"
    if d not in HEAD_DIMS:
        return f"head dim {d} is not 64 or 128"
    if deterministic:
        return "deterministic mode (the Hopper kernel adds dQ with atomics)"
    if seqlen_q == 0 or seqlen_k == 0:
        return "empty sequence (a tensor map needs non-empty dims)"
    return ""


def compile_problem(nvrtc: ar.Nvrtc, elem: str, d: int, causal: bool, cfg: BwdSm90Config, src: str | None = None,
                    use_cache: bool = True):
    """One NVRTC program with the three kernels (cached as the other harnesses' programs, file names
    bwd90-<key>). Returns dict(cubin, lowered {role: name}, log, resources, cached)."""

    src = src if src is not None else source()
    exprs = expressions(elem, d, causal, cfg)
    opts = ar.compile_options(fs.ARCH_SM90)

    def build():
        cubin, log, lowered = nvrtc.compile(src, SOURCE_NAME, opts, list(exprs.values()))
        per_fn = ar.split_ptxas_log(log)
        return cubin, dict(lowered={r: lowered[e] for r, e in exprs.items()}, log=log,
                           resources={r: ar.parse_ptxas(per_fn.get(lowered[e], "")) for r, e in exprs.items()},
                           expressions=exprs, arch=fs.ARCH_SM90)

    return ar.cached_cubin([src, *exprs.values(), " ".join(opts), f"nvrtc{nvrtc.version}"], use_cache, build,
                           prefix="bwd90-")


def launch(driver: ar.CudaDriver, fns: dict, cfg: BwdSm90Config, d: int, elem: str, p, q, k, v, dout, stream):
    """preprocess, the Hopper kernel, convert (p: a filled attn_bwd_runtime.AttnBwdParams with dq_accum set)."""
    B, Hq, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    driver.launch(fns["preprocess"], (p.seqlen_q_pad // 64, Hq, B), (256, 1, 1), 0, stream, p)
    tms = [fs.encode_tensor_map(driver, elem, t.data_ptr(), t.shape, t.stride(), rows)
           for t, rows in ((q, cfg.block_m), (k, BLOCK_N), (v, BLOCK_N), (dout, cfg.block_m))]
    args = (ctypes.c_void_p * 5)(*(ctypes.cast(ctypes.pointer(x), ctypes.c_void_p) for x in (p, *tms)))
    driver.check(driver.lib.cuLaunchKernel(fns["main"], (Sk + BLOCK_N - 1) // BLOCK_N, Hkv, B, THREADS, 1, 1,
                                           smem_bytes(d, cfg), ctypes.c_void_p(stream), args, None),
                 "cuLaunchKernel(attention_bwd_sm90)")
    driver.launch(fns["convert"], ((Sq + 63) // 64, Hq, B), (256, 1, 1), 0, stream, p)


def _compile_one(args):
    elem, d, causal, tag = args
    info = compile_problem(ar.Nvrtc(), elem, d, causal, BwdSm90Config.parse(tag))
    return elem, d, causal, tag, info["resources"]["main"], info["cached"]


def main(argv=None):
    """precompile: fill the cubin cache (OPFUSE_ATTN_CUBIN_DIR) and print ptxas's report."""
    import argparse
    import concurrent.futures as cf

    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["precompile"])
    ap.add_argument("--out")
    ap.add_argument("--defaults-only", action="store_true")
    ap.add_argument("--only", help="comma-separated terms every job's description (elem D=d causal=c tag) must contain")
    ap.add_argument("-j", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args(argv)
    if a.out:
        os.environ["OPFUSE_ATTN_CUBIN_DIR"] = a.out
    jobs = [(e, d, c, cfg.tag()) for (e, d, c, cfg) in all_problems() if not a.defaults_only or cfg == DEFAULT[d]]
    if a.only:  # e.g. --only bf16 keeps the jobs whose description contains every term
        jobs = [j for j in jobs if all(t in f"{j[0]} D={j[1]} causal={int(j[2])} {j[3]}" for t in a.only.split(","))]
    with cf.ProcessPoolExecutor(max_workers=a.j) as ex:
        for elem, d, causal, tag, r, cached in ex.map(_compile_one, jobs):
            print(f"sm_90a {elem:4} D={d:3} causal={int(causal)} {tag}: regs {r['registers']} stack {r['stack']} "
                  f"spill {r['spill_stores']}/{r['spill_loads']}{' (cached)' if cached else ''}", flush=True)


if __name__ == "__main__":
    main()
