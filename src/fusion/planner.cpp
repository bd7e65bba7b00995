#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "codegen/lower.h"
#include "fusion/gemm_epilogue.h"
#include "fusion/passes.h"
#include "fusion/plan.h"
#include "ir/ops.h"

namespace opfuse {
namespace {

// The shape of one row's results: the domain with reduce axes set to 1
// (keepdim) or removed.
Shape row_shape(const KernelGroup& k, bool keepdim) {
  Shape s;
  for (size_t i = 0; i < k.domain.size(); ++i) {
    bool red = std::find(k.reduce_axes.begin(), k.reduce_axes.end(), static_cast<int64_t>(i)) != k.reduce_axes.end();
    if (!red) s.push_back(k.domain[i]);
    else if (keepdim) s.push_back(cst(1));
  }
  return s;
}

bool is_inlined(const Graph& g, const std::vector<int>& kernel_of, int id) {
  const Node& n = g.node(id);
  return kernel_of[static_cast<size_t>(id)] < 0 && n.op != "input";
}

// Realized nodes of other kernels (and graph inputs) that kernel `k` loads:
// walk back from its roots through inlined nodes and through its own roots.
std::vector<int> compute_reads(const Graph& g, const std::vector<int>& kernel_of, int k, const std::vector<int>& roots) {
  std::set<int> reads, seen;
  std::function<void(int)> walk = [&](int id) {
    if (!seen.insert(id).second) return;
    const Node& n = g.node(id);
    for (int i : n.inputs) {
      const Node& in = g.node(i);
      if (in.op == "input") { reads.insert(i); continue; }
      int ki = kernel_of[static_cast<size_t>(i)];
      if (ki >= 0 && ki != k) { reads.insert(i); continue; }
      walk(i);
    }
  };
  for (int r : roots) walk(r);
  return {reads.begin(), reads.end()};
}

class Planner {
 public:
  Planner(FusionPlan& plan, const PlannerOptions& opt) : p_(plan), g_(plan.graph), opt_(opt) {}

  void run() {
    seed_kernels();
    if (opt_.gemm_epilogues) absorb_gemm_epilogues();
    if (opt_.fuse) merge_kernels();
    finish();
  }

 private:
  FusionPlan& p_;
  const Graph& g_;
  const PlannerOptions& opt_;
  std::vector<KernelGroup> ks_;
  std::vector<bool> alive_;

  void seed_kernels() {
    std::vector<bool> is_output(g_.nodes.size(), false);
    for (int o : g_.outputs) is_output[static_cast<size_t>(o)] = true;
    // An output that reshapes a computed node is a view of that node's
    // buffer: realize the source once instead of storing a copy.
    for (int o : g_.outputs) {
      int src = o;
      while (g_.node(src).op == "reshape") src = g_.node(src).inputs[0];
      const std::string& sop = g_.node(src).op;
      if (src == o || sop == "input" || sop == "scalar") continue;
      p_.output_alias[o] = src;
    }
    for (auto [o, src] : p_.output_alias) {
      is_output[static_cast<size_t>(o)] = false;
      is_output[static_cast<size_t>(src)] = true;
    }
    for (int o : g_.outputs)  // also an output in its own right
      if (!p_.output_alias.count(o)) is_output[static_cast<size_t>(o)] = true;
    // A library GEMM reads its operands from memory: the buffer behind each
    // operand (past a transpose or reshape view) must be realized.
    std::vector<bool> operand_buffer(g_.nodes.size(), false);
    auto is_input = [&](int id) { return g_.node(id).op == "input" || is_output[static_cast<size_t>(id)]; };
    for (const Node& n : g_.nodes)
      if (n.op == "matmul")
        for (int i : n.inputs) operand_buffer[static_cast<size_t>(resolve_gemm_operand(g_, i, is_input).node)] = true;
    p_.kernel_of.assign(g_.nodes.size(), -1);
    for (const Node& n : g_.nodes) {
      const OpDef& d = op_def(n);
      bool reduction = d.kind == OpKind::Reduction;
      bool gemm = d.kind == OpKind::Gemm;
      if (n.op == "input") continue;
      if (!reduction && !gemm && !is_output[static_cast<size_t>(n.id)] && !operand_buffer[static_cast<size_t>(n.id)]) continue;
      KernelGroup k;
      if (reduction) {
        const Node& x = g_.node(n.inputs[0]);
        k.kind = KernelGroup::Kind::Row;
        k.domain = x.shape;
        k.reduce_axes = reduction_dims(n, x.rank());
        if (n.op == "column_partials") {
          // Rows are the leading dims it sums over: the same loop nest as a
          // row reduction over the trailing dims, which it can fuse into.
          std::vector<int64_t> trailing;
          for (int64_t a = static_cast<int64_t>(k.reduce_axes.size()); a < x.rank(); ++a) trailing.push_back(a);
          k.reduce_axes = trailing;
        }
      } else {
        k.domain = n.shape;
      }
      if (gemm) {
        k.kind = KernelGroup::Kind::Gemm;
        k.gemm.matmul = k.gemm.result = n.id;
        k.gemm.a = resolve_gemm_operand(g_, n.inputs[0], is_input);
        k.gemm.b = resolve_gemm_operand(g_, n.inputs[1], is_input);
      }
      k.roots = {n.id};
      p_.kernel_of[static_cast<size_t>(n.id)] = static_cast<int>(ks_.size());
      ks_.push_back(k);
    }
    alive_.assign(ks_.size(), true);
  }

