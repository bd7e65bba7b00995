#include "runtime/attention_launcher_sm90.h"


#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <regex>
#include <stdexcept>
#include <tuple>

#include "attention_fwd_sm90_cu.inc"  // static const char attention_fwd_sm90_cu[]
#include "attention_fwd_sm90_schedule_cu.inc"  // static const char attention_fwd_sm90_schedule_cu[]
#include "attention_ptx_cu.inc"        // static const char attention_ptx_cu[]
#include "attention_sm90_ptx_cu.inc"   // static const char attention_sm90_ptx_cu[]

namespace opfuse::attention {
namespace {

constexpr int kAttrMaxDynamicSharedBytes = 8;  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
constexpr int kDevAttrMultiprocessorCount = 16;  // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
// cuda.h's CUtensorMap enums
constexpr int kTmaBf16 = 9, kTmaF16 = 6;
constexpr int kTmaInterleaveNone = 0, kTmaSwizzle128B = 3, kTmaL2Promo128B = 2, kTmaOobZero = 0;

// The shared PTX helpers (all kernels', then Hopper's), the schedules, then the kernel.
const std::string& source() {
  static const std::string s = std::string(attention_ptx_cu) + "\n" + attention_sm90_ptx_cu + "\n" +
                               attention_fwd_sm90_schedule_cu + "\n" + attention_fwd_sm90_cu;
  return s;
}

// Cache entry: "opfuse-attn-sm90-cubin\n<lowered name>\n" then the cubin.
constexpr const char kMagic[] = "opfuse-attn-sm90-cubin\n";

// A 4-D map over a [B, H, S, D] tensor with element strides (b, h, s, 1):
// dims (D, S, H, B), box (64, rows, 1, 1), 128-byte swizzle, zero fill
// outside the tensor (rows past S never reach another head's data).
struct TensorMap {
  alignas(64) unsigned char bytes[128];
};
TensorMap encode(AttnElem e, const void* ptr, const int64_t (&strides)[3], int64_t batch, int64_t heads, int64_t seqlen,
                 int head_dim, int box_rows, const char* what) {
  const CudaApi& c = cuda();
  if (!c.TensorMapEncodeTiled) throw std::runtime_error("the CUDA driver has no cuTensorMapEncodeTiled");
  TensorMap m{};
  const uint64_t dims[4] = {static_cast<uint64_t>(head_dim), static_cast<uint64_t>(seqlen), static_cast<uint64_t>(heads),
                            static_cast<uint64_t>(batch)};
  const uint64_t gstrides[3] = {2 * static_cast<uint64_t>(strides[2]), 2 * static_cast<uint64_t>(strides[1]),
                                2 * static_cast<uint64_t>(strides[0])};
  const uint32_t box[4] = {64, static_cast<uint32_t>(box_rows), 1, 1};
  const uint32_t estr[4] = {1, 1, 1, 1};
  check_cuda(c.TensorMapEncodeTiled(m.bytes, e == AttnElem::BF16 ? kTmaBf16 : kTmaF16, 4, const_cast<void*>(ptr), dims,
                                    gstrides, box, estr, kTmaInterleaveNone, kTmaSwizzle128B, kTmaL2Promo128B, kTmaOobZero),
             what);
  return m;
}

}  // namespace

AttnTensorMap attn_sm90_tensor_map(AttnElem e, const void* ptr, const int64_t (&strides)[3], int64_t batch, int64_t heads,
                                   int64_t seqlen, int head_dim, int box_rows, const char* what) {
  const TensorMap m = encode(e, ptr, strides, batch, heads, seqlen, head_dim, box_rows, what);
  AttnTensorMap r;
  std::memcpy(r.bytes, m.bytes, sizeof(r.bytes));
  return r;
}

std::string AttnSm90Tile::tag() const {
  return "wg" + std::to_string(block_m()) + "x" + std::to_string(block_n) + "s" + std::to_string(stages) +
         (pingpong ? "p" : "") + (overlap ? "o" : "") + (skip ? "k" : "") + (pairs ? "l" : "") +
         (desc ? "d" : "") + (split ? "w" : "") + (shift ? "b" : "") + (store_o ? "t" : "") + (persistent ? "" : "n");
}

bool AttnSm90Tile::is_tag(const std::string& tag) { return tag.rfind("wg", 0) == 0; }

AttnSm90Tile AttnSm90Tile::parse(const std::string& tag) {
  static const std::regex re(R"(wg(\d+)x(\d+)s(\d+)(p?)(o?)(k?)(l?)(d?)(w?)(b?)(t?)(n?))");
  std::smatch m;
  if (!std::regex_match(tag, m, re) || std::stoi(m[1]) % 64 != 0)
    throw std::invalid_argument("bad sm90 attention tile tag '" + tag + "' (want e.g. wg128x128s2p)");
  AttnSm90Tile t;
  t.consumers = std::stoi(m[1]) / 64;
  t.block_n = std::stoi(m[2]);
  t.stages = std::stoi(m[3]);
  t.pingpong = m[4].length() > 0;
  t.overlap = m[5].length() > 0;
  t.skip = m[6].length() > 0;
  t.pairs = m[7].length() > 0;
  t.desc = m[8].length() > 0;
  t.split = m[9].length() > 0;
  t.shift = m[10].length() > 0;
  t.store_o = m[11].length() > 0;
  t.persistent = m[12].length() == 0;
  if (t.store_o && (t.overlap || t.consumers != 2))
    throw std::invalid_argument("sm90 attention tile '" + tag + "': 't' needs two consumers and no 'o'");
  return t;
}

bool attn_sm90_head_dim_supported(int64_t d) { return d == 64 || d == 96 || d == 128 || d == 256; }

int attn_sm90_stored_dim(int64_t d) {
  // Sm90Tile::kStoredDim: whole 64-column (128-byte) swizzle atoms. D = 96
  // rows take 128 columns in shared memory (TMA zero-fills the last 32 of
  // the second box); its products are 96 wide (six k steps of S, P V as
  // m64n96k16): 1.10-1.13x the D = 128 kernel over 96-column maps on the H200
  // (session 27).
  return static_cast<int>((d + 63) / 64 * 64);
}

AttnSm90Tile attn_sm90_default_tile(int head_dim, bool causal, bool masked) {
  // Mirrors attn_runtime_sm90.default_config_sm90: causal tiles in the pairs
  // schedule (15% faster at D = 128, S = 2048 on the H200; docs/attention.md)
  // unless masked (pairs with a mask spilled); non-causal ones with the
  // descriptors by offset ("d", 1-2% on the H200 at 487e149) and the split
  // tail ("w", docs/attention.md), unless masked (not measured with a mask);
  // causal ones with the pairs schedule's tail split ("lw") and query blocks
  // ending at Sq ("b": +4.5% at D = 64, S = 2048 and 4096 on the H200).
  // OPFUSE_ATTN_SM90_SPLIT=0 leaves the split out.
  const bool pairs = causal && !masked, desc = !causal && !masked;
  const bool split = !masked && attn_sm90_split_enabled(), shift = pairs;
  if (head_dim == 64) return {128, 3, 4, true, true, false, false, pairs, desc, split, shift};
  if (head_dim == 128) return {128, 2, 2, true, true, false, false, pairs, desc, split, shift};
  // D = 96: D = 128's tiles, non-causal without "d" (ptxas spilled 8 bytes with it).
  if (head_dim == 96) return {128, 2, 2, true, true, false, false, pairs, false, split, shift};
  // D = 256: 64-key blocks (128 O accumulators a thread leave room for 32 S
  // floats; Sm90Tile), one Q buffer (64 KB) and two K/V stages (128 KB).
  if (head_dim == 256) return {64, 2, 2, true, true, false, false, pairs, desc, split, shift};
  throw std::invalid_argument("the sm90 attention kernel covers head dims 64, 96, 128 and 256, not " + std::to_string(head_dim));
}

std::vector<AttnSm90Tile> attn_sm90_candidate_tiles(int head_dim) {
  // Mirrors attn_runtime_sm90.VARIANT_SM90 (the benchmark's variants).
  std::vector<AttnSm90Tile> r{attn_sm90_default_tile(head_dim, false), attn_sm90_default_tile(head_dim, true)};
  // {block_n, consumers, stages, pingpong, persistent, overlap, skip, pairs}
  if (head_dim == 128)
    r.insert(r.end(), {{128, 2, 2, true, true, true, false, false}, {128, 2, 2, true, true, true, false, true}});
  // The defaults with and without the split tail, and causal without the shift.
  for (bool causal : {false, true}) {
    AttnSm90Tile t = attn_sm90_default_tile(head_dim, causal);
    t.split = !t.split;
    r.push_back(t);
  }
  AttnSm90Tile t = attn_sm90_default_tile(head_dim, true);
  t.shift = false;
  r.push_back(t);
  // The D = 128 defaults storing O through TMA (tile letter "t"; two consumers only).
  for (bool causal : {false, true}) {
    if (head_dim != 128) break;
    AttnSm90Tile s = attn_sm90_default_tile(head_dim, causal);
    s.store_o = true;
    r.push_back(s);
  }
  return r;
}

int attn_sm90_smem_bytes(int head_dim, const AttnSm90Tile& t) {
  head_dim = attn_sm90_stored_dim(head_dim);
  // + 32: the causal split's schedule after the mbarriers
  const int q = t.block_m() * head_dim * 2, kv = t.block_n * head_dim * 2,
            rest = 2 * t.stages * kv + 8 * (4 + 4 * t.stages) + 32 + 1024;
  return (2 * q + rest <= 227 * 1024 ? 2 * q : q) + rest;
}

std::string attn_sm90_name_expression(AttnElem e, int head_dim, bool causal, const AttnSm90Tile& t, AttnMaskKind mask) {
  return std::string("opfuse_attn::attention_fwd_sm90<opfuse_attn::") + attn_elem_name(e) + ", " +
         std::to_string(head_dim) + ", " + (causal ? "true" : "false") + ", " + std::to_string(t.block_n) + ", " +
         std::to_string(t.consumers) + ", " + std::to_string(t.stages) + ", " + (t.pingpong ? "true" : "false") +
         (mask == AttnMaskKind::None && t.opts() ? std::string(", opfuse_attn::MaskNone") : attn_mask_template_arg(mask)) +
         (t.opts() ? ", " + std::to_string(t.opts()) : std::string()) + ">";
}

bool attn_sm90_split_enabled() {
  const char* v = std::getenv("OPFUSE_ATTN_SM90_SPLIT");
  return !(v && std::string(v) == "0");
}

bool attn_sm90_enabled() {
  const char* v = std::getenv("OPFUSE_ATTN_SM90");
  return !(v && std::string(v) == "0");
}

bool attn_sm90_mask_enabled(int64_t head_dim) {
  // Mirrors attn_runtime_sm90.sm90_mask_enabled: D = 128 by default (1.35-1.6x
  // the mma.sync kernel's speed with a mask on the H200); D = 64 spills.
  const char* v = std::getenv("OPFUSE_ATTN_SM90_MASK");
  const std::string s = v ? v : "";
  return s == "1" || (s != "0" && head_dim == 128);
}

std::string attn_sm90_unsupported_reason(const AttnForwardArgs& a, int arch) {
  if (arch != 90) return "sm_" + std::to_string(arch) + " is not sm_90";
  if (!a.tile.empty() && !AttnSm90Tile::is_tag(a.tile)) return "an mma.sync tile was asked for";
  if (a.tile.empty() && !attn_sm90_enabled()) return "OPFUSE_ATTN_SM90=0";
  if (a.tile.empty() && a.mask != AttnMaskKind::None && !attn_sm90_mask_enabled(a.head_dim))
    return "an attn_mask at this head dim (OPFUSE_ATTN_SM90_MASK)";
  if (!attn_sm90_head_dim_supported(a.head_dim)) return "head dim " + std::to_string(a.head_dim) + " is not 64, 96, 128 or 256";
  if (a.seqlen_k == 0) return "Sk = 0 (a tensor map needs non-empty dims)";
  if (!cuda().TensorMapEncodeTiled) return "the CUDA driver has no cuTensorMapEncodeTiled";
  // TMA: global strides below 2^40 bytes (multiples of 16 bytes is
  // attn_unsupported_reason's multiple-of-8-elements rule).
  for (const int64_t* st : {a.q_strides, a.k_strides, a.v_strides})
    for (int d = 0; d < 3; ++d)
      if (st[d] <= 0 || 2 * st[d] >= (int64_t{1} << 40)) return "a stride is not in (0, 2^39) elements";
  return {};
}

AttnCompiled attn_sm90_compile(AttnElem e, int head_dim, bool causal, const AttnSm90Tile& t, bool use_cache,
                               AttnMaskKind mask) {
  if (!attn_sm90_head_dim_supported(head_dim))
    throw std::invalid_argument("the sm90 attention kernel covers head dims 64, 96, 128 and 256, not " + std::to_string(head_dim));
  // wgmma and setmaxnreg exist only on the arch-specific target.
  return attn_compile_named(source(), "attention_fwd_sm90.cu", attn_sm90_name_expression(e, head_dim, causal, t, mask),
                            "sm_90a", kMagic, use_cache);
}

namespace {

// SMs of the context's device (the persistent grid: one CTA an SM).
int sm_count(CUcontext ctx) {
  static std::mutex mu;
  static std::map<CUcontext, int> counts;
  std::lock_guard<std::mutex> lock(mu);
  int& n = counts[ctx];
  if (n == 0) {
    const CudaApi& c = cuda();
    CUdevice dev = 0;
    check_cuda(c.CtxGetDevice(&dev), "cuCtxGetDevice");
    check_cuda(c.DeviceGetAttribute(&n, kDevAttrMultiprocessorCount, dev), "cuDeviceGetAttribute(SM count)");
  }
  return n;
}

}  // namespace

bool attn_sm90_causal_split_cuts(int64_t seqlen_q, int64_t seqlen_k, int block_m, int block_n, int64_t heads_batch,
                                 int64_t grid, bool shift) {
  // Mirrors CausalTail / causal_tail_schedule (attention_fwd_sm90_schedule.cu).
  const int64_t num_m = (seqlen_q + block_m - 1) / block_m, tiles = num_m * heads_batch;
  if (seqlen_q <= 0 || seqlen_k <= 0 || grid <= 0 || tiles <= grid || num_m > INT32_MAX / 2) return false;
  const int64_t row_shift = shift ? num_m * block_m - seqlen_q : 0;  // row_shift_of
  auto blocks = [&](int64_t m) {  // tile_key_blocks, causal
    const int64_t m_end = std::min((m + 1) * block_m - row_shift, seqlen_q);
    const int64_t key_end = std::min(m_end + seqlen_k - seqlen_q, seqlen_k);
    return key_end > 0 ? (key_end + block_n - 1) / block_n : int64_t{0};
  };
  // Short tiles lose more to the cut pieces' extra epilogues than the balance
  // gains (H200, session 24: -4% at 4 key blocks, -1.6 to -3% at 8, -0.6 to
  // +1.3% at 16, +1 to +3.6% at 64 and 128). The kernel's tile and item
  // indices are 32-bit.
  const int64_t longest = blocks(num_m - 1), p2 = num_m / 2, np = p2 * heads_batch;
  if (longest < kAttnCausalSplitMinBlocks || np >= INT32_MAX / 2 || heads_batch >= INT32_MAX) return false;
  // This runs on every launch (plan_sm90) and sums over a head's P2 items:
  // the last answer of this thread is kept (one shape, launched again and again).
  struct Query {
    int64_t v[6];
    bool shift;
    bool operator==(const Query&) const = default;
  };
  thread_local Query last_query{};
  thread_local bool last_answer = false;
  const Query query{{seqlen_q, seqlen_k, block_m, block_n, heads_batch, grid}, shift};
  if (query == last_query) return last_answer;
  const int64_t j0 = std::max<int64_t>(np / grid - 1, 0) * grid;
  int64_t H = 0, c_j0 = 0;
  for (int64_t q = 0; q < p2; ++q) {
    const int64_t L = blocks(num_m - 1 - q) + blocks(q);
    H += L;
    if (q < j0 % p2) c_j0 += L;
  }
  if (p2 > 0) c_j0 += j0 / p2 * H;
  const int64_t T = heads_batch * H - c_j0 + ((num_m & 1) ? heads_batch * blocks(num_m / 2) : 0);
  // A range of at least the longest tile (the last query block's) cuts a tile at most once.
  last_query = query;
  last_answer = T / grid >= longest;
  return last_answer;
}

namespace {

// How a call runs: the tile (its split resolved), the grid and, with the
// split, the workspace the kernel needs (AttnSplitWs in attention_fwd_sm90.cu).
struct Sm90Plan {
  AttnSm90Tile tile;
  unsigned grid_x = 0;
  AttnWorkspace ws;
};

Sm90Plan plan_sm90(const AttnForwardArgs& a, CUcontext ctx) {
  const int D = static_cast<int>(a.head_dim);
  const bool masked = a.mask != AttnMaskKind::None;
  Sm90Plan pl;
  pl.tile = a.tile.empty() ? attn_sm90_default_tile(D, a.causal, masked) : AttnSm90Tile::parse(a.tile);
  const int sms = sm_count(ctx);
  const int64_t tiles = (a.seqlen_q + pl.tile.block_m() - 1) / pl.tile.block_m() * a.heads_q * a.batch;
  if (tiles > INT32_MAX) throw std::invalid_argument("attention sm90: more than 2^31 tiles");
  pl.grid_x = static_cast<unsigned>(pl.tile.persistent && tiles > sms ? sms : tiles);
  // The split changes nothing when the tiles fill whole rounds (or one CTA
  // has each tile); the kernel's tail arithmetic is 32-bit: at most 2 G
  // tiles of nb key blocks.
  // Causal (pairs): the pairs schedule's tail when every range holds at least
  // the longest tile.
  const int64_t nb = (a.seqlen_k + pl.tile.block_n - 1) / pl.tile.block_n;
  const bool cuts = a.causal ? attn_sm90_causal_split_cuts(a.seqlen_q, a.seqlen_k, pl.tile.block_m(), pl.tile.block_n,
                                                           a.heads_q * a.batch, pl.grid_x,
                                                           pl.tile.for_call(true, masked).shift)
                             : tiles > pl.grid_x && tiles % pl.grid_x != 0 && 2 * int64_t{pl.grid_x} * nb < INT32_MAX;
  pl.tile = pl.tile.for_call(a.causal, masked, cuts);
  if (pl.tile.split) {
    // flags (grid x consumers u32, 256-byte padded), then a slot of
    // 128 x consumers x (D / 2 + 4) floats a CTA
    pl.ws.zero_bytes = (int64_t{pl.grid_x} * pl.tile.consumers * 4 + 255) / 256 * 256;
    pl.ws.bytes = pl.ws.zero_bytes + int64_t{pl.grid_x} * 128 * pl.tile.consumers * (D / 2 + 4) * 4;
  }
  return pl;
}

}  // namespace

AttnWorkspace attn_sm90_workspace(const AttnForwardArgs& a, CUcontext ctx) { return plan_sm90(a, ctx).ws; }

void attn_forward_sm90_launch(const AttnForwardArgs& a, const AttnFwdParams& p, CUcontext ctx, CUstream stream) {
  const CudaApi& c = cuda();
  const int D = static_cast<int>(a.head_dim);
  Sm90Plan pl = plan_sm90(a, ctx);
  // Without the workspace the planned split cannot run: the same tile without it.
  if (pl.tile.split && (!a.split_ws || a.split_ws_bytes < pl.ws.bytes)) pl.tile.split = false;
  const AttnSm90Tile& tile = pl.tile;
  const int smem = attn_sm90_smem_bytes(D, tile);
  struct Loaded {
    CUmodule module = nullptr;
    CUfunction fn = nullptr;
  };
  static std::mutex mu;
  static std::map<std::tuple<CUcontext, std::string>, Loaded> functions;
  const std::string expr = attn_sm90_name_expression(a.elem, D, a.causal, tile, a.mask);
  CUfunction fn = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu);
    Loaded& lf = functions[{ctx, expr}];
    if (!lf.fn) {
      lf.fn = attn_load_function(
          [&](bool use_cache) { return attn_sm90_compile(a.elem, D, a.causal, tile, use_cache, a.mask); }, &lf.module,
          "attention sm90");
      check_cuda(c.FuncSetAttribute(lf.fn, kAttrMaxDynamicSharedBytes, smem), "cuFuncSetAttribute(max dynamic smem)");
    }
    fn = lf.fn;
  }
  TensorMap tq = encode(a.elem, a.q, a.q_strides, a.batch, a.heads_q, a.seqlen_q, D, tile.block_m(), "cuTensorMapEncodeTiled(q)");
  TensorMap tk = encode(a.elem, a.k, a.k_strides, a.batch, a.heads_kv, a.seqlen_k, D, tile.block_n, "cuTensorMapEncodeTiled(k)");
  TensorMap tv = encode(a.elem, a.v, a.v_strides, a.batch, a.heads_kv, a.seqlen_k, D, tile.block_n, "cuTensorMapEncodeTiled(v)");
  AttnFwdParams params = p;
  // AttnSplitWs {partial, flags}: the flags at the workspace's start.
  struct {
    void* partial;
    void* flags;
  } split_ws{nullptr, nullptr};
  if (tile.split) split_ws = {static_cast<char*>(a.split_ws) + pl.ws.zero_bytes, a.split_ws};
  // The O map (tile letter "t"; 64-row boxes, one consumer's rows); other
  // tiles take q's map in its place and never read it.
  TensorMap to;
  if (tile.store_o) to = encode(a.elem, a.o, a.o_strides, a.batch, a.heads_q, a.seqlen_q, D, 64, "cuTensorMapEncodeTiled(o)");
  void* args[] = {&params, tq.bytes, tk.bytes, tv.bytes, &split_ws, tile.store_o ? to.bytes : tq.bytes};
  check_cuda(c.LaunchKernel(fn, pl.grid_x, 1, 1,
                            static_cast<unsigned>(tile.threads()), 1, 1, static_cast<unsigned>(smem), stream, args, nullptr),
             "cuLaunchKernel(attention sm90)");
}

}  // namespace opfuse::attention
