// CUDA C++ for one kernel, as a subclass of the C-like emitter.
//
// Pointwise: a grid-stride loop in which each thread takes V consecutive
// elements of the innermost dim, loading and storing them with 128-bit
// accesses where every access is unit-stride along that dim (a scalar twin,
// V = 1, serves inputs whose alignment or strides do not allow it; the
// runtime picks per launch).
// Row kernels (cuda_row_*.cpp; the schedule and knobs in cuda_row_schedule.cpp),
// the schedule chosen by row length:
//  - short rows (at most 1024 elements): an aligned group of 1 to 32 lanes
//    per row, sized so that each lane holds a few 128-bit vectors;
//  - longer rows: a block per row, or a thread-block cluster of up to 8
//    blocks per row (partial reductions combined through distributed shared
//    memory) when one block would need too many registers.
// When the row length is known, what later stages need from earlier ones is
// kept in registers (see row_cache_plan.h), so each row is read once.
#pragma once
#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "codegen/c_emitter.h"
#include "codegen/row_cache_plan.h"

namespace opfuse {

// Groups of blocks exchanging through global memory (group_exchange), in
// the runtime's zeroed per-stream workspace (RunOptions::zeroed_workspace,
// kRowGroupWorkspaceBytes past the decode MLP's region), passed as the
// kernel argument's last member: at most kRowGroupsMax groups a launch;
// first every group's counter, alone in a 128-byte line, then every group's
// kGroupSlotsMax 8-byte slots. One layout for every kernel: the counters
// (left at zero below the top bit) are never another kernel's slots.
constexpr int kRowGroupsMax = 1024;
constexpr int kGroupSlotsMax = 2 * 8 * 16;  // (reduction, row parity) pairs x blocks: 8 reductions a row over 16 blocks
constexpr size_t kRowGroupWorkspaceBytes = size_t(kRowGroupsMax) * (16 + kGroupSlotsMax) * 8;

struct CudaLaunch {
  bool row = false;
  int threads = 256;
  int rows_per_block = 1;  // row kernels: 8 with a warp per row
  int vec = 1;             // pointwise: elements per thread access
  std::vector<int> vec_buffers;  // kernel buffers accessed with vectors
  // Element offsets of vector accesses at lane 0 with every loop index 0
  // that depend on sizes (a slice's start at s0 - 5, a cat's part): the
  // vector twin runs only where each is a multiple of vec (a constant one
  // that is not keeps the kernel scalar).
  std::vector<Expr> vec_offsets;
  int items = 0;           // row kernels: per-thread register cache length (0: none)
  int cluster = 1;          // row kernels: blocks per row (a thread-block cluster)
  int vec_threads = 0, vec_rows_per_block = 0, vec_cluster = 1;  // row kernels: geometry of the vector twin
  int64_t parts = 0;       // row kernels with column partials: grid x rows_per_block = parts
  int smem = 0, vec_smem = 0;  // row kernels: dynamic shared memory bytes (rows staged there), scalar and vector twin
  // The vector twin loops over rows with a staged ring (OPFUSE_ROW_STAGE_RING)
  // or in lane groups (OPFUSE_ROW_GROUP_LOOP): its grid is as many row groups
  // (clusters, or blocks of vec_rows_per_block rows) as the device holds at once.
  bool vec_ring = false;
  // The ring's blocks of a row exchange their partials through global
  // memory instead of a cluster (OPFUSE_ROW_GROUP_EXCHANGE): the grid is as
  // many groups of `cluster` consecutive blocks as the device holds at once,
  // at most kRowGroupsMax (the size of the kernel's counters).
  bool group_exchange = false, vec_group_exchange = false;
  // Both twins begin with opf_grid_dependency_wait (sm_90 unless OPFUSE_PDL=0): the
  // launcher may then launch them with the programmatic serialization
  // attribute, and only then.
  bool pdl = false;
  Expr numel, rows, cols;  // launch geometry in terms of size symbols
  std::string name, vec_name;  // scalar and vector entry points
};

class CudaEmitter : public CEmitter {
 public:
  // arch: the compute capability the source is for (90 for sm_90); cluster
  // schedules need 90 or newer.
  explicit CudaEmitter(int arch = 90) : arch_(arch) {}
  std::string emit(const KernelIR& k, const StrideSignature& sig) override;
  const CudaLaunch& launch() const { return launch_; }

