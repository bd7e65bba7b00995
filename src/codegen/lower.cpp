#include "codegen/lower.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <set>

#include "ir/ops.h"

namespace opfuse {
namespace {

bool is_one(const Expr& e) {
  int64_t c;
  return is_const(e, &c) && c == 1;
}

std::string index_key(int id, const std::vector<Expr>& idx) {
  std::string k = std::to_string(id) + "@";
  for (auto& e : idx) k += to_string(e) + ";";
  return k;
}

// Index into an input of shape `in` for element `idx` of the broadcast
// output shape `out`.
std::vector<Expr> broadcast_index(const std::vector<Expr>& idx, const Shape& out, const Shape& in) {
  std::vector<Expr> r;
  size_t off = out.size() - in.size();
  for (size_t j = 0; j < in.size(); ++j) r.push_back(is_one(in[j]) ? cst(0) : idx[off + j]);
  return r;
}

int64_t hint(const Expr& e) {
  std::map<std::string, int64_t> env;
  std::vector<std::string> syms;
  collect_symbols(e, &syms);
  for (auto& s : syms) env[s] = 1024;
  return evaluate(e, env);
}

// Index into reshape's input: dims are matched in groups of equal product,
// so that only dims that really merge or split need division.
std::vector<Expr> reshape_index(const std::vector<Expr>& idx, const Shape& out, const Shape& in) {
  std::vector<Expr> r(in.size(), cst(0));
  size_t i = 0, j = 0;
  auto emit_group = [&](size_t i0, size_t i1, size_t j0, size_t j1) {
    Expr lin = cst(0);
    for (size_t q = j0; q < j1; ++q) lin = lin * out[q] + idx[q];
    Expr stride = cst(1);
    for (size_t p = i1; p-- > i0;) {
      Expr v = floordiv(lin, stride);
      r[p] = p == i0 ? v : mod(v, in[p]);
      stride = stride * in[p];
    }
  };
  while (i < in.size() || j < out.size()) {
    // Size-1 dims stand alone.
    if (i < in.size() && is_one(in[i])) { r[i++] = cst(0); continue; }
    if (j < out.size() && is_one(out[j])) { ++j; continue; }
    if (i >= in.size() || j >= out.size()) break;
    size_t i0 = i, j0 = j;
    Expr pi = in[i++], po = out[j++];
    bool ok = true;
    while (!expr_equal(pi, po)) {
      if (hint(pi) <= hint(po) && i < in.size()) pi = pi * in[i++];
      else if (j < out.size()) po = po * out[j++];
      else if (i < in.size()) pi = pi * in[i++];
      else { ok = false; break; }
    }
    if (!ok) {  // no grouping found: linearise everything
      emit_group(0, in.size(), 0, out.size());
      return r;
    }
    emit_group(i0, i, j0, j);
  }
  return r;
}

class Lowerer {
 public:
  Lowerer(const FusionPlan& plan, const KernelGroup& k, const std::string& name) : plan_(plan), g_(plan.graph), k_(k) {
    ir_.name = name;
    ir_.row = k.kind == KernelGroup::Kind::Row;
    ir_.domain = k.domain;
    ir_.reduce_axes = k.reduce_axes;
    for (size_t a = 0; a < k.domain.size(); ++a)
      vars_.push_back(is_one(k.domain[a]) ? cst(0) : var("x" + std::to_string(a)));
    for (size_t a = 0; a < k.domain.size(); ++a) {
      bool red = std::find(k.reduce_axes.begin(), k.reduce_axes.end(), static_cast<int64_t>(a)) != k.reduce_axes.end();
      if (!ir_.row || red) loop_vars_.insert("x" + std::to_string(a));
    }
    for (int r : k.reads) add_buffer(r, false);
    for (int s : k.stores) add_buffer(s, true);
  }

