// Row (reduction) kernels of the CUDA emitter: the schedule by row length,
// the stage loops, and the reductions across the threads of a row.
#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>
#include <stdexcept>

#include "codegen/cuda_emitter.h"
#include "ir/ops.h"

namespace opfuse {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int pow2_at_least(int64_t n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

// How the threads of a launch cover the rows.
struct RowGeometry {
  bool grouped = false;   // `lanes` lanes of a warp per row, several rows a block
  int lanes = 32;
  int threads = 256;
  int rows_per_block = 1;
  int cluster = 1;        // blocks per row
  int items = 0;          // vectors per thread when the row is cached in registers (0: a loop)
  bool l2_overflow = false;  // loop stages whose re-reads overflow L2 at 512 threads: 1024, backwards
};

// Tuning knobs, read when a kernel is generated (the source, and so the
// cache key, changes with them): for measuring schedules side by side.
int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : dflt;
}

// Registers per thread spent on the row cache: about 32 values keeps a block
// of 512 threads at two blocks an SM (with ~25 registers for the rest), so
// that one block's reductions overlap another's loads.
int cached_values() { return env_int("OPFUSE_ROW_CACHE_VALUES", 32); }
// Blocks per row at most (8 is the portable cluster size; 1 turns clusters
// off). Off by default: on the H200 a cluster per row was slower than one
// block per row at 8192x32768 and than three passes through memory at
// 4096x262144 (docs/perf-notes.md, scripts/row_variants.py). Column
// reductions use clusters regardless.
int max_cluster() { return env_int("OPFUSE_ROW_MAX_CLUSTER", 1); }
// Column partials a thread holds per partials buffer, at most: past it a row
// gets more threads (or lanes).
int partial_values() { return std::max(1, env_int("OPFUSE_ROW_PARTIAL_VALUES", 16)); }
// L2 prefetch of the row a thread takes next, issued after the first
// stage's load loop (register-cached and partials stages of a block per row
// only: loop stages re-read their row from L2 and a prefetch would crowd it
// out). A block that loops over rows (column partials) prefetches its next
// row; a kernel with one row a block, the row one wave on (the blocks an
// SM holds x 132 SMs: its block starts about when the data lands), or
// OPFUSE_ROW_PREFETCH_AHEAD blocks on. On the H200 (bf16,
// rows_bwd_session.py at ea7a57a): layer_norm backward 32768x4096 351 ->
// 336 us, softmax backward 32768x4096 211 -> 198 us (560 ahead), softmax
// 32768x4096 158 -> 139 us (1100 ahead; 3.40 -> 3.86 TB/s). Lane groups
// (short rows) do not prefetch: measured no gain at 262144x256.
// OPFUSE_ROW_PREFETCH=0/1 forces it off or on (lane groups included).
int row_prefetch() { return env_int("OPFUSE_ROW_PREFETCH", -1); }
int prefetch_ahead(int threads) {
  int forced = env_int("OPFUSE_ROW_PREFETCH_AHEAD", 0);
  return forced > 0 ? forced : 132 * (1024 / threads);  // ~ the blocks resident: half the SM's threads (registers)
}
// Loop stages after the first run backwards along the row (alternately), so
// the first columns they re-read are the ones the stage before read last,
// the most likely still in L2. OPFUSE_ROW_REVERSE_LOOPS=0/1 forces it; by
// default it goes with the 1024-thread loop blocks of rows that overflow L2
// (see choose_geometry).
int reverse_loops() { return env_int("OPFUSE_ROW_REVERSE_LOOPS", -1); }
// The last stage of a staged row walks the columns backwards on odd rows
// (OPFUSE_ROW_ALTERNATE=1, an experiment; see the stage loop).
int row_alternate() { return env_int("OPFUSE_ROW_ALTERNATE", 0); }
// L2 eviction priorities in loop stages that re-read their row from L2
// (createpolicy + ld/st .L2::cache_hint, sm_80+): every stage but the last
// loads with evict_last, so the row stays for the next pass; the last
// stage's loads and stores go evict_first, so the pass that is done with
// the row and the output it writes do not push out the rows other blocks
// still re-read. The idea is Inductor's evict_last/evict_first loads in its
// looped reductions. OPFUSE_ROW_L2_HINTS=0: none; 1: the kernels whose
// re-reads overflow L2 at 512 threads (softmax backward 8192x32768); 2:
// every loop-stage kernel.
int l2_hints() { return env_int("OPFUSE_ROW_L2_HINTS", 0); }
// A register pipeline in kernels that loop over rows (column partials): the
// first stage's 16-byte loads of the row-varying tensors of row r + 1 are
// issued into registers right after row r's first stage loop, so they are
// in flight through row r's block reductions, later stages and stores (the
// L2 prefetch only asks for the lines; its loads start after the
// reductions). Costs a second set of those vectors' registers (8 at
// 32768x4096: dy and x, one 16-byte vector each), so it goes with the raw
// cache. OPFUSE_ROW_PIPELINE=1 turns it on (replaces the L2 prefetch).
int row_pipeline() { return env_int("OPFUSE_ROW_PIPELINE", 0); }
// Forward lane groups (rows of at most 1024 elements, no column partials)
// that step through rows with the same register pipeline: the grid is the
// blocks the device holds at once (CompiledGraph's persistent grid, evened
// out so every block takes the same number of row steps), and row r + 1's
// 16-byte loads are in flight through row r's shuffles, later passes and
// stores. A block a row group (the default) has its group's loads in flight
// only between its start and its first reduction: at 262144x256 four
// 256-thread blocks an SM keep at most 64 KB in flight, where the
// weight-stream microbenchmark read HBM at its copy rate only with ~128 KB.
// OPFUSE_ROW_GROUP_LOOP=1 turns it on.
int group_loop() { return env_int("OPFUSE_ROW_GROUP_LOOP", 0); }
// Lane groups with column partials write one partial row a block (the sum of
// its groups' partials, through shared memory, at the end) instead of one a
// group: at 262144x256 the 8192 parts' 16.8 MB of partials, written and read
// again, were 8% of the floor's bytes. The grid is then the parts. On by
// default for rows of at most 256 elements, which the planner gives 528
// parts (split_column_sums.cpp, parts_for): H200, 262144x256 bf16, 154.0 ->
// 134.5 us (lnbwd3_session.py at dcddfb0). Also wherever the parts are not a
// multiple of a block's groups. OPFUSE_ROW_BLOCK_PARTIALS=0/1 forces it.
int block_partials() { return env_int("OPFUSE_ROW_BLOCK_PARTIALS", -1); }
constexpr int64_t kBlockPartialsCols = 256;  // the same bound as parts_for's 528 parts
// Register savings for the partials kernels of the norm backwards, each
// with its own knob (0/1 forces it) and OPFUSE_ROW_LEAN=1/0 forcing the
// three together, with more blocks an SM where all of them apply on sm_90
// (3 of 512 threads, 4 of 256; see lean_blocks_):
// - the pair reduction (opf_block_sum2): on by default in a block per row
//   with the row cached in registers (H200, rows_bwd2_session.py at
//   333d743: layer_norm backward 32768x4096 330.3 -> 322.0 us; loop stages
//   of 8192x32768 854.8 -> 859.5, left off there);
// - the column partials in shared memory, each row's values added in
//   registers and folded into the thread's own shared slots;
// - the register cache of 16-bit vector loads as raw 128-bit vectors (half
//   the registers of floats; see opf_raw_lane).
// By default the last two (and the blocks) go together to lane groups
// (rows of at most 1024 elements) where all of them apply, else to none:
// 262144x256 151.8 -> 142.0 us; a block per row at 32768x4096 with all
// three and 3 blocks an SM ran 342.7 us against 322.0 with the pair alone.
int row_lean() { return env_int("OPFUSE_ROW_LEAN", -1); }
int pair_reduce() { return env_int("OPFUSE_ROW_PAIR_REDUCE", row_lean()); }
// Fewer instructions a row (branch lnbwd-4; layer_norm backward's dx kernel
// at 32768x4096 issued ~260 a warp a row, Inductor's ~60% of that at the same
// bytes; docs/perf-notes.md "lnbwd-4"). On by default since the H200
// measured them (session 9, scripts/sessions/lnbwd4_variants.py: layer_norm backward
// 32768x4096 265.7 -> 251.4 us, 8192x32768 911.5 -> 879.9 us; at 262144x256
// the raw lanes cost 4%, so lane groups keep the plain loads).
// OPFUSE_ROW_ISSUE=0 turns the four off together, each knob forcing its own
// (0/1):
// - OPFUSE_ROW_INDEX32: row and column indices (row_, x<axis>, c_) as int,
//   and 32-bit offsets for buffers of fixed strides, where rows and columns
//   are known and at most 2^30 and the buffer at most 2^31 - 1 elements
//   (IMAD.WIDE of a 32-bit offset instead of 64-bit products and adds;
//   buffers with strides passed at run time keep 64-bit products);
// - OPFUSE_ROW_EXACT_COLS: no column bounds test in unrolled stage loops
//   whose items x threads x V cover the row exactly (c_ < cols for every
//   thread of the block by construction);
// - OPFUSE_ROW_RAW_LANES: 16-bit vector loads kept as the raw 128-bit
//   vector, lane j read with one shift (even) or mask (odd) as the raw
//   cache does, not a byte permute and a shift (same float bits); by
//   default not in lane groups (rows of at most 1024 elements);
// - OPFUSE_ROW_SUM2_CONST: the pair reduction with the block's warps known
//   when the kernel is generated (opf_block_sum2_w: no blockDim arithmetic,
//   one 8-byte shared store and load for the pair, log2(warps) shuffle
//   steps in the second tree, not 5; the same sums bit for bit, see the prelude).
int row_issue() { return env_int("OPFUSE_ROW_ISSUE", 1); }
// Unrolling of staged stage loops (see row_stage_loop).
// Rows split over blocks unroll by 8, by 4 when the blocks exchange through
// global memory (OPFUSE_ROW_GROUP_EXCHANGE: at 8 the 512-thread ring spilled
// 8 bytes at its 40 registers, bf16 log_softmax and layer_norm; at 6 float32).
int stage_unroll(int cluster, bool group_exchange) {
  return env_int("OPFUSE_ROW_STAGE_UNROLL", cluster > 1 ? (group_exchange ? 4 : 8) : 0);
}
// The mean and variance in one pass in staged rows (see row_kernel).
int stage_moments() { return env_int("OPFUSE_ROW_STAGE_MOMENTS", 0); }
// The online (max, sum) pass in staged rows (see row_kernel).
int stage_online() { return env_int("OPFUSE_ROW_STAGE_ONLINE", 0); }
// Staged rows' cluster reductions without barrier.cluster (see reduce_across_threads):
// -1 (default) in the ring only (4-8% faster at 4096x262144 on the H200; a
// cluster a row measured no faster, rms_norm slower), 1 always, 0 never.
int cluster_push() { return env_int("OPFUSE_ROW_CLUSTER_PUSH", -1); }
// The ring's row groups without a cluster: the blocks of a row are C
// consecutive blocks of a grid as large as the device holds at once, and
// their reductions go through global memory (opf_group_reduce). Clusters of 8 three-block SMs leave 8 of the H200's
// 132 SMs idle (the GPCs do not divide into them: 45 clusters resident, not
// 49); without a cluster every SM takes three blocks. -1 (default): for
// rows over clusters of 8 with one reduction across the row (rms_norm,
// softmax backward), 1: every ring over several blocks, 0: never. H200,
// bf16 4096x262144 (session 29, us): rms_norm 1196 -> 1097 and 1237 ->
// 1129, softmax backward 1942 -> 1708 and 1957 -> 1743; with two
// reductions a row (softmax, log_softmax, layer_norm, layer_norm
// backward) 0-6% slower: an exchange costs more than the cluster's pushed
// one. (Tried and dropped: the partial and a tag in one word, no counter,
// 2-3% slower than the counter.) With 1, OPFUSE_ROW_STAGE_ONLINE=1 and
// OPFUSE_ROW_STAGE_MOMENTS=1 exchange their pairs and triples the same way
// (opf_group_online, opf_group_moments): one exchange a row for softmax
// and layer_norm, but 6-9% slower than the defaults (session 30: the
// one-pass loops cost more than the exchange they save).
int group_exchange() { return env_int("OPFUSE_ROW_GROUP_EXCHANGE", -1); }
// A row group's two reductions a row (softmax's max and sum, layer_norm's
// mean and variance) with one exchange: the first across the block only,
// the second against the block's own value, the blocks' pairs or triples
// combined in the one exchange (local_reference_pair). 1: on wherever the
// row is in groups (and so, with one exchange left, softmax, log_softmax and
// layer_norm over clusters of 8 go to groups by default as rms_norm does);
// 0 (default until it has been timed on a GPU): two exchanges, which the
// default declines for the cluster.
int group_local() { return env_int("OPFUSE_ROW_GROUP_LOCAL", 0); }

int index32() { return env_int("OPFUSE_ROW_INDEX32", row_issue()); }
int exact_cols() { return env_int("OPFUSE_ROW_EXACT_COLS", row_issue()); }
int sum2_const() { return env_int("OPFUSE_ROW_SUM2_CONST", row_issue()); }
bool raw_lanes(bool grouped_rows) {
  int forced = env_int("OPFUSE_ROW_RAW_LANES", -1);
  return forced >= 0 ? forced > 0 : row_issue() > 0 && !grouped_rows;
}
int partials_smem() { return env_int("OPFUSE_ROW_PARTIALS_SMEM", row_lean()); }
int cache_raw() { return env_int("OPFUSE_ROW_CACHE_RAW", row_lean()); }
// L2 of the H100/H200 (50 MB; the A100's is 40): rows in flight against it.
constexpr int64_t kL2Bytes = 50LL << 20;

// slots: values cached per element (0: nothing to cache, or cols unknown).
// reread: bytes a row's later loop stages read again (0: unknown), from
// reread_tensors row-varying tensors, for loop-stage rows against L2.
RowGeometry choose_geometry(bool known, int64_t ncols, int vec, int slots, bool cluster_ok, int64_t reread = 0,
                            int reread_tensors = 0) {
  RowGeometry g;
  if (known && ncols <= 1024) {
    // Short rows: the fewest lanes that give each lane at most 4 vectors.
    int64_t nv = ceil_div(ncols, vec);
    int lanes = 1;
    while (lanes < 32 && lanes * 4 < nv) lanes *= 2;
    // OPFUSE_ROW_GROUP_LANES / _THREADS (powers of two): the lanes a row and
    // the block size of lane groups, to measure them (defaults: the rule
    // above, 256 threads).
    auto pow2_knob = [](const char* name, int lo, int hi, int dflt) {
      int v = env_int(name, 0);
      return v >= lo && v <= hi && (v & (v - 1)) == 0 ? v : dflt;
    };
    lanes = pow2_knob("OPFUSE_ROW_GROUP_LANES", 1, 32, lanes);
    int threads = std::max(pow2_knob("OPFUSE_ROW_GROUP_THREADS", 64, 1024, 256), lanes);
    g.grouped = true;
    g.lanes = lanes;
    g.threads = threads;
    g.rows_per_block = threads / lanes;
    int64_t items = ceil_div(nv, lanes);
    if (slots > 0 && items * vec * slots <= 2 * cached_values()) g.items = static_cast<int>(items);
    return g;
  }
  g.threads = known ? std::min(1024, std::max(128, pow2_at_least(ceil_div(ncols, 8 * vec)))) : 512;
  if (!known || slots == 0) return g;
  int64_t nv = ceil_div(ncols, vec);
  int64_t per_thread = std::max(1, cached_values() / (vec * slots));  // vectors a thread caches
  int64_t need = ceil_div(nv, per_thread);                            // threads a row needs
  if (need <= 512) {
    g.threads = std::max(128, pow2_at_least(need));
    g.items = static_cast<int>(ceil_div(nv, g.threads));
    return g;
  }
  if (cluster_ok) {
    // A cluster of blocks per row; 1024-thread blocks only when 512 would
    // need more than the 8 blocks a portable cluster may have.
    int threads = 512;
    int64_t blocks = ceil_div(need, threads);
    if (blocks > max_cluster()) {
      threads = 1024;
      blocks = ceil_div(need, threads);
    }
    // (The scalar twin's index arithmetic does not fit beside 32 cached
    // values in 1024-thread blocks' 64 registers.)
    if (blocks <= max_cluster() && blocks > 1 && (threads < 1024 || vec > 1)) {
      g.threads = threads;
      g.cluster = static_cast<int>(blocks);
      g.items = static_cast<int>(ceil_div(nv, threads * blocks));
      return g;
    }
  }
  // Longer rows are not cached: a 1024-thread block holding a row in
  // registers runs alone on its SM, so each row's load latency and
  // reductions go unhidden (2.1-2.7 TB/s at 8192x32768 on the H200). Loop
  // stages with 512 threads run four blocks an SM, and the later stages'
  // re-reads of rows that many blocks hold (a few tens of MB) come from L2
  // (3.3-3.6 TB/s; docs/perf-notes.md). OPFUSE_ROW_LOOP_THREADS sets the
  // block size of loop stages, to measure rows in flight against L2.
  // Rows whose re-reads overflow L2 with 512-thread blocks (about 4 x 132
  // rows in flight) but fit with 1024-thread ones (2 x 132) take those, at
  // most 32 registers (two blocks an SM: as many threads), and run their
  // later stages backwards: softmax backward 8192x32768 (128 KB of dy and y
  // a row; 3 x 132 rows in flight at 38 registers, 50 MB) 623 us, 488
  // backwards, 487 with 1024 threads, 476 with both (H200,
  // rows_bwd_session.py at ea7a57a). Forward softmax and layer_norm at
  // 8192x32768 (64 KB a row, 25 MB) ran 2-5% slower backwards: not theirs.
  // Only for rows that re-read two or more tensors (the backward kernels,
  // measured): a forward re-reading one float32 row of 25-50K elements
  // would qualify too, but at the 32-register cap ptxas spills 4-8 bytes in
  // log_softmax and layer_norm, and it was not measured.
  if (reread > 0 && reread_tensors >= 2 && 4 * 132 * reread > kL2Bytes && 2 * 132 * reread <= kL2Bytes) {
    g.threads = 1024;
    g.l2_overflow = true;
  }
  if (int t = env_int("OPFUSE_ROW_LOOP_THREADS", 0); t >= 128 && t <= 1024 && (t & (t - 1)) == 0) g.threads = t;
  return g;
}

}  // namespace

