#include "runtime/attention_launcher.h"
#include "runtime/attention_launcher_sm90.h"

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <numbers>
#include <regex>
#include <stdexcept>
#include <tuple>

#include "runtime/compile_cache.h"
#include "runtime/hash.h"
#include "runtime/nvrtc_named.h"

#include "attention_fwd_cu.inc"  // static const char attention_fwd_cu[]
#include "attention_ptx_cu.inc"  // static const char attention_ptx_cu[]

namespace opfuse::attention {
namespace {

constexpr int kAttrMaxDynamicSharedBytes = 8;     // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
constexpr int kDevAttrMaxSmemPerBlockOptin = 97;  // CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN

// The shared PTX helpers, then the kernel.
const std::string& source() {
  static const std::string s = std::string(attention_ptx_cu) + "\n" + attention_fwd_cu;
  return s;
}

// Cache entry layout: "opfuse-attn-cubin\n<lowered name>\n" followed by the cubin.
constexpr const char kMagic[] = "opfuse-attn-cubin\n";

// One NVRTC program for one name expression: (lowered name, cubin, log).
AttnCompiled compile_uncached(const std::string& source, const char* file, const std::string& expr,
                              const std::string& gpu_arch) {
  NvrtcNamed r = nvrtc_compile_named(source.c_str(), file, {expr}, gpu_arch, expr);
  AttnCompiled out;
  out.expression = expr;
  out.lowered = r.lowered.at(0);
  out.cubin = std::move(r.cubin);
  out.log = std::move(r.log);
  return out;
}

struct LoadedFn {
  CUmodule module = nullptr;
  CUfunction fn = nullptr;
};

std::mutex& mu() {
  static std::mutex m;
  return m;
}

}  // namespace

const char* attn_elem_name(AttnElem e) { return e == AttnElem::BF16 ? "bf16" : "f16"; }

AttnElem parse_attn_elem(const std::string& name) {
  if (name == "bf16") return AttnElem::BF16;
  if (name == "f16") return AttnElem::F16;
  throw std::invalid_argument("attention kernel element type must be bf16 or f16, not " + name);
}

std::string AttnTile::tag() const {
  return std::to_string(block_m) + "x" + std::to_string(block_n) + "w" + std::to_string(num_warps) + "b" +
         std::to_string(min_blocks) + (split_pv ? "s" : "");
}

AttnTile AttnTile::parse(const std::string& tag) {
  static const std::regex re(R"((\d+)x(\d+)w(\d+)b(\d+)(s?))");
  std::smatch m;
  if (!std::regex_match(tag, m, re))
    throw std::invalid_argument("bad attention tile tag '" + tag + "' (want e.g. 128x64w4b2)");
  AttnTile t;
  t.block_m = std::stoi(m[1]);
  t.block_n = std::stoi(m[2]);
  t.num_warps = std::stoi(m[3]);
  t.min_blocks = std::stoi(m[4]);
  t.split_pv = m[5].length() > 0;
  return t;
}

bool attn_head_dim_supported(int64_t d) {
  for (int x : kAttnHeadDims)
    if (x == d) return true;
  return false;
}

int attn_smem_bytes(int head_dim, const AttnTile& t, AttnMaskKind mask) {
  const int stride_bytes = (head_dim + 8) * 2;
  const int keypad = mask == AttnMaskKind::KeyPad ? 2 * t.block_n * 4 : 0;
  return t.block_m * stride_bytes + 2 * 2 * t.block_n * stride_bytes + keypad;
}

const char* attn_mask_name(AttnMaskKind m) {
  switch (m) {
    case AttnMaskKind::None: return "none";
    case AttnMaskKind::FullBool: return "full-bool";
    case AttnMaskKind::FullBf16: return "full-bf16";
    case AttnMaskKind::FullF16: return "full-f16";
    case AttnMaskKind::FullF32: return "full-f32";
    case AttnMaskKind::KeyPad: return "keypad";
  }
  return "?";
}

AttnMaskKind parse_attn_mask(const std::string& name) {
  if (name.empty() || name == "none") return AttnMaskKind::None;
  for (AttnMaskKind m : {AttnMaskKind::FullBool, AttnMaskKind::FullBf16, AttnMaskKind::FullF16, AttnMaskKind::FullF32,
                         AttnMaskKind::KeyPad})
    if (name == attn_mask_name(m)) return m;
  throw std::invalid_argument("attention mask kind must be none, full-bool, full-bf16, full-f16, full-f32 or keypad, not " +
                              name);
}

int attn_mask_elem_bytes(AttnMaskKind m) {
  switch (m) {
    case AttnMaskKind::None: return 0;
    case AttnMaskKind::FullBool: return 1;
    case AttnMaskKind::FullBf16: case AttnMaskKind::FullF16: return 2;
    default: return 4;
  }
}

std::string attn_mask_template_arg(AttnMaskKind m) {
  switch (m) {
    case AttnMaskKind::None: return "";
    case AttnMaskKind::FullBool: return ", opfuse_attn::MaskFull<opfuse_attn::bool8>";
    case AttnMaskKind::FullBf16: return ", opfuse_attn::MaskFull<opfuse_attn::bf16>";
    case AttnMaskKind::FullF16: return ", opfuse_attn::MaskFull<opfuse_attn::f16>";
    case AttnMaskKind::FullF32: return ", opfuse_attn::MaskFull<float>";
    case AttnMaskKind::KeyPad: return ", opfuse_attn::MaskKeyPad";
  }
  return "";
}

std::string attn_mask_unsupported_reason(AttnMaskKind kind, const void* ptr, const int64_t (&st)[4], int64_t seqlen_k) {
  if (kind == AttnMaskKind::None) return {};
  if (!ptr) return "attn_mask: null pointer";
  if (reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(attn_mask_elem_bytes(kind)) != 0)
    return "attn_mask: data pointer not aligned to its element size";
  if (seqlen_k > 1 && st[3] != 1) return "attn_mask: the key dim must be contiguous (stride 1)";
  for (int d = 0; d < 3; ++d)
    if (st[d] < 0) return "attn_mask: negative stride";
  if (kind == AttnMaskKind::KeyPad && (st[1] != 0 || st[2] != 0))
    return "attn_mask: key padding needs head and row strides 0";
  return {};
}

int attn_max_smem_for_arch(int arch) {
  switch (arch) {
    case 80: case 87: return 166912;
    case 86: case 89: return 101376;
    case 90: return 232448;
    default: return 101376;
  }
}

AttnDevice attn_device(CUdevice dev) {
  AttnDevice info;
  info.arch = current_device_arch();
  if (cuda().DeviceGetAttribute(&info.smem_optin, kDevAttrMaxSmemPerBlockOptin, dev) != 0 || info.smem_optin <= 0)
    info.smem_optin = attn_max_smem_for_arch(info.arch);
  return info;
}

namespace {

// docs/attention.md, "Tile choice": the first tile of the list that fits.
std::vector<AttnTile> default_tiles(int head_dim) {
  switch (head_dim) {
    case 64: return {{128, 128, 4, 2}};
    case 96: return {{128, 64, 4, 2}};
    case 128: return {{128, 64, 4, 2}, {128, 32, 4, 2}};
    case 256: return {{128, 64, 8, 1}, {128, 32, 8, 1}, {64, 32, 4, 1}};
    default: throw std::invalid_argument("attention kernel head dim must be 64, 96, 128 or 256, not " + std::to_string(head_dim));
  }
}

// With an attn_mask, D = 64 takes 128x64 tiles (on 128x128 the mask step
// spilled 128-244 bytes, on 128x64 0-68; mirrors attn_runtime.MASKED_CONFIGS).
AttnTile default_tile(int head_dim, int limit, bool masked = false) {
  if (masked && head_dim == 64) return {128, 64, 4, 2};
  for (const AttnTile& t : default_tiles(head_dim))
    if (attn_smem_bytes(head_dim, t) <= limit) return t;
  throw std::invalid_argument("no attention tile for head dim " + std::to_string(head_dim) + " fits " +
                              std::to_string(limit) + " bytes of shared memory");
}

// 256-row tiles for long non-causal D = 128 (4-6% faster at Sk >= 8192 on the H200).
const AttnTile kLongTile128{256, 64, 8, 1};
constexpr int64_t kLongTileMinSk = 8192;

}  // namespace

AttnTile attn_choose_tile(int head_dim, int64_t seqlen_q, int64_t seqlen_k, bool causal, int arch, int smem_limit) {
  // (Masked calls take default_tile: the masked instantiations shipped.)
  const int limit = smem_limit > 0 ? smem_limit : attn_max_smem_for_arch(arch);
  if (head_dim == 128 && !causal && seqlen_q >= 256 && seqlen_k >= kLongTileMinSk &&
      attn_smem_bytes(head_dim, kLongTile128) <= limit)
    return kLongTile128;
  return default_tile(head_dim, limit);
}

std::vector<AttnTile> attn_candidate_tiles(int head_dim, int arch, int smem_limit) {
  const int limit = smem_limit > 0 ? smem_limit : attn_max_smem_for_arch(arch);
  std::vector<AttnTile> r{default_tile(head_dim, limit)};
  if (head_dim == 128 && attn_smem_bytes(head_dim, kLongTile128) <= limit) r.push_back(kLongTile128);
  return r;
}

std::string attn_name_expression(AttnElem e, int head_dim, bool causal, const AttnTile& t, AttnMaskKind mask) {
  return std::string("opfuse_attn::attention_fwd<opfuse_attn::") + attn_elem_name(e) + ", " + std::to_string(head_dim) +
         ", " + (causal ? "true" : "false") + ", " + std::to_string(t.block_m) + ", " + std::to_string(t.block_n) + ", " +
         std::to_string(t.num_warps) + ", " + std::to_string(t.min_blocks) + ", " + (t.split_pv ? "true" : "false") +
         attn_mask_template_arg(mask) + ">";
}

AttnCompiled attn_compile(AttnElem e, int head_dim, bool causal, const AttnTile& t, int arch, bool use_cache,
                          AttnMaskKind mask) {
  if (!attn_head_dim_supported(head_dim))
    throw std::invalid_argument("attention kernel head dim must be 64, 96, 128 or 256, not " + std::to_string(head_dim));
  return attn_compile_named(source(), "attention_fwd.cu", attn_name_expression(e, head_dim, causal, t, mask),
                            "sm_" + std::to_string(arch), kMagic, use_cache);
}

AttnCompiled attn_compile_named(const std::string& source, const char* file, const std::string& expr,
                                const std::string& gpu_arch, const char* magic, bool use_cache) {
  if (!use_cache) return compile_uncached(source, file, expr, gpu_arch);
  const NvrtcApi& n = nvrtc();
  if (!n.loaded) throw std::runtime_error("NVRTC not available: " + n.error);
  std::string opts;
  for (auto& o : nvrtc_named_options(gpu_arch)) opts += o + " ";
  const std::string key = content_hash(source + "\n" + expr + "\n" + opts + "\nnvrtc " +
                                       std::to_string(n.major) + "." + std::to_string(n.minor));
  AttnCompiled fresh;
  bool built = false;
  auto build = [&](const std::string& out) {
    fresh = compile_uncached(source, file, expr, gpu_arch);
    built = true;
    write_file_atomic(out, pack_named_cubin(magic, {fresh.lowered}, fresh.cubin));
  };
  CacheLookup found = cache_get_or_build("attention", key, ".cubin", build);
  if (built) {
    fresh.cache_hit = false;
    return fresh;
  }
  bool ok = false;
  AttnCompiled c;
  c.expression = expr;
  std::vector<std::string> lowered;
  if (std::string bytes = read_file(found.path, &ok); ok && unpack_named_cubin(bytes, magic, 1, &lowered, &c.cubin)) {
    c.lowered = lowered[0];
    c.cache_hit = true;
    return c;
  }
  // An entry of another layout or a damaged one: rebuild.
  cache_evict(found.path);
  found = cache_get_or_build("attention", key, ".cubin", build);
  fresh.cache_hit = false;
  return fresh;
}

CUfunction attn_load_function(const std::function<AttnCompiled(bool use_cache)>& compile, CUmodule* module,
                              const std::string& what) {
  const CudaApi& c = cuda();
  AttnCompiled comp = compile(true);
  if (c.ModuleLoadData(module, comp.cubin.data()) != 0) {
    // A cubin the driver refuses (e.g. a stale cache entry): compile afresh once.
    comp = compile(false);
    check_cuda(c.ModuleLoadData(module, comp.cubin.data()), ("cuModuleLoadData(" + what + ")").c_str());
  }
  CUfunction fn = nullptr;
  check_cuda(c.ModuleGetFunction(&fn, *module, comp.lowered.c_str()), ("cuModuleGetFunction(" + what + ")").c_str());
  return fn;
}

std::string attn_unsupported_reason(const AttnForwardArgs& a) {
  if (!attn_head_dim_supported(a.head_dim)) return "head dim " + std::to_string(a.head_dim) + " is not 64, 96, 128 or 256";
  if (a.batch < 0 || a.heads_q < 0 || a.heads_kv < 0 || a.seqlen_q < 0 || a.seqlen_k < 0) return "negative size";
  if (a.heads_kv == 0 ? a.heads_q != 0 : a.heads_q % a.heads_kv != 0) return "heads_q is not a multiple of heads_kv";
  if (a.batch > 65535 || a.heads_q > 65535) return "batch and heads must each be <= 65535";
  if (a.seqlen_q > INT32_MAX || a.seqlen_k > INT32_MAX) return "sequence lengths must fit in 32 bits";
  // The kernel takes row maxima of the raw scores, so the scale must be positive (0: the default).
  if (std::isnan(a.softmax_scale) || a.softmax_scale < 0) return "softmax scale must be > 0";
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  struct T {
    const char* name;
    const void* p;
    const int64_t* st;
  } ts[] = {{"q", a.q, a.q_strides}, {"k", a.k, a.k_strides}, {"v", a.v, a.v_strides}, {"o", a.o, a.o_strides}};
  for (const T& t : ts) {
    if (!aligned(t.p)) return std::string(t.name) + ": data pointer not 16-byte aligned";
    for (int d = 0; d < 3; ++d)
      if (t.st[d] % 8 != 0) return std::string(t.name) + ": strides must be multiples of 8 elements";
  }
  if (std::string why = attn_mask_unsupported_reason(a.mask, a.mask_ptr, a.mask_strides, a.seqlen_k); !why.empty())
    return why;
  if (!a.tile.empty()) {  // throws on a bad tag
    if (AttnSm90Tile::is_tag(a.tile)) AttnSm90Tile::parse(a.tile);
    else AttnTile::parse(a.tile);
  }
  return {};
}

AttnFwdParams attn_make_params(const AttnForwardArgs& a) {
  AttnFwdParams p{};
  p.q = a.q;
  p.k = a.k;
  p.v = a.v;
  p.o = a.o;
  p.lse = a.lse;
  p.q_batch_stride = a.q_strides[0], p.q_head_stride = a.q_strides[1], p.q_row_stride = a.q_strides[2];
  p.k_batch_stride = a.k_strides[0], p.k_head_stride = a.k_strides[1], p.k_row_stride = a.k_strides[2];
  p.v_batch_stride = a.v_strides[0], p.v_head_stride = a.v_strides[1], p.v_row_stride = a.v_strides[2];
  p.o_batch_stride = a.o_strides[0], p.o_head_stride = a.o_strides[1], p.o_row_stride = a.o_strides[2];
  p.lse_batch_stride = a.lse_strides[0], p.lse_head_stride = a.lse_strides[1];
  p.batch = static_cast<int32_t>(a.batch);
  p.heads_q = static_cast<int32_t>(a.heads_q);
  p.heads_kv = static_cast<int32_t>(a.heads_kv);
  p.q_per_kv = static_cast<int32_t>(a.heads_q / a.heads_kv);
  p.seqlen_q = static_cast<int32_t>(a.seqlen_q);
  p.seqlen_k = static_cast<int32_t>(a.seqlen_k);
  const double scale = a.softmax_scale > 0 ? a.softmax_scale : 1.0 / std::sqrt(static_cast<double>(a.head_dim));
  p.softmax_scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * std::numbers::log2e);
  if (a.mask != AttnMaskKind::None) {
    p.mask = a.mask_ptr;
    p.mask_batch_stride = a.mask_strides[0], p.mask_head_stride = a.mask_strides[1];
    p.mask_row_stride = a.mask_strides[2], p.mask_col_stride = a.mask_strides[3];
  }
  return p;
}

