// pybind11 bindings of the native kernels as glm5_hal._C. Pointers cross as integers
// (tensor.data_ptr()); every kernel runs with the GIL released. glm5::InvalidInput becomes
// glm5_hal.errors.InvalidInputError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "kv.h"
#include "moe.h"
#include "qgemm.h"
#include "quant.h"
#include "vec.h"
#include "common_ops.h"
#include "dsa.h"
#include "value_checks.h"

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

  // Argument order of the kernels below: outputs, then inputs as (pointer, sizes..., strides...)
  // with strides in elements unless named *_bytes, dtype codes as glm5::DType ints, scalars,
  // and the thread count last.

  // ---- common ----
  m.def("vec_isa", &glm5::vec::isa, "row-kernel tier in use: 0 portable, 1 AVX2, 2 AVX-512");
  m.def("vec_max_isa", &glm5::vec::max_isa, "best row-kernel tier this CPU supports");
  m.def("vec_set_isa_limit", &glm5::vec::set_isa_limit, py::arg("limit"),
        "cap the row-kernel tier (tests); returns the previous cap");
  m.def("rms_norm",
        [](uintptr_t out, uintptr_t x, uintptr_t w, int64_t rows, int64_t dim, int64_t xs,
           int64_t os, float eps, int xd, int wd, int nt) {
          glm5::rms_norm(ptr<void>(out), ptr<const void>(x), ptr<const void>(w), rows, dim, xs, os,
                         eps, dt(xd), dt(wd), nt);
        },
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul",
        [](uintptr_t out, uintptr_t x, int64_t rows, int64_t n, int64_t xs, int64_t os, int d, int nt) {
          glm5::silu_and_mul(ptr<void>(out), ptr<const void>(x), rows, n, xs, os, dt(d), nt);
        },
        py::call_guard<py::gil_scoped_release>());
  m.def("apply_rope",
        [](uintptr_t out, uintptr_t x, uintptr_t pos, int pd, int64_t tokens, int64_t heads, int64_t rot,
           int64_t xts, int64_t xhs, int64_t ots, int64_t ohs, double theta, bool interleaved, int d, int nt) {
          glm5::apply_rope(ptr<void>(out), ptr<const void>(x), ptr<const void>(pos), dt(pd), tokens, heads, rot,
                           xts, xhs, ots, ohs, theta, interleaved, dt(d), nt);
        },
        py::call_guard<py::gil_scoped_release>());
  m.def("hadamard_transform",
        [](uintptr_t out, uintptr_t x, int64_t rows, int64_t dim, int64_t xs, int64_t os, float scale, int d,
           int nt) {
          glm5::hadamard_transform(ptr<void>(out), ptr<const void>(x), rows, dim, xs, os, scale, dt(d), nt);
        },
        py::call_guard<py::gil_scoped_release>());
  // ---- end common ----

  // ---- moe ----
  m.def("moe_permute_plan",
        [](uintptr_t tokens_per_expert, uintptr_t src, uintptr_t ids, int64_t tokens, int64_t k,
           int64_t ids_row_stride, int64_t num_experts) {
          return glm5::moe_permute_plan(ptr<int32_t>(tokens_per_expert), ptr<int32_t>(src),
                                        ptr<const int32_t>(ids), tokens, k, ids_row_stride, num_experts);
        },
        py::call_guard<py::gil_scoped_release>(), "returns M, the number of valid entries");
  m.def("moe_permute_gather",
        [](uintptr_t x_perm, uintptr_t x, int64_t tokens, int64_t row_bytes, int64_t x_row_stride_bytes,
           uintptr_t src, int64_t rows, int64_t k, int nt) {
          glm5::moe_permute_gather(ptr<void>(x_perm), ptr<const void>(x), tokens, row_bytes, x_row_stride_bytes,
                                   ptr<const int32_t>(src), rows, k, nt);
        },
        py::call_guard<py::gil_scoped_release>());
  m.def("moe_unpermute",
        [](uintptr_t out, uintptr_t y, int64_t rows, int64_t dim, int64_t ys, uintptr_t src, uintptr_t weights,
           int64_t tokens, int64_t k, int d, int nt) {
          glm5::moe_unpermute(ptr<void>(out), ptr<const void>(y), rows, dim, ys, ptr<const int32_t>(src),
                              ptr<const float>(weights), tokens, k, dt(d), nt);
        },
        py::call_guard<py::gil_scoped_release>());
  m.def("moe_route",
        [](uintptr_t weights, uintptr_t ids, uintptr_t logits, int ld, int64_t tokens, int64_t experts, int64_t ls,
           uintptr_t bias, int bd, int64_t top_k, int64_t n_group, int64_t topk_group, float scale, bool norm,
           bool softmax, int nt) {
          glm5::moe_route(ptr<float>(weights), ptr<int32_t>(ids), ptr<const void>(logits), dt(ld), tokens, experts, ls,
                          ptr<const void>(bias), dt(bd), top_k, n_group, topk_group, scale, norm, softmax, nt);
        },
        py::call_guard<py::gil_scoped_release>(), "bias = 0: no bias");
  // ---- end moe ----

  // ---- kv ----
  m.def("kv_cache_write",
        [](uintptr_t cache, int64_t num_slots, int64_t row_bytes, uintptr_t values, int64_t values_row_stride_bytes,
           int64_t tokens, uintptr_t slots, int sd, int nt) {
          glm5::kv_cache_write(ptr<void>(cache), num_slots, row_bytes, ptr<const void>(values),
                               values_row_stride_bytes, tokens, ptr<const void>(slots), dt(sd), nt);
        },
        py::call_guard<py::gil_scoped_release>());
  m.def("indexer_k_cache_write",
        [](uintptr_t k, int64_t tokens, int64_t dim, int64_t ks, int kd, uintptr_t k_cache, uintptr_t k_scale,
           int64_t num_slots, uintptr_t slots, int sd, bool ue8m0, int nt) {
          glm5::indexer_k_cache_write(ptr<const void>(k), tokens, dim, ks, dt(kd), ptr<uint8_t>(k_cache),
                                      ptr<float>(k_scale), num_slots, ptr<const void>(slots), dt(sd), ue8m0, nt);
        },
        py::call_guard<py::gil_scoped_release>());
  m.def("kv_cache_gather_rows",
        [](uintptr_t context_lens, int64_t batch, int64_t max_blocks, int64_t block_size) {
          return glm5::kv_cache_gather_rows(ptr<const int32_t>(context_lens), batch, max_blocks, block_size);
        },
        py::call_guard<py::gil_scoped_release>(), "validates context_lens and returns their sum");
  m.def("kv_cache_gather",
        [](uintptr_t out, int64_t out_rows, uintptr_t cache, int64_t num_blocks, int64_t block_size,
           int64_t row_bytes, uintptr_t block_table, int64_t batch, int64_t max_blocks, int64_t bt_stride,
           uintptr_t context_lens, int nt) {
          glm5::kv_cache_gather(ptr<void>(out), out_rows, ptr<const void>(cache), num_blocks, block_size, row_bytes,
                                ptr<const int32_t>(block_table), batch, max_blocks, bt_stride,
                                ptr<const int32_t>(context_lens), nt);
        },
        py::call_guard<py::gil_scoped_release>());
  // ---- end kv ----

  // ---- quant ----
  m.def("fp8_block_quant",
        [](uintptr_t q, uintptr_t scale, uintptr_t x, int64_t rows, int64_t cols, int64_t xs, int64_t block,
           bool ue8m0, int d, int nt) {
          glm5::fp8_block_quant(ptr<uint8_t>(q), ptr<float>(scale), ptr<const void>(x), rows, cols, xs, block, ue8m0,
                                dt(d), nt);
        },
        py::call_guard<py::gil_scoped_release>());
  m.def("int4_quantize",
        [](uintptr_t fake, uintptr_t packed, uintptr_t scale, uintptr_t w, int64_t rows, int64_t cols, int64_t ws,
           int64_t group, int d, int nt) {
          glm5::int4_quantize(ptr<void>(fake), ptr<int32_t>(packed), ptr<float>(scale), ptr<const void>(w), rows, cols,
                              ws, group, dt(d), nt);
        },
        py::call_guard<py::gil_scoped_release>(), "int4_fake_quant (fake != 0) and/or int4_pack (packed, scale)");
  m.def("int4_unpack",
        [](uintptr_t out, uintptr_t packed, uintptr_t scale, int64_t rows, int64_t words, int64_t ps, int64_t group,
           int nt) {
          glm5::int4_unpack(ptr<float>(out), ptr<const int32_t>(packed), ptr<const float>(scale), rows, words, ps, group,
                            nt);
        },
        py::call_guard<py::gil_scoped_release>());
  // ---- end quant ----

  // ---- quantized and grouped GEMMs (qgemm.h), int8_quant ----
  // Each matrix crosses as (pointer, dtype code, sizes..., strides in elements..., scale pointer):
  // the output as (out, out dtype, out row stride); the activations as (a, rows M, K, row stride,
  // scale); the weights as (w, experts E, N, expert stride, row stride, scale) with K the
  // activations'; tokens_per_expert as a pointer to E int32 counts (validated natively).
  m.def("qgemm_float_isa", &glm5::qgemm_float_isa, "float-path GEMM tile tier: 0 portable .. 4 AMX");
  m.def("qgemm_int8_isa", &glm5::qgemm_int8_isa, "int8-path GEMM tile tier: 0 portable .. 4 AMX");
  m.def("qgemm_max_isa", &glm5::qgemm_max_isa, "best GEMM tile tier this CPU supports");
  m.def("qgemm_set_isa_limit", &glm5::qgemm_set_isa_limit, py::arg("limit"),
        "cap the GEMM tile tier (tests); returns the previous cap");
  m.def("int8_quant",
        [](uintptr_t q, uintptr_t scale, uintptr_t x, int64_t rows, int64_t cols, int64_t xs, int d, int nt) {
          glm5::int8_quant(ptr<int8_t>(q), ptr<float>(scale), ptr<const void>(x), rows, cols, xs, dt(d), nt);
        },
        py::call_guard<py::gil_scoped_release>());
  auto operand = [](uintptr_t a, DType ad, int64_t m, int64_t k, int64_t as, uintptr_t a_scale) {
    return glm5::GemmOperand{ptr<const void>(a), ad, m, k, as, ptr<const float>(a_scale)};
  };
  auto weights = [](uintptr_t w, DType wd, int64_t e, int64_t n, int64_t k, int64_t wes, int64_t ws,
                    uintptr_t w_scale) {
    return glm5::GemmWeights{ptr<const void>(w), wd, e, n, k, wes, ws, ptr<const float>(w_scale)};
  };
  m.def("fp8_block_gemm",
        [operand, weights](uintptr_t out, int od, int64_t os, uintptr_t a, int64_t m, int64_t k, int64_t as,
                           uintptr_t a_scale, uintptr_t w, int64_t n, int64_t ws, uintptr_t w_scale, int nt) {
          glm5::fp8_block_gemm({ptr<void>(out), dt(od), os}, operand(a, DType::F8E4M3, m, k, as, a_scale),
                               weights(w, DType::F8E4M3, 1, n, k, 0, ws, w_scale), nt);
        },
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_gemm",
        [operand, weights](uintptr_t out, int od, int64_t os, uintptr_t x, int64_t m, int64_t k, int64_t xs,
                           uintptr_t x_scale, uintptr_t w, int64_t n, int64_t ws, uintptr_t w_scale, uintptr_t bias,
                           int nt) {
          glm5::int8_gemm({ptr<void>(out), dt(od), os}, operand(x, DType::I8, m, k, xs, x_scale),
                          weights(w, DType::I8, 1, n, k, 0, ws, w_scale), ptr<const float>(bias), nt);
        },
        py::call_guard<py::gil_scoped_release>(), "bias = 0: no bias");
  // The grouped GEMMs: kind 0 = FP8 (fp8_grouped_gemm), 1 = INT8 (int8_grouped_gemm), 2 = bfloat16
  // (grouped_gemm, no scales).
  m.def("grouped_gemm",
        [operand, weights](int kind, uintptr_t out, int od, int64_t os, uintptr_t a, int64_t m, int64_t k,
                           int64_t as, uintptr_t a_scale, uintptr_t w, int64_t e, int64_t n, int64_t wes, int64_t ws,
                           uintptr_t w_scale, uintptr_t tokens_per_expert, int nt) {
          const DType d = kind == 0 ? DType::F8E4M3 : kind == 1 ? DType::I8 : DType::BF16;
          const glm5::GemmOutput o{ptr<void>(out), dt(od), os};
          const glm5::GemmOperand ao = operand(a, d, m, k, as, a_scale);
          const glm5::GemmWeights wo = weights(w, d, e, n, k, wes, ws, w_scale);
          const int32_t* counts = ptr<const int32_t>(tokens_per_expert);
          if (kind == 0) glm5::fp8_grouped_gemm(o, ao, wo, counts, nt);
          else if (kind == 1) glm5::int8_grouped_gemm(o, ao, wo, counts, nt);
          else glm5::bf16_grouped_gemm(o, ao, wo, counts, nt);
        },
        py::call_guard<py::gil_scoped_release>());
  // ---- end quantized and grouped GEMMs ----

  // ---- value checks (glm5_hal.checks): host memory, GIL held (they take well under a microsecond) ----
  m.def("first_outside",
        [](uintptr_t data, int64_t n, int d, int64_t lo, int64_t hi, bool has_allowed, int64_t allowed) {
          return glm5::first_outside(ptr<const void>(data), n, dt(d), lo, hi, has_allowed, allowed);
        });
  m.def("smallest_repeat", [](uintptr_t data, int64_t n, int d) {
    return glm5::smallest_repeat(ptr<const void>(data), n, dt(d));
  });
  m.def("sum_of", [](uintptr_t data, int64_t n, int d) { return glm5::sum_of(ptr<const void>(data), n, dt(d)); });
  m.def("first_bad_block",
        [](uintptr_t table, int64_t batch, int64_t max_blocks, int64_t row_stride, uintptr_t lens, int64_t block_size,
           int64_t num_blocks) {
          return glm5::first_bad_block(ptr<const int32_t>(table), batch, max_blocks, row_stride,
                                       ptr<const int32_t>(lens), block_size, num_blocks);
        });
  m.def("first_bad_range", [](uintptr_t start, uintptr_t end, int64_t n, int64_t num_keys) {
    return glm5::first_bad_range(ptr<const int32_t>(start), ptr<const int32_t>(end), n, num_keys);
  });
  // ---- end value checks ----
}
