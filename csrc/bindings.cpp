// pybind11 bindings of the native kernels as glm5_hal._C. A kernel's tensor arguments cross as
// the torch tensors themselves: each becomes a glm5::View (csrc/view.h) read through the
// tensor's Python API (data_ptr(), dtype, shape, stride()), so the kernels stay free of
// libtorch and no caller restates sizes, strides or dtypes. An input tensor without the layout
// its parameter type declares (In<Layout>) is copied here (tensor.contiguous()), so no Python
// wrapper restates layout rules either. A glm5_hal._C.View built by keyword is accepted wherever
// a tensor is, as is, never copied (memory no tensor describes; the tests' bad geometries).
// Scalars cross as themselves. Every kernel runs with the GIL released; glm5::InvalidInput
// becomes glm5_hal.errors.InvalidInputError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <tuple>
#include <utility>
#include <vector>

#include "kv.h"
#include "moe.h"
#include "qgemm.h"
#include "roofline.h"
#include "quant.h"
#include "vec.h"
#include "common_ops.h"
#include "dsa.h"
#include "bindings_tensors.h"
#include "view.h"

namespace py = pybind11;
using glm5::DType;
using glm5::View;

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

// ---- torch.Tensor -> View ---------------------------------------------------------------------
// Module-lifetime references, set once at import: attribute names, the View type, and the torch
// dtypes with their glm5::DType codes.
struct TorchNames {
  PyObject *data_ptr, *dtype, *shape, *stride, *contiguous;
  PyObject *empty, *dtype_kwname;  // torch.empty, ("dtype",)
  PyTypeObject* view_type;
  std::array<std::pair<PyObject*, DType>, 7> dtypes;
};
TorchNames g;

// torch.Tensor's C accessors, called directly for exact torch.Tensor instances: a conversion
// then skips four attribute lookups (~90 of its ~450 ns, measured). Set at import only if each
// resolves to a C descriptor of the calling convention used here; otherwise left null, and every
// tensor takes the generic calls (as do subclasses, which may override them).
struct Accessors {
  PyTypeObject* tensor = nullptr;
  PyCFunction data_ptr = nullptr;
  PyCFunctionWithKeywords stride = nullptr;
  PyGetSetDef *shape = nullptr, *dtype = nullptr;
  PyObject* no_args = nullptr;
};
Accessors fast;

void init_accessors(PyObject* tensor_type) {
  auto method = [&](const char* name, int flags) { return glm5_bindings::c_method(tensor_type, name, flags); };
  auto getset = [&](const char* name) { return glm5_bindings::c_getset(tensor_type, name); };
  PyMethodDef* data_ptr = method("data_ptr", METH_NOARGS);
  PyMethodDef* stride = method("stride", METH_VARARGS | METH_KEYWORDS);
  PyGetSetDef* shape = getset("shape");
  PyGetSetDef* dtype = getset("dtype");
  if (!data_ptr || !stride || !shape || !dtype) return;
  fast = Accessors{reinterpret_cast<PyTypeObject*>(tensor_type), data_ptr->ml_meth,
                   reinterpret_cast<PyCFunctionWithKeywords>(reinterpret_cast<void (*)(void)>(stride->ml_meth)),
                   shape, dtype, PyTuple_New(0)};
}

void init_torch_names(const py::module_& m) {
  g.data_ptr = PyUnicode_InternFromString("data_ptr");
  g.dtype = PyUnicode_InternFromString("dtype");
  g.shape = PyUnicode_InternFromString("shape");
  g.stride = PyUnicode_InternFromString("stride");
  g.contiguous = PyUnicode_InternFromString("contiguous");
  g.view_type = reinterpret_cast<PyTypeObject*>(m.attr("View").ptr());
  py::module_ torch = py::module_::import("torch");
  g.empty = py::object(torch.attr("empty")).release().ptr();
  g.dtype_kwname = py::make_tuple("dtype").release().ptr();
  const std::pair<const char*, DType> names[] = {{"float32", DType::F32}, {"float16", DType::F16},
                                                 {"bfloat16", DType::BF16}, {"float8_e4m3fn", DType::F8E4M3},
                                                 {"int32", DType::I32}, {"int64", DType::I64},
                                                 {"int8", DType::I8}};
  for (size_t i = 0; i < g.dtypes.size(); ++i)
    g.dtypes[i] = {py::object(torch.attr(names[i].first)).release().ptr(), names[i].second};
  init_accessors(torch.attr("Tensor").ptr());
}

