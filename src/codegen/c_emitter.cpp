#include "codegen/c_emitter.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>

#include "ir/ops.h"

namespace opfuse {

RowSplit split_rows(const KernelIR& k) {
  RowSplit r;
  r.rows = cst(1);
  r.cols = cst(1);
  for (size_t a = 0; a < k.domain.size(); ++a) {
    bool red = std::find(k.reduce_axes.begin(), k.reduce_axes.end(), static_cast<int64_t>(a)) != k.reduce_axes.end();
    (red ? r.reduced : r.kept).push_back(a);
    (red ? r.cols : r.rows) = (red ? r.cols : r.rows) * k.domain[a];
    int64_t c = 0;
    if (red && !(is_const(k.domain[a], &c) && c == 1)) r.loop.push_back(a);
  }
  return r;
}

std::string StrideSignature::key() const {
  std::string k;
  for (auto& c : classes) k += c + "/";
  return k;
}

void CEmitter::line(const std::string& s) { out_ << std::string(static_cast<size_t>(indent_) * 2, ' ') << s << "\n"; }

std::string CEmitter::storage_type(DType t) const {
  switch (t) {
    case DType::Bool: return "bool";
    case DType::Int32: return "int32_t";
    case DType::Int64: return "int64_t";
    case DType::Float16: return "opf_half";
    case DType::BFloat16: return "opf_bf16";
    case DType::Float32: return "float";
    case DType::Float64: return "double";
  }
  return "void";
}

std::string CEmitter::value_type(DType t) const { return storage_type(compute_dtype(t)); }

std::string CEmitter::load(int b, const std::string& off) const {
  DType t = k_->buffers[static_cast<size_t>(b)].dtype;
  std::string e = "b" + std::to_string(b) + "[" + off + "]";
  if (t == DType::Float16 || t == DType::BFloat16) return "opf_to_float(" + e + ")";
  return e;
}

std::string CEmitter::store(int b, const std::string& off, const std::string& v) const {
  DType t = k_->buffers[static_cast<size_t>(b)].dtype;
  std::string dst = "b" + std::to_string(b) + "[" + off + "]";
  if (t == DType::Float16) return dst + " = opf_float_to_half(" + v + ");";
  if (t == DType::BFloat16) return dst + " = opf_float_to_bf16(" + v + ");";
  return dst + " = (" + storage_type(t) + ")(" + v + ");";
}

std::string CEmitter::literal(double v, DType t) const {
  t = compute_dtype(t);
  if (t == DType::Bool) return v != 0 ? "true" : "false";
  if (!is_floating(t)) return "((" + storage_type(t) + ")" + std::to_string(static_cast<int64_t>(v)) + "LL)";
  std::string ty = storage_type(t);
  if (std::isnan(v)) return "opf_nan<" + ty + ">()";
  if (std::isinf(v)) return std::string(v < 0 ? "-" : "") + "opf_inf<" + ty + ">()";
  char buf[64];
  std::snprintf(buf, sizeof buf, t == DType::Float64 ? "%.17g" : "%.9g", v);
  std::string s = buf;
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return t == DType::Float64 ? s : s + "f";
}

std::string CEmitter::size_c(const Expr& e) const {
  return to_c(e, [](const ExprNode& n) { return n.name; });
}

Expr CEmitter::offset_expr(int b, const std::vector<Expr>& idx) const {
  const KBuffer& buf = k_->buffers[static_cast<size_t>(b)];
  Expr off = cst(0);
  if (buf.strided) {
    int sb = 0;  // which strided buffer this is
    for (int i = 0; i < b; ++i) sb += k_->buffers[static_cast<size_t>(i)].strided;
    const std::string& cls = sig_->classes[static_cast<size_t>(sb)];
    for (size_t d = 0; d < idx.size(); ++d) {
      char c = cls[d];
      if (c == '0') continue;
      off = off + (c == '1' ? idx[d] : idx[d] * var("st" + std::to_string(b) + "_" + std::to_string(d)));
    }
  } else {
    Expr stride = cst(1);
    for (size_t d = idx.size(); d-- > 0;) {
      off = off + idx[d] * stride;
      stride = stride * buf.shape[d];
    }
  }
  return off;
}

std::string CEmitter::acc_name(const KAccumulator& a, const char* part) const {
  return "a" + std::to_string(a.result) + part;
}

void CEmitter::accumulator_init(const KAccumulator& a) {
  std::string t = value_type(a.type);
  const std::string& c = a.combiner;
  if (c == "sum") line(t + " " + acc_name(a) + " = 0;");
  else if (c == "prod") line(t + " " + acc_name(a) + " = 1;");
  else if (c == "max" || c == "argmax") line(t + " " + acc_name(a) + " = opf_lowest<" + t + ">();");
  else if (c == "min" || c == "argmin") line(t + " " + acc_name(a) + " = opf_highest<" + t + ">();");
  if (c == "argmax" || c == "argmin") line("int64_t " + acc_name(a, "_i") + " = 0;");
  if (c == "welford") {
    line("double " + acc_name(a) + " = 0, " + acc_name(a, "_m2") + " = 0;");
    line("int64_t " + acc_name(a, "_n") + " = 0;");
  }
}

void CEmitter::accumulator_finish(const KAccumulator& a) {
  std::string t = value_type(a.result_type);
  std::string r = "const " + t + " " + value(a.result) + " = ";
  const std::string& c = a.combiner;
  if (c == "sum" && a.mean) line(r + "(" + t + ")(" + acc_name(a) + " / (" + value_type(a.type) + ")(" + size_c(a.count) + "));");
  else if (c == "argmax" || c == "argmin") line(r + acc_name(a, "_i") + ";");
  else if (c == "welford")
    line(r + "(" + t + ")(" + acc_name(a, "_m2") + " / (double)opf_imax(" + acc_name(a, "_n") + " - " +
         std::to_string(a.correction) + "LL, 0LL));");
  else line(r + "(" + t + ")" + acc_name(a) + ";");
}

void CEmitter::statement(const KStmt& s, const KStage& stage) {
  auto def = [&](const std::string& e) { line("const " + value_type(s.type) + " " + value(s.dst) + " = " + e + ";"); };
  switch (s.kind) {
    case KStmt::Load: def(load(s.buffer, offset(s.buffer, s.index))); break;
    case KStmt::Const: def(s.size ? "(" + value_type(s.type) + ")(" + size_c(s.size) + ")" : literal(s.value, s.type)); break;
    case KStmt::Cast: {
      std::string v = value(s.args[0]);
      DType to = s.node.dtype;
      // An integer made float: a zero is +0.0 by a select. With
      // -fno-trapping-math GCC turns (float)(int32_t)x into a truncation of
      // x, which gives -0.0 for x in (-1, 0) where PyTorch's integer gives
      // +0.0 (reciprocal: -inf against inf; IR fuzzer seed 3939, graph 115);
      // it folds a + 0.0f away, not the select, which vectorises.
      const DType from = k_->value_types.at(static_cast<size_t>(s.args[0]));
      if (is_integral(from) && is_floating(to)) {
        const std::string t = to == DType::Float64 ? "double" : "float";
        v = "(" + v + " == 0 ? (" + t + ")0 : (" + t + ")" + v + ")";
      }
      if (to == DType::Bool) def("(" + v + " != 0)");
      else if (to == DType::BFloat16) def("opf_round_bf16((float)" + v + ")");
      else if (to == DType::Float16) def("opf_round_half((float)" + v + ")");
      else def("(" + value_type(to) + ")(" + v + ")");
      break;
    }
    case KStmt::Compute: {
      std::vector<std::string> a;
      for (int x : s.args) a.push_back(value(x));
      if (s.node.op == "select_lt") {
        def("(" + size_c(s.index[0]) + " < " + size_c(s.index[1]) + ") ? " + a[0] + " : " + a[1]);
        break;
      }
      def(op_def(s.node).c_expr(a, s.node));
      break;
    }
    case KStmt::Store: line(store(s.buffer, offset(s.buffer, s.index), value(s.args[0]))); break;
    case KStmt::Update: update(s, stage); break;
    case KStmt::Partial: partial(s); break;
  }
}

void CEmitter::partial(const KStmt&) {
  throw std::runtime_error("opfuse: column partials are computed only by CUDA row kernels (split_column_sums runs for CUDA)");
}

void CEmitter::update(const KStmt& s, const KStage& stage) {
  {
    {
      const KAccumulator& a = stage.accs[static_cast<size_t>(s.acc)];
      std::string v = value(s.args[0]), n = acc_name(a);
      const std::string& c = a.combiner;
      if (c == "sum") line(n + " += " + v + ";");
      else if (c == "prod") line(n + " *= " + v + ";");
      else if (c == "max") line(n + " = opf_max_nan(" + n + ", " + v + ");");
      else if (c == "min") line(n + " = opf_min_nan(" + n + ", " + v + ");");
      else if (c == "argmax" || c == "argmin") {
        std::string cmp = c == "argmax" ? ">" : "<";
        std::string axis = a.index ? size_c(a.index) : "0";
        line("if (" + v + " " + cmp + " " + n + " || (opf_isnan(" + v + ") && !opf_isnan(" + n + "))) { " + n + " = " + v +
             "; " + acc_name(a, "_i") + " = " + axis + "; }");
      } else if (c == "welford") {
        line("{ " + acc_name(a, "_n") + " += 1; const double d = (double)" + v + " - " + n + "; " + n + " += d / (double)" +
             acc_name(a, "_n") + "; " + acc_name(a, "_m2") + " += d * ((double)" + v + " - " + n + "); }");
      }
    }
  }
}

// Sets the loop variables of `axes` (last fastest) from a linear index.
void CEmitter::decompose(const std::string& linear, const std::vector<size_t>& axes, const std::string& prefix) {
  const std::string rem = prefix == "x" ? "rem_" : prefix + "rem_";
  line(index_type_ + " " + rem + " = " + linear + ";");
  for (size_t i = axes.size(); i-- > 0;) {
    size_t a = axes[i];
    int64_t one = 0;
    if (is_const(k_->domain[a], &one) && one == 1) continue;
    std::string x = prefix + std::to_string(a), n = size_c(k_->domain[a]);
    if (i == 0) line("const " + index_type_ + " " + x + " = " + rem + ";");
    else {
      line("const " + index_type_ + " " + x + " = " + rem + " % " + n + ";");
      line(rem + " /= " + n + ";");
    }
  }
  line("(void)" + rem + ";");
}

void CEmitter::bind_arguments() {
  for (size_t i = 0; i < k_->symbols.size(); ++i)
    line("const int64_t " + k_->symbols[i] + " = syms[" + std::to_string(i) + "];");
  int sb = 0, si = 0;
  for (size_t b = 0; b < k_->buffers.size(); ++b) {
    const KBuffer& buf = k_->buffers[b];
    std::string t = storage_type(buf.dtype);
    std::string q = buf.written ? "" : "const ";
    line(q + t + "* __restrict__ b" + std::to_string(b) + " = (" + q + t + "*)bufs[" + std::to_string(b) + "];");
    if (!buf.strided) continue;
    const std::string& cls = sig_->classes[static_cast<size_t>(sb++)];
    for (size_t d = 0; d < buf.shape.size(); ++d) {
      if (cls[d] == 'x')
        line("const int64_t st" + std::to_string(b) + "_" + std::to_string(d) + " = strides[" + std::to_string(si) + "];");
      ++si;
    }
  }
}

}  // namespace opfuse
