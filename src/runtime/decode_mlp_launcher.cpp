#include "runtime/decode_mlp_launcher.h"

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <regex>
#include <stdexcept>
#include <tuple>

#include "runtime/cuda_api.h"
#include "runtime/nvrtc_cached.h"
#include "runtime/small_m_launch.h"

#include "decode_mlp_cu.inc"  // static const char decode_mlp_cu[]
#include "tma_ptx_cu.inc"     // static const char tma_ptx_cu[]

namespace opfuse::decode_mlp {
namespace {

constexpr int kAttrMaxDynamicSharedBytes = 8;     // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES

std::atomic<uint64_t> g_launches{0};
std::mutex g_mu;  // the maps below and g_error
std::string g_error;

const char* elem_name(DType t) { return small_m_elem_name(t, "decode MLP"); }

// small_m_act_code's, with silu_gate (the gated instantiation) as 0.
int act_code(const std::string& a) { return a == "silu_gate" ? 0 : small_m_act_code(a); }

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

struct LoadedFn {
  CUmodule module = nullptr;
  CUfunction fn = nullptr;
  int blocks_per_sm = 0;
  std::string failed;  // why it could not be built or loaded here
};
// Workspace layout (bytes): the grid barrier [0, 256): arrivals at 0, the
// generation at 128 (own cache lines); then kMaxCounters tile counters, a
// fixed region (the kernel leaves them at zero, and nothing else may ever
// write there: problems of other shapes share the workspace); then the
// float32 partials [2][grid][2][16 * bn]; then h [16, ldh].
constexpr int64_t kMaxCounters = int64_t(1) << 16;
int64_t tile_count(const Args& a, const Config& c) {
  const int64_t rows1 = a.activation == "silu_gate" ? c.bn / 2 : c.bn;
  return (a.h + rows1 - 1) / rows1 + (a.n + c.bn - 1) / c.bn;
}
struct WorkspaceLayout {
  size_t counters = 256, partials = 0, h = 0, total = 0;
  int64_t ldh = 0;
  WorkspaceLayout(const Args& a, const Config& c, int grid) {
    partials = counters + static_cast<size_t>(kMaxCounters * 4);
    h = partials + static_cast<size_t>(2 * grid * 2 * 16 * c.bn) * 4;
    ldh = round_up(a.h, 8);
    total = h + static_cast<size_t>(16 * ldh * 2);
  }
};

// CUtensorMap, as the kernel's TensorMap: 128 bytes, 64-byte aligned.
struct alignas(64) TensorMap {
  unsigned char bytes[128];
};
struct TensorMaps {
  TensorMap w1, w3, w2, x, h;
};
static_assert(sizeof(TensorMaps) == 640, "TensorMaps layout is the kernel's launch ABI");

// cuTensorMapEncodeTiled's enums (cuda.h): bf16 9, f16 6; no interleave, no
// swizzle (the kernel's loads avoid bank conflicts themselves), L2 promotion
// to 256 bytes (a stream), zeros outside the tensor.
constexpr int kTmaBf16 = 9, kTmaF16 = 6, kTmaInterleaveNone = 0, kTmaSwizzleNone = 0, kTmaL2Promo256B = 3,
              kTmaOobZero = 0;

// A 2-D map of a [rows, cols] matrix with row stride ld (elements), boxes of
// [box_rows, box_cols].
TensorMap encode_2d(DType dt, const void* ptr, int64_t cols, int64_t rows, int64_t ld, int box_cols, int64_t box_rows) {
  const CudaApi& c = cuda();
  if (!c.TensorMapEncodeTiled) throw std::runtime_error("the CUDA driver has no cuTensorMapEncodeTiled");
  TensorMap m{};
  const uint64_t dims[2] = {static_cast<uint64_t>(cols), static_cast<uint64_t>(rows)};
  const uint64_t strides[1] = {static_cast<uint64_t>(ld) * 2};
  const uint32_t box[2] = {static_cast<uint32_t>(box_cols), static_cast<uint32_t>(box_rows)};
  const uint32_t estr[2] = {1, 1};
  check_cuda(c.TensorMapEncodeTiled(m.bytes, dt == DType::BFloat16 ? kTmaBf16 : kTmaF16, 2, const_cast<void*>(ptr), dims,
                                    strides, box, estr, kTmaInterleaveNone, kTmaSwizzleNone, kTmaL2Promo256B, kTmaOobZero),
             "cuTensorMapEncodeTiled(decode MLP)");
  return m;
}

}  // namespace

std::string Config::tag() const {
  return "b" + std::to_string(bn) + "k" + std::to_string(ks) + "s" + std::to_string(stages) + "g" + std::to_string(kg) +
         (tensor ? "t" : "") + (no_mma ? "n" : "");
}

Config Config::parse(const std::string& tag) {
  static const std::regex re(R"(b(\d+)k(\d+)s(\d+)(?:g(\d+))?(t?)(n?))");
  std::smatch m;
  if (!std::regex_match(tag, m, re)) throw std::invalid_argument("bad decode MLP config '" + tag + "' (want e.g. b64k256s4g1)");
  Config c{std::stoi(m[1]), std::stoi(m[2]), std::stoi(m[3]), m[4].matched ? std::stoi(m[4]) : 1, m[5].length() > 0,
           m[6].length() > 0};
  bool ok = c.bn % 32 == 0 && c.bn >= 32 && c.bn <= 256 && c.ks % 32 == 0 && c.ks >= 32 && c.ks <= 2048 &&
            c.stages >= 2 && c.stages <= 8 && c.kg >= 1 && (c.ks / 32) % c.kg == 0 && c.bn / 16 * c.kg <= 16 &&
            (!c.tensor || (c.ks <= 256 && (c.ks / 64) % c.kg == 0)) && smem_bytes(c) <= 227 * 1024;
  if (!ok) throw std::invalid_argument("decode MLP config '" + tag + "' is out of range");
  return c;
}

int smem_bytes(const Config& c) {
  const int pitch = c.tensor ? 2 * c.ks : 2 * c.ks + 64, stage = (c.bn + 16) * pitch;
  return c.stages * stage + c.kg * 16 * (c.bn + 4) * 4 + 2 * c.stages * 8 + 16;
}

// Measured on the H200 (bench/results/h200/decode-mlp-c951c1c.txt), the
// 16x4096x16384 MLP, by row segment length (one bulk copy each):
// b64k256s4g1 (512 bytes) 233 us, b32k512s4g2 (1 KB, activation 50% of the
// weights) 163 us, b64k512s2g2 (1 KB) 130 us, b32k1024s2g4 (2 KB) 96 us;
// b128k128s4 (256 bytes) 368 us in the first run. The time follows the
// number of copies (~2-3e9 copies/s over the GPU, ~60 ns per copy per SM),
// not the bytes.
// Tensor-map boxes (2-3 copies a stage instead of 80) came next; on the H200
// at c05ecbf (bench/results/h200/decode-mlp-c05ecbf.txt, MLP / Llama at M =
// 16): b32k1024s2g4 96.8 / 95.9 us, b64k256s5g1t 101.4 / 102.6,
// b64k256s5g2t 89.8 / 89.9, b128k256s3g1t 113.9 / 106.8. So the copy count
// was not the limit; more consumer warps help, even with the MMAs left out
// (configs "n", 6719c0a: g1 105, g2 91 us), which points at the tile ends
// (docs/perf-notes.md, gemm-4). The default is b64k256s5g2t, faster than
// b32k1024s2g4 in the same run and run by the every-config GPU test there
// (the other GPU tests ran b64k256s5g1t: the same tensor-map path, one k group).
// b64k256s5g4t (16 consumer warps) ran 85.6 / 85.5 us at 6719c0a, beside g2's
// 89.6 / 88.9, with eager's errors at those two shapes; it joined the
// candidates after that run, so the GPU tests have not run it yet.
Config default_config() { return Config{64, 256, 5, 2, true}; }

std::vector<Config> candidate_configs() {
  return {default_config(),
          Config{},
          Config{64, 256, 4, 1},
          Config{64, 512, 2, 2},
          Config{32, 512, 4, 2},
          Config{64, 256, 5, 1, true},
          Config{128, 256, 3, 1, true},
          Config{64, 256, 5, 4, true}};
}

std::string source(DType dtype, bool gated, const Config& c) {
  // A diagnostic build ("n"): the consumers wait for each stage and release it without reading it.
  // common/tma_ptx.cu first: the kernel's mbarriers and tensor copies.
  std::string s = std::string(c.no_mma ? "#define OPFUSE_DECODE_NO_MMA 1\n" : "") + tma_ptx_cu + decode_mlp_cu;
  s += "\nOPFUSE_DECODE_MLP_ENTRY(" + std::string(kEntryName) + ", " + elem_name(dtype) + ", " + (gated ? "true" : "false") +
       ", " + std::to_string(c.bn) + ", " + std::to_string(c.ks) + ", " + std::to_string(c.stages) + ", " +
       std::to_string(c.kg) + ", " + (c.tensor ? "true" : "false") + ")\n";
  return s;
}

Compiled compile(DType dtype, bool gated, const Config& c, int arch, bool use_cache) {
  if (arch < 90) throw std::invalid_argument("decode MLP: needs sm_90 or newer (bulk copies, mbarrier transactions)");
  const std::string src = source(dtype, gated, c);
  return nvrtc_cubin_cached(src, "decode_mlp.cu", arch, "decode_mlp", "decode MLP", use_cache);
}

std::string unsupported_reason(const Args& a) {
  if (a.dtype != DType::BFloat16 && a.dtype != DType::Float16) return std::string("dtype ") + dtype_name(a.dtype);
  if (a.m < 1 || a.m > kMaxM) return "m = " + std::to_string(a.m) + " is not in 1..16";
  const int64_t lim = int64_t(1) << 30;
  if (a.k < 1 || a.h < 1 || a.n < 1 || a.k >= lim || a.h >= lim || a.n >= lim) return "a size is out of range";
  if (a.k % 8 != 0) return "k is not a multiple of 8";
  if (a.h % 8 != 0) return "the hidden size is not a multiple of 8";
  if (act_code(a.activation) < 0) return "activation " + a.activation;
  const bool gated = a.activation == "silu_gate";
  if (gated != (a.w3 != nullptr)) return gated ? "silu_gate without w3" : "w3 without silu_gate";
  if (gated && a.b1) return "a first bias with silu_gate";
  if (!a.x || !a.w1 || !a.w2 || !a.out) return "a null operand";
  if (!aligned16(a.x) || !aligned16(a.w1) || !aligned16(a.w2) || (gated && !aligned16(a.w3)))
    return "x or a weight is not 16-byte aligned";
  if ((a.m > 1 && a.ldx % 8 != 0) || a.ldw1 % 8 != 0 || a.ldw2 % 8 != 0 || (gated && a.ldw3 % 8 != 0))
    return "a row stride is not a multiple of 8 elements";
  if (a.ldw1 < a.k || a.ldw2 < a.h || (gated && a.ldw3 < a.k) || (a.m > 1 && a.ldx < a.k)) return "overlapping rows";
  if (a.m > 1 && a.ldo < a.n) return "the output's rows overlap";
  return {};
}


// Opt-in: on the H200 the kernel was slower than the cuBLASLt chain
// (docs/perf-notes.md, "Decode MLP": 96 us against 76-85 us at M = 16).
bool planning_enabled() {
  const char* e = std::getenv("OPFUSE_DECODE_MLP");
  return e && std::string(e) == "1";
}

bool try_run(const Args& a, std::string* why) {
  auto refuse = [&](const std::string& reason) {
    if (why) *why = reason;
    std::lock_guard<std::mutex> lock(g_mu);
    g_error = reason;
    return false;
  };
  if (std::string r = unsupported_reason(a); !r.empty()) return refuse(r);
  const CudaApi& c = cuda();
  if (!c.loaded) return refuse("no CUDA driver");
  if (!a.workspace || reinterpret_cast<uintptr_t>(a.workspace) % 256 != 0)
    return refuse("no workspace, or one not 256-byte aligned");
  CUcontext ctx = nullptr;
  if (c.CtxGetCurrent(&ctx) != 0 || !ctx) return refuse("no current CUDA context");
  const bool gated = a.activation == "silu_gate";

  static std::map<CUcontext, SmallMDevice> devices;
  static std::map<std::tuple<CUcontext, DType, bool, std::string>, LoadedFn> functions;
  Config cfg;
  CUfunction fn = nullptr;
  int grid = 0;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    SmallMDevice& info = devices[ctx];
    if (info.arch == 0) info = small_m_current_device();
    if (info.arch < 90) {
      g_error = "sm_" + std::to_string(info.arch) + " is not sm_90";
      if (why) *why = g_error;
      return false;
    }
    const char* forced = std::getenv("OPFUSE_DECODE_MLP_CONFIG");
    cfg = forced && *forced ? Config::parse(forced) : default_config();
    LoadedFn& lf = functions[{ctx, a.dtype, gated, cfg.tag()}];
    if (!lf.failed.empty()) {
      g_error = lf.failed;
      if (why) *why = lf.failed;
      return false;
    }
    if (!lf.fn) {
      try {
        Compiled comp = compile(a.dtype, gated, cfg, info.arch);
        if (c.ModuleLoadData(&lf.module, comp.cubin.data()) != 0) {
          comp = compile(a.dtype, gated, cfg, info.arch, /*use_cache=*/false);  // a stale cache entry
          check_cuda(c.ModuleLoadData(&lf.module, comp.cubin.data()), "cuModuleLoadData(decode MLP)");
        }
        check_cuda(c.ModuleGetFunction(&lf.fn, lf.module, kEntryName), "cuModuleGetFunction(decode MLP)");
        check_cuda(c.FuncSetAttribute(lf.fn, kAttrMaxDynamicSharedBytes, smem_bytes(cfg)),
                   "cuFuncSetAttribute(decode MLP shared memory)");
        lf.blocks_per_sm = 1;
        if (c.OccupancyMaxActiveBlocksPerMultiprocessor)
          check_cuda(c.OccupancyMaxActiveBlocksPerMultiprocessor(&lf.blocks_per_sm, lf.fn, cfg.threads(),
                                                                 static_cast<size_t>(smem_bytes(cfg))),
                     "cuOccupancyMaxActiveBlocksPerMultiprocessor(decode MLP)");
        if (lf.blocks_per_sm < 1) throw std::runtime_error("decode MLP: no CTA fits on an SM");
      } catch (const std::exception& e) {
        lf.fn = nullptr;
        lf.failed = e.what();
        g_error = lf.failed;
        if (why) *why = lf.failed;
        return false;
      }
    }
    fn = lf.fn;
    if (tile_count(a, cfg) > kMaxCounters) {
      g_error = "more than " + std::to_string(kMaxCounters) + " tiles";
      if (why) *why = g_error;
      return false;
    }
    // Every CTA must be resident at once (the grid barrier): at most one
    // wave, and no more CTAs than stages to stream.
    const int64_t rows1 = gated ? cfg.bn / 2 : cfg.bn;
    const int64_t stages = (a.h + rows1 - 1) / rows1 * ((a.k + cfg.ks - 1) / cfg.ks) +
                           (a.n + cfg.bn - 1) / cfg.bn * ((a.h + cfg.ks - 1) / cfg.ks);
    grid = static_cast<int>(std::min<int64_t>(static_cast<int64_t>(info.sms) * lf.blocks_per_sm, stages));
    if (WorkspaceLayout(a, cfg, grid).total > a.workspace_bytes) {
      g_error = "the problem needs " + std::to_string(WorkspaceLayout(a, cfg, grid).total) + " bytes of workspace, " +
                std::to_string(a.workspace_bytes) + " given";
      if (why) *why = g_error;
      return false;
    }
  }

