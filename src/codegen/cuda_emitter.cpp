#include "codegen/cuda_emitter.h"

#include <algorithm>
#include <set>

namespace opfuse {

#include "prelude_cuda.inc"

const char* cuda_prelude() { return prelude_cuda; }

namespace {

bool is_one(const Expr& e) {
  int64_t c;
  return is_const(e, &c) && c == 1;
}

bool mentions(const Expr& e, const std::string& v) {
  if (e->kind == ExprNode::Var) return e->name == v;
  for (auto& a : e->args)
    if (mentions(a, v)) return true;
  return false;
}

}  // namespace

std::string CudaEmitter::header(const std::string& name, int threads) {
  size_t nb = k_->buffers.size(), ns = std::max<size_t>(1, k_->symbols.size()), nt = 0;
  for (auto& b : k_->buffers)
    if (b.strided) nt += b.shape.size();
  std::string args = name + "_args";
  line("struct " + args + " { const void* b[" + std::to_string(nb) + "]; int64_t s[" + std::to_string(ns) + "]; int64_t st[" +
       std::to_string(std::max<size_t>(1, nt)) + "]; };");
  line("extern \"C\" __global__ void __launch_bounds__(" + std::to_string(threads) + ") " + name + "(const " + args + " a) {");
  ++indent_;
  line("const void* const* bufs = a.b;");
  line("const int64_t* syms = a.s;");
  line("const int64_t* strides = a.st;");
  line("(void)syms; (void)strides;");
  bind_arguments();
  return args;
}

// The widest V such that every load and store that moves along the
// innermost dim does so with unit stride; 1 when any does otherwise.
int CudaEmitter::choose_vec(bool all_stages) {
  size_t n = k_->domain.size();
  vec_buffer_.assign(k_->buffers.size(), false);
  if (n == 0 || is_one(k_->domain[n - 1])) return 1;
  std::string x = "x" + std::to_string(n - 1);
  int max_size = 0;
  std::vector<const std::vector<KStmt>*> lists;
  for (size_t i = 0; i < (all_stages ? k_->stages.size() : 1); ++i) {
    lists.push_back(&k_->stages[i].pre);
    lists.push_back(&k_->stages[i].loop);
  }
  for (const auto* list : lists)
    for (const KStmt& s : *list) {
      if (s.kind != KStmt::Load && s.kind != KStmt::Store) continue;
      for (auto& e : s.index)
        if (e->kind != ExprNode::Var && mentions(e, x) && !(e->kind == ExprNode::Var)) {
          // x inside a compound index (reshape, slice step, cat): no vectors.
          Expr step = substitute(e, [&](const ExprNode& v) -> Expr { return v.name == x ? var(x) + cst(1) : nullptr; }) - e;
          int64_t c;
          if (!is_const(step, &c) || c != 1) return 1;
        }
      Expr off = offset_expr(s.buffer, s.index);
      if (!mentions(off, x)) continue;
      Expr step = substitute(off, [&](const ExprNode& v) -> Expr { return v.name == x ? var(x) + cst(1) : nullptr; }) - off;
      int64_t c;
      if (!is_const(step, &c) || c != 1) return 1;
      vec_buffer_[static_cast<size_t>(s.buffer)] = true;
      max_size = std::max(max_size, dtype_size(k_->buffers[static_cast<size_t>(s.buffer)].dtype));
    }
  if (max_size == 0) return 1;
  return std::max(1, 16 / max_size);
}

std::string CudaEmitter::access_key(const KStmt& s) const {
  return std::to_string(s.buffer) + "@" + offset(s.buffer, s.index);
}

void CudaEmitter::vector_loads(const std::vector<KStmt>& stmts, const std::string& lane0) {
  for (const KStmt& s : stmts) {
    if (s.kind != KStmt::Load || !vec_buffer_[static_cast<size_t>(s.buffer)]) continue;
    std::string key = access_key(s);
    if (lane_of_.count(key)) continue;
    if (caching_ && cache_slot_.count(key)) continue;  // read from registers instead
    std::string arr = "lv" + std::to_string(lane_of_.size());
    lane_of_[key] = arr;
    std::vector<Expr> idx = s.index;
    for (auto& e : idx) e = substitute(e, [&](const ExprNode& v) -> Expr { return v.name == last_var_ ? var(lane0) : nullptr; });
    line(storage_type(k_->buffers[static_cast<size_t>(s.buffer)].dtype) + " " + arr + "[" + std::to_string(vec_) + "];");
    line("opf_vload<" + std::to_string(vec_) + ">(b" + std::to_string(s.buffer) + " + " + offset(s.buffer, idx) + ", " + arr + ");");
  }
  for (const KStmt& s : stmts) {
    if (s.kind != KStmt::Store || !vec_buffer_[static_cast<size_t>(s.buffer)]) continue;
    std::string key = access_key(s);
    if (lane_of_.count(key)) continue;
    std::string arr = "lv" + std::to_string(lane_of_.size());
    lane_of_[key] = arr;
    line(storage_type(k_->buffers[static_cast<size_t>(s.buffer)].dtype) + " " + arr + "[" + std::to_string(vec_) + "];");
  }
}

void CudaEmitter::vector_stores(const std::vector<KStmt>& stmts, const std::string& lane0) {
  for (const KStmt& s : stmts) {
    if (s.kind != KStmt::Store || !vec_buffer_[static_cast<size_t>(s.buffer)]) continue;
    std::vector<Expr> idx = s.index;
    for (auto& e : idx) e = substitute(e, [&](const ExprNode& v) -> Expr { return v.name == last_var_ ? var(lane0) : nullptr; });
    line("opf_vstore<" + std::to_string(vec_) + ">(b" + std::to_string(s.buffer) + " + " + offset(s.buffer, idx) + ", " +
         lane_of_.at(access_key(s)) + ");");
  }
}

void CudaEmitter::statement(const KStmt& s, const KStage& stage) {
  bool vec_access = in_lanes_ && (s.kind == KStmt::Load || s.kind == KStmt::Store) && vec_buffer_[static_cast<size_t>(s.buffer)];
  std::string cache_index = in_lanes_ ? "it_ * " + std::to_string(vec_) + " + j_" : "it_";
  // Row kernels: a row's loads are kept in registers after the first stage.
  if (caching_ && s.kind == KStmt::Load && s.varying) {
    std::string key = access_key(s);
    auto it = cache_slot_.find(key);
    if (it != cache_slot_.end()) {
      line("const " + value_type(s.type) + " " + value(s.dst) + " = rc" + std::to_string(it->second) + "[" + cache_index + "];");
      return;
    }
    int slot = static_cast<int>(cache_types_.size());
    cache_slot_[key] = slot;
    cache_types_.push_back(value_type(s.type));
    if (vec_access) {
      DType t = k_->buffers[static_cast<size_t>(s.buffer)].dtype;
      std::string e = lane_of_.at(key) + "[j_]";
      if (t == DType::Float16 || t == DType::BFloat16) e = "opf_to_float(" + e + ")";
      line("const " + value_type(s.type) + " " + value(s.dst) + " = " + e + ";");
    } else {
      CEmitter::statement(s, stage);
    }
    line("rc" + std::to_string(slot) + "[" + cache_index + "] = " + value(s.dst) + ";");
    return;
  }
  // Vector lanes: lane j of the arrays filled (or drained) outside the lane loop.
  if (vec_access) {
    std::string arr = lane_of_.at(access_key(s));
    DType t = k_->buffers[static_cast<size_t>(s.buffer)].dtype;
    if (s.kind == KStmt::Load) {
      std::string e = arr + "[j_]";
      if (t == DType::Float16 || t == DType::BFloat16) e = "opf_to_float(" + e + ")";
      line("const " + value_type(s.type) + " " + value(s.dst) + " = " + e + ";");
    } else {
      std::string v = value(s.args[0]);
      if (t == DType::Float16) line(arr + "[j_] = opf_float_to_half(" + v + ");");
      else if (t == DType::BFloat16) line(arr + "[j_] = opf_float_to_bf16(" + v + ");");
      else line(arr + "[j_] = (" + storage_type(t) + ")(" + v + ");");
    }
    return;
  }
  CEmitter::statement(s, stage);
}

void CudaEmitter::pointwise(const std::string& name, int vec) {
  vec_ = vec;
  const KStage& st = k_->stages.at(0);
  size_t n = k_->domain.size();
  header(name, 256);
  line("const int64_t numel = " + size_c(numel(k_->domain)) + ";");
  line("const int64_t step_ = (int64_t)gridDim.x * blockDim.x * " + std::to_string(vec) + ";");
  line("for (int64_t base_ = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * " + std::to_string(vec) +
       "; base_ < numel; base_ += step_) {");
  ++indent_;
  if (n == 0) {
    for (auto& s : st.pre) statement(s, st);
    for (auto& s : st.loop) statement(s, st);
  } else {
    std::vector<size_t> all;
    for (size_t a = 0; a < n; ++a) all.push_back(a);
    std::string last = "x" + std::to_string(n - 1);
    last_var_ = last;
    if (vec == 1) {
      decompose("base_", all);
      for (auto& s : st.pre) statement(s, st);
      for (auto& s : st.loop) statement(s, st);
    } else {
      std::vector<size_t> outer(all.begin(), all.end() - 1);
      std::string nl = size_c(k_->domain[n - 1]);
      line("const int64_t xl_ = base_ % " + nl + ";");
      decompose("base_ / " + nl, outer);
      for (auto& s : st.pre) statement(s, st);
      lane_of_.clear();
      vector_loads(st.loop, "xl_");
      line("#pragma unroll");
      line("for (int j_ = 0; j_ < " + std::to_string(vec) + "; ++j_) {");
      ++indent_;
      line("const int64_t " + last + " = xl_ + j_;");
      in_lanes_ = true;
      for (auto& s : st.loop) statement(s, st);
      in_lanes_ = false;
      --indent_;
      line("}");
      vector_stores(st.loop, "xl_");
    }
  }
  --indent_;
  line("}");
  --indent_;
  line("}");
}

void CudaEmitter::reduce_across_threads(const KAccumulator& a) {
  std::string t = value_type(a.type), n = acc_name(a);
  const std::string& c = a.combiner;
  std::string op = c == "sum" ? "opf_sum" : c == "prod" ? "opf_prod" : c == "max" ? "opf_max" : "opf_min";
  if (c == "sum" || c == "prod" || c == "max" || c == "min") {
    if (warp_rows_) line(n + " = opf_warp_reduce<" + op + ">(" + n + ");");
    else line(n + " = opf_block_reduce<" + op + ">(" + n + ", " + smem_ + ");");
  } else if (c == "argmax" || c == "argmin") {
    std::string mx = c == "argmax" ? "true" : "false";
    if (warp_rows_) line("opf_warp_arg<" + mx + ">(" + n + ", " + acc_name(a, "_i") + ");");
    else line("opf_block_arg<" + mx + ">(" + n + ", " + acc_name(a, "_i") + ", " + smem_ + ");");
  } else if (c == "welford") {
    if (warp_rows_) line("opf_warp_welford(" + n + ", " + acc_name(a, "_m2") + ", " + acc_name(a, "_n") + ");");
    else line("opf_block_welford(" + n + ", " + acc_name(a, "_m2") + ", " + acc_name(a, "_n") + ", " + smem_ + ");");
  }
}

void CudaEmitter::row_kernel(const std::string& name, int vec) {
  vec_ = vec;
  cache_slot_.clear();
  cache_types_.clear();
  lane_of_.clear();
  RowSplit split = split_rows(*k_);
  const std::vector<size_t>& kept = split.kept;
  const std::vector<size_t>& red_loop = split.loop;
  Expr rows = split.rows, cols = split.cols;
  launch_.rows = rows;
  launch_.cols = cols;
  int64_t ncols = -1;
  bool known = is_const(cols, &ncols);
  int threads;
  if (known && ncols <= 1024) {
    warp_rows_ = true;
    threads = 256;
    launch_.rows_per_block = 8;
  } else {
    warp_rows_ = false;
    threads = known ? static_cast<int>(std::min<int64_t>(1024, std::max<int64_t>(128, ncols / 8 / vec))) : 512;
    int p = 128;
    while (p < threads) p *= 2;
    threads = p;
    launch_.rows_per_block = 1;
  }
  int per_row = warp_rows_ ? 32 : threads;
  int chunk = per_row * vec;  // elements a row's threads cover per item
  int items = known ? static_cast<int>((ncols + chunk - 1) / chunk) : 0;
  // Registers per thread: 64K / threads, at most 255; 40 stay for the rest.
  std::set<std::string> cached_loads;
  for (const KStage& st : k_->stages)
    for (const KStmt& s : st.loop)
      if (s.kind == KStmt::Load && s.varying) cached_loads.insert(access_key(s));
  int budget = std::min(65536 / threads, 255) - 40;
  caching_ = known && items >= 1 && items * vec * static_cast<int>(cached_loads.size()) <= budget && k_->stages.size() > 1;
  launch_.items = caching_ ? items : 0;
  launch_.threads = threads;
  std::string last = red_loop.size() == 1 ? "x" + std::to_string(red_loop[0]) : "";
  last_var_ = last;

  // The body is printed to a side buffer first: the register arrays it
  // uses are declared before it.
  std::string saved = out_.str();
  out_.str("");
  int base_indent = indent_;
  indent_ = 2;
  decompose("row_", kept);
  std::string T = std::to_string(per_row);
  for (size_t si = 0; si < k_->stages.size(); ++si) {
    const KStage& st = k_->stages[si];
    stage_index_ = static_cast<int>(si);
    for (auto& s : st.pre) statement(s, st);
    for (auto& a : st.accs) accumulator_init(a);
    if (!st.loop.empty()) {
      if (caching_) {
        line("#pragma unroll");
        line("for (int it_ = 0; it_ < " + std::to_string(items) + "; ++it_) {");
        ++indent_;
        line("const int64_t c_ = ((int64_t)it_ * " + T + " + tid_) * " + std::to_string(vec) + ";");
        line("if (c_ < cols) {");
      } else {
        line("for (int64_t c_ = (int64_t)tid_ * " + std::to_string(vec) + "; c_ < cols; c_ += " + std::to_string(chunk) + ") {");
      }
      ++indent_;
      if (vec > 1) {
        for (auto it = lane_of_.begin(); it != lane_of_.end();) it = lane_of_.erase(it);
        vector_loads(st.loop, "c_");
        line("#pragma unroll");
        line("for (int j_ = 0; j_ < " + std::to_string(vec) + "; ++j_) {");
        ++indent_;
        line("const int64_t " + last + " = c_ + j_;");
        in_lanes_ = true;
        for (auto& s : st.loop) statement(s, st);
        in_lanes_ = false;
        --indent_;
        line("}");
        vector_stores(st.loop, "c_");
      } else {
        if (red_loop.size() == 1) line("const int64_t " + last + " = c_;");
        else if (!red_loop.empty()) decompose("c_", red_loop);
        for (auto& s : st.loop) statement(s, st);
      }
      --indent_;
      line("}");
      if (caching_) {
        --indent_;
        line("}");
      }
    }
    for (auto& a : st.accs) reduce_across_threads(a);
    for (auto& a : st.accs) accumulator_finish(a);
    for (auto& s : st.post) statement(s, st);
  }
  std::string body = out_.str();
  out_.str("");
  out_ << saved;
  indent_ = base_indent;

  header(name, threads);
  line("__shared__ __align__(16) double " + smem_ + "[128];");
  line("(void)" + smem_ + ";");
  line("const int64_t rows = " + size_c(rows) + ";");
  line("const int64_t cols = " + size_c(cols) + ";");
  if (warp_rows_) {
    line("const int tid_ = threadIdx.x & 31;");
    line("const int64_t row_ = (int64_t)blockIdx.x * " + std::to_string(launch_.rows_per_block) + " + (threadIdx.x >> 5);");
    line("if (row_ >= rows) return;");
  } else {
    line("const int tid_ = threadIdx.x;");
    line("for (int64_t row_ = blockIdx.x; row_ < rows; row_ += gridDim.x) {");
  }
  for (size_t i = 0; i < cache_types_.size(); ++i)
    line("  " + cache_types_[i] + " rc" + std::to_string(i) + "[" + std::to_string(items * vec) + "];");
  out_ << body;
  if (!warp_rows_) line("}");
  --indent_;
  line("}");
}

std::string CudaEmitter::emit(const KernelIR& k, const StrideSignature& sig) {
  k_ = &k;
  sig_ = &sig;
  out_.str("");
  indent_ = 0;
  cache_slot_.clear();
  cache_types_.clear();
  launch_ = CudaLaunch{};
  launch_.name = k.name;
  launch_.row = k.row;
  if (k.row) {
    // Vectors along the row when the only reduced axis is the innermost
    // one and every access moves along it with unit stride.
    int v = (k.reduce_axes.size() == 1 && k.reduce_axes[0] == static_cast<int64_t>(k.domain.size()) - 1) ? choose_vec(true) : 1;
    row_kernel(k.name, 1);
    CudaLaunch scalar = launch_;
    if (v > 1) {
      std::vector<bool> vb = vec_buffer_;
      row_kernel(k.name + "_v" + std::to_string(v), v);
      CudaLaunch vl = launch_;
      launch_ = scalar;
      launch_.vec = v;
      launch_.vec_name = k.name + "_v" + std::to_string(v);
      launch_.vec_threads = vl.threads;
      launch_.vec_rows_per_block = vl.rows_per_block;
      for (size_t b = 0; b < vb.size(); ++b)
        if (vb[b]) launch_.vec_buffers.push_back(static_cast<int>(b));
    }
    return out_.str();
  }
  launch_.numel = numel(k.domain);
  launch_.threads = 256;
  int v = choose_vec(false);
  pointwise(k.name, 1);
  if (v > 1) {
    launch_.vec = v;
    launch_.vec_name = k.name + "_v" + std::to_string(v);
    for (size_t b = 0; b < vec_buffer_.size(); ++b)
      if (vec_buffer_[b]) launch_.vec_buffers.push_back(static_cast<int>(b));
    pointwise(launch_.vec_name, v);
  }
  return out_.str();
}

}  // namespace opfuse
