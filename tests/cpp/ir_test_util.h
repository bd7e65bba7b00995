// Small helpers for the IR tests: tensors from literals, a structural graph
// comparison, and "throws a GraphError mentioning ..." checks.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "ir/evaluate.h"
#include "ir/graph.h"
#include "ir/ops.h"

namespace opfuse::irtest {

inline HostTensor tensor(DType t, std::vector<int64_t> shape, std::vector<double> data) {
  HostTensor h;
  h.dtype = t;
  h.shape = std::move(shape);
  h.data = std::move(data);
  return h;
}

inline Shape shape_of(std::initializer_list<int64_t> dims) {
  Shape s;
  for (int64_t d : dims) s.push_back(cst(d));
  return s;
}

// Normally distributed values, already representable in `t`.
inline HostTensor random_tensor(DType t, const std::vector<int64_t>& shape, std::mt19937_64& rng, double scale = 1.0,
                                double offset = 0.0) {
  HostTensor h;
  h.dtype = t;
  h.shape = shape;
  std::normal_distribution<double> dist(offset, scale);
  for (int64_t i = 0; i < h.numel(); ++i) h.data.push_back(round_to_dtype(dist(rng), t));
  return h;
}

// Bitwise-equal doubles, except that any NaN equals any NaN.
inline bool same_double(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return std::memcmp(&a, &b, sizeof a) == 0;
}

struct AttrEq {
  bool operator()(const AttrValue& a, const AttrValue& b) const {
    if (a.index() != b.index()) return false;
    if (auto x = std::get_if<double>(&a)) return same_double(*x, std::get<double>(b));
    if (auto x = std::get_if<Shape>(&a)) {
      const Shape& y = std::get<Shape>(b);
      if (x->size() != y.size()) return false;
      for (size_t i = 0; i < y.size(); ++i)
        if (!expr_equal((*x)[i], y[i])) return false;
      return true;
    }
    return a == b;
  }
};

// Structural equality of two graphs; on a difference, says where.
inline ::testing::AssertionResult graphs_equal(const Graph& a, const Graph& b) {
  if (a.nodes.size() != b.nodes.size())
    return ::testing::AssertionFailure() << "node counts differ: " << a.nodes.size() << " vs " << b.nodes.size();
  for (size_t i = 0; i < a.nodes.size(); ++i) {
    const Node& x = a.nodes[i];
    const Node& y = b.nodes[i];
    auto bad = [&](const char* what) { return ::testing::AssertionFailure() << x.where() << ": " << what << " differs"; };
    if (x.id != y.id) return bad("id");
    if (x.op != y.op) return bad("op");
    if (x.inputs != y.inputs) return bad("inputs");
    if (x.dtype != y.dtype) return bad("dtype");
    if (x.shape.size() != y.shape.size()) return bad("rank");
    for (size_t d = 0; d < x.shape.size(); ++d)
      if (!expr_equal(x.shape[d], y.shape[d])) return bad("shape");
    if (x.attrs.size() != y.attrs.size()) return bad("attribute count");
    for (auto& [k, v] : x.attrs) {
      auto it = y.attrs.find(k);
      if (it == y.attrs.end() || !AttrEq{}(v, it->second))
        return ::testing::AssertionFailure() << x.where() << ": attribute '" << k << "' differs";
    }
  }
  if (a.outputs != b.outputs) return ::testing::AssertionFailure() << "outputs differ";
  return ::testing::AssertionSuccess();
}

// Runs f, which must throw a GraphError whose message contains every needle.
inline ::testing::AssertionResult throws_graph_error(const std::function<void()>& f,
                                                     std::initializer_list<std::string> needles) {
  try {
    f();
  } catch (const GraphError& e) {
    std::string msg = e.what();
    for (const std::string& n : needles)
      if (msg.find(n) == std::string::npos)
        return ::testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << n << "\"";
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-GraphError: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

// |a - b| <= atol + rtol * |b| elementwise, NaN matching NaN.
inline ::testing::AssertionResult all_close(const HostTensor& a, const HostTensor& b, double rtol, double atol) {
  if (a.shape != b.shape) return ::testing::AssertionFailure() << "shapes differ";
  if (a.dtype != b.dtype) return ::testing::AssertionFailure() << "dtypes differ: " << dtype_name(a.dtype) << " vs " << dtype_name(b.dtype);
  for (size_t i = 0; i < a.data.size(); ++i) {
    double x = a.data[i], y = b.data[i];
    if (std::isnan(x) || std::isnan(y)) {
      if (std::isnan(x) && std::isnan(y)) continue;
    } else if (x == y || std::fabs(x - y) <= atol + rtol * std::fabs(y)) {
      continue;
    }
    return ::testing::AssertionFailure() << "element " << i << ": " << x << " vs " << y << " (diff " << std::fabs(x - y)
                                         << ", allowed " << atol + rtol * std::fabs(y) << ")";
  }
  return ::testing::AssertionSuccess();
}

}  // namespace opfuse::irtest
