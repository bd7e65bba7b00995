#include "runtime/attention_bwd_launcher.h"
#include "runtime/attention_bwd_launcher_sm90.h"


#include <cmath>
#include <map>
#include <mutex>
#include <numbers>
#include <stdexcept>
#include <tuple>

#include "runtime/compile_cache.h"
#include "runtime/hash.h"
#include "runtime/nvrtc_named.h"

#include "attention_bwd_cu.inc"  // static const char attention_bwd_cu[]
#include "attention_ptx_cu.inc"  // static const char attention_ptx_cu[]

namespace opfuse::attention {
namespace {

constexpr int kAttrMaxDynamicSharedBytes = 8;     // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
enum Role { kPreprocess, kDkdvAtomic, kDkdv, kConvert, kDq, kRoles };

const std::string& source() {
  static const std::string s = std::string(attention_ptx_cu) + "\n" + attention_bwd_cu;
  return s;
}

// Cache entries: "opfuse-attn-bwd-cubin\n", one lowered name per line (kRoles
// lines), then the cubin.
constexpr const char kMagic[] = "opfuse-attn-bwd-cubin\n";

std::mutex& mu() {
  static std::mutex m;
  return m;
}

const char* b(bool x) { return x ? "true" : "false"; }

// The kernels' argument for one call (the Hopper launcher takes it too).
AttnBwdParams make_params(const AttnBackwardArgs& a) {
  const int D = static_cast<int>(a.head_dim);
  AttnBwdParams p{};
  p.q = a.q, p.k = a.k, p.v = a.v, p.o = a.o, p.dout = a.dout;
  p.dq = a.dq, p.dk = a.dk, p.dv = a.dv;
  p.lse = a.lse, p.dq_accum = a.deterministic ? nullptr : a.dq_accum, p.delta = a.delta, p.lse_log2 = a.lse_log2;
  for (int d = 0; d < 3; ++d) {
    p.q_strides[d] = a.q_strides[d], p.k_strides[d] = a.k_strides[d], p.v_strides[d] = a.v_strides[d];
    p.o_strides[d] = a.o_strides[d], p.do_strides[d] = a.do_strides[d], p.dq_strides[d] = a.dq_strides[d];
    p.dk_strides[d] = a.dk_strides[d], p.dv_strides[d] = a.dv_strides[d];
  }
  p.lse_strides[0] = a.lse_strides[0], p.lse_strides[1] = a.lse_strides[1];
  p.batch = static_cast<int32_t>(a.batch);
  p.heads_q = static_cast<int32_t>(a.heads_q);
  p.heads_kv = static_cast<int32_t>(a.heads_kv);
  p.q_per_kv = static_cast<int32_t>(a.heads_q / a.heads_kv);
  p.seqlen_q = static_cast<int32_t>(a.seqlen_q);
  p.seqlen_k = static_cast<int32_t>(a.seqlen_k);
  p.seqlen_q_pad = static_cast<int32_t>(attn_bwd_padded_rows(a.seqlen_q));
  const double scale = a.softmax_scale > 0 ? a.softmax_scale : 1.0 / std::sqrt(static_cast<double>(D));
  p.softmax_scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * std::numbers::log2e);
  p.mask = a.mask != AttnMaskKind::None ? a.mask_ptr : nullptr;
  for (int d = 0; d < 4; ++d) p.mask_strides[d] = a.mask != AttnMaskKind::None ? a.mask_strides[d] : 0;
  return p;
}

}  // namespace

AttnBwdCompiled attn_bwd_compile_program(const std::string& source, const char* file,
                                         const std::vector<std::string>& exprs, const std::string& gpu_arch,
                                         const std::string& what, const char* magic, const char* suffix,
                                         bool use_cache) {
  auto compile = [&] {
    NvrtcNamed r = nvrtc_compile_named(source.c_str(), file, exprs, gpu_arch, what);
    AttnBwdCompiled out;
    out.expressions = exprs;
    out.lowered = std::move(r.lowered);
    out.cubin = std::move(r.cubin);
    out.log = std::move(r.log);
    return out;
  };
  if (!use_cache) return compile();
  const NvrtcApi& n = nvrtc();
  if (!n.loaded) throw std::runtime_error("NVRTC not available: " + n.error);
  std::string key_src = source + "\n";
  for (const auto& x : exprs) key_src += x + "\n";
  for (const auto& o : nvrtc_named_options(gpu_arch)) key_src += o + " ";
  key_src += "\nnvrtc " + std::to_string(n.major) + "." + std::to_string(n.minor);
  const std::string key = content_hash(key_src);
  AttnBwdCompiled fresh;
  bool built = false;
  auto build = [&](const std::string& out) {
    fresh = compile();
    built = true;
    write_file_atomic(out, pack_named_cubin(magic, fresh.lowered, fresh.cubin));
  };
  CacheLookup found = cache_get_or_build("attention", key, suffix, build);
  if (built) return fresh;
  bool ok = false;
  AttnBwdCompiled c;
  c.expressions = exprs;
  if (std::string bytes = read_file(found.path, &ok);
      ok && unpack_named_cubin(bytes, magic, exprs.size(), &c.lowered, &c.cubin)) {
    c.cache_hit = true;
    return c;
  }
  cache_evict(found.path);  // another layout or a damaged entry: rebuild
  cache_get_or_build("attention", key, suffix, build);
  return fresh;
}