  // Moves the nodes a GEMM's epilogue computes into its library call (and
  // out of the kernels they seeded); undone if the kernel graph would cycle.
  void absorb_gemm_epilogues() {
    UseInfo use(g_);
    for (size_t k = 0; k < ks_.size(); ++k) {
      if (!alive_[k] || ks_[k].kind != KernelGroup::Kind::Gemm) continue;
      auto snapshot_kernels = ks_;
      auto snapshot_alive = alive_;
      auto snapshot_of = p_.kernel_of;
      GemmCall call = ks_[k].gemm;
      auto available = [&](int id) { return g_.node(id).op == "input" || p_.kernel_of[static_cast<size_t>(id)] >= 0; };
      auto free = [&](int id) {
        int owner = p_.kernel_of[static_cast<size_t>(id)];
        return owner < 0 || ks_[static_cast<size_t>(owner)].kind != KernelGroup::Kind::Gemm;
      };
      std::vector<int> taken = match_gemm_epilogue(g_, use, call, available, opt_);
      for (int id : match_gemm_bias_grad(g_, use, call, free, opt_)) taken.push_back(id);
      if (taken.empty()) continue;
      for (int id : taken) {
        int owner = p_.kernel_of[static_cast<size_t>(id)];
        if (owner >= 0 && owner != static_cast<int>(k)) {
          auto& roots = ks_[static_cast<size_t>(owner)].roots;
          roots.erase(std::remove(roots.begin(), roots.end(), id), roots.end());
          if (roots.empty()) alive_[static_cast<size_t>(owner)] = false;
        }
        p_.kernel_of[static_cast<size_t>(id)] = static_cast<int>(k);
        ks_[k].roots.push_back(id);
      }
      std::sort(ks_[k].roots.begin(), ks_[k].roots.end());
      ks_[k].gemm = call;
      ks_[k].domain = g_.node(call.result).shape;
      if (!acyclic(p_.kernel_of)) {
        ks_ = snapshot_kernels;
        alive_ = snapshot_alive;
        p_.kernel_of = snapshot_of;
      }
    }
  }

  // Which kernels can share a loop nest: same domain (and reduce axes), or a
  // pointwise kernel over a Row kernel's domain or over its row shape.
  bool compatible(const KernelGroup& a, const KernelGroup& b) const {
    using K = KernelGroup::Kind;
    if (a.kind == K::Gemm || b.kind == K::Gemm) return false;  // library calls fuse only their epilogue
    if (a.kind == K::Row && b.kind == K::Row)
      return same_shape(a.domain, b.domain) && a.reduce_axes == b.reduce_axes;
    if (a.kind == K::Pointwise && b.kind == K::Pointwise) return same_shape(a.domain, b.domain);
    const KernelGroup& row = a.kind == K::Row ? a : b;
    const KernelGroup& pw = a.kind == K::Row ? b : a;
    return same_shape(pw.domain, row.domain) || same_shape(pw.domain, row_shape(row, true)) ||
           same_shape(pw.domain, row_shape(row, false));
  }

