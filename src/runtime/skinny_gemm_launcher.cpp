#include "runtime/skinny_gemm_launcher.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <regex>
#include <stdexcept>
#include <tuple>

#include "runtime/cuda_api.h"
#include "runtime/nvrtc_cached.h"
#include "runtime/small_m_launch.h"

#include "skinny_gemm_cu.inc"      // static const char skinny_gemm_cu[]
#include "skinny_gemm_tma_cu.inc"  // static const char skinny_gemm_tma_cu[]
#include "tma_ptx_cu.inc"          // static const char tma_ptx_cu[]

namespace opfuse::skinny {
namespace {

std::atomic<uint64_t> g_launches{0};
std::atomic<uint64_t*> g_trace{nullptr};  // set_trace_buffer
std::mutex g_mu;  // the maps below, g_error and g_last_launch
std::string g_error;
// The config of the last launch (skinny_gemm.last_config(): tests, benchmarks); nt 0: none yet.
SkinnyConfig g_last_launch{0, 0, 0, 0, 0};

const char* elem_name(DType t) { return small_m_elem_name(t, "skinny GEMM"); }

struct LoadedFn {
  CUmodule module = nullptr;
  CUfunction fn = nullptr;
  bool failed = false;  // could not be built or loaded here: cuBLASLt runs instead
};

// CUtensorMap, as skinny_gemm_tma.cu's TmaMap: 128 bytes, 64-byte aligned.
struct alignas(64) TmaMap {
  unsigned char bytes[128];
};

// cuTensorMapEncodeTiled's enums (cuda.h): bf16 9, f16 6; no interleave;
// 128-byte swizzle (the kernel's ldmatrix reads undo it); zeros outside the
// tensor. L2 promotion (none 0, 64 B 1, 128 B 2, 256 B 3): 128 bytes, or
// OPFUSE_SKINNY_TMA_L2_PROMO (benchmarking). Measured on the H200 at M = 16
// (docs/perf-notes.md, "H200, session 17"): 256 bytes was 0.5-1.5 us a call
// slower than 128 bytes or none on every benchmark GEMM; 128 bytes and none
// are within 0.4 us of each other, 128 bytes ahead on the up projections.
constexpr int kTmaBf16 = 9, kTmaF16 = 6, kTmaInterleaveNone = 0, kTmaSwizzle128B = 3, kTmaL2Promo128B = 2,
              kTmaOobZero = 0;
int tma_l2_promotion() {
  const char* e = std::getenv("OPFUSE_SKINNY_TMA_L2_PROMO");
  if (e && e[0] >= '0' && e[0] <= '3' && e[1] == 0) return e[0] - '0';
  return kTmaL2Promo128B;
}
constexpr int kAttrMaxDynamicSharedBytes = 8;  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES

// The map of a [rows, k] k-contiguous matrix (row stride ld elements; one
// row: any), boxes of [box_rows, 64]; with pair_bytes > 0 a 3-D map [2,
// rows, k] whose second matrix lies pair_bytes after the first (a GEMM
// pair's two weights), boxes [1, box_rows, 64]. Kept per (pointer, sizes,
// strides, box, dtype, L2 promotion), which is all a map encodes, so a hit
// is the same map (weights are the same tensors call after call). Guarded by g_mu.
// box_both: the gated pair's boxes [2, box_rows, 64], the same rows of both.
const TmaMap& tma_map(DType dt, const void* ptr, int64_t rows, int64_t k, int64_t ld, int box_rows,
                      int64_t pair_bytes = 0, bool box_both = false) {
  static std::map<std::tuple<const void*, int64_t, int64_t, int64_t, int, bool, int, int, int64_t>, TmaMap> maps;
  const int dtype = dt == DType::BFloat16 ? kTmaBf16 : kTmaF16, promo = tma_l2_promotion();
  const auto key = std::make_tuple(ptr, rows, k, ld, box_rows, box_both, dtype, promo, pair_bytes);
  auto it = maps.find(key);
  if (it != maps.end()) return it->second;
  const CudaApi& c = cuda();
  if (!c.TensorMapEncodeTiled) throw std::runtime_error("the CUDA driver has no cuTensorMapEncodeTiled");
  if (maps.size() >= 256) maps.clear();  // activations come and go; bounded
  TmaMap m{};
  const uint64_t dims[3] = {static_cast<uint64_t>(k), static_cast<uint64_t>(rows), 2};
  const uint64_t strides[2] = {static_cast<uint64_t>(rows > 1 ? ld : k) * 2, static_cast<uint64_t>(pair_bytes)};
  const uint32_t box[3] = {64, static_cast<uint32_t>(box_rows), box_both ? 2u : 1u};
  const uint32_t estr[3] = {1, 1, 1};
  const unsigned rank = pair_bytes > 0 ? 3 : 2;
  check_cuda(c.TensorMapEncodeTiled(m.bytes, dtype, rank, const_cast<void*>(ptr), dims, strides, box, estr,
                                    kTmaInterleaveNone, kTmaSwizzle128B, promo, kTmaOobZero),
             "cuTensorMapEncodeTiled(skinny GEMM)");
  return maps.emplace(key, m).first->second;
}

// The TMA kernel is the default on sm_90 (OPFUSE_SKINNY_TMA=0: the register
// kernel's configs). H200, M = 16, us per call (the suite's timer) against
// the register kernel's default (docs/perf-notes.md, "H200, session 17"):
// 4096->16384 36.4 / 38.1, 16384->4096 37.5 / 38.7, 4096->11008 27.0 / 29.1,
// 11008->4096 27.6 / 28.0; back to back 32.3 / 35.2, 34.4 / 36.1, 23.4 /
// 27.2, 24.0 / 24.2.
bool tma_wanted() {
  const char* e = std::getenv("OPFUSE_SKINNY_TMA");
  return !(e && std::string(e) == "0");
}

}  // namespace

std::string SkinnyConfig::tag() const {
  std::string s = "n" + std::to_string(nt);
  if (stages)
    s += "w" + std::to_string(warps) + "s" + std::to_string(stages) + "c" + std::to_string(cluster) +
         (early && early != stages ? "e" + std::to_string(early) : "") + (gated_pair ? "xg" : pair ? "x2" : "") + (trigger_start ? "d" : "");
  else
    s += "u" + std::to_string(u) + "w" + std::to_string(warps) + "b" + std::to_string(min_blocks) + "c" +
         std::to_string(cluster) + (pipe ? "p" + std::to_string(pipe) : "") + (gate ? "g" + std::to_string(gate) : "");
  return trace ? s + "t" : s;
}

int SkinnyConfig::dynamic_smem() const {
  if (!stages) return 0;
  const int bn = rows();  // skinny_gemm_tma.cu's tma_smem_bytes
  return 1024 + stages * (bn * 128 + 16 * 128) + (cluster > 1 || gated_pair ? bn * 64 : 0) + 16 * stages;
}

SkinnyConfig SkinnyConfig::parse(const std::string& tag_in) {
  // A trailing "t": the same config built with its CTAs' timeline (diagnosis).
  const bool traced = !tag_in.empty() && tag_in.back() == 't';
  const std::string tag = traced ? tag_in.substr(0, tag_in.size() - 1) : tag_in;
  static const std::regex tma(R"(n(\d+)w(\d+)s(\d+)c(\d+)(?:e(\d+))?(x2|xg)?(d)?)");
  std::smatch t;
  if (std::regex_match(tag, t, tma)) {
    SkinnyConfig c;
    c.nt = std::stoi(t[1]);
    c.warps = std::stoi(t[2]);
    c.stages = std::stoi(t[3]);
    c.cluster = std::stoi(t[4]);
    c.early = t[5].matched ? std::stoi(t[5]) : 0;
    c.pair = t[6].matched;
    c.gated_pair = t[6].matched && t[6] == "xg";
    c.trigger_start = t[7].matched;
    c.u = 1;
    c.min_blocks = 1;
    const bool ok = c.nt >= 1 && c.nt <= 16 && c.warps >= 1 && c.warps <= 8 && c.rows() <= 256 && c.stages >= 2 &&
                    c.stages <= 32 && (c.cluster == 1 || c.cluster == 2 || c.cluster == 4 || c.cluster == 8) &&
                    c.dynamic_smem() <= 227 * 1024 && c.early >= 0 && c.early <= c.stages &&
                    (!c.gated_pair || c.cluster == 1);
    if (c.early == c.stages) c.early = 0;  // one spelling per config
    if (!ok) throw std::invalid_argument("skinny GEMM config '" + tag + "' is out of range");
    c.trace = traced;
    return c;
  }
  static const std::regex re(R"(n(\d+)u(\d+)w(\d+)b(\d+)c(\d+)(?:p(\d+))?(?:g(\d+))?)");
  std::smatch m;
  if (!std::regex_match(tag, m, re))
    throw std::invalid_argument("bad skinny GEMM config '" + tag + "' (want e.g. n8u1w8b2c1, n4u1w8b3c2p1 or n4w4s10c1)");
  SkinnyConfig c{std::stoi(m[1]), std::stoi(m[2]), std::stoi(m[3]), std::stoi(m[4]), std::stoi(m[5]),
                 m[6].matched ? std::stoi(m[6]) : 0, m[7].matched ? std::stoi(m[7]) : 0};
  bool ok = c.nt >= 1 && (c.nt <= 8 || c.nt % 8 == 0) && c.nt <= 16 && c.u >= 1 && c.u <= 4 && c.warps >= 1 &&
            c.warps <= 16 && c.min_blocks >= 1 && c.min_blocks <= 4 &&
            (c.cluster == 1 || c.cluster == 2 || c.cluster == 4 || c.cluster == 8) && c.pipe >= 0 && c.pipe <= 2 &&
            (c.gate == 0 || c.gate == 1);
  if (!ok) throw std::invalid_argument("skinny GEMM config '" + tag + "' is out of range");
  c.trace = traced;
  return c;
}

// One wave of CTAs: the kernel is bound by HBM, so every CTA should be
// resident from the start (no tail wave), and there should be enough of them
// to put every SM to work. On sm_90, when N / 64 tiles are too few (N = 4096
// on 132 SMs), a cluster splits K over 2 to 8 CTAs per tile, one pipelined
// 256-thread CTA an SM (n8u1w8b1c2p1 for N = 4096); elsewhere narrower tiles
// (32 rows) serve the same end. H200, bench/results/h200/skinny-pipe-569bf43.txt,
// us: 16x16384->4096 n8u1w8b1c2p1 36.8, the old n8u1w8b2c2 39.9, cuBLASLt
// 40.5; 16x11008->4096 26.0 / 29.2 / 29.6. A cluster of 2 with 256 CTAs of
// 8 warps (n8u1w8b2c4 before 9a63bb0) had run 16x16384->4096 in 47.8.
SkinnyConfig choose_config(int64_t m, int64_t n, int64_t k, int arch, int sms) {
  (void)m;
  SkinnyConfig c;  // n8u1w8b2c1: 128 registers, 64 KB of loads in flight per SM
  const int64_t tiles = (n + c.rows() - 1) / c.rows();
  const int64_t chunks = (k / 8 + 4 * c.u - 1) / (4 * c.u);
  if (arch >= 90) {
    // Double the cluster while there stays at most one CTA per SM and each
    // warp keeps >= 2 chunks. A cluster's CTAs then run pipelined, one an
    // SM (measured); without one (N = 16384: 256 CTAs; or K too short to
    // split) the two-CTA config stays (the pipelined n8u1w8b2c1p1 ran
    // within 1% of it at N = 16384).
    while (c.cluster < 8 && tiles * c.cluster * 2 <= sms && chunks >= 2LL * c.cluster * 2 * c.warps) c.cluster *= 2;
    if (c.cluster > 1) {
      c.min_blocks = 1;
      c.pipe = 1;
    }
    return c;
  }
  if (tiles < sms) c = SkinnyConfig{4, 2, 8, 1, 1};
  return c;
}

SkinnyConfig choose_tma_config(int64_t m, int64_t n, int64_t k, int sms) {
  (void)m;
  const int64_t tiles8 = (n + 7) / 8, chunks = (k + 63) / 64;
  SkinnyConfig c;
  c.u = 1;
  c.min_blocks = 1;
  for (c.cluster = 1;; c.cluster *= 2) {
    // 8-row tiles a CTA, a multiple of 4: four consumer warps (one warp of
    // 11 tiles, n11w1s12c1, ran 16x4096->11008 in 54.9 us against 29.7 for
    // n4w4s11c1: a lone consumer cannot keep up with the ring).
    const int64_t per = std::min<int64_t>(32, ((tiles8 * c.cluster + sms - 1) / sms + 3) / 4 * 4);
    // Enough rows that A's box (16 rows) stays a small part of a stage, and
    // enough chunks per CTA to fill the ring.
    if (per >= 8 || c.cluster == 8 || chunks / (2 * c.cluster) < 8) {
      c.warps = 4;
      c.nt = static_cast<int>(per / 4);
      break;
    }
  }
  c.stages = std::min(12, (200 * 1024) / (8 * c.nt * c.warps * 128 + 16 * 128));  // a stage: BN rows of W and A's 16
  return c;
}

// The gated pair: H = BN / 2 columns of h a CTA (H rows of each weight), H
// the least multiple of 4 that covers N in one wave of `sms` CTAs, with BN / 8
// tiles shared by 4 or 3 consumer warps (H grows by 4 until one divides);
// as many stages as fit beside the partial tile. Why one full wave: on the
// H200 the 16x4096->22016 GEMM took 46.0 us back to back with 131 CTAs of
// 168 rows (n7w3s8c1) against 47.7 with 115 of 192 (n6w4s7c1)
// (docs/perf-notes.md, "H200, session 18"). N = 11008 on 132 SMs: H = 84,
// n7w3s8c1xg, 132 CTAs.
// Stages: as many as fit, at most 12, and at most 1.7 per TB/s of the
// device's peak DRAM bandwidth (dram_tbps; 0: no such cap). Bytes in flight
// need only cover bandwidth x latency, and past that more stages cost: on
// two H100s (3.35 TB/s) the Llama block at M = 16 took 102.2 and 106.1 us
// with n7w3s8c1xg against 98.6 and 102.3 with s6, s9 and s7 slower, s5 and
// s4 no faster (bench/results/h100/session36-{sweep-1dc8fcb,stages-29469e7}).
// The H200 (4.8 TB/s: 8.2) keeps its measured s8.
SkinnyConfig choose_gated_pair_config(int64_t m, int64_t n, int64_t k, int sms, double dram_tbps) {
  (void)m;
  (void)k;
  SkinnyConfig c;
  c.u = 1;
  c.min_blocks = 1;
  c.cluster = 1;
  c.pair = c.gated_pair = true;
  int64_t h = std::min<int64_t>(128, ((n + sms - 1) / sms + 3) / 4 * 4);
  for (;; h += 4) {
    const int64_t tiles = h / 4;  // BN / 8 = 2H / 8
    if (h >= 128 || tiles % 4 == 0) {
      c.warps = 4;
      c.nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(tiles, 32) / 4));
      break;
    }
    if (tiles % 3 == 0) {
      c.warps = 3;
      c.nt = static_cast<int>(tiles / 3);
      break;
    }
  }
  const int bn = 8 * c.nt * c.warps;  // rows(), which needs stages set
  c.stages = std::min(12, (200 * 1024 - bn * 64) / (bn * 128 + 16 * 128));
  if (dram_tbps > 0) c.stages = std::max(std::min(c.stages, 4), std::min(c.stages, static_cast<int>(std::lround(1.7 * dram_tbps))));
  return c;
}

