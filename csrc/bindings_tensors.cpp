// How glm5_hal._C reads torch tensors without building Python objects for each attribute
// (declared in bindings_tensors.h): call_key for dispatch, host_tensor for the value checks.
//
// glm5_hal._C.call_key: everything an op's generated metadata check reads from one call, as one
// hashable value. glm5_hal.opdef remembers the keys of calls that passed their check, so a call
// whose arguments have the same metadata as an earlier one skips the Python check (the check is a
// pure function of what is read here) and costs one native call and one dict lookup instead of
// ~0.6 us per tensor argument of attribute reads in Python.
//
// call_key(plan, pin, *args) -> tuple | None
//   plan: bytes, one code per argument: 't' a tensor, 'c' a tensor whose contiguity the check
//         reads, 'o' / 'p' the same but optional (None accepted), 'g' a paged cache (the check
//         reads whether its layout is paged: glm5_hal.checks.is_paged, restated in paged_flag),
//         'k' an indexer key (a tensor or
//         a pair of tensors), 's' a scalar. A tensor code in upper case also reads requires_grad
//         (differentiable ops: whether a call must go through autograd).
//   pin:  the pinned backend (str or None), carried in the key as is.
//   The key is (pin, metadata bytes, scalar values...). The bytes hold, per tensor, its dtype,
//   device type and index, requires_grad and the contiguity flag where asked, the number of dims
//   and every size; per scalar, a type code (so True and 1, or 1 and 1.0, never share a key).
//   None is returned, and the caller runs its check (and, under a transform, torch's dispatcher)
//   instead, for anything this does not read exactly: tensor subclasses other than nn.Parameter
//   (they may override the getters), symbolic sizes, scalars of other types; and for every call
//   while a PyTorch transform is active (a torch dispatch mode such as FakeTensorMode or make_fx's
//   proxy mode, a torch function mode, a functorch level: vmap, grad, jvp, functionalize; forward
//   AD; torch.jit.trace): there a tensor may be a wrapper without data of its own, and the op
//   must go through torch.ops.
//
// Tensors are read through torch.Tensor's own C getters (the ones `t.shape`, `t.dtype`,
// `t.device` and `t.requires_grad` run), resolved once at import, with a torch.device's type and
// index read from the object (THPDevice: PyObject_HEAD, then c10::Device {int8 type, int8 index}),
// a layout checked at import against devices of known type and index. If these do not resolve
// and check, call_key always returns None and host_tensor false: slower, never wrong.
#include <Python.h>
#include <pybind11/pybind11.h>

#include "bindings_tensors.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

namespace {

struct Readers {
  bool ok = false;
  int8_t cpu_type = 0;                    // torch.device("cpu")'s type byte
  PyObject *int32 = nullptr, *int64 = nullptr;  // torch.int32, torch.int64
  PyTypeObject *tensor = nullptr, *parameter = nullptr, *dtype = nullptr;
  PyGetSetDef *shape = nullptr, *dtype_get = nullptr, *device = nullptr, *requires_grad = nullptr;
  PyGetSetDef* is_cpu = nullptr;   // answers without building a torch.device (CPU tensors: index -1)
  PyCFunctionWithKeywords is_contiguous = nullptr;
  PyCFunction data_ptr = nullptr;
  PyCFunctionWithKeywords stride = nullptr;   // Tensor.stride(): the strides tuple
  PyCFunction element_size = nullptr;
  PyObject* no_args = nullptr;
  PyTypeObject* device_type = nullptr;  // torch.device
  // torch._C._is_torch_function_mode_enabled, _len_torch_dispatch_stack and
  // _are_functorch_transforms_active: whether a transform is active (transform_active)
  PyObject* function_mode = nullptr;
  PyObject* dispatch_modes = nullptr;
  PyObject* functorch_levels = nullptr;
  PyObject* jit_tracing = nullptr;     // torch._C._get_tracing_state: None unless torch.jit.trace runs
  // torch.autograd.forward_ad's globals: _current_level >= 0 inside forward_ad.dual_level()
  PyObject* forward_ad = nullptr;
  PyObject* current_level = nullptr;   // the interned name "_current_level"
};
Readers r;

struct DeviceObject {  // THPDevice's layout, checked at import (device_layout_ok)
  PyObject_HEAD
  int8_t type;
  int8_t index;
};

// `type`'s attribute `name` if it is a descriptor of `kind` (a C getter or a C method; anything
// defined in Python is not), else null.
PyObject* descriptor(PyObject* type, const char* name, PyTypeObject* kind) {
  PyObject* d = PyObject_GetAttrString(type, name);
  if (!d) PyErr_Clear();
  if (d && !Py_IS_TYPE(d, kind)) Py_CLEAR(d);
  return d;  // the type keeps it alive
}

}  // namespace

