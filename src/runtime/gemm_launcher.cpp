#include "runtime/gemm_launcher.h"

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <vector>

#include "fusion/plan.h"
#include "runtime/cublaslt_api.h"
#include "runtime/cuda_api.h"

namespace opfuse {
namespace {

// A column-major matrix as cuBLASLt describes it, and whether it is used
// transposed.
struct LtMatrix {
  int64_t rows = 0, cols = 0, ld = 0, batch_stride = 0;
  bool transposed = false;
};

// X^T in column-major terms, for X a logical [R, C] matrix: a row-major X
// is X^T column-major (ld = row stride); a column-major X is used with op T.
// A size-1 dim's stride is free, so it never decides. Throws GemmUnsupported
// when neither dim is unit-stride.
LtMatrix transposed_view(int64_t R, int64_t C, const GemmMatrix& x, const char* what) {
  LtMatrix m;
  m.batch_stride = x.batch_stride;
  int64_t sr = x.row_stride, sc = x.col_stride;
  if (sc == 1 || C == 1) {
    m.rows = C;
    m.cols = R;
    m.ld = R == 1 ? std::max<int64_t>(C, 1) : sr;
    if (m.ld >= std::max<int64_t>(C, 1)) return m;
  }
  if (sr == 1 || R == 1) {
    m.rows = R;
    m.cols = C;
    m.ld = C == 1 ? std::max<int64_t>(R, 1) : sc;
    m.transposed = true;
    if (m.ld >= std::max<int64_t>(R, 1)) return m;
  }
  std::ostringstream os;
  os << what << " with strides (" << sr << ", " << sc << ") for sizes (" << R << ", " << C
     << ") has no unit-stride dim a GEMM can read";
  throw GemmUnsupported(os.str());
}

int lt_type(DType t) {
  switch (t) {
    case DType::Float32: return lt::R_32F;
    case DType::Float16: return lt::R_16F;
    case DType::BFloat16: return lt::R_16BF;
    default: throw GemmUnsupported(std::string("no GEMM for dtype ") + dtype_name(t));
  }
}

constexpr int kMaxCandidates = 64;  // bound on GemmArgs::candidates
constexpr lt::Status kStatusInvalidValue = 7, kStatusNotSupported = 15;  // cublasStatus_t

int alignment(const void* p) {
  auto v = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 1 && v % static_cast<uintptr_t>(a) != 0) a /= 2;
  return a;
}

void check(lt::Status s, const char* what) {
  if (s == 0) return;
  const lt::Api& api = cublaslt();
  throw std::runtime_error(std::string(what) + " failed: " + (api.GetStatusString ? api.GetStatusString(s) : "") +
                           " (status " + std::to_string(s) + ")");
}

// Descriptors and the chosen algorithm for one problem (shapes, strides,
// dtype, epilogue, alignments), built once: cuBLASLt's heuristic is asked
// on first use and its answer cached.
struct Prepared {
  lt::MatmulDesc desc = nullptr;
  lt::Layout a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  lt::Algo algo{};
  size_t workspace = 0;
  std::vector<lt::Algo> candidates;  // the heuristic's answers, best first
  bool tuned = false;                // candidates timed once, algo is the fastest
  bool ok = false;
  std::string why;  // when !ok
  std::mutex mu;    // the pointer attributes are set per call
  ~Prepared() {
    const lt::Api& api = cublaslt();
    if (desc) api.MatmulDescDestroy(desc);
    for (lt::Layout l : {a, b, c, d})
      if (l) api.MatrixLayoutDestroy(l);
  }
};

lt::Handle handle_for_device(int device) {
  static std::mutex mu;
  static std::map<int, lt::Handle> handles;
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  lt::Handle h = nullptr;
  check(cublaslt().Create(&h), "cublasLtCreate");
  handles[device] = h;
  return h;
}

int current_device() {
  const CudaApi& c = cuda();
  CUdevice dev = 0;
  check_cuda(c.CtxGetDevice(&dev), "cuCtxGetDevice");
  return dev;
}

int epilogue_of(const GemmArgs& g) {
  if (g.activation == "dgelu_tanh") {
    if (!g.aux) throw std::invalid_argument("the gelu backward epilogue needs the saved gelu input (aux)");
    if (g.bias || g.residual.ptr) throw std::invalid_argument("the gelu backward epilogue takes no bias or residual");
    if (g.bias_grad && g.bias_grad_operand != GemmCall::kBiasGradOfResult)
      throw std::invalid_argument("the gelu backward epilogue's bias gradient is of its result");
    return g.bias_grad ? lt::EPI_DGELU_BGRAD : lt::EPI_DGELU;
  }
  if (g.bias_grad) {  // see build()
    if (g.bias_grad_operand == GemmCall::kBiasGradOfA) return lt::EPI_BGRADB;
    if (g.bias_grad_operand == GemmCall::kBiasGradOfB) return lt::EPI_BGRADA;
    throw std::invalid_argument("a bias gradient of the result needs the gelu backward epilogue");
  }
  bool bias = g.bias != nullptr;
  if (g.activation == "relu") return bias ? lt::EPI_RELU_BIAS : lt::EPI_RELU;
  if (g.activation == "gelu_tanh") {
    if (g.aux) return bias ? lt::EPI_GELU_AUX_BIAS : lt::EPI_GELU_AUX;
    return bias ? lt::EPI_GELU_BIAS : lt::EPI_GELU;
  }
  if (!g.activation.empty()) throw GemmUnsupported("no cuBLASLt epilogue for activation " + g.activation);
  return bias ? lt::EPI_BIAS : lt::EPI_DEFAULT;
}

void set_layout_batch(lt::Layout l, int64_t batch, int64_t stride) {
  if (batch <= 1) return;
  const lt::Api& api = cublaslt();
  int32_t count = static_cast<int32_t>(batch);
  check(api.MatrixLayoutSetAttribute(l, lt::LAYOUT_BATCH_COUNT, &count, sizeof(count)), "cublasLtMatrixLayoutSetAttribute");
  check(api.MatrixLayoutSetAttribute(l, lt::LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)),
        "cublasLtMatrixLayoutSetAttribute");
}

