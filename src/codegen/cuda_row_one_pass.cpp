// Row kernels (CUDA): stage pairs that one pass or one exchange can take:
// softmax's max and sum of exp, layer_norm's mean and variance (the online
// pair, the shifted moments, and a row group's local reference).
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

// Two stages k, k+1 that one pass can take: each has one float32
// accumulator (stage k's combines with `first`, stage k+1's sums; `means`
// says whether each divides by the count), stage k+1 has no pre statements
// and stores nothing, and its accumulator adds f(u' - r), where r is stage
// k's result (used nowhere else in stage k+1's loop), u' is stage k's
// accumulated value u recomputed, and `is_f` tells f's statement. Returns k,
// or -1.
int CudaEmitter::one_pass_stage(const std::string& first, std::pair<bool, bool> means,
                                const std::function<bool(const KStmt&)>& is_f, size_t from) const {
  StatementKey key = [&](const KStmt& s, const std::vector<std::string>& a) { return statement_key(s, a); };
  auto keys_of = [&](const KStage& st) {
    std::map<int, std::string> vk;
    for (const KStmt& x : st.loop) {
      std::vector<std::string> args;
      for (int a : x.args) args.push_back(vk.count(a) ? vk[a] : "v" + std::to_string(a));
      if (x.dst >= 0) vk[x.dst] = key(x, args);
    }
    return vk;
  };
  for (size_t k = from; k + 1 < k_->stages.size(); ++k) {
    const KStage& a = k_->stages[k];
    const KStage& b = k_->stages[k + 1];
    if (a.accs.size() != 1 || b.accs.size() != 1 || !b.pre.empty()) continue;
    const KAccumulator& r = a.accs[0];
    const KAccumulator& t = b.accs[0];
    if (r.combiner != first || t.combiner != "sum" || r.type != DType::Float32 || t.type != DType::Float32 ||
        r.mean != means.first || t.mean != means.second)
      continue;
    int u = -1, e = -1;
    bool stores = false;
    for (const KStmt& x : a.loop)
      if (x.kind == KStmt::Update) u = x.args[0];
    for (const KStmt& x : b.loop) {
      if (x.kind == KStmt::Update) e = x.args[0];
      if (x.kind == KStmt::Store) stores = true;
    }
    if (u < 0 || e < 0 || stores) continue;
    const KStmt* f_stmt = nullptr;
    const KStmt* sub_stmt = nullptr;
    int uses_of_r = 0;
    for (const KStmt& x : b.loop) {
      if (x.dst == e && is_f(x)) f_stmt = &x;
      for (int arg : x.args) uses_of_r += arg == r.result;
    }
    if (!f_stmt || uses_of_r != 1) continue;
    for (const KStmt& x : b.loop)
      if (x.dst == f_stmt->args[0] && x.kind == KStmt::Compute && x.node.op == "sub" && x.args[1] == r.result) sub_stmt = &x;
    if (!sub_stmt) continue;
    auto ka = keys_of(a), kb = keys_of(b);
    if (!ka.count(u) || !kb.count(sub_stmt->args[0]) || ka[u] != kb[sub_stmt->args[0]]) continue;
    return static_cast<int>(k);
  }
  return -1;
}

// Softmax's max stage followed by its sum-of-exp stage, which loop stages
// (rows not cached in registers) can run as one pass with an online
// (max, sum) pair: f is exp.
int CudaEmitter::online_softmax_stage(size_t from) const {
  return one_pass_stage("max", {false, false}, [](const KStmt& x) { return x.kind == KStmt::Compute && x.node.op == "exp"; }, from);
}

// layer_norm's mean stage followed by its variance stage (a mean of d * d),
// which a staged row can take as one pass of shifted sums (see row_kernel).
int CudaEmitter::moments_stage(size_t from) const {
  return one_pass_stage(
      "sum", {true, true},
      [](const KStmt& x) { return x.kind == KStmt::Compute && x.node.op == "mul" && x.args.size() == 2 && x.args[0] == x.args[1]; },
      from);
}