// Two stages k, k+1 that one pass can take: each has one float32
// accumulator (stage k's combines with `first`, stage k+1's sums; `means`
// says whether each divides by the count), stage k+1 has no pre statements
// and stores nothing, and its accumulator adds f(u' - r), where r is stage
// k's result (used nowhere else in stage k+1's loop), u' is stage k's
// accumulated value u recomputed, and `is_f` tells f's statement. Returns k,
// or -1.
int CudaEmitter::one_pass_stage(const std::string& first, std::pair<bool, bool> means,
                                const std::function<bool(const KStmt&)>& is_f, size_t from) const {
  StatementKey key = [&](const KStmt& s, const std::vector<std::string>& a) { return statement_key(s, a); };
  auto keys_of = [&](const KStage& st) {
    std::map<int, std::string> vk;
    for (const KStmt& x : st.loop) {
      std::vector<std::string> args;
      for (int a : x.args) args.push_back(vk.count(a) ? vk[a] : "v" + std::to_string(a));
      if (x.dst >= 0) vk[x.dst] = key(x, args);
    }
    return vk;
  };
  for (size_t k = from; k + 1 < k_->stages.size(); ++k) {
    const KStage& a = k_->stages[k];
    const KStage& b = k_->stages[k + 1];
    if (a.accs.size() != 1 || b.accs.size() != 1 || !b.pre.empty()) continue;
    const KAccumulator& r = a.accs[0];
    const KAccumulator& t = b.accs[0];
    if (r.combiner != first || t.combiner != "sum" || r.type != DType::Float32 || t.type != DType::Float32 ||
        r.mean != means.first || t.mean != means.second)
      continue;
    int u = -1, e = -1;
    bool stores = false;
    for (const KStmt& x : a.loop)
      if (x.kind == KStmt::Update) u = x.args[0];
    for (const KStmt& x : b.loop) {
      if (x.kind == KStmt::Update) e = x.args[0];
      if (x.kind == KStmt::Store) stores = true;
    }
    if (u < 0 || e < 0 || stores) continue;
    const KStmt* f_stmt = nullptr;
    const KStmt* sub_stmt = nullptr;
    int uses_of_r = 0;
    for (const KStmt& x : b.loop) {
      if (x.dst == e && is_f(x)) f_stmt = &x;
      for (int arg : x.args) uses_of_r += arg == r.result;
    }
    if (!f_stmt || uses_of_r != 1) continue;
    for (const KStmt& x : b.loop)
      if (x.dst == f_stmt->args[0] && x.kind == KStmt::Compute && x.node.op == "sub" && x.args[1] == r.result) sub_stmt = &x;
    if (!sub_stmt) continue;
    auto ka = keys_of(a), kb = keys_of(b);
    if (!ka.count(u) || !kb.count(sub_stmt->args[0]) || ka[u] != kb[sub_stmt->args[0]]) continue;
    return static_cast<int>(k);
  }
  return -1;
}

