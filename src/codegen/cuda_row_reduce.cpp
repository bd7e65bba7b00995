// Row kernels (CUDA): reductions across the threads of a row (warps, blocks,
// clusters and row groups) and the column partials written after the rows.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>
#include <stdexcept>

#include "codegen/cuda_emitter.h"
#include "codegen/cuda_row_schedule.h"
#include "ir/ops.h"

namespace opfuse {
using namespace row_schedule;

// The slot index of a row-group exchange of `width` 8-byte values, counted
// as cluster_reduction's indices in a ring: `width` slots a row parity.
std::string CudaEmitter::group_slot(int width) {
  int base = cluster_reductions_;
  cluster_reductions_ += width;
  ++group_exchanges_;
  return std::to_string(2 * base) + (width == 1 ? " + par_" : " + " + std::to_string(width) + " * par_");
}

// A cluster reduction of `width` 8-byte values: prints `call` with the
// address of its slots in opf_cslot (a cluster that steps through rows uses
// each slot group alternately by row parity: a block may publish row r + 1's
// part before its peers have read row r's) and marks where the kernel's last
// cluster reduction ends (see opf_cluster_arrive in row_kernel). `call`
// holds "@" where the slot's address goes.
void CudaEmitter::cluster_reduction(int width, const std::string& call) {
  int base = cluster_reductions_;
  cluster_reductions_ += width;
  std::string idx = !cluster_row_loop_ ? std::to_string(base)
                    : width == 1       ? std::to_string(2 * base) + " + par_"
                                       : std::to_string(2 * base) + " + " + std::to_string(width) + " * par_";
  std::string c = call;
  c.replace(c.find('@'), 1, "&opf_cslot[" + idx + "]");
  line(c);
  last_cluster_reduce_end_ = static_cast<int64_t>(out_.tellp());
  last_cluster_reduce_indent_ = indent_;
}

void CudaEmitter::reduce_across_threads(const KAccumulator& a) {
  std::string n = acc_name(a);
  const std::string& c = a.combiner;
  std::string op = c == "sum" ? "opf_sum" : c == "prod" ? "opf_prod" : c == "max" ? "opf_max" : "opf_min";
  std::string w = std::to_string(lanes_);
  if (columns_) {  // sum, prod, max or min only (see row_kernel)
    std::string slot = "reinterpret_cast<" + value_type(a.type) + "*>(&opf_cslot[" + std::to_string(32 * cluster_reductions_++) + "])";
    line(n + " = opf_column_reduce<" + op + ", " + std::to_string(cluster_) + ">(" + n + ", opf_csmem, " + slot + ");");
    return;
  }
  if (c == "sum" || c == "prod" || c == "max" || c == "min") {
    if (grouped_rows_) {
      if (lanes_ > 1) line(n + " = opf_warp_reduce<" + op + ", " + w + ">(" + n + ");");
    } else if (cluster_ > 1 && cluster_push_) {
      // OPFUSE_ROW_CLUSTER_PUSH (default in the ring; staged rows split
      // over a cluster, sm_90): each block pushes its partial into every peer's
      // slot with st.async, completing bytes on the peer's mbarrier, and
      // waits on its own mbarrier only. barrier.cluster compiles to
      // MEMBAR.ALL.GPU (its release waits for every earlier store: in the
      // ring, the previous row's output) and CCTL.IVALL (its acquire
      // empties L1, layer_norm's weight and bias with it); this is a
      // shared-memory store and a wait. In the ring, slots and mbarriers
      // alternate by row parity as opf_cslot's do and an mbarrier's phase
      // is its use count, xit_ / 2; a cluster a row uses each once.
      int k = cluster_reductions_++;
      std::string idx = cluster_row_loop_ ? std::to_string(2 * k) + " + par_" : std::to_string(k);
      if (group_exchange_) {  // the same slots by (reduction, parity), in global memory (opf_group_reduce)
        // (The group's address is computed in the call from the kernel
        // argument, not kept in registers: the in-place ring's 512-thread
        // blocks have 40 at three an SM.)
        ++group_exchanges_;
        line(n + " = opf_group_reduce<" + op + ", " + group_args() + ">(" + n + ", " + smem_ + ", a.gx, " + idx + ");");
        return;
      }
      line(n + " = opf_cluster_reduce_push<" + op + ", " + std::to_string(cluster_) + ">(" + n + ", " + smem_ + ", reinterpret_cast<" +
           value_type(a.type) + "*>(opf_xslot[" + idx + "]), &opf_xbar[" + idx + "], " +
           (cluster_row_loop_ ? "(unsigned)(xit_ >> 1) & 1u" : "0u") + ");");
    } else if (cluster_ > 1) {
      cluster_reduction(1, n + " = opf_cluster_reduce<" + op + ", " + std::to_string(cluster_) + ">(" + n + ", " + smem_ +
                               ", reinterpret_cast<" + value_type(a.type) + "*>(@));");
    } else {
      line(n + " = opf_block_reduce<" + op + ">(" + n + ", " + smem_ + ");");
    }
  } else if (c == "argmax" || c == "argmin") {
    std::string mx = c == "argmax" ? "true" : "false";
    if (grouped_rows_) {
      if (lanes_ > 1) line("opf_warp_arg<" + mx + ", " + w + ">(" + n + ", " + acc_name(a, "_i") + ");");
    } else {
      line("opf_block_arg<" + mx + ">(" + n + ", " + acc_name(a, "_i") + ", " + smem_ + ");");
    }
  } else if (c == "welford") {
    if (grouped_rows_) {
      if (lanes_ > 1) line("opf_warp_welford<" + w + ">(" + n + ", " + acc_name(a, "_m2") + ", " + acc_name(a, "_n") + ");");
    } else {
      line("opf_block_welford(" + n + ", " + acc_name(a, "_m2") + ", " + acc_name(a, "_n") + ", " + smem_ + ");");
    }
  }
}

// A stage's accumulators across the threads of a row. In a block per row,
// floating-point sums go two at a time through opf_block_sum2 (one barrier
// for the pair instead of two barriers each): layer_norm backward's
// sum(g) and sum(g * xhat) (OPFUSE_ROW_PAIR_REDUCE=0/1 forces it off/on).
void CudaEmitter::reduce_stage_across_threads(const KStage& st) {
  std::vector<const KAccumulator*> sums;
  int forced = pair_reduce();
  bool block = !grouped_rows_ && !columns_ && cluster_ == 1 && (forced >= 0 ? forced > 0 : caching_);
  for (const KAccumulator& a : st.accs) {
    bool pairable = block && a.combiner == "sum" && (a.type == DType::Float32 || a.type == DType::Float64);
    if (pairable) {
      for (size_t i = 0; i < sums.size(); ++i)
        if (sums[i]->type == a.type) {
          int nw = launch_.threads / 32;
          bool known_warps = sum2_const() > 0 && launch_.threads % 32 == 0 && (nw & (nw - 1)) == 0;
          std::string fn = known_warps ? "opf_block_sum2_w<" + std::to_string(nw) + ">(" : "opf_block_sum2(";
          line(fn + acc_name(*sums[i]) + ", " + acc_name(a) + ", reinterpret_cast<" + value_type(a.type) +
               "*>(opf_psmem), opf_rp_);");
          ++pair_reductions_;
          sums.erase(sums.begin() + static_cast<std::ptrdiff_t>(i));
          pairable = false;
          break;
        }
      if (pairable) sums.push_back(&a);
    } else {
      reduce_across_threads(a);
    }
  }
  for (const KAccumulator* a : sums) reduce_across_threads(*a);
}

// Adds to this thread's partial of the column the current element is in;
// groups that redo the last row (past the end) add nothing.
void CudaEmitter::partial(const KStmt& s) {
  std::string idx = in_lanes_ ? "it_ * " + std::to_string(vec_) + " + j_" : "it_";
  line("if (real_) pp" + std::to_string(s.buffer) + "[" + idx + "] += " + value(s.args[0]) + ";");
}

// After the rows: each thread writes its columns of the partials to the
// part `slot` (row `slot` of the [parts, cols] buffer).
void CudaEmitter::store_partials(int threads_per_row, const std::string& slot) {
  if (partial_buffers_.empty()) return;
  std::string V = std::to_string(vec_), T = std::to_string(threads_per_row);
  line("{");
  ++indent_;
  line("const int64_t slot_ = " + slot + ";");
  line("#pragma unroll");
  line("for (int it_ = 0; it_ < " + std::to_string(partial_items_) + "; ++it_) {");
  ++indent_;
  line("const int64_t c_ = cbase_ + ((int64_t)it_ * " + T + " + tid_) * " + V + ";");
  line("#pragma unroll");
  line("for (int j_ = 0; j_ < " + V + "; ++j_)");
  ++indent_;
  std::string stores;
  for (size_t k = 0; k < partial_buffers_.size(); ++k) {
    int b = partial_buffers_[k];
    std::string bs = std::to_string(b);
    std::string v = "pp" + bs + "[it_ * " + V + " + j_]";
    if (partials_smem_) {
      // Element e = it_ * V + j_ of buffer k sits at ((k * n/4 + e/4) * threads + threadIdx.x) * 4 + e % 4.
      int n = partial_items_ * vec_;
      v = "opf_pps[((" + std::to_string(static_cast<int64_t>(k) * (n / 4)) + " + (it_ * " + V + " + j_) / 4) * " +
          std::to_string(launch_.threads) + " + threadIdx.x) * 4 + (it_ * " + V + " + j_) % 4]";
    }
    stores += " " + store(b, "slot_ * cols + c_ + j_", v);
  }
  line("if (c_ + j_ < cols) {" + stores + " }");
  indent_ -= 2;
  line("}");
  --indent_;
  line("}");
}

// After the rows (OPFUSE_ROW_BLOCK_PARTIALS): the block's lane groups add
// their partials column by column (in a fixed order, group 0 first) and the
// block writes part blockIdx.x. Lane tid_ of a group holds, at element
// e = it_ * V + j_, column (it_ * lanes + tid_) * V + j_: from the shared
// partials (partials_smem_) directly, else through a shared row per group.
void CudaEmitter::store_block_partials(int rows_per_block) {
  if (partial_buffers_.empty()) return;
  std::string V = std::to_string(vec_), L = std::to_string(lanes_), R = std::to_string(rows_per_block);
  std::string TH = std::to_string(launch_.threads);
  int n = partial_items_ * vec_;
  int64_t span = static_cast<int64_t>(partial_items_) * lanes_ * vec_;  // columns a group's lanes cover
  line("{");
  ++indent_;
  line("const int64_t slot_ = blockIdx.x;");
  if (!partials_smem_) line("__shared__ __align__(16) float opf_bp[" + std::to_string(rows_per_block * span) + "];");
  for (size_t k = 0; k < partial_buffers_.size(); ++k) {
    std::string bs = std::to_string(partial_buffers_[k]);
    std::string sum;
    line("__syncthreads();");
    if (partials_smem_) {
      sum = "opf_pps[((" + std::to_string(static_cast<int64_t>(k) * (n / 4)) + " + e_ / 4) * " + TH + " + g_ * " + L +
            " + lane_) * 4 + e_ % 4]";
    } else {
      line("#pragma unroll");
      line("for (int it_ = 0; it_ < " + std::to_string(partial_items_) + "; ++it_)");
      line("  for (int j_ = 0; j_ < " + V + "; ++j_)");
      line("    opf_bp[(threadIdx.x / " + L + ") * " + std::to_string(span) + " + (it_ * " + L + " + tid_) * " + V +
           " + j_] = pp" + bs + "[it_ * " + V + " + j_];");
      line("__syncthreads();");
      sum = "opf_bp[g_ * " + std::to_string(span) + " + c_]";
    }
    line("#pragma unroll 1");
    line("for (int c_ = threadIdx.x; c_ < (int)cols; c_ += " + TH + ") {  // (lane groups: rows of at most 1024)");
    line("  const int lane_ = (int)((c_ / " + V + ") % " + L + ");");
    line("  const int e_ = (int)((c_ / " + V + ") / " + L + ") * " + V + " + (int)(c_ % " + V + ");");
    line("  (void)lane_; (void)e_;");
    line("  float s_ = 0.0f;");
    line("  #pragma unroll 4");
    line("  for (int g_ = 0; g_ < " + R + "; ++g_) s_ += " + sum + ";");
    line("  " + store(partial_buffers_[k], "slot_ * cols + (int64_t)c_", "s_"));
    line("}");
  }
  --indent_;
  line("}");
}

}  // namespace opfuse
