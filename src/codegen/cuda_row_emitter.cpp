// Row (reduction) kernels of the CUDA emitter: the kernel (row_kernel) and
// its stage loops. The schedule and knobs are cuda_row_schedule.cpp; the
// reductions across threads cuda_row_reduce.cpp; shared-memory staging
// cuda_row_staging.cpp; one-pass stage pairs cuda_row_one_pass.cpp.
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

// One stage's loop over the part of the row this thread covers.
void CudaEmitter::row_stage_loop(const KStage& st, int items, int threads_per_row) {
  std::vector<KStmt> loop;
  loop_varying_.clear();
  for (const KStmt& s : st.loop) {
    if (caching_ && s.dst >= 0 && cache_.skip[static_cast<size_t>(stage_index_)].count(s.dst)) continue;
    loop.push_back(s);
    if (s.varying && s.dst >= 0) loop_varying_.insert(s.dst);
  }
  std::string V = std::to_string(vec_), T = std::to_string(threads_per_row);
  // The stage adding column partials iterates like a cached stage (a fixed
  // number of unrolled items), so each partial sits at a constant register index.
  bool partials = false;
  for (const KStmt& s : loop) partials = partials || s.kind == KStmt::Partial;
  bool unrolled = caching_ || partials;
  if (!caching_ && partials) items = partial_items_;
  bool alternate = !unrolled && !columns_ && stage_bytes_ > 0 && cluster_ == 1 && !stage_inplace_ && vec_ > 1 &&
                   stage_index_ + 1 == static_cast<int>(k_->stages.size()) && row_alternate() > 0;
  bool backwards = false;
  if (!unrolled && !columns_) {
    int forced = reverse_loops();
    backwards = (forced >= 0 ? forced != 0 : loop_overflow_) && (loop_stages_printed_++ % 2 == 1);
  }
  l2_policy_.clear();
  if (!unrolled && !columns_ && vec_ > 1 && cluster_ == 1 && stage_bytes_ == 0 && k_->stages.size() > 1 &&
      (l2_hints() >= 2 || (l2_hints() == 1 && loop_overflow_))) {
    bool last = stage_index_ + 1 == static_cast<int>(k_->stages.size());
    l2_policy_ = "l2p" + std::to_string(stage_index_) + "_";
    line("const unsigned long long " + l2_policy_ + " = opf_l2_policy<" + (last ? "false" : "true") + ">();");
  }
  const std::string& I = index_type_;
  // Every thread's columns of the unrolled loop inside the row (see exact_cols).
  bool exact = unrolled && exact_cols() > 0 && cluster_ == 1 && !columns_ && ncols_ > 0 &&
               static_cast<int64_t>(items) * threads_per_row * vec_ == ncols_;
  if (unrolled) {
    line("#pragma unroll");
    line("for (int it_ = 0; it_ < " + std::to_string(items) + "; ++it_) {");
    ++indent_;
    line("const " + I + " c_ = cbase_ + ((" + I + ")it_ * " + T + " + tid_) * " + V + ";");
    line(exact ? "{" : "if (c_ < cols) {");
  } else if (alternate) {
    // The last stage of a staged row (a block a row) in the order of the
    // row's parity: odd rows walk the columns backwards, so the weight and
    // bias a block reads first are the ones its SM's other block read last,
    // the most likely still in L1 (OPFUSE_ROW_ALTERNATE; with a smaller
    // carveout, OPFUSE_ROW_CARVEOUT, that leaves L1 the room).
    std::string step = std::to_string(threads_per_row * vec_);
    line("const " + I + " nk_ = (cend_ - cbegin_ - (" + I + ")tid_ * " + V + " + " + step + " - 1) / " + step + ";");
    line("for (" + I + " k_ = 0; k_ < nk_; ++k_) {");
    line("  const " + I + " c_ = cbegin_ + (" + I + ")tid_ * " + V + " + ((row_ & 1) ? nk_ - 1 - k_ : k_) * " + step + ";");
  } else if (backwards) {
    // This thread's columns in the order opposite to the forward loop's.
    std::string step = std::to_string(threads_per_row * vec_);
    line("for (" + I + " k_ = (cend_ - cbegin_ - (" + I + ")tid_ * " + V + " + " + step + " - 1) / " + step + "; k_-- > 0;) {");
    line("  const " + I + " c_ = cbegin_ + (" + I + ")tid_ * " + V + " + k_ * " + step + ";");
  } else {
    if (columns_) line("#pragma unroll 8");  // loads of several rows in flight per thread
    // A staged row's stage loops unrolled n times (OPFUSE_ROW_STAGE_UNROLL=n;
    // 0 or 1: not unrolled), so that their global loads (layer_norm's weight
    // and bias) go out together. By default 8 where the row is split over a
    // cluster: H200, bf16 4096x262144 (session 10, 35d199a): layer_norm
    // 1443 -> 1309 us (2 and 4: 1368, 1342), softmax 1259-1272 -> 1255,
    // rms_norm 1204-1221 -> 1199, log_softmax the same; a block per row
    // (8192x32768) gained nothing, so it keeps the plain loop.
    else if (int n = stage_bytes_ > 0 && vec_ > 1 ? stage_unroll(cluster_, group_exchange_) : 0; n > 1)
      line("#pragma unroll " + std::to_string(n));
    line("for (" + I + " c_ = cbegin_ + (" + I + ")tid_ * " + V + "; c_ < cend_; c_ += " + std::to_string(threads_per_row * vec_) + ") {");
  }
  ++indent_;
  in_row_loop_ = true;
  if (vec_ > 1) {
    lane_of_.clear();
    bool pf = prefetch_;
    prefetch_ = pf && unrolled;
    prefetch_lines_.clear();
    pipe_lines_.clear();
    pipe_items_ = items;
    vector_loads(loop, "c_");
    prefetch_ = pf;
    if (!online_vec_max_.empty()) line("float ocv_[" + V + "];");
    line("#pragma unroll");
    line("for (int j_ = 0; j_ < " + V + "; ++j_) {");
    ++indent_;
    line("const " + I + " " + last_var_ + " = c_ + j_;");
    in_lanes_ = true;
    for (auto& s : loop) statement(s, st);
    in_lanes_ = false;
    --indent_;
    line("}");
    if (!online_vec_max_.empty())
      line(std::string("opf_online_add_vec<") + (fast_math_ ? "true" : "false") + ", " + V + ">(" + online_vec_max_ + ", " +
           online_acc_ + ", ocv_);");
    if (!moments_mean_.empty()) line("wn_ += " + V + ".0f;");
    vector_stores(loop, "c_");
    if (stage_inplace_ && stage_index_ + 1 == static_cast<int>(k_->stages.size())) stage_refill_piece();
  } else {
    if (row_loop_axes_.size() == 1) line("const " + I + " " + last_var_ + " = c_;");
    else if (!row_loop_axes_.empty()) decompose("c_", row_loop_axes_);
    for (auto& s : loop) statement(s, st);
  }
  in_row_loop_ = false;
  --indent_;
  line("}");
  if (unrolled) {
    --indent_;
    line("}");
  }
  if (partials && partials_smem_) {
    // This row's values into the thread's shared slots (see opf_smem_add4).
    int n = partial_items_ * vec_;
    line("#pragma unroll");
    line("for (int q_ = 0; q_ < " + std::to_string(n / 4) + "; ++q_) {");
    for (size_t k = 0; k < partial_buffers_.size(); ++k) {
      std::string bs = std::to_string(partial_buffers_[k]);
      line("  opf_smem_add4(opf_pps + ((" + std::to_string(static_cast<int64_t>(k) * (n / 4)) + " + q_) * " +
           std::to_string(launch_.threads) + " + threadIdx.x) * 4, pp" + bs + " + q_ * 4);");
    }
    line("}");
  }
  // The next row's accesses (`lines`, each per column c_), over this thread's
  // items of the row, when there is a next row (pf_ok_).
  auto next_row_loop = [&](const std::vector<std::string>& lines) {
    line("if (pf_ok_) {");
    line("  #pragma unroll");
    line("  for (int it_ = 0; it_ < " + std::to_string(items) + "; ++it_) {");
    line("    const " + I + " c_ = cbase_ + ((" + I + ")it_ * " + T + " + tid_) * " + V + ";");
    std::string body;
    for (auto& l : lines) body += " " + l;
    line(std::string(exact ? "    {" : "    if (c_ < cols) {") + body + " }");
    line("  }");
    line("}");
  };
  if (!pipe_lines_.empty()) {
    // The next row's loads into the pipeline registers, after the loop that
    // used this row's: they stay in flight through this row's reductions,
    // its later stages and its stores (see row_pipeline).
    next_row_loop(pipe_lines_);
    line("pl_first_ = false;");
    pipe_lines_.clear();
    prefetch_ = false;
  }
  if (!prefetch_lines_.empty()) {
    // The next row's prefetches go after the loop that loaded this row's:
    // while this row's reductions wait on barriers its loaded vectors are
    // dead (no registers added; beside the loads they took 4 more at
    // 32768x4096, past 64) and HBM gets the next row's requests.
    next_row_loop(prefetch_lines_);
    prefetch_lines_.clear();
    prefetch_ = false;  // only the first stage that loads the row
  }
}

