// The decode MLP kernel (src/kernels/decode_mlp/decode_mlp.cu, embedded as
// a string): a whole MLP block at M <= 16 in one persistent kernel,
//   out = act(x @ w1^T + b1) @ w2^T + b2          (act: none, relu, gelu_tanh)
//   out = (silu(x @ w1^T) * (x @ w3^T)) @ w2^T + b2  ("silu_gate", Llama)
// with weights in nn.Linear's [rows, K] layout. Sm_90 only (bulk copies,
// mbarriers with transaction counts).
//
// NVRTC compiles one instantiation per (dtype, gated, config, arch), cached
// on disk (OPFUSE_CACHE_DIR/decode_mlp) and loaded once per CUDA context.
// The device workspace (h, the split tiles' partials, tile counters and a
// grid barrier that the kernel leaves at zero) is the caller's: the Python
// runtime keeps one zeroed block of kWorkspaceBytes per (device, stream)
// from PyTorch's caching allocator, so launches on two streams never share
// counters, and launches sharing one run in stream order. The launch
// itself allocates nothing and never synchronizes (CUDA-graph safe once
// the instantiation is loaded).
//
// Environment: OPFUSE_DECODE_MLP=1 lets CUDA graphs plan this kernel (the
// planner's pass, src/fusion/decode_mlp.cpp); it is opt-in because it was
// slower than the cuBLASLt chain on the H200 (docs/perf-notes.md).
// OPFUSE_DECODE_MLP_CONFIG=<tag> forces a config, OPFUSE_DECODE_MLP_PREFETCH=<n>
// an L2 prefetch depth (benchmarking), OPFUSE_DECODE_MLP_COOPERATIVE=0 a
// plain launch instead of a cooperative one.
#pragma once
#include "runtime/nvrtc_cached.h"
#include <cstdint>
#include <string>
#include <vector>

#include "ir/dtype.h"

namespace opfuse::decode_mlp {

inline constexpr int64_t kMaxM = 16;
// The workspace a caller provides (zeroed before its first launch, then
// left zeroed by every launch): counters (256 KiB), the split tiles'
// float32 partials (4.3 MB at 132 CTAs of 128 rows) and h (32 bytes per
// hidden unit). A problem whose layout needs more is refused.
inline constexpr size_t kWorkspaceBytes = size_t(16) << 20;

// Mirror of opfuse_decode::DecodeMlpParams (only append fields, in both places).
struct DecodeMlpParams {
  const void* x;
  int64_t ldx;
  const void* w1;
  int64_t ldw1;
  const void* w3;
  int64_t ldw3;
  const void* b1;
  int64_t b1_stride;
  const void* w2;
  int64_t ldw2;
  const void* b2;
  int64_t b2_stride;
  void* out;
  int64_t ldo;
  void* h;
  int64_t ldh;
  float* partials;
  uint32_t* counters;
  uint32_t* barrier;
  int32_t m, k, hdim, n;
  int32_t act;
  int32_t prefetch;
};
static_assert(sizeof(DecodeMlpParams) == 176, "DecodeMlpParams layout is the kernel's launch ABI");

// One problem, element strides; weights [rows, K] with K unit-stride.
struct Args {
  DType dtype = DType::BFloat16;
  int64_t m = 0, k = 0, h = 0, n = 0;
  const void* x = nullptr;  // [m, k]
  int64_t ldx = 0;
  const void* w1 = nullptr;  // [h, k]
  int64_t ldw1 = 0;
  const void* w3 = nullptr;  // [h, k], silu_gate only
  int64_t ldw3 = 0;
  const void* b1 = nullptr;  // [h] or null (not with silu_gate)
  int64_t b1_stride = 1;
  const void* w2 = nullptr;  // [n, h]
  int64_t ldw2 = 0;
  const void* b2 = nullptr;  // [n] or null
  int64_t b2_stride = 1;
  void* out = nullptr;  // [m, n]
  int64_t ldo = 0;
  std::string activation;  // "", "relu", "gelu_tanh", "silu_gate"
  void* stream = nullptr;
  // Zeroed before its first use, never used by two streams at once
  // (kWorkspaceBytes; 256-byte aligned).
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// BN weight rows and KS values of k per ring stage, STAGES stages, KG
// groups of consumer warps splitting each stage's k; `tensor`: each stage
// arrives as tensor-map boxes instead of one bulk copy per row. Tag form
// "b64k256s4g1", "t" appended for tensor (the g part may be left out: 1),
// then "n" for no_mma: a diagnostic build whose consumers release each stage
// unread (wrong results; it times the copies, barriers and tile ends alone).
struct Config {
  int bn = 32, ks = 1024, stages = 2, kg = 4;  // the fields' defaults; the launcher's default is default_config()
  bool tensor = false;
  bool no_mma = false;
  std::string tag() const;
  static Config parse(const std::string& tag);  // throws std::invalid_argument
  bool operator==(const Config&) const = default;
  int threads() const { return (bn / 16 * kg + 1) * 32; }
};
// The config launches use unless OPFUSE_DECODE_MLP_CONFIG names one
// (decode_mlp_launcher.cpp says why).
Config default_config();
// Dynamic shared memory of a config (the kernel's Layout<>::kBytes).
int smem_bytes(const Config& c);
// Every config tested and benchmarked (the instantiations CI compiles).
std::vector<Config> candidate_configs();

std::string source(DType dtype, bool gated, const Config& c);
inline constexpr const char* kEntryName = "opfuse_decode_mlp";

using Compiled = CachedCubin;  // cubin, NVRTC log, cache_hit
// Compiles for sm_<arch> (>= 90) with NVRTC (no GPU needed), through the
// disk cache unless use_cache is false. Throws with NVRTC's log on failure.
Compiled compile(DType dtype, bool gated, const Config& c, int arch, bool use_cache = true);

// Empty when the kernel covers the problem (sizes, dtype, layouts,
// alignment, activation), else why not. Does not look at the device.
std::string unsupported_reason(const Args& a);
// Whether CUDA graphs plan decode MLP calls: OPFUSE_DECODE_MLP=1 (also
// without a GPU: plan tests). Where the device is not sm_90 the call then
// refuses at run time and the partition falls back (GemmUnsupported).
bool planning_enabled();

// Enqueues the block on a.stream and returns true; or returns false with
// *why (nothing enqueued) when the problem is unsupported, the device is not
// sm_90, the instantiation cannot be built or loaded, the grid cannot be
// co-resident, or the workspace is missing or too small. Throws only when
// a launch itself fails.
bool try_run(const Args& a, std::string* why = nullptr);

// Debug queries: launches so far (process-wide), the last failure reason.
uint64_t launch_count();
std::string last_error();

}  // namespace opfuse::decode_mlp
