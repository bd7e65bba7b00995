"""The Hopper forward (src/kernels/attention/attention_fwd_sm90.cu) for the ctypes harness.

Configurations, NVRTC compilation for sm_90a, the TMA tensor maps
(cuTensorMapEncodeTiled from libcuda) and the launch. attn_runtime.AttentionForward
dispatches here on sm_90 devices for the head dims the kernel covers (64 and
128) unless OPFUSE_ATTN_SM90=0; everything else stays on the mma.sync kernel.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import pathlib
import re

import attn_runtime as ar

KERNEL_SOURCE_SM90 = ar.REPO / "src" / "kernels" / "attention" / "attention_fwd_sm90.cu"
SCHEDULE_SOURCE_SM90 = ar.REPO / "src" / "kernels" / "attention" / "attention_fwd_sm90_schedule.cu"
PTX_SOURCE_SM90 = ar.REPO / "src" / "kernels" / "attention" / "attention_sm90_ptx.cu"


def sm90_source() -> str:
    """What NVRTC compiles: the shared PTX helpers (all kernels', then Hopper's), the schedules, then the
    Hopper kernel (OPFUSE_ATTN_SM90_KERNEL=FILE: another version of the kernel file, to time two versions
    in one session)."""
    kernel = os.environ.get("OPFUSE_ATTN_SM90_KERNEL") or KERNEL_SOURCE_SM90
    return (ar.PTX_SOURCE.read_text() + "\n" + PTX_SOURCE_SM90.read_text() + "\n" + SCHEDULE_SOURCE_SM90.read_text()
            + "\n" + pathlib.Path(kernel).read_text())
HEAD_DIMS_SM90 = (64, 96, 128, 256)
ARCH_SM90 = "sm_90a"  # wgmma and setmaxnreg exist only on the arch-specific target


# kAttnCausalSplitMinBlocks: the causal split only when the longest tile has this many key blocks.
CAUSAL_SPLIT_MIN_BLOCKS = 16


def causal_split_cuts(seqlen_q: int, seqlen_k: int, block_m: int, block_n: int, heads_batch: int, grid: int,
                      shift: bool = False) -> bool:
    """Whether the causal split cuts the pairs schedule's tail (C++ attn_sm90_causal_split_cuts): more
    tiles than the grid, the longest tile at least CAUSAL_SPLIT_MIN_BLOCKS key blocks and every CTA's
    tail range at least that tile."""
    num_m = -(-seqlen_q // block_m)
    if seqlen_q <= 0 or seqlen_k <= 0 or grid <= 0 or num_m * heads_batch <= grid:
        return False
    row_shift = num_m * block_m - seqlen_q if shift else 0  # row_shift_of

    def blocks(m):
        key_end = min(min((m + 1) * block_m - row_shift, seqlen_q) + seqlen_k - seqlen_q, seqlen_k)
        return -(-key_end // block_n) if key_end > 0 else 0

    p2 = num_m // 2
    np_ = p2 * heads_batch
    j0 = max(np_ // grid - 1, 0) * grid
    items = [blocks(num_m - 1 - q) + blocks(q) for q in range(p2)]
    h = sum(items)
    c_j0 = (j0 // p2 * h + sum(items[:j0 % p2])) if p2 else 0
    t = heads_batch * h - c_j0 + (heads_batch * blocks(num_m // 2) if num_m & 1 else 0)
    longest = blocks(num_m - 1)
    return np_ < 2**30 and longest >= CAUSAL_SPLIT_MIN_BLOCKS and t // grid >= longest


@dataclasses.dataclass(frozen=True)
class Sm90Config:
    block_n: int
    consumers: int  # consumer warpgroups of 64 query rows each
    stages: int  # K/V ring depth
    pingpong: bool  # consumers take turns issuing their products
    persistent: bool = True  # host only: grid of min(tiles, SMs) CTAs looping over tiles, else one CTA a tile
    overlap: bool = False  # OPTS kOptOverlap: the next tile's first S goes out before this tile's epilogue
    skip: bool = False  # OPTS kOptSkip: a consumer skips the key blocks none of its rows see
    pairs: bool = False  # OPTS kOptPairs: causal tiles handed out in pairs (x, num_m - 1 - x) of one head
    desc: bool = False  # OPTS kOptDesc: wgmma descriptors as the first one plus constant offsets
    split: bool = False  # OPTS kOptSplit: the last rounds' tiles cut over the CTAs by key blocks (causal: with pairs)
    shift: bool = False  # OPTS kOptShift (causal): query blocks end at Sq, the ragged one first
    store_o: bool = False  # OPTS kOptStoreO (not with overlap): O leaves through TMA stores (sixth argument)

    @property
    def opts(self) -> int:
        """The kernel's OPTS template argument."""
        return ((1 if self.overlap else 0) | (2 if self.skip else 0) | (4 if self.pairs else 0) | (8 if self.desc else 0)
                | (16 if self.split else 0) | (32 if self.shift else 0) | (64 if self.store_o else 0))

    @property
    def block_m(self) -> int:
        return 64 * self.consumers

    @property
    def num_threads(self) -> int:
        return 128 * (self.consumers + 1)

    def tag(self) -> str:
        return (f"wg{self.block_m}x{self.block_n}s{self.stages}{'p' if self.pingpong else ''}"
                f"{'o' if self.overlap else ''}{'k' if self.skip else ''}{'l' if self.pairs else ''}{'d' if self.desc else ''}"
                f"{'w' if self.split else ''}{'b' if self.shift else ''}{'t' if self.store_o else ''}"
                f"{'' if self.persistent else 'n'}")

    @staticmethod
    def parse(tag: str) -> "Sm90Config":
        m = re.fullmatch(r"wg(\d+)x(\d+)s(\d+)(p?)(o?)(k?)(l?)(d?)(w?)(b?)(t?)(n?)", tag)
        if not m or int(m.group(1)) % 64 or (m.group(11) and (m.group(5) or int(m.group(1)) != 128)):
            raise ValueError(f"bad sm90 config tag {tag!r} (want e.g. wg128x128s2p; 't': 128 rows, no 'o')")
        return Sm90Config(int(m.group(2)), int(m.group(1)) // 64, int(m.group(3)), bool(m.group(4)), not m.group(12),
                          bool(m.group(5)), bool(m.group(6)), bool(m.group(7)), bool(m.group(8)), bool(m.group(9)),
                          bool(m.group(10)), bool(m.group(11)))

    def for_call(self, causal: bool, masked: bool, cuts: bool = True) -> "Sm90Config":
        """The config a call runs (C++ AttnSm90Tile::for_call): kOptSplit only for unmasked calls whose
        tiles it cuts (`cuts`: split_cuts), causal ones with pairs; a non-causal split without pairs."""
        keep = self.split and not masked and cuts and (not causal or self.pairs)
        shift = self.shift and causal and not masked and not self.skip
        pairs = self.pairs and (causal or not keep)
        return dataclasses.replace(self, split=keep, shift=shift, pairs=pairs)

    def split_cuts(self, seqlen_q: int, seqlen_k: int, heads_q: int, batch: int, num_sms: int,
                   causal: bool = False) -> bool:
        """Whether the split tail cuts any tile (C++ plan_sm90): tiles that do not fill whole rounds of a
        persistent grid, and the kernel's 32-bit tail arithmetic; causal: causal_split_cuts."""
        tiles = -(-seqlen_q // self.block_m) * heads_q * batch
        g = self.grid(seqlen_q, heads_q, batch, num_sms)[0]
        if causal:
            return causal_split_cuts(seqlen_q, seqlen_k, self.block_m, self.block_n, heads_q * batch, g,
                                     self.shift and not self.skip)
        nb = -(-seqlen_k // self.block_n)
        return tiles > g and tiles % g != 0 and 2 * g * nb < 2**31 - 1

    def grid(self, seqlen_q: int, heads_q: int, batch: int, num_sms: int):
        tiles = -(-seqlen_q // self.block_m) * heads_q * batch
        return (min(tiles, num_sms) if self.persistent else tiles, 1, 1)


# Default per (head dim, causal), then the variants the benchmark may time
# (CI compiles all). The persistent grid everywhere: with causal tiles handed
# out in order of decreasing work in snake rounds it matched or beat one CTA
# per tile in 7 of 8 causal cases of the third H200 run (commit 6e378ba,
# docs/attention.md, "Hopper"). Causal: the pairs schedule (tag "l"), which
# beat that order in the same H200 run (commit 9af5955) at D = 128 by 15% /
# 7% / 3% (S = 2048 / 8192 / 16384) and at D = 64 by 5% at S = 2048 (+1% /
# -0.4% at S = 8192 / 16384, a tie). Non-causal: descriptors by offset (tag
# "d"), 1.0-1.8% faster than the plain tile in all four non-causal cases of
# the H200 run at 487e149 (inside the two rounds' spreads; causal lost
# 0.2-1% with it, so causal keeps "pl"). Split tails ("w", session 23 for
# non-causal, session 24 for causal: up to +3.6%) and, causal, query blocks
# ending at Sq ("b", session 24: +4.5% at D = 64, S = 2048 and 4096).
DEFAULT_SM90 = {
    (64, False): Sm90Config(128, 3, 4, True, desc=True, split=True),
    (64, True): Sm90Config(128, 3, 4, True, pairs=True, split=True, shift=True),
    (128, False): Sm90Config(128, 2, 2, True, desc=True, split=True),
    (128, True): Sm90Config(128, 2, 2, True, pairs=True, split=True, shift=True),
    # D = 256 (session 26): 64-key blocks (Sm90Tile: 128 O accumulators a
    # thread leave room for 32 S floats), one Q buffer, the D = 128 options.
    # D = 96 (session 27): D = 128's tiles; rows stored 128 columns wide in
    # shared memory (TMA zero-fills the last 32), the products 96 wide.
    # Non-causal without "d" (with it ptxas spilled 8 bytes).
    (96, False): Sm90Config(128, 2, 2, True, split=True),
    (96, True): Sm90Config(128, 2, 2, True, pairs=True, split=True, shift=True),
    (256, False): Sm90Config(64, 2, 2, True, desc=True, split=True),
    (256, True): Sm90Config(64, 2, 2, True, pairs=True, split=True, shift=True),
}
# The previous non-causal defaults, the overlap options, and (branch
# attn-fwd-4) 176-key blocks at D = 128: FlashAttention-3's non-causal tile
# width, one Q buffer; 6% slower at S = 2048, a tie at 8192 (487e149).
VARIANT_SM90 = {
    64: [Sm90Config(128, 3, 4, True), Sm90Config(128, 3, 4, True, pairs=True)],
    128: [Sm90Config(128, 2, 2, True), Sm90Config(128, 2, 2, True, overlap=True),
          Sm90Config(128, 2, 2, True, pairs=True), Sm90Config(128, 2, 2, True, overlap=True, pairs=True),
          Sm90Config(176, 2, 2, True, desc=True), Sm90Config(128, 2, 2, True, desc=True)],
    96: [],
    256: [],
}
# The non-causal default without the split tail (tag "w": the last rounds' tiles cut over the CTAs;
# non-causal only, a causal call of a "w" tile runs the tile without it).
VARIANT_SM90[64].append(Sm90Config(128, 3, 4, True, desc=True))
# The causal default without query blocks ending at Sq (tag "b"; 4.5% slower at D = 64, S = 2048, 4096).
for _d, (_n, _c, _s) in ((64, (128, 3, 4)), (96, (128, 2, 2)), (128, (128, 2, 2)), (256, (64, 2, 2))):
    VARIANT_SM90[_d].append(Sm90Config(_n, _c, _s, True, pairs=True, split=True))
# The D = 256 non-causal default without the split tail.
VARIANT_SM90[256].append(Sm90Config(64, 2, 2, True, desc=True))
# The D = 128 defaults storing O through TMA (tag "t", session 25; two consumers only).
VARIANT_SM90[128] += [dataclasses.replace(DEFAULT_SM90[(128, _c)], store_o=True) for _c in (False, True)]


def default_config_sm90(head_dim: int, causal: bool, masked: bool = False) -> Sm90Config:
    """With an attn_mask, the plain tile: pairs on top of a mask spilled
    16-28 bytes (D = 128, causal, key padding) where the plain tile spills
    none; "d" was not measured with a mask (C++: attn_sm90_default_tile)."""
    cfg = DEFAULT_SM90[(head_dim, bool(causal))]
    if os.environ.get("OPFUSE_ATTN_SM90_SPLIT") == "0":
        cfg = dataclasses.replace(cfg, split=False)
    return dataclasses.replace(cfg, pairs=False, desc=False, split=False, shift=False) if masked else cfg


def configs_sm90(head_dim: int):
    """The defaults and the variants of one head dim, without repeats."""
    out = []
    for cfg in [DEFAULT_SM90[(head_dim, False)], DEFAULT_SM90[(head_dim, True)]] + VARIANT_SM90[head_dim]:
        if cfg not in out:
            out.append(cfg)
    return out


SMEM_LIMIT_SM90 = 227 * 1024


def stored_dim_sm90(head_dim: int) -> int:
    """Sm90Tile::kStoredDim: columns a row takes in shared memory (whole 64-column swizzle atoms: 96 -> 128)."""
    return -(-head_dim // 64) * 64


def q_buffers_sm90(head_dim: int, cfg: Sm90Config) -> int:
    """Sm90Tile::kQBufs: two Q buffers when they fit."""
    d = stored_dim_sm90(head_dim)
    q, kv = cfg.block_m * d * 2, cfg.block_n * d * 2
    return 2 if 2 * q + 2 * cfg.stages * kv + 8 * (4 + 4 * cfg.stages) + 32 + 1024 <= SMEM_LIMIT_SM90 else 1


def smem_bytes_sm90(head_dim: int, cfg: Sm90Config) -> int:
    """Sm90Tile::kSmemBytes: Q buffers, the K/V ring, the mbarriers and 1 KB to align the base."""
    d = stored_dim_sm90(head_dim)
    q, kv = cfg.block_m * d * 2, cfg.block_n * d * 2
    # mbarriers, then 32 bytes of the causal split's schedule
    return q_buffers_sm90(head_dim, cfg) * q + 2 * cfg.stages * kv + 8 * (4 + 4 * cfg.stages) + 32 + 1024


def name_expression_sm90(elem: str, head_dim: int, causal: bool, cfg: Sm90Config, mask=None) -> str:
    return (f"opfuse_attn::attention_fwd_sm90<opfuse_attn::{elem}, {head_dim}, {'true' if causal else 'false'}, "
            f"{cfg.block_n}, {cfg.consumers}, {cfg.stages}, {'true' if cfg.pingpong else 'false'}"
            f"{ar._mask_arg(mask) or (', opfuse_attn::MaskNone' if cfg.opts else '')}"
            f"{f', {cfg.opts}' if cfg.opts else ''}>")


def masked_instantiations_sm90():
    """(elem, head_dim, causal, cfg, mask): the default configs with every mask kind."""
    out = []
    for d in HEAD_DIMS_SM90:
        for elem in ar.ELEMENTS:
            for causal in (False, True):
                for mask in ar.mask_kinds(elem):
                    out.append((elem, d, causal, default_config_sm90(d, causal, masked=True), mask))
    return out


def all_instantiations_sm90():
    """(elem, head_dim, causal, cfg), one per kernel (configs differing only on the host share one)."""
    out, seen = [], set()
    for d in HEAD_DIMS_SM90:
        for cfg in configs_sm90(d):
            for elem in ar.ELEMENTS:
                for causal in (False, True):
                    for cuts in (True, False):  # (the CI compile: every kernel a call can run)
                        c = cfg.for_call(causal, False, cuts)
                        e = name_expression_sm90(elem, d, causal, c)
                        if e not in seen:
                            seen.add(e)
                            out.append((elem, d, causal, c))
    return out


def compile_options_sm90():
    return ar.compile_options(ARCH_SM90)


def sm90_enabled() -> bool:
    """OPFUSE_ATTN_SM90=0 forces the mma.sync kernel (for comparison)."""
    return os.environ.get("OPFUSE_ATTN_SM90", "1") != "0"


# Head dims whose masked calls the Hopper kernel takes by default: at D = 128
# it was 1.35-1.6x faster than the mma.sync kernel with a mask on the H200
# (docs/attention.md, "attn_mask"); at D = 64 (three consumers at 160
# registers) a full mask spills hundreds of bytes, unmeasured.
SM90_MASK_HEAD_DIMS = (128,)


def sm90_mask_enabled(head_dim: int) -> bool:
    """OPFUSE_ATTN_SM90_MASK: unset, the Hopper kernel takes masked calls at
    SM90_MASK_HEAD_DIMS; 0: never (the mma.sync kernel); 1: at every head dim it covers."""
    v = os.environ.get("OPFUSE_ATTN_SM90_MASK", "")
    return v == "1" or (v != "0" and head_dim in SM90_MASK_HEAD_DIMS)


def sm90_unsupported_reason(arch: str, head_dim: int, seqlen_k: int, mask=None) -> str:
    """Empty when the Hopper kernel takes the problem, else why not."""
    if not arch.startswith("sm_90"):
        return f"{arch} is not sm_90"
    if not sm90_enabled():
        return "OPFUSE_ATTN_SM90=0"
    if mask and not sm90_mask_enabled(head_dim):
        return "an attn_mask at this head dim (OPFUSE_ATTN_SM90_MASK)"
    if head_dim not in HEAD_DIMS_SM90:
        return f"head dim {head_dim} is not 64, 96, 128 or 256"
    if seqlen_k == 0:
        return "Sk = 0 (a tensor map needs non-empty dims)"
    return ""


def compile_kernel_sm90(nvrtc: ar.Nvrtc, elem: str, head_dim: int, causal: bool, cfg: Sm90Config,
                        source: str | None = None, use_cache: bool = True, mask=None):
    """Compiles one instantiation for sm_90a. Returns dict(cubin, lowered, log, resources, cached)."""
    if source is None:
        source = sm90_source()
    expr = name_expression_sm90(elem, head_dim, causal, cfg, mask)
    opts = compile_options_sm90()

    def build():
        cubin, log, lowered = nvrtc.compile(source, "attention_fwd_sm90.cu", opts, [expr])
        return cubin, dict(lowered=lowered[expr], log=log, resources=ar.parse_ptxas(log), expression=expr,
                           arch=ARCH_SM90)

    return ar.cached_cubin([source, expr, " ".join(opts), f"nvrtc{nvrtc.version}"], use_cache, build)


# ---------------------------------------------------------------------------
# Tensor maps (cuTensorMapEncodeTiled) and the launch
# ---------------------------------------------------------------------------

class CUtensorMap(ctypes.Structure):
    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


CU_TENSOR_MAP_DATA_TYPE = {"f16": 6, "bf16": 9}
CU_TENSOR_MAP_INTERLEAVE_NONE = 0
CU_TENSOR_MAP_SWIZZLE_128B = 3
CU_TENSOR_MAP_L2_PROMOTION_L2_128B = 2
CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0  # out-of-bounds elements read as zero


def _bind_encode(lib):
    f = lib.cuTensorMapEncodeTiled
    f.argtypes = [ctypes.POINTER(CUtensorMap), ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                  ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32),
                  ctypes.POINTER(ctypes.c_uint32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


def encode_tensor_map(driver: ar.CudaDriver, elem: str, ptr: int, shape, strides, box_rows: int) -> CUtensorMap:
    """4-D map over a [B, H, S, D] tensor with element strides (b, h, s, 1): dims (D, S, H, B),
    box (64, box_rows, 1, 1), 128-byte swizzle (the kernel's shared-memory layout)."""
    if not hasattr(driver, "_encode_tiled"):
        driver._encode_tiled = _bind_encode(driver.lib)
    B, H, S, D = shape
    dims = (ctypes.c_uint64 * 4)(D, max(S, 1), max(H, 1), max(B, 1))
    gstrides = (ctypes.c_uint64 * 3)(2 * strides[2], 2 * strides[1], 2 * strides[0])
    box = (ctypes.c_uint32 * 4)(64, box_rows, 1, 1)
    estr = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
    m = CUtensorMap()
    rc = driver._encode_tiled(ctypes.byref(m), CU_TENSOR_MAP_DATA_TYPE[elem], 4, ctypes.c_void_p(ptr), dims, gstrides,
                              box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    driver.check(rc, f"cuTensorMapEncodeTiled(dims {tuple(dims)}, strides {tuple(gstrides)}, box {tuple(box)})")
    return m


class AttnSplitWs(ctypes.Structure):
    """The kernel's fifth argument (kOptSplit): partials and flags, or nulls."""
    _fields_ = [("partial", ctypes.c_void_p), ("flags", ctypes.c_void_p)]


def split_workspace_sm90(head_dim: int, cfg: Sm90Config, grid_x: int):
    """(bytes, flag bytes to zero first) of a kOptSplit launch's workspace: the flags
    (grid_x * consumers u32, padded to 256 bytes), then each CTA's partials slot."""
    flags = -(-grid_x * cfg.consumers * 4 // 256) * 256
    return flags + grid_x * 128 * cfg.consumers * (head_dim // 2 + 4) * 4, flags


def launch_sm90(driver: ar.CudaDriver, fn, grid, cfg: Sm90Config, smem: int, stream, params, tm_q, tm_k, tm_v,
                ws: AttnSplitWs | None = None, tm_o=None):
    """grid: cfg.grid(...) (persistent CTAs loop over the tiles); ws: the split workspace (kOptSplit);
    tm_o: the map over O with 64-row boxes (kOptStoreO; other tiles get tm_q in its place, never read)."""
    ws = ws if ws is not None else AttnSplitWs()
    if cfg.store_o and tm_o is None:
        raise ValueError(f"tile {cfg.tag()} stores O through TMA: launch_sm90 needs tm_o")
    args = (ctypes.c_void_p * 6)(*(ctypes.cast(ctypes.pointer(x), ctypes.c_void_p)
                                   for x in (params, tm_q, tm_k, tm_v, ws, tm_o if tm_o is not None else tm_q)))
    driver.check(driver.lib.cuLaunchKernel(fn, grid[0], grid[1], grid[2], cfg.num_threads, 1, 1, smem,
                                           ctypes.c_void_p(stream), args, None), "cuLaunchKernel(sm90)")


def compile_ptx_and_cubin_sm90(nvrtc: ar.Nvrtc, exprs, source: str | None = None):
    """One NVRTC program for `exprs` (CI): returns (ptx text, cubin bytes, log, {expr: lowered})."""
    return nvrtc.compile_with_ptx(source if source is not None else sm90_source(), "attention_fwd_sm90.cu",
                                  compile_options_sm90(), exprs)
