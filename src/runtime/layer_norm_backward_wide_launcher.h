// The wide-row layer_norm backward (src/kernels/layer_norm_backward/
// layer_norm_backward_wide.cu, embedded as a string): dx and the weight and
// bias gradients from one read of dy and x, for rows too long for the
// generated kernels to keep the gradients' column partials on chip
// (n > 8192, up to 65536 16-bit or 32768 float32 columns), on sm_90.
//
// NVRTC compiles one instantiation per (dtype, config, arch), cached on disk
// (OPFUSE_CACHE_DIR/layer_norm_backward_wide) and loaded once per CUDA
// context. The caller (python/opfuse/ops/layer_norm_wide.py) asks parts()
// for the workspace size, allocates it from PyTorch's allocator and calls
// run(): two launches (the row kernel, then one column kernel for both gradients),
// nothing allocated, no synchronisation (CUDA-graph safe once loaded).
// OPFUSE_LNBWD_WIDE=0 turns the path off; OPFUSE_LNBWD_WIDE_CONFIG=<tag>
// forces a config (benchmarking).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "ir/dtype.h"
#include "runtime/nvrtc_cached.h"

namespace opfuse::lnbwd_wide {

// Mirror of opfuse_lnbwd::LnBwdParams (only append fields, in both places).
struct LnBwdParams {
  const void* dy;
  int64_t ld_dy;
  const void* x;
  int64_t ld_x;
  const float* mean;
  const float* rstd;
  const void* w;
  void* dx;
  int64_t ld_dx;
  float* part_dw;
  float* part_db;
  int32_t rows, n;
};
static_assert(sizeof(LnBwdParams) == 96, "LnBwdParams layout is the kernel's launch ABI");

// THREADS a CTA, a cluster of C CTAs a row, R rows a cluster barrier, NV
// 16-byte vectors a thread, MIN_BLOCKS CTAs an SM, and STAGES slots of the
// shared-memory ring that loads batches ahead (0: the batch's rows in
// registers, loaded after the previous batch), with PIPELINED the split
// cluster barrier (the next batch's first pass between its arrive and its
// wait). Tag form "t512c8r2v1b2s3p" ("s0" may be left out, "p" is the
// pipelined variant). GROUP > 0 is the lane-group kernel for short rows
// instead: GROUP lanes a row, THREADS / GROUP rows side by side in a CTA, no
// cluster; tag form "t256g32r2v1b4".
struct Config {
  int threads = 512, cluster = 8, rows = 2, nv = 1, min_blocks = 2, stages = 0;
  bool pipelined = false;
  int group = 0;
  std::string tag() const;
  static Config parse(const std::string& tag);  // throws std::invalid_argument
  int64_t columns(DType t) const;                // the most columns it covers
  int dynamic_smem() const;                      // bytes of the ring
  bool operator==(const Config&) const = default;
};

int vec_of(DType t);  // elements a 16-byte vector: 8 (16-bit) or 4 (float32)
// The config for n columns (0 clusters when no config covers n).
Config choose_config(DType t, int64_t n);
// Every config choose_config returns for dtype t (the instantiations CI compiles).
std::vector<Config> candidate_configs(DType t);

std::string source(DType t, const Config& c);
inline constexpr const char* kEntryName = "opfuse_lnbwd_wide";
inline constexpr const char* kFinishName = "opfuse_lnbwd_finish";

// Compiles for sm_<arch> (>= 90) with NVRTC (no GPU needed), through the disk
// cache unless use_cache is false. Throws with NVRTC's log on failure.
CachedCubin compile(DType t, const Config& c, int arch, bool use_cache = true);

struct Args {
  DType dtype = DType::BFloat16;
  int64_t rows = 0, n = 0;
  const void* dy = nullptr;
  int64_t ld_dy = 0;
  const void* x = nullptr;
  int64_t ld_x = 0;
  const float* mean = nullptr;
  const float* rstd = nullptr;
  const void* w = nullptr;  // or null
  void* dx = nullptr;       // or null
  int64_t ld_dx = 0;
  void* dw = nullptr;  // [n] of dtype, or null
  void* db = nullptr;  // [n] of dtype, or null
  float* workspace = nullptr;  // 2 * parts * n floats (parts())
  int64_t workspace_floats = 0;
  void* stream = nullptr;
};

// Empty when the kernel covers the problem (dtype, sizes, alignment), else
// why not. Does not look at the device or OPFUSE_LNBWD_WIDE.
std::string unsupported_reason(const Args& a);
bool enabled();  // OPFUSE_LNBWD_WIDE is not "0"

// The parts (resident clusters) run() will use on the current context's
// device, loading the instantiation; 0 when the path is off, the device is
// older than sm_90, or the instantiation cannot be built (last_error()).
int64_t parts(DType t, int64_t rows, int64_t n);
// Enqueues the kernels on a.stream. Throws on a problem unsupported_reason
// refuses, a too small workspace, or a failed launch.
void run(const Args& a);

uint64_t launch_count();
std::string last_error();

}  // namespace opfuse::lnbwd_wide
