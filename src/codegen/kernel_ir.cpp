#include "codegen/kernel_ir.h"

#include <sstream>

namespace opfuse {
namespace {

std::string index_str(const std::vector<Expr>& idx) {
  std::string s = "[";
  for (size_t i = 0; i < idx.size(); ++i) s += (i ? ", " : "") + opfuse::to_string(idx[i]);
  return s + "]";
}

std::string stmt_str(const KStmt& s) {
  std::ostringstream os;
  auto v = [](int id) { return "v" + std::to_string(id); };
  switch (s.kind) {
    case KStmt::Load: os << v(s.dst) << " = load b" << s.buffer << index_str(s.index); break;
    case KStmt::Const:
      if (s.size) os << v(s.dst) << " = size " << opfuse::to_string(s.size);
      else os << v(s.dst) << " = const " << s.value;
      break;
    case KStmt::Cast: os << v(s.dst) << " = cast<" << dtype_name(s.node.dtype) << ">(" << v(s.args[0]) << ")"; break;
    case KStmt::Compute: {
      os << v(s.dst) << " = " << s.node.op << "(";
      for (size_t i = 0; i < s.args.size(); ++i) os << (i ? ", " : "") << v(s.args[i]);
      if (!s.index.empty()) os << "; " << index_str(s.index);
      os << ")";
      break;
    }
    case KStmt::Store: os << "store b" << s.buffer << index_str(s.index) << " = " << v(s.args[0]); break;
    case KStmt::Update: os << "acc" << s.acc << " <- " << v(s.args[0]); break;
    case KStmt::Partial: os << "partial b" << s.buffer << " += " << v(s.args[0]); break;
  }
  os << " : " << dtype_name(s.type);
  return os.str();
}

}  // namespace

std::string KernelIR::to_string() const {
  std::ostringstream os;
  os << "kernel " << name << (row ? " row" : " pointwise") << " domain=" << shape_to_string(domain);
  if (row) {
    os << " reduce=[";
    for (size_t i = 0; i < reduce_axes.size(); ++i) os << (i ? "," : "") << reduce_axes[i];
    os << "]";
  }
  os << "\n";
  for (size_t b = 0; b < buffers.size(); ++b)
    os << "  b" << b << ": %" << buffers[b].node << " " << dtype_name(buffers[b].dtype) << shape_to_string(buffers[b].shape)
       << (buffers[b].strided ? " strided" : "") << (buffers[b].written ? " out" : " in") << "\n";
  for (size_t i = 0; i < stages.size(); ++i) {
    const KStage& st = stages[i];
    os << "  stage " << i << "\n";
    for (auto& s : st.pre) os << "    " << stmt_str(s) << "\n";
    if (!st.loop.empty()) {
      os << "    loop\n";
      for (auto& s : st.loop) os << "      " << stmt_str(s) << "\n";
    }
    for (size_t a = 0; a < st.accs.size(); ++a)
      os << "    acc" << a << " " << st.accs[a].combiner << (st.accs[a].mean ? " mean" : "") << " : "
         << dtype_name(st.accs[a].type) << " -> v" << st.accs[a].result << "\n";
  }
  return os.str();
}

}  // namespace opfuse