// Softmax's max stage followed by its sum-of-exp stage, which loop stages
// (rows not cached in registers) can run as one pass with an online
// (max, sum) pair: f is exp.
int CudaEmitter::online_softmax_stage(size_t from) const {
  return one_pass_stage("max", {false, false}, [](const KStmt& x) { return x.kind == KStmt::Compute && x.node.op == "exp"; }, from);
}

// layer_norm's mean stage followed by its variance stage (a mean of d * d),
// which a staged row can take as one pass of shifted sums (see row_kernel).
int CudaEmitter::moments_stage(size_t from) const {
  return one_pass_stage(
      "sum", {true, true},
      [](const KStmt& x) { return x.kind == KStmt::Compute && x.node.op == "mul" && x.args.size() == 2 && x.args[0] == x.args[1]; },
      from);
}

// Every softmax-like and layer_norm-like stage pair (see one_pass_stage)
// whose second loop uses nothing the first stage's post statements define:
// the second loop runs before them, against the block's own max or mean
// (local_reference_pair).
std::map<int, bool> CudaEmitter::local_reference_stages() const {
  std::map<int, bool> found;
  auto add = [&](int k, bool moments) {
    if (k < 0 || found.count(k) || found.count(k - 1) || found.count(k + 1)) return;
    std::set<int> post;
    for (const KStmt& x : k_->stages[static_cast<size_t>(k)].post)
      if (x.dst >= 0) post.insert(x.dst);
    for (const KStmt& x : k_->stages[static_cast<size_t>(k) + 1].loop)
      for (int arg : x.args)
        if (post.count(arg)) return;
    found[k] = moments;
  };
  for (size_t k = 0; k + 1 < k_->stages.size(); ++k) {
    if (online_softmax_stage(k) == static_cast<int>(k)) add(static_cast<int>(k), false);
    if (moments_stage(k) == static_cast<int>(k)) add(static_cast<int>(k), true);
  }
  return found;
}

