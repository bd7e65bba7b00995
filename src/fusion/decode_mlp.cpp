// The decode MLP pass: after planning, a decode-shaped MLP block becomes one
// call of the decode MLP kernel (src/kernels/decode_mlp/decode_mlp.cu), which
// streams every weight once in a single persistent kernel. At M <= 16 each
// GEMM of the block only reads its weight, and the chain of 2-4 kernels the
// planner forms (cuBLASLt calls, the gate kernel) loses 10-20% to ramps,
// tails and launch gaps (docs/perf-notes.md, "Decode MLP").
//
// Two shapes of the plan are matched, with every weight an nn.Linear weight
// (a graph input [rows, K] read transposed) and x [M, K] a graph input or a
// node another kernel writes (a norm before the block):
//   MLP:    call1 = act(x @ w1^T + b1)  (act none, relu, tanh-gelu; b1 optional)
//           call2 = call1 @ w2^T + b2   (b2 optional)
//   Llama:  call1 = x @ w1^T, call3 = x @ w3^T (no epilogues),
//           a pointwise kernel computing exactly silu(call1) * call3,
//           call2 = that @ w2^T + b2
// where each intermediate is read only inside the block and is no output,
// all sizes are constants, M <= 16, K and H multiples of 8, bf16 or f16.
// Anything else keeps its plan.
#include <algorithm>
#include <functional>
#include <set>

#include "fusion/gate_kernel.h"
#include "fusion/passes.h"
#include "fusion/plan.h"
#include "ir/ops.h"

namespace opfuse {
namespace {

using Kind = KernelGroup::Kind;

bool const_dim(const Expr& e, int64_t* v) { return is_const(e, v); }

// A matrix operand that is an nn.Linear weight: a graph input [rows, cols]
// of `dtype`, read transposed. Sets rows and cols.
bool linear_weight(const Graph& g, const GemmOperand& op, DType dtype, int64_t* rows, int64_t* cols) {
  if (op.node < 0 || !op.transposed) return false;
  const Node& w = g.node(op.node);
  if (w.op != "input" || w.dtype != dtype || w.rank() != 2 || !same_shape(w.shape, op.shape)) return false;
  return const_dim(w.shape[0], rows) && const_dim(w.shape[1], cols);
}

// x: a graph input or a realized node (say a norm's output) [M, K], read as
// it is (a realized node's buffer is contiguous).
bool plain_input(const Graph& g, const GemmOperand& op, DType dtype, int64_t* m, int64_t* k) {
  if (op.node < 0 || op.transposed) return false;
  const Node& x = g.node(op.node);
  if (x.dtype != dtype || x.rank() != 2 || !same_shape(x.shape, op.shape)) return false;
  return const_dim(x.shape[0], m) && const_dim(x.shape[1], k);
}

// A bias the kernel reads: a graph input of the element type (not the
// float32 input a level-2 call reads through a cast).
bool bias_ok(const Graph& g, int bias, DType dtype) {
  return bias < 0 || (g.node(bias).op == "input" && g.node(bias).dtype == dtype);
}

// A call with no epilogue but (optionally) a bias and relu/gelu: the first GEMM of an MLP.
bool plain_call(const GemmCall& c, bool allow_bias_act) {
  if (c.residual >= 0 || c.aux >= 0 || c.bias_grad >= 0 || c.is_decode_mlp()) return false;
  if (!allow_bias_act) return c.bias < 0 && c.activation.empty();
  return c.activation.empty() || c.activation == "relu" || c.activation == "gelu_tanh";
}

class DecodeMlpFuser {
 public:
  DecodeMlpFuser(FusionPlan& plan) : p_(plan), g_(plan.graph) {}

  void run() {
    // Each match removes kernels: start over until nothing matches.
    while (fuse_one()) {
    }
  }

 private:
  FusionPlan& p_;
  const Graph& g_;

  int kernel_of(int node) const { return p_.kernel_of[static_cast<size_t>(node)]; }

