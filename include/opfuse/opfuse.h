// opfuse's C++ API: build a tensor graph, compile it for the CPU (fused
// kernels, generated C++, host compiler, disk cache), run it on raw pointers.
//
//   opfuse::Program p;
//   auto x = p.input("x", "f32", {"s0", "1024"});
//   auto b = p.input("b", "f32", {"1024"});
//   auto y = p.op("relu", {p.op("add", {x, b})});
//   p.set_outputs({y});
//   opfuse::Compiled c = opfuse::compile(p);
//   c.run({{x_ptr, "f32", {n, 1024}, {1024, 1}}, ...}, {{y_ptr, "f32", {n, 1024}, {1024, 1}}});
//
// Errors (an invalid graph, wrong inputs at run time) throw opfuse::Error
// with a message naming the node and the problem.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

namespace opfuse {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A value in a Program (a node id).
struct Value {
  int id = -1;
};

// Attribute values; "dtype" attributes are dtype names ("f32", "bf16", ...).
// Shapes and bounds: integers, or strings that may name size symbols
// ({"s0*4", "-1"} for a reshape; {"s0 - 1"} for a slice's end).
using Attribute = std::variant<int64_t, double, bool, std::string, std::vector<int64_t>, std::vector<std::string>>;
using Attributes = std::map<std::string, Attribute>;

class Program {
 public:
  Program();
  ~Program();
  Program(Program&&) noexcept;
  Program& operator=(Program&&) noexcept;

  // dtype: b8 i32 i64 f16 bf16 f32 f64; shape: sizes or symbols ("s0").
  Value input(const std::string& name, const std::string& dtype, const std::vector<std::string>& shape);
  Value scalar(double value, const std::string& dtype = "f32");
  Value op(const std::string& name, const std::vector<Value>& inputs, const Attributes& attrs = {});
  void set_outputs(const std::vector<Value>& outputs);
  std::string text() const;  // the canonical IR text

  struct Impl;
  std::unique_ptr<Impl> impl;
};

// A tensor in memory: element strides, any storage layout.
struct TensorRef {
  void* data = nullptr;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
};

class Compiled {
 public:
  Compiled();
  ~Compiled();
  Compiled(Compiled&&) noexcept;
  Compiled& operator=(Compiled&&) noexcept;

  int num_kernels() const;
  std::string plan() const;  // the fusion plan, one kernel a line
  // Shapes of the outputs for these input shapes.
  std::vector<std::vector<int64_t>> output_shapes(const std::vector<std::vector<int64_t>>& input_shapes) const;
  // Runs all kernels; outputs must be contiguous (row-major strides) with
  // the shapes above, and may not overlap the inputs. An output that is a
  // graph input is copied from it.
  void run(const std::vector<TensorRef>& inputs, const std::vector<TensorRef>& outputs);

  struct Impl;
  std::unique_ptr<Impl> impl;
};

Compiled compile(const Program& program);

}  // namespace opfuse
