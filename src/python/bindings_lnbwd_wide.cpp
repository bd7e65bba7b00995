// Bindings of the wide-row layer_norm backward
// (runtime/layer_norm_backward_wide_launcher.h): the launch the custom op
// python/opfuse/ops/layer_norm_wide.py makes, its NVRTC build for CI, its
// debug queries, and the float64 CPU reference. Tensors cross as raw
// pointers (integers) with element row strides.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/layer_norm_backward/layer_norm_backward_reference.h"
#include "runtime/layer_norm_backward_wide_launcher.h"

namespace nb = nanobind;
using namespace opfuse;

namespace {

DType parse_elem(const std::string& name) {
  if (name == "bf16") return DType::BFloat16;
  if (name == "f16") return DType::Float16;
  if (name == "f32") return DType::Float32;
  throw std::invalid_argument("layer_norm backward (wide rows): dtype must be bf16, f16 or f32, not " + name);
}

template <class T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

}  // namespace

void bind_lnbwd_wide(nb::module_& m) {
  m.def(
      "lnbwd_wide_parts", [](const std::string& dtype, int64_t rows, int64_t n) {
        return lnbwd_wide::parts(parse_elem(dtype), rows, n);
      },
      nb::arg("dtype"), nb::arg("rows"), nb::arg("n"),
      "Parts (resident clusters) of the wide-row layer_norm backward here, loading its kernel; 0 when it cannot run "
      "(off, older than sm_90, or its build failed: lnbwd_wide_last_error()). The workspace is 2 * parts * n floats.");
  m.def(
      "lnbwd_wide_run",
      [](const std::string& dtype, int64_t rows, int64_t n, uintptr_t dy, int64_t ld_dy, uintptr_t x, int64_t ld_x,
         uintptr_t mean, uintptr_t rstd, uintptr_t w, uintptr_t dx, int64_t ld_dx, uintptr_t dw, uintptr_t db,
         uintptr_t workspace, int64_t workspace_floats, uintptr_t stream) {
        lnbwd_wide::Args a;
        a.dtype = parse_elem(dtype);
        a.rows = rows, a.n = n;
        a.dy = ptr<const void>(dy), a.ld_dy = ld_dy, a.x = ptr<const void>(x), a.ld_x = ld_x;
        a.mean = ptr<const float>(mean), a.rstd = ptr<const float>(rstd), a.w = ptr<const void>(w);
        a.dx = ptr<void>(dx), a.ld_dx = ld_dx, a.dw = ptr<void>(dw), a.db = ptr<void>(db);
        a.workspace = ptr<float>(workspace), a.workspace_floats = workspace_floats;
        a.stream = ptr<void>(stream);
        nb::gil_scoped_release release;
        lnbwd_wide::run(a);
      },
      nb::arg("dtype"), nb::arg("rows"), nb::arg("n"), nb::arg("dy"), nb::arg("ld_dy"), nb::arg("x"), nb::arg("ld_x"),
      nb::arg("mean"), nb::arg("rstd"), nb::arg("w"), nb::arg("dx"), nb::arg("ld_dx"), nb::arg("dw"), nb::arg("db"),
      nb::arg("workspace"), nb::arg("workspace_floats"), nb::arg("stream"),
      "Enqueues dx, dw and db (any of them 0: not asked) on the stream; throws on a problem it does not take.");
  m.def(
      "lnbwd_wide_unsupported_reason",
      [](const std::string& dtype, int64_t rows, int64_t n, int64_t ld_dy, int64_t ld_x, int64_t ld_dx, bool dx,
         bool dw, bool db, bool has_w, int64_t align) {
        // Pointers stand in by their alignment (align: the worst of the tensors').
        lnbwd_wide::Args a;
        a.dtype = parse_elem(dtype);
        a.rows = rows, a.n = n;
        const uintptr_t p = static_cast<uintptr_t>(align > 0 ? align : 16);
        a.dy = ptr<const void>(p), a.x = ptr<const void>(p), a.mean = ptr<const float>(16), a.rstd = ptr<const float>(16);
        a.w = has_w ? ptr<const void>(p) : nullptr;
        a.dx = dx ? ptr<void>(p) : nullptr;
        a.dw = dw ? ptr<void>(16) : nullptr, a.db = db ? ptr<void>(16) : nullptr;
        a.ld_dy = ld_dy, a.ld_x = ld_x, a.ld_dx = ld_dx;
        return lnbwd_wide::unsupported_reason(a);
      },
      nb::arg("dtype"), nb::arg("rows"), nb::arg("n"), nb::arg("ld_dy"), nb::arg("ld_x"), nb::arg("ld_dx"),
      nb::arg("dx"), nb::arg("dw"), nb::arg("db"), nb::arg("has_w"), nb::arg("align"));
  m.def(
      "lnbwd_wide_compile",
      [](const std::string& dtype, const std::string& config, int arch) {
        CachedCubin c = lnbwd_wide::compile(parse_elem(dtype), lnbwd_wide::Config::parse(config), arch, false);
        return nb::make_tuple(nb::bytes(c.cubin.data(), c.cubin.size()), c.log);
      },
      nb::arg("dtype"), nb::arg("config"), nb::arg("arch"), "NVRTC build of one instantiation (no cache): (cubin, log).");
  m.def("lnbwd_wide_candidates", [](const std::string& dtype) {
    std::vector<std::string> r;
    for (auto& c : lnbwd_wide::candidate_configs(parse_elem(dtype))) r.push_back(c.tag());
    return r;
  });
  m.def("lnbwd_wide_choose_config", [](const std::string& dtype, int64_t n) {
    lnbwd_wide::Config c = lnbwd_wide::choose_config(parse_elem(dtype), n);
    return c.cluster == 0 ? std::string() : c.tag();
  });
  m.def("lnbwd_wide_source", [](const std::string& dtype, const std::string& config) {
    return lnbwd_wide::source(parse_elem(dtype), lnbwd_wide::Config::parse(config));
  });
  m.def("lnbwd_wide_launch_count", [] { return lnbwd_wide::launch_count(); });
  m.def("lnbwd_wide_last_error", [] { return lnbwd_wide::last_error(); });
  m.def(
      "lnbwd_wide_reference",
      [](int64_t rows, int64_t n, uintptr_t dy, int64_t ld_dy, uintptr_t x, int64_t ld_x, uintptr_t mean,
         uintptr_t rstd, uintptr_t w, uintptr_t dx, uintptr_t dw, uintptr_t db) {
        kernels::layer_norm_backward::ReferenceArgs r;
        r.rows = rows, r.n = n;
        r.dy = ptr<const double>(dy), r.ld_dy = ld_dy, r.x = ptr<const double>(x), r.ld_x = ld_x;
        r.mean = ptr<const double>(mean), r.rstd = ptr<const double>(rstd), r.w = ptr<const double>(w);
        r.dx = ptr<double>(dx), r.dw = ptr<double>(dw), r.db = ptr<double>(db);
        nb::gil_scoped_release release;
        kernels::layer_norm_backward::layer_norm_backward_reference(r);
      },
      nb::arg("rows"), nb::arg("n"), nb::arg("dy"), nb::arg("ld_dy"), nb::arg("x"), nb::arg("ld_x"), nb::arg("mean"),
      nb::arg("rstd"), nb::arg("w"), nb::arg("dx"), nb::arg("dw"), nb::arg("db"),
      "layer_norm_backward_reference.h on float64 CPU tensors (pointers; w, dx, dw, db may be 0).");
}