// Without OPFUSE_SKINNY_GEMM: the box of shapes measured on the H200 (sm_90,
// N and K of 4096 to 16384), where the kernel is faster than cuBLASLt's
// timed choice alone or as fast, and faster in a chain, whose next skinny
// kernel starts early (programmatic dependent launch). bench/results/h200/
// skinny-default-ec1839a.txt and session14-sixth-8d40c0a.txt, us, kernel /
// cuBLASLt: 16x16384->4096 37.0 / 41.0, 16x11008->4096 26.1 / 30.0,
// 16x4096->16384 36.6 / 36.3, 16x4096->11008 26.7 / 27.0; the MLP block at
// M = 16, both GEMMs here, 70.1 and 71.6 against cuBLASLt's 75.1 and 75.2.
// Outside the box (a vocabulary projection's N, short K) cuBLASLt stays.
// Pairs (Llama's gate and up projections) stay pairs: in the box one TMA
// launch (try_run_pair), elsewhere cuBLASLt's batched call unless mode_all().
static bool in_default_box(int64_t n, int64_t k) { return n >= 4096 && n <= 16384 && k >= 4096 && k <= 16384; }

bool default_takes(int64_t m, int64_t n, int64_t k, int arch, int sms) {
  (void)m;
  (void)sms;
  return arch >= 90 && in_default_box(n, k);
}

