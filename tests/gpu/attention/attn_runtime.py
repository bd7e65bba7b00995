"""Run-time compilation and launch of src/kernels/attention/attention_fwd.cu.

A stand-in for opfuse's C++ runtime (dlopen of libnvrtc / libcuda, a disk
cache of cubins, launches on PyTorch's current stream) so the attention kernel
can be tested and timed before that runtime exists. Only ctypes: no pip
package beyond torch, no CUDA headers.

    fwd = AttentionForward()                 # needs torch with CUDA
    o, lse = fwd(q, k, v, causal=True)       # q [B,Hq,Sq,D], k/v [B,Hkv,Sk,D]

Compilation alone (no GPU, no torch) goes through `Nvrtc` and `compile_kernel`;
`python attn_runtime.py precompile --arch sm_90 --out DIR` fills a cubin cache
that a GPU machine can reuse (OPFUSE_ATTN_CUBIN_DIR=DIR).
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import hashlib
import json
import math
import os
import pathlib
import re
import site
import sys

REPO = pathlib.Path(__file__).resolve().parents[3]
KERNEL_SOURCE = REPO / "src" / "kernels" / "attention" / "attention_fwd.cu"
PTX_SOURCE = REPO / "src" / "kernels" / "attention" / "attention_ptx.cu"


def kernel_source() -> str:
    """What NVRTC compiles: the shared PTX helpers, then the kernel (as the C++ launcher does)."""
    return PTX_SOURCE.read_text() + "\n" + KERNEL_SOURCE.read_text()

# ---------------------------------------------------------------------------
# Kernel configurations
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    block_m: int
    block_n: int
    num_warps: int
    min_blocks: int  # __launch_bounds__ minimum CTAs per SM (register cap)
    split_pv: bool = False  # softmax/PV per m-tile (overlap within a warp)

    def tag(self) -> str:
        return f"{self.block_m}x{self.block_n}w{self.num_warps}b{self.min_blocks}{'s' if self.split_pv else ''}"

    @staticmethod
    def parse(tag: str) -> "FwdConfig":
        m = re.fullmatch(r"(\d+)x(\d+)w(\d+)b(\d+)(s?)", tag)
        if not m:
            raise ValueError(f"bad config tag {tag!r} (want e.g. 128x64w4b2 or 128x64w4b2s)")
        return FwdConfig(*(int(g) for g in m.groups()[:4]), split_pv=bool(m.group(5)))


# Default tile per head dim, in order of preference: the first whose shared
# memory fits the device is used (see docs/attention.md for why these).
DEFAULT_CONFIGS = {
    64: [FwdConfig(128, 128, 4, 2)],
    96: [FwdConfig(128, 64, 4, 2)],
    128: [FwdConfig(128, 64, 4, 2), FwdConfig(128, 32, 4, 2)],
    256: [FwdConfig(128, 64, 8, 1), FwdConfig(128, 32, 8, 1), FwdConfig(64, 32, 4, 1)],
}

# Variants the benchmark may time beside the default (CI compiles them too).
VARIANT_CONFIGS = {
    64: [FwdConfig(256, 128, 8, 1), FwdConfig(128, 64, 4, 2)],
    96: [FwdConfig(128, 64, 8, 1)],
    128: [FwdConfig(256, 64, 8, 1), FwdConfig(128, 64, 4, 2, True), FwdConfig(128, 32, 4, 2)],
    256: [FwdConfig(128, 32, 8, 1), FwdConfig(64, 64, 4, 1), FwdConfig(64, 32, 4, 1)],
}

# Tiles of 256 query rows (8 warps of 32 rows, one CTA per SM) halve the K/V
# traffic from L2 per FLOP but leave no second CTA to overlap a CTA's prologue
# and epilogue: they pay off when each CTA runs many key blocks (measured on
# the H200, docs/attention.md).
LONG_TILES = {
    # head dim: (tile, min Sk when not causal, min Sk when causal or None)
    # +4-6% over 128x64 in two runs of three (non-causal, S >= 8192), -3% in the third
    128: (FwdConfig(256, 64, 8, 1), 8192, None),
}


def choose_config(head_dim: int, seqlen_q: int, seqlen_k: int, causal: bool, arch: str = "sm_90",
                  smem_limit: int | None = None) -> "FwdConfig":
    """The tile the launcher uses for one problem shape."""
    limit = smem_limit or MAX_SMEM_PER_BLOCK.get(arch, 101376)
    if head_dim in LONG_TILES:
        big, min_sk, min_sk_causal = LONG_TILES[head_dim]
        need = min_sk_causal if causal else min_sk
        if need is not None and seqlen_q >= 256 and seqlen_k >= need and smem_bytes(head_dim, big) <= limit:
            return big
    return default_config(head_dim, arch, smem_limit)


# Largest dynamic shared memory one CTA may opt into, per architecture.
MAX_SMEM_PER_BLOCK = {"sm_80": 166912, "sm_86": 101376, "sm_87": 166912, "sm_89": 101376, "sm_90": 232448}


# With an attn_mask, D = 64 takes 128x64 tiles: on 128x128 (128 S values per
# thread) the mask step spilled 128-244 bytes, on 128x64 0-68.
MASKED_CONFIGS = {64: [FwdConfig(128, 64, 4, 2)]}


def default_config(head_dim: int, arch: str = "sm_90", smem_limit: int | None = None,
                   masked: bool = False) -> "FwdConfig":
    limit = smem_limit or MAX_SMEM_PER_BLOCK.get(arch, 101376)
    configs = MASKED_CONFIGS.get(head_dim, DEFAULT_CONFIGS[head_dim]) if masked else DEFAULT_CONFIGS[head_dim]
    for cfg in configs:
        if smem_bytes(head_dim, cfg) <= limit:
            return cfg
    raise ValueError(f"no attention tile for head dim {head_dim} fits {limit} bytes of shared memory on {arch}")


HEAD_DIMS = (64, 96, 128, 256)
ELEMENTS = ("bf16", "f16")

# attn_mask kinds the kernels take (the Mask template argument of
# attention_ptx.cu): None, "full-<dtype>" (any broadcast shape, one value per
# (b, h, i, j)) with dtype bool / bf16 / f16 / f32, or "keypad" (one float32
# value per (b, j)).
MASK_POLICIES = {
    None: "",
    "full-bool": "opfuse_attn::MaskFull<opfuse_attn::bool8>",
    "full-bf16": "opfuse_attn::MaskFull<opfuse_attn::bf16>",
    "full-f16": "opfuse_attn::MaskFull<opfuse_attn::f16>",
    "full-f32": "opfuse_attn::MaskFull<float>",
    "keypad": "opfuse_attn::MaskKeyPad",
}
# The masked instantiations shipped (and compiled by CI): default tiles, every
# mask kind whose dtype can go with the element type.
def mask_kinds(elem: str):
    return ["full-bool", f"full-{elem}", "full-f32", "keypad"]


def _mask_arg(mask) -> str:
    return f", {MASK_POLICIES[mask]}" if mask else ""


def smem_bytes(head_dim: int, cfg: FwdConfig, mask=None) -> int:
    """Dynamic shared memory of one CTA (FwdTile::kSmemBytes, + 2 stages of
    BLOCK_N float32 key-padding values for the keypad mask)."""
    stride_bytes = (head_dim + 8) * 2
    extra = 2 * cfg.block_n * 4 if mask == "keypad" else 0
    return cfg.block_m * stride_bytes + 2 * 2 * cfg.block_n * stride_bytes + extra


def name_expression(elem: str, head_dim: int, causal: bool, cfg: FwdConfig, mask=None) -> str:
    return (
        f"opfuse_attn::attention_fwd<opfuse_attn::{elem}, {head_dim}, {'true' if causal else 'false'}, "
        f"{cfg.block_m}, {cfg.block_n}, {cfg.num_warps}, {cfg.min_blocks}, {'true' if cfg.split_pv else 'false'}"
        f"{_mask_arg(mask)}>"
    )


def kernel_mask(attn_mask, B: int, Hq: int, Sq: int, Sk: int, q_dtype):
    """What the kernels take for an attn_mask broadcastable to [B, Hq, Sq, Sk]:
    (kind, tensor, element strides over [B, Hq, Sq, Sk]); (None, None, None)
    without a mask. Key padding (one value per (b, key)) becomes a float32
    [B, Sk] tensor (bool: 0 / -inf); other masks keep their storage (bool,
    q's dtype, float32; other float dtypes go to float32) unless the key
    dim is not contiguous, then their own (unbroadcast) shape is copied.
    (python/opfuse/ops/attention.py has the same rules.)"""
    import torch

    if attn_mask is None:
        return None, None, None
    m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)) if attn_mask.dim() < 4 else attn_mask
    e = m.expand(B, Hq, Sq, Sk)
    st = e.stride()
    if (Hq == 1 or st[1] == 0) and (Sq == 1 or st[2] == 0):
        kp = e[:, 0, 0, :]
        kp = torch.where(kp, 0.0, float("-inf")) if kp.dtype == torch.bool else kp.float()
        kp = kp.contiguous()
        return "keypad", kp, (Sk, 0, 0, 1)
    if m.dtype == torch.bool:
        kind = "full-bool"
    elif m.dtype == q_dtype:
        kind = "full-bf16" if q_dtype == torch.bfloat16 else "full-f16"
    else:
        kind = "full-f32"
        if m.dtype != torch.float32:
            m = m.float()
    if Sk > 1 and (m.shape[3] == 1 or m.stride(-1) != 1):
        m = m.expand(*m.shape[:3], Sk).contiguous() if m.shape[3] == 1 else m.contiguous()
    e = m.expand(B, Hq, Sq, Sk)
    return kind, e, tuple(e.stride())


def all_instantiations(include_variants: bool = True):
    """(elem, head_dim, causal, cfg) for every unmasked instantiation we ship."""
    out = []
    for d in HEAD_DIMS:
        cfgs = list(DEFAULT_CONFIGS[d])
        if include_variants:
            cfgs += [c for c in VARIANT_CONFIGS[d] if c not in cfgs]
        for cfg in cfgs:
            for elem in ELEMENTS:
                for causal in (False, True):
                    out.append((elem, d, causal, cfg))
    return out


def masked_instantiations(arch: str = "sm_90"):
    """(elem, head_dim, causal, cfg, mask) for every masked instantiation we
    ship on `arch`: the default tile of each head dim, every mask kind."""
    out = []
    for d in HEAD_DIMS:
        cfg = default_config(d, arch, masked=True)
        for elem in ELEMENTS:
            for causal in (False, True):
                for mask in mask_kinds(elem):
                    out.append((elem, d, causal, cfg, mask))
    return out


# ---------------------------------------------------------------------------
# Library lookup
# ---------------------------------------------------------------------------


def _site_dirs():
    dirs = []
    try:
        dirs += site.getsitepackages()
    except Exception:
        pass
    try:
        dirs.append(site.getusersitepackages())
    except Exception:
        pass
    dirs += [p for p in sys.path if p.endswith("site-packages")]
    seen, out = set(), []
    for d in dirs:
        if d not in seen:
            seen.add(d)
            out.append(d)
    return out


def _try_noload(names):
    mode = getattr(os, "RTLD_NOLOAD", 4) | getattr(os, "RTLD_GLOBAL", 0x100)
    for n in names:
        try:
            return ctypes.CDLL(n, mode=mode), n + " (already loaded)"
        except OSError:
            pass
    return None, None


def load_nvrtc():
    """Returns (CDLL, path) or raises OSError listing what was tried."""
    tried = []
    env = os.environ.get("OPFUSE_NVRTC_LIB")
    if env:
        return ctypes.CDLL(env, mode=getattr(os, "RTLD_GLOBAL", 0)), env
    lib, where = _try_noload(["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"])
    if lib is not None:
        return lib, where
    paths = []
    for sp in _site_dirs():
        for pat in ("nvidia/cu13/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*"):
            paths += sorted(glob.glob(os.path.join(sp, pat)), reverse=True)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            paths += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")), reverse=True)
    paths += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    for p in paths:
        try:
            return ctypes.CDLL(p, mode=getattr(os, "RTLD_GLOBAL", 0)), p
        except OSError as e:
            tried.append(f"{p}: {e}")
    raise OSError("libnvrtc not found; tried:\n  " + "\n  ".join(tried))


# ---------------------------------------------------------------------------
# NVRTC
# ---------------------------------------------------------------------------


class NvrtcError(RuntimeError):
    pass


class Nvrtc:
    def __init__(self):
        self.lib, self.path = load_nvrtc()
        L = self.lib
        L.nvrtcGetErrorString.restype = ctypes.c_char_p
        L.nvrtcCreateProgram.argtypes = [
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
            ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p)]
        L.nvrtcAddNameExpression.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        L.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        L.nvrtcGetProgramLogSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        L.nvrtcGetProgramLog.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        L.nvrtcGetCUBINSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        L.nvrtcGetCUBIN.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        L.nvrtcGetPTXSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        L.nvrtcGetPTX.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        L.nvrtcGetLoweredName.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]
        L.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(L.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, rc, what, log=""):
        if rc != 0:
            msg = self.lib.nvrtcGetErrorString(rc).decode()
            raise NvrtcError(f"{what} failed: {msg}\n{log}")

    def compile(self, source: str, name: str, options, name_expressions):
        """Returns (cubin bytes, log text, {expression: lowered name})."""
        return self._compile(source, name, options, name_expressions, want_ptx=False)[1:]

    def compile_with_ptx(self, source: str, name: str, options, name_expressions):
        """Returns (PTX text, cubin bytes, log text, {expression: lowered name}) (for checks of the instructions)."""
        return self._compile(source, name, options, name_expressions, want_ptx=True)

    def _compile(self, source, name, options, name_expressions, want_ptx):
        L = self.lib
        prog = ctypes.c_void_p()
        self._check(L.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
                    "nvrtcCreateProgram")
        try:
            for e in name_expressions:
                self._check(L.nvrtcAddNameExpression(prog, e.encode()), "nvrtcAddNameExpression")
            opts = [o.encode() for o in options]
            arr = (ctypes.c_char_p * len(opts))(*opts)
            rc = L.nvrtcCompileProgram(prog, len(opts), arr)
            size = ctypes.c_size_t()
            L.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            L.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
            self._check(rc, "nvrtcCompileProgram", log)
            lowered = {}
            for e in name_expressions:
                p = ctypes.c_char_p()
                self._check(L.nvrtcGetLoweredName(prog, e.encode(), ctypes.byref(p)), "nvrtcGetLoweredName")
                lowered[e] = p.value.decode()
            ptx = None
            if want_ptx:
                self._check(L.nvrtcGetPTXSize(prog, ctypes.byref(size)), "nvrtcGetPTXSize")
                text = ctypes.create_string_buffer(size.value)
                self._check(L.nvrtcGetPTX(prog, text), "nvrtcGetPTX")
                ptx = text.value.decode(errors="replace")
            self._check(L.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(L.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return ptx, cubin.raw, log, lowered
        finally:
            L.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_options(arch: str):
    return [f"--gpu-architecture={arch}", "-std=c++17", "--ptxas-options=-v", "-lineinfo"]


_PTXAS_RE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def split_ptxas_log(log: str) -> dict:
    """ptxas -v output per entry function (mangled name -> its lines), for
    programs holding several kernels."""
    per_fn, cur = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = m.group(1)
            per_fn[cur] = ""
        if cur:
            per_fn[cur] += line + "\n"
    return per_fn


def parse_ptxas(log: str):
    """Resource use from a single-kernel ptxas -v log."""
    out = {}
    for key, rx in _PTXAS_RE.items():
        m = rx.search(log)
        out[key] = int(m.group(1)) if m else None
    return out


def cache_dir() -> pathlib.Path:
    d = os.environ.get("OPFUSE_ATTN_CUBIN_DIR") or os.path.join(
        os.environ.get("OPFUSE_CACHE_DIR", os.path.expanduser("~/.cache/opfuse")), "attention")
    return pathlib.Path(d)


def cached_cubin(key_parts, use_cache: bool, build, prefix: str = ""):
    """The disk cache of the harnesses' NVRTC programs: the cubin and its metadata
    under sha256(key_parts) in cache_dir() (file names prefix + key). `build()`
    returns (cubin, meta dict) on a miss. Returns dict(cubin, cached, **meta)."""
    key = hashlib.sha256("\0".join(key_parts).encode()).hexdigest()[:32]
    cdir = cache_dir()
    cubin_path, meta_path = cdir / f"{prefix}{key}.cubin", cdir / f"{prefix}{key}.json"
    if use_cache and cubin_path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        return dict(cubin=cubin_path.read_bytes(), cached=True, **meta)
    cubin, meta = build()
    if use_cache:
        try:
            cdir.mkdir(parents=True, exist_ok=True)
            tmp = cubin_path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(cubin)
            tmp.replace(cubin_path)
            meta_path.write_text(json.dumps(meta))
        except OSError:
            pass
    return dict(cubin=cubin, cached=False, **meta)


def compile_kernel(nvrtc: Nvrtc, arch: str, elem: str, head_dim: int, causal: bool, cfg: FwdConfig,
                   source: str | None = None, use_cache: bool = True, mask=None):
    """Compiles one instantiation. Returns dict(cubin, lowered, log, resources, cached)."""
    if source is None:
        source = kernel_source()
    expr = name_expression(elem, head_dim, causal, cfg, mask)
    opts = compile_options(arch)

    def build():
        cubin, log, lowered = nvrtc.compile(source, "attention_fwd.cu", opts, [expr])
        return cubin, dict(lowered=lowered[expr], log=log, resources=parse_ptxas(log), expression=expr, arch=arch)

    return cached_cubin([source, expr, " ".join(opts), f"nvrtc{nvrtc.version}"], use_cache, build)


# ---------------------------------------------------------------------------
# CUDA driver + launch (needs torch with CUDA)
# ---------------------------------------------------------------------------


class AttnFwdParams(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("o", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        ("q_batch_stride", ctypes.c_int64), ("q_head_stride", ctypes.c_int64), ("q_row_stride", ctypes.c_int64),
        ("k_batch_stride", ctypes.c_int64), ("k_head_stride", ctypes.c_int64), ("k_row_stride", ctypes.c_int64),
        ("v_batch_stride", ctypes.c_int64), ("v_head_stride", ctypes.c_int64), ("v_row_stride", ctypes.c_int64),
        ("o_batch_stride", ctypes.c_int64), ("o_head_stride", ctypes.c_int64), ("o_row_stride", ctypes.c_int64),
        ("lse_batch_stride", ctypes.c_int64), ("lse_head_stride", ctypes.c_int64),
        ("batch", ctypes.c_int32), ("heads_q", ctypes.c_int32), ("heads_kv", ctypes.c_int32),
        ("q_per_kv", ctypes.c_int32), ("seqlen_q", ctypes.c_int32), ("seqlen_k", ctypes.c_int32),
        ("softmax_scale", ctypes.c_float), ("scale_log2", ctypes.c_float),
        ("mask", ctypes.c_void_p),
        ("mask_batch_stride", ctypes.c_int64), ("mask_head_stride", ctypes.c_int64),
        ("mask_row_stride", ctypes.c_int64), ("mask_col_stride", ctypes.c_int64),
    ]


assert ctypes.sizeof(AttnFwdParams) == 224, ctypes.sizeof(AttnFwdParams)
assert AttnFwdParams.batch.offset == 152 and AttnFwdParams.mask.offset == 184

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class CudaError(RuntimeError):
    pass


class CudaDriver:
    def __init__(self):
        lib, _ = _try_noload(["libcuda.so.1", "libcuda.so"])
        self.lib = lib or ctypes.CDLL("libcuda.so.1")
        L = self.lib
        L.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        L.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
        L.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        L.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        L.cuFuncGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_void_p]
        L.cuLaunchKernel.argtypes = [
            ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
            ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
            ctypes.POINTER(ctypes.c_void_p)]
        L.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self.check(L.cuInit(0), "cuInit")

    def check(self, rc, what):
        if rc != 0:
            s = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(s))
            raise CudaError(f"{what} failed: {rc} {s.value.decode() if s.value else ''}")

    def current_context(self):
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        return ctx.value

    def load_function(self, cubin: bytes, name: str, dyn_smem: int):
        mod = ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
        fn = ctypes.c_void_p()
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()), "cuModuleGetFunction")
        if dyn_smem > 48 * 1024:
            self.check(self.lib.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dyn_smem),
                       "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
        return mod, fn

    def func_attribute(self, fn, attr: int) -> int:
        v = ctypes.c_int()
        self.check(self.lib.cuFuncGetAttribute(ctypes.byref(v), attr, fn), "cuFuncGetAttribute")
        return v.value

    def launch(self, fn, grid, block, smem, stream, params: ctypes.Structure):
        args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(params), ctypes.c_void_p))
        self.check(self.lib.cuLaunchKernel(fn, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem,
                                           ctypes.c_void_p(stream), args, None), "cuLaunchKernel")


def current_device(who: str, arch: str | None):
    """Makes torch's primary context current on this thread (the kernels run
    on torch's stream); returns (arch, or the device's sm_XY when None, the
    device's properties)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"{who} needs a CUDA device")
    torch.cuda.init()
    torch.empty(1, device="cuda")
    if arch is None:
        major, minor = torch.cuda.get_device_capability()
        arch = f"sm_{major}{minor}"
    return arch, torch.cuda.get_device_properties(torch.cuda.current_device())


class AttentionForward:
    """Callable: (q, k, v, causal, scale, config) -> (o, lse) on torch's current stream."""

    def __init__(self, arch: str | None = None):
        self.arch, props = current_device("AttentionForward", arch)
        self.smem_limit = getattr(props, "shared_memory_per_block_optin", None)
        self.num_sms = props.multi_processor_count
        self.nvrtc = Nvrtc()
        self.driver = CudaDriver()
        self.source = kernel_source()
        self._functions = {}
        self.compile_info = {}
        # The Hopper kernel (attn_runtime_sm90.py) for the head dims it covers.
        import attn_runtime_sm90 as sm90

        self.sm90 = sm90

    def function(self, elem, head_dim, causal, cfg, mask=None):
        key = (self.driver.current_context(), elem, head_dim, causal, cfg, mask)
        fn = self._functions.get(key)
        if fn is None:
            info = compile_kernel(self.nvrtc, self.arch, elem, head_dim, causal, cfg, source=self.source, mask=mask)
            _, fn = self.driver.load_function(info["cubin"], info["lowered"], smem_bytes(head_dim, cfg, mask))
            self._functions[key] = fn
            self.compile_info[(elem, head_dim, causal, cfg, mask)] = info
        return fn

    def __call__(self, q, k, v, causal=False, scale=None, config: FwdConfig | None = None, out=None, lse=None,
                 want_lse=True, attn_mask=None):
        import torch

        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError("q, k, v must be [B, H, S, D]")
        B, Hq, Sq, D = q.shape
        Bk, Hkv, Sk, Dk = k.shape
        if v.shape != k.shape or Bk != B or Dk != D:
            raise ValueError(f"shape mismatch q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
        if Hq % Hkv != 0:
            raise ValueError(f"heads_q ({Hq}) must be a multiple of heads_kv ({Hkv})")
        if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError("q, k, v must all be bfloat16 or all float16")
        if D not in HEAD_DIMS:
            raise ValueError(f"head dim {D} not in {HEAD_DIMS}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name}: last dim must be contiguous")
            if t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:3]):
                raise ValueError(f"{name}: needs 16-byte aligned data and strides that are multiples of 8")
            if not t.is_cuda:
                raise ValueError(f"{name} must be a CUDA tensor")
        if scale is None:
            scale = 1.0 / math.sqrt(D)
        if not scale > 0:
            raise ValueError("softmax scale must be > 0")
        elem = "bf16" if q.dtype == torch.bfloat16 else "f16"
        mask, mt, mst = kernel_mask(attn_mask, B, Hq, Sq, Sk, q.dtype)
        if mt is not None and mt.device != q.device:
            raise ValueError("attn_mask must be on q's device")
        # sm_90: the Hopper kernel unless a mma.sync tile is asked for, the
        # head dim is not covered, or OPFUSE_ATTN_SM90=0 (with a mask: at
        # D = 128 unless OPFUSE_ATTN_SM90_MASK=0, at D = 64 if it is 1).
        sm90_cfg = config if isinstance(config, self.sm90.Sm90Config) else None
        if config is None and not self.sm90.sm90_unsupported_reason(self.arch, D, Sk, mask):
            sm90_cfg = self.sm90.default_config_sm90(D, causal, masked=mask is not None)
        if sm90_cfg is not None:
            why = self.sm90.sm90_unsupported_reason(self.arch, D, Sk, mask)
            why = why.replace("an attn_mask at this head dim (OPFUSE_ATTN_SM90_MASK)", "").replace("OPFUSE_ATTN_SM90=0", "")
            if why:
                raise ValueError(f"sm90 config {sm90_cfg.tag()}: {why}")
        # Masked calls use the default tile (the masked instantiations shipped).
        if sm90_cfg is not None:
            cuts = sm90_cfg.split_cuts(Sq, Sk, Hq, B, self.num_sms, bool(causal))
            sm90_cfg = sm90_cfg.for_call(bool(causal), mask is not None, cuts)
        cfg = sm90_cfg or config or (default_config(D, self.arch, self.smem_limit, masked=True) if mask else
                                     choose_config(D, Sq, Sk, bool(causal), self.arch, self.smem_limit))
        self.last_config = cfg
        if out is None:
            out = torch.empty((B, Hq, Sq, D), dtype=q.dtype, device=q.device)
        if want_lse and lse is None:
            lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=q.device)
        if out.stride(-1) != 1 or out.data_ptr() % 16 or any(s % 8 for s in out.stride()[:3]):
            raise ValueError("out: needs a contiguous last dim, 16-byte alignment, strides multiple of 8")
        if B == 0 or Hq == 0 or Sq == 0:
            return out, lse
        fn = (self.function_sm90(elem, D, bool(causal), cfg, mask) if sm90_cfg
              else self.function(elem, D, bool(causal), cfg, mask))
        p = AttnFwdParams()
        p.q, p.k, p.v, p.o = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        p.lse = lse.data_ptr() if lse is not None else None
        p.q_batch_stride, p.q_head_stride, p.q_row_stride = q.stride()[:3]
        p.k_batch_stride, p.k_head_stride, p.k_row_stride = k.stride()[:3]
        p.v_batch_stride, p.v_head_stride, p.v_row_stride = v.stride()[:3]
        p.o_batch_stride, p.o_head_stride, p.o_row_stride = out.stride()[:3]
        if lse is not None:
            p.lse_batch_stride, p.lse_head_stride = lse.stride()[:2]
        p.batch, p.heads_q, p.heads_kv, p.q_per_kv = B, Hq, Hkv, Hq // Hkv
        p.seqlen_q, p.seqlen_k = Sq, Sk
        p.softmax_scale = scale
        p.scale_log2 = scale * math.log2(math.e)
        if mt is not None:
            p.mask = mt.data_ptr()
            p.mask_batch_stride, p.mask_head_stride, p.mask_row_stride, p.mask_col_stride = mst
            self._mask_alive = mt  # until the next call (the launch is asynchronous)
        grid = ((Sq + cfg.block_m - 1) // cfg.block_m, Hq, B)
        if grid[1] > 65535 or grid[2] > 65535:
            raise ValueError("heads and batch must each be <= 65535")
        stream = torch.cuda.current_stream(q.device).cuda_stream
        if sm90_cfg:
            sm = self.sm90
            tms = [sm.encode_tensor_map(self.driver, elem, t.data_ptr(), t.shape, t.stride(), rows)
                   for t, rows in ((q, cfg.block_m), (k, cfg.block_n), (v, cfg.block_n))]
            grid = cfg.grid(Sq, Hq, B, self.num_sms)
            ws = None
            if cfg.split:
                nbytes, zbytes = sm.split_workspace_sm90(D, cfg, grid[0])
                buf = torch.empty(nbytes, dtype=torch.uint8, device=q.device)
                buf[:zbytes].zero_()
                self._split_ws_alive = buf  # until the next call (the launch is asynchronous)
                ws = sm.AttnSplitWs(buf.data_ptr() + zbytes, buf.data_ptr())
            tm_o = sm.encode_tensor_map(self.driver, elem, out.data_ptr(), out.shape, out.stride(), 64) \
                if cfg.store_o else None
            sm.launch_sm90(self.driver, fn, grid, cfg, sm.smem_bytes_sm90(D, cfg), stream, p, *tms, ws=ws, tm_o=tm_o)
            return out, lse
        self.driver.launch(fn, grid, (cfg.num_warps * 32, 1, 1), smem_bytes(D, cfg, mask), stream, p)
        return out, lse

    def function_sm90(self, elem, head_dim, causal, cfg, mask=None):
        key = (self.driver.current_context(), "sm90", elem, head_dim, causal, cfg, mask)
        fn = self._functions.get(key)
        if fn is None:
            info = self.sm90.compile_kernel_sm90(self.nvrtc, elem, head_dim, causal, cfg, mask=mask)
            _, fn = self.driver.load_function(info["cubin"], info["lowered"], self.sm90.smem_bytes_sm90(head_dim, cfg))
            self._functions[key] = fn
            self.compile_info[(elem, head_dim, causal, cfg, mask)] = info
        return fn


# ---------------------------------------------------------------------------
# CLI: precompile (fills the cache), report (ptxas resources)
# ---------------------------------------------------------------------------


def _compile_one(args):
    arch, elem, d, causal, tag, mask = args
    nv = Nvrtc()
    if tag.startswith("wg"):  # the Hopper kernel (attn_runtime_sm90.py)
        import attn_runtime_sm90 as sm90

        info = sm90.compile_kernel_sm90(nv, elem, d, causal, sm90.Sm90Config.parse(tag), mask=mask)
        return (sm90.ARCH_SM90, elem, d, causal, tag, mask, info["resources"], info["cached"])
    info = compile_kernel(nv, arch, elem, d, causal, FwdConfig.parse(tag), mask=mask)
    return (arch, elem, d, causal, tag, mask, info["resources"], info["cached"])


def precompile_args(argv, doc):
    """The options of the precompile / report command line (here and in
    attn_bwd_runtime.py); --out sets OPFUSE_ATTN_CUBIN_DIR."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["precompile", "report"])
    ap.add_argument("--arch", action="append", help="sm_80, sm_90 (repeatable; default sm_90)")
    ap.add_argument("--out", help="cubin cache dir (sets OPFUSE_ATTN_CUBIN_DIR)")
    ap.add_argument("--defaults-only", action="store_true")
    ap.add_argument("--masks-only", action="store_true", help="only the masked instantiations")
    ap.add_argument("--no-masks", action="store_true", help="no masked instantiation")
    ap.add_argument("--only", help="comma-separated terms every compiled job's description must contain")
    ap.add_argument("-j", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args(argv)
    if a.out:
        os.environ["OPFUSE_ATTN_CUBIN_DIR"] = a.out
    return a


def main(argv=None):
    import concurrent.futures as cf

    a = precompile_args(argv, __doc__)
    archs = a.arch or ["sm_90"]
    jobs = []
    if not a.masks_only:
        jobs += [(arch, elem, d, causal, cfg.tag(), None)
                 for arch in archs
                 for (elem, d, causal, cfg) in all_instantiations(include_variants=not a.defaults_only)]
    if not a.no_masks:
        jobs += [(arch, *i[:3], i[3].tag(), i[4]) for arch in archs for i in masked_instantiations(arch)]
    if any(arch.startswith("sm_90") for arch in archs):
        import attn_runtime_sm90 as sm90

        if not a.masks_only:
            jobs += [("sm_90a", elem, d, causal, cfg.tag(), None)
                     for (elem, d, causal, cfg) in sm90.all_instantiations_sm90()
                     if not a.defaults_only or cfg in sm90.DEFAULT_SM90.values()]
        if not a.no_masks:
            jobs += [("sm_90a", *i[:3], i[3].tag(), i[4]) for i in sm90.masked_instantiations_sm90()]
    if a.only:  # e.g. --only "D=128" keeps the jobs whose description contains every term
        terms = a.only.split(",")
        jobs = [j for j in jobs if all(t in f"{j[0]} {j[1]} D={j[2]} causal={int(j[3])} {j[4]} {j[5]}" for t in terms)]
    with cf.ProcessPoolExecutor(max_workers=a.j) as ex:
        for arch, elem, d, causal, tag, mask, res, cached in ex.map(_compile_one, jobs):
            print(f"{arch} {elem:4} D={d:3} causal={int(causal)} {tag:12} {mask or '':9} regs={res['registers']} "
                  f"stack={res['stack']} spill_st={res['spill_stores']} spill_ld={res['spill_loads']}"
                  f"{' (cached)' if cached else ''}", flush=True)


if __name__ == "__main__":
    main()
