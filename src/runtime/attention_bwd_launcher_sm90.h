// The launcher of the Hopper attention backward
// (src/kernels/attention/attention_bwd_sm90.cu, compiled in one NVRTC program
// after attention_ptx.cu, attention_sm90_ptx.cu and attention_bwd.cu, whose
// preprocess and dQ-convert kernels it launches around its own): tiles, NVRTC
// for sm_90a through the disk cache, the TMA tensor maps and the launch
// sequence. attn_backward_cuda (attention_bwd_launcher.h) dispatches here on
// sm_90 for D = 64 and 128 in atomic mode unless OPFUSE_ATTN_BWD_SM90=0;
// deterministic mode, D = 96 / 256 and other architectures keep the mma.sync
// kernels. Launch ABI: docs/attention.md, "Hopper backward".
#pragma once
#include <string>
#include <vector>

#include "runtime/attention_bwd_launcher.h"

namespace opfuse::attention {

// BLOCK_M query rows per step (the CTA owns 128 keys), a `stages`-deep ring
// of Q / dO / LSE2 / Delta, how dQ is added (the kernel's DQ_MODE: 0 red.global,
// 1 staged per warp + bulk reductions from the consumer lanes, 2 staged per
// block + bulk reductions from producer warps) and the kernel's schedule
// options (OPTS bits: 1 early dK, 2 deferred dQ, 4 staggered consumers, 8
// red.global.add.v4, 16 next S^T under the dQ epilogue, 32 cheap wgmma
// descriptors, 64 conflict-free dQ staging stores). Tag form "wgb64s2" (mode
// 0), "wgb64s2q" (1), "wgb64s2w" (2), options as "_" + letters k, d, t, v, o,
// u, b ("wgb64s2_kdt").
struct AttnBwdSm90Tile {
  int block_m = 64, stages = 2, dq_mode = 0, opts = 0;
  std::string tag() const;
  bool operator==(const AttnBwdSm90Tile&) const = default;
};

// False when OPFUSE_ATTN_BWD_SM90=0 (forces the mma.sync kernels, for comparison).
bool attn_bwd_sm90_enabled();
// OPFUSE_ATTN_BWD_SM90_DQ=0|1|2 picks the dQ mode's plain tile instead (A/B; no options).
AttnBwdSm90Tile attn_bwd_sm90_default_tile(int head_dim);
// The default and the variants (what CI compiles); mirrors attn_bwd_runtime_sm90.
std::vector<AttnBwdSm90Tile> attn_bwd_sm90_candidate_tiles(int head_dim);
// BwdSm90Tile::kSmemBytes.
int attn_bwd_sm90_smem_bytes(int head_dim, const AttnBwdSm90Tile& t);
// Name expressions in the order preprocess, the Hopper kernel, convert.
std::vector<std::string> attn_bwd_sm90_name_expressions(AttnElem e, int head_dim, bool causal, const AttnBwdSm90Tile& t);
// Compiles the three kernels of one problem for sm_90a (no GPU needed).
AttnBwdCompiled attn_bwd_sm90_compile(AttnElem e, int head_dim, bool causal, const AttnBwdSm90Tile& t,
                                      bool use_cache = true);
// Empty when the Hopper kernel takes the (already checked) problem on sm_<arch>, else why not.
std::string attn_bwd_sm90_unsupported_reason(const AttnBackwardArgs& a, int arch);
// preprocess, the Hopper kernel, convert on `stream` in the current context
// `ctx`; `p` is the kernels' AttnBwdParams, filled by attn_backward_cuda.
void attn_backward_sm90_launch(const AttnBackwardArgs& a, const AttnBwdParams& p, CUcontext ctx, CUstream stream);

}  // namespace opfuse::attention