 private:
  int arch_;
  CudaLaunch launch_;
  bool in_row_loop_ = false;
  bool fast_math_ = false;  // every output is float16/bfloat16: see opf_exp_fast
  std::string online_acc_;  // set while printing an online softmax pass: the sum accumulator
  // ...and, in a staged row's vector lanes (OPFUSE_ROW_STAGE_ONLINE), the max
  // accumulator: the lanes' values go to ocv_ and fold in once a vector.
  std::string online_vec_max_;
  // Set while printing a staged row's moments pass (OPFUSE_ROW_STAGE_MOMENTS):
  // the mean's accumulator; the squared deviations' is online_acc_.
  std::string moments_mean_;
  int vec_ = 1;                  // the V of the function being printed
  bool in_lanes_ = false;
  std::vector<bool> vec_buffer_;  // by kernel buffer
  std::vector<Expr> vec_offsets_;  // choose_vec's symbolic base offsets (CudaLaunch::vec_offsets)
  // Row kernels.
  RowCachePlan cache_;            // values kept in registers between stages
  bool caching_ = false;
  std::set<int> raw_slots_;                  // cache slots kept as raw 16-byte vectors (rr<slot>[it_])
  std::map<int, std::string> raw_type_;      // their element storage type (opf_bf16, opf_half)
  int stage_index_ = 0;
  std::string smem_ = "opf_smem";
  bool grouped_rows_ = false;     // a group of `lanes_` lanes per row
  bool columns_ = false;          // an outer reduction: lanes along the kept innermost axis
  int lanes_ = 32;
  int cluster_ = 1;
  int cluster_reductions_ = 0;    // slots used so far
  void cluster_reduction(int width, const std::string& call);
  int64_t last_cluster_reduce_end_ = -1;  // where the row body's last cluster reduction ends in out_ (see row_kernel)
  int last_cluster_reduce_indent_ = 0;
  int pair_reductions_ = 0;       // opf_block_sum2 calls printed (their shared buffer and parity are declared)
  bool cluster_row_loop_ = false;
  bool cluster_push_ = false;      // staged rows' cluster reductions pushed into the peers' slots (OPFUSE_ROW_CLUSTER_PUSH)
  bool group_exchange_ = false;    // the ring's row groups without a cluster, exchanging through global memory
  bool group_auto_ = false;        // chosen by default, kept only for one reduction a row (see row_kernel)
  bool group_retry_ = false;       // generating again with the cluster (see row_kernel)
  int group_exchanges_ = 0;        // the row's exchanges across its group printed so far
  std::string group_slot(int width);  // the next exchange's first slot index (see cluster_reduction)
  std::string group_args() const {     // C, G, S of the opf_group_* calls
    return std::to_string(cluster_) + ", " + std::to_string(kRowGroupsMax) + ", " + std::to_string(kGroupSlotsMax);
  }
  // A group's slots: one a block for each (reduction, row parity).
  int group_slots() const { return 2 * std::max(1, cluster_reductions_) * cluster_; }
  bool loop_overflow_ = false;     // loop stages in 1024-thread blocks, later stages backwards (rows overflowing L2)  // a cluster steps through rows (column partials): slots alternate by row (par_)
  std::set<int> loop_varying_;    // values defined by the current stage loop's varying statements
  std::vector<size_t> row_loop_axes_;  // the reduced axes a row loop runs over (split_rows)
  std::vector<int> partial_buffers_;    // column_partials buffers of this kernel
  int partial_items_ = 0;               // vectors per thread the partials cover
  bool lean_retry_ = false;              // generating again without the lean default (see row_lean)
  int lean_blocks_ = 0;                 // blocks an SM asked for by OPFUSE_ROW_LEAN (0: the default bound)
  bool block_partials_ = false;         // lane groups write one partial row a block (OPFUSE_ROW_BLOCK_PARTIALS)
  bool partials_smem_ = false;          // partials in shared memory (OPFUSE_ROW_PARTIALS_SMEM), per-row values in registers
  // L2 prefetch of the row a thread takes next (OPFUSE_ROW_PREFETCH): set
  // while the first unrolled stage loop is printed; its vector loads of
  // row-varying buffers also prefetch the same columns of row pfx<kept>.
  bool prefetch_ = false;
  std::vector<std::string> prefetch_lines_;  // collected by vector_loads, printed after the stage loop
  // Register pipeline of a kernel that loops over rows (OPFUSE_ROW_PIPELINE):
  // the first stage's row-varying 16-byte loads come from nx<k>[it_],
  // loaded in the previous iteration (or in this one, the first); the next
  // row's loads into them are printed after the stage loop (pipe_lines_).
  bool pipeline_ = false;
  bool group_loop_ = false;  // forward lane groups step through rows with the pipeline (OPFUSE_ROW_GROUP_LOOP)
  std::vector<std::pair<std::string, int>> pipe_arrays_;  // nx<k> and its items, declared before the row loop
  std::vector<std::string> pipe_lines_;
  int pipe_items_ = 0;                                    // items of the stage loop being printed
  std::set<std::string> kept_vars_;     // x<axis> of the kept (row) axes
  int loop_stages_printed_ = 0;         // loop (not unrolled) stages so far: odd ones may run backwards
  // Rows staged in shared memory (vector twins of loop-stage rows): the
  // staged buffers' smem arrays, the bytes a block stages, the columns a
  // block (of a cluster) takes, and the blocks an SM that leaves room for.
  struct Staged {
    std::string name;
    int64_t offset = 0;
    KStmt load;  // the buffer's one access along the row
  };
  std::map<int, Staged> staged_;
  int stage_bytes_ = 0;
  int64_t stage_chunk_ = 0;
  int stage_min_blocks_ = 1;
  bool stage_rows(int64_t ncols, const std::set<int>& reread, bool cluster_ok, int* threads, int* cluster);
  void stage_prologue(int threads_per_row, const std::vector<size_t>& kept);
  // The staged ring (OPFUSE_ROW_STAGE_RING): two slots per staged buffer,
  // persistent row groups that copy the next row while reducing this one;
  // =2, one slot refilled in place (stage_inplace_): each piece's copy of
  // the next row goes out right after the last stage stores that piece.
  bool stage_ring_ = false;
  bool stage_inplace_ = false;
  int64_t stage_slot_bytes_ = 0;  // bytes between a staged buffer's two slots
  std::string stage_copy(int b, const Staged& st, const std::string& row_prefix, const std::string& dst);
  void stage_copy_loop(int threads_per_row, const std::string& row_prefix, const std::string& slot);
  void stage_ring_next(int threads_per_row, const std::vector<size_t>& kept);
  void stage_refill_piece();
  int64_t slot_elements(int b) const;
  void partial(const KStmt& s) override;
  void store_partials(int threads_per_row, const std::string& slot);
  void store_block_partials(int rows_per_block);

