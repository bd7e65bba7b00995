// The skinny GEMM (src/kernels/skinny_gemm/skinny_gemm.cu, embedded as a
// string): the GEMM path for decode shapes, M <= 16, where cuBLASLt streams
// the weight well below the memory bandwidth. It takes GemmArgs (the same
// D = act(A @ B + bias + C) contract as run_gemm) when B is an nn.Linear
// weight (K unit-stride) and the rest qualifies (see skinny_unsupported_reason);
// otherwise the caller keeps cuBLASLt.
//
// NVRTC compiles one instantiation per (dtype, tile config, arch), cached on
// disk (OPFUSE_CACHE_DIR/skinny_gemm) and loaded once per CUDA context; the
// launch allocates nothing and never synchronizes (CUDA-graph safe once the
// instantiation is loaded). Environment: OPFUSE_SKINNY_GEMM=1 sends every
// GEMM it supports here, GEMM pairs included, =0 none; by default the box
// of shapes measured on the H200 (default_takes: sm_90, N and K of 4096 to
// 16384), a pair there as one TMA launch (try_run_pair); OPFUSE_SKINNY_PDL=0 turns off its
// programmatic dependent launch; OPFUSE_SKINNY_CONFIG=<tag> forces a tile
// config (<tag>@<N>,...: per output width), OPFUSE_SKINNY_PIPE=2 makes the chosen pipelined configs p2 and
// OPFUSE_SKINNY_TMA=0 the register kernel's configs where the TMA kernel's
// are the default (sm_90, not the gated form).
#pragma once
#include "runtime/nvrtc_cached.h"
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/gemm_launcher.h"