[[noreturn]] void not_a_tensor(py::handle h, const char* op, const char* arg) {
  PyErr_Clear();
  throw glm5::InvalidInput(op, arg, "a torch.Tensor or a glm5_hal._C.View", Py_TYPE(h.ptr())->tp_name);
}

// Merges leading dims of a tensor of more than kMaxDims dims where the layout allows; false if
// it does not.
bool fit_dims(View& v, const int64_t* size, const int64_t* stride, int ndim) {
  int extra = ndim - glm5::kMaxDims;
  int64_t merged = size[0], merged_stride = stride[0];
  int d = 1;
  for (; extra > 0; --extra, ++d) {
    if (size[d] != 1 && merged != 1 && merged_stride != stride[d] * size[d]) return false;
    merged_stride = merged == 1 ? stride[d] : (size[d] == 1 ? merged_stride : stride[d]);
    merged *= size[d];
  }
  v.ndim = glm5::kMaxDims;
  v.size[0] = merged;
  v.stride[0] = merged_stride;
  for (int i = 1; i < glm5::kMaxDims; ++i, ++d) {
    v.size[i] = size[d];
    v.stride[i] = stride[d];
  }
  return true;
}

bool is_view_object(py::handle h) { return Py_TYPE(h.ptr()) == g.view_type; }

// The View of tensor `h` (a _C.View: itself); false if its dims do not fit in kMaxDims.
bool read_view(py::handle h, const char* op, const char* arg, View& v) {
  if (is_view_object(h)) {
    v = h.cast<View>();
    return true;
  }
  PyObject* t = h.ptr();
  const bool direct = Py_TYPE(t) == fast.tensor;
  auto steal = [](PyObject* o) { return py::reinterpret_steal<py::object>(o); };
  py::object p = steal(direct ? fast.data_ptr(t, nullptr) : PyObject_CallMethodNoArgs(t, g.data_ptr));
  if (!p) not_a_tensor(h, op, arg);
  v.data = PyLong_AsVoidPtr(p.ptr());
  py::object dtype = steal(direct ? fast.dtype->get(t, fast.dtype->closure) : PyObject_GetAttr(t, g.dtype));
  py::object shape = steal(direct ? fast.shape->get(t, fast.shape->closure) : PyObject_GetAttr(t, g.shape));
  py::object stride = steal(direct ? fast.stride(t, fast.no_args, nullptr) : PyObject_CallMethodNoArgs(t, g.stride));
  if (!dtype || !shape || !stride || !PyTuple_Check(shape.ptr()) || !PyTuple_Check(stride.ptr()))
    not_a_tensor(h, op, arg);
  bool known = false;
  for (const auto& [obj, code] : g.dtypes)
    if (obj == dtype.ptr()) {
      v.dtype = code;
      known = true;
      break;
    }
  if (!known)
    throw glm5::InvalidInput(op, arg, "dtype float32, float16, bfloat16, float8_e4m3fn, int32, int64 or int8",
                             py::str(dtype).cast<std::string>());
  const int ndim = static_cast<int>(PyTuple_GET_SIZE(shape.ptr()));
  int64_t size[64], strides[64];
  if (ndim > 64 || PyTuple_GET_SIZE(stride.ptr()) != ndim) not_a_tensor(h, op, arg);
  for (int d = 0; d < ndim; ++d) {
    size[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(shape.ptr(), d));
    strides[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(stride.ptr(), d));
  }
  if (PyErr_Occurred()) throw py::error_already_set();
  if (ndim > glm5::kMaxDims) return fit_dims(v, size, strides, ndim);
  v.ndim = ndim;
  std::copy(size, size + ndim, v.size);
  std::copy(strides, strides + ndim, v.stride);
  return true;
}

// An output (or a tensor read only for its sizes): as it is.
View to_view(py::handle h, const char* op, const char* arg) {
  View v;
  if (!read_view(h, op, arg, v))
    throw glm5::InvalidInput(op, arg, "at most " + glm5::str(glm5::kMaxDims) + " dims after merging contiguous ones",
                             "a tensor of more");
  return v;
}