  KernelIR run() {
    if (ir_.row) lower_reductions();
    lower_partials();
    lower_stores();
    std::vector<std::string> syms;
    for (auto& d : ir_.domain) collect_symbols(d, &syms);
    for (auto& b : ir_.buffers)
      for (auto& d : b.shape) collect_symbols(d, &syms);
    // Indices mention symbols no size does (a slice starting at <s0>, the
    // gradient of a cat's second part): the kernel takes those too.
    for (auto& st : ir_.stages) {
      for (auto* list : {&st.pre, &st.loop, &st.post})
        for (auto& s : *list) {
          if (s.size) collect_symbols(s.size, &syms);
          for (auto& e : s.index) collect_symbols(e, &syms);
        }
      for (auto& a : st.accs) {
        if (a.count) collect_symbols(a.count, &syms);
        if (a.index) collect_symbols(a.index, &syms);
      }
    }
    std::sort(syms.begin(), syms.end());
    syms.erase(std::unique(syms.begin(), syms.end()), syms.end());
    ir_.symbols = syms;
    return ir_;
  }

 private:
  const FusionPlan& plan_;
  const Graph& g_;
  const KernelGroup& k_;
  KernelIR ir_;
  std::vector<Expr> vars_;
  std::set<std::string> loop_vars_;
  std::map<int, int> buffer_of_;
  struct Memo { int value, stage; bool varying; };
  std::map<std::string, Memo> memo_;
  std::map<int, int> reduction_value_;
  std::vector<bool> value_varying_;
  int stage_ = 0;

  void add_buffer(int node, bool written) {
    const Node& n = g_.node(node);
    KBuffer b;
    b.node = node;
    b.dtype = n.dtype;
    b.shape = n.shape;
    b.strided = n.op == "input";
    b.written = written;
    b.partials = written && n.op == "column_partials";
    if (!written) buffer_of_[node] = static_cast<int>(ir_.buffers.size());
    ir_.buffers.push_back(b);
  }

  bool here(int id) const { return std::find(k_.roots.begin(), k_.roots.end(), id) != k_.roots.end(); }

  bool varying_index(const std::vector<Expr>& idx) const {
    std::function<bool(const Expr&)> has = [&](const Expr& e) {
      if (e->kind == ExprNode::Var) return loop_vars_.count(e->name) > 0;
      for (auto& a : e->args)
        if (has(a)) return true;
      return false;
    };
    for (auto& e : idx)
      if (has(e)) return true;
    return false;
  }

  KStage& stage() {
    while (static_cast<int>(ir_.stages.size()) <= stage_) ir_.stages.emplace_back();
    return ir_.stages[static_cast<size_t>(stage_)];
  }

  int new_value(DType t, bool varying) {
    ir_.value_types.push_back(t);
    value_varying_.push_back(varying);
    return static_cast<int>(ir_.value_types.size()) - 1;
  }

  int emit(KStmt s) {
    if (s.kind != KStmt::Store && s.kind != KStmt::Update && s.kind != KStmt::Partial) s.dst = new_value(s.type, s.varying);
    int dst = s.dst;
    (s.varying ? stage().loop : stage().pre).push_back(std::move(s));
    return dst;
  }

  bool any_varying(const std::vector<int>& args) const {
    for (int a : args)
      if (value_varying_[static_cast<size_t>(a)]) return true;
    return false;
  }

  int convert(int v, DType to) {
    if (ir_.value_types[static_cast<size_t>(v)] == to) return v;
    KStmt s;
    s.kind = KStmt::Cast;
    s.type = to;
    s.node.dtype = to;
    s.args = {v};
    s.varying = any_varying(s.args);
    return emit(s);
  }

  int constant(double v, DType t) {
    KStmt s;
    s.kind = KStmt::Const;
    s.type = compute_dtype(t);
    s.value = v;
    return emit(s);
  }

  int size_constant(const Expr& size, DType t) {
    KStmt s;
    s.kind = KStmt::Const;
    s.type = compute_dtype(t);
    s.size = size;
    return emit(s);
  }

