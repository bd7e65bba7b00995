#include "codegen/cpu_emitter.h"
#include "ir/ops.h"

#include <algorithm>

namespace opfuse {

#include "prelude_cpu.inc"

const char* cpu_prelude() { return prelude_cpu; }

namespace {
bool is_one(const Expr& e) {
  int64_t c;
  return is_const(e, &c) && c == 1;
}
}  // namespace

std::string CpuEmitter::emit(const KernelIR& k, const StrideSignature& sig) {
  k_ = &k;
  sig_ = &sig;
  out_.str("");
  indent_ = 0;
  line("extern \"C\" void " + k.name + "(void* const* bufs, const int64_t* syms, const int64_t* strides) {");
  ++indent_;
  bind_arguments();
  if (k.row) row_body();
  else pointwise_body();
  --indent_;
  line("}");
  return out_.str();
}

void CpuEmitter::pointwise_body() {
  const KStage& st = k_->stages.at(0);
  size_t n = k_->domain.size();
  if (n == 0) {
    for (auto& s : st.pre) statement(s, st);
    for (auto& s : st.loop) statement(s, st);
    return;
  }
  std::vector<size_t> outer;
  Expr outer_n = cst(1);
  for (size_t a = 0; a + 1 < n; ++a) { outer.push_back(a); outer_n = outer_n * k_->domain[a]; }
  std::string last = "x" + std::to_string(n - 1);
  line("const int64_t n_last = " + size_c(k_->domain[n - 1]) + ";");
  line("const int64_t chunk = 8192;");
  line("const int64_t nchunks = (n_last + chunk - 1) / chunk;");
  line("const int64_t tasks = " + size_c(outer_n) + " * nchunks;");
  line("#pragma omp parallel for schedule(static) if (tasks * opf_imin(n_last, chunk) > 65536)");
  line("for (int64_t t = 0; t < tasks; ++t) {");
  ++indent_;
  line("const int64_t lo = (t % nchunks) * chunk;");
  line("const int64_t hi = opf_imin(lo + chunk, n_last);");
  decompose("t / nchunks", outer);
  for (auto& s : st.pre) statement(s, st);
  line("#pragma omp simd");
  line("for (int64_t " + last + " = lo; " + last + " < hi; ++" + last + ") {");
  ++indent_;
  for (auto& s : st.loop) statement(s, st);
  --indent_;
  line("}");
  --indent_;
  line("}");
}

void CpuEmitter::statement(const KStmt& s, const KStage& stage) {
  if (s.kind == KStmt::Compute) {
    auto ld = cache_load_.find(s.dst);
    if (ld != cache_load_.end()) {
      line("const " + value_type(s.type) + " " + value(s.dst) + " = opf_sc" + std::to_string(ld->second) + "[" + row_index_ + "];");
      return;
    }
    auto st = cache_store_.find(s.dst);
    if (st != cache_store_.end()) {
      CEmitter::statement(s, stage);
      line("opf_sc" + std::to_string(st->second) + "[" + row_index_ + "] = " + value(s.dst) + ";");
      return;
    }
  }
  if (s.kind == KStmt::Update) {
    const KAccumulator& a = stage.accs[static_cast<size_t>(s.acc)];
    if (a.combiner == "max" || a.combiner == "min") {
      std::string n = acc_name(a), v = value(s.args[0]), cmp = a.combiner == "max" ? " > " : " < ";
      line(n + " = (" + v + cmp + n + ") ? " + v + " : " + n + ";");
      if (is_floating(a.type)) line(acc_name(a, "_nan") + " += (" + v + " != " + v + ");");
      return;
    }
  }
  CEmitter::statement(s, stage);
}

void CpuEmitter::stage_loop(const KStage& st, const std::vector<size_t>& axes, const std::string& count) {
  for (auto& s : st.pre) statement(s, st);
  for (auto& a : st.accs) {
    accumulator_init(a);
    if ((a.combiner == "max" || a.combiner == "min") && is_floating(a.type)) line("int64_t " + acc_name(a, "_nan") + " = 0;");
  }
  if (!st.loop.empty()) {
    // Sums, maxima and minima vectorise as OpenMP simd reductions; argmax,
    // prod and Welford run as plain loops.
    bool simd = !st.accs.empty();
    std::string clause;
    for (auto& a : st.accs) {
      if (a.combiner == "sum") clause += " reduction(+:" + acc_name(a) + ")";
      else if (a.combiner == "max" || a.combiner == "min") {
        clause += " reduction(" + a.combiner + ":" + acc_name(a) + ")";
        if (is_floating(a.type)) clause += " reduction(+:" + acc_name(a, "_nan") + ")";
      } else simd = false;
    }
    if (st.accs.empty()) simd = true;
    if (simd) line("#pragma omp simd" + clause);
    bool single = axes.size() == 1;
    std::string iv = single ? "x" + std::to_string(axes[0]) : "c_";
    line("for (int64_t " + iv + " = 0; " + iv + " < " + count + "; ++" + iv + ") {");
    ++indent_;
    if (!single) decompose("c_", axes);
    for (auto& s : st.loop) statement(s, st);
    --indent_;
    line("}");
  }
  for (auto& a : st.accs) {
    if ((a.combiner == "max" || a.combiner == "min") && is_floating(a.type))
      line("if (" + acc_name(a, "_nan") + ") " + acc_name(a) + " = opf_nan<" + value_type(a.type) + ">();");
    accumulator_finish(a);
  }
  for (auto& s : st.post) statement(s, st);
}

namespace {
// Ops worth a store and a load to avoid recomputing (transcendental ones).
bool expensive(const std::string& op) {
  static const char* ops[] = {"exp", "log", "log1p", "expm1", "tanh", "sigmoid", "erf", "gelu", "silu", "pow", "sin", "cos"};
  for (const char* o : ops)
    if (op == o) return true;
  return false;
}
}  // namespace

void CpuEmitter::plan_row_cache() {
  cache_store_.clear();
  cache_load_.clear();
  cache_types_.clear();
  // A statement's key is its C expression with the arguments defined in the
  // same loop replaced by their keys: equal keys compute equal values (same
  // loads at the same indices, same row values from earlier stages).
  std::map<std::string, int> first;  // key -> value id of its first expensive definition
  std::map<std::string, size_t> first_stage;
  for (size_t i = 0; i < k_->stages.size(); ++i) {
    std::map<int, std::string> key;
    for (const KStmt& s : k_->stages[i].loop) {
      if (s.dst < 0) continue;
      auto arg = [&](int id) { auto it = key.find(id); return it != key.end() ? "(" + it->second + ")" : value(id); };
      std::string k;
      switch (s.kind) {
        case KStmt::Load: k = "load " + std::to_string(s.buffer) + "@" + offset(s.buffer, s.index); break;
        case KStmt::Const: k = literal(s.value, s.type); break;
        case KStmt::Cast: k = "cast " + std::string(dtype_name(s.node.dtype)) + " " + arg(s.args[0]); break;
        case KStmt::Compute: {
          if (s.node.op == "select_lt") { k = "select@" + std::to_string(s.dst); break; }  // index-dependent: never shared
          std::vector<std::string> a;
          for (int x : s.args) a.push_back(arg(x));
          k = op_def(s.node).c_expr(a, s.node);
          break;
        }
        default: continue;
      }
      k = value_type(s.type) + ":" + k;
      key[s.dst] = k;
      if (s.kind != KStmt::Compute || !expensive(s.node.op)) continue;
      auto f = first.find(k);
      if (f == first.end()) {
        first[k] = s.dst;
        first_stage[k] = i;
      } else if (first_stage[k] < i && cache_types_.size() < 4) {
        int slot;
        auto st = cache_store_.find(f->second);
        if (st != cache_store_.end()) slot = st->second;
        else {
          slot = static_cast<int>(cache_types_.size());
          cache_types_.push_back(value_type(s.type));
          cache_store_[f->second] = slot;
        }
        cache_load_[s.dst] = slot;
      }
    }
  }
}

void CpuEmitter::row_body() {
  RowSplit split = split_rows(*k_);
  const std::vector<size_t>& kept = split.kept;
  const std::vector<size_t>& red_loop = split.loop;
  Expr rows = split.rows, cols = split.cols;
  plan_row_cache();
  row_index_ = red_loop.size() == 1 ? "x" + std::to_string(red_loop[0]) : "c_";
  line("const int64_t rows = " + size_c(rows) + ";");
  line("const int64_t cols = " + size_c(cols) + ";");
  line("#pragma omp parallel for schedule(static) if (rows * cols > 32768)");
  line("for (int64_t row_ = 0; row_ < rows; ++row_) {");
  ++indent_;
  for (size_t i = 0; i < cache_types_.size(); ++i)
    line(cache_types_[i] + "* opf_sc" + std::to_string(i) + " = opf_row_scratch<" + cache_types_[i] + ">(" + std::to_string(i) +
         ", cols);");
  decompose("row_", kept);
  // Stages share the row's scope: values finished in one are read by the next.
  for (const KStage& st : k_->stages) {
    stage_loop(st, red_loop, "cols");  // over size-1 axes the loop runs once
  }
  --indent_;
  line("}");
}

}  // namespace opfuse
