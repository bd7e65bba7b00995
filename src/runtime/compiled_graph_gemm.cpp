// CompiledGraph's GEMM steps on the GPU: buffers and strides to a cuBLASLt
// call, or to the skinny GEMM kernel for decode shapes (M <= 16).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <set>
#include <string>

#include "runtime/compiled_graph.h"
#include "fusion/gate_kernel.h"
#include "ir/ops.h"
#include "runtime/gemm_launcher.h"
#include "runtime/decode_mlp_launcher.h"
#include "runtime/skinny_gemm_launcher.h"

namespace opfuse {
namespace {

// Strides of a buffer viewed as `shape`: a graph input's own strides (its
// view is its shape), else contiguous.
std::vector<int64_t> view_strides(const BufferSpec& b, int index, const std::vector<int64_t>& shape,
                                  const std::vector<std::vector<int64_t>>& input_strides) {
  if (b.is_input) return input_strides.at(static_cast<size_t>(index));
  std::vector<int64_t> st(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) st[d - 1] = st[d] * std::max<int64_t>(shape[d], 1);
  return st;
}

// A pair that runs as two calls: said on stderr with OPFUSE_GEMM_LOG=1.
bool not_paired(const std::string& why, const GemmArgs& g) {
  const char* log = std::getenv("OPFUSE_GEMM_LOG");
  if (log && std::string(log) == "1")
    std::fprintf(stderr, "opfuse gemm pair %lldx%lldx%lld runs as two calls: %s\n", static_cast<long long>(g.m),
                 static_cast<long long>(g.n), static_cast<long long>(g.k), why.c_str());
  return false;
}

}  // namespace

// The whole MLP block in one decode MLP kernel; where it cannot run (a
// misaligned pointer, no sm_90, a build failure), GemmUnsupported sends the
// Python runtime to a plan without epilogues, as for a refused cuBLASLt call.
void CompiledGraph::launch_decode_mlp(const GemmStep& s, const SymbolEnv& env, const std::vector<void*>& ptrs,
                                      const std::vector<std::vector<int64_t>>& input_strides, const RunOptions& o) const {
  auto dim = [&](int buffer, int d) { return evaluate(buffers_[static_cast<size_t>(buffer)].shape.at(static_cast<size_t>(d)), env); };
  // A buffer's row stride, requiring unit-stride rows (the planner matched [rows, cols] matrices): a
  // graph input's own strides, a written buffer's contiguous ones.
  auto row_stride = [&](int buffer) {
    const BufferSpec& b = buffers_[static_cast<size_t>(buffer)];
    if (!b.is_input) return dim(buffer, 1);
    const auto& st = input_strides.at(static_cast<size_t>(buffer));
    if (st.size() != 2 || (dim(buffer, 1) > 1 && st[1] != 1))
      throw GemmUnsupported("decode MLP: an operand's rows are not unit-stride");
    return st[0];
  };
  auto vec_stride = [&](int buffer) { return buffer < 0 ? int64_t{1} : input_strides.at(static_cast<size_t>(buffer)).back(); };
  decode_mlp::Args a;
  a.dtype = s.dtype;
  a.m = dim(s.a, 0);
  a.k = dim(s.a, 1);
  a.h = dim(s.w1, 0);
  a.n = dim(s.b, 0);
  a.x = ptrs[static_cast<size_t>(s.a)];
  a.ldx = row_stride(s.a);
  a.w1 = ptrs[static_cast<size_t>(s.w1)];
  a.ldw1 = row_stride(s.w1);
  if (s.w3 >= 0) {
    a.w3 = ptrs[static_cast<size_t>(s.w3)];
    a.ldw3 = row_stride(s.w3);
  }
  if (s.b1 >= 0) a.b1 = ptrs[static_cast<size_t>(s.b1)];
  a.b1_stride = vec_stride(s.b1);
  a.w2 = ptrs[static_cast<size_t>(s.b)];
  a.ldw2 = row_stride(s.b);
  if (s.bias >= 0) a.b2 = ptrs[static_cast<size_t>(s.bias)];
  a.b2_stride = vec_stride(s.bias);
  a.out = ptrs[static_cast<size_t>(s.out)];
  a.ldo = a.n;
  a.activation = s.call.decode_activation;
  a.stream = o.stream;
  static_assert(decode_mlp::kWorkspaceBytes == kDecodeRegionBytes, "the decode MLP's region of the zeroed workspace");
  a.workspace = o.zeroed_workspace;
  a.workspace_bytes = o.zeroed_workspace_bytes;
  std::string why;
  if (!decode_mlp::try_run(a, &why)) throw GemmUnsupported("decode MLP: " + why);
  if (o.gemm_kernels) ++*o.gemm_kernels;  // an opfuse kernel, not a library call
}

// A GEMM step whose A is silu(gate_silu) * gate_mul, both buffers of A's
// shape (contiguous, like A's own), read in place of A by the skinny GEMM.
// Returns false, with nothing enqueued, when the skinny GEMM does not take it
// (OPFUSE_SKINNY_GEMM, shape, device, alignment): the gate kernel and the
// step then run as planned.
bool CompiledGraph::launch_gated_gemm(const GemmStep& s, const SymbolEnv& env, const std::vector<void*>& ptrs,
                                      const std::vector<std::vector<int64_t>>& input_strides, const RunOptions& o) const {
  if (s.gate_silu < 0 || s.gate_mul < 0 || buffers_[static_cast<size_t>(s.a)].is_input) return false;
  GemmArgs g = gemm_args(s, env, ptrs, input_strides, o);
  g.a_mul = g.a;
  g.a.ptr = ptrs[static_cast<size_t>(s.gate_silu)];
  g.a_mul.ptr = ptrs[static_cast<size_t>(s.gate_mul)];
  if (!skinny::try_run(g)) return false;
  if (o.gemm_kernels) ++*o.gemm_kernels;
  return true;
}

GemmArgs CompiledGraph::gemm_args(const GemmStep& s, const SymbolEnv& env, const std::vector<void*>& ptrs,
                                  const std::vector<std::vector<int64_t>>& input_strides, const RunOptions& o) const {
  auto concrete = [&](const Shape& sh) {
    std::vector<int64_t> v;
    for (auto& d : sh) v.push_back(evaluate(d, env));
    return v;
  };
  auto matrix = [&](const GemmOperand& op, int buffer, int64_t* rows, int64_t* cols) {
    std::vector<int64_t> shape = concrete(op.shape);
    std::vector<int64_t> st = view_strides(buffers_[static_cast<size_t>(buffer)], buffer, shape, input_strides);
    size_t r = shape.size();
    GemmMatrix m;
    m.ptr = ptrs[static_cast<size_t>(buffer)];
    m.batch_stride = r == 3 ? st[0] : 0;
    m.row_stride = st[r - 2];
    m.col_stride = st[r - 1];
    *rows = shape[r - 2];
    *cols = shape[r - 1];
    if (op.transposed) {
      std::swap(m.row_stride, m.col_stride);
      std::swap(*rows, *cols);
    }
    return m;
  };
  GemmArgs g;
  g.dtype = s.dtype;
  int64_t k2 = 0, n = 0;
  g.a = matrix(s.call.a, s.a, &g.m, &g.k);
  g.b = matrix(s.call.b, s.b, &k2, &n);
  g.n = n;
  std::vector<int64_t> out_shape = concrete(plan_.graph.node(s.call.matmul).shape);
  g.batch = out_shape.size() == 3 ? out_shape[0] : 1;
  g.d = ptrs[static_cast<size_t>(s.out)];
  // A float32 bias or bias gradient beside 16-bit matrices (autocast).
  auto float32_beside_16bit = [&](int buffer) {
    return buffers_[static_cast<size_t>(buffer)].dtype == DType::Float32 && s.dtype != DType::Float32;
  };
  if (s.bias >= 0) {
    g.bias = ptrs[static_cast<size_t>(s.bias)];
    const BufferSpec& b = buffers_[static_cast<size_t>(s.bias)];
    g.bias_stride = b.is_input ? input_strides.at(static_cast<size_t>(s.bias)).back() : 1;
    g.float32_bias = float32_beside_16bit(s.bias);
  }
  if (s.residual >= 0) {
    GemmOperand r;
    r.shape = plan_.graph.node(s.call.residual).shape;
    int64_t rm = 0, rn = 0;
    g.residual = matrix(r, s.residual, &rm, &rn);
  }
  g.activation = s.call.activation;
  if (s.aux >= 0) g.aux = ptrs[static_cast<size_t>(s.aux)];
  if (s.aux >= 0 && s.call.reads_aux()) {
    // The gelu input the forward saved, read by DGELU in D's layout: rows of
    // unit-stride elements, at any row stride cuBLASLt takes (checked there).
    GemmOperand x;
    x.shape = plan_.graph.node(s.call.aux).shape;
    int64_t rows = 0, cols = 0;
    GemmMatrix m = matrix(x, s.aux, &rows, &cols);
    if (cols > 1 && m.col_stride != 1)
      throw GemmUnsupported("the saved gelu input has column stride " + std::to_string(m.col_stride) +
                            ": the gelu backward epilogue reads it row-major");
    g.aux_ld = rows > 1 ? m.row_stride : g.n;
  }
  if (s.bias_grad >= 0) {
    g.bias_grad = ptrs[static_cast<size_t>(s.bias_grad)];
    g.bias_grad_operand = s.call.bias_grad_operand;
    g.float32_bias = float32_beside_16bit(s.bias_grad);
  }
  g.workspace = o.workspace;
  g.workspace_bytes = o.workspace_bytes;
  g.allow_tf32 = o.allow_tf32;
  g.stream = o.stream;
  g.candidates = gemm_candidates_;
  g.split_k_max = gemm_split_k_;
  return g;
}

void CompiledGraph::launch_gemm(const GemmStep& s, const SymbolEnv& env, const std::vector<void*>& ptrs,
                                const std::vector<std::vector<int64_t>>& input_strides, const RunOptions& o) const {
  if (s.call.is_decode_mlp()) {
    launch_decode_mlp(s, env, ptrs, input_strides, o);
    return;
  }
  GemmArgs g = gemm_args(s, env, ptrs, input_strides, o);
  // An opfuse kernel, not a library call: counted as such (RunOptions::gemm_kernels).
  if (skinny::try_run(g)) {
    if (o.gemm_kernels) ++*o.gemm_kernels;
    return;
  }
  run_gemm(g);
}

// Two GEMMs of one A and two B of one shape and layout (Llama's gate and up
// projections, x @ w1^T and x @ w3^T) as one launch of the skinny GEMM's
// TMA kernel where it takes them (skinny::try_run_pair), else as one
// strided-batched cuBLASLt call:
// A's batch stride is 0, B's the distance between the two weights, D's the
// distance between the two results, which the caller allocated in one
// block, the second at the next 256-byte boundary (paired_buffers()). One
// launch streams both weights, with one ramp and one tail.
//
// Returns false, and the caller runs the two calls, where this run's
// pointers do not allow it: a distance that is not a multiple of 16 bytes
// (the heuristic sees the first batch's alignment only), results that
// overlap, cuBLASLt refusing the batched call, or OPFUSE_SKINNY_GEMM=1
// giving these GEMMs to the skinny kernel. The two results are scratch buffers of one
// shape that no caller sees, so when the weights lie in the opposite order
// to the results, their pointers are swapped in `ptrs` (which every later
// step reads) rather than asking for a negative stride.
bool CompiledGraph::launch_gemm_pair(const GemmStep& x, const GemmStep& y, const SymbolEnv& env, std::vector<void*>& ptrs,
                                     const std::vector<std::vector<int64_t>>& input_strides, const RunOptions& o,
                                     const PairGate* gate, bool* gate_folded) const {
  GemmArgs gx = gemm_args(x, env, ptrs, input_strides, o);
  if (gx.m > gemm_pair_max_rows_) return false;  // the default's size bound: two calls, as measured
  GemmArgs gy = gemm_args(y, env, ptrs, input_strides, o);
  if (gx.batch != 1 || gy.batch != 1 || gx.m != gy.m || gx.n != gy.n || gx.k != gy.k || gx.a.ptr != gy.a.ptr ||
      gx.a.row_stride != gy.a.row_stride || gx.a.col_stride != gy.a.col_stride ||
      gx.b.row_stride != gy.b.row_stride || gx.b.col_stride != gy.b.col_stride)
    return not_paired("operands differ", gx);
  // Where the skinny GEMM takes each (decode shapes on sm_90), one launch of
  // its TMA kernel computes both: one ramp and one tail for both weights,
  // level with cuBLAS on one GEMM of both weights' rows (docs/perf-notes.md,
  // "H200, session 17").
  // Where Llama's gate kernel alone reads the two results, the same launch
  // may form its product h instead (one kernel fewer, and neither result
  // goes through HBM).
  if (gate && skinny::try_run_gated_pair(gx, gy, ptrs[static_cast<size_t>(gate->h)], gate->first_is_gate)) {
    if (o.gemm_kernels) ++*o.gemm_kernels;
    *gate_folded = true;
    return true;
  }
  if (skinny::try_run_pair(gx, gy)) {
    if (o.gemm_kernels) ++*o.gemm_kernels;
    return true;
  }
  // A pair streams both weights at ~93% of the copy (one ramp, one tail):
  // it stays a pair unless OPFUSE_SKINNY_GEMM=1 asks the skinny kernel for everything.
  if (skinny::mode_all() && skinny::takes(gx)) return not_paired("the skinny GEMM takes it", gx);
  int64_t elem = static_cast<int64_t>(dtype_size(gx.dtype));
  int64_t b_diff = static_cast<int64_t>(reinterpret_cast<intptr_t>(gy.b.ptr) - reinterpret_cast<intptr_t>(gx.b.ptr));
  int64_t d_diff = static_cast<int64_t>(reinterpret_cast<intptr_t>(gy.d) - reinterpret_cast<intptr_t>(gx.d));
  // Each batch of B and D starts 16-byte aligned like the first (the
  // heuristic sees the first's alignment only), and D's two results do not overlap.
  int64_t d_abs = d_diff < 0 ? -d_diff : d_diff;
  if (b_diff == 0 || b_diff % 16 != 0 || d_abs % 16 != 0 || d_abs < gx.m * gx.n * elem)
    return not_paired("weights or results apart (b " + std::to_string(b_diff) + " bytes, d " + std::to_string(d_diff) +
                      ")", gx);
  if ((b_diff > 0) != (d_diff > 0)) {
    std::swap(ptrs[static_cast<size_t>(x.out)], ptrs[static_cast<size_t>(y.out)]);
    std::swap(gx.d, gy.d);
  }
  GemmArgs g = b_diff > 0 ? gx : gy;
  g.batch = 2;
  g.a.batch_stride = 0;
  g.b.batch_stride = (b_diff > 0 ? b_diff : -b_diff) / elem;
  g.d_batch_stride = d_abs / elem;
  try {
    run_gemm(g);
  } catch (const GemmUnsupported& e) {
    // the two calls instead (the pointers as swapped above: every step reads them)
    return not_paired(std::string("cuBLASLt refused the batched call: ") + e.what(), gx);
  }
  return true;
}

// Pairs GEMM steps that read the same A buffer through the same view and two
// different B buffers of one shape and view, with no epilogue that reads a
// per-call operand (no bias, residual, aux or bias gradient; the same
// activation), 2-D, whose results are same-shaped scratch buffers (no graph
// output): the second can run at the first's place when its B is a graph
// input or written by an earlier step. CUDA only. By default a pair runs as
// one call where A has at most kPairDefaultMaxRows rows (decode shapes, where
// it measured 6 us faster on Llama's 16x4096x11008; at 8192 rows it measured
// level with the two calls: docs/perf-notes.md, GEMM run 3);
// OPFUSE_GEMM_PAIRS=1 at every size, OPFUSE_GEMM_PAIRS=0 never.
// Also reads the algorithm search knobs of the graph's GEMM steps.
void CompiledGraph::pair_gemms() {
  pair_of_.assign(gemms_.size(), -1);
  auto knob = [](const char* name, int fallback) {
    const char* v = std::getenv(name);
    return v && *v ? std::atoi(v) : fallback;
  };
  gemm_candidates_ = std::clamp(knob("OPFUSE_GEMM_CANDIDATES", 8), 1, 64);
  gemm_split_k_ = std::clamp(knob("OPFUSE_GEMM_SPLITK", 0), 0, 32);
  const char* env = std::getenv("OPFUSE_GEMM_PAIRS");
  std::string mode = env ? env : "";
  gemm_pair_max_rows_ = mode == "1" ? std::numeric_limits<int64_t>::max() : kPairDefaultMaxRows;
  if (target_ != Target::CUDA || mode == "0") return;
  const Graph& pg = plan_.graph;
  // The step position writing each buffer (inputs: -1).
  std::vector<int> written_at(buffers_.size(), -1);
  std::vector<int> gemm_pos(gemms_.size(), -1);
  for (size_t pos = 0; pos < steps_.size(); ++pos) {
    auto [gemm, index] = steps_[pos];
    if (gemm) {
      const GemmStep& s = gemms_[static_cast<size_t>(index)];
      gemm_pos[static_cast<size_t>(index)] = static_cast<int>(pos);
      for (int b : {s.out, s.aux, s.bias_grad})
        if (b >= 0) written_at[static_cast<size_t>(b)] = static_cast<int>(pos);
    } else {
      for (int b : launches_[static_cast<size_t>(index)].buffers)
        if (!buffers_[static_cast<size_t>(b)].is_input && written_at[static_cast<size_t>(b)] < 0)
          written_at[static_cast<size_t>(b)] = static_cast<int>(pos);
    }
  }
  auto is_output = [&](int b) {
    return std::find(output_buffers_.begin(), output_buffers_.end(), b) != output_buffers_.end();
  };
  auto plain = [&](const GemmStep& s) {
    return !s.call.is_decode_mlp() && s.bias < 0 && s.residual < 0 && s.aux < 0 && s.bias_grad < 0 && pg.node(s.call.matmul).rank() == 2 &&
           !is_output(s.out);
  };
  auto same_view = [](const GemmOperand& x, const GemmOperand& y) {
    return x.transposed == y.transposed && same_shape(x.shape, y.shape);
  };
  for (size_t i = 0; i < gemms_.size(); ++i) {
    const GemmStep& x = gemms_[i];
    if (pair_of_[i] != -1 || !plain(x)) continue;
    for (size_t j = i + 1; j < gemms_.size(); ++j) {
      const GemmStep& y = gemms_[j];
      // One A: the same buffer, or two graph inputs (the backend passes each
      // x.view(...) of a 3-D activation as its own input) whose pointers and
      // strides launch_gemm_pair compares per run.
      bool one_a = y.a == x.a || (buffers_[static_cast<size_t>(x.a)].is_input && buffers_[static_cast<size_t>(y.a)].is_input);
      if (pair_of_[j] != -1 || !plain(y) || !one_a || y.b == x.b || y.dtype != x.dtype ||
          y.call.activation != x.call.activation || !same_view(x.call.a, y.call.a) || !same_view(x.call.b, y.call.b) ||
          buffers_[static_cast<size_t>(x.b)].dtype != buffers_[static_cast<size_t>(y.b)].dtype ||
          !same_shape(buffers_[static_cast<size_t>(x.out)].shape, buffers_[static_cast<size_t>(y.out)].shape) ||
          written_at[static_cast<size_t>(y.b)] >= gemm_pos[i])
        continue;
      pair_of_[i] = static_cast<int>(j);
      pair_of_[j] = -2;  // a second: in no other pair
      break;
    }
  }
  for (int& p : pair_of_)
    if (p == -2) p = -1;
  mark_pair_gates();
}

// A pair whose two results are exactly a later GEMM's gated A (Llama's
// silu(x @ w1^T) * (x @ w3^T), marked by the plan's gated-input pass) and
// are read by nothing but the gate kernel: the pair's launch may write the
// gate's product itself. OPFUSE_GATED_PAIR=0 turns it off; with
// OPFUSE_GATED_GEMM=1 the down projection reads the gate instead (opt-in).
void CompiledGraph::mark_pair_gates() {
  pair_gate_.assign(gemms_.size(), PairGate{});
  const char* env = std::getenv("OPFUSE_GATED_PAIR");
  if (env && std::string(env) == "0") return;
  for (size_t i = 0; i < gemms_.size(); ++i) {
    if (pair_of_[i] < 0) continue;
    const GemmStep& x = gemms_[i];
    const GemmStep& y = gemms_[static_cast<size_t>(pair_of_[i])];
    if (x.call.activation != "" || y.call.activation != "") continue;
    for (const GemmStep& d : gemms_) {
      // OPFUSE_GATED_GEMM=1 gave this gate to the down projection (gate_gemm_of_): it keeps it.
      if (d.gate_kernel < 0 || gate_gemm_of_[static_cast<size_t>(d.gate_kernel)] >= 0) continue;
      const bool x_gate = d.gate_silu == x.out && d.gate_mul == y.out;
      if (!x_gate && !(d.gate_silu == y.out && d.gate_mul == x.out)) continue;
      const std::set<int> only_gate{d.gate_step};
      if (!private_to(plan_, buffers_[static_cast<size_t>(x.out)].node, only_gate) ||
          !private_to(plan_, buffers_[static_cast<size_t>(y.out)].node, only_gate))
        continue;
      pair_gate_[i] = PairGate{d.gate_kernel, d.a, x_gate};
      break;
    }
  }
}

std::vector<std::pair<int, int>> CompiledGraph::gemm_pairs() const {
  std::vector<std::pair<int, int>> r;
  for (size_t i = 0; i < pair_of_.size(); ++i)
    if (pair_of_[i] >= 0) r.emplace_back(static_cast<int>(i), pair_of_[i]);
  return r;
}

std::vector<std::tuple<int, int, int, bool>> CompiledGraph::pair_gates() const {
  std::vector<std::tuple<int, int, int, bool>> r;
  for (size_t i = 0; i < pair_gate_.size(); ++i)
    if (pair_gate_[i].kernel >= 0)
      r.emplace_back(static_cast<int>(i), pair_gate_[i].kernel, pair_gate_[i].h, pair_gate_[i].first_is_gate);
  return r;
}

std::vector<std::pair<int, int>> CompiledGraph::paired_buffers() const {
  std::vector<std::pair<int, int>> r;
  for (auto [i, j] : gemm_pairs()) r.emplace_back(gemms_[static_cast<size_t>(i)].out, gemms_[static_cast<size_t>(j)].out);
  return r;
}

}  // namespace opfuse