  bool acyclic(const std::vector<int>& kernel_of) const {
    // Kernel dependency graph under `kernel_of`; DFS for a back edge.
    int nk = static_cast<int>(ks_.size());
    std::vector<std::vector<int>> roots(static_cast<size_t>(nk));
    for (size_t id = 0; id < kernel_of.size(); ++id)
      if (kernel_of[id] >= 0) roots[static_cast<size_t>(kernel_of[id])].push_back(static_cast<int>(id));
    std::vector<std::vector<int>> deps(static_cast<size_t>(nk));
    for (int k = 0; k < nk; ++k) {
      if (roots[static_cast<size_t>(k)].empty()) continue;
      for (int r : compute_reads(g_, kernel_of, k, roots[static_cast<size_t>(k)])) {
        int kr = kernel_of[static_cast<size_t>(r)];
        if (kr >= 0) deps[static_cast<size_t>(k)].push_back(kr);
      }
    }
    std::vector<int> state(static_cast<size_t>(nk), 0);
    std::function<bool(int)> dfs = [&](int k) {
      state[static_cast<size_t>(k)] = 1;
      for (int d : deps[static_cast<size_t>(k)]) {
        if (state[static_cast<size_t>(d)] == 1) return false;
        if (state[static_cast<size_t>(d)] == 0 && !dfs(d)) return false;
      }
      state[static_cast<size_t>(k)] = 2;
      return true;
    };
    for (int k = 0; k < nk; ++k)
      if (state[static_cast<size_t>(k)] == 0 && !dfs(k)) return false;
    return true;
  }

  KernelGroup merged(const KernelGroup& a, const KernelGroup& b) const {
    KernelGroup m = a.kind == KernelGroup::Kind::Row ? a : b;
    m.roots = a.roots;
    m.roots.insert(m.roots.end(), b.roots.begin(), b.roots.end());
    std::sort(m.roots.begin(), m.roots.end());
    return m;
  }

  KernelCost cost(const KernelGroup& k, const std::vector<int>& kernel_of, int index) const {
    FusionPlan tmp;
    tmp.graph = g_;
    tmp.kernel_of = kernel_of;
    KernelGroup kk = k;
    kk.reads = compute_reads(g_, kernel_of, index, k.roots);
    return estimate_cost(tmp, kk, opt_);
  }

  // Peak bytes of stored intermediates and outputs over a dependency order
  // of the kernels under `kernel_of`: a buffer lives from the kernel that
  // writes it to the last kernel that reads it (outputs to the end).
  double peak_bytes(const std::vector<int>& kernel_of) const {
    int nk = static_cast<int>(ks_.size());
    std::vector<std::vector<int>> roots(static_cast<size_t>(nk)), reads(static_cast<size_t>(nk));
    for (size_t id = 0; id < kernel_of.size(); ++id)
      if (kernel_of[id] >= 0) roots[static_cast<size_t>(kernel_of[id])].push_back(static_cast<int>(id));
    for (int k = 0; k < nk; ++k)
      if (!roots[static_cast<size_t>(k)].empty()) reads[static_cast<size_t>(k)] = compute_reads(g_, kernel_of, k, roots[static_cast<size_t>(k)]);
    std::vector<int> order, state(static_cast<size_t>(nk), 0);
    std::function<void(int)> visit = [&](int k) {
      if (state[static_cast<size_t>(k)]) return;
      state[static_cast<size_t>(k)] = 1;
      for (int r : reads[static_cast<size_t>(k)])
        if (kernel_of[static_cast<size_t>(r)] >= 0) visit(kernel_of[static_cast<size_t>(r)]);
      order.push_back(k);
    };
    for (int k = 0; k < nk; ++k)
      if (!roots[static_cast<size_t>(k)].empty()) visit(k);
    std::vector<int> position(static_cast<size_t>(nk), -1);
    for (size_t i = 0; i < order.size(); ++i) position[static_cast<size_t>(order[i])] = static_cast<int>(i);
    // Which realized nodes are stored, and until when they live.
    std::map<int, int> last_use;
    for (int o : g_.outputs) last_use[o] = static_cast<int>(order.size());
    for (auto [o, src] : p_.output_alias) last_use[src] = static_cast<int>(order.size());
    for (int k : order)
      for (int r : reads[static_cast<size_t>(k)])
        if (kernel_of[static_cast<size_t>(r)] >= 0) last_use[r] = std::max(last_use[r], position[static_cast<size_t>(k)]);
    std::map<std::string, int64_t> env;
    std::vector<double> delta(order.size() + 2, 0.0);
    for (auto& [node, last] : last_use) {
      int k = kernel_of[static_cast<size_t>(node)];
      if (k < 0) continue;
      const Node& n = g_.node(node);
      std::vector<std::string> syms;
      for (auto& d : n.shape) collect_symbols(d, &syms);
      for (auto& sname : syms) env.emplace(sname, opt_.symbol_hint);
      double bytes = static_cast<double>(evaluate(numel(n.shape), env)) * dtype_size(n.dtype);
      delta[static_cast<size_t>(position[static_cast<size_t>(k)])] += bytes;
      delta[static_cast<size_t>(last) + 1] -= bytes;
    }
    double live = 0, peak = 0;
    for (double d : delta) {
      live += d;
      peak = std::max(peak, live);
    }
    return peak;
  }