// Two reductions a row with one exchange across a row group
// (OPFUSE_ROW_GROUP_LOCAL): the first (softmax's max, layer_norm's mean)
// across the block only; the second loop (sum of exp(x - r), of (x - r)^2)
// against the block's own r; then the blocks' pairs (max, sum) or triples
// (count, mean, squared deviations) combine in one exchange, exactly as
// the two passes would within rounding: sum exp(x - M) = sum_b exp(m_b - M)
// * s_b, and Chan's update for the moments. Unlike the online pair (one
// exp per element plus a rescale per vector) and the shifted sums, the
// loops stay those of the two passes: the extra cost is one block
// reduction, where the second exchange through L2 is saved.
void CudaEmitter::local_reference_pair(const KStage& st, const KStage& next, bool moments, int items, int threads_per_row) {
  const KAccumulator& ra = st.accs[0];
  const KAccumulator& rb = next.accs[0];
  for (auto& s : st.pre) statement(s, st);
  accumulator_init(ra);
  accumulator_init(rb);
  if (!st.loop.empty()) row_stage_loop(st, items, threads_per_row);
  const std::string a = acc_name(ra), b = acc_name(rb), n = a + "_n";
  std::string ref;
  if (moments) {
    line(a + " = opf_block_reduce<opf_sum>(" + a + ", " + smem_ + ");");
    line(a + " = cend_ > cbegin_ ? " + a + " / (float)(cend_ - cbegin_) : 0.0f;  // the block's mean of its columns of the row");
    ref = a;
  } else {
    // A block whose part is all -inf has max -inf: its sum runs against 0
    // (exp(-inf - 0) adds nothing) and its pair adds nothing to the group's.
    line(a + " = opf_block_reduce<opf_max>(" + a + ", " + smem_ + ");");
    ref = a + " == opf_lowest<float>() ? 0.0f : " + a;
  }
  line("{");
  ++indent_;
  line("const " + value_type(ra.result_type) + " " + value(ra.result) + " = " + ref + ";");
  ++stage_index_;
  if (!next.loop.empty()) row_stage_loop(next, items, threads_per_row);
  --stage_index_;
  --indent_;
  line("}");
  if (moments) {
    // (The count after the loop, not kept live across it: it is cend_ - cbegin_.)
    line("float " + n + " = (float)(cend_ > cbegin_ ? cend_ - cbegin_ : 0);");
    line("opf_group_local_moments<" + group_args() + ">(" + n + ", " + a + ", " + b + ", " + smem_ + ", a.gx, " + group_slot(2) + ");");
    line(a + " *= " + n + ";");  // the mean accumulator's finish divides the sum by the count
  } else {
    line(std::string("opf_group_local_online<") + (fast_math_ ? "true" : "false") + ", " + group_args() + ">(" + a + ", " + b + ", " +
         smem_ + ", a.gx, " + group_slot(1) + ");");
  }
  accumulator_finish(ra);
  for (auto& s : st.post) statement(s, st);
  accumulator_finish(rb);
  for (auto& s : next.post) statement(s, next);
}

