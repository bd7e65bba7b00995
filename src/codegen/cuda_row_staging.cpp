// Row kernels (CUDA): rows staged in shared memory (cp.async copies, the
// ring of row slots that a block steps through).
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

// Rows too long for the register cache run loop stages, and each stage
// after the first re-reads the row: from L2 where the rows in flight fit
// (8192x32768 bf16: 3 passes, ~3.4 TB/s on the H200), from HBM where they do
// not (4096x262144: 2-3 reads of each element). Staged instead, each block
// copies its row (or, in a cluster of up to 8 blocks, its slice of the row)
// into shared memory once with cp.async, and every stage reads it there:
// each element is read from HBM once and written once. The row statistics
// of a cluster combine through distributed shared memory (the cluster
// reductions). Vector twins only (16-byte copies of aligned rows); each
// thread reads back only the columns it copied, so no barrier guards the
// copy. OPFUSE_ROW_SMEM_KB (default 64 a re-read tensor: three forward blocks
// an SM on sm_90, 0 turns staging off) is the most a block stages; OPFUSE_ROW_SMEM_CLUSTER (8) the
// most blocks a row may take; OPFUSE_ROW_SMEM_THREADS (512) the most threads
// a block has.
bool CudaEmitter::stage_rows(int64_t ncols, const std::set<int>& reread, bool cluster_ok, int* threads, int* cluster) {
  // Forward rows re-read one tensor, the backward kernels two (dy and y or
  // x): staged too on sm_90 (OPFUSE_ROW_SMEM_TENSORS, default 2 there), with 64 KB of
  // shared memory a tensor (OPFUSE_ROW_SMEM_KB overrides the block's
  // budget): one 128 KB block an SM where three 64 KB ones held a forward
  // row. H200, bf16 softmax backward (session 20, row_variants.py at
  // 5504794): 8192x32768 457-472 -> 377 us (100% of the floor; 426.6 with
  // 64 KB blocks in clusters of 2, 440.0 with 32 KB), 4096x262144 2518 ->
  // 2077; 32768x4096 is not staged (195 us either way).
  int ntensors = static_cast<int>(reread.size());
  int64_t budget = static_cast<int64_t>(env_int("OPFUSE_ROW_SMEM_KB", 64 * std::max(1, ntensors))) * 1024;
  // Shared memory an SM (KB): sm_80/87 164, sm_90/100 228, others 100. One
  // block may opt into 1 KB less; each also takes ~1 KB of static and 1 KB
  // of reserved memory.
  const int64_t sm_kb = arch_ == 80 || arch_ == 87 ? 164 : arch_ == 90 || arch_ == 100 || arch_ == 103 ? 228 : 100;
  const int64_t block_budget = (sm_kb - 3) * 1024;
  budget = std::min<int64_t>(budget, block_budget);
  if (budget <= 0 || arch_ < 80 || columns_ || row_loop_axes_.size() != 1 || last_var_.empty() || k_->stages.size() < 2)
    return false;
  // Two by default where measured (sm_90); one on older architectures.
  if (ntensors > std::max(1, env_int("OPFUSE_ROW_SMEM_TENSORS", arch_ >= 90 ? 2 : 1))) return false;
  std::map<int, std::set<std::string>> keys;
  std::map<int, KStmt> load;
  for (const KStage& st : k_->stages)
    for (const KStmt& s : st.loop)
      if (s.kind == KStmt::Load && reread.count(s.buffer)) {
        keys[s.buffer].insert(access_key(s));
        load.emplace(s.buffer, s);
      }
  int64_t esum = 0;
  for (int b : reread) {
    const KBuffer& kb = k_->buffers[static_cast<size_t>(b)];
    // One access a row (its columns at one offset), read with 16-byte vectors, never written here.
    if (!vec_buffer_[static_cast<size_t>(b)] || kb.written || keys[b].size() != 1 || dtype_size(kb.dtype) * vec_ != 16) return false;
    esum += dtype_size(kb.dtype);
  }
  // (16, a non-portable cluster the runtime opts into, only when asked:
  // with OPFUSE_ROW_SMEM_KB=32 a 512 KB row takes 16 blocks of 32 KB, six
  // 256-thread blocks an SM, to measure the resident blocks against
  // clusters of 8.)
  int max_c = arch_ >= 90 && cluster_ok ? std::max(1, std::min(16, env_int("OPFUSE_ROW_SMEM_CLUSTER", 8))) : 1;
  auto chunk_of = [&](int c) { return ceil_div(ceil_div(ncols, c), vec_) * vec_; };
  int c = 1;
  while (chunk_of(c) * esum > budget && c < max_c) c *= 2;
  int64_t chunk = chunk_of(c);
  if (chunk * esum > budget) return false;
  stage_chunk_ = chunk;
  int64_t off = 0;
  for (int b : reread) {
    staged_[b] = Staged{"sr" + std::to_string(b), off, load.at(b)};
    off += chunk * dtype_size(k_->buffers[static_cast<size_t>(b)].dtype);  // a multiple of 16
  }
  // The ring (sm_90). OPFUSE_ROW_STAGE_RING=1: two slots, so one 64 KB
  // slice a block takes one block an SM, and 1024 threads
  // (OPFUSE_ROW_STAGE_RING_THREADS) keep the SM's issue slots as busy as
  // three 512-thread blocks did; measured 5-33% slower on the H200 (a third
  // fewer rows in flight), off. =2: one slot (three blocks an SM, as
  // without a ring) refilled in place: every stage reads back only the
  // pieces its thread copied, so once the last stage has stored a piece
  // nothing reads it again and the thread sends the next row's copy of that
  // piece there (stage_refill_piece); the copy overlaps the rest of the
  // output pass and the group skips a cluster launch a row. Only where the
  // last stage loops over the row (it reads or stores every piece last).
  // The default for rows split over a cluster: H200, bf16 4096x262144
  // (row_variants.py at 9a14d7c): softmax 1336 -> 1312 us, layer_norm
  // 1551 -> 1507, rms_norm 1252 -> 1215, log_softmax 1311 -> 1304; not for
  // a block per row (8192x32768: 268 -> 296 us, softmax). =0 turns it off.
  int forced = env_int("OPFUSE_ROW_STAGE_RING", -1);
  int ring = arch_ >= 90 ? (forced >= 0 ? forced : c > 1 ? 2 : 0) : 0;
  if (ring == 2 && k_->stages.back().loop.empty()) ring = 0;
  stage_ring_ = ring > 0;
  stage_inplace_ = ring == 2;
  bool two_slots = stage_ring_ && !stage_inplace_;
  if (two_slots && 2 * off > block_budget) stage_ring_ = two_slots = false;  // two slots do not fit a block
  stage_slot_bytes_ = off;
  stage_bytes_ = static_cast<int>(two_slots ? 2 * off : off);
  int max_threads = two_slots ? env_int("OPFUSE_ROW_STAGE_RING_THREADS", 1024) : env_int("OPFUSE_ROW_SMEM_THREADS", 512);
  if (max_threads < 128 || max_threads > 1024 || (max_threads & (max_threads - 1)) != 0) max_threads = 512;
  *threads = std::min(max_threads, std::max(128, pow2_at_least(ceil_div(chunk, (two_slots ? 4 : 8) * vec_))));
  *cluster = c;
  // At most 1536 threads an SM (40 registers a thread): at 32 (four 512-thread
  // blocks) ptxas spilled in float32 rms_norm.
  int64_t blocks = (sm_kb * 1024) / (stage_bytes_ + 2048);
  stage_min_blocks_ = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, 1536 / *threads)));
  return true;
}