namespace glm5_bindings {

PyGetSetDef* c_getset(PyObject* type, const char* name) {
  PyObject* d = descriptor(type, name, &PyGetSetDescr_Type);
  PyGetSetDef* def = d ? reinterpret_cast<PyGetSetDescrObject*>(d)->d_getset : nullptr;
  Py_XDECREF(d);
  return def && def->get ? def : nullptr;
}

PyMethodDef* c_method(PyObject* type, const char* name, int flags) {
  PyObject* d = descriptor(type, name, &PyMethodDescr_Type);
  PyMethodDef* def = d ? reinterpret_cast<PyMethodDescrObject*>(d)->d_method : nullptr;
  Py_XDECREF(d);
  return def && def->ml_flags == flags ? def : nullptr;
}

}  // namespace glm5_bindings

namespace {

using glm5_bindings::c_getset;
using glm5_bindings::c_method;

// The device object's (type, index) as read through the layout, or false.
bool read_device(PyObject* device, int8_t& type, int8_t& index) {
  if ((r.device_type && Py_TYPE(device) != r.device_type) ||
      Py_TYPE(device)->tp_basicsize < static_cast<Py_ssize_t>(sizeof(DeviceObject)))
    return false;
  const auto* d = reinterpret_cast<const DeviceObject*>(device);
  type = d->type;
  index = d->index;
  return true;
}

// torch.device(spec) read through the layout matches the index Python reports for it, and
// devices of two types differ in the type byte.
bool device_layout_ok(PyObject* torch) {
  namespace py = pybind11;
  try {
    py::object make = py::reinterpret_borrow<py::object>(torch).attr("device");
    py::object cpu = make("cpu"), cuda3 = make("cuda", 3), cuda5 = make("cuda", 5), meta = make("meta");
    int8_t t_cpu, i_cpu, t3, i3, t5, i5, t_meta, i_meta;
    if (!read_device(cpu.ptr(), t_cpu, i_cpu) || !read_device(cuda3.ptr(), t3, i3) ||
        !read_device(cuda5.ptr(), t5, i5) || !read_device(meta.ptr(), t_meta, i_meta))
      return false;
    return i_cpu == -1 && i3 == 3 && i5 == 5 && i_meta == -1 && t3 == t5 && t_cpu != t3 && t_meta != t_cpu &&
           t_meta != t3 && Py_TYPE(cpu.ptr()) == Py_TYPE(cuda3.ptr());
  } catch (const py::error_already_set&) {
    PyErr_Clear();
    return false;
  }
}

// module.path1[.path2], a new reference (or null with the error set).
PyObject* attribute(PyObject* module, const char* path1, const char* path2 = nullptr) {
  PyObject* a = PyObject_GetAttrString(module, path1);
  if (!a || !path2) return a;
  PyObject* b = PyObject_GetAttrString(a, path2);
  Py_DECREF(a);
  return b;
}

void init_readers() {
  PyObject* torch = PyImport_ImportModule("torch");
  if (!torch) {
    PyErr_Clear();
    return;
  }
  PyObject* tensor = attribute(torch, "Tensor");
  PyObject* parameter = attribute(torch, "nn", "Parameter");
  PyObject* f32 = attribute(torch, "float32");
  if (!tensor || !parameter || !f32) {
    PyErr_Clear();
    Py_XDECREF(tensor);
    Py_XDECREF(parameter);
    Py_XDECREF(f32);
    Py_DECREF(torch);
    return;
  }
  Readers x;
  x.tensor = reinterpret_cast<PyTypeObject*>(tensor);      // kept for the module's lifetime
  x.parameter = reinterpret_cast<PyTypeObject*>(parameter);
  x.dtype = Py_TYPE(f32);
  Py_DECREF(f32);
  x.shape = c_getset(tensor, "shape");
  x.dtype_get = c_getset(tensor, "dtype");
  x.device = c_getset(tensor, "device");
  x.requires_grad = c_getset(tensor, "requires_grad");
  x.is_cpu = c_getset(tensor, "is_cpu");
  PyMethodDef* contiguous = c_method(tensor, "is_contiguous", METH_VARARGS | METH_KEYWORDS);
  x.no_args = PyTuple_New(0);
  PyMethodDef* data_ptr = c_method(tensor, "data_ptr", METH_NOARGS);
  PyMethodDef* stride = c_method(tensor, "stride", METH_VARARGS | METH_KEYWORDS);
  PyMethodDef* element_size = c_method(tensor, "element_size", METH_NOARGS);
  x.int32 = attribute(torch, "int32");   // kept for the module's lifetime
  PyErr_Clear();
  x.int64 = attribute(torch, "int64");
  PyErr_Clear();
  x.function_mode = attribute(torch, "_C", "_is_torch_function_mode_enabled");
  PyErr_Clear();
  x.dispatch_modes = attribute(torch, "_C", "_len_torch_dispatch_stack");
  PyErr_Clear();
  x.functorch_levels = attribute(torch, "_C", "_are_functorch_transforms_active");
  PyErr_Clear();
  x.jit_tracing = attribute(torch, "_C", "_get_tracing_state");
  PyErr_Clear();
  if (PyObject* forward_ad = PyImport_ImportModule("torch.autograd.forward_ad")) {
    x.forward_ad = PyModule_GetDict(forward_ad);   // borrowed: the module lives as long as torch
    Py_XINCREF(x.forward_ad);
    Py_DECREF(forward_ad);
  }
  x.current_level = PyUnicode_InternFromString("_current_level");
  PyErr_Clear();
  PyObject* cpu = PyObject_CallMethod(torch, "device", "s", "cpu");
  PyErr_Clear();
  if (cpu) x.device_type = Py_TYPE(cpu);   // a type object lives as long as torch
  int8_t cpu_index = 0;
  const bool cpu_read = cpu && read_device(cpu, x.cpu_type, cpu_index);
  Py_XDECREF(cpu);
  if (x.shape && x.dtype_get && x.device && x.requires_grad && x.is_cpu && contiguous && data_ptr && stride &&
      element_size && x.no_args && x.int32 &&
      x.int64 && x.function_mode && x.dispatch_modes && x.functorch_levels && x.jit_tracing && x.forward_ad && x.current_level &&
      cpu_read && device_layout_ok(torch)) {
    x.is_contiguous = reinterpret_cast<PyCFunctionWithKeywords>(reinterpret_cast<void (*)(void)>(contiguous->ml_meth));
    x.data_ptr = data_ptr->ml_meth;
    x.stride = reinterpret_cast<PyCFunctionWithKeywords>(reinterpret_cast<void (*)(void)>(stride->ml_meth));
    x.element_size = element_size->ml_meth;
    x.ok = true;
  }
  Py_DECREF(torch);
  r = x;
}

// Owned reference holder for the getters' results.
struct Ref {
  PyObject* p;
  explicit Ref(PyObject* o) : p(o) {}
  ~Ref() { Py_XDECREF(p); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
};

// True while a torch function mode is active (or if that cannot be told): the getters then
// answer what the mode says, so their path declines.
bool function_mode_active() {
  Ref on(PyObject_CallNoArgs(r.function_mode));
  if (!on.p) PyErr_Clear();
  return on.p != Py_False;
}

// True while any PyTorch transform is active (or if that cannot be told): a torch function
// mode, a torch dispatch mode (FakeTensorMode, make_fx's proxy mode, ...), a functorch level
// (vmap, grad, jvp, functionalize), forward-mode AD (forward_ad.dual_level) or torch.jit.trace.
// Such a call must reach the op through torch's dispatcher.
bool transform_active() {
  if (function_mode_active()) return true;
  PyObject* level = PyDict_GetItem(r.forward_ad, r.current_level);   // borrowed
  if (!level || !PyLong_CheckExact(level) || PyLong_AsLong(level) >= 0) {
    PyErr_Clear();
    return true;
  }
  Ref modes(PyObject_CallNoArgs(r.dispatch_modes));
  if (!modes.p || !PyLong_CheckExact(modes.p) || PyLong_AsLong(modes.p) != 0) {
    PyErr_Clear();
    return true;
  }
  Ref levels(PyObject_CallNoArgs(r.functorch_levels));
  if (!levels.p) PyErr_Clear();
  if (levels.p != Py_False) return true;
  Ref tracing(PyObject_CallNoArgs(r.jit_tracing));
  if (!tracing.p) PyErr_Clear();
  return tracing.p != Py_None;
}

// `t`'s device type and index: a CPU tensor's through is_cpu (a CPU tensor's device has no
// index: torch.empty(2, device="cpu:0").device is cpu), others' through the device object.
bool tensor_device(PyObject* t, int8_t& type, int8_t& index) {
  Ref cpu(r.is_cpu->get(t, r.is_cpu->closure));
  if (cpu.p == Py_True) {
    type = r.cpu_type;
    index = -1;
    return true;
  }
  if (cpu.p != Py_False) {
    PyErr_Clear();
    return false;
  }
  Ref device(r.device->get(t, r.device->closure));
  if (!device.p) {
    PyErr_Clear();
    return false;
  }
  return read_device(device.p, type, index);
}

enum : int64_t { kNone = 0, kPair = 1 };  // never a tensor's first word (a dtype's address, or kTensor set)
constexpr int64_t kTensor = int64_t{1} << 56;
enum : int64_t { kInt = 1, kFloat, kBool, kStr, kNoneScalar, kDType };

// The key's words, on the stack (no allocation per call); a call needing more than fit, far
// more than any op's arguments, gets no key (its check runs).
class Words {
 public:
  void push_back(int64_t w) { insert(&w, &w + 1); }
  void insert(const int64_t* first, const int64_t* last) {
    const size_t n = static_cast<size_t>(last - first);
    if (n > kCapacity - size_) {
      overflow_ = true;
      return;
    }
    std::copy(first, last, words_ + size_);
    size_ += n;
  }
  bool overflow() const { return overflow_; }
  const int64_t* data() const { return words_; }
  size_t size() const { return size_; }