std::string CudaEmitter::statement_key(const KStmt& s, const std::vector<std::string>& arg_keys) const {
  std::vector<std::string> a;
  for (auto& k : arg_keys) a.push_back("{" + k + "}");
  switch (s.kind) {
    case KStmt::Load: return "load " + access_key(s) + " " + dtype_name(s.type);
    case KStmt::Const: return "const " + literal(s.value, s.type);
    case KStmt::Cast: return "cast " + std::string(dtype_name(s.node.dtype)) + " " + a[0];
    case KStmt::Compute:
      if (s.node.op == "select_lt") return "select_lt " + size_c(s.index[0]) + " " + size_c(s.index[1]) + " " + a[0] + " " + a[1];
      return dtype_name(s.type) + std::string(" ") + op_def(s.node).c_expr(a, s.node);
    default: return "effect";
  }
}

// A cluster reduction of `width` 8-byte values: prints `call` with the
// address of its slots in opf_cslot (a cluster that steps through rows uses
// each slot group alternately by row parity: a block may publish row r + 1's
// part before its peers have read row r's) and marks where the kernel's last
// cluster reduction ends (see opf_cluster_arrive in row_kernel). `call`
// holds "@" where the slot's address goes.
std::string CudaEmitter::group_slot(int width) {
  // As cluster_reduction's indices in a ring: `width` slots a parity.
  int base = cluster_reductions_;
  cluster_reductions_ += width;
  ++group_exchanges_;
  return std::to_string(2 * base) + (width == 1 ? " + par_" : " + " + std::to_string(width) + " * par_");
}