std::vector<SkinnyConfig> candidate_configs(int arch) {
  std::vector<SkinnyConfig> r{SkinnyConfig{}};
  if (arch >= 90)
    for (int cl : {2, 4, 8}) {
      r.push_back(SkinnyConfig{8, 1, 8, 2, cl});
      r.push_back(SkinnyConfig{8, 1, 8, 1, cl, 1});
      r.push_back(SkinnyConfig{8, 1, 8, 1, cl, 2});  // not chosen yet: p1's rival, to be measured
    }
  if (arch >= 90) {  // not chosen yet: 128-row tiles, 128 KB of loads in flight an SM, in order in SASS
    for (int cl : {1, 2, 4}) r.push_back(SkinnyConfig{16, 1, 8, 1, cl, 1});
    // The TMA kernel (the default on sm_90) at the benchmark shapes on 132 SMs, and rivals.
    for (const char* t : {"n4w4s11c1", "n4w4s11c4", "n3w4s12c1", "n4w4s8c1", "n2w4s12c2", "n4w4s11c1e2", "n6w4s7c1x2",
                          "n2w4s12c2x2", "n7w3s8c1", "n7w3s8c1xg", "n8w4s5c1xg", "n2w4s12c1xg"})
      r.push_back(SkinnyConfig::parse(t));
  } else
    r.push_back(SkinnyConfig{4, 2, 8, 1, 1});
  return r;
}