// Every softmax-like and layer_norm-like stage pair (see one_pass_stage)
// whose second loop uses nothing the first stage's post statements define:
// the second loop runs before them, against the block's own max or mean
// (local_reference_pair).
std::map<int, bool> CudaEmitter::local_reference_stages() const {
  std::map<int, bool> found;
  auto add = [&](int k, bool moments) {
    if (k < 0 || found.count(k) || found.count(k - 1) || found.count(k + 1)) return;
    std::set<int> post;
    for (const KStmt& x : k_->stages[static_cast<size_t>(k)].post)
      if (x.dst >= 0) post.insert(x.dst);
    for (const KStmt& x : k_->stages[static_cast<size_t>(k) + 1].loop)
      for (int arg : x.args)
        if (post.count(arg)) return;
    found[k] = moments;
  };
  for (size_t k = 0; k + 1 < k_->stages.size(); ++k) {
    if (online_softmax_stage(k) == static_cast<int>(k)) add(static_cast<int>(k), false);
    if (moments_stage(k) == static_cast<int>(k)) add(static_cast<int>(k), true);
  }
  return found;
}

// Two reductions a row with one exchange across a row group
// (OPFUSE_ROW_GROUP_LOCAL): the first (softmax's max, layer_norm's mean)
// across the block only; the second loop (sum of exp(x - r), of (x - r)^2)
// against the block's own r; then the blocks' pairs (max, sum) or triples
// (count, mean, squared deviations) combine in one exchange, exactly as
// the two passes would within rounding: sum exp(x - M) = sum_b exp(m_b - M)
// * s_b, and Chan's update for the moments. Unlike the online pair (one
// exp per element plus a rescale per vector) and the shifted sums, the
// loops stay those of the two passes: the extra cost is one block
// reduction, where the second exchange through L2 is saved.
void CudaEmitter::local_reference_pair(const KStage& st, const KStage& next, bool moments, int items, int threads_per_row) {
  const KAccumulator& ra = st.accs[0];
  const KAccumulator& rb = next.accs[0];
  for (auto& s : st.pre) statement(s, st);
  accumulator_init(ra);
  accumulator_init(rb);
  if (!st.loop.empty()) row_stage_loop(st, items, threads_per_row);
  const std::string a = acc_name(ra), b = acc_name(rb), n = a + "_n";
  std::string ref;
  if (moments) {
    line(a + " = opf_block_reduce<opf_sum>(" + a + ", " + smem_ + ");");
    line(a + " = cend_ > cbegin_ ? " + a + " / (float)(cend_ - cbegin_) : 0.0f;  // the block's mean of its columns of the row");
    ref = a;
  } else {
    // A block whose part is all -inf has max -inf: its sum runs against 0
    // (exp(-inf - 0) adds nothing) and its pair adds nothing to the group's.
    line(a + " = opf_block_reduce<opf_max>(" + a + ", " + smem_ + ");");
    ref = a + " == opf_lowest<float>() ? 0.0f : " + a;
  }
  line("{");
  ++indent_;
  line("const " + value_type(ra.result_type) + " " + value(ra.result) + " = " + ref + ";");
  ++stage_index_;
  if (!next.loop.empty()) row_stage_loop(next, items, threads_per_row);
  --stage_index_;
  --indent_;
  line("}");
  if (moments) {
    // (The count after the loop, not kept live across it: it is cend_ - cbegin_.)
    line("float " + n + " = (float)(cend_ > cbegin_ ? cend_ - cbegin_ : 0);");
    line("opf_group_local_moments<" + group_args() + ">(" + n + ", " + a + ", " + b + ", " + smem_ + ", a.gx, " + group_slot(2) + ");");
    line(a + " *= " + n + ";");  // the mean accumulator's finish divides the sum by the count
  } else {
    line(std::string("opf_group_local_online<") + (fast_math_ ? "true" : "false") + ", " + group_args() + ">(" + a + ", " + b + ", " +
         smem_ + ", a.gx, " + group_slot(1) + ");");
  }
  accumulator_finish(ra);
  for (auto& s : st.post) statement(s, st);
  accumulator_finish(rb);
  for (auto& s : next.post) statement(s, next);
}