void CudaEmitter::cluster_reduction(int width, const std::string& call) {
  int base = cluster_reductions_;
  cluster_reductions_ += width;
  std::string idx = !cluster_row_loop_ ? std::to_string(base)
                    : width == 1       ? std::to_string(2 * base) + " + par_"
                                       : std::to_string(2 * base) + " + " + std::to_string(width) + " * par_";
  std::string c = call;
  c.replace(c.find('@'), 1, "&opf_cslot[" + idx + "]");
  line(c);
  last_cluster_reduce_end_ = static_cast<int64_t>(out_.tellp());
  last_cluster_reduce_indent_ = indent_;
}

void CudaEmitter::reduce_across_threads(const KAccumulator& a) {
  std::string n = acc_name(a);
  const std::string& c = a.combiner;
  std::string op = c == "sum" ? "opf_sum" : c == "prod" ? "opf_prod" : c == "max" ? "opf_max" : "opf_min";
  std::string w = std::to_string(lanes_);
  if (columns_) {  // sum, prod, max or min only (see row_kernel)
    std::string slot = "reinterpret_cast<" + value_type(a.type) + "*>(&opf_cslot[" + std::to_string(32 * cluster_reductions_++) + "])";
    line(n + " = opf_column_reduce<" + op + ", " + std::to_string(cluster_) + ">(" + n + ", opf_csmem, " + slot + ");");
    return;
  }
  if (c == "sum" || c == "prod" || c == "max" || c == "min") {
    if (grouped_rows_) {
      if (lanes_ > 1) line(n + " = opf_warp_reduce<" + op + ", " + w + ">(" + n + ");");
    } else if (cluster_ > 1 && cluster_push_) {
      // OPFUSE_ROW_CLUSTER_PUSH (default in the ring; staged rows split
      // over a cluster, sm_90): each block pushes its partial into every peer's
      // slot with st.async, completing bytes on the peer's mbarrier, and
      // waits on its own mbarrier only. barrier.cluster compiles to
      // MEMBAR.ALL.GPU (its release waits for every earlier store: in the
      // ring, the previous row's output) and CCTL.IVALL (its acquire
      // empties L1, layer_norm's weight and bias with it); this is a
      // shared-memory store and a wait. In the ring, slots and mbarriers
      // alternate by row parity as opf_cslot's do and an mbarrier's phase
      // is its use count, xit_ / 2; a cluster a row uses each once.
      int k = cluster_reductions_++;
      std::string idx = cluster_row_loop_ ? std::to_string(2 * k) + " + par_" : std::to_string(k);
      if (group_exchange_) {  // the same slots by (reduction, parity), in global memory (opf_group_reduce)
        // (The group's address is computed in the call from the kernel
        // argument, not kept in registers: the in-place ring's 512-thread
        // blocks have 40 at three an SM.)
        ++group_exchanges_;
        line(n + " = opf_group_reduce<" + op + ", " + group_args() + ">(" + n + ", " + smem_ + ", a.gx, " + idx + ");");
        return;
      }
      line(n + " = opf_cluster_reduce_push<" + op + ", " + std::to_string(cluster_) + ">(" + n + ", " + smem_ + ", reinterpret_cast<" +
           value_type(a.type) + "*>(opf_xslot[" + idx + "]), &opf_xbar[" + idx + "], " +
           (cluster_row_loop_ ? "(unsigned)(xit_ >> 1) & 1u" : "0u") + ");");
    } else if (cluster_ > 1) {
      cluster_reduction(1, n + " = opf_cluster_reduce<" + op + ", " + std::to_string(cluster_) + ">(" + n + ", " + smem_ +
                               ", reinterpret_cast<" + value_type(a.type) + "*>(@));");
    } else {
      line(n + " = opf_block_reduce<" + op + ">(" + n + ", " + smem_ + ");");
    }
  } else if (c == "argmax" || c == "argmin") {
    std::string mx = c == "argmax" ? "true" : "false";
    if (grouped_rows_) {
      if (lanes_ > 1) line("opf_warp_arg<" + mx + ", " + w + ">(" + n + ", " + acc_name(a, "_i") + ");");
    } else {
      line("opf_block_arg<" + mx + ">(" + n + ", " + acc_name(a, "_i") + ", " + smem_ + ");");
    }
  } else if (c == "welford") {
    if (grouped_rows_) {
      if (lanes_ > 1) line("opf_warp_welford<" + w + ">(" + n + ", " + acc_name(a, "_m2") + ", " + acc_name(a, "_n") + ");");
    } else {
      line("opf_block_welford(" + n + ", " + acc_name(a, "_m2") + ", " + acc_name(a, "_n") + ", " + smem_ + ");");
    }
  }
}

