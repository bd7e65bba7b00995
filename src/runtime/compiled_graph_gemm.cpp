// CompiledGraph's GEMM steps on the GPU: buffers and strides to a cuBLASLt
// call, or to the skinny GEMM kernel for decode shapes (M <= 16).
#include <map>

#include "runtime/compiled_graph.h"
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
  std::string why;
  if (!decode_mlp::try_run(a, &why)) throw GemmUnsupported("decode MLP: " + why);
  if (o.gemm_kernels) ++*o.gemm_kernels;  // an opfuse kernel, not a library call
}

void CompiledGraph::launch_gemm(const GemmStep& s, const SymbolEnv& env, const std::vector<void*>& ptrs,
                                const std::vector<std::vector<int64_t>>& input_strides, const RunOptions& o) const {
  if (s.call.is_decode_mlp()) {
    launch_decode_mlp(s, env, ptrs, input_strides, o);
    return;
  }
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
  // An opfuse kernel, not a library call: counted as such (RunOptions::gemm_kernels).
  if (skinny::try_run(g)) {
    if (o.gemm_kernels) ++*o.gemm_kernels;
    return;
  }
  run_gemm(g);
}

}  // namespace opfuse