namespace {

// A context's device facts, read once per context (the caller holds mu()).
const AttnDevice& context_device(CUcontext ctx, CUdevice dev) {
  static std::map<CUcontext, AttnDevice> devices;
  AttnDevice& info = devices[ctx];
  if (info.arch == 0) info = attn_device(dev);
  return info;
}

}  // namespace

AttnWorkspace attn_forward_workspace(const AttnForwardArgs& a) {
  if (std::string why = attn_unsupported_reason(a); !why.empty()) throw std::invalid_argument("attention kernel: " + why);
  if (a.batch == 0 || a.heads_q == 0 || a.seqlen_q == 0) return {};
  CUdevice dev = 0;
  CUcontext ctx = launcher_context(a.device, &dev);
  int arch = 0;
  {
    std::lock_guard<std::mutex> lock(mu());
    arch = context_device(ctx, dev).arch;
  }
  if (!(AttnSm90Tile::is_tag(a.tile) || (a.tile.empty() && arch == 90))) return {};
  if (!attn_sm90_unsupported_reason(a, arch).empty()) return {};
  return attn_sm90_workspace(a, ctx);
}

void attn_forward_cuda(const AttnForwardArgs& a, CUstream stream) {
  if (std::string why = attn_unsupported_reason(a); !why.empty()) throw std::invalid_argument("attention kernel: " + why);
  if (a.batch == 0 || a.heads_q == 0 || a.seqlen_q == 0) return;
  if (!a.q || !a.o || (a.seqlen_k > 0 && (!a.k || !a.v))) throw std::invalid_argument("attention kernel: null pointer");
  const CudaApi& c = cuda();
  CUdevice dev = 0;
  CUcontext ctx = launcher_context(a.device, &dev);

  static std::map<std::tuple<CUcontext, std::string>, LoadedFn> functions;

  std::lock_guard<std::mutex> lock(mu());
  const AttnDevice& info = context_device(ctx, dev);
  if (info.arch < 80) throw std::invalid_argument("attention kernel needs sm_80 or newer");
  // sm_90: the Hopper kernel (attention_launcher_sm90.h) for the head dims it
  // covers, unless an mma.sync tile is asked for or OPFUSE_ATTN_SM90=0.
  if (AttnSm90Tile::is_tag(a.tile) || (a.tile.empty() && info.arch == 90)) {
    const std::string why = attn_sm90_unsupported_reason(a, info.arch);
    if (why.empty()) return attn_forward_sm90_launch(a, attn_make_params(a), ctx, stream);
    if (!a.tile.empty()) throw std::invalid_argument("attention tile " + a.tile + ": " + why);
  }
  const int D = static_cast<int>(a.head_dim);
  // Masked calls take the default tile (the masked instantiations shipped).
  const AttnTile tile = !a.tile.empty()                 ? AttnTile::parse(a.tile)
                        : a.mask != AttnMaskKind::None ? default_tile(D, info.smem_optin, true)
                                                       : attn_choose_tile(D, a.seqlen_q, a.seqlen_k, a.causal, info.arch,
                                                                          info.smem_optin);
  const int smem = attn_smem_bytes(D, tile, a.mask);
  if (smem > info.smem_optin) throw std::invalid_argument("attention tile " + tile.tag() + " needs more shared memory than the device has");
  const std::string expr = attn_name_expression(a.elem, D, a.causal, tile, a.mask);
  LoadedFn& lf = functions[{ctx, expr}];
  if (!lf.fn) {
    lf.fn = attn_load_function(
        [&](bool use_cache) { return attn_compile(a.elem, D, a.causal, tile, info.arch, use_cache, a.mask); },
        &lf.module, "attention");
    if (smem > 48 * 1024)
      check_cuda(c.FuncSetAttribute(lf.fn, kAttrMaxDynamicSharedBytes, smem), "cuFuncSetAttribute(max dynamic smem)");
  }

  AttnFwdParams p = attn_make_params(a);
  const unsigned grid_x = static_cast<unsigned>((a.seqlen_q + tile.block_m - 1) / tile.block_m);
  void* params[] = {&p};
  check_cuda(c.LaunchKernel(lf.fn, grid_x, static_cast<unsigned>(a.heads_q), static_cast<unsigned>(a.batch),
                            static_cast<unsigned>(tile.num_warps * 32), 1, 1, static_cast<unsigned>(smem), stream, params,
                            nullptr),
             "cuLaunchKernel(attention)");
}

}  // namespace opfuse::attention
