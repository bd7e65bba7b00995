// The row kernels' schedule by row length and their tuning knobs (see
// cuda_row_schedule.h).
#include "codegen/cuda_row_schedule.h"

#include <algorithm>
#include <cstdlib>

namespace opfuse::row_schedule {

int pow2_at_least(int64_t n) {
  int p = 1;
  while (p < n) p *= 2;
  return p;
}

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
// combined in the one exchange (local_reference_pair). With one exchange
// left, such rows over clusters of 8 go to groups by default as rms_norm's
// do. -1 (default): softmax's and log_softmax's (max, sum) pairs only; 1:
// layer_norm's moments too; 0: never (two exchanges, which the default
// declines for the cluster). Session 33 (H100 80GB HBM3, 4a26dae, bf16
// 4096x262144, us, defaults first / last): softmax 1522 / 1533 -> 1501,
// log_softmax 1518 / 1514 -> 1491, layer_norm 1536 / 1538 -> 1577 (its
// moments' combine costs more than the exchange it saves).
int group_local() { return env_int("OPFUSE_ROW_GROUP_LOCAL", -1); }

int index32() { return env_int("OPFUSE_ROW_INDEX32", row_issue()); }
int exact_cols() { return env_int("OPFUSE_ROW_EXACT_COLS", row_issue()); }
int sum2_const() { return env_int("OPFUSE_ROW_SUM2_CONST", row_issue()); }
bool raw_lanes(bool grouped_rows) {
  int forced = env_int("OPFUSE_ROW_RAW_LANES", -1);
  return forced >= 0 ? forced > 0 : row_issue() > 0 && !grouped_rows;
}
int partials_smem() { return env_int("OPFUSE_ROW_PARTIALS_SMEM", row_lean()); }
int cache_raw() { return env_int("OPFUSE_ROW_CACHE_RAW", row_lean()); }

// See the header.
RowGeometry choose_geometry(bool known, int64_t ncols, int vec, int slots, bool cluster_ok, int64_t reread,
                            int reread_tensors) {
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

}  // namespace opfuse::row_schedule