  int load(int node, const std::vector<Expr>& idx) {
    KStmt s;
    s.kind = KStmt::Load;
    s.buffer = buffer_of_.at(node);
    s.index = idx;
    s.type = compute_dtype(g_.node(node).dtype);
    s.varying = varying_index(idx);
    return emit(s);
  }

  int value_at(int id, const std::vector<Expr>& idx) {
    std::string key = index_key(id, idx);
    auto it = memo_.find(key);
    if (it != memo_.end() && (!it->second.varying || it->second.stage == stage_)) return it->second.value;
    int v = compute(id, idx);
    memo_[key] = {v, stage_, value_varying_[static_cast<size_t>(v)]};
    return v;
  }

  int compute(int id, const std::vector<Expr>& idx) {
    const Node& n = g_.node(id);
    if (n.op == "input" || (plan_.kernel_of[static_cast<size_t>(id)] >= 0 && !here(id))) return load(id, idx);
    const OpDef& d = op_def(n);
    if (d.kind == OpKind::Reduction) return reduction_result(n, idx);
    if (Expr size = n.scalar_size()) return size_constant(size, n.dtype);
    if (n.op == "scalar") return constant(n.get_float("value"), n.dtype);
    if (n.op == "full") return constant(n.get_float("value"), n.dtype);
    if (d.kind == OpKind::Elementwise) return elementwise(n, d, idx);
    return layout(n, idx);
  }

  int elementwise(const Node& n, const OpDef& d, const std::vector<Expr>& idx) {
    std::vector<int> args;
    DType common = compute_dtype(result_type(g_, n.inputs));
    for (size_t i = 0; i < n.inputs.size(); ++i) {
      const Node& in = g_.node(n.inputs[i]);
      int v = value_at(in.id, broadcast_index(idx, n.shape, in.shape));
      if (d.operands == OperandType::Result) v = convert(v, compute_dtype(n.dtype));
      else if (d.operands == OperandType::Common) v = convert(v, common);
      else if (n.op == "where" && i > 0) v = convert(v, compute_dtype(n.dtype));
      args.push_back(v);
    }
    if (n.op == "cast") {
      KStmt s;
      s.kind = KStmt::Cast;
      s.type = compute_dtype(n.dtype);
      s.node.dtype = n.dtype;  // rounds to the storage type (bf16, f16, ints)
      s.args = args;
      s.varying = any_varying(args);
      return emit(s);
    }
    KStmt s;
    s.kind = KStmt::Compute;
    s.type = compute_dtype(n.dtype);
    s.node = n;
    s.args = args;
    s.varying = any_varying(args);
    return emit(s);
  }

