// split_column_sums: a sum over the leading dims of a value that a row
// reduction over the trailing dims also reads becomes column_partials
// (ops.cpp) followed by a sum over the partials' dim 0.
//
// Why: layer_norm's backward computes dx per row (a row reduction over the
// trailing dims) and dweight, dbias per column (sums over the leading dims)
// from the same dy and x. As two kernels both read dy and x, 5 passes over
// memory where 3 are the floor (60% at best). The partials share the row
// kernel's domain and reduce axes, so the planner fuses them into it: each
// block (or lane group) adds its rows' values into registers and writes one
// partial row at the end; a small column reduction of [parts, cols] float32
// finishes (docs/perf-notes.md, "layer_norm backward").
//
// CUDA only (PlannerOptions::column_partials): the row emitter of the CPU
// backend does not compute partials. Only for shapes known at compile time,
// with at least 2048 rows (so each part gets several rows) and rows of at
// most 8192 elements (the partials live in registers), or up to 32768 where
// the planner allows (OPFUSE_COLUMN_PARTIALS_WIDE=1): the row kernel then
// splits each row over a cluster of blocks on sm_90, 8 columns a thread.
#include <algorithm>
#include <cstdlib>

#include "fusion/passes.h"
#include "ir/ops.h"

namespace opfuse {
namespace {

constexpr int64_t kMinRows = 2048;

bool known_product(const Shape& s, size_t begin, size_t end, int64_t* out) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) {
    int64_t c = 0;
    if (!is_const(s[i], &c)) return false;
    p *= c;
  }
  *out = p;
  return true;
}

// Parts: a power of two from 256 with at least 8 rows a part, so the
// partials are at most an eighth of the rows. The grid is parts / (rows a
// block takes): a block per row for rows over 1024 elements (up to 1024
// blocks), lane groups of 8 to 32 rows a block for shorter rows (up to
// 8192 parts, so that there are still hundreds of blocks). Powers of two
// from 256 are multiples of every rows-per-block the emitter uses. Rows
// over 8192 elements take a cluster of up to 8 blocks each: 64 parts (512
// blocks, two waves of 2 x 132), so the partials stay a few percent of the
// traffic (64 x 32768 floats x 2, against 1 GB of dy and x at 8192 rows).
// OPFUSE_COLUMN_PARTS=n (at most rows / 8) sets the parts of rows up to 8192
// elements, to measure the partials' traffic (1024 x 4096 x 2 floats written
// and read again at 32768x4096, 8% of the floor) against the blocks in
// flight. Lane groups need a multiple of their rows a block, unless a block
// writes one part (OPFUSE_ROW_BLOCK_PARTIALS=1).
// Fewer parts where measured faster (H200, bf16, scripts/sessions/lnbwd3_session.py
// at dcddfb0, whole backward): rows of 2049 to 4096 elements (a 512-thread
// block per row, two an SM) take 256 parts, one wave of blocks each
// stepping through 128 rows at 32768x4096 (335.3 -> 289.4 us; 1024 parts
// were 3.9 waves and 64 MB of partials written and read); rows of at most
// 256 elements take 528 (4 lane-group blocks an SM x 132 SMs, one wave),
// each block writing one part (the emitter's block partials, on for those
// rows: see block_partials in cuda_row_schedule.cpp): 262144x256 154.0 ->
// 134.5 us (8192 parts were 16.8 MB of partials).
int64_t parts_for(int64_t rows, int64_t cols) {
  if (cols > 8192) return 64;
  if (const char* e = std::getenv("OPFUSE_COLUMN_PARTS"); e && *e) {
    int64_t n = std::atoll(e);
    if (n >= 1 && n * 8 <= rows) return n;
  }
  if (cols > 2048 && cols <= 4096) return 256;  // (rows >= kMinRows = 2048: 8 rows a part)
  if (cols <= 256 && rows >= 528 * 8) return 528;
  int64_t most = cols <= 1024 ? 8192 : 1024;
  int64_t p = 256;
  while (p < most && p * 2 * 8 <= rows) p *= 2;
  return p;
}

// The number of leading dims `n` sums over, or 0 when it is not a sum over
// leading dims that keeps at least one trailing dim.
size_t leading_sum_dims(const Graph& g, const Node& n) {
  if (n.op != "sum") return 0;
  const Node& x = g.node(n.inputs[0]);
  if (!is_floating(x.dtype) || x.dtype == DType::Float64 || !is_floating(n.dtype)) return 0;
  auto dims = reduction_dims(n, x.rank());
  for (size_t i = 0; i < dims.size(); ++i)
    if (dims[i] != static_cast<int64_t>(i)) return 0;
  return dims.size() < static_cast<size_t>(x.rank()) ? dims.size() : 0;
}

// A row reduction over dims [lead, rank) of a value shaped like `shape`.
bool has_row_partner(const Graph& g, const Shape& shape, size_t lead) {
  for (const Node& r : g.nodes) {
    if (op_def(r).kind != OpKind::Reduction || r.op == "column_partials") continue;
    const Node& x = g.node(r.inputs[0]);
    if (!same_shape(x.shape, shape)) continue;
    auto dims = reduction_dims(r, x.rank());
    bool trailing = dims.size() == shape.size() - lead;
    for (size_t i = 0; trailing && i < dims.size(); ++i) trailing = dims[i] == static_cast<int64_t>(lead + i);
    if (trailing) return true;
  }
  return false;
}

}  // namespace

Graph split_column_sums(const Graph& g, int64_t max_cols) {
  Graph out;
  std::vector<int> remap(g.nodes.size(), -1);
  for (const Node& n : g.nodes) {
    std::vector<int> ins;
    for (int i : n.inputs) ins.push_back(remap[static_cast<size_t>(i)]);
    if (n.op == "input" || n.op == "scalar") {
      remap[static_cast<size_t>(n.id)] = out.add_typed(n.op, {}, n.attrs, n.dtype, n.shape);
      continue;
    }
    size_t lead = leading_sum_dims(g, n);
    int64_t rows = 0, cols = 0;
    const Shape& xs = lead ? g.node(n.inputs[0]).shape : Shape{};
    if (lead && known_product(xs, 0, lead, &rows) && known_product(xs, lead, xs.size(), &cols) && rows >= kMinRows &&
        cols >= 1 && cols <= max_cols && has_row_partner(g, xs, lead)) {
      std::vector<int64_t> dims;
      for (size_t i = 0; i < lead; ++i) dims.push_back(static_cast<int64_t>(i));
      int p = out.add("column_partials", ins, {{"dims", dims}, {"parts", parts_for(rows, cols)}});
      bool keep = n.get_bool("keepdim", false);
      int s = out.add("sum", {p}, {{"dims", std::vector<int64_t>{0}}, {"keepdim", keep}});
      if (keep && lead > 1) s = out.add("reshape", {s}, {{"shape", n.shape}});
      if (out.node(s).dtype != n.dtype) s = out.add("cast", {s}, {{"dtype", n.dtype}});
      remap[static_cast<size_t>(n.id)] = s;
      continue;
    }
    remap[static_cast<size_t>(n.id)] = out.add(n.op, ins, n.attrs);
  }
  for (int o : g.outputs) out.outputs.push_back(remap[static_cast<size_t>(o)]);
  return out;
}

}  // namespace opfuse
