#include "runtime/attention_bwd_launcher_sm90.h"

#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>

#include "runtime/attention_launcher_sm90.h"  // attn_sm90_tensor_map
#include "runtime/nvrtc_named.h"

#include "attention_bwd_cu.inc"       // static const char attention_bwd_cu[]
#include "attention_bwd_sm90_cu.inc"  // static const char attention_bwd_sm90_cu[]
#include "attention_ptx_cu.inc"       // static const char attention_ptx_cu[]
#include "attention_sm90_ptx_cu.inc"  // static const char attention_sm90_ptx_cu[]

namespace opfuse::attention {
namespace {

constexpr int kAttrMaxDynamicSharedBytes = 8;  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
constexpr int kBlockN = 128, kThreads = 384;   // keys per CTA; producer + two consumer warpgroups
enum Role { kPreprocess, kMain, kConvert, kRoles };

// The shared helpers, the mma.sync backward (AttnBwdParams, preprocess,
// convert), then the Hopper kernel.
const std::string& source() {
  static const std::string s = std::string(attention_ptx_cu) + "\n" + attention_sm90_ptx_cu + "\n" + attention_bwd_cu +
                               "\n" + attention_bwd_sm90_cu;
  return s;
}

// Cache entries: "opfuse-attn-bwd90-cubin\n", kRoles lowered names (one a line), then the cubin.
constexpr const char kMagic[] = "opfuse-attn-bwd90-cubin\n";

}  // namespace

std::string AttnBwdSm90Tile::tag() const {
  static const char* const kSuffix[] = {"", "q", "w"};
  static const char kOptLetters[] = "kdtvoub";  // OPTS bits 1, 2, 4, 8, 16, 32, 64
  std::string letters;
  for (int b = 0; b < 7; ++b)
    if (opts & (1 << b)) letters += kOptLetters[b];
  return "wgb" + std::to_string(block_m) + "s" + std::to_string(stages) + kSuffix[dq_mode] +
         (letters.empty() ? "" : "_" + letters);
}

bool attn_bwd_sm90_enabled() {
  const char* v = std::getenv("OPFUSE_ATTN_BWD_SM90");
  return !(v && std::string(v) == "0");
}

namespace {
// The head dim of the kernels that run a call's: D = 96 runs the D = 128
// kernels (dq_accum rows of 128 floats: attn_bwd_accum_cols) with
// AttnBwdParams::d_cols = 96; their tensor maps zero-fill q, k, v and dO past
// column 96.
int kernel_head_dim(int d) { return static_cast<int>(attn_bwd_accum_cols(d)); }

// Mirrors attn_bwd_runtime_sm90.BY_DQ_MODE: the tile of each dQ mode (modes 1
// and 2 stage dQ in shared memory, which leaves room for 2 stages at D = 64).
AttnBwdSm90Tile tile_of_dq_mode(int head_dim, int mode) {
  head_dim = kernel_head_dim(head_dim);  // 96: the 128 kernel's tile
  if (head_dim != 64 && head_dim != 128)
    throw std::invalid_argument("the sm90 attention backward covers head dims 64, 96 and 128, not " + std::to_string(head_dim));
  // Modes 1 and 2 at D = 64 (BLOCK_M = 128) spill in the consumers: not offered.
  if (mode != 0 && head_dim == 64) throw std::invalid_argument("dQ modes 1 and 2 cover head dim 128 only");
  const int block_m = head_dim == 64 ? 128 : 64;
  return {block_m, mode == 0 && head_dim == 64 ? 3 : 2, mode};
}
// attn_bwd_runtime_sm90.DEFAULT: D = 64 dQ mode 0 with cheap wgmma descriptors
// (wgb128s3_u, OPTS 32), D = 128 mode 2, the dQ writers, with cheap descriptors
// and conflict-free dQ staging (wgb64s2w_ub, OPTS 32 + 64: 491 / 434 vs 473 / 422
// TFLOP/s for wgb64s2w at S = 4096, full / causal, on the H200 at fad5c51;
// docs/attention.md, "Hopper backward").
AttnBwdSm90Tile default_tile(int head_dim) {
  head_dim = kernel_head_dim(head_dim);
  AttnBwdSm90Tile t = tile_of_dq_mode(head_dim, head_dim == 128 ? 2 : 0);
  t.opts = head_dim == 128 ? 32 + 64 : 32;
  return t;
}
}  // namespace

AttnBwdSm90Tile attn_bwd_sm90_default_tile(int head_dim) {
  const char* v = std::getenv("OPFUSE_ATTN_BWD_SM90_DQ");
  if (v && *v) {
    const std::string m(v);
    if (m != "0" && m != "1" && m != "2")
      throw std::invalid_argument("OPFUSE_ATTN_BWD_SM90_DQ=" + m + ": want 0, 1 or 2");
    return tile_of_dq_mode(head_dim, m[0] - '0');
  }
  return default_tile(head_dim);
}

std::vector<AttnBwdSm90Tile> attn_bwd_sm90_candidate_tiles(int head_dim) {
  head_dim = kernel_head_dim(head_dim);
  // The default, then the plain tile of each dQ mode (attn_bwd_runtime_sm90.configs
  // also carries the option variants being measured).
  if (head_dim == 64) return {default_tile(64), tile_of_dq_mode(64, 0), {128, 2, 0}};
  return {default_tile(head_dim), tile_of_dq_mode(head_dim, 0), tile_of_dq_mode(head_dim, 1),
          tile_of_dq_mode(head_dim, 2)};
}

int attn_bwd_sm90_smem_bytes(int d, const AttnBwdSm90Tile& t) {
  d = kernel_head_dim(d);
  // BwdSm90Tile::kSmemBytes: dQ staging (mode 1: 8 warps x 16 rows of a
  // consumer's columns, rows padded by 32 bytes; mode 2: the block's BLOCK_M x D
  // in pairs of rows padded by 32 bytes), in mode 2 two more mbarriers, and
  // with the deferred dQ (opts & 2) 4 dS^T buffers (mode 0) or 3 (mode 2).
  const int kv = kBlockN * d * 2, q = t.block_m * d * 2, stat = t.block_m * 4, ds = kBlockN * t.block_m * 2;
  const int dq_n = t.block_m == 128 ? d : d / 2;  // a consumer's dQ columns
  const int dq_stage =
      t.dq_mode == 1 ? 8 * 16 * (dq_n * 4 + 32) : t.dq_mode == 2 ? t.block_m / 2 * (2 * d * 4 + 32) : 0;
  const int bars = 1 + 2 * t.stages + (t.dq_mode == 2 ? 2 : 0);
  const int ds_bufs = !(t.opts & 2) ? 2 : t.dq_mode == 2 ? 3 : 4;
  return 2 * kv + 2 * t.stages * q + ds_bufs * ds + 2 * t.stages * stat + dq_stage + 8 * bars + 1024;
}

std::vector<std::string> attn_bwd_sm90_name_expressions(AttnElem e, int d, bool causal, const AttnBwdSm90Tile& t) {
  d = kernel_head_dim(d);  // D = 96 runs the 128 kernels (AttnBwdParams::d_cols)
  const std::string el = std::string("opfuse_attn::") + attn_elem_name(e), D = std::to_string(d);
  return {
      "opfuse_attn::attention_bwd_preprocess<" + el + ", " + D + ">",
      "opfuse_attn::attention_bwd_sm90<" + el + ", " + D + ", " + (causal ? "true" : "false") + ", " +
          std::to_string(t.block_m) + ", " + std::to_string(t.stages) + ", " + std::to_string(t.dq_mode) +
          (t.opts ? ", " + std::to_string(t.opts) : "") + ">",
      "opfuse_attn::attention_bwd_dq_convert<" + el + ", " + D + ">",
  };
}

AttnBwdCompiled attn_bwd_sm90_compile(AttnElem e, int head_dim, bool causal, const AttnBwdSm90Tile& t, bool use_cache) {
  if (head_dim != 64 && head_dim != 96 && head_dim != 128)
    throw std::invalid_argument("the sm90 attention backward covers head dims 64, 96 and 128, not " + std::to_string(head_dim));
  const std::vector<std::string> exprs = attn_bwd_sm90_name_expressions(e, head_dim, causal, t);
  return attn_bwd_compile_program(source(), "attention_bwd_sm90.cu", exprs, "sm_90a", exprs.at(kMain), kMagic,
                                  ".bwd90.cubin", use_cache);
}

std::string attn_bwd_sm90_unsupported_reason(const AttnBackwardArgs& a, int arch) {
  if (arch != 90) return "sm_" + std::to_string(arch) + " is not sm_90";
  if (!attn_bwd_sm90_enabled()) return "OPFUSE_ATTN_BWD_SM90=0";
  if (a.head_dim != 64 && a.head_dim != 96 && a.head_dim != 128)
    return "head dim " + std::to_string(a.head_dim) + " is not 64, 96 or 128";
  if (a.deterministic) return "deterministic mode (the Hopper kernel adds dQ with atomics)";
  if (a.mask != AttnMaskKind::None) return "an attn_mask (the Hopper backward applies causal masking only)";
  if (a.seqlen_q == 0 || a.seqlen_k == 0) return "empty sequence (a tensor map needs non-empty dims)";
  if (!cuda().TensorMapEncodeTiled) return "the CUDA driver has no cuTensorMapEncodeTiled";
  // TMA: strides below 2^40 bytes (multiples of 16 bytes is checked already).
  for (const int64_t* st : {a.q_strides, a.k_strides, a.v_strides, a.do_strides})
    for (int d = 0; d < 3; ++d)
      if (st[d] <= 0 || 2 * st[d] >= (int64_t{1} << 40)) return "a stride is not in (0, 2^39) elements";
  return {};
}

void attn_backward_sm90_launch(const AttnBackwardArgs& a, const AttnBwdParams& p, CUcontext ctx, CUstream stream) {
  const CudaApi& c = cuda();
  const int D = static_cast<int>(a.head_dim);
  const AttnBwdSm90Tile tile = attn_bwd_sm90_default_tile(D);
  const int smem = attn_bwd_sm90_smem_bytes(D, tile);
  struct Loaded {
    CUmodule module = nullptr;
    CUfunction fn[kRoles] = {};
  };
  static std::mutex mu;
  static std::map<std::tuple<CUcontext, std::string>, Loaded> loaded;
  const std::vector<std::string> exprs = attn_bwd_sm90_name_expressions(a.elem, D, a.causal, tile);
  Loaded lf;
  {
    std::lock_guard<std::mutex> lock(mu);
    Loaded& l = loaded[{ctx, exprs[kMain]}];
    if (!l.module) {
      AttnBwdCompiled comp = attn_bwd_sm90_compile(a.elem, D, a.causal, tile);
      if (c.ModuleLoadData(&l.module, comp.cubin.data()) != 0) {
        comp = attn_bwd_sm90_compile(a.elem, D, a.causal, tile, /*use_cache=*/false);
        check_cuda(c.ModuleLoadData(&l.module, comp.cubin.data()), "cuModuleLoadData(attention backward sm90)");
      }
      for (int r = 0; r < kRoles; ++r)
        check_cuda(c.ModuleGetFunction(&l.fn[r], l.module, comp.lowered[static_cast<size_t>(r)].c_str()),
                   "cuModuleGetFunction(attention backward sm90)");
      check_cuda(c.FuncSetAttribute(l.fn[kMain], kAttrMaxDynamicSharedBytes, smem), "cuFuncSetAttribute(max dynamic smem)");
    }
    lf = l;
  }
  AttnTensorMap tq = attn_sm90_tensor_map(a.elem, a.q, a.q_strides, a.batch, a.heads_q, a.seqlen_q, D, tile.block_m,
                                          "cuTensorMapEncodeTiled(q)");
  AttnTensorMap tk = attn_sm90_tensor_map(a.elem, a.k, a.k_strides, a.batch, a.heads_kv, a.seqlen_k, D, kBlockN,
                                          "cuTensorMapEncodeTiled(k)");
  AttnTensorMap tv = attn_sm90_tensor_map(a.elem, a.v, a.v_strides, a.batch, a.heads_kv, a.seqlen_k, D, kBlockN,
                                          "cuTensorMapEncodeTiled(v)");
  AttnTensorMap tdo = attn_sm90_tensor_map(a.elem, a.dout, a.do_strides, a.batch, a.heads_q, a.seqlen_q, D, tile.block_m,
                                           "cuTensorMapEncodeTiled(dout)");
  AttnBwdParams params = p;
  // The maps above hold the real head dim; the kernels' is kernel_head_dim's.
  if (kernel_head_dim(D) != D) params.d_cols = D;
  void* one[] = {&params};
  void* five[] = {&params, tq.bytes, tk.bytes, tv.bytes, tdo.bytes};
  const unsigned B = static_cast<unsigned>(a.batch), Hq = static_cast<unsigned>(a.heads_q);
  check_cuda(c.LaunchKernel(lf.fn[kPreprocess], static_cast<unsigned>(p.seqlen_q_pad / 64), Hq, B, 256, 1, 1, 0, stream,
                            one, nullptr),
             "cuLaunchKernel(attention backward preprocess)");
  check_cuda(c.LaunchKernel(lf.fn[kMain], static_cast<unsigned>((a.seqlen_k + kBlockN - 1) / kBlockN),
                            static_cast<unsigned>(a.heads_kv), B, kThreads, 1, 1, static_cast<unsigned>(smem), stream,
                            five, nullptr),
             "cuLaunchKernel(attention backward sm90)");
  check_cuda(c.LaunchKernel(lf.fn[kConvert], static_cast<unsigned>((a.seqlen_q + 63) / 64), Hq, B, 256, 1, 1, 0, stream,
                            one, nullptr),
             "cuLaunchKernel(attention backward dq convert)");
}

}  // namespace opfuse::attention
