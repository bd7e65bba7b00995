// Bindings of the decode MLP kernel (runtime/decode_mlp_launcher.h): a
// direct launch for tests and the benchmark, its NVRTC build for CI, debug
// queries and the float64 CPU reference. Tensors cross as raw pointers
// (integers) with element strides; python/opfuse/decode_mlp.py wraps them.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/decode_mlp/decode_mlp_reference.h"
#include "runtime/compiled_graph.h"
#include "runtime/decode_mlp_launcher.h"
#include "runtime/small_m_launch.h"

namespace nb = nanobind;
using namespace opfuse;

namespace {

DType parse_elem(const std::string& name) { return small_m_parse_elem(name, "decode MLP"); }

// The block's element type, sizes and operands from the integers both entry
// points take: decode_mlp::Args (device pointers) or ReferenceArgs (float64).
template <class A>
void set_block(A& a, const std::string& dtype, int64_t m, int64_t k, int64_t h, int64_t n, uintptr_t x, int64_t ldx,
               uintptr_t w1, int64_t ldw1, uintptr_t w3, int64_t ldw3, uintptr_t b1, int64_t b1_stride, uintptr_t w2,
               int64_t ldw2, uintptr_t b2, int64_t b2_stride) {
  a.dtype = parse_elem(dtype);
  a.m = m, a.k = k, a.h = h, a.n = n;
  a.x = reinterpret_cast<decltype(a.x)>(x), a.ldx = ldx;
  a.w1 = reinterpret_cast<decltype(a.w1)>(w1), a.ldw1 = ldw1;
  a.w3 = reinterpret_cast<decltype(a.w3)>(w3), a.ldw3 = ldw3;
  a.b1 = reinterpret_cast<decltype(a.b1)>(b1), a.b1_stride = b1_stride;
  a.w2 = reinterpret_cast<decltype(a.w2)>(w2), a.ldw2 = ldw2;
  a.b2 = reinterpret_cast<decltype(a.b2)>(b2), a.b2_stride = b2_stride;
}

}  // namespace

void bind_decode_mlp(nb::module_& m) {
  m.def(
      "decode_mlp",
      [](const std::string& dtype, int64_t m_, int64_t k, int64_t h, int64_t n, uintptr_t x, int64_t ldx, uintptr_t w1,
         int64_t ldw1, uintptr_t w3, int64_t ldw3, uintptr_t b1, int64_t b1_stride, uintptr_t w2, int64_t ldw2,
         uintptr_t b2, int64_t b2_stride, uintptr_t out, int64_t ldo, const std::string& activation, uintptr_t stream, uintptr_t workspace,
         size_t workspace_bytes) {
        decode_mlp::Args a;
        set_block(a, dtype, m_, k, h, n, x, ldx, w1, ldw1, w3, ldw3, b1, b1_stride, w2, ldw2, b2, b2_stride);
        a.out = reinterpret_cast<void*>(out), a.ldo = ldo;
        a.activation = activation;
        a.stream = reinterpret_cast<void*>(stream);
        a.workspace = reinterpret_cast<void*>(workspace);
        a.workspace_bytes = workspace_bytes;
        std::string why;
        bool ok;
        {
          nb::gil_scoped_release release;
          ok = decode_mlp::try_run(a, &why);
        }
        return nb::make_tuple(ok, why);
      },
      nb::arg("dtype"), nb::arg("m"), nb::arg("k"), nb::arg("h"), nb::arg("n"), nb::arg("x"), nb::arg("ldx"),
      nb::arg("w1"), nb::arg("ldw1"), nb::arg("w3"), nb::arg("ldw3"), nb::arg("b1"), nb::arg("b1_stride"),
      nb::arg("w2"), nb::arg("ldw2"), nb::arg("b2"), nb::arg("b2_stride"), nb::arg("out"), nb::arg("ldo"),
      nb::arg("activation"), nb::arg("stream"), nb::arg("workspace"), nb::arg("workspace_bytes"),
      "Enqueues the whole MLP block with the decode MLP kernel: (True, '') or (False, why) with nothing enqueued.");
  m.def(
      "decode_mlp_compile",
      [](const std::string& dtype, bool gated, const std::string& config, int arch, bool use_cache) {
        decode_mlp::Compiled c;
        {
          nb::gil_scoped_release release;  // builds may run in parallel threads
          c = decode_mlp::compile(parse_elem(dtype), gated, decode_mlp::Config::parse(config), arch, use_cache);
        }
        return nb::make_tuple(nb::bytes(c.cubin.data(), c.cubin.size()), c.log);
      },
      nb::arg("dtype"), nb::arg("gated"), nb::arg("config"), nb::arg("arch"), nb::arg("use_cache") = false,
      "NVRTC build of one instantiation (through the disk cache with use_cache): (cubin, log).");
  m.def("decode_mlp_candidates", [] {
    std::vector<std::string> r;
    for (auto& c : decode_mlp::candidate_configs()) r.push_back(c.tag());
    return r;
  });
  m.def("decode_mlp_smem_bytes", [](const std::string& config) { return decode_mlp::smem_bytes(decode_mlp::Config::parse(config)); });
  m.def("zeroed_workspace_bytes", [] { return kZeroedWorkspaceBytes; });
  m.def("decode_mlp_launch_count", [] { return decode_mlp::launch_count(); });
  m.def("decode_mlp_last_error", [] { return decode_mlp::last_error(); });
  m.def(
      "decode_mlp_reference",
      [](const std::string& dtype, int64_t m_, int64_t k, int64_t h, int64_t n, uintptr_t x, int64_t ldx, uintptr_t w1,
         int64_t ldw1, uintptr_t w3, int64_t ldw3, uintptr_t b1, int64_t b1_stride, uintptr_t w2, int64_t ldw2,
         uintptr_t b2, int64_t b2_stride, uintptr_t out, uintptr_t hidden, const std::string& activation) {
        kernels::decode_mlp::ReferenceArgs r;
        set_block(r, dtype, m_, k, h, n, x, ldx, w1, ldw1, w3, ldw3, b1, b1_stride, w2, ldw2, b2, b2_stride);
        r.out = reinterpret_cast<double*>(out);
        r.hidden = reinterpret_cast<double*>(hidden);
        r.activation = activation;
        nb::gil_scoped_release release;
        kernels::decode_mlp::decode_mlp_reference(r);
      },
      nb::arg("dtype"), nb::arg("m"), nb::arg("k"), nb::arg("h"), nb::arg("n"), nb::arg("x"), nb::arg("ldx"),
      nb::arg("w1"), nb::arg("ldw1"), nb::arg("w3"), nb::arg("ldw3"), nb::arg("b1"), nb::arg("b1_stride"),
      nb::arg("w2"), nb::arg("ldw2"), nb::arg("b2"), nb::arg("b2_stride"), nb::arg("out"), nb::arg("hidden"),
      nb::arg("activation"), "decode_mlp_reference.h on float64 CPU tensors (pointers).");
}