std::string source(DType dtype, const SkinnyConfig& c) {
  std::string s = c.trace ? "#define OPFUSE_SKINNY_TRACE 1\n" : "";
  if (c.stages && c.trigger_start) s += "#define OPFUSE_SKINNY_TRIGGER_START 1\n";
  if (c.stages) s += tma_ptx_cu;
  s += skinny_gemm_cu;
  if (c.stages) {
    s += skinny_gemm_tma_cu;
    const std::string args = std::string(kEntryName) + ", " + elem_name(dtype) + ", " + std::to_string(c.nt) + ", " +
                             std::to_string(c.warps) + ", " + std::to_string(c.stages) + ", " +
                             std::to_string(c.early ? c.early : c.stages);
    const std::string kind = c.gated_pair ? "OPFUSE_SKINNY_TMA_GATED_PAIR_" : c.pair ? "OPFUSE_SKINNY_TMA_PAIR_" : "OPFUSE_SKINNY_TMA_";
    if (c.cluster > 1) s += "\n" + kind + "CLUSTER_ENTRY(" + args + ", " + std::to_string(c.cluster) + ")\n";
    else s += "\n" + kind + "ENTRY(" + args + ")\n";
    return s;
  }
  std::string args = std::string(kEntryName) + ", " + elem_name(dtype) + ", " + std::to_string(c.nt) + ", " +
                     std::to_string(c.u) + ", " + std::to_string(c.warps) + ", " + std::to_string(c.min_blocks) + ", " +
                     std::to_string(c.pipe) + ", " + std::to_string(c.gate);
  if (c.cluster > 1) s += "\nOPFUSE_SKINNY_CLUSTER_ENTRY(" + args + ", " + std::to_string(c.cluster) + ")\n";
  else s += "\nOPFUSE_SKINNY_ENTRY(" + args + ")\n";
  return s;
}