int attn_bwd_dkdv_smem_bytes(int d, const AttnTile& t, bool masked) {
  const int sb = (d + 8) * 2, psb = (t.block_m + 8) * 2;
  const int warps_d = t.num_warps / (t.block_n / 16);
  const int stage = 2 * t.block_m * sb + (masked ? 3 : 2) * t.block_m * 4;  // Q, dO, LSE2, Delta (, A)
  return 2 * t.block_n * sb + 2 * stage + (warps_d > 1 ? 2 : 1) * t.block_n * psb;
}

int attn_bwd_dq_smem_bytes(int d, const AttnTile& t) {
  const int sb = (d + 8) * 2;
  return 2 * t.block_m * sb + 2 * 2 * t.block_n * sb;
}

AttnBwdTiles attn_bwd_choose_tiles(int head_dim, int arch, int smem_limit, bool masked) {
  const int limit = smem_limit > 0 ? smem_limit : attn_max_smem_for_arch(arch);
  // Mirrors attn_bwd_runtime.DKDV_TILES / DQ_TILES (docs/attention.md, "Backward").
  std::vector<AttnTile> kv, q;
  switch (head_dim) {
    case 64:
      // Masked: the 64-query tile (on 128x128 the mask step spilled up to 384 bytes).
      kv = masked ? std::vector<AttnTile>{{64, 128, 8, 1}} : std::vector<AttnTile>{{128, 128, 8, 1}, {64, 128, 8, 1}};
      q = {{128, 64, 8, 1}};
      break;
    case 96: kv = {{64, 128, 8, 1}}; q = {{128, 64, 8, 1}}; break;
    case 128: kv = {{64, 128, 8, 1}, {64, 64, 4, 1}}; q = {{128, 64, 8, 1}, {64, 64, 4, 1}}; break;
    case 256: kv = {{32, 64, 8, 1}}; q = {{64, 32, 4, 1}}; break;
    default:
      throw std::invalid_argument("attention backward head dim must be 64, 96, 128 or 256, not " +
                                  std::to_string(head_dim));
  }
  AttnBwdTiles t;
  bool have_kv = false, have_q = false;
  for (const AttnTile& x : kv)
    if (!have_kv && attn_bwd_dkdv_smem_bytes(head_dim, x, masked) <= limit) t.dkdv = x, have_kv = true;
  for (const AttnTile& x : q)
    if (!have_q && attn_bwd_dq_smem_bytes(head_dim, x) <= limit) t.dq = x, have_q = true;
  if (!have_kv || !have_q)
    throw std::invalid_argument("no attention backward tile for head dim " + std::to_string(head_dim) + " fits " +
                                std::to_string(limit) + " bytes of shared memory");
  return t;
}

std::vector<std::string> attn_bwd_name_expressions(AttnElem e, int d, bool causal, const AttnBwdTiles& t,
                                                   AttnMaskKind mask) {
  const std::string m = attn_mask_template_arg(mask);
  const std::string el = std::string("opfuse_attn::") + attn_elem_name(e), D = std::to_string(d);
  const AttnTile& kv = t.dkdv;
  const std::string kvargs = el + ", " + D + ", " + b(causal) + ", " + std::to_string(kv.block_m) + ", " +
                             std::to_string(kv.block_n) + ", " + std::to_string(kv.num_warps) + ", " +
                             std::to_string(kv.min_blocks);
  const AttnTile& q = t.dq;
  return {
      "opfuse_attn::attention_bwd_preprocess<" + el + ", " + D + ">",
      "opfuse_attn::attention_bwd_dkdv<" + kvargs + ", true" + m + ">",
      "opfuse_attn::attention_bwd_dkdv<" + kvargs + ", false" + m + ">",
      "opfuse_attn::attention_bwd_dq_convert<" + el + ", " + D + ">",
      "opfuse_attn::attention_bwd_dq<" + el + ", " + D + ", " + b(causal) + ", " + std::to_string(q.block_m) + ", " +
          std::to_string(q.block_n) + ", " + std::to_string(q.num_warps) + ", " + std::to_string(q.min_blocks) + m + ">",
  };
}