// A staged row's mean and variance in one pass (OPFUSE_ROW_STAGE_MOMENTS=1,
// see row_kernel): each thread's shifted sums, then (count, mean, squared
// deviations) across the block, cluster or row group.
void CudaEmitter::moments_pair(const KStage& st, const KStage& next, int items, int threads_per_row) {
  const KAccumulator& mn = st.accs[0];
  const KAccumulator& vr = next.accs[0];
  for (auto& s : st.pre) statement(s, st);
  accumulator_init(mn);
  accumulator_init(vr);
  line("float wk_ = 0.0f, wn_ = 0.0f;");
  moments_mean_ = acc_name(mn);
  online_acc_ = acc_name(vr);
  if (!st.loop.empty()) row_stage_loop(st, items, threads_per_row);
  moments_mean_.clear();
  online_acc_.clear();
  // (mean, squared deviations) of the thread, then of the row; the sum
  // the mean accumulator's finish divides is mean x count.
  std::string m = acc_name(mn), m2 = acc_name(vr);
  line("opf_shifted_moments(wn_, wk_, " + m + ", " + m2 + ");");
  if (cluster_ > 1 && group_exchange_) {
    line("opf_group_moments<" + group_args() + ">(wn_, " + m + ", " + m2 + ", " + smem_ + ", a.gx, " + group_slot(2) + ");");
  } else if (cluster_ > 1) {
    // Two 8-byte slots: count, mean, squared deviations.
    cluster_reduction(2, "opf_cluster_moments<" + std::to_string(cluster_) + ">(wn_, " + m + ", " + m2 + ", " + smem_ +
                             ", reinterpret_cast<float*>(@));");
  } else {
    line("opf_block_moments(wn_, " + m + ", " + m2 + ", " + smem_ + ");");
  }
  line(m + " *= wn_;");
  accumulator_finish(mn);
  for (auto& s : st.post) statement(s, st);
  accumulator_finish(vr);
  for (auto& s : next.post) statement(s, next);
}

// Softmax's max and sum of exp as one online (max, sum) pass (long loop
// rows, or staged rows with OPFUSE_ROW_STAGE_ONLINE=1, see row_kernel), the
// pair then combined across the lanes, block, cluster or row group.
void CudaEmitter::online_pair(const KStage& st, const KStage& next, bool staged_online, int items, int threads_per_row) {
  const KAccumulator& mx = st.accs[0];
  const KAccumulator& sm = next.accs[0];
  for (auto& s : st.pre) statement(s, st);
  accumulator_init(mx);
  accumulator_init(sm);
  online_acc_ = acc_name(sm);
  if (staged_online) online_vec_max_ = acc_name(mx);
  if (!st.loop.empty()) row_stage_loop(st, items, threads_per_row);
  online_acc_.clear();
  online_vec_max_.clear();
  std::string fast = fast_math_ ? "true" : "false";
  if (grouped_rows_) {
    if (lanes_ > 1) line("opf_warp_online<" + fast + ", " + std::to_string(lanes_) + ">(" + acc_name(mx) + ", " + acc_name(sm) + ");");
  } else if (cluster_ > 1 && group_exchange_) {
    line("opf_group_online<" + fast + ", " + group_args() + ">(" + acc_name(mx) + ", " + acc_name(sm) + ", " + smem_ +
         ", a.gx, " + group_slot(1) + ");");
  } else if (cluster_ > 1) {
    // The pair through distributed shared memory: one 8-byte slot a block.
    cluster_reduction(1, "opf_cluster_online<" + fast + ", " + std::to_string(cluster_) + ">(" + acc_name(mx) + ", " + acc_name(sm) +
                             ", " + smem_ + ", reinterpret_cast<float*>(@));");
  } else {
    line("opf_block_online<" + fast + ">(" + acc_name(mx) + ", " + acc_name(sm) + ", " + smem_ + ");");
  }
  accumulator_finish(mx);
  for (auto& s : st.post) statement(s, st);
  accumulator_finish(sm);
  for (auto& s : next.post) statement(s, next);
}

std::string CudaEmitter::statement_key(const KStmt& s, const std::vector<std::string>& arg_keys) const {
  std::vector<std::string> a;
  for (auto& k : arg_keys) a.push_back("{" + k + "}");
  switch (s.kind) {
    case KStmt::Load: return "load " + access_key(s) + " " + dtype_name(s.type);
    case KStmt::Const: return s.size ? "size " + size_c(s.size) : "const " + literal(s.value, s.type);
    case KStmt::Cast: return "cast " + std::string(dtype_name(s.node.dtype)) + " " + a[0];
    case KStmt::Compute:
      if (s.node.op == "select_lt") return "select_lt " + size_c(s.index[0]) + " " + size_c(s.index[1]) + " " + a[0] + " " + a[1];
      return dtype_name(s.type) + std::string(" ") + op_def(s.node).c_expr(a, s.node);
    default: return "effect";
  }
}

}  // namespace opfuse