namespace opfuse::skinny {

inline constexpr int64_t kMaxM = 16;

// Mirror of opfuse_skinny::SkinnyParams (only append fields, in both places).
struct SkinnyParams {
  const void* a;
  int64_t lda;
  const void* w;
  int64_t ldw;
  void* d;
  int64_t ldd;
  const void* bias;
  int64_t bias_stride;
  const void* c;
  int64_t ldc;
  void* aux;
  int64_t ldaux;
  int32_t m, n, k;
  int32_t act;  // 0 none, 1 relu, 2 gelu_tanh
  const void* a2;  // gated A (GemmArgs::a_mul): A = silu(a) * a2
  int64_t lda2;
};
static_assert(sizeof(SkinnyParams) == 128, "SkinnyParams layout is the kernel's launch ABI");

// A tile config: NT n-tiles of 8 rows per CTA, U 16-byte loads per row and
// lane per chunk, WARPS warps splitting K, MIN_BLOCKS CTAs per SM
// (__launch_bounds__), CLUSTER CTAs of a cluster splitting K (sm_90).
// Tag form "n8u1w8b2c4".
//
// With stages > 0 the TMA kernel (skinny_gemm_tma.cu, sm_90): nt n-tiles per
// consumer warp, `warps` consumer warps (plus a producer), a ring of
// `stages` boxes of W, CLUSTER CTAs splitting K, `early` of them issued
// before the wait for the previous kernel; tag form "n4w4s10c1" or "n4w4s11c1e2".
struct SkinnyConfig {
  int nt = 8, u = 1, warps = 8, min_blocks = 2, cluster = 1;
  int pipe = 0;  // 1: the next chunk's loads before this chunk's MMAs (tag suffix "p1"); 2: the same as a ping-pong (kernel comment)
  int gate = 0;  // 1: A read as silu(a) * a2 (GemmArgs::a_mul; tag suffix "g1"): not a tuning choice
  int stages = 0;  // > 0: the TMA kernel
  int early = 0;   // the TMA kernel: W stages issued before griddepcontrol.wait (tag suffix "e2"; 0 or absent: all)
  bool pair = false;   // the TMA kernel: two GEMMs of one A in one launch (tag suffix "x2"; try_run_pair)
  bool gated_pair = false;  // with pair: silu(one) * other, one output (tag suffix "xg"; try_run_gated_pair)
  bool trigger_start = false;  // the TMA kernel: the next kernel may launch at this one's start (tag suffix "d"; OPFUSE_SKINNY_TRIGGER=start)
  bool trace = false;  // tag suffix "t": a build that writes each CTA's timeline (diagnosis; set_trace_buffer)
  std::string tag() const;
  static SkinnyConfig parse(const std::string& tag);  // throws std::invalid_argument
  int rows() const { return stages ? 8 * nt * warps : 8 * nt; }  // BN
  int cta_rows() const { return gated_pair ? rows() / 2 : rows(); }  // rows of each weight a CTA streams
  int threads() const { return stages ? (warps + 1) * 32 : warps * 32; }
  int dynamic_smem() const;  // the TMA kernel's ring, partials and barriers; 0 for the register kernel
  bool operator==(const SkinnyConfig&) const = default;
};

// The TMA kernel's config for a problem (the default on sm_90 but for the
// gated form; OPFUSE_SKINNY_TMA=0 turns it off): BN rows so that one wave of at most
// `sms` CTAs covers N, a cluster splitting K when BN would fall below 64
// rows, as many stages as ~200 KB of shared memory holds (at most 12).
SkinnyConfig choose_tma_config(int64_t m, int64_t n, int64_t k, int sms);

// The default config for a problem on a GPU of `sms` SMs of sm_<arch> (gate 0).
SkinnyConfig choose_config(int64_t m, int64_t n, int64_t k, int arch, int sms);
// Every config choose_config can return on sm_<arch>, and the rivals still
// to be measured against them (the instantiations CI compiles).
std::vector<SkinnyConfig> candidate_configs(int arch);

// The CUDA source of one instantiation: the embedded kernel and its entry line.
std::string source(DType dtype, const SkinnyConfig& c);
inline constexpr const char* kEntryName = "opfuse_skinny_gemm";

using Compiled = CachedCubin;  // cubin, NVRTC log, cache_hit
// Compiles for sm_<arch> with NVRTC (no GPU needed), through the disk cache
// unless use_cache is false. Throws with NVRTC's log on failure.
Compiled compile(DType dtype, const SkinnyConfig& c, int arch, bool use_cache = true);

// Empty when the kernel covers the GEMM (shapes, dtype, layouts, alignment,
// epilogue), else why not. Does not look at OPFUSE_SKINNY_GEMM.
std::string unsupported_reason(const GemmArgs& g);
bool enabled();      // OPFUSE_SKINNY_GEMM is not "0"
bool mode_all();     // OPFUSE_SKINNY_GEMM is "1": every shape, pairs included
bool pdl_enabled();  // OPFUSE_SKINNY_PDL is not "0": programmatic dependent launch on sm_90
// Whether try_run would take this GEMM on the current context's device
// (OPFUSE_SKINNY_GEMM, the kernel's limits and, by default, default_takes).
bool takes(const GemmArgs& g);
// The shapes the kernel takes without OPFUSE_SKINNY_GEMM (measured faster
// than cuBLASLt there).
bool default_takes(int64_t m, int64_t n, int64_t k, int arch, int sms);

// Enqueues the GEMM on g.stream with the skinny kernel and returns true, or
// returns false (nothing enqueued) when it is disabled or does not apply, or
// when its instantiation cannot be built here (the error is kept, see
// last_error()). Throws only when a launch itself fails.
bool try_run(const GemmArgs& g);

// A GEMM pair (Llama's gate and up projections: one A, two weights of one
// shape and row stride at a 16-byte-multiple distance, plain epilogues) in
// one launch of the TMA kernel (sm_90; "x2" configs), each CTA streaming
// rows of one weight: one ramp and one tail for both. Returns false
// (nothing enqueued) where the skinny kernel would not take each GEMM alone
// or the TMA kernel is off (OPFUSE_SKINNY_TMA=0).
bool try_run_pair(const GemmArgs& x, const GemmArgs& y);

// The same pair with Llama's gate as its epilogue: h = silu(x's result) *
// y's result (x_is_gate false: silu of y's), written to h ([M, N], row
// stride N), the two results never written ("xg" configs: each CTA streams
// the same rows of both weights). No activation, bias or residual. Returns
// false (nothing enqueued) where try_run_pair would.
bool try_run_gated_pair(const GemmArgs& x, const GemmArgs& y, void* h, bool x_is_gate);

// The gated pair's config: one wave of CTAs over h's columns (the chooser
// behind try_run_gated_pair).
SkinnyConfig choose_gated_pair_config(int64_t m, int64_t n, int64_t k, int sms, double dram_tbps = 0);

// Diagnosis: the buffer (device memory, 6 words per CTA) that the next
// launches of a trace config ("...t", forced with OPFUSE_SKINNY_CONFIG)
// write their CTAs' %globaltimer stamps to; 0 for none. Read at launch.
void set_trace_buffer(uint64_t* buffer);

// Debug queries: launches so far (process-wide), and the last build error.
uint64_t launch_count();
std::string last_error();
// The config tag of the last launch, or of a launch that threw ("" before the first).
std::string last_config();

}  // namespace opfuse::skinny
