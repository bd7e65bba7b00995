// The launcher of the Hopper attention forward kernel
// (src/kernels/attention/attention_fwd_sm90.cu after its schedules,
// attention_fwd_sm90_schedule.cu, embedded as strings):
// its tiles, NVRTC compilation for sm_90a through the disk cache, the TMA
// tensor maps (cuTensorMapEncodeTiled) and the launch. attn_forward_cuda
// (attention_launcher.h) dispatches here on sm_90 devices for the head dims
// the kernel covers (64, 128) unless OPFUSE_ATTN_SM90=0; everything else runs
// on the mma.sync kernel. Launch ABI: docs/attention.md, "Hopper".
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/attention_launcher.h"

namespace opfuse::attention {

// BLOCK_N keys per block, `consumers` warpgroups of 64 query rows each, a
// `stages`-deep K/V ring, ping-pong (consumers take turns issuing their
// matrix products), and (host only) a persistent grid of min(tiles, SMs) CTAs
// rather than one CTA per tile. Tag form "wg128x128s2p" (BLOCK_M x BLOCK_N,
// s stages, p ping-pong, o overlap, k skip, l pairs, d descriptors by offset;
// a trailing "n": not persistent).
// Kernel options (the OPTS template argument; tag letters after "p"):
// overlap ("o"): the next tile's first S = Q K^T goes out before this tile's
// epilogue; skip ("k"): a consumer issues no product for the key blocks none
// of its rows see; pairs ("l"): causal tiles handed out in pairs of query
// blocks (x, last - x) of one head (equal work per pair, few heads in L2);
// desc ("d"): each wgmma's descriptors as the product's first plus a constant.
// split ("w", calls without an attn_mask; causal ones with pairs): the tiles
// of the last one or two rounds (causal: of the pairs schedule's last item
// rounds and its middles) cut over the CTAs by key blocks, the two pieces of
// a cut tile merged through a workspace (docs/attention.md, "split tail").
// shift ("b", causal calls without an attn_mask, no skip): the query blocks
// end at Sq, the ragged one first (the shortest causal tile, not the longest).
// store_o ("t", two consumers, not with overlap): O leaves through TMA stores
// (the kernel's sixth argument, a map over O with 64-row boxes) instead of
// 16-byte copies; slower than without on the H200 (session 25), a variant.
struct AttnSm90Tile {
  int block_n = 128, consumers = 2, stages = 2;
  bool pingpong = true, persistent = true;
  bool overlap = false, skip = false, pairs = false, desc = false, split = false, shift = false, store_o = false;
  int opts() const {
    return (overlap ? 1 : 0) | (skip ? 2 : 0) | (pairs ? 4 : 0) | (desc ? 8 : 0) | (split ? 16 : 0) | (shift ? 32 : 0) |
           (store_o ? 64 : 0);
  }
  // The tile a call runs: without the split when it does not apply (an
  // attn_mask; causal without pairs) or `fits` is false (nothing to cut, no
  // workspace, too many iterations); a non-causal split without pairs (which
  // only order causal tiles).
  // The shift only for causal calls without an attn_mask or skip.
  AttnSm90Tile for_call(bool causal, bool masked, bool fits = true) const {
    AttnSm90Tile t = *this;
    t.split = split && !masked && fits && (!causal || pairs);
    if (t.split && !causal) t.pairs = false;
    t.shift = shift && causal && !masked && !skip;
    return t;
  }
  int block_m() const { return 64 * consumers; }
  int threads() const { return 128 * (consumers + 1); }
  std::string tag() const;
  static AttnSm90Tile parse(const std::string& tag);  // throws std::invalid_argument
  static bool is_tag(const std::string& tag);         // "wg..." (else an mma.sync tile)
  bool operator==(const AttnSm90Tile&) const = default;
};

bool attn_sm90_head_dim_supported(int64_t head_dim);  // 64, 96, 128, 256
// Columns a row takes in the kernel's shared memory (128 for 96: whole
// 64-column swizzle atoms, the rest zero-filled by TMA).
int attn_sm90_stored_dim(int64_t head_dim);
// The persistent grid; causal: the pairs schedule (docs/attention.md,
// "Hopper"), except with an attn_mask (pairs there spilled 16-28 bytes).
AttnSm90Tile attn_sm90_default_tile(int head_dim, bool causal, bool masked = false);
// The default and the benchmark variants (what CI compiles).
std::vector<AttnSm90Tile> attn_sm90_candidate_tiles(int head_dim);
// Sm90Tile::kSmemBytes: Q (two buffers when they fit), the K/V ring, the
// mbarriers, 1 KB to align the base.
int attn_sm90_smem_bytes(int head_dim, const AttnSm90Tile& t);
std::string attn_sm90_name_expression(AttnElem e, int head_dim, bool causal, const AttnSm90Tile& t,
                                      AttnMaskKind mask = AttnMaskKind::None);
// False when OPFUSE_ATTN_SM90=0 (forces the mma.sync kernel, for comparison).
bool attn_sm90_enabled();
// False when OPFUSE_ATTN_SM90_SPLIT=0 (the default tiles without the split tail).
bool attn_sm90_split_enabled();
// Whether masked calls at this head dim take the Hopper kernel:
// OPFUSE_ATTN_SM90_MASK unset: D = 128 only (faster than the mma.sync kernel
// with a mask; at D = 64 a full mask spills, docs/attention.md, "attn_mask");
// 0: never; 1: every head dim the kernel covers (64, 96, 128, 256).
bool attn_sm90_mask_enabled(int64_t head_dim);
// Empty when the Hopper kernel takes the problem on sm_<arch> (with a.tile
// empty or a "wg" tag), else why not; the caller then uses the mma.sync kernel.
std::string attn_sm90_unsupported_reason(const AttnForwardArgs& a, int arch);

// Compiles one instantiation for sm_90a with NVRTC (no GPU needed).
AttnCompiled attn_sm90_compile(AttnElem e, int head_dim, bool causal, const AttnSm90Tile& t, bool use_cache = true,
                               AttnMaskKind mask = AttnMaskKind::None);

// A TMA tensor map (CUtensorMap) over a [B, H, S, D] tensor with element
// strides (b, h, s, 1): dims (D, S, H, B), box (64, box_rows, 1, 1), 128-byte
// swizzle, zero fill outside the tensor; `what` names a failure. Also used by
// the Hopper backward (attention_bwd_launcher_sm90.cpp).
struct AttnTensorMap {
  alignas(64) unsigned char bytes[128];
};
AttnTensorMap attn_sm90_tensor_map(AttnElem e, const void* ptr, const int64_t (&strides)[3], int64_t batch, int64_t heads,
                                   int64_t seqlen, int head_dim, int box_rows, const char* what);

// Whether the causal split cuts a call's pairs schedule: more tiles than the
// grid, the longest tile at least kAttnCausalSplitMinBlocks key blocks, and
// every CTA's tail range at least that tile (a tile is then cut at most once;
// mirrors causal_tail_schedule in attention_fwd_sm90_schedule.cu).
constexpr int64_t kAttnCausalSplitMinBlocks = 16;
bool attn_sm90_causal_split_cuts(int64_t seqlen_q, int64_t seqlen_k, int block_m, int block_n, int64_t heads_batch,
                                 int64_t grid, bool shift);

// The split tail's workspace for a call the Hopper kernel takes (attn_forward_workspace).
AttnWorkspace attn_sm90_workspace(const AttnForwardArgs& a, CUcontext ctx);

// Encodes the tensor maps and launches on `stream` in the current context
// `ctx`; `p` is the kernel's AttnFwdParams, filled by attn_forward_cuda.
void attn_forward_sm90_launch(const AttnForwardArgs& a, const AttnFwdParams& p, CUcontext ctx, CUstream stream);

}  // namespace opfuse::attention