Compiled compile(DType dtype, const SkinnyConfig& c, int arch, bool use_cache) {
  if (c.cluster > 1 && arch < 90) throw std::invalid_argument("skinny GEMM: clusters need sm_90 or newer");
  if (c.stages && arch < 90) throw std::invalid_argument("skinny GEMM: the TMA kernel needs sm_90 or newer");
  const std::string src = source(dtype, c);
  return nvrtc_cubin_cached(src, "skinny_gemm.cu", arch, "skinny_gemm", "skinny GEMM", use_cache);
}

std::string unsupported_reason(const GemmArgs& g) {
  if (g.dtype != DType::BFloat16 && g.dtype != DType::Float16) return std::string("dtype ") + dtype_name(g.dtype);
  if (g.batch != 1) return "batched";
  if (g.m < 1 || g.m > kMaxM) return "m = " + std::to_string(g.m) + " is not in 1..16";
  if (g.n < 1 || g.k < 1 || g.n >= (int64_t(1) << 31) || g.k >= (int64_t(1) << 31)) return "n or k out of range";
  if (g.k % 8 != 0) return "k is not a multiple of 8";
  if (g.bias_grad) return "bias gradient";
  if (g.float32_bias) return "a float32 bias";
  if (small_m_act_code(g.activation) < 0) return "activation " + g.activation;
  // A [m, k] with k unit-stride; B [k, n] = W^T with k unit-stride (W[n, k] at b.ptr + n * col_stride + k).
  if (g.a.col_stride != 1) return "a is not k-contiguous";
  if (g.m > 1 && g.a.row_stride % 8 != 0) return "a's row stride is not a multiple of 8";
  if (g.b.row_stride != 1) return "b is not k-contiguous (not an nn.Linear weight)";
  if (g.n > 1 && g.b.col_stride % 8 != 0) return "b's row stride is not a multiple of 8";
  if (!aligned16(g.a.ptr) || !aligned16(g.b.ptr)) return "a or b not 16-byte aligned";
  // The kernel keeps W's rows as 32-bit byte offsets within a tile (at most 128 rows of any config).
  if (g.n > 1 && g.b.col_stride * 2 * 128 >= (int64_t(1) << 31)) return "b's row stride is too large";
  if (g.residual.ptr && g.n > 1 && g.residual.col_stride != 1) return "the residual is not n-contiguous";
  if (!g.d) return "no output";
  if (g.a_mul.ptr) {  // silu(a) * a_mul: read like a
    if (g.a_mul.col_stride != 1) return "a_mul is not k-contiguous";
    if (g.m > 1 && g.a_mul.row_stride % 8 != 0) return "a_mul's row stride is not a multiple of 8";
    if (!aligned16(g.a_mul.ptr)) return "a_mul not 16-byte aligned";
  }
  return {};
}

