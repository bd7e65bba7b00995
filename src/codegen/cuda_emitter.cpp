#include "codegen/cuda_emitter.h"

#include <algorithm>
#include <cstdlib>
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

std::string CudaEmitter::header(const std::string& name, int threads, int cluster) {
  size_t nb = k_->buffers.size(), ns = std::max<size_t>(1, k_->symbols.size()), nt = 0;
  for (auto& b : k_->buffers)
    if (b.strided) nt += b.shape.size();
  std::string args = name + "_args";
  // Row groups exchanging through global memory: their workspace last (the
  // runtime puts it after the strides).
  line("struct " + args + " { const void* b[" + std::to_string(nb) + "]; int64_t s[" + std::to_string(ns) + "]; int64_t st[" +
       std::to_string(std::max<size_t>(1, nt)) + "];" + (group_exchange_ ? " unsigned long long* gx;" : "") + " };");
  std::string dims = cluster > 1 ? "__cluster_dims__(" + std::to_string(cluster) + ", 1, 1) " : "";
  // Row kernels say "at least one block an SM": with the thread count alone,
  // ptxas sometimes caps registers at 48 and spills a register cache that
  // fits in 56 (seen on sm_80 and sm_90 with 128-thread blocks).
  // OPFUSE_ROW_MIN_BLOCKS=n asks for n blocks an SM (a register cap) in the
  // vector twins of row kernels, to measure occupancy against registers.
  const char* mb = std::getenv("OPFUSE_ROW_MIN_BLOCKS");
  std::string min_blocks = mb && std::atoi(mb) > 0 && vec_ > 1 ? std::to_string(std::atoi(mb)) : "1";
  // A cluster stepping through rows with column partials (rows of 8193 to
  // 32768) holds 64 registers' worth at 512 threads: two blocks an SM, so
  // that one block's cluster barriers overlap the other's loads.
  if (!(mb && std::atoi(mb) > 0) && cluster_row_loop_ && vec_ > 1) min_blocks = "2";
  // 1024-thread loop blocks for rows overflowing L2: two an SM (32 registers).
  if (!(mb && std::atoi(mb) > 0) && k_->row && loop_overflow_ && vec_ > 1) min_blocks = "2";
  // A register pipeline (OPFUSE_ROW_PIPELINE) holds the next row's vectors
  // too: with the raw cache ptxas left 80 registers at 32768x4096 (one
  // 512-thread block an SM) where 62 fit without spills; ask for two. (Not
  // with a float cache: float32 rows of 4096 spilled 52 bytes at 64; nor lane
  // groups, whose partials of 1000-element rows need far more.)
  if (!(mb && std::atoi(mb) > 0) && k_->row && pipeline_ && !raw_slots_.empty() && !grouped_rows_ && !cluster_row_loop_ &&
      vec_ > 1 && threads == 512)
    min_blocks = "2";
  // 32-bit indices (OPFUSE_ROW_INDEX32) in a block-per-row partials kernel
  // of 512 threads with a register cache: ptxas at one block an SM took 68 to
  // 72 registers at 32768x4096 bf16 (one block an SM), 62 at two without
  // spills; ask for the two blocks the defaults got at 64.
  if (!(mb && std::atoi(mb) > 0) && k_->row && index_type_ == "int" && !partial_buffers_.empty() && !grouped_rows_ &&
      cluster_ == 1 && caching_ && vec_ > 1 && threads == 512)
    min_blocks = "2";
  // Lane groups stepping through rows (OPFUSE_ROW_GROUP_LOOP) hold the next
  // row's vectors too: at 262144x256 bf16 ptxas took 72-96 registers at one
  // block an SM (two or three 256-thread blocks), 64-80 at three without
  // spills (four or three: layer_norm spilled 8 bytes at four).
  if (!(mb && std::atoi(mb) > 0) && k_->row && group_loop_ && vec_ > 1) min_blocks = "3";
  // Lean partials kernels (OPFUSE_ROW_LEAN): see lean_blocks_.
  if (!(mb && std::atoi(mb) > 0) && k_->row && lean_blocks_ > 0 && vec_ > 1) min_blocks = std::to_string(lean_blocks_);
  // Rows staged in shared memory: as many blocks an SM as its shared memory
  // holds (three of 64 KB on sm_90), so one block's reductions and stores
  // overlap another's copies.
  if (!(mb && std::atoi(mb) > 0) && k_->row && stage_bytes_ > 0 && vec_ > 1) min_blocks = std::to_string(stage_min_blocks_);
  std::string bounds = std::to_string(threads) + (k_->row ? ", " + min_blocks : "");
  line("extern \"C\" __global__ void __launch_bounds__(" + bounds + ") " + dims + name + "(const " + args + " a) {");
  ++indent_;
  // Programmatic dependent launch (sm_90; OPFUSE_PDL=0 turns it off): the
  // kernel may start while the one before it ends (its launch and first
  // instructions overlap that kernel's tail) and waits before it reads
  // anything. H200, session 15: Llama's M = 16 block (its gate kernel sits
  // between two GEMMs) 2.0-2.9 us a call faster, the rest unchanged.
  const char* pdl = std::getenv("OPFUSE_PDL");
  if (arch_ >= 90 && !(pdl && std::string(pdl) == "0")) {
    line("opf_grid_dependency_wait();");
    line("opf_launch_dependents();");
    launch_.pdl = true;
  }
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
  vec_offsets_.clear();
  if (n == 0 || is_one(k_->domain[n - 1])) return 1;
  std::string x = "x" + std::to_string(n - 1);
  int max_size = 0;
  // Each vector access's element offset with every loop index and stride
  // at 0: what is left (a slice's start, a cat's shift) must be a multiple
  // of the vector, on top of the run time's checks of pointers, of the
  // strides and of the innermost sizes (which cover the terms of the loop
  // indices). x[1:-3] of 12 floats read at xl_ + 1 as float4 was a
  // misaligned address on the GPU.
  std::vector<Expr> bases;
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
      bases.push_back(substitute(off, [](const ExprNode& v) -> Expr { return v.kind == ExprNode::Var ? cst(0) : nullptr; }));
    }
  if (max_size == 0) return 1;
  const int vec = std::max(1, 16 / max_size);
  for (const Expr& b : bases) {
    int64_t c;
    if (is_const(b, &c)) {
      if (c % vec != 0) return 1;
    } else if (std::none_of(vec_offsets_.begin(), vec_offsets_.end(), [&](const Expr& e) { return expr_equal(e, b); })) {
      vec_offsets_.push_back(b);
    }
  }
  return vec;
}

