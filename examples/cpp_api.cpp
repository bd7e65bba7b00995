// The seed's chain y = relu(x + b1) * 0.5 + b2 and a softmax through opfuse's
// C++ API, checked against a plain loop. Exit code 0 when every value matches.
#include <opfuse/opfuse.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  const int64_t rows = 37, cols = 1001;
  opfuse::Program p;
  auto x = p.input("x", "f32", {"s0", std::to_string(cols)});
  auto b1 = p.input("b1", "f32", {std::to_string(cols)});
  auto b2 = p.input("b2", "f32", {"s0", std::to_string(cols)});
  auto y = p.op("add", {p.op("mul", {p.op("relu", {p.op("add", {x, b1})}), p.scalar(0.5)}), b2});
  auto s = p.op("softmax", {y}, {{"dim", int64_t{-1}}});
  p.set_outputs({y, s});
  opfuse::Compiled c = opfuse::compile(p);
  std::printf("%d kernel(s):\n%s", c.num_kernels(), c.plan().c_str());

  std::mt19937 rng(0);
  std::normal_distribution<float> dist;
  std::vector<float> xv(rows * cols), b1v(cols), b2v(rows * cols), yv(rows * cols, NAN), sv(rows * cols, NAN);
  for (auto& v : xv) v = dist(rng);
  for (auto& v : b1v) v = dist(rng);
  for (auto& v : b2v) v = dist(rng);
  c.run({{xv.data(), "f32", {rows, cols}, {cols, 1}}, {b1v.data(), "f32", {cols}, {1}}, {b2v.data(), "f32", {rows, cols}, {cols, 1}}},
        {{yv.data(), "f32", {rows, cols}, {cols, 1}}, {sv.data(), "f32", {rows, cols}, {cols, 1}}});

  double worst = 0;
  for (int64_t r = 0; r < rows; ++r) {
    double m = -INFINITY, sum = 0;
    std::vector<double> ref(cols);
    for (int64_t j = 0; j < cols; ++j) {
      ref[j] = std::max(0.0, double(xv[r * cols + j]) + b1v[j]) * 0.5 + b2v[r * cols + j];
      worst = std::max(worst, std::fabs(ref[j] - yv[r * cols + j]));
      m = std::max(m, ref[j]);
    }
    for (int64_t j = 0; j < cols; ++j) sum += std::exp(ref[j] - m);
    for (int64_t j = 0; j < cols; ++j) worst = std::max(worst, std::fabs(std::exp(ref[j] - m) / sum - sv[r * cols + j]));
  }
  std::printf("max abs error %.3g\n", worst);

  // A bad graph is a clear error, not a crash.
  try {
    opfuse::Program bad;
    auto a = bad.input("a", "f32", {"3"});
    auto b = bad.input("b", "f32", {"4"});
    bad.op("add", {a, b});
    std::printf("FAIL: no error for mismatched shapes\n");
    return 1;
  } catch (const opfuse::Error& e) {
    std::printf("invalid graph rejected: %s\n", e.what());
  }
  return (c.num_kernels() == 1 && worst < 1e-5) ? 0 : 1;
}