// A stage's accumulators across the threads of a row. In a block per row,
// floating-point sums go two at a time through opf_block_sum2 (one barrier
// for the pair instead of two barriers each): layer_norm backward's
// sum(g) and sum(g * xhat) (OPFUSE_ROW_PAIR_REDUCE=0/1 forces it off/on).
void CudaEmitter::reduce_stage_across_threads(const KStage& st) {
  std::vector<const KAccumulator*> sums;
  int forced = pair_reduce();
  bool block = !grouped_rows_ && !columns_ && cluster_ == 1 && (forced >= 0 ? forced > 0 : caching_);
  for (const KAccumulator& a : st.accs) {
    bool pairable = block && a.combiner == "sum" && (a.type == DType::Float32 || a.type == DType::Float64);
    if (pairable) {
      for (size_t i = 0; i < sums.size(); ++i)
        if (sums[i]->type == a.type) {
          int nw = launch_.threads / 32;
          bool known_warps = sum2_const() > 0 && launch_.threads % 32 == 0 && (nw & (nw - 1)) == 0;
          std::string fn = known_warps ? "opf_block_sum2_w<" + std::to_string(nw) + ">(" : "opf_block_sum2(";
          line(fn + acc_name(*sums[i]) + ", " + acc_name(a) + ", reinterpret_cast<" + value_type(a.type) +
               "*>(opf_psmem), opf_rp_);");
          ++pair_reductions_;
          sums.erase(sums.begin() + static_cast<std::ptrdiff_t>(i));
          pairable = false;
          break;
        }
      if (pairable) sums.push_back(&a);
    } else {
      reduce_across_threads(a);
    }
  }
  for (const KAccumulator* a : sums) reduce_across_threads(*a);
}

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

// Adds to this thread's partial of the column the current element is in;
// groups that redo the last row (past the end) add nothing.
void CudaEmitter::partial(const KStmt& s) {
  std::string idx = in_lanes_ ? "it_ * " + std::to_string(vec_) + " + j_" : "it_";
  line("if (real_) pp" + std::to_string(s.buffer) + "[" + idx + "] += " + value(s.args[0]) + ";");
}

// After the rows: each thread writes its columns of the partials to the
// part `slot` (row `slot` of the [parts, cols] buffer).
void CudaEmitter::store_partials(int threads_per_row, const std::string& slot) {
  if (partial_buffers_.empty()) return;
  std::string V = std::to_string(vec_), T = std::to_string(threads_per_row);
  line("{");
  ++indent_;
  line("const int64_t slot_ = " + slot + ";");
  line("#pragma unroll");
  line("for (int it_ = 0; it_ < " + std::to_string(partial_items_) + "; ++it_) {");
  ++indent_;
  line("const int64_t c_ = cbase_ + ((int64_t)it_ * " + T + " + tid_) * " + V + ";");
  line("#pragma unroll");
  line("for (int j_ = 0; j_ < " + V + "; ++j_)");
  ++indent_;
  std::string stores;
  for (size_t k = 0; k < partial_buffers_.size(); ++k) {
    int b = partial_buffers_[k];
    std::string bs = std::to_string(b);
    std::string v = "pp" + bs + "[it_ * " + V + " + j_]";
    if (partials_smem_) {
      // Element e = it_ * V + j_ of buffer k sits at ((k * n/4 + e/4) * threads + threadIdx.x) * 4 + e % 4.
      int n = partial_items_ * vec_;
      v = "opf_pps[((" + std::to_string(static_cast<int64_t>(k) * (n / 4)) + " + (it_ * " + V + " + j_) / 4) * " +
          std::to_string(launch_.threads) + " + threadIdx.x) * 4 + (it_ * " + V + " + j_) % 4]";
    }
    stores += " " + store(b, "slot_ * cols + c_ + j_", v);
  }
  line("if (c_ + j_ < cols) {" + stores + " }");
  indent_ -= 2;
  line("}");
  --indent_;
  line("}");
}