  // Fewer instructions a row (see row_issue in cuda_row_schedule.cpp): the
  // row length while a row kernel is printed (-1 unknown), and 16-bit
  // vector loads read as raw lanes (OPFUSE_ROW_RAW_LANES).
  int64_t ncols_ = -1;
  bool raw_lanes_ = false;
  std::string l2_policy_;  // a loop stage's L2 eviction policy register (OPFUSE_ROW_L2_HINTS), or empty
  std::string offset(int buffer, const std::vector<Expr>& idx) const override;

  std::map<std::string, std::string> lane_of_;  // access (buffer@offset) -> lane array
  std::string last_var_;                        // the innermost loop variable
  bool row_vectorisable_ = false;

  void statement(const KStmt& s, const KStage& stage) override;
  void plain_statement(const KStmt& s, const KStage& stage);
  void pointwise(const std::string& name, int vec);
  void row_kernel(const std::string& name, int vec);
  void row_stage_loop(const KStage& st, int items, int threads_per_row);
  std::string statement_key(const KStmt& s, const std::vector<std::string>& arg_keys) const;
  int one_pass_stage(const std::string& first, std::pair<bool, bool> means, const std::function<bool(const KStmt&)>& is_f,
                     size_t from = 0) const;
  int online_softmax_stage(size_t from = 0) const;
  int moments_stage(size_t from = 0) const;
  // Stage pairs a row group takes with one exchange against each block's own
  // max or mean (OPFUSE_ROW_GROUP_LOCAL): stage index -> true for moments.
  std::map<int, bool> local_reference_stages() const;
  void local_reference_pair(const KStage& st, const KStage& next, bool moments, int items, int threads_per_row);
  void moments_pair(const KStage& st, const KStage& next, int items, int threads_per_row);
  void online_pair(const KStage& st, const KStage& next, bool staged_online, int items, int threads_per_row);
  void choose_row_cache(bool known, int64_t ncols, int vec, bool lean_try);
  std::string access_key(const KStmt& s) const;
  // Declares lane arrays and issues the vector loads of `stmts` at lane 0's
  // index (`lane0` replaces the innermost variable); skips cached loads.
  void vector_loads(const std::vector<KStmt>& stmts, const std::string& lane0);
  void vector_stores(const std::vector<KStmt>& stmts, const std::string& lane0);
  void reduce_across_threads(const KAccumulator& a);
  void reduce_stage_across_threads(const KStage& st);
  int choose_vec(bool all_stages);
  std::string header(const std::string& name, int threads, int cluster = 1);
};

const char* cuda_prelude();

}  // namespace opfuse
