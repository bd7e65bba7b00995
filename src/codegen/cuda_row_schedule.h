// The row kernels' schedule by row length (choose_geometry) and their
// tuning knobs (OPFUSE_ROW_*), read when a kernel is generated: the source,
// and so the cache key, changes with them, so schedules can be measured side
// by side (scripts/row_variants.py). What each knob does and what it
// measured is beside its definition in cuda_row_schedule.cpp.
#pragma once
#include <cstdint>

namespace opfuse::row_schedule {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

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

// Lane groups with column partials write one partial row a block at most
// this many columns (see block_partials): the same bound as parts_for's 528
// parts.
constexpr int64_t kBlockPartialsCols = 256;
// L2 of the H100/H200 (50 MB; the A100's is 40): rows in flight against it.
constexpr int64_t kL2Bytes = 50LL << 20;

int pow2_at_least(int64_t n);
// The integer in environment variable `name`, or `dflt` when unset or empty.
int env_int(const char* name, int dflt);

// The knobs, each its OPFUSE_ROW_* variable or its default (what each does
// and what it measured: the comment at its definition).
// Register cache, clusters, column partials:
int cached_values();
int max_cluster();
int partial_values();
int block_partials();
int row_lean();
int pair_reduce();
int partials_smem();
int cache_raw();
// Loads: L2 prefetch, walk order, eviction hints, register pipelines:
int row_prefetch();
int prefetch_ahead(int threads);
int reverse_loops();
int row_alternate();
int l2_hints();
int row_pipeline();
int group_loop();
// Instructions a row:
int row_issue();
int index32();
int exact_cols();
int sum2_const();
bool raw_lanes(bool grouped_rows);
// Staged rows: unrolling, one-pass stage pairs, cluster and row-group exchanges:
int stage_unroll(int cluster, bool group_exchange);
int stage_moments();
int stage_online();
int cluster_push();
int group_exchange();
int group_local();

// slots: values cached per element (0: nothing to cache, or cols unknown).
// reread: bytes a row's later loop stages read again (0: unknown), from
// reread_tensors row-varying tensors, for loop-stage rows against L2.
RowGeometry choose_geometry(bool known, int64_t ncols, int vec, int slots, bool cluster_ok, int64_t reread = 0,
                            int reread_tensors = 0);

}  // namespace opfuse::row_schedule