  WorkspaceLayout lay(a, cfg, grid);
  const auto base = reinterpret_cast<uintptr_t>(a.workspace);
  DecodeMlpParams p{};
  p.x = a.x;
  p.ldx = a.m > 1 ? a.ldx : 0;
  p.w1 = a.w1;
  p.ldw1 = a.ldw1;
  p.w3 = a.w3;
  p.ldw3 = a.ldw3;
  p.b1 = a.b1;
  p.b1_stride = a.b1_stride;
  p.w2 = a.w2;
  p.ldw2 = a.ldw2;
  p.b2 = a.b2;
  p.b2_stride = a.b2_stride;
  p.out = a.out;
  p.ldo = a.m > 1 ? a.ldo : 0;
  p.h = reinterpret_cast<void*>(base + lay.h);
  p.ldh = lay.ldh;
  p.partials = reinterpret_cast<float*>(base + lay.partials);
  p.counters = reinterpret_cast<uint32_t*>(base + lay.counters);
  p.barrier = reinterpret_cast<uint32_t*>(base);
  p.m = static_cast<int32_t>(a.m);
  p.k = static_cast<int32_t>(a.k);
  p.hdim = static_cast<int32_t>(a.h);
  p.n = static_cast<int32_t>(a.n);
  p.act = act_code(a.activation);
  const char* pf = std::getenv("OPFUSE_DECODE_MLP_PREFETCH");
  p.prefetch = pf && *pf ? std::atoi(pf) : 0;  // prefetching 2 or 8 stages measured no faster on the H200
  TensorMaps maps{};
  if (cfg.tensor) {
    try {
      const int64_t rows1 = gated ? cfg.bn / 2 : cfg.bn;
      maps.w1 = encode_2d(a.dtype, a.w1, a.k, a.h, a.ldw1, cfg.ks, rows1);
      if (gated) maps.w3 = encode_2d(a.dtype, a.w3, a.k, a.h, a.ldw3, cfg.ks, rows1);
      maps.w2 = encode_2d(a.dtype, a.w2, a.h, a.n, a.ldw2, cfg.ks, cfg.bn);
      maps.x = encode_2d(a.dtype, a.x, a.k, a.m, a.m > 1 ? a.ldx : round_up(a.k, 8), cfg.ks, 16);
      maps.h = encode_2d(a.dtype, p.h, a.h, a.m, lay.ldh, cfg.ks, 16);
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(g_mu);
      g_error = e.what();
      if (why) *why = g_error;
      return false;
    }
  }
  void* params[] = {&p, &maps};
  // Cooperative: the grid starts only once every CTA fits, so two of these
  // kernels on two streams cannot each hold part of the SMs and wait for the
  // other at their grid barriers. OPFUSE_DECODE_MLP_COOPERATIVE=0: a plain launch.
  const char* coop = std::getenv("OPFUSE_DECODE_MLP_COOPERATIVE");
  const unsigned g = static_cast<unsigned>(grid), bt = static_cast<unsigned>(cfg.threads()),
                 sm = static_cast<unsigned>(smem_bytes(cfg));
  if (c.LaunchCooperativeKernel && !(coop && std::string(coop) == "0"))
    check_cuda(c.LaunchCooperativeKernel(fn, g, 1, 1, bt, 1, 1, sm, a.stream, params), "cuLaunchCooperativeKernel(decode MLP)");
  else
    check_cuda(c.LaunchKernel(fn, g, 1, 1, bt, 1, 1, sm, a.stream, params, nullptr), "cuLaunchKernel(decode MLP)");
  g_launches.fetch_add(1, std::memory_order_relaxed);
  return true;
}

uint64_t launch_count() { return g_launches.load(std::memory_order_relaxed); }

std::string last_error() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_error;
}

}  // namespace opfuse::decode_mlp