// The register cache: the frontier plan or the loads-only plan, whichever
// needs fewer registers (cache_, raw_slots_, raw_type_).
void CudaEmitter::choose_row_cache(bool known, int64_t ncols, int vec, bool lean_try) {
  cache_ = RowCachePlan{};
  raw_slots_.clear();
  raw_type_.clear();
  if (known && k_->stages.size() > 1) {
    StatementKey key = [&](const KStmt& s, const std::vector<std::string>& a) { return statement_key(s, a); };
    // Values the same for every row (weights) are reloaded from L1 in short
    // rows and cached in longer ones: layer_norm backward on the H200 (bf16,
    // scripts/row_variants.py) ran 262144x256 in 151.7 us reloading them
    // against 177.7 caching, and 32768x4096 in 346.7 us caching them against
    // 404.9 reloading (three cached values at 512 threads beat two at 256).
    // OPFUSE_ROW_CACHE_INVARIANT=0/1 forces either.
    int forced = env_int("OPFUSE_ROW_CACHE_INVARIANT", -1);
    bool invariant = forced >= 0 ? forced != 0 : ncols > 1024;
    RowCachePlan frontier = plan_row_cache(*k_, key, false, invariant), loads = plan_row_cache(*k_, key, true, invariant);
    cache_ = frontier.slots() <= loads.slots() ? frontier : loads;
    raw_slots_.clear();
    if ((cache_raw() >= 0 ? cache_raw() > 0 : lean_try) && vec > 1) {
      // Slots of the loads plan that hold only 16-bit vector loads (8 lanes
      // of 16 bytes) cost half a register a value as raw vectors.
      std::vector<int> raw(static_cast<size_t>(loads.slots()), 1);
      for (size_t si = 0; si < k_->stages.size(); ++si) {
        std::map<int, const KStmt*> defs;
        for (const KStmt& st : k_->stages[si].loop)
          if (st.dst >= 0) defs[st.dst] = &st;
        for (auto& [value, slot] : loads.write[si]) {
          const KStmt* d = defs.count(value) ? defs[value] : nullptr;
          DType t = d && d->kind == KStmt::Load ? k_->buffers[static_cast<size_t>(d->buffer)].dtype : DType::Float32;
          bool ok = d && d->kind == KStmt::Load && vec_buffer_[static_cast<size_t>(d->buffer)] && vec * 2 == 16 &&
                    (t == DType::BFloat16 || t == DType::Float16);
          if (!ok) raw[static_cast<size_t>(slot)] = 0;
          else raw_type_[slot] = storage_type(t);
        }
      }
      int n_raw = static_cast<int>(std::count(raw.begin(), raw.end(), 1));
      if (loads.slots() > 0 && 2 * (loads.slots() - n_raw) + n_raw < 2 * frontier.slots()) {
        cache_ = loads;
        for (int i = 0; i < loads.slots(); ++i)
          if (raw[static_cast<size_t>(i)]) raw_slots_.insert(i);
      }
    }
  }
}

