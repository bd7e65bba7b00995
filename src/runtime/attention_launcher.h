// The C++ launcher of the FlashAttention-2-style forward kernel
// (src/kernels/attention/attention_fwd.cu, embedded as a string): tile
// choice, NVRTC compilation of one template instantiation per
// (element type, head dim, causal, tile), a disk cache of the cubins
// (OPFUSE_CACHE_DIR/attention), a per-context cache of loaded functions, and
// the launch on the caller's stream. No link-time CUDA dependency: libcuda
// and libnvrtc come from runtime/cuda_api.h (dlopen).
//
// The launch ABI (AttnFwdParams, grid, block, shared memory) is documented in
// docs/attention.md and at the top of attention_fwd.cu; AttnFwdParams below
// mirrors the kernels' struct (attention_ptx.cu) byte for byte.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "runtime/cuda_api.h"

namespace opfuse::attention {

// Mirror of opfuse_attn::AttnFwdParams (only append fields, in both places).
struct AttnFwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t k_batch_stride, k_head_stride, k_row_stride;
  int64_t v_batch_stride, v_head_stride, v_row_stride;
  int64_t o_batch_stride, o_head_stride, o_row_stride;
  int64_t lse_batch_stride, lse_head_stride;
  int32_t batch, heads_q, heads_kv, q_per_kv;
  int32_t seqlen_q, seqlen_k;
  float softmax_scale;
  float scale_log2;
  const void* mask;  // attn_mask or null; element strides over [B, Hq, Sq, Sk], key stride 1
  int64_t mask_batch_stride, mask_head_stride, mask_row_stride, mask_col_stride;
};
static_assert(sizeof(AttnFwdParams) == 224, "AttnFwdParams layout is the kernel's launch ABI");
static_assert(offsetof(AttnFwdParams, lse_batch_stride) == 136 && offsetof(AttnFwdParams, batch) == 152 &&
                  offsetof(AttnFwdParams, softmax_scale) == 176 && offsetof(AttnFwdParams, mask) == 184,
              "AttnFwdParams field offsets are the kernel's launch ABI");

enum class AttnElem { BF16, F16 };
const char* attn_elem_name(AttnElem e);  // "bf16" / "f16"
AttnElem parse_attn_elem(const std::string& name);

// The attn_mask kinds the kernels take (their Mask template argument,
// attention_ptx.cu): one value per (b, h, i, j) of a broadcast mask, bool
// (False = -inf) or additive in bf16 / f16 / f32; or key padding, one float32
// additive value per (b, j) (the caller converts a boolean one to 0 / -inf).
// Names: "none" (or ""), "full-bool", "full-bf16", "full-f16", "full-f32", "keypad".
enum class AttnMaskKind { None, FullBool, FullBf16, FullF16, FullF32, KeyPad };
const char* attn_mask_name(AttnMaskKind m);
AttnMaskKind parse_attn_mask(const std::string& name);  // throws std::invalid_argument
int attn_mask_elem_bytes(AttnMaskKind m);                // 0 for None
// ", opfuse_attn::MaskFull<opfuse_attn::bool8>" etc.; "" for None (the kernels' default).
std::string attn_mask_template_arg(AttnMaskKind m);

// A tile: BLOCK_M x BLOCK_N, NUM_WARPS, MIN_BLOCKS (launch bounds), SPLIT_PV.
// Tag form "128x64w4b2" (suffix "s" for SPLIT_PV), as in docs/attention.md.
struct AttnTile {
  int block_m = 128, block_n = 64, num_warps = 4, min_blocks = 2;
  bool split_pv = false;
  std::string tag() const;
  static AttnTile parse(const std::string& tag);  // throws std::invalid_argument
  bool operator==(const AttnTile&) const = default;
};

inline constexpr int kAttnHeadDims[] = {64, 96, 128, 256};
bool attn_head_dim_supported(int64_t head_dim);

// Dynamic shared memory of one CTA (FwdTile::kSmemBytes; key padding adds two
// stages of BLOCK_N float32 values).
int attn_smem_bytes(int head_dim, const AttnTile& t, AttnMaskKind mask = AttnMaskKind::None);
// Largest dynamic shared memory a CTA may opt into on sm_<arch> (table; the
// launcher asks the device instead).
int attn_max_smem_for_arch(int arch);
// What both attention launchers choose tiles with: the current context's
// sm_XY as XY, and the shared memory a block of `dev` may opt in to
// (attn_max_smem_for_arch where the driver does not say).
struct AttnDevice {
  int arch = 0, smem_optin = 0;
};
AttnDevice attn_device(CUdevice dev);
// The tile the launcher uses (docs/attention.md, "Tile choice"); smem_limit
// <= 0 takes the table's value for the architecture.
AttnTile attn_choose_tile(int head_dim, int64_t seqlen_q, int64_t seqlen_k, bool causal, int arch, int smem_limit = 0);
// Every tile the default choice can return for a head dim on an
// architecture with `smem_limit` bytes (the instantiations CI compiles).
std::vector<AttnTile> attn_candidate_tiles(int head_dim, int arch, int smem_limit = 0);