// An input read in `layout`: a tensor without it is replaced by tensor.contiguous(), kept alive
// in `copy` for the call.
View input_view(py::handle h, glm5::Layout layout, const char* op, const char* arg, py::object& copy) {
  View v;
  if (read_view(h, op, arg, v) && (is_view_object(h) || glm5::has_layout(v, layout))) return v;
  copy = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(h.ptr(), g.contiguous));
  if (!copy) throw py::error_already_set();
  return to_view(copy, op, arg);
}

// torch.empty(shape, dtype=dtype): outputs whose size a kernel computes (two-phase ops).
py::object new_tensor(std::initializer_list<int64_t> shape, DType dtype) {
  py::tuple size(shape.size());
  size_t i = 0;
  for (int64_t n : shape) size[i++] = n;
  PyObject* dtype_object = nullptr;
  for (const auto& [obj, code] : g.dtypes)
    if (code == dtype) dtype_object = obj;
  PyObject* args[] = {size.ptr(), dtype_object};
  py::object t = py::reinterpret_steal<py::object>(PyObject_Vectorcall(g.empty, args, 1, g.dtype_kwname));
  if (!t) throw py::error_already_set();
  return t;
}

// ---- kernel binding ------------------------------------------------------------------------------
// A kernel parameter as it crosses from Python: views from tensors (None for an optional one),
// scalars as themselves.
template <class T> struct Param {
  using Py = T;
  T value;
  Param(T v, const char*, const char*) : value(v) {}
  T get() const { return value; }
};
template <> struct Param<const View&> {
  using Py = py::handle;
  View value;
  Param(py::handle h, const char* op, const char* arg) : value(to_view(h, op, arg)) {}
  const View& get() const { return value; }
};
template <> struct Param<const View*> {
  using Py = py::handle;
  View value;
  bool present;
  Param(py::handle h, const char* op, const char* arg) : present(!h.is_none()) {
    if (present) value = to_view(h, op, arg);
  }
  const View* get() const { return present ? &value : nullptr; }
};
template <glm5::Layout L> struct Param<const glm5::In<L>&> {
  using Py = py::handle;
  py::object copy;
  glm5::In<L> value;
  Param(py::handle h, const char* op, const char* arg) : value(input_view(h, L, op, arg, copy)) {}
  const glm5::In<L>& get() const { return value; }
};
template <glm5::Layout L> struct Param<const glm5::In<L>*> {
  using Py = py::handle;
  py::object copy;
  glm5::In<L> value;
  bool present;
  Param(py::handle h, const char* op, const char* arg) : present(!h.is_none()) {
    if (present) value = input_view(h, L, op, arg, copy);
  }
  const glm5::In<L>* get() const { return present ? &value : nullptr; }
};

template <class R, class... A, size_t... I>
void def_kernel_impl(py::module_& m, const char* name, R (*fn)(A...), std::array<const char*, sizeof...(A)> names,
                     std::index_sequence<I...>) {
  m.def(
      name,
      [fn, name, names](typename Param<A>::Py... args) -> R {
        std::tuple<Param<A>...> p{Param<A>(args, name, names[I])...};  // braces: left to right
        py::gil_scoped_release nogil;
        return fn(std::get<I>(p).get()...);
      },
      py::arg(names[I])...);
}

// Binds kernel `fn` as _C.<name>, its parameters named (`names`, in order) as the kernel's
// errors name them.
template <class R, class... A, class... N>
void def_kernel(py::module_& m, const char* name, R (*fn)(A...), N... names) {
  static_assert(sizeof...(N) == sizeof...(A), "one name per kernel parameter");
  def_kernel_impl(m, name, fn, std::array<const char*, sizeof...(A)>{names...}, std::index_sequence_for<A...>{});
}

py::tuple dims(const int64_t* v, int n) {
  py::tuple t(n);
  for (int d = 0; d < n; ++d) t[d] = v[d];
  return t;
}

