// IR texts that more than one C++ test file plans or lowers.
#pragma once

namespace opfuse::testgraphs {

// The seed's chain: y = relu(x + b1) * 0.5 + b2.
inline constexpr const char* kChain = R"(graph {
  %0 = input() {name="x"} : f32[s0, 37]
  %1 = input() {name="b1"} : f32[37]
  %2 = input() {name="b2"} : f32[37]
  %3 = add(%0, %1) : f32[s0, 37]
  %4 = relu(%3) : f32[s0, 37]
  %5 = scalar() {value=0.5, weak=true} : f64[]
  %6 = mul(%4, %5) : f32[s0, 37]
  %7 = add(%6, %2) : f32[s0, 37]
  return (%7)
})";

inline constexpr const char* kSoftmax = R"(graph {
  %0 = input() {name="x"} : f32[s0, 37]
  %1 = softmax(%0) {dim=-1} : f32[s0, 37]
  return (%1)
})";

}  // namespace opfuse::testgraphs
