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
                                     const std::function<bool(int)>& available) {
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
  // 1. bias (and/or a residual: D = A*B + C + bias, both added before the activation)
  for (int step = 0; step < 2; ++step) {
    int u = single_user(cur);
    if (u < 0) break;
    const Node& add = g.node(u);
    int other = other_addend(add, cur);
    if (other < 0 || add.dtype != mm.dtype) break;
    const Node& o = g.node(other);
    if (o.dtype != mm.dtype || !available(other)) break;
    if (call.bias < 0 && o.op == "input" && is_bias_shape(o.shape, ncols)) {
      call.bias = other;
    } else if (call.residual < 0 && same_shape(o.shape, mm.shape)) {
      call.residual = other;
    } else {
      break;
    }
    take(u);
  }
  // 2. activation: relu or tanh-gelu of the sum. When the sum is also needed
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
    if (!alone && !gelu) continue;  // a relu's input cannot be kept on the side (RELU_AUX is a bit mask)
    if (!alone) call.aux = cur;
    call.activation = relu ? "relu" : "gelu_tanh";
    take(u);
    break;
  }
  return absorbed;
}

int match_gemm_bias_grad(const Graph& g, GemmCall& call) {
  const Node& mm = g.node(call.matmul);
  if (mm.rank() != 2 || call.result != call.matmul) return -1;
  // Candidates: sums over dim 0 of the matrix behind a transposed a (its dim
  // 0 is contracted) or behind a plain b (its dim 0 is contracted).
  for (int which = 0; which < 2; ++which) {
    const GemmOperand& op = which == 0 ? call.a : call.b;
    if (op.transposed != (which == 0)) continue;
    const Node& t = g.node(op.node);
    if (t.rank() != 2 || !same_shape(t.shape, op.shape)) continue;
    for (const Node& s : g.nodes) {
      if (s.op != "sum" || s.inputs.size() != 1 || s.inputs[0] != op.node || s.dtype != mm.dtype) continue;
      auto dims = reduction_dims(s, 2);
      if (dims != std::vector<int64_t>{0}) continue;
      call.bias_grad = s.id;
      call.bias_grad_operand = which;
      return s.id;
    }
  }
  return -1;
}

std::string GemmCall::epilogue_name() const {
  std::string s;
  auto add = [&](const std::string& x) { s += (s.empty() ? "" : "+") + x; };
  if (bias >= 0) add("bias");
  if (residual >= 0) add("residual");
  if (!activation.empty()) add(activation);
  if (aux >= 0) add("aux");
  if (bias_grad >= 0) add("bias_grad");
  return s.empty() ? "none" : s;
}

}  // namespace opfuse
