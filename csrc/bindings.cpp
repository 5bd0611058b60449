// pybind11 bindings of the native kernels as glm5_hal._C. Pointers cross as integers
// (tensor.data_ptr()); every kernel runs with the GIL released. glm5::InvalidInput becomes
// glm5_hal.errors.InvalidInputError.
#include <pybind11/pybind11.h>

#include "common_ops.h"

namespace py = pybind11;
using glm5::DType;

namespace {

template <typename T> T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }
// dtype codes cross as ints (glm5::DType values); the kernels reject unknown codes.
DType dt(int code) { return static_cast<DType>(code); }

void translate_invalid_input(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const glm5::InvalidInput& e) {
    py::object cls = py::module_::import("glm5_hal.errors").attr("InvalidInputError");
    py::object err = cls(e.op, e.arg, e.expected, e.actual, "cpu");
    PyErr_SetObject(cls.ptr(), err.ptr());
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "glm5_hal native CPU kernels (plain C++17 + OpenMP, no libtorch)";
  py::register_exception_translator(&translate_invalid_input);


#ifdef _OPENMP
  m.attr("has_openmp") = true;
#else
  m.attr("has_openmp") = false;
#endif

  m.def("rms_norm",
        [](uintptr_t out, uintptr_t x, uintptr_t w, int64_t rows, int64_t dim, int64_t xs,
           int64_t os, float eps, int xd, int wd, int nt) {
          glm5::rms_norm(ptr<void>(out), ptr<const void>(x), ptr<const void>(w), rows, dim, xs, os,
                         eps, dt(xd), dt(wd), nt);
        },
        py::call_guard<py::gil_scoped_release>());
}
