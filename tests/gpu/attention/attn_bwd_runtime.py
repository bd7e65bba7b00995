"""Run-time compilation and launch of src/kernels/attention/attention_bwd.cu.

The backward's twin of attn_runtime.py (whose Nvrtc, CudaDriver and cache it
reuses): tile choice, name expressions, the ctypes mirror of AttnBwdParams,
and `AttentionBackward`, which runs the launch sequence of docs/attention.md
("Backward") on PyTorch's current stream with workspaces from PyTorch's
allocator.

    bwd = AttentionBackward()
    dq, dk, dv = bwd(dout, q, k, v, o, lse, causal=True, deterministic=False)

`python attn_bwd_runtime.py precompile --arch sm_90 --out DIR` fills the
cubin cache (OPFUSE_ATTN_CUBIN_DIR=DIR) for a GPU machine.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import pathlib
import re

import attn_runtime as ar

KERNEL_DIR = ar.REPO / "src" / "kernels" / "attention"
COMMON_SOURCE = KERNEL_DIR / "attention_ptx.cu"
BWD_SOURCE = KERNEL_DIR / "attention_bwd.cu"
SOURCE_NAME = "attention_bwd.cu"
ROW_PAD = 128  # workspace rows per (b, h): kBwdRowPad


def source() -> str:
    """What NVRTC compiles: the shared helpers, then the backward kernels."""
    return COMMON_SOURCE.read_text() + "\n" + BWD_SOURCE.read_text()


@dataclasses.dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    num_warps: int
    min_blocks: int

    def tag(self) -> str:
        return f"{self.block_m}x{self.block_n}w{self.num_warps}b{self.min_blocks}"

    @staticmethod
    def parse(tag: str) -> "Tile":
        m = re.fullmatch(r"(\d+)x(\d+)w(\d+)b(\d+)", tag)
        if not m:
            raise ValueError(f"bad tile tag {tag!r} (want e.g. 64x128w8b1)")
        return Tile(*(int(g) for g in m.groups()))


# dK/dV kernel: BLOCK_M queries per iteration x BLOCK_N keys per CTA. Warps own
# 16 keys each; at D = 256 two warps share a key group (each half of D).
DKDV_TILES = {
    64: [Tile(128, 128, 8, 1), Tile(64, 128, 8, 1)],
    96: [Tile(64, 128, 8, 1)],
    128: [Tile(64, 128, 8, 1), Tile(64, 64, 4, 1)],
    256: [Tile(32, 64, 8, 1)],
}
# Deterministic dQ kernel: BLOCK_M = 16 * warps query rows per CTA, BLOCK_N keys per step.
DQ_TILES = {
    64: [Tile(128, 64, 8, 1), Tile(128, 64, 8, 1)],
    96: [Tile(128, 64, 8, 1)],
    128: [Tile(128, 64, 8, 1), Tile(64, 64, 4, 1)],
    256: [Tile(64, 32, 4, 1)],
}
HEAD_DIMS = ar.HEAD_DIMS
ELEMENTS = ar.ELEMENTS


def _b(x: bool) -> str:
    return "true" if x else "false"


def dkdv_smem(d: int, t: Tile, masked: bool = False) -> int:
    """BwdKVTile::kSmemBytes (a masked kernel stages a third per-row array, A)."""
    sb, psb = (d + 8) * 2, (t.block_m + 8) * 2
    key_groups = t.block_n // 16
    warps_d = t.num_warps // key_groups
    stage = 2 * t.block_m * sb + (3 if masked else 2) * t.block_m * 4
    return 2 * t.block_n * sb + 2 * stage + (2 if warps_d > 1 else 1) * t.block_n * psb


def dq_smem(d: int, t: Tile) -> int:
    """BwdQTile::kSmemBytes."""
    sb = (d + 8) * 2
    return 2 * t.block_m * sb + 2 * 2 * t.block_n * sb


# With an attn_mask, D = 64 takes the 64-query dK/dV tile: on 128x128w8b1 the
# mask step spilled up to 384 bytes (sm_90, a causal boolean mask), on
# 64x128w8b1 nothing.
MASKED_DKDV_TILES = {64: [Tile(64, 128, 8, 1)]}


def choose_tiles(d: int, arch: str = "sm_90", smem_limit: int | None = None, masked: bool = False) -> tuple[Tile, Tile]:
    limit = smem_limit or ar.MAX_SMEM_PER_BLOCK.get(arch, 101376)
    kv_list = MASKED_DKDV_TILES.get(d, DKDV_TILES[d]) if masked else DKDV_TILES[d]
    kv = next((t for t in kv_list if dkdv_smem(d, t, masked) <= limit), None)
    q = next((t for t in DQ_TILES[d] if dq_smem(d, t) <= limit), None)
    if kv is None or q is None:
        raise ValueError(f"no attention backward tile for head dim {d} fits {limit} bytes of shared memory")
    return kv, q


def expressions(elem: str, d: int, causal: bool, kv: Tile, q: Tile, mask=None) -> dict:
    """Name expressions of every kernel one (elem, D, causal, tiles, mask kind) problem launches."""
    ns = "opfuse_attn::"
    e = f"{ns}{elem}"
    m = ar._mask_arg(mask)
    kvargs = f"{e}, {d}, {_b(causal)}, {kv.block_m}, {kv.block_n}, {kv.num_warps}, {kv.min_blocks}"
    return {
        "preprocess": f"{ns}attention_bwd_preprocess<{e}, {d}>",
        "dkdv_atomic": f"{ns}attention_bwd_dkdv<{kvargs}, true{m}>",
        "dkdv": f"{ns}attention_bwd_dkdv<{kvargs}, false{m}>",
        "convert": f"{ns}attention_bwd_dq_convert<{e}, {d}>",
        "dq": f"{ns}attention_bwd_dq<{e}, {d}, {_b(causal)}, {q.block_m}, {q.block_n}, {q.num_warps}, {q.min_blocks}{m}>",
    }


def all_problems(include_variants: bool = True):
    """(elem, D, causal, kv tile, q tile) for every instantiation we ship."""
    out = []
    for d in HEAD_DIMS:
        pairs = list(zip(DKDV_TILES[d], DQ_TILES[d]))
        if not include_variants:
            pairs = pairs[:1]
        for kv, q in pairs:
            for elem in ELEMENTS:
                for causal in (False, True):
                    out.append((elem, d, causal, kv, q))
    return out


def masked_problems(arch: str = "sm_90"):
    """(elem, D, causal, kv tile, q tile, mask) for every masked problem shipped: default tiles, every mask kind."""
    out = []
    for d in HEAD_DIMS:
        kv, q = choose_tiles(d, arch, masked=True)
        for elem in ELEMENTS:
            for causal in (False, True):
                for mask in ar.mask_kinds(elem):
                    out.append((elem, d, causal, kv, q, mask))
    return out


def compile_problem(nvrtc: ar.Nvrtc, arch: str, elem: str, d: int, causal: bool, kv: Tile, q: Tile,
                    src: str | None = None, use_cache: bool = True, mask=None):
    """One NVRTC program holding the five kernels of a problem. Returns
    dict(cubin, lowered {role: name}, log, resources {role: ptxas}, cached)."""
    src = src if src is not None else source()
    exprs = expressions(elem, d, causal, kv, q, mask)
    opts = ar.compile_options(arch)

    def build():
        cubin, log, lowered = nvrtc.compile(src, SOURCE_NAME, opts, list(exprs.values()))
        per_fn = ar.split_ptxas_log(log)
        return cubin, dict(lowered={r: lowered[e] for r, e in exprs.items()}, log=log,
                           resources={r: ar.parse_ptxas(per_fn.get(lowered[e], "")) for r, e in exprs.items()},
                           expressions=exprs, arch=arch)

    return ar.cached_cubin([src, *exprs.values(), " ".join(opts), f"nvrtc{nvrtc.version}"], use_cache, build,
                           prefix="bwd-")


def compile_ptx(nvrtc: ar.Nvrtc, arch: str, expressions, src: str | None = None) -> str:
    """The PTX NVRTC generates for some kernels (for checks of the instructions used)."""
    return nvrtc.compile_with_ptx(src or source(), SOURCE_NAME, ar.compile_options(arch), expressions)[0]


# attn_bwd_runtime_sm90 calls it through this module.
split_ptxas_log = ar.split_ptxas_log


# ---------------------------------------------------------------------------
# Launch ABI
# ---------------------------------------------------------------------------

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class AttnBwdParams(ctypes.Structure):
    _fields_ = (
        [(n, _P) for n in ("q", "k", "v", "o", "dout", "dq", "dk", "dv", "lse", "dq_accum", "delta", "lse_log2")]
        + [(f"{t}_{s}_stride", _I64) for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv")
           for s in ("batch", "head", "row")]
        + [("lse_batch_stride", _I64), ("lse_head_stride", _I64)]
        + [(n, _I32) for n in ("batch", "heads_q", "heads_kv", "q_per_kv", "seqlen_q", "seqlen_k", "seqlen_q_pad",
                               "d_cols")]
        + [("softmax_scale", _F), ("scale_log2", _F)]
        + [("mask", _P), ("mask_batch_stride", _I64), ("mask_head_stride", _I64), ("mask_row_stride", _I64),
           ("mask_col_stride", _I64)]
    )


assert ctypes.sizeof(AttnBwdParams) == 384, ctypes.sizeof(AttnBwdParams)


def _kernel_ok(t) -> bool:
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:3])


class AttentionBackward:
    """Callable: (dout, q, k, v, o, lse, causal, scale, deterministic) -> (dq, dk, dv)."""

    def __init__(self, arch: str | None = None):
        self.arch, props = ar.current_device("AttentionBackward", arch)
        self.smem_limit = getattr(props, "shared_memory_per_block_optin", None)
        self.nvrtc = ar.Nvrtc()
        self.driver = ar.CudaDriver()
        self.source = source()
        self._fns = {}
        # The Hopper kernel (attn_bwd_runtime_sm90.py): sm_90, D = 64 / 128, atomic dQ.
        import attn_bwd_runtime_sm90 as sm90

        self.sm90 = sm90
        self.last_path = None  # "sm90" or "mma" after a call (tests)

    def functions(self, elem, d, causal, kv, q, mask=None):
        key = (self.driver.current_context(), elem, d, causal, kv, q, mask)
        fns = self._fns.get(key)
        if fns is None:
            info = compile_problem(self.nvrtc, self.arch, elem, d, causal, kv, q, src=self.source, mask=mask)
            kv_smem = dkdv_smem(d, kv, mask is not None)
            smem = {"dkdv": kv_smem, "dkdv_atomic": kv_smem, "dq": dq_smem(d, q)}
            fns = {}
            for role, name in info["lowered"].items():
                _, fns[role] = self.driver.load_function(info["cubin"], name, smem.get(role, 0))
            self._fns[key] = fns
        return fns

    def functions_sm90(self, elem, d, causal, cfg):
        key = (self.driver.current_context(), "sm90", elem, d, causal, cfg)
        fns = self._fns.get(key)
        if fns is None:
            info = self.sm90.compile_problem(self.nvrtc, elem, d, causal, cfg)
            fns = {}
            for role, name in info["lowered"].items():
                _, fns[role] = self.driver.load_function(info["cubin"], name,
                                                         self.sm90.smem_bytes(d, cfg) if role == "main" else 0)
            self._fns[key] = fns
        return fns

    def __call__(self, dout, q, k, v, o, lse, causal=False, scale=None, deterministic=None, tiles=None,
                 out=None, attn_mask=None):
        """tiles: None (default dispatch), (dK/dV tile, dQ tile) of the mma.sync kernels, or an
        attn_bwd_runtime_sm90.BwdSm90Config (the Hopper kernel with that configuration).
        attn_mask: additive or boolean, broadcastable to [B, Hq, Sq, Sk] (mma.sync kernels only)."""
        import torch

        B, Hq, Sq, D = q.shape
        Hkv, Sk = k.shape[1], k.shape[2]
        if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or Hq % Hkv:
            raise ValueError(f"shape mismatch q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
        if o.shape != q.shape or dout.shape != q.shape or lse.shape != (B, Hq, Sq):
            raise ValueError("o and dout must be shaped like q, lse [B, Hq, Sq]")
        if q.dtype not in (torch.bfloat16, torch.float16) or any(t.dtype != q.dtype for t in (k, v, o, dout)):
            raise ValueError("q, k, v, o, dout must all be bfloat16 or all float16")
        if lse.dtype != torch.float32 or lse.stride(-1) != 1:
            raise ValueError("lse must be float32 with a contiguous last dim")
        if D not in HEAD_DIMS:
            raise ValueError(f"head dim {D} not in {HEAD_DIMS}")
        for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("dout", dout)):
            if not _kernel_ok(t):
                raise ValueError(f"{name}: needs a contiguous last dim, 16-byte aligned data, strides multiple of 8")
        if scale is None:
            scale = 1.0 / math.sqrt(D)
        if not scale > 0:
            raise ValueError("softmax scale must be > 0")
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
        if B > 65535 or max(Hq, Hkv) > 65535:
            raise ValueError("heads and batch must each be <= 65535")
        elem = "bf16" if q.dtype == torch.bfloat16 else "f16"
        sm90_cfg = tiles if isinstance(tiles, self.sm90.BwdSm90Config) else None
        why90 = self.sm90.unsupported_reason(self.arch, D, Sq, Sk, bool(deterministic))
        if sm90_cfg is not None and why90.replace("OPFUSE_ATTN_BWD_SM90=0", ""):
            raise ValueError(f"sm90 backward {sm90_cfg.tag()}: {why90}")
        if attn_mask is not None and sm90_cfg is not None:
            raise ValueError(f"sm90 backward {sm90_cfg.tag()}: no attn_mask (causal masking only)")
        if tiles is None and not why90 and attn_mask is None:
            sm90_cfg = self.sm90.default(D)
        kv_t, q_t = (None, None) if sm90_cfg else (tiles or choose_tiles(D, self.arch, self.smem_limit))
        dev = q.device
        if out is None:
            dq, dk, dv = torch.empty_like(q, memory_format=torch.contiguous_format), \
                torch.empty_like(k, memory_format=torch.contiguous_format), \
                torch.empty_like(v, memory_format=torch.contiguous_format)
        else:
            dq, dk, dv = out
        if B == 0 or Hq == 0:
            return dq, dk, dv
        sq_pad = (Sq + ROW_PAD - 1) // ROW_PAD * ROW_PAD
        delta = torch.empty((B, Hq, sq_pad), dtype=torch.float32, device=dev)
        acc = None if deterministic else torch.empty((B, Hq, sq_pad, D), dtype=torch.float32, device=dev)
        mask, mt, mst = ar.kernel_mask(attn_mask, B, Hq, Sq, Sk, q.dtype)
        # With a mask: L2, then the rows' scales A (attention_bwd.cu, attn_bwd_row_terms).
        lse2 = torch.empty((2 if mt is not None else 1, B, Hq, sq_pad), dtype=torch.float32, device=dev)
        if mask and tiles is None:
            kv_t, q_t = choose_tiles(D, self.arch, self.smem_limit, masked=True)
        fns = self.functions_sm90(elem, D, bool(causal), sm90_cfg) if sm90_cfg else \
            self.functions(elem, D, bool(causal), kv_t, q_t, mask)

        p = AttnBwdParams()
        p.q, p.k, p.v, p.o, p.dout = (t.data_ptr() for t in (q, k, v, o, dout))
        p.dq, p.dk, p.dv = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
        p.lse, p.dq_accum, p.delta, p.lse_log2 = lse.data_ptr(), (acc.data_ptr() if acc is not None else None), \
            delta.data_ptr(), lse2.data_ptr()
        for name, t in (("q", q), ("k", k), ("v", v), ("o", o), ("do", dout), ("dq", dq), ("dk", dk), ("dv", dv)):
            for s, val in zip(("batch", "head", "row"), t.stride()[:3]):
                setattr(p, f"{name}_{s}_stride", val)
        p.lse_batch_stride, p.lse_head_stride = lse.stride()[:2]
        p.batch, p.heads_q, p.heads_kv, p.q_per_kv = B, Hq, Hkv, Hq // Hkv
        p.seqlen_q, p.seqlen_k, p.seqlen_q_pad = Sq, Sk, sq_pad
        p.softmax_scale, p.scale_log2 = scale, scale * math.log2(math.e)
        if mt is not None:
            p.mask = mt.data_ptr()
            p.mask_batch_stride, p.mask_head_stride, p.mask_row_stride, p.mask_col_stride = mst
            self._mask_alive = mt  # until the next call (the launches are asynchronous)
        stream = torch.cuda.current_stream(dev).cuda_stream
        self.last_path = "sm90" if sm90_cfg else "mma"
        if sm90_cfg:
            self.sm90.launch(self.driver, fns, sm90_cfg, D, elem, p, q, k, v, dout, stream)
            return dq, dk, dv
        L = self.driver.launch
        if sq_pad:
            L(fns["preprocess"], (sq_pad // 64, Hq, B), (256, 1, 1), 0, stream, p)
        nkb = (Sk + kv_t.block_n - 1) // kv_t.block_n
        if nkb:
            L(fns["dkdv" if deterministic else "dkdv_atomic"], (nkb, Hkv, B), (kv_t.num_warps * 32, 1, 1),
              dkdv_smem(D, kv_t, mt is not None), stream, p)
        if Sq:
            if deterministic:
                L(fns["dq"], ((Sq + q_t.block_m - 1) // q_t.block_m, Hq, B), (q_t.num_warps * 32, 1, 1),
                  dq_smem(D, q_t), stream, p)
            else:
                L(fns["convert"], ((Sq + 63) // 64, Hq, B), (256, 1, 1), 0, stream, p)
        return dq, dk, dv


def hopper_bench_problem(ap):
    """The problem of the Hopper backward's profiling scripts
    (profile_bwd_sm90.py, time_bwd_parts.py): adds --d, --s, --causal and --b to
    the parser `ap` and parses; FlashAttention's bench setup as
    bench_attention_bwd.py (bf16, hidden 2048, 16k tokens). Returns the
    arguments `a`, the sizes B, H, S, D, the inputs q, k, v, dout, the
    forward's o and lse, and `bwd`, an AttentionBackward."""
    import types

    import torch

    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--s", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--b", type=int, default=0, help="batch (default 16384 // S)")
    a = ap.parse_args()
    S, D = a.s, a.d
    B, H = a.b or 16384 // S, 2048 // D
    g = torch.Generator(device="cuda").manual_seed(S + D)
    q, k, v, dout = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    fwd, bwd = ar.AttentionForward(), AttentionBackward()
    o, lse = fwd(q, k, v, causal=a.causal)
    return types.SimpleNamespace(a=a, B=B, H=H, S=S, D=D, q=q, k=k, v=v, dout=dout, o=o, lse=lse, bwd=bwd)