void CudaEmitter::row_kernel(const std::string& name, int vec) {
  vec_ = vec;
  lane_of_.clear();
  RowSplit split = split_rows(*k_);
  row_loop_axes_ = split.loop;
  launch_.rows = split.rows;
  launch_.cols = split.cols;
  int64_t ncols = -1;
  bool known = is_const(split.cols, &ncols);
  last_var_ = split.loop.size() == 1 ? "x" + std::to_string(split.loop[0]) : "";

  // The lean default (see row_lean): tried for lane groups with partials,
  // dropped (the kernel generated again without it) unless all of it applies.
  bool has_partials = false;
  for (const KBuffer& b : k_->buffers) has_partials = has_partials || b.partials;
  bool lean_try = row_lean() < 0 && !lean_retry_ && known && ncols <= 1024 && has_partials && vec > 1 && arch_ >= 90;

  choose_row_cache(known, ncols, vec, lean_try);
  partial_buffers_.clear();
  for (size_t b = 0; b < k_->buffers.size(); ++b)
    if (k_->buffers[b].partials) partial_buffers_.push_back(static_cast<int>(b));
  bool partials = !partial_buffers_.empty();
  if (partials && (!known || k_->parts <= 0))
    throw std::runtime_error("opfuse: column partials need a row length known when the kernel is generated");
  bool cluster_ok = arch_ >= 90 && !partials;  // partials need each row whole in one block
  for (const KStage& st : k_->stages)
    for (const KAccumulator& a : st.accs)
      if (a.combiner != "sum" && a.combiner != "max" && a.combiner != "min" && a.combiner != "prod") cluster_ok = false;
  // Outer (column) reductions: the innermost axis is kept, so a warp takes
  // 32 neighbouring outputs (coalesced loads) and the block's 16 warps split
  // the reduced axis; a cluster splits it further when there are few outputs.
  size_t last_axis = k_->domain.size() - 1;
  columns_ = vec == 1 && !k_->domain.empty() && !k_->reduce_axes.empty() &&
             std::find(k_->reduce_axes.begin(), k_->reduce_axes.end(), static_cast<int64_t>(last_axis)) == k_->reduce_axes.end();
  for (const KStage& st : k_->stages)
    for (const KAccumulator& a : st.accs)
      if (a.combiner != "sum" && a.combiner != "max" && a.combiner != "min" && a.combiner != "prod") columns_ = false;
  // Bytes the row's later stages read again, if they loop: distinct
  // row-varying buffers loaded after the first stage.
  int64_t reread = 0;
  size_t reread_bufs = 0;
  std::set<int> bufs;
  if (known) {
    std::set<std::string> kept;
    for (size_t a : split.kept) kept.insert("x" + std::to_string(a));
    for (size_t si = 1; si < k_->stages.size(); ++si)
      for (const KStmt& s : k_->stages[si].loop)
        if (s.kind == KStmt::Load && std::any_of(s.index.begin(), s.index.end(), [&](const Expr& e) {
              bool m = false;
              substitute(e, [&](const ExprNode& v) -> Expr {
                if (kept.count(v.name)) m = true;
                return nullptr;
              });
              return m;
            }))
          bufs.insert(s.buffer);
    for (int b : bufs) reread += ncols * static_cast<int64_t>(dtype_size(k_->buffers[static_cast<size_t>(b)].dtype));
    reread_bufs = bufs.size();
  }
  RowGeometry g = choose_geometry(known, ncols, vec, cache_.slots(), cluster_ok, reread, static_cast<int>(reread_bufs));
  staged_.clear();
  stage_bytes_ = 0;
  stage_ring_ = false;
  stage_inplace_ = false;
  if (vec > 1 && known && g.items == 0 && !g.grouped && !partials && !bufs.empty() &&
      stage_rows(ncols, bufs, cluster_ok, &g.threads, &g.cluster))
    g.l2_overflow = false;
  if (columns_) {
    g = RowGeometry{};
    g.threads = 512;
    g.rows_per_block = 32;
    int64_t nrows = 0;
    if (arch_ >= 90 && known && is_const(split.rows, &nrows)) {
      // About three blocks an SM in all (132 SMs), each warp with at least 8 elements.
      int64_t tiles = ceil_div(nrows, 32);
      int64_t c = std::min<int64_t>({8, std::max<int64_t>(1, 396 / tiles), std::max<int64_t>(1, ncols / (16 * 8))});
      g.cluster = static_cast<int>(c);
    }
    cache_ = RowCachePlan{};
  }
  partial_items_ = 0;
  block_partials_ = false;
  int partial_cluster = 1;
  if (partials && !g.grouped && ncols > 8192) {
    // Rows over 8192 elements (split_column_sums with
    // OPFUSE_COLUMN_PARTIALS_WIDE=1): a cluster of 512-thread blocks per
    // row, 8 columns a thread, each block with its slice's partials and
    // (when they fit) cache; the cluster steps through its part's rows, and
    // the row sums go through distributed shared memory. Both twins take the
    // same cluster, so the grid (parts x cluster) is the same for either.
    if (arch_ < 90) throw std::runtime_error("opfuse: column partials of rows over 8192 elements need sm_90 (clusters)");
    partial_cluster = static_cast<int>(ceil_div(ncols, 512 * 8));
    if (partial_cluster > 8) throw std::runtime_error("opfuse: column partials of rows over 32768 elements");
    int64_t nv = ceil_div(ncols, vec);
    int64_t items = ceil_div(nv, 512 * partial_cluster);
    g = RowGeometry{};
    g.threads = 512;
    g.cluster = partial_cluster;
    if (cache_.slots() > 0 && items * vec * cache_.slots() <= 2 * cached_values()) g.items = static_cast<int>(items);
    partial_items_ = static_cast<int>(items);
  } else if (partials) {
    // At most 16 partial values a thread per partials buffer: more threads
    // (or lanes) per row where the row would need more.
    int64_t nv = ceil_div(ncols, vec);
    if (g.grouped) {
      while (g.lanes < 32 && ceil_div(nv, g.lanes) * vec > partial_values()) g.lanes *= 2;
      g.rows_per_block = g.threads / g.lanes;
      if (g.items > 0) g.items = static_cast<int>(ceil_div(nv, g.lanes));
    } else {
      while (g.threads < 1024 && ceil_div(nv, g.threads) * vec > partial_values()) g.threads *= 2;
      if (g.items > 0) g.items = static_cast<int>(ceil_div(nv, g.threads));
    }
    partial_items_ = static_cast<int>(ceil_div(nv, g.grouped ? g.lanes : g.threads));
    int bp = block_partials();
    block_partials_ = g.grouped && (bp > 0 || (bp < 0 && ncols <= kBlockPartialsCols) || k_->parts % g.rows_per_block != 0);
    if (!block_partials_ && k_->parts % g.rows_per_block != 0)
      throw std::runtime_error("opfuse: column partials' parts must be a multiple of the rows a block takes");
  }
  caching_ = g.items > 0 && cache_.slots() > 0;
  partials_smem_ = false;
  if (partials && (partials_smem() >= 0 ? partials_smem() > 0 : lean_try) && partial_cluster == 1 && vec > 1 && (partial_items_ * vec) % 4 == 0) {
    bool f32 = true;
    for (int b : partial_buffers_) f32 = f32 && k_->buffers[static_cast<size_t>(b)].dtype == DType::Float32;
    int64_t bytes = static_cast<int64_t>(partial_buffers_.size()) * partial_items_ * vec * g.threads * 4;
    partials_smem_ = f32 && bytes <= 40 * 1024;
  }
  // More blocks an SM where the partials sit in shared memory and every
  // cached value is a raw vector (ptxas fits 40 registers at 512 threads,
  // 64 at 256, without spills on sm_90; sm_80's spilled at 262144x256).
  lean_blocks_ = 0;
  if (partials_smem_ && (row_lean() > 0 || lean_try) && arch_ >= 90 &&
      static_cast<int>(raw_slots_.size()) == (caching_ ? cache_.slots() : 0) && cache_.slots() > 0)
    lean_blocks_ = g.threads == 512 ? 3 : g.threads == 256 ? 4 : 0;
  if (lean_try && lean_blocks_ == 0) {
    lean_retry_ = true;
    row_kernel(name, vec);
    lean_retry_ = false;
    return;
  }
  grouped_rows_ = g.grouped;
  lanes_ = g.lanes;
  cluster_ = caching_ || columns_ || partial_cluster > 1 || stage_bytes_ > 0 ? g.cluster : 1;
  cluster_row_loop_ = partial_cluster > 1 || (stage_ring_ && stage_bytes_ > 0 && cluster_ > 1);
  const int push = cluster_push();
  cluster_push_ = cluster_ > 1 && stage_bytes_ > 0 && partial_cluster <= 1 && !columns_ && arch_ >= 90 &&
                  (push > 0 || (push < 0 && cluster_row_loop_));
  // (By default not with the one-pass online pair or moments: their group
  // versions ran 6-9% slower than the cluster, session 30.)
  const int ge = group_retry_ ? 0 : group_exchange();
  group_exchange_ = cluster_push_ && cluster_row_loop_ && stage_ring_ && stage_bytes_ > 0 && vec > 1 &&
                    (ge > 0 || (ge < 0 && cluster_ == 8 && stage_online() <= 0 && stage_moments() <= 0));
  group_auto_ = group_exchange_ && ge < 0;
  launch_.group_exchange = group_exchange_;
  group_loop_ = grouped_rows_ && !partials && !columns_ && caching_ && vec > 1 && group_loop() > 0;
  launch_.vec_ring = (stage_ring_ && stage_bytes_ > 0) || group_loop_;
  loop_overflow_ = g.l2_overflow && !caching_ && !columns_ && !partials && cluster_ == 1 && stage_bytes_ == 0;
  launch_.smem = stage_bytes_;
  cluster_reductions_ = 0;
  group_exchanges_ = 0;
  last_cluster_reduce_end_ = -1;
  pair_reductions_ = 0;
  launch_.threads = g.threads;
  // (For the grid: parts / rows_per_block blocks; a block writing one part takes "one row".)
  launch_.rows_per_block = block_partials_ ? 1 : g.rows_per_block;
  launch_.cluster = cluster_;
  launch_.items = caching_ ? g.items : 0;
  launch_.parts = partials ? k_->parts * cluster_ : 0;
  int threads_per_row = columns_ ? g.threads / 32 : grouped_rows_ ? lanes_ : g.threads;
  // 32-bit indices (see index32): rows and columns known, each at most 2^30,
  // so row_ + the grid (at most the rows) or a prefetch distance (a few
  // thousand rows) and every column index stay below 2^31. Column kernels
  // keep 64-bit indices.
  int64_t nrows = -1;
  bool rows_known = is_const(split.rows, &nrows);
  ncols_ = known ? ncols : -1;
  // (Not in sm_80's 1024-thread loop kernels, capped at 32 registers: the
  // defaults spill 4 bytes there at 8192x32768, the raw lanes 8.)
  raw_lanes_ = raw_lanes(grouped_rows_) && !(arch_ < 90 && loop_overflow_);
  // (Not in cluster kernels but staged ones: the scalar twin of a 1024-thread
  // cluster block at 40000 columns spilled 116 bytes with them. A staged
  // cluster row's loops are its issue: 64-bit column indices cost ~1.5
  // instructions an element of ~23 at 4096x262144, session 10's ncu.)
  index_type_ = index32() > 0 && !columns_ && (cluster_ == 1 || stage_bytes_ > 0) && known && rows_known && ncols <= (1LL << 30) &&
                        nrows <= (1LL << 30)
                    ? "int"
                    : "int64_t";
  const std::string I = index_type_;

  // The body is printed to a side buffer first: the register arrays and
  // cluster slots it uses are declared before it.
  std::string saved = out_.str();
  out_.str("");
  int base_indent = indent_;
  indent_ = 2;
  decompose("row_", split.kept);
  loop_stages_printed_ = 0;
  kept_vars_.clear();
  for (size_t a : split.kept) kept_vars_.insert("x" + std::to_string(a));
  // The row this thread takes next: the block's next row where it loops
  // over rows (column partials), else one OPFUSE_ROW_PREFETCH_AHEAD blocks on.
  std::string next_row;
  int pf = row_prefetch();
  if (vec > 1 && !columns_ && (caching_ || partials) && (cluster_ == 1 || cluster_row_loop_) && (pf > 0 || (pf < 0 && !grouped_rows_))) {
    std::string rpb = std::to_string(g.rows_per_block);
    if (cluster_row_loop_) next_row = "row_ + (" + I + ")(gridDim.x / " + std::to_string(cluster_) + ")";
    else if (partials) next_row = grouped_rows_ ? "row_ + (" + I + ")gridDim.x * " + rpb : "row_ + (" + I + ")gridDim.x";
    else next_row = "row_ + " + std::to_string(static_cast<int64_t>(prefetch_ahead(g.threads)) * g.rows_per_block);
  }
  pipeline_ = false;
  pipe_arrays_.clear();
  if ((row_pipeline() > 0 && vec > 1 && !columns_ && partials && (cluster_ == 1 || cluster_row_loop_)) || group_loop_) {
    std::string rpb = std::to_string(g.rows_per_block);
    pipeline_ = true;
    if (cluster_row_loop_) next_row = "row_ + (" + I + ")(gridDim.x / " + std::to_string(cluster_) + ")";
    else next_row = grouped_rows_ ? "row_ + (" + I + ")gridDim.x * " + rpb : "row_ + (" + I + ")gridDim.x";
  }
  prefetch_ = !next_row.empty();
  if (pipeline_ && grouped_rows_) {
    // The next iteration exists when the block's next row base is a row; a
    // group past the end then redoes the last row (as the loop does), so
    // its registers hold that row.
    line("const bool pf_ok_ = rbase_ + (" + I + ")gridDim.x * " + std::to_string(g.rows_per_block) + " < rows;");
    decompose("(" + next_row + " < rows ? " + next_row + " : rows - 1)", split.kept, "pfx");
  } else if (prefetch_) {
    line("const bool pf_ok_ = " + next_row + " < rows;");
    decompose("pf_ok_ ? " + next_row + " : row_", split.kept, "pfx");
  }
  // Loop stages re-read the row each stage: for rows longer than 32768
  // elements, whose re-reads miss L2 (four 512-thread blocks an SM hold
  // 4 x 132 rows), softmax's max and sum stages become one pass with an
  // online (max, sum) pair (3 passes -> 2: 4096x262144 softmax 1.93 -> 2.55
  // TB/s on the H200). Shorter rows re-read from L2, where the online pair's
  // dependent chain cost more than the pass it saves (8192x32768 softmax
  // 3.26 -> 2.40 TB/s), so they keep three stages.
  bool long_rows = known && ncols > 32768;
  // Rows staged in shared memory re-read it, not HBM: three passes, unless
  // OPFUSE_ROW_STAGE_ONLINE=1: the online pair a 16-byte vector at a time
  // (opf_online_add_vec: the vector's max, one rescale, an exp a value), so
  // a staged row takes two passes over shared memory and one reduction
  // across the block or cluster fewer. Off: slower on the H200 (session
  // 10, f4b6140, bf16): softmax 4096x262144 1263.9 -> 1384.7 us,
  // log_softmax 1234.8 -> 1345.7, 8192x32768 unchanged; the vector's
  // max chain, its combine (one more exp, branches) and 8 dependent adds
  // cost more than the pass and the cluster barrier they save.
  bool staged_online = stage_bytes_ > 0 && vec > 1 && !caching_ && !columns_ && !grouped_rows_ && stage_online() > 0;
  int online = ((long_rows && !caching_ && !columns_ && cluster_ == 1 && stage_bytes_ == 0) || staged_online) ? online_softmax_stage() : -1;
  if (stage_bytes_ > 0 && stage_ring_) stage_ring_next(threads_per_row, split.kept);
  else if (stage_bytes_ > 0) stage_prologue(threads_per_row, split.kept);
  // A staged row's mean and variance in one pass (OPFUSE_ROW_STAGE_MOMENTS=1,
  // rows whose every output is 16-bit): each thread sums x - k and its
  // square around its own first value k (so (k - mean)^2 is at most the
  // thread's squared deviations, and the cancellation in s2 - s1^2 / n
  // costs at most log2(n) bits), turns them into (count, mean, squared
  // deviations) and the block or cluster combines those (Chan's update).
  // Off: slower on the H200 (session 10, 303d331, bf16): 4096x262144
  // 1324-1334 -> 1406-1409 us, 8192x32768 unchanged (290-295 us either
  // way); the triple's combine (a division, shuffles of three values) and
  // the shift's compare cost more than the pass and the barrier it saves.
  int moments = stage_bytes_ > 0 && vec > 1 && fast_math_ && !caching_ && !columns_ && !grouped_rows_ && stage_moments() > 0
                    ? moments_stage()
                    : -1;
  // OPFUSE_ROW_GROUP_LOCAL: a row group's two reductions with one
  // exchange (local_reference_pair), where the one-pass knobs are off; by
  // default the (max, sum) pairs only, not the moments (see group_local).
  std::map<int, bool> local;
  const int gl = group_local();
  if (group_exchange_ && online < 0 && moments < 0 && !caching_ && !columns_ && !grouped_rows_ && vec > 1 && gl != 0) {
    local = local_reference_stages();
    if (gl < 0)
      for (auto it = local.begin(); it != local.end();) it = it->second ? local.erase(it) : std::next(it);
  }
  for (size_t si = 0; si < k_->stages.size(); ++si) {
    const KStage& st = k_->stages[si];
    stage_index_ = static_cast<int>(si);
    if (auto l = local.find(static_cast<int>(si)); l != local.end()) {
      local_reference_pair(st, k_->stages[si + 1], l->second, g.items, threads_per_row);
      ++si;
      continue;
    }
    if (moments >= 0 && si == static_cast<size_t>(moments)) {
      moments_pair(st, k_->stages[si + 1], g.items, threads_per_row);
      ++si;
      continue;
    }
    if (online >= 0 && si == static_cast<size_t>(online)) {
      online_pair(st, k_->stages[si + 1], staged_online, g.items, threads_per_row);
      ++si;
      continue;
    }
    for (auto& s : st.pre) statement(s, st);
    for (auto& a : st.accs) accumulator_init(a);
    if (!st.loop.empty()) row_stage_loop(st, g.items, threads_per_row);
    reduce_stage_across_threads(st);
    for (auto& a : st.accs) accumulator_finish(a);
    for (auto& s : st.post) statement(s, st);
  }
  prefetch_ = false;
  std::string body = out_.str();
  if (group_exchange_ && ((group_auto_ && group_exchanges_ != 1) || group_slots() > kGroupSlotsMax)) {
    // By default only rows with one reduction across the blocks (see
    // group_exchange), and never past the workspace's slots a group: the
    // kernel again, with the cluster.
    out_.str("");
    out_ << saved;
    indent_ = base_indent;
    group_retry_ = true;
    row_kernel(name, vec);
    group_retry_ = false;
    return;
  }
  // A row split over a cluster (one row, no loop over rows) arrives at its
  // exit barrier right after its last cluster reduction and waits for it
  // only at the end (opf_cluster_arrive), not for the slowest peer's output
  // stage. H200 (bf16 4096x262144, row_variants.py at f134b5a, with the
  // 128-bit stores): softmax 3.04 -> 3.06 TB/s, log_softmax 3.08 -> 3.25,
  // layer_norm 2.59 -> 2.68, rms_norm 3.27 -> 3.39.
  // OPFUSE_ROW_CLUSTER_EARLY_ARRIVE=0: one full barrier at the end, as before.
  bool early_arrive = env_int("OPFUSE_ROW_CLUSTER_EARLY_ARRIVE", 1) > 0 && cluster_ > 1 && !columns_ && !cluster_row_loop_ &&
                      last_cluster_reduce_end_ >= 0;
  if (early_arrive)
    body.insert(static_cast<size_t>(last_cluster_reduce_end_), std::string(static_cast<size_t>(last_cluster_reduce_indent_) * 2, ' ') + "opf_cluster_arrive();\n");
  out_.str("");
  out_ << saved;
  indent_ = base_indent;

  header(name, g.threads, group_exchange_ ? 1 : cluster_);
  line("__shared__ __align__(16) double " + smem_ + "[128];");
  line("(void)" + smem_ + ";");
  if (columns_) {
    line("__shared__ __align__(16) double opf_csmem[" + std::to_string(g.threads) + "];");
    line("__shared__ __align__(8) unsigned long long opf_cslot[" + std::to_string(32 * std::max(1, cluster_reductions_)) + "];");
    line("(void)opf_cslot;");
  } else if (cluster_ > 1) {
    int slots = std::max(1, cluster_reductions_) * (cluster_row_loop_ ? 2 : 1);
    line("__shared__ __align__(8) unsigned long long opf_cslot[" + std::to_string(slots) + "];");
    if (cluster_push_ && cluster_reductions_ > 0 && !group_exchange_) {  // (row groups: global memory, nothing here)
      // Each reduction's (and row parity's, in the ring) mbarrier and the
      // cluster's partials (8-byte slots, a peer a slot); the peers may push
      // into them only once every block's mbarriers are initialised: one
      // cluster barrier.
      std::string n = std::to_string((cluster_row_loop_ ? 2 : 1) * cluster_reductions_);
      line("__shared__ __align__(8) unsigned long long opf_xbar[" + n + "];");
      line("__shared__ __align__(16) unsigned long long opf_xslot[" + n + "][" + std::to_string(cluster_) + "];");
      line("opf_mbar_init_cluster(opf_xbar);");
    }
  }
  if (pair_reductions_ > 0) {
    line("__shared__ __align__(16) double opf_psmem[128];");
    line("int opf_rp_ = 0;");
  }
  if (stage_bytes_ > 0) {
    line("extern __shared__ __align__(16) unsigned char opf_dsmem[];");
    // (The ring's two slots of a buffer are stage_slot_bytes_ apart: every buffer's slot 0, then every slot 1.)
    for (const auto& [b, st] : staged_)
      line(storage_type(k_->buffers[static_cast<size_t>(b)].dtype) + "* const " + st.name + (stage_ring_ ? "_ring_" : "") +
           " = reinterpret_cast<" + storage_type(k_->buffers[static_cast<size_t>(b)].dtype) + "*>(opf_dsmem + " +
           std::to_string(st.offset) + ");");
  }
  line("const int64_t rows = " + size_c(split.rows) + ";");
  line("const int64_t cols = " + size_c(split.cols) + ";");
  auto partial_declarations = [&]() {
    // The pipeline registers (row_pipeline) live across the row loop.
    for (auto& [nx, items] : pipe_arrays_) line("opf_vec<16> " + nx + "[" + std::to_string(items) + "];");
    if (!pipe_arrays_.empty()) line("bool pl_first_ = true;");
    if (partials_smem_) {
      // Each thread zeroes its own slots (no one else reads them before the end).
      int64_t n = static_cast<int64_t>(partial_buffers_.size()) * partial_items_ * vec;
      line("__shared__ __align__(16) float opf_pps[" + std::to_string(n * g.threads) + "];");
      line("for (int q_ = 0; q_ < " + std::to_string(n / 4) + "; ++q_) {");
      line("  const float z_[4] = {};");
      line("  opf_lanes<float, 4> l_;");
      line("  for (int j_ = 0; j_ < 4; ++j_) l_.e[j_] = z_[j_];");
      line("  *reinterpret_cast<opf_vec<16>*>(opf_pps + ((int64_t)q_ * " + std::to_string(g.threads) + " + threadIdx.x) * 4) = l_.v;");
      line("}");
      return;
    }
    for (int b : partial_buffers_)
      line(value_type(k_->buffers[static_cast<size_t>(b)].dtype) + " pp" + std::to_string(b) + "[" +
           std::to_string(partial_items_ * vec) + "] = {};");
  };
  std::string chunk = std::to_string(static_cast<int64_t>(g.items) * threads_per_row * vec);
  if (columns_) {
    // Lanes take neighbouring outputs, warps (and cluster blocks) split the
    // reduced axis; lanes past the last output redo the last one.
    std::string C = std::to_string(cluster_);
    line("const int tid_ = threadIdx.x >> 5;");
    line("int64_t row_ = (int64_t)(blockIdx.x / " + C + ") * 32 + (threadIdx.x & 31);");
    line("if (row_ >= rows) row_ = rows - 1;");
    line("const int64_t cbase_ = 0;");
    if (cluster_ > 1) {
      line("const int64_t cchunk_ = (cols + " + C + " - 1) / " + C + ";");
      line("const int64_t cbegin_ = (int64_t)opf_cluster_rank() * cchunk_;");
      line("const int64_t cend_ = cbegin_ + cchunk_ < cols ? cbegin_ + cchunk_ : cols;");
    } else {
      line("const int64_t cbegin_ = 0, cend_ = cols;");
    }
    line("{");
  } else if (grouped_rows_ && (partials || group_loop_)) {
    // The block's groups step through the rows together: for column partials
    // (every lane takes part in each row's shuffles) and with
    // OPFUSE_ROW_GROUP_LOOP. A group past the last row redoes it; with
    // partials it must not add to them, so it remembers the row was not real.
    std::string RPB = std::to_string(g.rows_per_block), L = std::to_string(lanes_);
    line("const int tid_ = threadIdx.x & " + std::to_string(lanes_ - 1) + ";");
    line("const " + I + " cbase_ = 0, cbegin_ = 0, cend_ = cols;");
    partial_declarations();
    line("for (" + I + " rbase_ = (" + I + ")blockIdx.x * " + RPB + "; rbase_ < rows; rbase_ += (" + I + ")gridDim.x * " + RPB + ") {");
    // (int + unsigned would be unsigned: the int cast only with 32-bit indices, the defaults' source unchanged.)
    line("  " + I + " row_ = rbase_ + " + (I == "int" ? "(int)(threadIdx.x / " + L + ")" : "threadIdx.x / " + L) + ";");
    if (partials) {
      line("  const bool real_ = row_ < rows;");
      line("  if (!real_) row_ = rows - 1;");
    } else {
      line("  if (row_ >= rows) row_ = rows - 1;");
    }
  } else if (grouped_rows_) {
    // A group past the last row redoes the last row (same values to the same
    // places) rather than leaving its warp's shuffles short of lanes.
    line("const int tid_ = threadIdx.x & " + std::to_string(lanes_ - 1) + ";");
    line(I + " row_ = (" + I + ")blockIdx.x * " + std::to_string(g.rows_per_block) + " + " + (I == "int" ? "(int)" : "") +
         "(threadIdx.x / " + std::to_string(lanes_) + ");");
    line("if (row_ >= rows) row_ = rows - 1;");
    line("const " + I + " cbase_ = 0, cbegin_ = 0, cend_ = cols;");
    line("{");
  } else if (stage_ring_ && stage_bytes_ > 0) {
    // Persistent row groups (a block, or a cluster of blocks each with its
    // slice): group g takes rows g, g + G, ... (G = gridDim.x / cluster, as
    // many as the device holds at once: CompiledGraph's ring grid). The
    // first row's copies go out before the loop; each iteration sends the
    // next row's into the other slot before reducing this one.
    std::string S = std::to_string(stage_chunk_), C = std::to_string(cluster_);
    line("const int tid_ = threadIdx.x;");
    std::string rank = group_exchange_ ? "(blockIdx.x % " + C + ")" : "opf_cluster_rank()";
    line("const " + I + " cbase_ = 0, cbegin_ = " + (cluster_ > 1 ? "(" + I + ")" + rank + " * " + S : std::string("0")) + ";");
    line("const " + I + " cend_ = cbegin_ + " + S + " < cols ? cbegin_ + " + S + " : cols;");
    line("if ((" + I + ")blockIdx.x / " + C + " < rows) {");
    ++indent_;
    decompose("(" + I + ")blockIdx.x / " + C, split.kept, "frx");
    stage_copy_loop(threads_per_row, "frx", "0");
    --indent_;
    line("}");
    line("opf_cp_async_commit();");
    const bool phases = cluster_push_ && !group_exchange_;  // the mbarriers' use count
    line(phases ? "int par_ = 0, xit_ = 0;" : "int par_ = 0;");
    line("for (" + I + " row_ = blockIdx.x / " + C + "; row_ < rows; row_ += gridDim.x / " + C + ", par_ ^= 1" +
         (phases ? ", ++xit_" : "") + ") {");
  } else if (cluster_row_loop_) {
    std::string C = std::to_string(cluster_);
    std::string slice = std::to_string(static_cast<int64_t>(partial_items_) * g.threads * vec);
    line("const int tid_ = threadIdx.x;");
    line("const " + I + " cbase_ = (" + I + ")opf_cluster_rank() * " + slice + ", cbegin_ = cbase_;");
    line("const " + I + " cend_ = cbase_ + " + slice + " < cols ? cbase_ + " + slice + " : cols;");
    partial_declarations();
    line("int par_ = 0;");
    line("for (" + I + " row_ = blockIdx.x / " + C + "; row_ < rows; row_ += gridDim.x / " + C + ", par_ ^= 1) {");
    line("  const bool real_ = true;");
  } else if (cluster_ > 1 && stage_bytes_ > 0) {
    // A staged row split over the cluster: block r takes (and stages) the
    // r-th slice of the row in every stage.
    std::string S = std::to_string(stage_chunk_);
    line("const int tid_ = threadIdx.x;");
    line("const " + I + " row_ = (" + I + ")blockIdx.x / " + std::to_string(cluster_) + ";");
    line("const " + I + " cbase_ = 0, cbegin_ = (" + I + ")opf_cluster_rank() * " + S + ";");
    line("const " + I + " cend_ = cbegin_ + " + S + " < cols ? cbegin_ + " + S + " : cols;");
    line("{");
  } else if (cluster_ > 1) {
    line("const int tid_ = threadIdx.x;");
    line("const " + I + " row_ = (" + I + ")blockIdx.x / " + std::to_string(cluster_) + ";");
    line("const " + I + " cbase_ = (" + I + ")opf_cluster_rank() * " + chunk + ", cbegin_ = 0, cend_ = cols;");
    line("{");
  } else {
    line("const int tid_ = threadIdx.x;");
    line("const " + I + " cbase_ = 0, cbegin_ = 0, cend_ = cols;");
    partial_declarations();
    line("for (" + I + " row_ = blockIdx.x; row_ < rows; row_ += gridDim.x) {");
    if (partials) line("  const bool real_ = true;");
  }
  line("  (void)cbase_; (void)cbegin_; (void)cend_;");
  if (partials_smem_)  // this row's values, folded into shared memory after the stage that adds them
    for (int b : partial_buffers_) line("  float pp" + std::to_string(b) + "[" + std::to_string(partial_items_ * vec) + "] = {};");
  for (int i = 0; i < cache_.slots() && caching_; ++i)
    if (raw_slots_.count(i)) line("  opf_vec<16> rr" + std::to_string(i) + "[" + std::to_string(g.items) + "];");
    else line("  " + value_type(cache_.slot_types[static_cast<size_t>(i)]) + " rc" + std::to_string(i) + "[" +
         std::to_string(g.items * vec) + "];");
  out_ << body;
  line("}");
  if (partials && block_partials_)
    store_block_partials(g.rows_per_block);
  else if (partials)
    store_partials(threads_per_row, grouped_rows_ ? "(int64_t)blockIdx.x * " + std::to_string(g.rows_per_block) + " + threadIdx.x / " +
                                                        std::to_string(lanes_)
                                    : cluster_row_loop_ ? "(int64_t)(blockIdx.x / " + std::to_string(cluster_) + ")"
                                                        : "(int64_t)blockIdx.x");
  if (cluster_ > 1 && !group_exchange_) line(early_arrive ? "opf_cluster_wait();" : "opf_cluster_sync();");
  --indent_;
  line("}");
  index_type_ = "int64_t";
  raw_lanes_ = false;
  ncols_ = -1;
  group_exchange_ = false;
}