void set_dims(View& v, const std::vector<int64_t>& size, const std::vector<int64_t>& stride) {
  if (size.size() != stride.size() || size.size() > static_cast<size_t>(glm5::kMaxDims))
    throw py::value_error("View: as many strides as sizes, at most " + glm5::str(glm5::kMaxDims));
  v.ndim = static_cast<int>(size.size());
  std::copy(size.begin(), size.end(), v.size);
  std::copy(stride.begin(), stride.end(), v.stride);
}

}  // namespace


PYBIND11_MODULE(_C, m) {
  m.doc() = "glm5_hal native CPU kernels (plain C++17 + OpenMP, no libtorch)";
  py::register_exception_translator(&translate_invalid_input);

  py::class_<View>(m, "View",
                   "A strided tensor as the kernels take it (csrc/view.h): data pointer, glm5::DType code, "
                   "sizes and strides in elements. Accepted wherever a kernel takes a tensor.")
      .def(py::init([](uintptr_t data, int dtype, const std::vector<int64_t>& size,
                       const std::vector<int64_t>& stride) {
             View v;
             v.data = ptr<void>(data);
             v.dtype = dt(dtype);
             set_dims(v, size, stride);
             return v;
           }),
           py::kw_only(), py::arg("data"), py::arg("dtype"), py::arg("size"), py::arg("stride"))
      .def(py::init([](py::handle tensor) { return to_view(tensor, "View", "tensor"); }), py::arg("tensor"),
           "the View a kernel receives for `tensor`")
      .def_property(
          "data", [](const View& v) { return reinterpret_cast<uintptr_t>(v.data); },
          [](View& v, uintptr_t p) { v.data = ptr<void>(p); })
      .def_property(
          "dtype", [](const View& v) { return static_cast<int>(v.dtype); }, [](View& v, int c) { v.dtype = dt(c); })
      .def_property_readonly("size", [](const View& v) { return dims(v.size, v.ndim); })
      .def_property_readonly("stride", [](const View& v) { return dims(v.stride, v.ndim); })
      .def("__repr__", [](const View& v) {
        return "View(data=" + glm5::str(static_cast<int64_t>(reinterpret_cast<uintptr_t>(v.data))) +
               ", dtype=" + glm5::str(static_cast<int>(v.dtype)) + ", size=" +
               py::str(dims(v.size, v.ndim)).cast<std::string>() + ", stride=" +
               py::str(dims(v.stride, v.ndim)).cast<std::string>() + ")";
      });
  init_torch_names(m);
  glm5_bind_tensor_reading(m);  // csrc/bindings_tensors.cpp: call_key

  // ---- dsa ----
  m.def("dsa_isa", &glm5::dsa_isa, "DSA kernel tier in use: 0 portable, 1 AVX2, 2 AVX-512, 3 AVX-512 + BF16");
  m.def("dsa_max_isa", &glm5::dsa_max_isa, "best DSA kernel tier this CPU supports");
  m.def("dsa_set_isa_limit", &glm5::dsa_set_isa_limit, py::arg("limit"),
        "cap the DSA kernel tier (tests); returns the previous cap");
  def_kernel(m, "indexer_logits", &glm5::indexer_logits, "out", "q", "k", "k_scale", "weights", "k_start", "k_end",
             "num_threads");
  def_kernel(m, "indexer_topk", &glm5::indexer_topk, "out", "q", "k", "k_scale", "weights", "k_start", "k_end",
             "num_threads");
  def_kernel(m, "indexer_topk_paged", &glm5::indexer_topk_paged, "out", "q", "k_cache", "k_cache_scale", "weights",
             "block_table", "context_lens", "num_threads");
  def_kernel(m, "sparse_mla_attention", &glm5::sparse_mla_attention, "out", "lse", "q", "kv", "indices", "sm_scale",
             "num_threads");
  def_kernel(m, "sparse_mla_decode_paged", &glm5::sparse_mla_decode_paged, "out", "lse", "q", "kv_cache",
             "block_table", "context_lens", "indices", "sm_scale", "num_threads");
  def_kernel(m, "dense_mla_decode_paged", &glm5::dense_mla_decode_paged, "out", "lse", "q", "kv_cache", "block_table",
             "context_lens", "sm_scale", "num_threads");
  // ---- end dsa ----

#ifdef _OPENMP
  m.attr("has_openmp") = true;
#else
  m.attr("has_openmp") = false;
#endif


  // ---- common ----
  m.def("vec_isa", &glm5::vec::isa, "row-kernel tier in use: 0 portable, 1 AVX2, 2 AVX-512");
  m.def("vec_max_isa", &glm5::vec::max_isa, "best row-kernel tier this CPU supports");
  m.def("vec_set_isa_limit", &glm5::vec::set_isa_limit, py::arg("limit"),
        "cap the row-kernel tier (tests); returns the previous cap");
  def_kernel(m, "rms_norm", &glm5::rms_norm, "out", "x", "weight", "eps", "num_threads");
  def_kernel(m, "silu_and_mul", &glm5::silu_and_mul, "out", "x", "num_threads");
  def_kernel(m, "apply_rope", &glm5::apply_rope, "out", "x", "positions", "theta", "interleaved", "num_threads");
  def_kernel(m, "hadamard_transform", &glm5::hadamard_transform, "out", "x", "scale", "num_threads");
  // ---- end common ----

  // ---- moe ----
  def_kernel(m, "moe_permute_plan", &glm5::moe_permute_plan, "tokens_per_expert", "src", "ids");
  // The whole op in one call: the plan, then x_perm [M, D] allocated here and gathered.
  m.def(
      "moe_permute",
      [](py::handle tokens_per_expert, py::handle src, py::handle x, py::handle ids, int num_threads) {
        const char* op = "moe_permute";
        const Param<const View&> tpe(tokens_per_expert, op, "tokens_per_expert"), src_out(src, op, "src");
        const Param<const glm5::RowsIn&> x_in(x, op, "x"), ids_in(ids, op, "ids");
        int64_t rows;
        {
          py::gil_scoped_release nogil;
          rows = glm5::moe_permute_plan(tpe.get(), src_out.get(), ids_in.get());
        }
        GLM5_REQUIRE(x_in.get().ndim == 2, op, "x", "2 dims", glm5::shape_str(x_in.get()));
        py::object x_perm = new_tensor({rows, x_in.get().size[1]}, x_in.get().dtype);
        const Param<const View&> out(x_perm, op, "x_perm");
        {
          py::gil_scoped_release nogil;
          glm5::moe_permute_gather(out.get(), x_in.get(), src_out.get(), ids_in.get().size[1], num_threads);
        }
        return x_perm;
      },
      py::arg("tokens_per_expert"), py::arg("src"), py::arg("x"), py::arg("ids"), py::arg("num_threads"),
      "moe_permute_plan, then moe_permute_gather into a new x_perm [M, D], returned");
  def_kernel(m, "moe_permute_gather", &glm5::moe_permute_gather, "x_perm", "x", "src", "k", "num_threads");
  def_kernel(m, "moe_unpermute", &glm5::moe_unpermute, "out", "y", "src", "weights", "num_threads");
  def_kernel(m, "moe_route", &glm5::moe_route, "weights", "ids", "logits", "bias", "n_group", "topk_group",
             "routed_scaling_factor", "norm_topk_prob", "softmax", "num_threads");
  // ---- end moe ----

  // ---- kv ----
  def_kernel(m, "kv_cache_write", &glm5::kv_cache_write, "cache", "values", "slot_mapping", "num_threads");
  def_kernel(m, "indexer_k_cache_write", &glm5::indexer_k_cache_write, "k", "k_cache", "k_scale", "slot_mapping",
             "ue8m0", "num_threads");
  m.def(
      "kv_cache_gather",
      [](py::handle out, py::handle cache, py::handle block_table, py::handle context_lens, int num_threads) {
        const char* op = "kv_cache_gather";
        const Param<const glm5::DenseIn&> cache_in(cache, op, "cache"), lens(context_lens, op, "context_lens");
        const Param<const glm5::RowsIn&> table(block_table, op, "block_table");
        py::object result = py::reinterpret_borrow<py::object>(out);
        if (out.is_none()) {
          const int64_t rows = glm5::kv_cache_gather_rows(cache_in.get(), table.get(), lens.get());
          result = new_tensor({rows, cache_in.get().size[2]}, cache_in.get().dtype);
        }
        const Param<const View&> out_view(result, op, "out");
        {
          py::gil_scoped_release nogil;
          glm5::kv_cache_gather(out_view.get(), cache_in.get(), table.get(), lens.get(), num_threads);
        }
        return result;
      },
      py::arg("out"), py::arg("cache"), py::arg("block_table"), py::arg("context_lens"), py::arg("num_threads"),
      "out=None: a new [sum(context_lens), D] output, sized by kv_cache_gather_rows; returns out");
  // ---- end kv ----

  // ---- quant ----
  def_kernel(m, "fp8_block_quant", &glm5::fp8_block_quant, "q", "scale", "x", "block", "ue8m0", "num_threads");
  def_kernel(m, "int4_quantize", &glm5::int4_quantize, "out", "packed", "scale", "w", "group_size", "num_threads");
  def_kernel(m, "int4_unpack", &glm5::int4_unpack, "out", "packed", "scale", "group_size", "num_threads");
  // ---- end quant ----

  // ---- quantized and grouped GEMMs (qgemm.h), int8_quant ----
  m.def("qgemm_float_isa", &glm5::qgemm_float_isa, "float-path GEMM tile tier: 0 portable .. 4 AMX");
  m.def("qgemm_int8_isa", &glm5::qgemm_int8_isa, "int8-path GEMM tile tier: 0 portable .. 4 AMX");
  m.def("qgemm_max_isa", &glm5::qgemm_max_isa, "best GEMM tile tier this CPU supports");
  m.def("qgemm_set_isa_limit", &glm5::qgemm_set_isa_limit, py::arg("limit"),
        "cap the GEMM tile tier (tests); returns the previous cap");
  def_kernel(m, "int8_quant", &glm5::int8_quant, "q", "scale", "x", "num_threads");
  def_kernel(m, "fp8_block_gemm", &glm5::fp8_block_gemm, "out", "a", "a_scale", "w", "w_scale", "num_threads");
  def_kernel(m, "fp8_grouped_gemm", &glm5::fp8_grouped_gemm, "out", "a", "a_scale", "w", "w_scale",
             "tokens_per_expert", "num_threads");
  def_kernel(m, "int8_gemm", &glm5::int8_gemm, "out", "x", "x_scale", "w", "w_scale", "bias", "num_threads");
  def_kernel(m, "int8_grouped_gemm", &glm5::int8_grouped_gemm, "out", "x", "x_scale", "w", "w_scale",
             "tokens_per_expert", "num_threads");
  def_kernel(m, "bf16_grouped_gemm", &glm5::bf16_grouped_gemm, "out", "x", "w", "tokens_per_expert", "num_threads");
  // ---- end quantized and grouped GEMMs ----

  // ---- roofline (glm5-hal bench): the machine's peak rates and memory bandwidth ----
  m.def("roofline_fp32_fma_flops", &glm5::roofline::fp32_fma_flops, py::arg("threads"), py::arg("seconds"),
        py::call_guard<py::gil_scoped_release>());
  m.def("roofline_bf16_dot_flops", &glm5::roofline::bf16_dot_flops, py::arg("threads"), py::arg("seconds"),
        py::call_guard<py::gil_scoped_release>(), "vdpbf16ps; 0 without AVX-512 BF16");
  m.def("roofline_int8_dot_ops", &glm5::roofline::int8_dot_ops, py::arg("threads"), py::arg("seconds"),
        py::call_guard<py::gil_scoped_release>(), "vpdpbusd; 0 without AVX-512 VNNI or AVX-VNNI");
  m.def("roofline_amx_bf16_flops", &glm5::roofline::amx_bf16_flops, py::arg("threads"), py::arg("seconds"),
        py::call_guard<py::gil_scoped_release>(), "0 without usable AMX");
  m.def("roofline_amx_int8_ops", &glm5::roofline::amx_int8_ops, py::arg("threads"), py::arg("seconds"),
        py::call_guard<py::gil_scoped_release>(), "0 without usable AMX");
  m.def("roofline_triad_bytes", &glm5::roofline::triad_bytes, py::arg("threads"), py::arg("elements"),
        py::arg("passes"), py::call_guard<py::gil_scoped_release>());
  // ---- end roofline ----

  glm5_bind_value_checks(m);  // csrc/bindings_value_checks.cpp: the value checks take the tensors
}