void add_split_k(Prepared& p, const GemmArgs& g, lt::Handle handle);

// D^T (n x m, ld n) = op(A') op(B') with A' describing B^T and B' describing
// A^T. So a bias along D's columns (n) is along D^T's rows (cuBLASLt's
// BIAS), and the bias gradient of a (summed over k) is BGRADB, of b BGRADA.
void build(Prepared& p, const GemmArgs& g, int epilogue, const LtMatrix& ma, const LtMatrix& mb, const LtMatrix* mc) {
  const lt::Api& api = cublaslt();
  int type = lt_type(g.dtype);
  int compute = (g.dtype == DType::Float32 && g.allow_tf32) ? lt::COMPUTE_32F_FAST_TF32 : lt::COMPUTE_32F;
  check(api.MatmulDescCreate(&p.desc, compute, lt::R_32F), "cublasLtMatmulDescCreate");
  int32_t ta = ma.transposed ? lt::OP_T : lt::OP_N, tb = mb.transposed ? lt::OP_T : lt::OP_N;
  check(api.MatmulDescSetAttribute(p.desc, lt::DESC_TRANSA, &ta, sizeof(ta)), "set TRANSA");
  check(api.MatmulDescSetAttribute(p.desc, lt::DESC_TRANSB, &tb, sizeof(tb)), "set TRANSB");
  int32_t epi = epilogue;
  check(api.MatmulDescSetAttribute(p.desc, lt::DESC_EPILOGUE, &epi, sizeof(epi)), "set EPILOGUE");
  if (g.bias || g.bias_grad) {
    // A float32 bias (or bias gradient) beside 16-bit matrices: autocast's
    // linear layers. Where cuBLASLt takes no such combination its heuristic
    // finds no algorithm, GemmUnsupported below, and the partition is
    // planned again with the bias cast in a kernel.
    int32_t bt = g.float32_bias ? lt::R_32F : type;
    check(api.MatmulDescSetAttribute(p.desc, lt::DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)), "set BIAS_DATA_TYPE");
  }
  if (g.aux) {
    int64_t ld = g.aux_ld ? g.aux_ld : g.n;
    check(api.MatmulDescSetAttribute(p.desc, lt::DESC_AUX_LD, &ld, sizeof(ld)), "set AUX_LD");
  }
  check(api.MatrixLayoutCreate(&p.a, type, static_cast<uint64_t>(ma.rows), static_cast<uint64_t>(ma.cols), ma.ld), "layout A");
  check(api.MatrixLayoutCreate(&p.b, type, static_cast<uint64_t>(mb.rows), static_cast<uint64_t>(mb.cols), mb.ld), "layout B");
  check(api.MatrixLayoutCreate(&p.d, type, static_cast<uint64_t>(g.n), static_cast<uint64_t>(g.m), g.n), "layout D");
  set_layout_batch(p.a, g.batch, ma.batch_stride);
  set_layout_batch(p.b, g.batch, mb.batch_stride);
  set_layout_batch(p.d, g.batch, g.d_batch_stride ? g.d_batch_stride : g.m * g.n);
  if (mc) {
    check(api.MatrixLayoutCreate(&p.c, type, static_cast<uint64_t>(g.n), static_cast<uint64_t>(g.m), mc->ld), "layout C");
    set_layout_batch(p.c, g.batch, mc->batch_stride);
  }
  lt::Preference pref = nullptr;
  check(api.MatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
  uint64_t ws = g.workspace_bytes;
  api.MatmulPreferenceSetAttribute(pref, lt::PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  uint32_t al_a = static_cast<uint32_t>(alignment(g.b.ptr)), al_b = static_cast<uint32_t>(alignment(g.a.ptr));
  uint32_t al_d = static_cast<uint32_t>(alignment(g.d));
  uint32_t al_c = mc ? static_cast<uint32_t>(alignment(g.residual.ptr)) : al_d;
  api.MatmulPreferenceSetAttribute(pref, lt::PREF_MIN_ALIGNMENT_A, &al_a, sizeof(al_a));
  api.MatmulPreferenceSetAttribute(pref, lt::PREF_MIN_ALIGNMENT_B, &al_b, sizeof(al_b));
  api.MatmulPreferenceSetAttribute(pref, lt::PREF_MIN_ALIGNMENT_C, &al_c, sizeof(al_c));
  api.MatmulPreferenceSetAttribute(pref, lt::PREF_MIN_ALIGNMENT_D, &al_d, sizeof(al_d));
  // The heuristic looks at the epilogue pointers' alignment too.
  void* bias_ptr = g.bias_grad ? g.bias_grad : const_cast<void*>(g.bias);
  if (bias_ptr) api.MatmulDescSetAttribute(p.desc, lt::DESC_BIAS_POINTER, &bias_ptr, sizeof(bias_ptr));
  if (g.aux) api.MatmulDescSetAttribute(p.desc, lt::DESC_AUX_POINTER, &g.aux, sizeof(g.aux));
  int wanted = std::clamp(g.candidates, 1, kMaxCandidates);
  std::vector<lt::HeuristicResult> results(static_cast<size_t>(wanted));
  int found = 0;
  lt::Handle handle = handle_for_device(current_device());
  lt::Status s = api.MatmulAlgoGetHeuristic(handle, p.desc, p.a, p.b, p.c ? p.c : p.d, p.d, pref, wanted,
                                             results.data(), &found);
  api.MatmulPreferenceDestroy(pref);
  const lt::HeuristicResult& r = results[0];
  if (s != 0 || found == 0 || r.state != 0) {
    std::ostringstream os;
    os << "cuBLASLt has no algorithm for this GEMM (" << dtype_name(g.dtype) << " " << g.batch << "x" << g.m << "x"
       << g.n << "x" << g.k << ", epilogue " << epilogue << ", status " << s << ")";
    p.why = os.str();
    return;
  }
  p.algo = r.algo;
  p.workspace = r.workspace_size;
  for (int i = 0; i < found; ++i)
    if (results[static_cast<size_t>(i)].state == 0) p.candidates.push_back(results[static_cast<size_t>(i)].algo);
  if (g.split_k_max > 1 && g.m <= GemmArgs::kSplitKMaxRows) add_split_k(p, g, handle);
  p.ok = true;
}

// Decode shapes (few rows of A) have few output tiles: the heuristic's
// answers may not split K enough to stream the weight with every SM. Each
// answer that supports split-K is re-cut into 2 .. split_k_max splits,
// reduced in float32 in the workspace where the algorithm allows (no
// atomics: deterministic), else in the output type; cuBLASLt's AlgoCheck
// keeps those it can run within the workspace. Timed with the rest.
void add_split_k(Prepared& p, const GemmArgs& g, lt::Handle handle) {
  const lt::Api& api = cublaslt();
  if (!api.AlgoConfigGetAttribute || !api.AlgoConfigSetAttribute || !api.AlgoCapGetAttribute || !api.AlgoCheck) return;
  std::vector<lt::Algo> base = p.candidates;
  for (const lt::Algo& a : base) {
    int32_t support = 0;
    size_t written = 0;
    if (api.AlgoCapGetAttribute(&a, lt::CAP_SPLITK_SUPPORT, &support, sizeof(support), &written) != 0 || !support)
      continue;
    uint32_t mask = 0;
    if (api.AlgoCapGetAttribute(&a, lt::CAP_REDUCTION_SCHEME_MASK, &mask, sizeof(mask), &written) != 0) continue;
    uint32_t scheme = (mask & lt::REDUCE_COMPUTE_TYPE) ? lt::REDUCE_COMPUTE_TYPE
                      : (mask & lt::REDUCE_OUTPUT_TYPE) ? lt::REDUCE_OUTPUT_TYPE
                                                        : 0;
    if (!scheme) continue;
    uint32_t current = 1;
    api.AlgoConfigGetAttribute(&a, lt::CONFIG_SPLITK_NUM, &current, sizeof(current), &written);
    for (uint32_t split : {2u, 3u, 4u, 6u, 8u, 12u, 16u, 24u, 32u}) {
      if (static_cast<int>(split) > g.split_k_max || split == current) continue;
      if (static_cast<int64_t>(split) * 256 > g.k) break;  // at least 256 of K per split
      lt::Algo v = a;
      if (api.AlgoConfigSetAttribute(&v, lt::CONFIG_SPLITK_NUM, &split, sizeof(split)) != 0 ||
          api.AlgoConfigSetAttribute(&v, lt::CONFIG_REDUCTION_SCHEME, &scheme, sizeof(scheme)) != 0)
        continue;
      bool dup = false;
      for (const lt::Algo& c : p.candidates) dup = dup || std::equal(std::begin(c.data), std::end(c.data), std::begin(v.data));
      if (dup) continue;
      lt::HeuristicResult r{};
      if (api.AlgoCheck(handle, p.desc, p.a, p.b, p.c ? p.c : p.d, p.d, &v, &r) != 0 || r.state != 0 ||
          r.workspace_size > g.workspace_bytes)
        continue;
      p.candidates.push_back(v);
    }
  }
}

// Times each candidate algorithm on the call's own operands (a few runs
// each, on its stream) and keeps the fastest: cuBLASLt's first heuristic
// answer is not always its fastest kernel (skinny decode shapes especially).
// Done once per problem, outside CUDA graph capture; it synchronizes, so it
// belongs to the first call, like compiling. OPFUSE_GEMM_AUTOTUNE=0 keeps
// the heuristic's first answer.
template <class Enqueue>
void autotune(Prepared& p, const GemmArgs& g, Enqueue enqueue) {
  void* stream = g.stream;
  p.tuned = true;
  const char* env = std::getenv("OPFUSE_GEMM_AUTOTUNE");
  if ((env && std::string(env) == "0") || p.candidates.size() < 2) return;
  const CudaApi& c = cuda();
  if (!c.EventCreate || !c.EventRecord || !c.EventSynchronize || !c.EventElapsedTime || !c.EventDestroy ||
      !c.StreamIsCapturing)
    return;
  int capturing = 0;
  if (c.StreamIsCapturing(stream, &capturing) != 0 || capturing != 0) {
    p.tuned = false;  // try again on a call outside capture
    return;
  }
  CUevent start = nullptr, stop = nullptr;
  if (c.EventCreate(&start, 0) != 0) return;
  if (c.EventCreate(&stop, 0) != 0) {
    c.EventDestroy(start);
    return;
  }
  float best = 0, first = 0;
  size_t best_i = 0;
  for (size_t i = 0; i < p.candidates.size(); ++i) {
    if (enqueue(p.candidates[i]) != 0) continue;  // warm-up; an algorithm that fails is skipped
    c.EventRecord(start, stream);
    for (int rep = 0; rep < 3; ++rep) enqueue(p.candidates[i]);
    c.EventRecord(stop, stream);
    float ms = 0;
    if (c.EventSynchronize(stop) != 0 || c.EventElapsedTime(&ms, start, stop) != 0) continue;
    if (i == 0) first = ms;
    if (best == 0 || ms < best) {
      best = ms;
      best_i = i;
    }
  }
  c.EventDestroy(start);
  c.EventDestroy(stop);
  if (best > 0) p.algo = p.candidates[best_i];
  const char* log = std::getenv("OPFUSE_GEMM_LOG");
  if (log && std::string(log) == "1" && best > 0) {
    uint32_t split = 1;
    size_t written = 0;
    const lt::Api& api = cublaslt();
    if (api.AlgoConfigGetAttribute) api.AlgoConfigGetAttribute(&p.algo, lt::CONFIG_SPLITK_NUM, &split, sizeof(split), &written);
    std::fprintf(stderr, "opfuse gemm tuned: batch %lld m %lld n %lld k %lld: %zu candidates, best #%zu (split-K %u) %.2f us, "
                 "heuristic's first %.2f us\n", static_cast<long long>(g.batch), static_cast<long long>(g.m),
                 static_cast<long long>(g.n), static_cast<long long>(g.k), p.candidates.size(), best_i, split,
                 best / 3 * 1e3, first / 3 * 1e3);
  }
}

// The problem's identity, as integers: this runs on every call, so no
// string formatting.
std::vector<int64_t> key_of(const GemmArgs& g, int epilogue, const LtMatrix& ma, const LtMatrix& mb, const LtMatrix* mc,
                            int device) {
  std::vector<int64_t> k = {device, static_cast<int64_t>(g.dtype), g.batch, g.m, g.n, g.k, epilogue, g.allow_tf32,
                            static_cast<int64_t>(g.workspace_bytes), g.float32_bias, g.aux_ld, g.candidates,
                            g.split_k_max, g.d_batch_stride};
  for (const LtMatrix* m : {&ma, &mb, mc}) {
    if (!m) {
      k.push_back(-1);
      continue;
    }
    k.insert(k.end(), {m->rows, m->cols, m->ld, m->batch_stride, m->transposed});
  }
  k.insert(k.end(), {alignment(g.a.ptr), alignment(g.b.ptr), alignment(g.d), mc ? alignment(g.residual.ptr) : 0,
                     alignment(g.bias), alignment(g.aux), alignment(g.bias_grad)});
  return k;
}

}  // namespace