// OPFUSE_SKINNY_GEMM: "1" every GEMM the kernel supports, "0" none, unset
// the shapes of default_takes (elsewhere it was slower than cuBLASLt's timed
// choice on the H200: scripts/bench_skinny_gemm.py, docs/perf-notes.md).
namespace {
enum class Mode { kOff, kDefault, kAll };
Mode mode() {
  const char* e = std::getenv("OPFUSE_SKINNY_GEMM");
  if (e && std::string(e) == "1") return Mode::kAll;
  if (e && std::string(e) == "0") return Mode::kOff;
  return Mode::kDefault;
}

std::map<CUcontext, SmallMDevice>& devices() {  // guarded by g_mu
  static std::map<CUcontext, SmallMDevice> d;
  return d;
}

// The current context's device (0 arch: none), asked of the driver once a context.
bool current_device(CUcontext* ctx, SmallMDevice* info) {
  const CudaApi& c = cuda();
  if (!c.loaded || c.CtxGetCurrent(ctx) != 0 || !*ctx) return false;
  SmallMDevice& d = devices()[*ctx];
  if (d.arch == 0) d = small_m_current_device();
  *info = d;
  return d.arch >= 80;  // mma.sync bf16 and cvt.rn.bf16 need sm_80
}

bool mode_takes(Mode md, const GemmArgs& g, const SmallMDevice& info) {
  return md == Mode::kAll || (md == Mode::kDefault && default_takes(g.m, g.n, g.k, info.arch, info.sms));
}

// What rules a GEMM out from its sizes alone, before unsupported_reason
// builds its answer: every CUDA GEMM step asks try_run, and by default
// (the skinny path on) most of them are larger than M = 16.
bool ruled_out(Mode md, const GemmArgs& g) {
  return md == Mode::kOff || g.m > kMaxM || (md == Mode::kDefault && !in_default_box(g.n, g.k)) ||
         !unsupported_reason(g).empty();
}
}  // namespace

bool enabled() { return mode() != Mode::kOff; }
bool mode_all() { return mode() == Mode::kAll; }

// OPFUSE_SKINNY_CONFIG: a tag forces every skinny GEMM's config; entries
// "tag@N" separated by commas force only the GEMMs of N output columns (a
// gated pair's N is h's), so one process can measure a block's GEMMs one
// at a time (e.g. "n1w4s32c1@4096": the down projections alone). Empty: none.
static std::string forced_config(int64_t n) {
  const char* e = std::getenv("OPFUSE_SKINNY_CONFIG");
  if (!e || !*e) return {};
  const std::string v(e);
  if (v.find('@') == std::string::npos) return v;
  const std::string width = std::to_string(n);
  size_t at = 0;
  while (at <= v.size()) {
    const size_t end = std::min(v.find(',', at), v.size());
    const std::string entry = v.substr(at, end - at);
    const size_t sep = entry.find('@');
    if (sep != std::string::npos && entry.substr(sep + 1) == width) return entry.substr(0, sep);
    at = end + 1;
  }
  return {};
}

// OPFUSE_SKINNY_TRIGGER=start: the TMA kernel lets the next kernel launch at
// its start ("d" configs), =loop after its main loop; unset: the config's.
static int trigger_env() {
  const char* e = std::getenv("OPFUSE_SKINNY_TRIGGER");
  if (!e) return -1;
  const std::string v(e);
  return v == "start" ? 1 : v == "loop" ? 0 : -1;
}

// Programmatic dependent launch on sm_90 (the kernel's griddepcontrol): it
// may start while the kernel before it in the stream ends, its first W
// chunks prefetched into L2 before it waits for that kernel's results. A
// chain's kernel boundaries cost the skinny kernel there: H200 at ec1839a,
// the MLP block at M = 16 ran 74.9 us with it after cuBLASLt's up
// projection, where the two kernels alone take 36.3 + 37.0 us (and the
// cuBLASLt pair 75.1 against 36.3 + 41.0). OPFUSE_SKINNY_PDL=0 turns it off.
bool pdl_enabled() {
  const char* e = std::getenv("OPFUSE_SKINNY_PDL");
  return !(e && std::string(e) == "0");
}

bool takes(const GemmArgs& g) {
  const Mode md = mode();
  if (ruled_out(md, g)) return false;
  CUcontext ctx = nullptr;
  SmallMDevice info;
  std::lock_guard<std::mutex> lock(g_mu);
  return current_device(&ctx, &info) && mode_takes(md, g, info);
}

