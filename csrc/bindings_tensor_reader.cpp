// glm5_hal._tensor_reader (bindings_tensor_reader.h), compiled against the c10 headers of the
// torch the package is built for (CMakeLists.txt); nothing here reaches past c10's
// public TensorImpl API except where the Python object keeps its TensorImpl, which is found at
// import by looking for the address Python reports (Tensor._cdata) at the places torch's
// THPVariable has kept it: right after PyObject_HEAD (at::Tensor cdata, torch 2.13) or one word
// later (c10::MaybeOwned<at::Tensor> cdata, whose flag comes first, earlier releases).
#include "bindings_tensor_reader.h"

#include <c10/core/TensorImpl.h>

#include <algorithm>
#include <cstddef>
#include <cstring>

#ifndef GLM5_HAL_TORCH_VERSION
#error "GLM5_HAL_TORCH_VERSION: the torch version whose headers this is compiled with"
#endif

namespace glm5_bindings {
namespace {

Py_ssize_t impl_offset = -1;  // where a torch.Tensor object keeps its TensorImpl*; -1: unusable

bool read_tensor(PyObject* t, bool contiguity, bool grad, TensorMeta* out);

c10::TensorImpl* impl_of(PyObject* t) {
  c10::TensorImpl* impl;
  std::memcpy(&impl, reinterpret_cast<const char*>(t) + impl_offset, sizeof(impl));
  return impl;
}

// The Python object's own view of `t`, to check the reader against: (shape, contiguous,
// requires_grad, TensorImpl address).
struct PythonSays {
  PyObject* shape = nullptr;
  bool contiguous = false, requires_grad = false;
  uintptr_t cdata = 0;
  ~PythonSays() { Py_XDECREF(shape); }
  bool read(PyObject* t) {
    shape = PyObject_GetAttrString(t, "shape");
    PyObject* c = PyObject_CallMethod(t, "is_contiguous", nullptr);
    PyObject* g = PyObject_GetAttrString(t, "requires_grad");
    PyObject* p = PyObject_GetAttrString(t, "_cdata");
    const bool ok = shape && c && g && p && PyTuple_Check(shape) && PyLong_Check(p);
    if (ok) {
      contiguous = c == Py_True;
      requires_grad = g == Py_True;
      cdata = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(p));
    }
    Py_XDECREF(c);
    Py_XDECREF(g);
    Py_XDECREF(p);
    return ok && !PyErr_Occurred();
  }
};

bool same_sizes(const TensorMeta& m, PyObject* shape) {
  if (m.ndim != PyTuple_GET_SIZE(shape)) return false;
  for (int64_t d = 0; d < m.ndim; ++d)
    if (PyLong_AsLongLong(PyTuple_GET_ITEM(shape, d)) != m.sizes[d]) return false;
  return true;
}

PyObject* eval(PyObject* torch, const char* expression) {
  PyObject* globals = PyDict_New();
  if (!globals) return nullptr;
  PyDict_SetItemString(globals, "torch", torch);
  PyObject* v = PyRun_String(expression, Py_eval_input, globals, globals);
  Py_DECREF(globals);
  return v;
}

struct Sample {
  const char* make;
  c10::ScalarType dtype;
  c10::DeviceType device;
};

bool check_samples(PyObject* torch) {
  const Sample samples[] = {
      {"torch.zeros(2, 3)", c10::ScalarType::Float, c10::DeviceType::CPU},
      {"torch.zeros(4, 5, dtype=torch.bfloat16).t()", c10::ScalarType::BFloat16, c10::DeviceType::CPU},
      {"torch.nn.Parameter(torch.zeros(7, dtype=torch.float16))", c10::ScalarType::Half, c10::DeviceType::CPU},
      {"torch.zeros(1, 2, 3, dtype=torch.int32, device='meta')", c10::ScalarType::Int, c10::DeviceType::Meta},
      {"torch.zeros(3, 2, 2, dtype=torch.int64)[:, 1]", c10::ScalarType::Long, c10::DeviceType::CPU},
  };
  for (const Sample& s : samples) {
    PyObject* t = eval(torch, s.make);
    if (!t) return false;
    PythonSays says;
    TensorMeta m{};
    const bool ok = says.read(t) && reinterpret_cast<uintptr_t>(impl_of(t)) == says.cdata &&
                    read_tensor(t, true, true, &m) && same_sizes(m, says.shape) &&
                    m.contiguous == says.contiguous && m.requires_grad == says.requires_grad &&
                    m.scalar_type == static_cast<int64_t>(s.dtype) &&
                    m.device_type == static_cast<int8_t>(s.device) && m.device_index == -1;
    Py_DECREF(t);
    if (!ok) return false;
  }
  return true;
}

// The offset after PyObject_HEAD at which a sample tensor object holds the address Python
// reports for its TensorImpl, or -1.
Py_ssize_t find_impl_offset(PyObject* torch) {
  PyObject* t = eval(torch, "torch.zeros(1)");
  if (!t) return -1;
  PythonSays says;
  Py_ssize_t found = -1;
  if (says.read(t)) {
    for (Py_ssize_t offset : {static_cast<Py_ssize_t>(sizeof(PyObject)),
                              static_cast<Py_ssize_t>(sizeof(PyObject) + sizeof(void*))}) {
      if (offset + static_cast<Py_ssize_t>(sizeof(void*)) > Py_TYPE(t)->tp_basicsize) break;
      uintptr_t at;
      std::memcpy(&at, reinterpret_cast<const char*>(t) + offset, sizeof(at));
      if (at == says.cdata) {
        found = offset;
        break;
      }
    }
  }
  Py_DECREF(t);
  return found;
}


bool tensor_reader_init(PyObject* torch) {
  impl_offset = -1;
  PyObject* version = PyObject_GetAttrString(torch, "__version__");
  const char* running = version ? PyUnicode_AsUTF8(version) : nullptr;
  const bool same_torch = running && std::strcmp(running, GLM5_HAL_TORCH_VERSION) == 0;
  Py_XDECREF(version);
  if (!same_torch) {
    PyErr_Clear();
    return false;
  }
  impl_offset = find_impl_offset(torch);
  if (impl_offset < 0 || !check_samples(torch)) {
    PyErr_Clear();
    impl_offset = -1;
    return false;
  }
  return true;
}

bool read_tensor(PyObject* t, bool contiguity, bool grad, TensorMeta* out) {
  if (impl_offset < 0) return false;
  const c10::TensorImpl* impl = impl_of(t);
  if (!impl || impl->is_python_dispatch() || impl->has_symbolic_sizes_strides()) return false;
  try {
    const c10::Device device = impl->device();
    const c10::IntArrayRef sizes = impl->sizes();
    out->scalar_type = static_cast<int64_t>(impl->dtype().toScalarType());
    out->device_type = static_cast<int8_t>(device.type());
    out->device_index = device.index();
    out->requires_grad = grad && impl->requires_grad();
    out->contiguous = contiguity && impl->is_contiguous();
    out->ndim = static_cast<int64_t>(sizes.size());
    out->sizes = sizes.data();
  } catch (...) {  // a device, sizes or dtype this tensor does not have (undefined, nested)
    return false;
  }
  return true;
}

bool host_data(PyObject* t, HostData* out) {
  if (impl_offset < 0) return false;
  const c10::TensorImpl* impl = impl_of(t);
  if (!impl || impl->is_python_dispatch() || impl->has_symbolic_sizes_strides()) return false;
  try {
    if (impl->device().type() != c10::DeviceType::CPU || !impl->is_contiguous()) return false;
    const c10::IntArrayRef sizes = impl->sizes();
    if (sizes.size() > static_cast<size_t>(kHostMaxDims)) return false;
    out->numel = impl->numel();
    out->data = nullptr;
    if (out->numel) {
      // data() trusts the storage: a tensor without one, or whose storage holds no memory (a
      // functional wrapper under torch.func.functionalize, a freed one), has nothing to scan
      if (!impl->has_storage() || !impl->storage_initialized()) return false;
      out->data = impl->data();
      if (!out->data) return false;
    }
    const c10::ScalarType dtype = impl->dtype().toScalarType();
    out->int_bytes = dtype == c10::ScalarType::Int ? 4 : dtype == c10::ScalarType::Long ? 8 : 0;
    out->ndim = static_cast<int64_t>(sizes.size());
    std::copy(sizes.begin(), sizes.end(), out->sizes);
  } catch (...) {  // no device, or sizes or a dtype this tensor does not have
    return false;
  }
  return true;
}

const TensorReaderApi api{kTensorReaderAbi, tensor_reader_init, read_tensor, host_data};

PyModuleDef module{PyModuleDef_HEAD_INIT, "_tensor_reader",
                   "glm5_hal._C.call_key's tensor reader (csrc/bindings_tensor_reader.h)", -1, nullptr,
                   nullptr, nullptr, nullptr, nullptr};

}  // namespace
}  // namespace glm5_bindings

PyMODINIT_FUNC PyInit__tensor_reader() {
  PyObject* m = PyModule_Create(&glm5_bindings::module);
  if (!m) return nullptr;
  PyObject* capsule = PyCapsule_New(const_cast<glm5_bindings::TensorReaderApi*>(&glm5_bindings::api),
                                    glm5_bindings::kTensorReaderCapsule, nullptr);
  if (!capsule || PyModule_AddObject(m, "api", capsule) != 0) {
    Py_XDECREF(capsule);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
