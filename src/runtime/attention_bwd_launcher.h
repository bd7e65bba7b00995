// The C++ launcher of the attention backward (src/kernels/attention/attention_bwd.cu
// after attention_ptx.cu, both embedded as strings): tile choice, NVRTC
// compilation of the five kernels of one (element type, head dim, causal,
// tiles) problem in one program, a disk cache of the cubins
// (OPFUSE_CACHE_DIR/attention), a per-context cache of loaded functions, and
// the launch sequence on the caller's stream. No allocation: the caller
// passes the workspaces (from PyTorch's allocator), so the path has no
// cudaMalloc and no synchronisation (CUDA-graph safe after the first call).
//
// The launch ABI (AttnBwdParams, grids, shared memory) is in docs/attention.md
// ("Backward") and at the top of attention_bwd.cu; AttnBwdParams below
// mirrors the kernel's struct byte for byte.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/attention_launcher.h"  // AttnElem, parse_attn_elem
#include "runtime/cuda_api.h"
#include "runtime/nvrtc_named.h"  // NvrtcNamed

namespace opfuse::attention {

// Mirror of opfuse_attn::AttnBwdParams (only append fields, in both places).
struct AttnBwdParams {
  const void *q, *k, *v, *o, *dout;
  void *dq, *dk, *dv;
  const float* lse;
  float* dq_accum;
  float* delta;
  float* lse_log2;
  int64_t q_strides[3], k_strides[3], v_strides[3], o_strides[3], do_strides[3], dq_strides[3], dk_strides[3],
      dv_strides[3];
  int64_t lse_strides[2];
  int32_t batch, heads_q, heads_kv, q_per_kv;
  int32_t seqlen_q, seqlen_k, seqlen_q_pad;
  int32_t d_cols;  // columns of O, dO, dQ, dK, dV (0: the kernel's head dim; the Hopper backward's D = 96 as 128)
  float softmax_scale, scale_log2;
  const void* mask;  // attn_mask or null (as AttnFwdParams::mask)
  int64_t mask_strides[4];
};
static_assert(sizeof(AttnBwdParams) == 384, "AttnBwdParams layout is the kernel's launch ABI");
static_assert(offsetof(AttnBwdParams, lse_strides) == 288 && offsetof(AttnBwdParams, batch) == 304 &&
                  offsetof(AttnBwdParams, softmax_scale) == 336 && offsetof(AttnBwdParams, mask) == 344,
              "AttnBwdParams field offsets are the kernel's launch ABI");

inline constexpr int kAttnBwdRowPad = 128;  // workspace rows per (b, h): round_up(Sq, 128)

// Tiles of the two main kernels, tag form "64x128w8b1" (BLOCK_M x BLOCK_N, warps, min CTAs per SM).
struct AttnBwdTiles {
  AttnTile dkdv{64, 128, 8, 1};
  AttnTile dq{128, 64, 8, 1};
};
// `masked`: the kernel stages a third per-row array (the rows' scales of S).
int attn_bwd_dkdv_smem_bytes(int head_dim, const AttnTile& t, bool masked = false);
int attn_bwd_dq_smem_bytes(int head_dim, const AttnTile& t);
// The default tiles for a head dim that fit `smem_limit` bytes (<= 0: the
// architecture's table value); throws std::invalid_argument when none does.
// With `masked` (an attn_mask), D = 64 takes the 64x128w8b1 dK/dV tile (the
// mask step spills on 128x128w8b1).
AttnBwdTiles attn_bwd_choose_tiles(int head_dim, int arch, int smem_limit = 0, bool masked = false);

// Name expressions of one problem, in the order preprocess, dkdv (atomic dQ),
// dkdv (no dQ), dq_convert, dq.
std::vector<std::string> attn_bwd_name_expressions(AttnElem e, int head_dim, bool causal, const AttnBwdTiles& t,
                                                   AttnMaskKind mask = AttnMaskKind::None);

struct AttnBwdCompiled {
  std::vector<std::string> expressions, lowered;  // same order as attn_bwd_name_expressions
  std::string cubin, log;
  bool cache_hit = false;
};
// One backward program of either launcher: `source` (named `file` in
// NVRTC's messages) with the name expressions `exprs`, for `gpu_arch`
// (nvrtc_named_options); `what` names it in errors. With use_cache, through
// the disk cache (folder "attention", entries ending in `suffix` that hold
// `magic`, the lowered names and the cubin; one that cannot be read back is
// evicted and rebuilt), keyed by the source, the expressions, the options and
// NVRTC's version.
AttnBwdCompiled attn_bwd_compile_program(const std::string& source, const char* file,
                                         const std::vector<std::string>& exprs, const std::string& gpu_arch,
                                         const std::string& what, const char* magic, const char* suffix,
                                         bool use_cache);
// NVRTC-compiles the five kernels of one problem for sm_<arch> (no GPU needed).
AttnBwdCompiled attn_bwd_compile(AttnElem e, int head_dim, bool causal, const AttnBwdTiles& t, int arch,
                                 bool use_cache = true, AttnMaskKind mask = AttnMaskKind::None);

struct AttnBackwardArgs {
  AttnElem elem = AttnElem::BF16;
  const void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr, *dout = nullptr;
  void *dq = nullptr, *dk = nullptr, *dv = nullptr;  // outputs, q's element type
  const float* lse = nullptr;                         // [B, Hq, Sq] float32 from the forward
  // Workspaces, float32, contiguous: delta and lse_log2 [B, Hq, round_up(Sq, 128)]
  // (lse_log2 [2, B, Hq, round_up(Sq, 128)] with a mask: L2, then the rows' scales);
  // dq_accum [B, Hq, round_up(Sq, 128), D] unless deterministic (then unused).
  float *delta = nullptr, *lse_log2 = nullptr, *dq_accum = nullptr;
  int64_t q_strides[3] = {}, k_strides[3] = {}, v_strides[3] = {}, o_strides[3] = {}, do_strides[3] = {},
          dq_strides[3] = {}, dk_strides[3] = {}, dv_strides[3] = {};
  int64_t lse_strides[2] = {};
  int64_t batch = 0, heads_q = 0, heads_kv = 0, seqlen_q = 0, seqlen_k = 0, head_dim = 0;
  bool causal = false;
  // attn_mask as in AttnForwardArgs (the forward's; P is recomputed with it).
  AttnMaskKind mask = AttnMaskKind::None;
  const void* mask_ptr = nullptr;
  int64_t mask_strides[4] = {};
  bool deterministic = false;  // dQ without atomics (bitwise-reproducible)
  double softmax_scale = 0;    // <= 0: 1 / sqrt(head_dim)
  int device = -1;             // CUDA device of the tensors (see AttnForwardArgs::device)
};

// Rows of the workspaces per (b, h): round_up(seqlen_q, 128).
int64_t attn_bwd_padded_rows(int64_t seqlen_q);
// Floats of a dq_accum row: the head dim, but 128 for 96 (the Hopper backward
// runs D = 96 as 128; the mma.sync kernels use the first 96 of each row's
// place, so one size serves both).
int64_t attn_bwd_accum_cols(int64_t head_dim);

// Empty when the kernels cover the problem, else why not.
std::string attn_bwd_unsupported_reason(const AttnBackwardArgs& a);

// Checks, compiles or loads the problem's kernels into the current CUDA
// context (once per context), and launches preprocess, dK/dV and the dQ
// kernel on `stream`. Throws std::invalid_argument for unsupported problems.
void attn_backward_cuda(const AttnBackwardArgs& a, CUstream stream);

}  // namespace opfuse::attention