  int layout(const Node& n, const std::vector<Expr>& idx) {
    const Node& x = g_.node(n.inputs[0]);
    if (n.op == "copy") return value_at(x.id, idx);
    if (n.op == "permute") {
      auto dims = n.get_ints("dims");
      std::vector<Expr> in(idx.size());
      for (size_t i = 0; i < dims.size(); ++i) in[static_cast<size_t>(normalize_dim(dims[i], x.rank(), n))] = idx[i];
      return value_at(x.id, in);
    }
    if (n.op == "expand") return value_at(x.id, broadcast_index(idx, n.shape, x.shape));
    if (n.op == "squeeze") {
      // Reinsert the removed size-1 dims as index 0.
      std::vector<Expr> in;
      size_t j = 0;
      std::vector<int64_t> dims = n.has("dims") ? n.get_ints("dims") : std::vector<int64_t>{};
      for (auto& dd : dims) dd = normalize_dim(dd, x.rank(), n);
      for (int64_t a = 0; a < x.rank(); ++a) {
        bool one = is_one(x.shape[static_cast<size_t>(a)]);
        bool listed = dims.empty() || std::find(dims.begin(), dims.end(), a) != dims.end();
        in.push_back(one && listed ? cst(0) : idx[j++]);
      }
      return value_at(x.id, in);
    }
    if (n.op == "unsqueeze") {
      int64_t d = normalize_dim(n.get_int("dim"), x.rank() + 1, n);
      std::vector<Expr> in = idx;
      in.erase(in.begin() + d);
      return value_at(x.id, in);
    }
    if (n.op == "reshape") return value_at(x.id, reshape_index(idx, n.shape, x.shape));
    if (n.op == "slice") {
      int64_t d = normalize_dim(n.get_int("dim"), x.rank(), n);
      Expr start = slice_bounds(n, x.shape[static_cast<size_t>(d)]).first;
      std::vector<Expr> in = idx;
      in[static_cast<size_t>(d)] = start + idx[static_cast<size_t>(d)] * cst(n.get_int("step", 1));
      return value_at(x.id, in);
    }
    if (n.op == "slice_scatter") {
      // Element i along dim is src's (i - start) / step where that is a
      // whole index of src, else base's: j = i - start is taken where
      // miss = max(-j, 0) + max(j - (len - 1) * step, 0) + max(j, 0) % step
      // is 0 (every term is >= 0, so miss < 1 says all three are 0).
      int64_t d = normalize_dim(n.get_int("dim"), x.rank(), n);
      size_t du = static_cast<size_t>(d);
      const Node& src = g_.node(n.inputs[1]);
      Expr step = cst(n.get_int("step", 1)), len = src.shape[du];
      int64_t c;
      if (is_const(len, &c) && c == 0) return convert(value_at(x.id, idx), compute_dtype(n.dtype));  // as cat skips empty parts
      Expr j = idx[du] - slice_bounds(n, x.shape[du]).first;
      Expr ahead = emax(j, cst(0));
      Expr miss = (ahead - j) + emax(j - (len - cst(1)) * step, cst(0)) + mod(ahead, step);
      std::vector<Expr> at = idx;
      at[du] = emax(emin(floordiv(ahead, step), len - cst(1)), cst(0));  // clamped: every load stays inside src
      int from_src = convert(value_at(src.id, at), compute_dtype(n.dtype));
      int from_base = convert(value_at(x.id, idx), compute_dtype(n.dtype));
      KStmt s;
      s.kind = KStmt::Compute;
      s.type = compute_dtype(n.dtype);
      s.node.op = "select_lt";
      s.index = {miss, cst(1)};
      s.args = {from_src, from_base};
      s.varying = any_varying(s.args) || varying_index(s.index);
      return emit(s);
    }
    if (n.op == "cat") {
      int64_t d = normalize_dim(n.get_int("dim"), x.rank(), n);
      Expr i = idx[static_cast<size_t>(d)];
      std::vector<int> vals;
      std::vector<Expr> ends;
      Expr off = cst(0);
      for (int in_id : n.inputs) {
        const Node& y = g_.node(in_id);
        Expr sz = y.shape[static_cast<size_t>(d)];
        int64_t c;
        if (is_const(sz, &c) && c == 0) continue;
        std::vector<Expr> sub = idx;
        // Clamped so that every load stays inside its input.
        sub[static_cast<size_t>(d)] = emax(emin(i - off, sz - cst(1)), cst(0));
        vals.push_back(convert(value_at(in_id, sub), compute_dtype(n.dtype)));
        off = off + sz;
        ends.push_back(off);
      }
      // Every part empty: so is the cat, whose elements no store reaches.
      if (vals.empty()) return constant(0, n.dtype);
      int v = vals.back();
      for (size_t k = vals.size() - 1; k-- > 0;) {
        KStmt s;
        s.kind = KStmt::Compute;
        s.type = compute_dtype(n.dtype);
        s.node.op = "select_lt";
        s.index = {i, ends[k]};
        s.args = {vals[k], v};
        s.varying = any_varying(s.args) || varying_index(s.index);
        v = emit(s);
      }
      return v;
    }
    throw LoweringConflict(n.where() + ": no lowering for this op");
  }