// try_run, try_run_pair and try_run_gated_pair: `second` is the pair's
// other GEMM (its weight at pair_bytes > 0 after g's; the same shape, A and
// epilogue) or null; `gated_h` the gated pair's output h = silu(gate) * up
// ([M, N], row stride N), `silu_z` which of the two (0: g) is the gate.
static bool run_impl(const GemmArgs& g, const GemmArgs* second, int64_t pair_bytes, void* gated_h = nullptr,
                     int silu_z = 0) {
  const Mode md = mode();
  if (ruled_out(md, g) || (second && ruled_out(md, *second))) return false;
  const CudaApi& c = cuda();
  if (!c.loaded) return false;
  CUcontext ctx = nullptr;

  // Integers only: this runs on every call.
  static std::map<std::tuple<CUcontext, DType, int, int, int, int, int, int, int, int>, LoadedFn> functions;
  CUfunction fn = nullptr;
  SkinnyConfig cfg;
  TmaMap wmap{}, amap{};  // the TMA kernel's
  bool pdl = false;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    SmallMDevice info;
    if (!current_device(&ctx, &info) || !mode_takes(md, g, info) || (second && !mode_takes(md, *second, info)))
      return false;
    if (second && (info.arch < 90 || g.a_mul.ptr || !tma_wanted())) return false;  // only the TMA kernel pairs
    pdl = info.arch >= 90 && pdl_enabled();
    const std::string forced_tag = forced_config(g.n);
    const char* forced = forced_tag.empty() ? nullptr : forced_tag.c_str();
    cfg = forced && *forced ? SkinnyConfig::parse(forced) : choose_config(g.m, g.n, g.k, info.arch, info.sms);
    // OPFUSE_SKINNY_PIPE=2: the pipelined configs as p2 (the ping-pong
    // ptxas keeps in order; docs/perf-notes.md, "H200, session 15"), to measure.
    const char* pipe = std::getenv("OPFUSE_SKINNY_PIPE");
    if (!(forced && *forced) && cfg.pipe == 1 && pipe && std::string(pipe) == "2") cfg.pipe = 2;
    if (!(forced && *forced) && info.arch >= 90 && !g.a_mul.ptr && tma_wanted())
      cfg = choose_tma_config(g.m, g.n, g.k, info.sms);
    // The TMA kernel has no gated form and needs sm_90.
    if (cfg.stages && (g.a_mul.ptr || info.arch < 90)) cfg = choose_config(g.m, g.n, g.k, info.arch, info.sms);
    if (cfg.cluster > 1 && info.arch < 90) cfg.cluster = 1;
    cfg.gate = g.a_mul.ptr ? 1 : 0;  // the operand decides it, not the tuning
    if (gated_h) {  // one wave over h's columns, each CTA both weights' rows of them
      if (!(forced && *forced && cfg.stages && cfg.cluster == 1)) cfg = choose_gated_pair_config(g.m, g.n, g.k, info.sms, info.dram_tbps);
      cfg.pair = cfg.gated_pair = true;
    } else if (second) {  // one wave over both weights' rows
      if (!(forced && *forced && cfg.stages)) cfg = choose_tma_config(g.m, 2 * g.n, g.k, info.sms);
      cfg.pair = true;
      cfg.gated_pair = false;
    } else {
      cfg.pair = cfg.gated_pair = false;
    }
    if (const int trigger = cfg.stages ? trigger_env() : -1; trigger >= 0) cfg.trigger_start = trigger == 1;
    // A forced config's partial tile, which parse did not count unless it was an "xg" tag.
    if (cfg.gated_pair && cfg.dynamic_smem() > 227 * 1024) cfg = choose_gated_pair_config(g.m, g.n, g.k, info.sms, info.dram_tbps);
    LoadedFn& lf = functions[{ctx, g.dtype, cfg.nt, cfg.u, cfg.warps, cfg.min_blocks, cfg.cluster, cfg.pipe, cfg.gate,
                              (((cfg.stages * 32 + cfg.early) * 2 + (cfg.trace ? 1 : 0)) * 3 +
                               (cfg.gated_pair ? 2 : cfg.pair ? 1 : 0)) * 2 + (cfg.trigger_start ? 1 : 0)}];
    if (lf.failed) return false;
    if (!lf.fn) {
      try {
        Compiled comp = compile(g.dtype, cfg, info.arch);
        if (c.ModuleLoadData(&lf.module, comp.cubin.data()) != 0) {
          comp = compile(g.dtype, cfg, info.arch, /*use_cache=*/false);  // a stale cache entry
          check_cuda(c.ModuleLoadData(&lf.module, comp.cubin.data()), "cuModuleLoadData(skinny GEMM)");
        }
        check_cuda(c.ModuleGetFunction(&lf.fn, lf.module, kEntryName), "cuModuleGetFunction(skinny GEMM)");
        if (cfg.dynamic_smem() > 48 * 1024)
          check_cuda(c.FuncSetAttribute(lf.fn, kAttrMaxDynamicSharedBytes, cfg.dynamic_smem()),
                     "cuFuncSetAttribute(skinny GEMM, max dynamic smem)");
      } catch (const std::exception& e) {
        lf.failed = true;
        g_error = e.what();
        return false;
      }
    }
    fn = lf.fn;
    if (cfg.stages) {
      try {
        wmap = tma_map(g.dtype, g.b.ptr, g.n, g.k, g.b.col_stride, cfg.cta_rows(), second ? pair_bytes : 0,
                       cfg.gated_pair);
        amap = tma_map(g.dtype, g.a.ptr, g.m, g.k, g.a.row_stride, 16);
      } catch (const std::exception& e) {
        g_error = e.what();
        return false;
      }
    }
    g_last_launch = cfg;  // a struct copy under the lock already held; the tag is built only when asked
  }

  SkinnyParams p{};
  p.a = g.a.ptr;
  p.lda = g.m > 1 ? g.a.row_stride : 0;
  p.w = g.b.ptr;
  p.ldw = g.n > 1 ? g.b.col_stride : 0;
  p.d = gated_h ? gated_h : g.d;
  p.ldd = g.n;
  p.bias = g.bias;
  p.bias_stride = g.bias_stride;
  p.c = g.residual.ptr;
  p.ldc = g.residual.ptr ? g.residual.row_stride : 0;
  p.aux = g.aux;
  p.ldaux = g.n;
  p.m = static_cast<int32_t>(g.m);
  p.n = static_cast<int32_t>(g.n);
  p.k = static_cast<int32_t>(g.k);
  p.act = small_m_act_code(g.activation);
  p.a2 = g.a_mul.ptr;
  p.lda2 = g.a_mul.ptr && g.m > 1 ? g.a_mul.row_stride : 0;
  int pair_ctas = static_cast<int>((g.n + cfg.cta_rows() - 1) / cfg.cta_rows() * cfg.cluster);
  const unsigned grid = static_cast<unsigned>(second && !gated_h ? 2 * pair_ctas : pair_ctas);
  void* d2 = second ? second->d : nullptr;
  // The register kernel takes p, the TMA kernel p and its maps (a pair also
  // the second output and the first GEMM's CTA count, the gated pair which
  // weight is the gate's); a trace config also the trace buffer, last.
  uint64_t* trace = g_trace.load(std::memory_order_relaxed);
  void* params[] = {&p, &wmap, &amap, &d2, &pair_ctas, &trace};
  if (cfg.stages && !second) params[3] = &trace;
  if (gated_h) {
    params[3] = &silu_z;
    params[4] = &trace;
  }
  if (cfg.trace && !cfg.stages) params[1] = &trace;
  launch_1d(fn, grid, static_cast<unsigned>(cfg.threads()), static_cast<unsigned>(cfg.dynamic_smem()), g.stream, params,
            pdl, "cuLaunchKernel(skinny GEMM)");
  g_launches.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool try_run(const GemmArgs& g) { return run_impl(g, nullptr, 0); }