  bool fuse_one() {
    for (size_t k2 = 0; k2 < p_.kernels.size(); ++k2) {
      const KernelGroup& second = p_.kernels[k2];
      if (second.kind != Kind::Gemm) continue;
      const GemmCall& c2 = second.gemm;
      const Node& mm2 = g_.node(c2.matmul);
      const DType dt = mm2.dtype;
      if ((dt != DType::BFloat16 && dt != DType::Float16) || mm2.rank() != 2) continue;
      if (!plain_call(c2, true) || !c2.activation.empty()) continue;
      if (!bias_ok(g_, c2.bias, dt)) continue;
      int64_t n = 0, hdim = 0;
      if (!linear_weight(g_, c2.b, dt, &n, &hdim)) continue;
      // The hidden activation: a realized node read as it is.
      const GemmOperand& hop = c2.a;
      if (hop.node < 0 || hop.transposed || !same_shape(g_.node(hop.node).shape, hop.shape)) continue;
      int64_t m = 0, h2 = 0;
      if (g_.node(hop.node).rank() != 2 || !const_dim(hop.shape[0], &m) || !const_dim(hop.shape[1], &h2) || h2 != hdim)
        continue;
      if (m < 1 || m > 16) continue;
      const int kh = kernel_of(hop.node);
      if (kh < 0) continue;
      GemmCall fused = c2;
      std::set<int> inside = {static_cast<int>(k2), kh};
      std::vector<int> privates = {hop.node};
      int64_t kdim = 0;
      const KernelGroup& hk = p_.kernels[static_cast<size_t>(kh)];
      if (hk.kind == Kind::Gemm) {
        const GemmCall& c1 = hk.gemm;
        int64_t m1 = 0, rows = 0, cols = 0;
        if (c1.result != hop.node || !plain_call(c1, true) || g_.node(c1.matmul).dtype != dt) continue;
        if (!bias_ok(g_, c1.bias, dt)) continue;
        if (!plain_input(g_, c1.a, dt, &m1, &kdim) || m1 != m) continue;
        if (!linear_weight(g_, c1.b, dt, &rows, &cols) || rows != hdim || cols != kdim) continue;
        fused.a = c1.a;
        fused.decode_w1 = c1.b.node;
        fused.decode_b1 = c1.bias;
        fused.decode_activation = c1.activation;
      } else {
        int a = -1, b = -1;
        if (!is_gate_kernel(p_, kh, hop.node, &a, &b)) continue;
        const int ka = kernel_of(a), kb = kernel_of(b);
        if (ka == kb || p_.kernels[static_cast<size_t>(ka)].kind != Kind::Gemm ||
            p_.kernels[static_cast<size_t>(kb)].kind != Kind::Gemm)
          continue;
        const GemmCall& c1 = p_.kernels[static_cast<size_t>(ka)].gemm;
        const GemmCall& c3 = p_.kernels[static_cast<size_t>(kb)].gemm;
        if (c1.result != a || c3.result != b || !plain_call(c1, false) || !plain_call(c3, false)) continue;
        if (g_.node(c1.matmul).dtype != dt || g_.node(c3.matmul).dtype != dt) continue;
        int64_t m1 = 0, m3 = 0, k3 = 0, r1 = 0, q1 = 0, r3 = 0, q3 = 0;
        if (!plain_input(g_, c1.a, dt, &m1, &kdim) || !plain_input(g_, c3.a, dt, &m3, &k3)) continue;
        if (c1.a.node != c3.a.node || m1 != m || m3 != m || k3 != kdim) continue;
        if (!linear_weight(g_, c1.b, dt, &r1, &q1) || !linear_weight(g_, c3.b, dt, &r3, &q3)) continue;
        if (r1 != hdim || r3 != hdim || q1 != kdim || q3 != kdim) continue;
        inside.insert(ka);
        inside.insert(kb);
        privates.push_back(a);
        privates.push_back(b);
        fused.a = c1.a;
        fused.decode_w1 = c1.b.node;
        fused.decode_w3 = c3.b.node;
        fused.decode_activation = "silu_gate";
      }
      if (kdim % 8 != 0 || hdim % 8 != 0 || kdim < 1 || n < 1) continue;
      bool ok = true;
      for (int node : privates) ok = ok && private_to(p_, node, inside);
      // (The calls' other roots are their epilogue nodes, which only the
      // call reads: match_gemm_epilogue takes single-use nodes.)
      if (!ok) continue;
      replace(static_cast<int>(k2), inside, fused);
      return true;
    }
    return false;
  }

  // The fused call takes kernel k2's place; the other kernels of `inside` go.
  void replace(int k2, const std::set<int>& inside, const GemmCall& call) {
    KernelGroup fused = p_.kernels[static_cast<size_t>(k2)];
    fused.gemm = call;
    fused.roots.clear();
    for (int k : inside)
      for (int r : p_.kernels[static_cast<size_t>(k)].roots) fused.roots.push_back(r);
    std::sort(fused.roots.begin(), fused.roots.end());
    fused.stores = {call.result};
    std::vector<KernelGroup> kept;
    std::vector<int> new_index(p_.kernels.size(), -1);
    for (size_t k = 0; k < p_.kernels.size(); ++k) {
      if (static_cast<int>(k) == k2) {
        new_index[k] = static_cast<int>(kept.size());
        kept.push_back(fused);
      } else if (!inside.count(static_cast<int>(k))) {
        new_index[k] = static_cast<int>(kept.size());
        kept.push_back(p_.kernels[k]);
      }
    }
    for (int k : inside) new_index[static_cast<size_t>(k)] = new_index[static_cast<size_t>(k2)];
    for (auto& ko : p_.kernel_of)
      if (ko >= 0) ko = new_index[static_cast<size_t>(ko)];
    p_.kernels = std::move(kept);
    // The fused call reads graph inputs only: x, the weights, the biases.
    KernelGroup& f = p_.kernels[static_cast<size_t>(new_index[static_cast<size_t>(k2)])];
    std::set<int> reads;
    for (int id : {call.a.node, call.b.node, call.bias, call.decode_w1, call.decode_w3, call.decode_b1})
      if (id >= 0) reads.insert(id);
    f.reads.assign(reads.begin(), reads.end());
  }
};

}  // namespace

void fuse_decode_mlp(FusionPlan& plan, const PlannerOptions& opt) {
  if (!opt.decode_mlp || !opt.gemm_epilogues) return;
  DecodeMlpFuser(plan).run();
}

}  // namespace opfuse