  bool try_merge(int a, int b) {
    if (!compatible(ks_[static_cast<size_t>(a)], ks_[static_cast<size_t>(b)])) return false;
    std::vector<int> kernel_of = p_.kernel_of;
    for (int r : ks_[static_cast<size_t>(b)].roots) kernel_of[static_cast<size_t>(r)] = a;
    if (!acyclic(kernel_of)) return false;
    KernelGroup m = merged(ks_[static_cast<size_t>(a)], ks_[static_cast<size_t>(b)]);
    // The roofline gate: fusing must not cost more than the two kernels did.
    double before = cost(ks_[static_cast<size_t>(a)], p_.kernel_of, a).seconds + cost(ks_[static_cast<size_t>(b)], p_.kernel_of, b).seconds;
    double after = cost(m, kernel_of, a).seconds;
    if (after > before * 1.001) return false;
    // Every access to a reduction must stay inside its own row.
    FusionPlan trial;
    trial.graph = g_;
    trial.kernel_of = kernel_of;
    KernelGroup t = m;
    t.stores = m.roots;
    t.reads = compute_reads(g_, kernel_of, a, m.roots);
    if (!can_lower(trial, t)) return false;
    // The memory gate: fusing must not raise the peak of live buffers
    // (horizontal fusion can start a buffer's life earlier).
    // Column partials are exempt: they are at most an eighth of the rows
    // they summarise (parts <= rows / 8, split_column_sums.cpp), which the
    // kernel reads anyway, and fusing them saves a pass over those rows.
    auto all_partials = [&](int k) {
      for (int r : ks_[static_cast<size_t>(k)].roots)
        if (g_.node(r).op != "column_partials") return false;
      return true;
    };
    bool only_partials = all_partials(a) || all_partials(b);
    if (!only_partials && peak_bytes(kernel_of) > peak_bytes(p_.kernel_of) * 1.001) return false;
    ks_[static_cast<size_t>(a)] = m;
    ks_[static_cast<size_t>(b)].roots.clear();
    alive_[static_cast<size_t>(b)] = false;
    p_.kernel_of = kernel_of;
    return true;
  }