 private:
  static constexpr size_t kCapacity = 256;
  int64_t words_[kCapacity];
  size_t size_ = 0;
  bool overflow_ = false;
};

// Appends tensor `t`'s words; false if it is not read exactly here (the caller returns None).
// glm5_hal.checks.is_paged over (sizes, strides): each block (the dims after the first)
// row-major contiguous, blocks not overlapping. -1 when the strides cannot be read exactly.
int64_t paged_flag(PyObject* t, PyObject* shape) {
  Ref strides(r.stride(t, r.no_args, nullptr));   // the class's method, as is_contiguous
  const Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
  if (!strides.p || !PyTuple_Check(strides.p) || PyTuple_GET_SIZE(strides.p) != ndim) {
    PyErr_Clear();
    return -1;
  }
  long long size[64], stride[64];
  if (ndim > 64) return -1;
  for (Py_ssize_t d = 0; d < ndim; ++d) {
    PyObject* sz = PyTuple_GET_ITEM(shape, d);
    PyObject* st = PyTuple_GET_ITEM(strides.p, d);
    if (!PyLong_CheckExact(sz) || !PyLong_CheckExact(st)) return -1;
    int o1 = 0, o2 = 0;
    size[d] = PyLong_AsLongLongAndOverflow(sz, &o1);
    stride[d] = PyLong_AsLongLongAndOverflow(st, &o2);
    if (o1 || o2 || PyErr_Occurred()) {
      PyErr_Clear();
      return -1;
    }
  }
  long long extent = 1;
  for (Py_ssize_t d = ndim - 1; d >= 1; --d) {
    if (size[d] != 1 && stride[d] != extent) return 0;
    extent *= size[d];
  }
  return ndim >= 1 && (size[0] <= 1 || extent == 0 || stride[0] >= extent) ? 1 : 0;
}

enum class KeyLayout { None, Contiguity, Paged };

bool add_tensor(PyObject* t, KeyLayout layout, bool grad_flag, Words& words) {
  PyTypeObject* type = Py_TYPE(t);
  if (type != r.tensor && type != r.parameter) return false;
  Ref dtype(r.dtype_get->get(t, r.dtype_get->closure));
  Ref shape(r.shape->get(t, r.shape->closure));
  Ref grad(grad_flag ? r.requires_grad->get(t, r.requires_grad->closure) : nullptr);
  if (!dtype.p || !shape.p || (grad_flag && !grad.p) || !PyTuple_Check(shape.p) || Py_TYPE(dtype.p) != r.dtype) {
    PyErr_Clear();
    return false;
  }
  int8_t dev_type, dev_index;
  if (!tensor_device(t, dev_type, dev_index)) return false;
  int64_t contiguous = 0, paged = 0;
  if (layout == KeyLayout::Contiguity) {
    Ref flag(r.is_contiguous(t, r.no_args, nullptr));
    if (!flag.p) {
      PyErr_Clear();
      return false;
    }
    contiguous = flag.p == Py_True;
  } else if (layout == KeyLayout::Paged) {
    paged = paged_flag(t, shape.p);
    if (paged < 0) return false;
  }
  const Py_ssize_t ndim = PyTuple_GET_SIZE(shape.p);
  words.push_back(reinterpret_cast<intptr_t>(dtype.p));
  words.push_back(static_cast<int64_t>(ndim) | static_cast<int64_t>(static_cast<uint8_t>(dev_type)) << 32 |
                  static_cast<int64_t>(static_cast<uint8_t>(dev_index)) << 40 |
                  static_cast<int64_t>(grad.p == Py_True) << 48 | contiguous << 49 | paged << 50);
  for (Py_ssize_t d = 0; d < ndim; ++d) {
    PyObject* size = PyTuple_GET_ITEM(shape.p, d);
    if (!PyLong_CheckExact(size)) return false;  // a SymInt while tracing
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(size, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    words.push_back(v);
  }
  return true;
}

int64_t scalar_code(PyObject* v) {
  if (PyLong_CheckExact(v)) return kInt;
  if (PyFloat_CheckExact(v)) return kFloat;
  if (PyBool_Check(v)) return kBool;
  if (PyUnicode_CheckExact(v)) return kStr;
  if (v == Py_None) return kNoneScalar;
  if (Py_TYPE(v) == r.dtype) return kDType;
  return 0;
}

PyObject* call_key(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 2 || !PyBytes_Check(args[0]) || PyBytes_GET_SIZE(args[0]) != nargs - 2) {
    PyErr_SetString(PyExc_TypeError, "call_key(plan: bytes, pin, *args): one plan code per argument");
    return nullptr;
  }
  if (!r.ok || transform_active()) Py_RETURN_NONE;
  const char* plan = PyBytes_AS_STRING(args[0]);
  const Py_ssize_t n = nargs - 2;
  Words words;
  PyObject* scalars[32];
  Py_ssize_t nscalars = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* a = args[i + 2];
    const bool grad = plan[i] >= 'A' && plan[i] <= 'Z';
    const char code = static_cast<char>(plan[i] | 0x20);  // lower case
    switch (code) {
      case 'o':
      case 'p':
        if (a == Py_None) {
          words.push_back(kNone);
          break;
        }
        [[fallthrough]];
      case 't':
      case 'c':
      case 'g':
        if (!add_tensor(a, code == 'g' ? KeyLayout::Paged : (code == 'c' || code == 'p') ? KeyLayout::Contiguity : KeyLayout::None,
                        grad, words))
          Py_RETURN_NONE;
        break;
      case 'k':
        if (PyTuple_CheckExact(a) || PyList_CheckExact(a)) {
          if (PySequence_Fast_GET_SIZE(a) != 2) Py_RETURN_NONE;
          words.push_back(kPair);
          if (!add_tensor(PySequence_Fast_GET_ITEM(a, 0), KeyLayout::None, grad, words) ||
              !add_tensor(PySequence_Fast_GET_ITEM(a, 1), KeyLayout::None, grad, words))
            Py_RETURN_NONE;
        } else if (!add_tensor(a, KeyLayout::None, grad, words)) {
          Py_RETURN_NONE;
        }
        break;
      case 's': {
        const int64_t code = scalar_code(a);
        if (!code || nscalars == 32) Py_RETURN_NONE;
        words.push_back(code);
        scalars[nscalars++] = a;
        break;
      }
      default:
        Py_RETURN_NONE;
    }
  }
  if (words.overflow()) Py_RETURN_NONE;
  PyObject* key = PyTuple_New(2 + nscalars);
  if (!key) return nullptr;
  PyObject* bytes = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(words.data()),
                                              static_cast<Py_ssize_t>(words.size() * sizeof(int64_t)));
  if (!bytes) {
    Py_DECREF(key);
    return nullptr;
  }
  Py_INCREF(args[1]);
  PyTuple_SET_ITEM(key, 0, args[1]);
  PyTuple_SET_ITEM(key, 1, bytes);
  for (Py_ssize_t s = 0; s < nscalars; ++s) {
    Py_INCREF(scalars[s]);
    PyTuple_SET_ITEM(key, 2 + s, scalars[s]);
  }
  return key;
}

}  // namespace