  // The value of a reduction of this kernel, which must be the current row's.
  int reduction_result(const Node& r, const std::vector<Expr>& idx) {
    bool keep = r.get_bool("keepdim", false);
    size_t j = 0;
    for (size_t a = 0; a < ir_.domain.size(); ++a) {
      bool red = std::find(ir_.reduce_axes.begin(), ir_.reduce_axes.end(), static_cast<int64_t>(a)) != ir_.reduce_axes.end();
      if (red) {
        if (keep) {
          int64_t c;
          if (!is_const(idx[j], &c) || c != 0) throw LoweringConflict(r.where() + ": needed at another row");
          ++j;
        }
        continue;
      }
      if (!expr_equal(idx[j], vars_[a])) throw LoweringConflict(r.where() + ": needed at another row");
      ++j;
    }
    auto it = reduction_value_.find(r.id);
    if (it == reduction_value_.end()) throw LoweringConflict(r.where() + ": needed before it is computed");
    return it->second;
  }

  // Reductions of this kernel depend on each other; each level is a stage.
  void lower_reductions() {
    std::map<int, int> level;
    std::function<int(int)> level_of = [&](int id) -> int {
      auto it = level.find(id);
      if (it != level.end()) return it->second;
      int lv = 0;
      std::set<int> seen;
      std::function<void(int)> walk = [&](int n) {
        for (int i : g_.node(n).inputs) {
          if (!seen.insert(i).second) continue;
          const Node& in = g_.node(i);
          if (in.op == "input") continue;
          if (plan_.kernel_of[static_cast<size_t>(i)] >= 0 && !here(i)) continue;
          if (op_def(in).kind == OpKind::Reduction) { lv = std::max(lv, level_of(i)); continue; }
          walk(i);
        }
      };
      walk(id);
      level[id] = lv + 1;
      return lv + 1;
    };
    std::vector<int> reds;
    for (int r : k_.roots)
      if (op_def(g_.node(r)).kind == OpKind::Reduction && g_.node(r).op != "column_partials") reds.push_back(r);
    int max_level = 0;
    for (int r : reds) max_level = std::max(max_level, level_of(r));
    for (int lv = 1; lv <= max_level; ++lv) {
      stage_ = lv - 1;
      stage();
      for (int r : reds)
        if (level[r] == lv) lower_reduction(g_.node(r));
    }
    stage_ = max_level;
  }

  void lower_reduction(const Node& r) {
    const Node& x = g_.node(r.inputs[0]);
    KAccumulator acc;
    acc.id = static_cast<int>(stage().accs.size());
    acc.result_type = compute_dtype(r.dtype);
    std::string op = r.op;
    acc.combiner = op == "mean" ? "sum" : op == "amax" ? "max" : op == "amin" ? "min" : op == "var" ? "welford" : op;
    acc.mean = op == "mean";
    acc.correction = r.get_int("correction", 1);
    DType in_t = compute_dtype(x.dtype);
    acc.type = (op == "sum" || op == "prod") && !is_floating(r.dtype) ? DType::Int64
               : (op == "argmax" || op == "argmin" || op == "amax" || op == "amin") ? in_t
                                                                                    : compute_dtype(r.dtype);
    Expr count = cst(1);
    for (auto a : ir_.reduce_axes) count = count * ir_.domain[static_cast<size_t>(a)];
    acc.count = count;
    if (op == "argmax" || op == "argmin") {
    Expr lin = cst(0);
    for (auto a : ir_.reduce_axes) lin = lin * ir_.domain[static_cast<size_t>(a)] + vars_[static_cast<size_t>(a)];
    acc.index = lin;
  }
    int v = convert(value_at(x.id, vars_), acc.type);
    KStmt u;
    u.kind = KStmt::Update;
    u.acc = acc.id;
    u.args = {v};
    u.varying = true;
    stage().loop.push_back(u);
    acc.result = new_value(acc.result_type, false);
    stage().accs.push_back(acc);
    reduction_value_[r.id] = acc.result;
  }

