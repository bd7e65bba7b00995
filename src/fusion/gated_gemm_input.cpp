// The gated-input pass: after planning (CUDA, GEMM library calls), a GEMM
// whose A operand is the product of Llama's gate kernel,
//
//   kernel k - 1:  h = silu(a) * b          (a, b: realized [M, H], e.g. x @ w1^T and x @ w3^T)
//   kernel k:      h @ w2^T (+ epilogue)
//
// with h read by nothing else (no output, no other kernel), is marked with
// a and b (GemmCall::gate_silu, gate_mul). The plan keeps both kernels: with
// OPFUSE_GATED_GEMM=1 the skinny GEMM (M <= 16) reads a and b at run time
// and forms silu(a) * b as it loads A, and the gate kernel is not launched,
// which saves a launch, a kernel boundary and h's round trip through HBM
// (CompiledGraph's launch_gated_gemm); where the skinny GEMM does not take
// the call, the two kernels run as planned. Only adjacent kernels are
// marked, so skipping the gate kernel never reorders anything else.
//
// Opt-in because on the H200 it lost (docs/perf-notes.md, "H200, session
// 15"): every one of the down projection's 64 column tiles forms the
// product again (2 special-function ops an element, 11 M at Llama's M = 16),
// and the loads of A double, which cost the GEMM more than the gate
// kernel's 1-3 us.
#include <set>

#include "fusion/gate_kernel.h"
#include "fusion/passes.h"
#include "ir/ops.h"

namespace opfuse {

void mark_gated_gemm_inputs(FusionPlan& plan) {
  const Graph& g = plan.graph;
  for (size_t k = 1; k < plan.kernels.size(); ++k) {
    KernelGroup& kg = plan.kernels[k];
    if (kg.kind != KernelGroup::Kind::Gemm || kg.gemm.is_decode_mlp()) continue;
    GemmCall& call = kg.gemm;
    const Node& mm = g.node(call.matmul);
    if ((mm.dtype != DType::BFloat16 && mm.dtype != DType::Float16) || mm.rank() != 2) continue;
    const GemmOperand& aop = call.a;
    if (aop.node < 0 || aop.transposed) continue;
    const Node& h = g.node(aop.node);
    if (h.rank() != 2 || h.dtype != mm.dtype || !same_shape(h.shape, aop.shape)) continue;
    const int kh = static_cast<int>(k) - 1;
    if (plan.kernel_of[static_cast<size_t>(h.id)] != kh) continue;
    int a = -1, b = -1;
    if (!is_gate_kernel(plan, kh, h.id, &a, &b)) continue;
    // a and b: realized buffers of h's shape and type (contiguous, like h).
    bool same = true;
    for (int x : {a, b}) same = same && g.node(x).dtype == h.dtype && same_shape(g.node(x).shape, h.shape);
    if (!same || !private_to(plan, h.id, {kh, static_cast<int>(k)})) continue;
    call.gate_silu = a;
    call.gate_mul = b;
  }
}

}  // namespace opfuse