size_t cublaslt_version() {
  const lt::Api& api = cublaslt();
  if (!api.loaded) throw std::runtime_error("cuBLASLt not available: " + api.error);
  return api.GetVersion();
}

void run_gemm(const GemmArgs& g) {
  const lt::Api& api = cublaslt();
  if (!api.loaded) throw std::runtime_error("cuBLASLt not available: " + api.error);
  if (g.m == 0 || g.n == 0 || g.batch == 0) return;
  if (g.k == 0) throw GemmUnsupported("a GEMM over an empty dim (k = 0)");
  if (g.a_mul.ptr) throw GemmUnsupported("a gated A (silu(a) * a_mul) is the skinny GEMM's, not cuBLASLt's");
  if (g.bias && g.n > 1 && g.bias_stride != 1) throw GemmUnsupported("the bias is not contiguous");
  if (g.aux) {  // cuBLASLt: the gelu aux's leading dimension is a multiple of 8, at least D's rows (n)
    int64_t ld = g.aux_ld ? g.aux_ld : g.n;
    if (ld % 8 != 0 || ld < g.n)
      throw GemmUnsupported("the GELU aux matrix needs a row stride that is a multiple of 8 and at least n = " +
                            std::to_string(g.n) + ", got " + std::to_string(ld));
  }
  if (g.float32_bias && g.dtype == DType::Float32) throw std::invalid_argument("float32_bias is for 16-bit GEMMs");
  int epilogue = epilogue_of(g);
  LtMatrix ma = transposed_view(g.k, g.n, g.b, "operand b");  // B^T
  LtMatrix mb = transposed_view(g.m, g.k, g.a, "operand a");  // A^T
  LtMatrix mc;
  if (g.residual.ptr) {
    mc = transposed_view(g.m, g.n, g.residual, "the residual");
    if (mc.transposed) throw GemmUnsupported("the residual is column-major");
  }
  const LtMatrix* pc = g.residual.ptr ? &mc : nullptr;
  int device = current_device();
  std::vector<int64_t> key = key_of(g, epilogue, ma, mb, pc, device);

  static std::mutex cache_mu;
  static std::map<std::vector<int64_t>, std::unique_ptr<Prepared>> cache;
  Prepared* p = nullptr;
  {
    std::lock_guard<std::mutex> lock(cache_mu);
    auto& slot = cache[key];
    if (!slot) {
      slot = std::make_unique<Prepared>();
      build(*slot, g, epilogue, ma, mb, pc);
    }
    p = slot.get();
  }
  if (!p->ok) throw GemmUnsupported(p->why);
  float alpha = 1.0f, beta = g.residual.ptr ? 1.0f : 0.0f;
  std::lock_guard<std::mutex> lock(p->mu);
  void* bias_ptr = g.bias_grad ? g.bias_grad : const_cast<void*>(g.bias);
  if (bias_ptr) check(api.MatmulDescSetAttribute(p->desc, lt::DESC_BIAS_POINTER, &bias_ptr, sizeof(bias_ptr)), "set BIAS_POINTER");
  if (g.aux) check(api.MatmulDescSetAttribute(p->desc, lt::DESC_AUX_POINTER, &g.aux, sizeof(g.aux)), "set AUX_POINTER");
  const void* c_ptr = g.residual.ptr ? g.residual.ptr : g.d;
  lt::Handle handle = handle_for_device(device);
  auto enqueue = [&](const lt::Algo& algo) {
    return api.Matmul(handle, p->desc, &alpha, g.b.ptr, p->a, g.a.ptr, p->b, &beta, c_ptr, p->c ? p->c : p->d, g.d, p->d,
                      &algo, g.workspace, g.workspace_bytes, g.stream);
  };
  if (!p->tuned) autotune(*p, g, enqueue);
  // cuBLASLt checks some combinations only when the call is made (nothing
  // is enqueued then): a refusal, like the heuristic's, for the fallback.
  lt::Status status = enqueue(p->algo);
  if (status == kStatusInvalidValue || status == kStatusNotSupported)
    throw GemmUnsupported(std::string("cublasLtMatmul refused this GEMM (epilogue ") + std::to_string(epilogue) + "): " +
                          (api.GetStatusString ? api.GetStatusString(status) : "") + " (status " + std::to_string(status) + ")");
  check(status, "cublasLtMatmul");
}

}  // namespace opfuse