AttnBwdCompiled attn_bwd_compile(AttnElem e, int head_dim, bool causal, const AttnBwdTiles& t, int arch,
                                 bool use_cache, AttnMaskKind mask) {
  if (!attn_head_dim_supported(head_dim))
    throw std::invalid_argument("attention backward head dim must be 64, 96, 128 or 256, not " +
                                std::to_string(head_dim));
  const std::vector<std::string> exprs = attn_bwd_name_expressions(e, head_dim, causal, t, mask);
  return attn_bwd_compile_program(source(), "attention_bwd.cu", exprs, "sm_" + std::to_string(arch),
                                  "the attention backward (" + exprs.at(1) + ")", kMagic, ".bwd.cubin", use_cache);
}

int64_t attn_bwd_accum_cols(int64_t head_dim) { return head_dim == 96 ? 128 : head_dim; }

int64_t attn_bwd_padded_rows(int64_t sq) { return (sq + kAttnBwdRowPad - 1) / kAttnBwdRowPad * kAttnBwdRowPad; }

std::string attn_bwd_unsupported_reason(const AttnBackwardArgs& a) {
  if (!attn_head_dim_supported(a.head_dim)) return "head dim " + std::to_string(a.head_dim) + " is not 64, 96, 128 or 256";
  if (a.batch < 0 || a.heads_q < 0 || a.heads_kv < 0 || a.seqlen_q < 0 || a.seqlen_k < 0) return "negative size";
  if (a.heads_kv == 0 ? a.heads_q != 0 : a.heads_q % a.heads_kv != 0) return "heads_q is not a multiple of heads_kv";
  if (a.batch > 65535 || a.heads_q > 65535) return "batch and heads must each be <= 65535";
  if (a.seqlen_q > INT32_MAX - kAttnBwdRowPad || a.seqlen_k > INT32_MAX) return "sequence lengths must fit in 32 bits";
  if (std::isnan(a.softmax_scale) || a.softmax_scale < 0) return "softmax scale must be > 0";
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  struct T {
    const char* name;
    const void* p;
    const int64_t* st;
  } ts[] = {{"q", a.q, a.q_strides},   {"k", a.k, a.k_strides},    {"v", a.v, a.v_strides},
            {"o", a.o, a.o_strides},   {"dout", a.dout, a.do_strides}, {"dq", a.dq, a.dq_strides},
            {"dk", a.dk, a.dk_strides}, {"dv", a.dv, a.dv_strides}};
  for (const T& t : ts) {
    if (!aligned(t.p)) return std::string(t.name) + ": data pointer not 16-byte aligned";
    for (int d = 0; d < 3; ++d)
      if (t.st[d] % 8 != 0) return std::string(t.name) + ": strides must be multiples of 8 elements";
  }
  for (const void* w : {static_cast<const void*>(a.delta), static_cast<const void*>(a.lse_log2),
                        static_cast<const void*>(a.dq_accum)})
    if (!aligned(w)) return "workspace not 16-byte aligned";
  return attn_mask_unsupported_reason(a.mask, a.mask_ptr, a.mask_strides, a.seqlen_k);
}