  void merge_kernels() {
    // Vertical fusion first (a kernel into one it reads from), then
    // horizontal fusion of kernels that read a common buffer.
    bool changed = true;
    while (changed) {
      changed = false;
      for (int b = 0; b < static_cast<int>(ks_.size()); ++b) {
        if (!alive_[static_cast<size_t>(b)]) continue;
        auto reads = compute_reads(g_, p_.kernel_of, b, ks_[static_cast<size_t>(b)].roots);
        for (int r : reads) {
          int a = p_.kernel_of[static_cast<size_t>(r)];
          if (a < 0 || a == b || !alive_[static_cast<size_t>(a)]) continue;
          if (try_merge(a, b)) { changed = true; break; }
        }
        if (changed) break;
      }
      if (changed) continue;
      for (int b = 0; b < static_cast<int>(ks_.size()) && !changed; ++b) {
        if (!alive_[static_cast<size_t>(b)]) continue;
        auto rb = compute_reads(g_, p_.kernel_of, b, ks_[static_cast<size_t>(b)].roots);
        for (int a = 0; a < b && !changed; ++a) {
          if (!alive_[static_cast<size_t>(a)]) continue;
          auto ra = compute_reads(g_, p_.kernel_of, a, ks_[static_cast<size_t>(a)].roots);
          bool share = false;
          for (int x : rb) share = share || std::find(ra.begin(), ra.end(), x) != ra.end();
          if (share && try_merge(a, b)) changed = true;
        }
      }
    }
  }