// The staged row's copy: each thread issues its columns' 16-byte copies at
// once and waits for them (its own only: see stage_rows).
// OPFUSE_ROW_SMEM_PREFETCH=n (an experiment, off by default): after its
// copies each thread also asks L2 for the same columns of the row n rows on
// (-1: one wave on, the blocks an SM x 132 / the cluster), so that the
// block taking that row finds it in L2 and its cluster waits less at the
// first barrier for the slowest copy. Measured slower (H200, bf16
// 4096x262144 at f134b5a, -1 with the 128-bit stores and early arrive):
// softmax 3.06 -> 2.70 TB/s, log_softmax 3.25 -> 2.75, layer_norm 2.68 ->
// 2.46, rms_norm 3.39 -> 2.81; left off.
void CudaEmitter::stage_prologue(int threads_per_row, const std::vector<size_t>& kept) {
  std::string V = std::to_string(vec_), step = std::to_string(threads_per_row * vec_);
  int64_t ahead = env_int("OPFUSE_ROW_SMEM_PREFETCH", 0);
  if (ahead < 0) ahead = std::max<int64_t>(1, 132 * stage_min_blocks_ / cluster_);
  if (ahead > 0) {
    line("const bool spf_ok_ = row_ + " + std::to_string(ahead) + " < rows;");
    decompose("spf_ok_ ? row_ + " + std::to_string(ahead) + " : row_", kept, "spfx");
  }
  const std::string& I = index_type_;
  line("for (" + I + " c_ = cbegin_ + (" + I + ")tid_ * " + V + "; c_ < cend_; c_ += " + step + ") {");
  for (const auto& [b, st] : staged_) {
    std::vector<Expr> idx = st.load.index;
    for (auto& e : idx) e = substitute(e, [&](const ExprNode& v) -> Expr { return v.name == last_var_ ? var("c_") : nullptr; });
    line("  opf_cp_async16(" + st.name + " + (c_ - cbegin_), b" + std::to_string(b) + " + " + offset(b, idx) + ");");
    if (ahead > 0) {
      for (auto& e : idx)
        e = substitute(e, [&](const ExprNode& v) -> Expr { return kept_vars_.count(v.name) ? var("spf" + v.name) : nullptr; });
      line("  if (spf_ok_) opf_prefetch_l2(b" + std::to_string(b) + " + " + offset(b, idx) + ");");
    }
  }
  line("}");
  line("opf_cp_async_wait_all();");
}