# ---------------------------------------------------------------------------
# CLI: precompile / report
# ---------------------------------------------------------------------------


def _compile_one(args):
    arch, elem, d, causal, kv, q, mask = args
    info = compile_problem(ar.Nvrtc(), arch, elem, d, causal, Tile.parse(kv), Tile.parse(q), mask=mask)
    return (arch, elem, d, causal, kv, q, mask, info["resources"], info["cached"])


def main(argv=None):
    import concurrent.futures as cf

    a = ar.precompile_args(argv, __doc__)
    jobs = []
    if not a.masks_only:
        jobs += [(arch, elem, d, causal, kv.tag(), q.tag(), None) for arch in (a.arch or ["sm_90"])
                 for (elem, d, causal, kv, q) in all_problems(include_variants=not a.defaults_only)]
    if not a.no_masks:
        jobs += [(arch, elem, d, causal, kv.tag(), q.tag(), m) for arch in (a.arch or ["sm_90"])
                 for (elem, d, causal, kv, q, m) in masked_problems(arch)]
    if a.only:
        terms = a.only.split(",")
        jobs = [j for j in jobs if all(t in f"{j[0]} {j[1]} D={j[2]} causal={int(j[3])} {j[6]}" for t in terms)]
    with cf.ProcessPoolExecutor(max_workers=a.j) as ex:
        for arch, elem, d, causal, kv, q, mask, res, cached in ex.map(_compile_one, jobs):
            cols = " ".join(f"{r}={v['registers']}/{v['spill_stores']}" for r, v in res.items())
            print(f"{arch} {elem:4} D={d:3} causal={int(causal)} kv={kv} q={q} {mask or '':9} regs/spill: {cols}"
                  f"{' (cached)' if cached else ''}", flush=True)


if __name__ == "__main__":
    main()