// A pair as run_impl takes it: the same problem but for the weights and
// outputs, plain epilogues; the first GEMM is the one whose weight lies
// lower (the map's second matrix sits a positive distance after it, a
// multiple of 16 bytes). pair_bytes 0: not a pair the kernel takes.
struct PairOrder {
  const GemmArgs* first = nullptr;
  const GemmArgs* other = nullptr;
  int64_t pair_bytes = 0;
};
static PairOrder order_pair(const GemmArgs& x, const GemmArgs& y) {
  if (x.m != y.m || x.n != y.n || x.k != y.k || x.dtype != y.dtype || x.batch != 1 || y.batch != 1 ||
      x.a.ptr != y.a.ptr || x.a.row_stride != y.a.row_stride || x.a.col_stride != y.a.col_stride ||
      x.b.row_stride != y.b.row_stride || x.b.col_stride != y.b.col_stride || x.bias || y.bias || x.residual.ptr ||
      y.residual.ptr || x.aux || y.aux || x.a_mul.ptr || y.a_mul.ptr || x.activation != y.activation ||
      x.stream != y.stream)
    return {};
  const bool x_first = reinterpret_cast<uintptr_t>(x.b.ptr) < reinterpret_cast<uintptr_t>(y.b.ptr);
  PairOrder o{x_first ? &x : &y, x_first ? &y : &x, 0};
  const int64_t bytes =
      static_cast<int64_t>(reinterpret_cast<uintptr_t>(o.other->b.ptr) - reinterpret_cast<uintptr_t>(o.first->b.ptr));
  if (bytes > 0 && bytes % 16 == 0 && bytes < (int64_t(1) << 40)) o.pair_bytes = bytes;
  return o;
}

bool try_run_pair(const GemmArgs& x, const GemmArgs& y) {
  const PairOrder o = order_pair(x, y);
  return o.pair_bytes && run_impl(*o.first, o.other, o.pair_bytes);
}

bool try_run_gated_pair(const GemmArgs& x, const GemmArgs& y, void* h, bool x_is_gate) {
  // As try_run_pair, with no activation: h = silu(x's result) * y's (or the
  // other way round), the two results themselves never written.
  if (!h || !x.activation.empty() || reinterpret_cast<uintptr_t>(h) % 2 != 0) return false;
  const PairOrder o = order_pair(x, y);
  const bool x_first = o.first == &x;
  return o.pair_bytes && run_impl(*o.first, o.other, o.pair_bytes, h, x_first == x_is_gate ? 0 : 1);
}

void set_trace_buffer(uint64_t* buffer) { g_trace.store(buffer, std::memory_order_relaxed); }

uint64_t launch_count() { return g_launches.load(std::memory_order_relaxed); }

std::string last_error() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_error;
}

std::string last_config() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_last_launch.nt ? g_last_launch.tag() : std::string();
}

}  // namespace opfuse::skinny
