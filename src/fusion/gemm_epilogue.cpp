#include "fusion/gemm_epilogue.h"

#include <algorithm>

#include "ir/ops.h"

namespace opfuse {
namespace {

bool swaps_last_two(const Node& n) {
  if (n.op != "permute") return false;
  auto dims = n.get_ints("dims");
  int64_t r = static_cast<int64_t>(dims.size());
  if (r < 2) return false;
  for (int64_t i = 0; i < r - 2; ++i)
    if (normalize_dim(dims[static_cast<size_t>(i)], r, n) != i) return false;
  return normalize_dim(dims[static_cast<size_t>(r - 2)], r, n) == r - 1 &&
         normalize_dim(dims[static_cast<size_t>(r - 1)], r, n) == r - 2;
}

// The other operand of a binary add whose one operand is `x`, or -1.
int other_addend(const Node& add, int x) {
  if (add.op != "add" || add.inputs.size() != 2 || add.has("alpha")) return -1;
  if (add.inputs[0] == x && add.inputs[1] != x) return add.inputs[1];
  if (add.inputs[1] == x && add.inputs[0] != x) return add.inputs[0];
  return -1;
}

// A bias for a [M, N] result: shape [N] or [1, N].
bool is_bias_shape(const Shape& s, const Expr& n) {
  int64_t one = 0;
  if (s.size() == 1) return expr_equal(s[0], n);
  return s.size() == 2 && is_const(s[0], &one) && one == 1 && expr_equal(s[1], n);
}

bool is_16bit(DType t) { return t == DType::BFloat16 || t == DType::Float16; }

// The graph input a call reads as its bias when `addend` is added to its
// [M, N] result, or -1: an input of the GEMM's dtype shaped [N] or [1, N];
// with float32 biases allowed, also the cast of such a float32 input to a
// 16-bit GEMM's dtype (autocast's linear layer). cuBLASLt adds the float32
// values as they are: one rounding fewer than the graph writes.
int bias_input(const Graph& g, int addend, const Expr& ncols, DType dtype, bool float32_bias) {
  const Node& o = g.node(addend);
  if (o.dtype != dtype || !is_bias_shape(o.shape, ncols)) return -1;
  if (o.op == "input") return addend;
  if (!float32_bias || o.op != "cast" || !is_16bit(dtype)) return -1;
  const Node& src = g.node(o.inputs[0]);
  return src.op == "input" && src.dtype == DType::Float32 ? src.id : -1;
}

// cuBLASLt's gelu aux matrix (written by GELU_AUX, read by DGELU) needs a
// leading dimension that is a multiple of 8. Where the result's width is a
// constant that is not, no aux epilogue is planned: the run would refuse it
// and fall back to a plan without any epilogue.
bool aux_width_ok(const Expr& ncols) {
  int64_t n = 0;
  return !is_const(ncols, &n) || n % 8 == 0;
}

}  // namespace

GemmOperand resolve_gemm_operand(const Graph& g, int operand, const std::function<bool(int)>& in_memory) {
  // Walk the view chain operand <- [permute of the last two dims] <- [reshape]
  // <- source and stop at the first node that is in memory.
  GemmOperand r;
  int cur = operand;
  auto found = [&](int id, const Shape& shape) {
    r.node = id;
    r.shape = shape;
    return r;
  };
  if (in_memory(cur)) return found(cur, g.node(cur).shape);
  if (swaps_last_two(g.node(cur))) {
    r.transposed = true;
    cur = g.node(cur).inputs[0];
    if (in_memory(cur)) return found(cur, g.node(cur).shape);
  }
  const Node& c = g.node(cur);
  // Through a chain of reshapes to its first source that is in memory or no
  // reshape: only a realized (contiguous) source makes any reshape a view.
  int src = cur;
  while (g.node(src).op == "reshape" && !in_memory(src)) {
    int next = g.node(src).inputs[0];
    const std::string& op = g.node(next).op;
    if (op == "input" || op == "scalar") break;
    src = next;
  }
  return found(src, c.shape);
}

UseInfo::UseInfo(const Graph& g) : users(g.nodes.size()), is_output(g.nodes.size(), false) {
  for (const Node& n : g.nodes)
    for (int i : n.inputs)
      if (std::find(users[static_cast<size_t>(i)].begin(), users[static_cast<size_t>(i)].end(), n.id) ==
          users[static_cast<size_t>(i)].end())
        users[static_cast<size_t>(i)].push_back(n.id);
  for (int o : g.outputs) is_output[static_cast<size_t>(o)] = true;
}

bool UseInfo::only_use(int node, int user) const {
  const auto& u = users[static_cast<size_t>(node)];
  return !is_output[static_cast<size_t>(node)] && u.size() == 1 && u[0] == user;
}

std::vector<int> match_gemm_epilogue(const Graph& g, const UseInfo& use, GemmCall& call,
                                     const std::function<bool(int)>& available, const PlannerOptions& opt) {
  std::vector<int> absorbed;
  const Node& mm = g.node(call.matmul);
  call.result = call.matmul;
  // cuBLASLt's bias and aux pointers have no batch stride here: 2-D only.
  if (mm.rank() != 2) return absorbed;
  const Expr& ncols = mm.shape[1];
  int cur = call.matmul;
  auto single_user = [&](int id) -> int {
    const auto& u = use.users[static_cast<size_t>(id)];
    return (!use.is_output[static_cast<size_t>(id)] && u.size() == 1) ? u[0] : -1;
  };
  auto take = [&](int id) {
    absorbed.push_back(id);
    cur = id;
    call.result = id;
  };
  // 1. The gelu's backward, gelu_backward(a @ b, x), where x (the gelu's
  //    input, which the forward saved) is in memory: DGELU reads x as its
  //    aux. Like the forward's gelu epilogue, bfloat16 only.
  if (int u = single_user(cur); u >= 0) {
    const Node& d = g.node(u);
    if (d.op == "gelu_backward" && d.inputs[0] == cur && d.inputs[1] != cur &&
        d.get_str("approximate", "none") == "tanh" && mm.dtype == DType::BFloat16 && d.dtype == mm.dtype) {
      const Node& x = g.node(d.inputs[1]);
      if (x.dtype == mm.dtype && same_shape(x.shape, mm.shape) && available(x.id) && aux_width_ok(ncols)) {
        call.activation = "dgelu_tanh";
        call.aux = x.id;
        take(u);
        return absorbed;
      }
    }
  }
  // 2. bias (and/or a residual: D = A*B + C + bias, both added before the activation)
  for (int step = 0; step < 2; ++step) {
    int u = single_user(cur);
    if (u < 0) break;
    const Node& add = g.node(u);
    int other = other_addend(add, cur);
    if (other < 0 || add.dtype != mm.dtype) break;
    const Node& o = g.node(other);
    int bias = call.bias < 0 ? bias_input(g, other, ncols, mm.dtype, opt.gemm_float32_bias) : -1;
    if (bias >= 0 && available(bias)) {
      call.bias = bias;
    } else if (call.residual < 0 && o.dtype == mm.dtype && available(other) && same_shape(o.shape, mm.shape)) {
      call.residual = other;
    } else {
      break;
    }
    take(u);
  }
  // 3. activation: relu or tanh-gelu of the sum. When the sum is also needed
  //    elsewhere (the gelu backward reads it), GELU_AUX stores it on the side.
  const auto& users = use.users[static_cast<size_t>(cur)];
  for (int u : users) {
    const Node& a = g.node(u);
    bool relu = a.op == "relu";
    // cuBLASLt's gelu epilogue approximates tanh more coarsely than float32
    // or float16 resolve (a float32 MLP's weight gradient was off by 1e-4
    // relative on the H200): only bfloat16 rounds that away.
    bool gelu = a.op == "gelu" && a.get_str("approximate", "none") == "tanh" && mm.dtype == DType::BFloat16;
    if ((!relu && !gelu) || a.dtype != mm.dtype) continue;
    bool alone = !use.is_output[static_cast<size_t>(cur)] && users.size() == 1;
    // A relu's input cannot be kept on the side (RELU_AUX is a bit mask, and
    // PyTorch's relu backward reads the relu's output, not a mask).
    if (!alone && (!gelu || !aux_width_ok(ncols))) continue;
    if (!alone) call.aux = cur;
    call.activation = relu ? "relu" : "gelu_tanh";
    take(u);
    break;
  }
  return absorbed;
}

std::vector<int> match_gemm_bias_grad(const Graph& g, const UseInfo& use, GemmCall& call,
                                      const std::function<bool(int)>& free, const PlannerOptions& opt) {
  const Node& mm = g.node(call.matmul);
  if (mm.rank() != 2) return {};
  // A sum over dim 0 of node x's [rows, N] matrix (kept dims or not), in the
  // GEMM's dtype, that no other call computes.
  auto sum_over_rows = [&](int x) {
    for (int s : use.users[static_cast<size_t>(x)]) {
      const Node& n = g.node(s);
      if (n.op != "sum" || n.dtype != mm.dtype || !free(s)) continue;
      if (reduction_dims(n, g.node(x).rank()) == std::vector<int64_t>{0}) return s;
    }
    return -1;
  };
  int sum = -1, which = -1;
  if (call.reads_aux()) {
    // DGELU_BGRAD: the bias gradient of the gelu's input is the sum of the
    // call's result over its rows.
    sum = sum_over_rows(call.result);
    which = GemmCall::kBiasGradOfResult;
  } else if (call.result == call.matmul) {
    // Sums over dim 0 of the matrix behind a transposed a (its dim 0 is
    // contracted) or behind a plain b (its dim 0 is contracted).
    for (int w = 0; w < 2 && sum < 0; ++w) {
      const GemmOperand& op = w == 0 ? call.a : call.b;
      if (op.transposed != (w == 0)) continue;
      const Node& t = g.node(op.node);
      if (t.rank() != 2 || !same_shape(t.shape, op.shape)) continue;
      sum = sum_over_rows(op.node);
      which = w == 0 ? GemmCall::kBiasGradOfA : GemmCall::kBiasGradOfB;
    }
  }
  if (sum < 0) return {};
  std::vector<int> taken = {sum};
  call.bias_grad = sum;
  call.bias_grad_operand = which;
  // Autocast: a float32 bias's gradient is the sum cast to float32 (after a
  // reshape that drops a kept dim): the call writes the float32 values.
  if (opt.gemm_float32_bias && is_16bit(mm.dtype)) {
    auto single_user = [&](int id) -> int {
      const auto& u = use.users[static_cast<size_t>(id)];
      return (!use.is_output[static_cast<size_t>(id)] && u.size() == 1) ? u[0] : -1;
    };
    int cur = single_user(sum);
    while (cur >= 0 && g.node(cur).op == "reshape") cur = single_user(cur);
    if (cur >= 0 && g.node(cur).op == "cast" && g.node(cur).dtype == DType::Float32 && free(cur)) {
      call.bias_grad = cur;
      taken.push_back(cur);
    }
  }
  return taken;
}

std::vector<int> GemmCall::written() const {
  std::vector<int> w = {result};
  if (aux >= 0 && !reads_aux()) w.push_back(aux);
  if (bias_grad >= 0) w.push_back(bias_grad);
  return w;
}

std::string GemmCall::epilogue_name() const {
  std::string s;
  auto add = [&](const std::string& x) { s += (s.empty() ? "" : "+") + x; };
  if (is_decode_mlp()) add("decode_mlp" + (decode_activation.empty() ? std::string() : "_" + decode_activation));
  if (bias >= 0) add("bias");
  if (residual >= 0) add("residual");
  if (!activation.empty()) add(activation);
  if (aux >= 0 && !reads_aux()) add("aux");
  if (bias_grad >= 0) add("bias_grad");
  return s.empty() ? "none" : s;
}

}  // namespace opfuse