std::string attn_name_expression(AttnElem e, int head_dim, bool causal, const AttnTile& t,
                                 AttnMaskKind mask = AttnMaskKind::None);

struct AttnCompiled {
  std::string expression;  // the NVRTC name expression
  std::string lowered;     // the mangled entry point in the cubin
  std::string cubin;
  std::string log;         // NVRTC/ptxas log (empty on a cache hit)
  bool cache_hit = false;
};
// Compiles one instantiation for sm_<arch> with NVRTC (no GPU needed), through
// the disk cache unless use_cache is false. Throws with NVRTC's log on failure.
AttnCompiled attn_compile(AttnElem e, int head_dim, bool causal, const AttnTile& t, int arch, bool use_cache = true,
                          AttnMaskKind mask = AttnMaskKind::None);

// What attn_compile and attn_sm90_compile share: one name expression of
// `source` (the shared helpers, then the kernel; named `file` in messages)
// compiled for `gpu_arch` with nvrtc_named_options, through the disk cache
// unless use_cache is false: ".cubin" entries of kind "attention" that start
// with `magic`, keyed by the source, the expression, the options and NVRTC's
// version. An entry that does not unpack (another layout, damaged) is
// evicted and rebuilt.
AttnCompiled attn_compile_named(const std::string& source, const char* file, const std::string& expr,
                                const std::string& gpu_arch, const char* magic, bool use_cache);

// Loads compile(true)'s cubin into the current context as *module and
// returns its function; a cubin the driver refuses (e.g. a stale cache
// entry) is compiled afresh once with compile(false). `what` names failures.
CUfunction attn_load_function(const std::function<AttnCompiled(bool use_cache)>& compile, CUmodule* module,
                              const std::string& what);

struct AttnForwardArgs {
  AttnElem elem = AttnElem::BF16;
  const void* q = nullptr;  // [B, Hq, Sq, D]
  const void* k = nullptr;  // [B, Hkv, Sk, D]
  const void* v = nullptr;  // [B, Hkv, Sk, D]
  void* o = nullptr;        // [B, Hq, Sq, D], q's element type
  float* lse = nullptr;     // [B, Hq, Sq] float32, or null
  // element strides of dims 0..2 (the last dim must be contiguous)
  int64_t q_strides[3] = {}, k_strides[3] = {}, v_strides[3] = {}, o_strides[3] = {};
  int64_t lse_strides[2] = {};
  int64_t batch = 0, heads_q = 0, heads_kv = 0, seqlen_q = 0, seqlen_k = 0, head_dim = 0;
  bool causal = false;
  // attn_mask (combines with causal: a key must pass both): its kind, data
  // and element strides over the broadcast [B, Hq, Sq, Sk] (0 on broadcast
  // dims; the key stride must be 1, key padding: head and row strides 0).
  AttnMaskKind mask = AttnMaskKind::None;
  const void* mask_ptr = nullptr;
  int64_t mask_strides[4] = {};
  double softmax_scale = 0;  // <= 0: 1 / sqrt(head_dim)
  std::string tile;          // empty: the default (sm_90, D 64/128: the Hopper kernel); "wg...": a Hopper tile
  int device = -1;           // CUDA device of the tensors; >= 0: make its primary context current
                             // when the thread has none or another device's (PyTorch's context)
  // The Hopper kernel's split tail (tile letter "w"): a workspace of at least
  // attn_forward_workspace(a).bytes bytes whose first zero_bytes are zero at
  // launch (the caller allocates it on the launch stream and zeroes them).
  // Null or too small: the tile runs without the split.
  void* split_ws = nullptr;
  int64_t split_ws_bytes = 0;
};

// What a call needs beyond its outputs: {0, 0} unless the Hopper kernel
// takes it with the split tail (non-causal, no attn_mask, default tile or a
// "w" tile). Same checks as attn_forward_cuda (throws where it would).
struct AttnWorkspace {
  int64_t bytes = 0, zero_bytes = 0;
};
AttnWorkspace attn_forward_workspace(const AttnForwardArgs& a);

// Empty when the kernel covers the problem, else why not (head dim,
// alignment, strides, sizes, the mask's layout): the caller then takes another path.
std::string attn_unsupported_reason(const AttnForwardArgs& a);
// The attn_mask checks alone (shared with the backward): kind, pointer, strides.
std::string attn_mask_unsupported_reason(AttnMaskKind kind, const void* ptr, const int64_t (&strides)[4],
                                         int64_t seqlen_k);

// The kernel argument for a checked problem (scale <= 0: 1 / sqrt(head_dim)).
AttnFwdParams attn_make_params(const AttnForwardArgs& a);

// Checks, chooses the tile, compiles or loads the instantiation into the
// current CUDA context (once per context), and launches on `stream`. No
// synchronisation and no allocation: CUDA-graph safe after the first call of
// an instantiation. Throws std::invalid_argument for unsupported problems.
void attn_forward_cuda(const AttnForwardArgs& a, CUstream stream);

}  // namespace opfuse::attention
