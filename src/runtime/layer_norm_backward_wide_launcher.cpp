#include "runtime/layer_norm_backward_wide_launcher.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <regex>
#include <stdexcept>
#include <tuple>

#include "runtime/cuda_api.h"
#include "runtime/small_m_launch.h"

#include "layer_norm_backward_wide_cu.inc"  // static const char layer_norm_backward_wide_cu[]

namespace opfuse::lnbwd_wide {
namespace {

constexpr int kAttrMaxDynamicSharedBytes = 8;  // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
std::atomic<uint64_t> g_launches{0};
std::mutex g_mu;  // the map below and g_error
std::string g_error;

struct Loaded {
  CUmodule module = nullptr;
  CUfunction rows_fn = nullptr, finish_fn = nullptr;
  int resident = 0;     // clusters resident at once on this device
  bool failed = false;  // could not be built or loaded here: the generated kernels run instead
};

const char* elem_name(DType t) {
  switch (t) {
    case DType::BFloat16: return "bf16";
    case DType::Float16: return "f16";
    case DType::Float32: return "f32";
    default: throw std::invalid_argument(std::string("layer_norm backward (wide rows): no kernel for dtype ") + dtype_name(t));
  }
}

int env_off() {
  const char* e = std::getenv("OPFUSE_LNBWD_WIDE");
  return e && std::string(e) == "0";
}

// The loaded instantiation for the current context (nullptr when it cannot run here).
Loaded* load(DType t, const Config& cfg) {
  const CudaApi& c = cuda();
  if (!c.loaded) return nullptr;
  CUcontext ctx = nullptr;
  if (c.CtxGetCurrent(&ctx) != 0 || !ctx) return nullptr;
  static std::map<CUcontext, SmallMDevice> devices;
  static std::map<std::tuple<CUcontext, DType, std::string>, Loaded> loaded;
  std::lock_guard<std::mutex> lock(g_mu);
  SmallMDevice& info = devices[ctx];
  if (info.arch == 0) info = small_m_current_device();
  if (info.arch < 90) return nullptr;  // thread-block clusters
  Loaded& l = loaded[{ctx, t, cfg.tag()}];
  if (l.failed) return nullptr;
  if (!l.rows_fn) {
    try {
      CachedCubin comp = compile(t, cfg, info.arch);
      if (c.ModuleLoadData(&l.module, comp.cubin.data()) != 0) {
        comp = compile(t, cfg, info.arch, /*use_cache=*/false);  // a stale cache entry
        check_cuda(c.ModuleLoadData(&l.module, comp.cubin.data()), "cuModuleLoadData(layer_norm backward wide)");
      }
      check_cuda(c.ModuleGetFunction(&l.rows_fn, l.module, kEntryName), "cuModuleGetFunction(layer_norm backward wide)");
      check_cuda(c.ModuleGetFunction(&l.finish_fn, l.module, kFinishName), "cuModuleGetFunction(layer_norm backward finish)");
      // Static plus dynamic shared memory over 48 KB needs the opt-in, and
      // the default allows only 48 KB minus the static part: always set it.
      if (cfg.dynamic_smem() > 0)
        check_cuda(c.FuncSetAttribute(l.rows_fn, kAttrMaxDynamicSharedBytes, cfg.dynamic_smem()),
                   "cuFuncSetAttribute(layer_norm backward wide, max dynamic shared memory)");
      l.resident = resident_groups(l.rows_fn, cfg.threads, cfg.dynamic_smem(), cfg.cluster);
    } catch (const std::exception& e) {
      l.failed = true;
      l.rows_fn = nullptr;
      g_error = e.what();
      return nullptr;
    }
  }
  return &l;
}

Config config_for(DType t, int64_t n) {
  const char* forced = std::getenv("OPFUSE_LNBWD_WIDE_CONFIG");
  return forced && *forced ? Config::parse(forced) : choose_config(t, n);
}

}  // namespace

std::string Config::tag() const {
  if (group)
    return "t" + std::to_string(threads) + "g" + std::to_string(group) + "r" + std::to_string(rows) + "v" +
           std::to_string(nv) + "b" + std::to_string(min_blocks);
  return "t" + std::to_string(threads) + "c" + std::to_string(cluster) + "r" + std::to_string(rows) + "v" +
         std::to_string(nv) + "b" + std::to_string(min_blocks) + (stages ? "s" + std::to_string(stages) : "") + (pipelined ? "p" : "");
}

Config Config::parse(const std::string& tag) {
  static const std::regex re(R"(t(\d+)c(\d+)r(\d+)v(\d+)b(\d+)(?:s(\d+))?(p?))");
  static const std::regex re_group(R"(t(\d+)g(\d+)r(\d+)v(\d+)b(\d+))");
  std::smatch m;
  if (std::regex_match(tag, m, re_group)) {
    Config c{std::stoi(m[1]), 1, std::stoi(m[3]), std::stoi(m[4]), std::stoi(m[5])};
    c.group = std::stoi(m[2]);
    const int ns = 2 * c.rows;
    bool ok = c.threads >= 64 && c.threads <= 1024 && c.threads % 32 == 0 && c.group >= 2 && c.group <= 32 &&
              (c.group & (c.group - 1)) == 0 && (ns & (ns - 1)) == 0 && ns <= c.group && c.nv >= 1 && c.nv <= 4 &&
              c.min_blocks >= 1 && c.min_blocks <= 8;
    if (!ok) throw std::invalid_argument("layer_norm backward config '" + tag + "' is out of range");
    return c;
  }
  if (!std::regex_match(tag, m, re))
    throw std::invalid_argument("bad layer_norm backward config '" + tag + "' (want e.g. t512c8r2v1b2)");
  Config c{std::stoi(m[1]), std::stoi(m[2]), std::stoi(m[3]), std::stoi(m[4]), std::stoi(m[5]),
           m[6].matched ? std::stoi(m[6]) : 0, m[7].length() > 0};
  bool ok = c.threads >= 64 && c.threads <= 1024 && c.threads % 32 == 0 &&
            (c.cluster == 1 || c.cluster == 2 || c.cluster == 4 || c.cluster == 8) && c.rows >= 1 && c.rows <= 8 &&
            c.nv >= 1 && c.nv <= 4 && c.min_blocks >= 1 && c.min_blocks * c.threads <= 2048 && (c.stages == 0 || (c.stages >= 2 && c.stages <= 4)) &&
            c.dynamic_smem() <= 227 * 1024 && (!c.pipelined || (c.stages >= 2 && c.cluster > 1));
  if (!ok) throw std::invalid_argument("layer_norm backward config '" + tag + "' is out of range");
  return c;
}

int Config::dynamic_smem() const { return stages * rows * nv * 2 * threads * 16; }

int vec_of(DType t) { return t == DType::Float32 ? 4 : 8; }

int64_t Config::columns(DType t) const {
  return static_cast<int64_t>(group ? group : cluster * threads) * nv * vec_of(t);
}

// 512 threads and two CTAs an SM (64 registers: ptxas fits R x NV = 2 row
// vectors of dy and x, the 2 x 8 partials and the sums without a spill);
// the cluster as small as covers n with one vector a thread, at most 8
// (portable), then two vectors a thread.
Config choose_config(DType t, int64_t n) {
  Config c;
  const int64_t per_cta = static_cast<int64_t>(c.threads) * vec_of(t);
  c.cluster = 1;
  while (c.cluster < 8 && c.cluster * per_cta < n) c.cluster *= 2;
  if (c.cluster * per_cta < n) {
    // Two vectors a thread: float32 keeps two CTAs an SM with one row a
    // batch; 16-bit elements (16 partials a vector) take one 512-thread CTA
    // an SM and two rows a batch (64 registers would spill).
    c.nv = 2;
    if (t == DType::Float32) c.rows = 1;
    else c.min_blocks = 1;
  }
  if (c.columns(t) < n) c.cluster = 0;  // nothing covers n
  if (t == DType::Float32) return c;
  // 16-bit rows with one vector a thread (up to 32768 columns) load two
  // batches ahead through the shared-memory ring; two vectors a thread take
  // a ring of two slots. H200, bf16, back-to-back calls at 8cff513
  // (perf-notes, session 12), us: 8192x32768 452 against 487 (register
  // variant), 16384x16384 468 against 475, 4096x65536 526 against 656.
  c.stages = c.nv == 1 ? 3 : 2;
  // Up to 4096 columns: 256-thread CTAs, four an SM, 2048 columns a CTA:
  // 32768x4096 221 us against 237 for one 512-thread CTA a row.
  if (n <= 4096) {
    c.threads = 256, c.min_blocks = 4;
    c.cluster = n <= 2048 ? 1 : 2;
  }
  // 513 to 1024 columns: 128-thread CTAs (1024 columns a CTA, where a
  // 256-thread one idles half its threads or more), four rows a batch. H200,
  // bf16, back-to-back calls at 150f1ba (perf-notes, session 13), us, this
  // against t256c1r2v1b4s3 and the generated kernels: 65536x576 93 / 149 /
  // 186, 65536x768 105 / 151 / 178, 32768x1024 81 / 86 / 138, 131072x1024
  // 241 / 283 / 341.
  if (n <= 1024) c.threads = 128, c.rows = 4, c.min_blocks = 8;
  // Up to 512 columns: lane groups (the smallest power of two of lanes that
  // covers n with one vector a lane, at least 4 (a lane a sum), at most 32,
  // then two vectors a lane), 256 threads, four CTAs an SM (two with two
  // vectors a lane: 64 registers would spill).
  if (n <= 512) {
    c = Config{256, 1, 2, 1, 4};
    c.group = 4;
    while (c.group < 32 && c.group * 8 < n) c.group *= 2;
    if (c.group * 8 < n) c.nv = 2, c.min_blocks = 2;
  }
  return c;
}

std::vector<Config> candidate_configs(DType t) {
  std::vector<Config> r;
  if (t != DType::Float32) {
    // Lane groups for rows of up to 512 columns.
    for (int g : {4, 8, 16, 32}) {
      Config c{256, 1, 2, 1, 4};
      c.group = g;
      r.push_back(c);
    }
    Config two{256, 1, 2, 2, 2};
    two.group = 32;
    r.push_back(two);
  }
  // Rows of 513 to 8192 columns (the defaults there, and the 512-thread
  // alternatives at 4096).
  if (t != DType::Float32) r.push_back(Config{256, 1, 2, 1, 4, 3}), r.push_back(Config{256, 2, 2, 1, 4, 3});
  // 128-thread CTAs (1024 columns), eight an SM, for 513 to 1024 columns.
  if (t != DType::Float32)
    r.push_back(Config{128, 1, 2, 1, 8, 3}), r.push_back(Config{128, 1, 2, 1, 8}), r.push_back(Config{128, 1, 4, 1, 8, 3});
  if (t != DType::Float32) r.push_back(Config{512, 1, 2, 1, 2, 3}), r.push_back(Config{512, 2, 2, 1, 2, 3});
  else r.push_back(Config{512, 1, 2, 1, 2}), r.push_back(Config{512, 2, 2, 1, 2}), r.push_back(Config{512, 4, 2, 1, 2});  // float32
  if (t != DType::Float32) r.push_back(Config{512, 4, 2, 1, 2});
  r.push_back(Config{512, 8, 2, 1, 2});
  if (t == DType::Float32) r.push_back(Config{512, 8, 1, 2, 2});  // past 16384 columns
  else r.push_back(Config{512, 8, 2, 2, 1});                      // past 32768 columns
  // The staged ring (measured against the register variant: perf-notes).
  for (bool pipe : {false, true}) {
    if (t != DType::Float32) r.push_back(Config{512, 4, 2, 1, 2, 3, pipe});
    r.push_back(Config{512, 8, 2, 1, 2, 3, pipe});
  }
  r.push_back(Config{512, 8, 4, 1, 2, 2});
  if (t == DType::Float32) r.push_back(Config{512, 8, 1, 2, 2, 3}), r.push_back(Config{512, 8, 1, 2, 2, 3, true});
  else r.push_back(Config{512, 8, 2, 2, 1, 2}), r.push_back(Config{512, 8, 2, 2, 1, 2, true});
  return r;
}

std::string source(DType t, const Config& c) {
  std::string s(layer_norm_backward_wide_cu);
  if (c.group) {
    s += "\nOPFUSE_LNBWD_GROUPS_ENTRY(" + std::string(kEntryName) + ", " + elem_name(t) + ", " + std::to_string(c.threads) +
         ", " + std::to_string(c.group) + ", " + std::to_string(c.rows) + ", " + std::to_string(c.nv) + ", " +
         std::to_string(c.min_blocks) + ")\n";
    s += "OPFUSE_LNBWD_FINISH_SPLIT_ENTRY(" + std::string(kFinishName) + ", " + elem_name(t) + ")\n";
    return s;
  }
  const char* entry = c.pipelined ? "\nOPFUSE_LNBWD_PIPELINED_ENTRY(" : c.stages ? "\nOPFUSE_LNBWD_STAGED_ENTRY(" : "\nOPFUSE_LNBWD_ENTRY(";
  s += std::string(entry) + kEntryName + ", " + elem_name(t) +
       ", " + std::to_string(c.threads) + ", " + std::to_string(c.cluster) + ", " + std::to_string(c.rows) + ", " +
       std::to_string(c.nv) + ", " + std::to_string(c.min_blocks) + (c.stages ? ", " + std::to_string(c.stages) : "") +
       ")\n";
  s += "OPFUSE_LNBWD_FINISH_ENTRY(" + std::string(kFinishName) + ", " + elem_name(t) + ")\n";
  return s;
}

CachedCubin compile(DType t, const Config& c, int arch, bool use_cache) {
  if (arch < 90) throw std::invalid_argument("layer_norm backward (wide rows): needs sm_90 or newer (clusters)");
  return nvrtc_cubin_cached(source(t, c), "layer_norm_backward_wide.cu", arch, "layer_norm_backward_wide",
                            "layer_norm backward (wide rows)", use_cache);
}

std::string unsupported_reason(const Args& a) {
  if (a.dtype != DType::BFloat16 && a.dtype != DType::Float16 && a.dtype != DType::Float32)
    return std::string("dtype ") + dtype_name(a.dtype);
  const int64_t v = vec_of(a.dtype);
  if (a.rows < 1 || a.rows >= (int64_t(1) << 31)) return "rows out of range";
  if (a.n < 1 || a.n % v != 0) return "n = " + std::to_string(a.n) + " is not a multiple of " + std::to_string(v);
  if (choose_config(a.dtype, a.n).cluster == 0) return "n = " + std::to_string(a.n) + " is wider than the kernel covers";
  if (!a.dw && !a.db) return "no weight or bias gradient asked (the generated kernel does dx alone)";
  if (!a.dy || !a.x || !a.mean || !a.rstd) return "a missing input";
  if (!aligned16(a.dy) || !aligned16(a.x) || (a.dx && !aligned16(a.dx)) || (a.w && !aligned16(a.w)))
    return "dy, x, dx or the weight not 16-byte aligned";
  if (a.rows > 1 && (a.ld_dy % v != 0 || a.ld_x % v != 0 || (a.dx && a.ld_dx % v != 0)))
    return "a row stride is not a multiple of " + std::to_string(v);
  if (a.ld_dy < a.n || a.ld_x < a.n || (a.dx && a.ld_dx < a.n)) return "rows overlap";
  return {};
}

bool enabled() { return !env_off(); }

namespace {
// The parts (clusters launched) for `rows` rows with the loaded kernel.
int64_t parts_of(const Loaded& l, const Config& cfg, int64_t rows) {
  int64_t batches = (rows + cfg.rows - 1) / cfg.rows;
  if (cfg.group) batches = (batches + cfg.threads / cfg.group - 1) / (cfg.threads / cfg.group);  // a CTA's groups
  return std::max<int64_t>(1, std::min<int64_t>(l.resident, batches));
}
}  // namespace

int64_t parts(DType t, int64_t rows, int64_t n) {
  if (!enabled() || rows < 1) return 0;
  const Config cfg = config_for(t, n);
  if (cfg.cluster == 0 || cfg.columns(t) < n) return 0;
  Loaded* l = load(t, cfg);
  return l ? parts_of(*l, cfg, rows) : 0;
}

void run(const Args& a) {
  const std::string why = unsupported_reason(a);
  if (!why.empty()) throw std::invalid_argument("layer_norm backward (wide rows): " + why);
  const Config cfg = config_for(a.dtype, a.n);
  if (cfg.cluster == 0 || cfg.columns(a.dtype) < a.n)
    throw std::invalid_argument("layer_norm backward (wide rows): config " + cfg.tag() + " does not cover n");
  Loaded* l = enabled() ? load(a.dtype, cfg) : nullptr;  // one lookup a call
  if (!l) throw std::runtime_error("layer_norm backward (wide rows): cannot run here: " + last_error());
  const int64_t p = parts_of(*l, cfg, a.rows);
  if (!a.workspace || a.workspace_floats < 2 * p * a.n)
    throw std::invalid_argument("layer_norm backward (wide rows): the workspace needs " + std::to_string(2 * p * a.n) +
                                " floats");
  const CudaApi& c = cuda();
  LnBwdParams k{};
  k.dy = a.dy, k.ld_dy = a.ld_dy, k.x = a.x, k.ld_x = a.ld_x, k.mean = a.mean, k.rstd = a.rstd, k.w = a.w;
  k.dx = a.dx, k.ld_dx = a.ld_dx;
  k.part_dw = a.dw ? a.workspace : nullptr;
  k.part_db = a.db ? a.workspace + p * a.n : nullptr;
  k.rows = static_cast<int32_t>(a.rows), k.n = static_cast<int32_t>(a.n);
  CUstream s = static_cast<CUstream>(a.stream);
  void* params[] = {&k};
  check_cuda(c.LaunchKernel(l->rows_fn, static_cast<unsigned>(p * cfg.cluster), 1, 1, static_cast<unsigned>(cfg.threads), 1, 1,
                            static_cast<unsigned>(cfg.dynamic_smem()), s, params, nullptr),
             "cuLaunchKernel(layer_norm backward wide)");
  int parts32 = static_cast<int>(p), n32 = static_cast<int>(a.n);
  // The lane-group kernel's finish: 32 columns x 32 slices of parts a block.
  const unsigned cols_a_block = cfg.group ? 32 : 256, finish_threads = cfg.group ? 1024 : 256;
  const unsigned col_blocks = static_cast<unsigned>((a.n + cols_a_block - 1) / cols_a_block);
  void* dw = a.dw;
  void* db = a.db;
  void* fp[] = {&k.part_dw, &k.part_db, &parts32, &n32, &dw, &db};
  check_cuda(c.LaunchKernel(l->finish_fn, col_blocks, 2, 1, finish_threads, 1, 1, 0, s, fp, nullptr),
             "cuLaunchKernel(layer_norm backward finish)");
  g_launches.fetch_add(1, std::memory_order_relaxed);
}

uint64_t launch_count() { return g_launches.load(std::memory_order_relaxed); }

std::string last_error() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_error;
}

}  // namespace opfuse::lnbwd_wide
