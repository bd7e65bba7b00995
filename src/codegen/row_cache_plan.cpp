#include "codegen/row_cache_plan.h"

#include <algorithm>
#include <set>
#include <sstream>

namespace opfuse {

namespace {

// A point in the per-element program order: (stage, statement position).
using Point = std::pair<size_t, size_t>;

struct Cached {
  DType type;
  Point written;
  Point last_read;
  std::pair<size_t, int> writer;          // (stage, value id)
  std::vector<std::pair<size_t, int>> readers;
};

bool mentions(const Expr& e, const std::set<std::string>& vars) {
  if (!e) return false;
  if (e->kind == ExprNode::Var && vars.count(e->name)) return true;
  for (auto& a : e->args)
    if (mentions(a, vars)) return true;
  return false;
}

}  // namespace

RowCachePlan plan_row_cache(const KernelIR& k, const StatementKey& key, bool loads_only, bool cache_row_invariant) {
  RowCachePlan p;
  size_t ns = k.stages.size();
  p.read.resize(ns);
  p.write.resize(ns);
  p.skip.resize(ns);
  struct Computed { size_t stage, pos; int value; };
  std::map<std::string, Computed> computed;  // key -> where first computed
  std::map<std::string, Cached> cached;
  // Values the same for every row (a weight, bias or their products) are
  // not cached: each stage reloads them, from L1, and their registers hold
  // more of the row instead (layer_norm backward caches dy and x, not w too).
  std::set<std::string> kept_vars;
  for (size_t a = 0; a < k.domain.size(); ++a)
    if (std::find(k.reduce_axes.begin(), k.reduce_axes.end(), static_cast<int64_t>(a)) == k.reduce_axes.end())
      kept_vars.insert("x" + std::to_string(a));
  for (size_t s = 0; s < ns; ++s) {
    const std::vector<KStmt>& loop = k.stages[s].loop;
    std::map<int, std::string> value_key;
    std::vector<std::string> keys(loop.size());
    std::set<int> row_invariant;
    for (size_t i = 0; i < loop.size(); ++i) {
      const KStmt& st = loop[i];
      bool inv = st.kind == KStmt::Const || (st.kind == KStmt::Load && !std::any_of(st.index.begin(), st.index.end(), [&](const Expr& e) {
                                               return mentions(e, kept_vars);
                                             }));
      if (st.kind == KStmt::Compute || st.kind == KStmt::Cast) {
        inv = !st.args.empty();
        for (int a : st.args) inv = inv && row_invariant.count(a);
        for (auto& e : st.index) inv = inv && !mentions(e, kept_vars);
      }
      if (inv && st.dst >= 0 && !cache_row_invariant) row_invariant.insert(st.dst);
    }
    for (size_t i = 0; i < loop.size(); ++i) {
      std::vector<std::string> args;
      for (int a : loop[i].args) {
        auto it = value_key.find(a);
        args.push_back(it != value_key.end() ? it->second : "v" + std::to_string(a));
      }
      keys[i] = key(loop[i], args);
      if (loop[i].dst >= 0) value_key[loop[i].dst] = keys[i];
    }
    // Backwards from the stage's effects (stores, accumulator updates): a
    // needed value that an earlier stage computed is read from a register;
    // anything not needed is not emitted.
    std::set<int> needed;
    std::vector<bool> emitted(loop.size(), false);
    for (size_t i = loop.size(); i-- > 0;) {
      const KStmt& st = loop[i];
      bool effect = st.kind == KStmt::Store || st.kind == KStmt::Update || st.kind == KStmt::Partial;
      if (!effect && !needed.count(st.dst)) {
        p.skip[s].insert(st.dst);
        continue;
      }
      bool reusable = !effect && st.varying && (!loads_only || st.kind == KStmt::Load) && !row_invariant.count(st.dst);
      auto earlier = reusable ? computed.find(keys[i]) : computed.end();
      if (earlier != computed.end()) {
        const Computed& w = earlier->second;
        auto [c, fresh] = cached.emplace(keys[i], Cached{st.type, {w.stage, w.pos}, {s, i}, {w.stage, w.value}, {}});
        c->second.last_read = std::max(c->second.last_read, Point{s, i});
        c->second.readers.push_back({s, st.dst});
        continue;
      }
      emitted[i] = true;
      for (int a : st.args) needed.insert(a);
    }
    for (size_t i = 0; i < loop.size(); ++i)
      if (emitted[i] && loop[i].varying && loop[i].dst >= 0 && loop[i].kind != KStmt::Store && loop[i].kind != KStmt::Update && loop[i].kind != KStmt::Partial)
        computed.emplace(keys[i], Computed{s, i, loop[i].dst});
  }
  // Register arrays: a value whose last read comes before another's write
  // (in per-element program order) lends it its array, as softmax's loads
  // (read last by the sum stage) lend theirs to exp(x - max) (written there,
  // read by the output stage). Greedy by write point; intervals, so optimal.
  std::vector<const Cached*> order;
  for (auto& [k_, c] : cached) order.push_back(&c);
  std::sort(order.begin(), order.end(), [](const Cached* a, const Cached* b) { return a->written < b->written; });
  std::vector<Point> free_after;  // per array: last read of its current value
  for (const Cached* c : order) {
    int slot = -1;
    for (size_t a = 0; a < free_after.size() && slot < 0; ++a)
      if (p.slot_types[a] == c->type && free_after[a] < c->written) slot = static_cast<int>(a);
    if (slot < 0) {
      slot = static_cast<int>(free_after.size());
      free_after.push_back(c->last_read);
      p.slot_types.push_back(c->type);
    }
    free_after[static_cast<size_t>(slot)] = c->last_read;
    p.write[c->writer.first][c->writer.second] = slot;
    for (auto& r : c->readers) p.read[r.first][r.second] = slot;
  }
  return p;
}

std::string to_string(const RowCachePlan& p) {
  std::ostringstream os;
  os << "slots " << p.slots() << "\n";
  for (size_t s = 0; s < p.read.size(); ++s) {
    os << "stage " << s << ":";
    for (auto& [v, slot] : p.write[s]) os << " v" << v << "->rc" << slot;
    for (auto& [v, slot] : p.read[s]) os << " rc" << slot << "->v" << v;
    if (!p.skip[s].empty()) {
      os << " skip";
      for (int v : p.skip[s]) os << " v" << v;
    }
    os << "\n";
  }
  return os.str();
}

}  // namespace opfuse