void attn_backward_cuda(const AttnBackwardArgs& a, CUstream stream) {
  if (std::string why = attn_bwd_unsupported_reason(a); !why.empty())
    throw std::invalid_argument("attention backward kernel: " + why);
  if (a.batch == 0 || a.heads_q == 0) return;
  const bool any_q = a.seqlen_q > 0, any_k = a.seqlen_k > 0;
  if ((any_q && (!a.q || !a.o || !a.dout || !a.dq || !a.lse || !a.delta || !a.lse_log2)) ||
      (any_k && (!a.k || !a.v || !a.dk || !a.dv)) || (any_q && !a.deterministic && !a.dq_accum))
    throw std::invalid_argument("attention backward kernel: null pointer");
  const CudaApi& c = cuda();
  CUdevice dev = 0;
  CUcontext ctx = launcher_context(a.device, &dev);

  struct Loaded {
    CUmodule module = nullptr;
    CUfunction fn[kRoles] = {};
  };
  static std::map<CUcontext, AttnDevice> devices;
  static std::map<std::tuple<CUcontext, std::string>, Loaded> loaded;

  const int D = static_cast<int>(a.head_dim);
  std::lock_guard<std::mutex> lock(mu());
  AttnDevice& info = devices[ctx];
  if (info.arch == 0) info = attn_device(dev);
  if (info.arch < 80) throw std::invalid_argument("attention backward kernel needs sm_80 or newer");
  AttnBwdParams p = make_params(a);
  // sm_90, D = 64 / 128, atomic dQ, no mask: the Hopper kernel (unless OPFUSE_ATTN_BWD_SM90=0).
  if (attn_bwd_sm90_unsupported_reason(a, info.arch).empty()) return attn_backward_sm90_launch(a, p, ctx, stream);
  const AttnBwdTiles tiles = attn_bwd_choose_tiles(D, info.arch, info.smem_optin, a.mask != AttnMaskKind::None);
  const int smem_kv = attn_bwd_dkdv_smem_bytes(D, tiles.dkdv, a.mask != AttnMaskKind::None), smem_q = attn_bwd_dq_smem_bytes(D, tiles.dq);
  const std::vector<std::string> exprs = attn_bwd_name_expressions(a.elem, D, a.causal, tiles, a.mask);
  Loaded& lf = loaded[{ctx, exprs[kDkdv]}];
  if (!lf.module) {
    AttnBwdCompiled comp = attn_bwd_compile(a.elem, D, a.causal, tiles, info.arch, true, a.mask);
    if (c.ModuleLoadData(&lf.module, comp.cubin.data()) != 0) {
      comp = attn_bwd_compile(a.elem, D, a.causal, tiles, info.arch, /*use_cache=*/false, a.mask);
      check_cuda(c.ModuleLoadData(&lf.module, comp.cubin.data()), "cuModuleLoadData(attention backward)");
    }
    for (int r = 0; r < kRoles; ++r)
      check_cuda(c.ModuleGetFunction(&lf.fn[r], lf.module, comp.lowered[static_cast<size_t>(r)].c_str()),
                 "cuModuleGetFunction(attention backward)");
    for (int r : {kDkdvAtomic, kDkdv})
      if (smem_kv > 48 * 1024) check_cuda(c.FuncSetAttribute(lf.fn[r], kAttrMaxDynamicSharedBytes, smem_kv), "cuFuncSetAttribute");
    if (smem_q > 48 * 1024) check_cuda(c.FuncSetAttribute(lf.fn[kDq], kAttrMaxDynamicSharedBytes, smem_q), "cuFuncSetAttribute");
  }

  void* params[] = {&p};
  const unsigned B = static_cast<unsigned>(a.batch), Hq = static_cast<unsigned>(a.heads_q);
  auto launch = [&](Role r, unsigned gx, unsigned gy, unsigned threads, unsigned smem) {
    check_cuda(c.LaunchKernel(lf.fn[r], gx, gy, B, threads, 1, 1, smem, stream, params, nullptr),
               "cuLaunchKernel(attention backward)");
  };
  if (p.seqlen_q_pad > 0) launch(kPreprocess, static_cast<unsigned>(p.seqlen_q_pad / 64), Hq, 256, 0);
  const int64_t n_kblocks = (a.seqlen_k + tiles.dkdv.block_n - 1) / tiles.dkdv.block_n;
  if (n_kblocks > 0)
    launch(a.deterministic ? kDkdv : kDkdvAtomic, static_cast<unsigned>(n_kblocks), static_cast<unsigned>(a.heads_kv),
           static_cast<unsigned>(tiles.dkdv.num_warps * 32), static_cast<unsigned>(smem_kv));
  if (any_q) {
    if (a.deterministic)
      launch(kDq, static_cast<unsigned>((a.seqlen_q + tiles.dq.block_m - 1) / tiles.dq.block_m), Hq,
             static_cast<unsigned>(tiles.dq.num_warps * 32), static_cast<unsigned>(smem_q));
    else
      launch(kConvert, static_cast<unsigned>((a.seqlen_q + 63) / 64), Hq, 256, 0);
  }
}

}  // namespace opfuse::attention