std::string CudaEmitter::access_key(const KStmt& s) const {
  return std::to_string(s.buffer) + "@" + offset(s.buffer, s.index);
}

void CudaEmitter::vector_loads(const std::vector<KStmt>& stmts, const std::string& lane0) {
  for (const KStmt& s : stmts) {
    if (s.kind != KStmt::Load || !vec_buffer_[static_cast<size_t>(s.buffer)]) continue;
    std::string key = access_key(s);
    if (lane_of_.count(key)) continue;
    if (caching_ && cache_.read[static_cast<size_t>(stage_index_)].count(s.dst)) continue;  // read from registers instead
    if (auto st = staged_.find(s.buffer); st != staged_.end()) {
      // The thread's own copy of these columns, from the stage prologue; as
      // the raw 16-byte vector where 16-bit loads are read as raw lanes (one
      // shift or mask an element, not a permute and a shift: the staged
      // rows' three passes each paid it, session 10).
      DType t = k_->buffers[static_cast<size_t>(s.buffer)].dtype;
      std::string src = st->second.name + " + (" + lane0 + " - cbegin_)";
      if (raw_lanes_ && vec_ == 8 && (t == DType::BFloat16 || t == DType::Float16)) {
        std::string arr = "rl" + std::to_string(lane_of_.size());
        lane_of_[key] = arr;
        line("const opf_vec<16> " + arr + " = *reinterpret_cast<const opf_vec<16>*>(" + src + ");");
        continue;
      }
      std::string arr = "lv" + std::to_string(lane_of_.size());
      lane_of_[key] = arr;
      line(storage_type(t) + " " + arr + "[" + std::to_string(vec_) + "];");
      line("opf_vload<" + std::to_string(vec_) + ">(" + src + ", " + arr + ");");
      continue;
    }
    std::vector<Expr> idx = s.index;
    for (auto& e : idx) e = substitute(e, [&](const ExprNode& v) -> Expr { return v.name == last_var_ ? var(lane0) : nullptr; });
    int raw_slot = -1;
    std::string pipe;  // the pipeline register this load comes from (see pipeline_)
    if (prefetch_ && pipeline_ && dtype_size(k_->buffers[static_cast<size_t>(s.buffer)].dtype) * vec_ == 16) {
      bool row_varying = false;
      std::vector<Expr> next = idx;
      for (auto& e : next)
        e = substitute(e, [&](const ExprNode& v) -> Expr {
          if (!kept_vars_.count(v.name)) return nullptr;
          row_varying = true;
          return var("pf" + v.name);
        });
      if (row_varying) {
        pipe = "nx" + std::to_string(pipe_arrays_.size());
        pipe_arrays_.emplace_back(pipe, pipe_items_);
        std::string src = "*reinterpret_cast<const opf_vec<16>*>(b" + std::to_string(s.buffer) + " + ";
        line("if (pl_first_) " + pipe + "[it_] = " + src + offset(s.buffer, idx) + ");");
        pipe_lines_.push_back(pipe + "[it_] = " + src + offset(s.buffer, next) + ");");
        pipe += "[it_]";
      }
    }
    if (caching_) {
      const std::map<int, int>& writes = cache_.write[static_cast<size_t>(stage_index_)];
      auto w = writes.find(s.dst);
      if (w != writes.end() && raw_slots_.count(w->second)) raw_slot = w->second;
    }
    if (raw_slot >= 0) {
      // Loaded straight into the raw cache vector; its lanes are read from there.
      std::string arr = "rr" + std::to_string(raw_slot) + "[it_]";
      lane_of_[key] = arr;
      if (!pipe.empty()) line(arr + " = " + pipe + ";");
      else line(arr + " = *reinterpret_cast<const opf_vec<16>*>(b" + std::to_string(s.buffer) + " + " + offset(s.buffer, idx) + ");");
    } else if (raw_lanes_ && pipe.empty() && vec_ == 8 && !k_->buffers[static_cast<size_t>(s.buffer)].written && dtype_size(k_->buffers[static_cast<size_t>(s.buffer)].dtype) == 2 &&
               (k_->buffers[static_cast<size_t>(s.buffer)].dtype == DType::BFloat16 ||
                k_->buffers[static_cast<size_t>(s.buffer)].dtype == DType::Float16)) {
      // The 16-byte vector as it came (OPFUSE_ROW_RAW_LANES); its lanes are
      // read with opf_raw_lane, as from the raw cache (same float bits as
      // opf_to_float of each element).
      std::string arr = "rl" + std::to_string(lane_of_.size());
      lane_of_[key] = arr;
      std::string src = "b" + std::to_string(s.buffer) + " + " + offset(s.buffer, idx);
      if (!l2_policy_.empty()) line("const opf_vec<16> " + arr + " = opf_ld16_hint(" + src + ", " + l2_policy_ + ");");
      else line("const opf_vec<16> " + arr + " = *reinterpret_cast<const opf_vec<16>*>(" + src + ");");
    } else {
      std::string arr = "lv" + std::to_string(lane_of_.size());
      lane_of_[key] = arr;
      line(storage_type(k_->buffers[static_cast<size_t>(s.buffer)].dtype) + " " + arr + "[" + std::to_string(vec_) + "];");
      bool whole = dtype_size(k_->buffers[static_cast<size_t>(s.buffer)].dtype) * vec_ == 16;
      std::string src = "b" + std::to_string(s.buffer) + " + " + offset(s.buffer, idx);
      if (!pipe.empty()) line("opf_vunpack<" + std::to_string(vec_) + ">(" + pipe + ", " + arr + ");");
      else if (!l2_policy_.empty() && whole && !k_->buffers[static_cast<size_t>(s.buffer)].written)
        line("opf_vunpack<" + std::to_string(vec_) + ">(opf_ld16_hint(" + src + ", " + l2_policy_ + "), " + arr + ");");
      else line("opf_vload<" + std::to_string(vec_) + ">(" + src + ", " + arr + ");");
    }
    if (prefetch_ && !pipeline_) {
      bool row_varying = false;
      std::vector<Expr> next = idx;
      for (auto& e : next)
        e = substitute(e, [&](const ExprNode& v) -> Expr {
          if (!kept_vars_.count(v.name)) return nullptr;
          row_varying = true;
          return var("pf" + v.name);
        });
      if (row_varying) prefetch_lines_.push_back("opf_prefetch_l2(b" + std::to_string(s.buffer) + " + " + offset(s.buffer, next) + ");");
    }
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

// 16-bit vector stores go through opf_vstore_w (whole words, one 128-bit
// store; see the prelude). On the H200 (bf16, row_variants.py at f134b5a)
// log_softmax 8192x32768 3.49 -> 3.94 TB/s and the cluster-staged
// 4096x262144 rows +0-10%; kernels whose stores NVVM kept whole get the same
// SASS. OPFUSE_VSTORE_WORDS=0: opf_vstore, as before.
void CudaEmitter::vector_stores(const std::vector<KStmt>& stmts, const std::string& lane0) {
  const char* w = std::getenv("OPFUSE_VSTORE_WORDS");
  std::string fn = w && *w && std::atoi(w) <= 0 ? "opf_vstore<" : "opf_vstore_w<";
  // A loop stage with an L2 policy (OPFUSE_ROW_L2_HINTS) stores with it too.
  std::string hint = l2_policy_.empty() || fn != "opf_vstore_w<" ? "" : ", " + l2_policy_;
  if (!hint.empty()) fn = "opf_vstore_w_hint<";
  for (const KStmt& s : stmts) {
    if (s.kind != KStmt::Store || !vec_buffer_[static_cast<size_t>(s.buffer)]) continue;
    std::vector<Expr> idx = s.index;
    for (auto& e : idx) e = substitute(e, [&](const ExprNode& v) -> Expr { return v.name == last_var_ ? var(lane0) : nullptr; });
    line(fn + std::to_string(vec_) + ">(b" + std::to_string(s.buffer) + " + " + offset(s.buffer, idx) + ", " +
         lane_of_.at(access_key(s)) + hint + ");");
  }
}

void CudaEmitter::statement(const KStmt& s, const KStage& stage) {
  std::string cache_index = in_lanes_ ? "it_ * " + std::to_string(vec_) + " + j_" : "it_";
  // Row kernels: values an earlier stage computed come from registers.
  if (caching_ && s.dst >= 0) {
    auto r = cache_.read[static_cast<size_t>(stage_index_)].find(s.dst);
    if (r != cache_.read[static_cast<size_t>(stage_index_)].end()) {
      if (raw_slots_.count(r->second))
        line("const " + value_type(s.type) + " " + value(s.dst) + " = opf_raw_lane<" + raw_type_.at(r->second) + ">(rr" +
             std::to_string(r->second) + "[it_], j_);");
      else
        line("const " + value_type(s.type) + " " + value(s.dst) + " = rc" + std::to_string(r->second) + "[" + cache_index + "];");
      return;
    }
  }
  plain_statement(s, stage);
  if (caching_ && s.dst >= 0) {
    auto w = cache_.write[static_cast<size_t>(stage_index_)].find(s.dst);
    if (w != cache_.write[static_cast<size_t>(stage_index_)].end() && !raw_slots_.count(w->second))
      line("rc" + std::to_string(w->second) + "[" + cache_index + "] = " + value(s.dst) + ";");
  }
}

void CudaEmitter::plain_statement(const KStmt& s, const KStage& stage) {
  bool vec_access = in_lanes_ && (s.kind == KStmt::Load || s.kind == KStmt::Store) && vec_buffer_[static_cast<size_t>(s.buffer)];
  // Vector lanes: lane j of the arrays filled (or drained) outside the lane loop.
  if (vec_access) {
    std::string arr = lane_of_.at(access_key(s));
    DType t = k_->buffers[static_cast<size_t>(s.buffer)].dtype;
    if (s.kind == KStmt::Load) {
      std::string e = arr + "[j_]";
      // The raw cache vector, or a raw load (OPFUSE_ROW_RAW_LANES).
      if (arr.compare(0, 2, "rr") == 0 || arr.compare(0, 2, "rl") == 0) e = "opf_raw_lane<" + storage_type(t) + ">(" + arr + ", j_)";
      else if (t == DType::Float16 || t == DType::BFloat16) e = "opf_to_float(" + e + ")";
      line("const " + value_type(s.type) + " " + value(s.dst) + " = " + e + ";");
    } else {
      std::string v = value(s.args[0]);
      // A store of a cast to this 16-bit type (every bf16 row output) rounded
      // twice, opf_round_bf16 then opf_float_to_bf16 (a cvt, a shift back and
      // a second cvt an element; ptxas cannot drop them); rounding is
      // idempotent, so the cast's operand converted once gives the same
      // bits. Row kernels only, where the operand is printed in this loop
      // (not skipped for the cache). H200 (bf16, row_variants.py at 1f89c5c):
      // faster in all 12 cells measured, softmax 4096x262144 3.05 -> 3.22
      // TB/s, 32768x4096 3.74 -> 3.91, layer_norm 8192x32768 3.47 -> 3.56.
      // OPFUSE_ROW_STORE_ROUND_ONCE=0: both roundings, as before.
      const char* once = std::getenv("OPFUSE_ROW_STORE_ROUND_ONCE");
      if (!(once && *once && std::atoi(once) <= 0) && k_->row && (t == DType::Float16 || t == DType::BFloat16)) {
        size_t si = static_cast<size_t>(stage_index_);
        for (const KStmt& d : stage.loop)
          if (d.dst == s.args[0] && d.kind == KStmt::Cast && d.node.dtype == t &&
              (!caching_ || (!cache_.skip[si].count(d.dst) && !cache_.read[si].count(d.dst))))
            v = "(float)(" + value(d.args[0]) + ")";
      }
      if (t == DType::Float16) line(arr + "[j_] = opf_float_to_half(" + v + ");");
      else if (t == DType::BFloat16) line(arr + "[j_] = opf_float_to_bf16(" + v + ");");
      else line(arr + "[j_] = (" + storage_type(t) + ")(" + v + ");");
    }
    return;
  }
  // Row loops: dividing by a row's reduction (softmax's sum) multiplies by
  // its reciprocal, computed once per row by the compiler (float32 only:
  // within an ulp or two, far inside float32's tolerance).
  if (in_row_loop_ && s.kind == KStmt::Compute && s.node.op == "div" && s.type == DType::Float32 &&
      s.node.get_str("rounding_mode", "true") == "true" && !loop_varying_.count(s.args[1])) {
    line("const float " + value(s.dst) + " = " + value(s.args[0]) + " * (1.0f / " + value(s.args[1]) + ");");
    return;
  }
  // A staged layer_norm row's moments pass (OPFUSE_ROW_STAGE_MOMENTS): the
  // thread's first value is its shift k; sums of x - k and its square.
  if (!moments_mean_.empty() && s.kind == KStmt::Update && in_lanes_) {
    std::string u = value(s.args[0]);
    line("if (j_ == 0 && wn_ == 0.0f) wk_ = " + u + ";");
    line("{ const float wd_ = " + u + " - wk_; " + moments_mean_ + " += wd_; " + online_acc_ + " = fmaf(wd_, wd_, " + online_acc_ + "); }");
    return;
  }
  // The max stage of an online softmax pass: in a staged row's vector lanes
  // (OPFUSE_ROW_STAGE_ONLINE) u goes to ocv_, folded in once a vector after
  // the lane loop; elsewhere u folds into the (max, sum) pair at once.
  if (!online_acc_.empty() && s.kind == KStmt::Update && !online_vec_max_.empty() && in_lanes_) {
    line("ocv_[j_] = " + value(s.args[0]) + ";");
    return;
  }
  if (!online_acc_.empty() && s.kind == KStmt::Update) {
    const KAccumulator& a = stage.accs[static_cast<size_t>(s.acc)];
    line(std::string("opf_online_add<") + (fast_math_ ? "true" : "false") + ">(" + acc_name(a) + ", " + online_acc_ + ", " +
         value(s.args[0]) + ");");
    return;
  }
  if (fast_math_ && s.kind == KStmt::Compute && s.node.op == "exp" && s.type == DType::Float32) {
    line("const float " + value(s.dst) + " = opf_exp_fast(" + value(s.args[0]) + ");");
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

std::string CudaEmitter::emit(const KernelIR& k, const StrideSignature& sig) {
  k_ = &k;
  sig_ = &sig;
  out_.str("");
  indent_ = 0;
  launch_ = CudaLaunch{};
  staged_.clear();
  stage_bytes_ = 0;
  // Every output in 16-bit floats: exp may use the hardware's approximation.
  fast_math_ = true;
  for (const KBuffer& b : k.buffers)
    if (b.written && b.dtype != DType::BFloat16 && b.dtype != DType::Float16) fast_math_ = false;
  launch_.name = k.name;
  launch_.row = k.row;
  if (k.row) {
    // Vectors along the row when the only reduced axis is the innermost
    // one and every access moves along it with unit stride.
    int v = (k.reduce_axes.size() == 1 && k.reduce_axes[0] == static_cast<int64_t>(k.domain.size()) - 1) ? choose_vec(true) : 1;
    const std::vector<Expr> offsets = vec_offsets_;
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
      launch_.vec_cluster = vl.cluster;
      launch_.vec_smem = vl.smem;
      launch_.vec_ring = vl.vec_ring;
      launch_.vec_group_exchange = vl.group_exchange;
      for (size_t b = 0; b < vb.size(); ++b)
        if (vb[b]) launch_.vec_buffers.push_back(static_cast<int>(b));
      launch_.vec_offsets = offsets;
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
    launch_.vec_offsets = vec_offsets_;
    pointwise(launch_.vec_name, v);
  }
  return out_.str();
}

}  // namespace opfuse