// After the rows (OPFUSE_ROW_BLOCK_PARTIALS): the block's lane groups add
// their partials column by column (in a fixed order, group 0 first) and the
// block writes part blockIdx.x. Lane tid_ of a group holds, at element
// e = it_ * V + j_, column (it_ * lanes + tid_) * V + j_: from the shared
// partials (partials_smem_) directly, else through a shared row per group.
void CudaEmitter::store_block_partials(int rows_per_block) {
  if (partial_buffers_.empty()) return;
  std::string V = std::to_string(vec_), L = std::to_string(lanes_), R = std::to_string(rows_per_block);
  std::string TH = std::to_string(launch_.threads);
  int n = partial_items_ * vec_;
  int64_t span = static_cast<int64_t>(partial_items_) * lanes_ * vec_;  // columns a group's lanes cover
  line("{");
  ++indent_;
  line("const int64_t slot_ = blockIdx.x;");
  if (!partials_smem_) line("__shared__ __align__(16) float opf_bp[" + std::to_string(rows_per_block * span) + "];");
  for (size_t k = 0; k < partial_buffers_.size(); ++k) {
    std::string bs = std::to_string(partial_buffers_[k]);
    std::string sum;
    line("__syncthreads();");
    if (partials_smem_) {
      sum = "opf_pps[((" + std::to_string(static_cast<int64_t>(k) * (n / 4)) + " + e_ / 4) * " + TH + " + g_ * " + L +
            " + lane_) * 4 + e_ % 4]";
    } else {
      line("#pragma unroll");
      line("for (int it_ = 0; it_ < " + std::to_string(partial_items_) + "; ++it_)");
      line("  for (int j_ = 0; j_ < " + V + "; ++j_)");
      line("    opf_bp[(threadIdx.x / " + L + ") * " + std::to_string(span) + " + (it_ * " + L + " + tid_) * " + V +
           " + j_] = pp" + bs + "[it_ * " + V + " + j_];");
      line("__syncthreads();");
      sum = "opf_bp[g_ * " + std::to_string(span) + " + c_]";
    }
    line("#pragma unroll 1");
    line("for (int c_ = threadIdx.x; c_ < (int)cols; c_ += " + TH + ") {  // (lane groups: rows of at most 1024)");
    line("  const int lane_ = (int)((c_ / " + V + ") % " + L + ");");
    line("  const int e_ = (int)((c_ / " + V + ") / " + L + ") * " + V + " + (int)(c_ % " + V + ");");
    line("  (void)lane_; (void)e_;");
    line("  float s_ = 0.0f;");
    line("  #pragma unroll 4");
    line("  for (int g_ = 0; g_ < " + R + "; ++g_) s_ += " + sum + ";");
    line("  " + store(partial_buffers_[k], "slot_ * cols + (int64_t)c_", "s_"));
    line("}");
  }
  --indent_;
  line("}");
}

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

  // The register cache: the frontier plan or the loads-only plan, whichever
  // needs fewer registers.
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
  // versions have not run on a GPU.)
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
  // OPFUSE_ROW_GROUP_LOCAL=1: a row group's two reductions with one
  // exchange (local_reference_pair), where the one-pass knobs are off.
  std::map<int, bool> local;
  if (group_exchange_ && online < 0 && moments < 0 && !caching_ && !columns_ && !grouped_rows_ && vec > 1 && group_local() > 0)
    local = local_reference_stages();
  for (size_t si = 0; si < k_->stages.size(); ++si) {
    const KStage& st = k_->stages[si];
    stage_index_ = static_cast<int>(si);
    if (auto l = local.find(static_cast<int>(si)); l != local.end()) {
      local_reference_pair(st, k_->stages[si + 1], l->second, g.items, threads_per_row);
      ++si;
      continue;
    }
    if (moments >= 0 && si == static_cast<size_t>(moments)) {
      const KStage& next = k_->stages[si + 1];
      const KAccumulator& mn = st.accs[0];
      const KAccumulator& vr = next.accs[0];
      for (auto& s : st.pre) statement(s, st);
      accumulator_init(mn);
      accumulator_init(vr);
      line("float wk_ = 0.0f, wn_ = 0.0f;");
      moments_mean_ = acc_name(mn);
      online_acc_ = acc_name(vr);
      if (!st.loop.empty()) row_stage_loop(st, g.items, threads_per_row);
      moments_mean_.clear();
      online_acc_.clear();
      // (mean, squared deviations) of the thread, then of the row; the sum
      // the mean accumulator's finish divides is mean x count.
      std::string m = acc_name(mn), m2 = acc_name(vr);
      line("opf_shifted_moments(wn_, wk_, " + m + ", " + m2 + ");");
      if (cluster_ > 1 && group_exchange_) {
        line("opf_group_moments<" + group_args() + ">(wn_, " + m + ", " + m2 + ", " + smem_ + ", a.gx, " + group_slot(2) + ");");
      } else if (cluster_ > 1) {
        // Two 8-byte slots: count, mean, squared deviations.
        cluster_reduction(2, "opf_cluster_moments<" + std::to_string(cluster_) + ">(wn_, " + m + ", " + m2 + ", " + smem_ +
                                 ", reinterpret_cast<float*>(@));");
      } else {
        line("opf_block_moments(wn_, " + m + ", " + m2 + ", " + smem_ + ");");
      }
      line(m + " *= wn_;");
      accumulator_finish(mn);
      for (auto& s : st.post) statement(s, st);
      accumulator_finish(vr);
      for (auto& s : next.post) statement(s, next);
      ++si;
      continue;
    }
    if (online >= 0 && si == static_cast<size_t>(online)) {
      const KStage& next = k_->stages[si + 1];
      const KAccumulator& mx = st.accs[0];
      const KAccumulator& sm = next.accs[0];
      for (auto& s : st.pre) statement(s, st);
      accumulator_init(mx);
      accumulator_init(sm);
      online_acc_ = acc_name(sm);
      if (staged_online) online_vec_max_ = acc_name(mx);
      if (!st.loop.empty()) row_stage_loop(st, g.items, threads_per_row);
      online_acc_.clear();
      online_vec_max_.clear();
      std::string fast = fast_math_ ? "true" : "false";
      if (grouped_rows_) {
        if (lanes_ > 1) line("opf_warp_online<" + fast + ", " + std::to_string(lanes_) + ">(" + acc_name(mx) + ", " + acc_name(sm) + ");");
      } else if (cluster_ > 1 && group_exchange_) {
        line("opf_group_online<" + fast + ", " + group_args() + ">(" + acc_name(mx) + ", " + acc_name(sm) + ", " + smem_ +
             ", a.gx, " + group_slot(1) + ");");
      } else if (cluster_ > 1) {
        // The pair through distributed shared memory: one 8-byte slot a block.
        cluster_reduction(1, "opf_cluster_online<" + fast + ", " + std::to_string(cluster_) + ">(" + acc_name(mx) + ", " + acc_name(sm) +
                                 ", " + smem_ + ", reinterpret_cast<float*>(@));");
      } else {
        line("opf_block_online<" + fast + ">(" + acc_name(mx) + ", " + acc_name(sm) + ", " + smem_ + ");");
      }
      accumulator_finish(mx);
      for (auto& s : st.post) statement(s, st);
      accumulator_finish(sm);
      for (auto& s : next.post) statement(s, next);
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