// Elements of buffer b between its two ring slots (every staged buffer's
// slot 0 comes first, then every slot 1).
int64_t CudaEmitter::slot_elements(int b) const {
  int64_t size = dtype_size(k_->buffers[static_cast<size_t>(b)].dtype);
  if (stage_slot_bytes_ % size != 0) throw std::logic_error("opfuse: a staged ring slot is not a whole number of elements");
  return stage_slot_bytes_ / size;
}

// One 16-byte copy of buffer b's piece at column c_ of the row whose kept
// variables carry `row_prefix`, to shared memory at `dst`.
std::string CudaEmitter::stage_copy(int b, const Staged& st, const std::string& row_prefix, const std::string& dst) {
  std::vector<Expr> idx = st.load.index;
  for (auto& e : idx)
    e = substitute(e, [&](const ExprNode& v) -> Expr {
      if (v.name == last_var_) return var("c_");
      if (kept_vars_.count(v.name)) return var(row_prefix + v.name.substr(1));
      return nullptr;
    });
  return "opf_cp_async16(" + dst + ", b" + std::to_string(b) + " + " + offset(b, idx) + ");";
}

// The staged ring's copy of one row into one slot (0 or 1): the row's kept
// variables carry `row_prefix` (decompose's prefix: "x" is the row being
// reduced), `slot` is the slot's offset in elements. Each thread copies the
// columns it later reads, as stage_prologue's copy does.
void CudaEmitter::stage_copy_loop(int threads_per_row, const std::string& row_prefix, const std::string& slot) {
  std::string V = std::to_string(vec_), step = std::to_string(threads_per_row * vec_);
  const std::string& I = index_type_;
  line("for (" + I + " c_ = cbegin_ + (" + I + ")tid_ * " + V + "; c_ < cend_; c_ += " + step + ") {");
  for (const auto& [b, st] : staged_)
    line("  " + stage_copy(b, st, row_prefix,
                           st.name + "_ring_ + " + slot + " * " + std::to_string(slot_elements(b)) + " + (c_ - cbegin_)"));
  line("}");
}

// In the last stage's loop of the in-place ring, after the piece at c_ is
// stored (its values are used, so its shared-memory reads are done): the
// next row's copy of the same piece into the same place.
void CudaEmitter::stage_refill_piece() {
  for (const auto& [b, st] : staged_) line("if (nr_ok_) " + stage_copy(b, st, "nrx", st.name + " + (c_ - cbegin_)"));
}

// The top of a ring iteration. Two slots: the copies of the group's next
// row go into the other slot (an empty group after the last row), then the
// thread waits for its copies of this row only, and the staged names point
// at this row's slot. In place: the thread waits for this row's copies and
// names the next row for the last stage's refills (stage_refill_piece).
void CudaEmitter::stage_ring_next(int threads_per_row, const std::vector<size_t>& kept) {
  if (stage_inplace_) {
    // This row's copies (before the loop, or the last iteration's refills)
    // are the thread's only ones in flight; the next row's are decomposed
    // here for the refills.
    line("opf_cp_async_wait_all();");
    line("const " + index_type_ + " nr_ = row_ + (" + index_type_ + ")(gridDim.x / " + std::to_string(cluster_) + ");");
    line("const bool nr_ok_ = nr_ < rows;");
    decompose("nr_ok_ ? nr_ : row_", kept, "nrx");
    for (const auto& [b, st] : staged_)
      line(storage_type(k_->buffers[static_cast<size_t>(b)].dtype) + "* const " + st.name + " = " + st.name + "_ring_;");
    return;
  }
  line("{");
  ++indent_;
  line("const int64_t nr_ = row_ + (int64_t)(gridDim.x / " + std::to_string(cluster_) + ");");
  line("if (nr_ < rows) {");
  ++indent_;
  decompose("nr_", kept, "nrx");
  stage_copy_loop(threads_per_row, "nrx", "(par_ ^ 1)");
  --indent_;
  line("}");
  --indent_;
  line("}");
  line("opf_cp_async_commit();");
  line("opf_cp_async_wait_prior();");
  for (const auto& [b, st] : staged_) {
    std::string t = storage_type(k_->buffers[static_cast<size_t>(b)].dtype);
    line(t + "* const " + st.name + " = " + st.name + "_ring_ + par_ * " + std::to_string(slot_elements(b)) + ";");
  }
}

}  // namespace opfuse
