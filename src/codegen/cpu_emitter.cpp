#include "codegen/cpu_emitter.h"

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
  // Row loops: dividing by a row's reduction (softmax's sum) multiplies by
  // its reciprocal, hoisted out of the loop by the compiler (float32 only:
  // within an ulp or two; a vector divide costs ten times a multiply).
  if (in_row_loop_ && s.kind == KStmt::Compute && s.node.op == "div" && s.type == DType::Float32 &&
      s.node.get_str("rounding_mode", "true") == "true" && !loop_varying_.count(s.args[1])) {
    line("const float " + value(s.dst) + " = " + value(s.args[0]) + " * (1.0f / " + value(s.args[1]) + ");");
    return;
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
    // Floating sums add up in double (a simd lane of them): a lane adding
    // a long row into a float drifts one way when the terms are alike
    // (36891 equal terms came out 3.4e-4 off, and blocks of 2048 into a
    // double total still 1.5e-5; PyTorch's cascade sum is within 1e-7).
    // The sums' loops read their data once, so the wider adds cost little.
    if (a.combiner == "sum" && is_floating(a.type)) line("double " + acc_name(a) + " = 0;");
    else accumulator_init(a);
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
    loop_varying_.clear();
    for (auto& s : st.loop)
      if (s.varying && s.dst >= 0) loop_varying_.insert(s.dst);
    in_row_loop_ = true;
    for (auto& s : st.loop) statement(s, st);
    in_row_loop_ = false;
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

void CpuEmitter::row_body() {
  RowSplit split = split_rows(*k_);
  const std::vector<size_t>& kept = split.kept;
  const std::vector<size_t>& red_loop = split.loop;
  Expr rows = split.rows, cols = split.cols;
  line("const int64_t rows = " + size_c(rows) + ";");
  line("const int64_t cols = " + size_c(cols) + ";");
  line("#pragma omp parallel for schedule(static) if (rows * cols > 32768)");
  line("for (int64_t row_ = 0; row_ < rows; ++row_) {");
  ++indent_;
  decompose("row_", kept);
  // Stages share the row's scope: values finished in one are read by the next.
  for (const KStage& st : k_->stages) {
    stage_loop(st, red_loop, "cols");  // over size-1 axes the loop runs once
  }
  --indent_;
  line("}");
}

}  // namespace opfuse