namespace glm5_bindings {

bool host_reading() { return r.ok && !function_mode_active(); }

bool host_tensor(PyObject* t, HostData& out) {
  if (Py_TYPE(t) != r.tensor && Py_TYPE(t) != r.parameter) return false;
  Ref cpu(r.is_cpu->get(t, r.is_cpu->closure));
  if (cpu.p != Py_True) {
    PyErr_Clear();
    return false;
  }
  Ref dtype(r.dtype_get->get(t, r.dtype_get->closure));
  Ref shape(r.shape->get(t, r.shape->closure));
  Ref contiguous(r.is_contiguous(t, r.no_args, nullptr));
  if (!dtype.p || !shape.p || !contiguous.p || !PyTuple_Check(shape.p) || contiguous.p != Py_True ||
      PyTuple_GET_SIZE(shape.p) > kHostMaxDims) {
    PyErr_Clear();
    return false;
  }
  out.int_bytes = dtype.p == r.int32 ? 4 : dtype.p == r.int64 ? 8 : 0;
  out.ndim = PyTuple_GET_SIZE(shape.p);
  out.numel = 1;
  for (int64_t d = 0; d < out.ndim; ++d) {
    PyObject* size = PyTuple_GET_ITEM(shape.p, d);
    out.sizes[d] = PyLong_CheckExact(size) ? PyLong_AsLongLong(size) : -1;
    if (out.sizes[d] < 0) {
      PyErr_Clear();
      return false;
    }
    out.numel *= out.sizes[d];
  }
  out.data = nullptr;
  if (out.numel) {
    Ref pointer(r.data_ptr(t, nullptr));   // the class's method: a tensor's own attribute must not answer
    out.data = pointer.p ? PyLong_AsVoidPtr(pointer.p) : nullptr;
    if (!out.data) {
      PyErr_Clear();
      return false;
    }
  }
  return true;
}

bool tensor_layout(PyObject* t, Layout& out) {
  if (Py_TYPE(t) != r.tensor && Py_TYPE(t) != r.parameter) return false;
  Ref shape(r.shape->get(t, r.shape->closure));
  Ref strides(r.stride(t, r.no_args, nullptr));
  Ref itemsize(r.element_size(t, nullptr));
  if (!shape.p || !strides.p || !itemsize.p || !PyTuple_Check(shape.p) || !PyTuple_Check(strides.p) ||
      PyTuple_GET_SIZE(shape.p) != PyTuple_GET_SIZE(strides.p) || PyTuple_GET_SIZE(shape.p) > kHostMaxDims ||
      !PyLong_CheckExact(itemsize.p)) {
    PyErr_Clear();
    return false;
  }
  out.ndim = PyTuple_GET_SIZE(shape.p);
  out.numel = 1;
  for (int64_t d = 0; d < out.ndim; ++d) {
    PyObject* size = PyTuple_GET_ITEM(shape.p, d);
    PyObject* stride = PyTuple_GET_ITEM(strides.p, d);
    if (!PyLong_CheckExact(size) || !PyLong_CheckExact(stride)) return false;   // SymInts
    out.sizes[d] = PyLong_AsLongLong(size);
    out.strides[d] = PyLong_AsLongLong(stride);
    if (out.sizes[d] < 0 || PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    out.numel *= out.sizes[d];
  }
  out.itemsize = PyLong_AsLongLong(itemsize.p);
  Ref pointer(r.data_ptr(t, nullptr));
  out.address = pointer.p ? reinterpret_cast<uintptr_t>(PyLong_AsVoidPtr(pointer.p)) : 0;
  if (!pointer.p || PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

}  // namespace glm5_bindings

namespace {

PyMethodDef methods[] = {
    {"call_key", glm5_bindings::fastcall<call_key>(), METH_FASTCALL,
     "call_key(plan, pin, *args): the metadata an op's check reads, as one hashable key, or None "
     "(csrc/bindings_tensors.cpp)"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

void glm5_bind_tensor_reading(pybind11::module_& m) {
  init_readers();
  if (PyModule_AddFunctions(m.ptr(), methods) != 0) throw pybind11::error_already_set();
  m.def("tensor_reading", [] { return std::string(r.ok ? "getters" : ""); },
        "how call_key and the value checks read tensors: 'getters' (torch.Tensor's C getters), or '' "
        "(they did not resolve at import: call_key always returns None, the value checks always decline)");
}