  std::vector<Expr> row_index(const Node& root) const {
    // Index of this row's element in a row-shaped tensor (keepdim or not).
    std::vector<Expr> idx;
    bool keep = root.rank() == static_cast<int>(ir_.domain.size());
    for (size_t a = 0; a < ir_.domain.size(); ++a) {
      bool red = std::find(ir_.reduce_axes.begin(), ir_.reduce_axes.end(), static_cast<int64_t>(a)) != ir_.reduce_axes.end();
      if (!red) idx.push_back(vars_[a]);
      else if (keep) idx.push_back(cst(0));
    }
    return idx;
  }

  // column_partials roots: in the last stage, each element of the row adds
  // its value into its column's partial (the emitter keeps the partials and
  // writes them after the rows).
  void lower_partials() {
    for (size_t b = 0; b < ir_.buffers.size(); ++b) {
      const KBuffer& buf = ir_.buffers[b];
      const Node& p = g_.node(buf.node);
      if (p.op != "column_partials" || !here(p.id)) continue;
      if (!ir_.row) throw LoweringConflict(p.where() + ": column partials need a row kernel");
      size_t lead = reduction_dims(p, g_.node(p.inputs[0]).rank()).size();
      std::vector<int64_t> trailing;
      for (size_t a = lead; a < ir_.domain.size(); ++a) trailing.push_back(static_cast<int64_t>(a));
      if (ir_.reduce_axes != trailing || !same_shape(g_.node(p.inputs[0]).shape, ir_.domain))
        throw LoweringConflict(p.where() + ": its rows are not this kernel's rows");
      int64_t parts = p.get_int("parts");
      if (ir_.parts != 0 && ir_.parts != parts) throw LoweringConflict(p.where() + ": partials with different parts");
      ir_.parts = parts;
      stage();
      int v = convert(value_at(p.inputs[0], vars_), compute_dtype(p.dtype));
      KStmt s;
      s.kind = KStmt::Partial;
      s.buffer = static_cast<int>(b);
      s.args = {v};
      s.varying = true;
      stage().loop.push_back(s);
    }
  }

  void lower_stores() {
    stage();
    for (size_t b = 0; b < ir_.buffers.size(); ++b) {
      const KBuffer& buf = ir_.buffers[b];
      if (!buf.written || buf.partials) continue;
      const Node& root = g_.node(buf.node);
      std::vector<Expr> idx;
      bool full = root.rank() == static_cast<int>(ir_.domain.size());
      for (size_t a = 0; full && a < ir_.domain.size(); ++a) full = expr_equal(root.shape[a], ir_.domain[a]);
      if (!ir_.row || full) idx = vars_;
      else idx = row_index(root);
      // Keep the index of size-1 dims at 0 for the buffer's own shape.
      for (size_t a = 0; a < idx.size() && a < root.shape.size(); ++a)
        if (is_one(root.shape[a])) idx[a] = cst(0);
      int v = convert(value_at(root.id, idx), compute_dtype(root.dtype));
      KStmt s;
      s.kind = KStmt::Store;
      s.buffer = static_cast<int>(b);
      s.index = idx;
      s.args = {v};
      s.varying = value_varying_[static_cast<size_t>(v)] || varying_index(idx);
      emit(s);
    }
  }
};

}  // namespace

KernelIR lower_kernel(const FusionPlan& plan, const KernelGroup& group, const std::string& name) {
  return Lowerer(plan, group, name).run();
}

bool can_lower(const FusionPlan& plan, const KernelGroup& group) {
  try {
    lower_kernel(plan, group, "trial");
    return true;
  } catch (const LoweringConflict&) {
    return false;
  }
}

}  // namespace opfuse