  void finish() {
    // Compact, order by dependencies, and decide which roots are stored.
    std::vector<int> order;
    std::vector<int> new_index(ks_.size(), -1);
    std::vector<std::vector<int>> deps(ks_.size());
    for (size_t k = 0; k < ks_.size(); ++k) {
      if (!alive_[k]) continue;
      for (int r : compute_reads(g_, p_.kernel_of, static_cast<int>(k), ks_[k].roots)) {
        int kr = p_.kernel_of[static_cast<size_t>(r)];
        if (kr >= 0) deps[k].push_back(kr);
      }
    }
    std::vector<int> state(ks_.size(), 0);
    std::function<void(int)> visit = [&](int k) {
      if (state[static_cast<size_t>(k)]) return;
      state[static_cast<size_t>(k)] = 1;
      for (int d : deps[static_cast<size_t>(k)]) visit(d);
      new_index[static_cast<size_t>(k)] = static_cast<int>(order.size());
      order.push_back(k);
    };
    for (size_t k = 0; k < ks_.size(); ++k)
      if (alive_[k]) visit(static_cast<int>(k));
    for (auto& ko : p_.kernel_of)
      if (ko >= 0) ko = new_index[static_cast<size_t>(ko)];
    for (int k : order) p_.kernels.push_back(ks_[static_cast<size_t>(k)]);

    // A GEMM reads the first buffer along each operand's view chain; another
    // node on that chain may have been realized too (a graph output), and
    // then that is the buffer (the one compute_reads finds).
    auto in_memory = [&](int id) { return g_.node(id).op == "input" || p_.kernel_of[static_cast<size_t>(id)] >= 0; };
    for (auto& kg : p_.kernels)
      if (kg.kind == KernelGroup::Kind::Gemm) {
        const Node& mm = g_.node(kg.gemm.matmul);
        kg.gemm.a = resolve_gemm_operand(g_, mm.inputs[0], in_memory);
        kg.gemm.b = resolve_gemm_operand(g_, mm.inputs[1], in_memory);
      }
    std::vector<bool> needed(g_.nodes.size(), false);
    for (int o : g_.outputs) needed[static_cast<size_t>(o)] = true;
    for (auto [o, src] : p_.output_alias) needed[static_cast<size_t>(src)] = true;
    for (size_t k = 0; k < p_.kernels.size(); ++k) {
      KernelGroup& kg = p_.kernels[k];
      kg.reads = compute_reads(g_, p_.kernel_of, static_cast<int>(k), kg.roots);
      for (int r : kg.reads) needed[static_cast<size_t>(r)] = true;
    }
    for (auto& kg : p_.kernels) {
      for (int r : kg.roots)
        if (needed[static_cast<size_t>(r)]) kg.stores.push_back(r);
      if (kg.kind == KernelGroup::Kind::Gemm)  // the call writes these whether or not anything reads them
        for (int r : kg.gemm.written())
          if (std::find(kg.stores.begin(), kg.stores.end(), r) == kg.stores.end()) kg.stores.push_back(r);
      std::sort(kg.stores.begin(), kg.stores.end());
    }
  }
};

}  // namespace

FusionPlan plan_fusion(const Graph& g, const PlannerOptions& opt) {
  FusionPlan plan;
  plan.graph = g;
  for (const GraphPass& pass : graph_passes()) plan.graph = pass.run(plan.graph);
  if (opt.column_partials) plan.graph = split_column_sums(plan.graph, opt.column_partials_max_cols);
  Planner(plan, opt).run();
  if (opt.decode_mlp && opt.gemm_epilogues) fuse_decode_mlp(plan, opt);
  if (opt.gemm_epilogues) mark_gated_gemm_inputs(plan);
  return plan;
}

KernelCost estimate_cost(const FusionPlan& plan, const KernelGroup& k, const PlannerOptions& opt) {
  const Graph& g = plan.graph;
  std::map<std::string, int64_t> env;
  auto size = [&](const Shape& s) {
    std::vector<std::string> syms;
    for (auto& d : s) collect_symbols(d, &syms);
    for (auto& n : syms) env.emplace(n, opt.symbol_hint);
    return static_cast<double>(evaluate(numel(s), env));
  };
  KernelCost c;
  for (int r : k.reads) c.bytes += size(g.node(r).shape) * dtype_size(g.node(r).dtype);
  for (int r : (k.stores.empty() ? k.roots : k.stores)) c.bytes += size(g.node(r).shape) * dtype_size(g.node(r).dtype);
  // Flops: every inlined node once per element of its shape.
  std::set<int> members;
  std::function<void(int)> walk = [&](int id) {
    if (!members.insert(id).second) return;
    for (int i : g.node(id).inputs)
      if (g.node(i).op != "input" && (plan.kernel_of[static_cast<size_t>(i)] < 0 ||
                                      std::find(k.roots.begin(), k.roots.end(), i) != k.roots.end()))
        walk(i);
  };
  for (int r : k.roots) walk(r);
  for (int id : members) {
    const Node& n = g.node(id);
    const OpDef& d = op_def(n);
    if (d.kind == OpKind::Gemm) {
      const Node& a = g.node(n.inputs[0]);
      c.flops += 2 * size(n.shape) * size({a.shape.back()});
      continue;
    }
    double elems = d.kind == OpKind::Reduction ? size(g.node(n.inputs[0]).shape) : size(n.shape);
    c.flops += d.flops * elems;
  }
  c.seconds = std::max(c.bytes / opt.bandwidth_bytes_per_s, c.flops / opt.flops_per_s) + opt.launch_seconds;
  return c;
}

std::string FusionPlan::to_string() const {
  std::ostringstream os;
  for (size_t k = 0; k < kernels.size(); ++k) {
    const KernelGroup& kg = kernels[k];
    const char* kind = kg.kind == KernelGroup::Kind::Row ? "row" : kg.kind == KernelGroup::Kind::Gemm ? "gemm" : "pointwise";
    os << "kernel " << k << " " << kind << " " << shape_to_string(kg.domain);
    if (kg.kind == KernelGroup::Kind::Gemm) {
      auto operand = [&](const GemmOperand& o) {
        return "%" + std::to_string(o.node) + (o.transposed ? "^T" : "");
      };
      os << " call=" << operand(kg.gemm.a) << "@" << operand(kg.gemm.b) << " epilogue=" << kg.gemm.epilogue_name();
      if (kg.gemm.gate_silu >= 0) os << " a=silu(%" << kg.gemm.gate_silu << ")*%" << kg.gemm.gate_mul;
    }
    if (kg.kind == KernelGroup::Kind::Row) {
      os << " reduce=[";
      for (size_t i = 0; i < kg.reduce_axes.size(); ++i) os << (i ? "," : "") << kg.reduce_axes[i];
      os << "]";
    }
    auto list = [&](const char* label, const std::vector<int>& ids) {
      os << " " << label << "=(";
      for (size_t i = 0; i < ids.size(); ++i) os << (i ? "," : "") << "%" << ids[i] << ":" << graph.node(ids[i]).op;
      os << ")";
    };
    list("roots", kg.roots);
    list("stores", kg.stores);
    list("reads", kg.reads);
    os << "\n";
  }
  return os.str();
}

}  // namespace opfuse
