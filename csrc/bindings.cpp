// pybind11 bindings of the native kernels as glm5_hal._C. Pointers cross as integers
// (tensor.data_ptr()); every kernel runs with the GIL released. glm5::InvalidInput becomes
// glm5_hal.errors.InvalidInputError.
#include <pybind11/pybind11.h>

#include "common_ops.h"
#include "dsa.h"

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


  // ---- dsa ----
  // Argument order: outputs, then each tensor as (pointer, sizes..., strides...), dtype codes
  // as glm5::DType ints, then scalars, then the thread count. Key/cache strides are in elements.
  m.def("dsa_isa", &glm5::dsa_isa, "DSA kernel tier in use: 0 portable, 1 AVX2, 2 AVX-512, 3 AVX-512 + BF16");
  m.def("dsa_max_isa", &glm5::dsa_max_isa, "best DSA kernel tier this CPU supports");
  m.def("dsa_set_isa_limit", &glm5::dsa_set_isa_limit, py::arg("limit"),
        "cap the DSA kernel tier (tests); returns the previous cap");
  m.def("indexer_logits",
        [](uintptr_t out, int64_t out_stride, uintptr_t q, int qd, int64_t tokens, int64_t heads, int64_t dim,
           uintptr_t k, int kd, int64_t rows, int64_t row_stride, uintptr_t k_scale, int64_t scale_stride,
           uintptr_t weights, uintptr_t k_start, uintptr_t k_end, int nt) {
          glm5::DsaKeys keys{ptr<const void>(k), dt(kd), rows, dim, row_stride, ptr<const float>(k_scale), scale_stride};
          glm5::indexer_logits(ptr<float>(out), out_stride, ptr<const void>(q), dt(qd), tokens, heads, dim, keys,
                               ptr<const float>(weights), ptr<const int32_t>(k_start), ptr<const int32_t>(k_end), nt);
        },
        py::call_guard<py::gil_scoped_release>());
  m.def("indexer_topk",
        [](uintptr_t out, int64_t topk, uintptr_t q, int qd, int64_t tokens, int64_t heads, int64_t dim,
           uintptr_t k, int kd, int64_t rows, int64_t row_stride, uintptr_t k_scale, int64_t scale_stride,
           uintptr_t weights, uintptr_t k_start, uintptr_t k_end, int nt) {
          glm5::DsaKeys keys{ptr<const void>(k), dt(kd), rows, dim, row_stride, ptr<const float>(k_scale), scale_stride};
          glm5::indexer_topk(ptr<int32_t>(out), topk, ptr<const void>(q), dt(qd), tokens, heads, dim, keys,
                             ptr<const float>(weights), ptr<const int32_t>(k_start), ptr<const int32_t>(k_end), nt);
        },
        py::call_guard<py::gil_scoped_release>());
  m.def("indexer_topk_paged",
        [](uintptr_t out, int64_t topk, uintptr_t q, int qd, int64_t batch, int64_t queries, int64_t heads,
           int64_t dim, uintptr_t cache, int cd, int64_t num_blocks, int64_t block_size, int64_t block_stride,
           int64_t row_stride, uintptr_t scale, int64_t scale_block_stride, int64_t scale_row_stride,
           uintptr_t weights, uintptr_t block_table, int64_t max_blocks, int64_t bt_stride, uintptr_t context_lens,
           int nt) {
          glm5::DsaPagedCache c{ptr<const void>(cache), dt(cd), num_blocks, block_size, dim, block_stride, row_stride,
                                ptr<const float>(scale), scale_block_stride, scale_row_stride};
          glm5::DsaPaging pg{ptr<const int32_t>(block_table), batch, max_blocks, bt_stride,
                             ptr<const int32_t>(context_lens)};
          glm5::indexer_topk_paged(ptr<int32_t>(out), topk, ptr<const void>(q), dt(qd), batch, queries, heads, dim, c,
                                   ptr<const float>(weights), pg, nt);
        },
        py::call_guard<py::gil_scoped_release>());
  m.def("sparse_mla_attention",
        [](uintptr_t out, uintptr_t lse, uintptr_t q, int qd, int64_t tokens, int64_t heads, int64_t dqk,
           uintptr_t kv, int64_t kv_rows, int64_t kv_row_stride, uintptr_t indices, int64_t topk, float sm_scale,
           int64_t d_v, int nt) {
          glm5::sparse_mla_attention(ptr<void>(out), ptr<float>(lse), ptr<const void>(q), dt(qd), tokens, heads, dqk,
                                     ptr<const void>(kv), kv_rows, kv_row_stride, ptr<const int32_t>(indices), topk,
                                     sm_scale, d_v, nt);
        },
        py::call_guard<py::gil_scoped_release>());
  m.def("sparse_mla_decode_paged",
        [](uintptr_t out, uintptr_t lse, uintptr_t q, int qd, int64_t batch, int64_t queries, int64_t heads,
           int64_t dqk, uintptr_t cache, int cd, int64_t num_blocks, int64_t block_size, int64_t block_stride,
           int64_t row_stride, uintptr_t block_table, int64_t max_blocks, int64_t bt_stride, uintptr_t context_lens,
           uintptr_t indices, int64_t topk, float sm_scale, int64_t d_v, int nt) {
          glm5::DsaPagedCache c{ptr<const void>(cache), dt(cd), num_blocks, block_size, dqk, block_stride, row_stride,
                                nullptr, 0, 0};
          glm5::DsaPaging pg{ptr<const int32_t>(block_table), batch, max_blocks, bt_stride,
                             ptr<const int32_t>(context_lens)};
          glm5::sparse_mla_decode_paged(ptr<void>(out), ptr<float>(lse), ptr<const void>(q), dt(qd), batch, queries,
                                        heads, dqk, c, pg, ptr<const int32_t>(indices), topk, sm_scale, d_v, nt);
        },
        py::call_guard<py::gil_scoped_release>());
  m.def("dense_mla_decode_paged",
        [](uintptr_t out, uintptr_t lse, uintptr_t q, int qd, int64_t batch, int64_t queries, int64_t heads,
           int64_t dqk, uintptr_t cache, int cd, int64_t num_blocks, int64_t block_size, int64_t block_stride,
           int64_t row_stride, uintptr_t block_table, int64_t max_blocks, int64_t bt_stride, uintptr_t context_lens,
           float sm_scale, int64_t d_v, int nt) {
          glm5::DsaPagedCache c{ptr<const void>(cache), dt(cd), num_blocks, block_size, dqk, block_stride, row_stride,
                                nullptr, 0, 0};
          glm5::DsaPaging pg{ptr<const int32_t>(block_table), batch, max_blocks, bt_stride,
                             ptr<const int32_t>(context_lens)};
          glm5::dense_mla_decode_paged(ptr<void>(out), ptr<float>(lse), ptr<const void>(q), dt(qd), batch, queries,
                                       heads, dqk, c, pg, sm_scale, d_v, nt);
        },
        py::call_guard<py::gil_scoped_release>());
  // ---- end dsa ----

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
