#include "runtime/skinny_gemm_launcher.h"

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

#include "skinny_gemm_cu.inc"  // static const char skinny_gemm_cu[]

namespace opfuse::skinny {
namespace {

std::atomic<uint64_t> g_launches{0};
std::mutex g_mu;  // the maps below and g_error
std::string g_error;

const char* elem_name(DType t) { return small_m_elem_name(t, "skinny GEMM"); }

struct LoadedFn {
  CUmodule module = nullptr;
  CUfunction fn = nullptr;
  bool failed = false;  // could not be built or loaded here: cuBLASLt runs instead
};

}  // namespace

std::string SkinnyConfig::tag() const {
  return "n" + std::to_string(nt) + "u" + std::to_string(u) + "w" + std::to_string(warps) + "b" +
         std::to_string(min_blocks) + "c" + std::to_string(cluster) + (pipe ? "p" + std::to_string(pipe) : "");
}

SkinnyConfig SkinnyConfig::parse(const std::string& tag) {
  static const std::regex re(R"(n(\d+)u(\d+)w(\d+)b(\d+)c(\d+)(?:p(\d+))?)");
  std::smatch m;
  if (!std::regex_match(tag, m, re))
    throw std::invalid_argument("bad skinny GEMM config '" + tag + "' (want e.g. n8u1w8b2c1 or n4u1w8b3c2p1)");
  SkinnyConfig c{std::stoi(m[1]), std::stoi(m[2]), std::stoi(m[3]), std::stoi(m[4]), std::stoi(m[5]),
                 m[6].matched ? std::stoi(m[6]) : 0};
  bool ok = c.nt >= 1 && (c.nt <= 8 || c.nt % 8 == 0) && c.nt <= 16 && c.u >= 1 && c.u <= 4 && c.warps >= 1 &&
            c.warps <= 16 && c.min_blocks >= 1 && c.min_blocks <= 4 &&
            (c.cluster == 1 || c.cluster == 2 || c.cluster == 4 || c.cluster == 8) && (c.pipe == 0 || c.pipe == 1);
  if (!ok) throw std::invalid_argument("skinny GEMM config '" + tag + "' is out of range");
  return c;
}

// One wave of CTAs: the kernel is bound by HBM, so every CTA should be
// resident from the start (no tail wave), and there should be enough of them
// to put every SM to work. On sm_90, when N / 64 tiles are too few (N = 4096
// on 132 SMs), a cluster splits K over 2 to 8 CTAs per tile; elsewhere
// narrower tiles (32 rows) serve the same end.
SkinnyConfig choose_config(int64_t m, int64_t n, int64_t k, int arch, int sms) {
  (void)m;
  SkinnyConfig c;  // n8u1w8b2c1: 128 registers, 64 KB of loads in flight per SM
  const int64_t tiles = (n + c.rows() - 1) / c.rows();
  const int64_t chunks = (k / 8 + 4 * c.u - 1) / (4 * c.u);
  if (arch >= 90) {
    // Double the cluster while there stays at most one CTA per SM and each
    // warp keeps >= 2 chunks. Measured on the H200 (bench/results/h200/
    // skinny-gemm-20261129T2222.txt): for N = 4096 a cluster of 2 (128 CTAs)
    // ran 16x16384->4096 in 40.3 us and 16x11008->4096 in 29.1 us, a cluster
    // of 4 (256 CTAs, two per SM) in 47.8 and 34.5.
    while (c.cluster < 8 && tiles * c.cluster * 2 <= sms && chunks >= 2LL * c.cluster * 2 * c.warps) c.cluster *= 2;
    return c;
  }
  if (tiles < sms) c = SkinnyConfig{4, 2, 8, 1, 1};
  return c;
}

std::vector<SkinnyConfig> candidate_configs(int arch) {
  std::vector<SkinnyConfig> r{SkinnyConfig{}};
  if (arch >= 90)
    for (int cl : {2, 4, 8}) r.push_back(SkinnyConfig{8, 1, 8, 2, cl});
  else
    r.push_back(SkinnyConfig{4, 2, 8, 1, 1});
  return r;
}

std::string source(DType dtype, const SkinnyConfig& c) {
  std::string s(skinny_gemm_cu);
  std::string args = std::string(kEntryName) + ", " + elem_name(dtype) + ", " + std::to_string(c.nt) + ", " +
                     std::to_string(c.u) + ", " + std::to_string(c.warps) + ", " + std::to_string(c.min_blocks) + ", " +
                     std::to_string(c.pipe);
  if (c.cluster > 1) s += "\nOPFUSE_SKINNY_CLUSTER_ENTRY(" + args + ", " + std::to_string(c.cluster) + ")\n";
  else s += "\nOPFUSE_SKINNY_ENTRY(" + args + ")\n";
  return s;
}

Compiled compile(DType dtype, const SkinnyConfig& c, int arch, bool use_cache) {
  if (c.cluster > 1 && arch < 90) throw std::invalid_argument("skinny GEMM: clusters need sm_90 or newer");
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
  return {};
}

// Opt-in: on the H200 (scripts/bench_skinny_gemm.py, docs/perf-notes.md) it
// was slower than cuBLASLt's timed choice on three of the four M = 16 GEMMs
// of the gemm suite, so cuBLASLt stays the default.
bool enabled() {
  const char* e = std::getenv("OPFUSE_SKINNY_GEMM");
  return e && std::string(e) == "1";
}

bool try_run(const GemmArgs& g) {
  if (!enabled() || !unsupported_reason(g).empty()) return false;
  const CudaApi& c = cuda();
  if (!c.loaded) return false;
  CUcontext ctx = nullptr;
  if (c.CtxGetCurrent(&ctx) != 0 || !ctx) return false;

  static std::map<CUcontext, SmallMDevice> devices;
  // Integers only: this runs on every call.
  static std::map<std::tuple<CUcontext, DType, int, int, int, int, int, int>, LoadedFn> functions;
  CUfunction fn = nullptr;
  SkinnyConfig cfg;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    SmallMDevice& info = devices[ctx];
    if (info.arch == 0) info = small_m_current_device();
    if (info.arch < 80) return false;  // mma.sync bf16 and cvt.rn.bf16 need sm_80
    const char* forced = std::getenv("OPFUSE_SKINNY_CONFIG");
    cfg = forced && *forced ? SkinnyConfig::parse(forced) : choose_config(g.m, g.n, g.k, info.arch, info.sms);
    if (cfg.cluster > 1 && info.arch < 90) cfg.cluster = 1;
    LoadedFn& lf = functions[{ctx, g.dtype, cfg.nt, cfg.u, cfg.warps, cfg.min_blocks, cfg.cluster, cfg.pipe}];
    if (lf.failed) return false;
    if (!lf.fn) {
      try {
        Compiled comp = compile(g.dtype, cfg, info.arch);
        if (c.ModuleLoadData(&lf.module, comp.cubin.data()) != 0) {
          comp = compile(g.dtype, cfg, info.arch, /*use_cache=*/false);  // a stale cache entry
          check_cuda(c.ModuleLoadData(&lf.module, comp.cubin.data()), "cuModuleLoadData(skinny GEMM)");
        }
        check_cuda(c.ModuleGetFunction(&lf.fn, lf.module, kEntryName), "cuModuleGetFunction(skinny GEMM)");
      } catch (const std::exception& e) {
        lf.failed = true;
        g_error = e.what();
        return false;
      }
    }
    fn = lf.fn;
  }

  SkinnyParams p{};
  p.a = g.a.ptr;
  p.lda = g.m > 1 ? g.a.row_stride : 0;
  p.w = g.b.ptr;
  p.ldw = g.n > 1 ? g.b.col_stride : 0;
  p.d = g.d;
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
  const unsigned grid = static_cast<unsigned>((g.n + cfg.rows() - 1) / cfg.rows() * cfg.cluster);
  void* params[] = {&p};
  check_cuda(c.LaunchKernel(fn, grid, 1, 1, static_cast<unsigned>(cfg.warps * 32), 1, 1, 0, g.stream, params, nullptr),
             "cuLaunchKernel(skinny GEMM)");
  g_launches.fetch_add(1, std::memory_order_relaxed);
  return true;
}

uint64_t launch_count() { return g_launches.load(std::memory_order_relaxed); }

std::string last_error() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_error;
}

}  // namespace opfuse::skinny
