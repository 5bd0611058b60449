// How glm5_hal._C reads torch tensors without building Python objects for each attribute
// (csrc/bindings_tensors.cpp): _C.call_key for dispatch, host_tensor for the value checks.
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <exception>
#include <new>

namespace glm5_bindings {

// A host tensor's elements, for the value checks (csrc/bindings_value_checks.cpp).
constexpr int kHostMaxDims = 8;
struct HostData {
  const void* data;   // null when empty
  int64_t int_bytes;  // 4 for int32, 8 for int64, 0 for any other dtype
  int64_t numel;
  int64_t ndim;
  int64_t sizes[kHostMaxDims];
};

// `type`'s own C getter `name` (a PyGetSetDef with a getter), or null.
PyGetSetDef* c_getset(PyObject* type, const char* name);
// `type`'s own C method `name` of calling convention `flags`, or null.
PyMethodDef* c_method(PyObject* type, const char* name, int flags);

// Whether host_tensor may read tensors now: the getters resolved at import, and no torch
// function mode is active (the getters would answer what the mode says). Asked once per
// native value check, before its host_tensor calls.
bool host_reading();

// The elements of `t` if it is an exact torch.Tensor or nn.Parameter on the CPU, contiguous,
// of at most kHostMaxDims dims; false (and the caller takes its torch path) otherwise. Read
// through torch's getters; only after host_reading() said yes.
bool host_tensor(PyObject* t, HostData& out);

// A tensor's layout (any device: nothing of its data is read), for checks on addresses.
struct Layout {
  uintptr_t address;   // data_ptr()
  int64_t itemsize;
  int64_t numel;
  int64_t ndim;
  int64_t sizes[kHostMaxDims];
  int64_t strides[kHostMaxDims];
};

// The layout of `t` if it is an exact torch.Tensor or nn.Parameter of at most kHostMaxDims
// dims with concrete sizes; false otherwise. Only after host_reading() said yes.
bool tensor_layout(PyObject* t, Layout& out);

using FastcallBody = PyObject* (*)(PyObject*, PyObject* const*, Py_ssize_t);

// A METH_FASTCALL function running `F` with C++ exceptions turned into Python ones (MemoryError
// for std::bad_alloc): they must never unwind through CPython's frames.
template <FastcallBody F>
PyObject* guarded(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  try {
    return F(self, args, nargs);
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception");
  }
  return nullptr;
}

// `F`, guarded, as a PyMethodDef's ml_meth (with METH_FASTCALL).
template <FastcallBody F>
PyCFunction fastcall() {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(&guarded<F>));
}

}  // namespace glm5_bindings

// Adds call_key and tensor_reading to glm5_hal._C (its module init, after
// torch is imported).
void glm5_bind_tensor_reading(pybind11::module_& m);

// Adds the value checks taking tensors (csrc/bindings_value_checks.cpp) to glm5_hal._C.
void glm5_bind_value_checks(pybind11::module_& m);