// With 32-bit indices (index32): a buffer of fixed strides (no strides
// passed at run time) and known shape of fewer than 2^31 elements takes its
// offset as an int, so the address is one IMAD.WIDE of it; every offset
// used for an access lies in [0, elements), so the int holds it exactly.
// A buffer with strides passed at run time keeps its int64 products, of
// each index zero-extended ((uint32_t)x0: indices are never negative), which
// spares the sign extension and one IMAD a product.
std::string CudaEmitter::offset(int b, const std::vector<Expr>& idx) const {
  const KBuffer& buf = k_->buffers[static_cast<size_t>(b)];
  if (index_type_ == "int" && buf.strided) {
    std::vector<Expr> z = idx;
    auto is_index = [](const std::string& n) {
      size_t d = n.find_first_of("0123456789");
      std::string p = d == std::string::npos ? n : n.substr(0, d);
      bool digits = d != std::string::npos && n.find_first_not_of("0123456789", d) == std::string::npos;
      return n == "c_" || (digits && (p == "x" || p == "pfx" || p == "spfx"));
    };
    for (auto& e : z) e = substitute(e, [&](const ExprNode& v) -> Expr { return is_index(v.name) ? var("(uint32_t)" + v.name) : nullptr; });
    return CEmitter::offset(b, z);
  }
  std::string o = CEmitter::offset(b, idx);
  if (index_type_ != "int" || buf.strided) return o;
  int64_t n = 1;
  for (const Expr& d : buf.shape) {
    int64_t c = 0;
    if (!is_const(d, &c) || c < 0 || (c > 0 && n > ((1LL << 31) - 1) / c)) return o;
    n *= c;
  }
  return "(int)(" + o + ")";
}

}  // namespace opfuse
