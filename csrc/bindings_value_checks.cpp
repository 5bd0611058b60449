// The value checks (csrc/value_checks.h) as glm5_hal._C functions taking the int tensors
// themselves: glm5_hal.checks calls each once per check, and the tensor is read here
// (bindings_tensors.h: host_tensor) instead of through five Python attribute reads per tensor.
// Each returns None when its tensors are not what the native scan reads (not contiguous int32
// or int64 CPU tensors of the expected ranks, bounds beyond int64): glm5_hal.checks then runs
// the torch formulation, which is also the one for other devices.
#include <Python.h>

#include <cstdint>

#include "bindings_tensors.h"
#include "core.h"
#include "value_checks.h"

namespace {

using glm5_bindings::HostData;
using glm5_bindings::host_reading;
using glm5_bindings::host_tensor;

glm5::DType int_dtype(const HostData& h) { return h.int_bytes == 4 ? glm5::DType::I32 : glm5::DType::I64; }

bool int_arg(PyObject* v, int64_t& out) {
  if (!PyLong_Check(v)) return false;
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(v, &overflow);
  if (overflow || (out == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  return true;
}

bool arity(const char* name, Py_ssize_t nargs, Py_ssize_t expected) {
  if (nargs == expected) return true;
  PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, expected, nargs);
  return false;
}

// first_outside(t, low, high, allowed | None) -> flat index or -1
PyObject* first_outside(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("first_outside", nargs, 4)) return nullptr;
  HostData t;
  int64_t low, high, allowed = 0;
  const bool has_allowed = args[3] != Py_None;
  if (!host_reading() || !host_tensor(args[0], t) || !t.int_bytes || !int_arg(args[1], low) || !int_arg(args[2], high) ||
      (has_allowed && !int_arg(args[3], allowed)))
    Py_RETURN_NONE;
  return PyLong_FromLongLong(glm5::first_outside(t.data, t.numel, int_dtype(t), low, high, has_allowed, allowed));
}

// smallest_repeat(t) -> the smallest value >= 0 given more than once, or -1
PyObject* smallest_repeat(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("smallest_repeat", nargs, 1)) return nullptr;
  HostData t;
  if (!host_reading() || !host_tensor(args[0], t) || !t.int_bytes) Py_RETURN_NONE;
  return PyLong_FromLongLong(glm5::smallest_repeat(t.data, t.numel, int_dtype(t)));
}

// sum_of(t) -> the sum as an int
PyObject* sum_of(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("sum_of", nargs, 1)) return nullptr;
  HostData t;
  if (!host_reading() || !host_tensor(args[0], t) || !t.int_bytes) Py_RETURN_NONE;
  return PyLong_FromLongLong(glm5::sum_of(t.data, t.numel, int_dtype(t)));
}

// first_bad_block(block_table [B, max_blocks] int32, context_lens [B] int32, block_size,
// num_blocks) -> (b, j), (-1, -1) if none
PyObject* first_bad_block(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("first_bad_block", nargs, 4)) return nullptr;
  HostData table, lens;
  int64_t block_size, num_blocks;
  if (!host_reading() || !host_tensor(args[0], table) || !host_tensor(args[1], lens) || table.int_bytes != 4 || lens.int_bytes != 4 ||
      table.ndim != 2 || lens.ndim != 1 || lens.sizes[0] != table.sizes[0] || !int_arg(args[2], block_size) ||
      !int_arg(args[3], num_blocks) || block_size < 1)
    Py_RETURN_NONE;
  if (table.numel == 0) return Py_BuildValue("(LL)", -1LL, -1LL);
  const auto [b, j] = glm5::first_bad_block(static_cast<const int32_t*>(table.data), table.sizes[0], table.sizes[1],
                                            table.sizes[1], static_cast<const int32_t*>(lens.data), block_size,
                                            num_blocks);
  return Py_BuildValue("(LL)", static_cast<long long>(b), static_cast<long long>(j));
}

// first_bad_paging(block_table [B, max_blocks] int32, context_lens [B] int32, block_size,
// num_blocks) -> (kind, b, j): (1, b, -1) for the first context_lens[b] outside
// [0, max_blocks * block_size], else (2, b, j) for the first block in use whose id is outside
// [0, num_blocks), else (0, -1, -1). Each tensor read once: the paged ops' whole value check.
PyObject* first_bad_paging(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("first_bad_paging", nargs, 4)) return nullptr;
  HostData table, lens;
  int64_t block_size, num_blocks;
  if (!host_reading() || !host_tensor(args[0], table) || !host_tensor(args[1], lens) || table.int_bytes != 4 ||
      lens.int_bytes != 4 || table.ndim != 2 || lens.ndim != 1 || lens.sizes[0] != table.sizes[0] ||
      !int_arg(args[2], block_size) || !int_arg(args[3], num_blocks) || block_size < 1 ||
      table.sizes[1] > INT64_MAX / block_size)
    Py_RETURN_NONE;
  const int64_t batch = table.sizes[0], max_blocks = table.sizes[1];
  const auto* context_lens = static_cast<const int32_t*>(lens.data);
  const int64_t b = glm5::first_outside(lens.data, lens.numel, glm5::DType::I32, 0, max_blocks * block_size + 1,
                                        false, 0);
  if (b >= 0) return Py_BuildValue("(iLL)", 1, static_cast<long long>(b), -1LL);
  if (table.numel == 0) return Py_BuildValue("(iLL)", 0, -1LL, -1LL);
  const auto [bad_b, j] = glm5::first_bad_block(static_cast<const int32_t*>(table.data), batch, max_blocks,
                                                max_blocks, context_lens, block_size, num_blocks);
  return Py_BuildValue("(iLL)", bad_b < 0 ? 0 : 2, static_cast<long long>(bad_b), static_cast<long long>(j));
}

// first_bad_range(start [n] int32, end [n] int32, num_keys) -> (kind, t) (value_checks.h)
PyObject* first_bad_range(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("first_bad_range", nargs, 3)) return nullptr;
  HostData start, end;
  int64_t num_keys;
  if (!host_reading() || !host_tensor(args[0], start) || !host_tensor(args[1], end) || start.int_bytes != 4 || end.int_bytes != 4 ||
      start.numel != end.numel || !int_arg(args[2], num_keys))
    Py_RETURN_NONE;
  if (start.numel == 0) return Py_BuildValue("(iL)", 0, -1LL);
  const auto [kind, t] = glm5::first_bad_range(static_cast<const int32_t*>(start.data),
                                               static_cast<const int32_t*>(end.data), start.numel, num_keys);
  return Py_BuildValue("(iL)", kind, static_cast<long long>(t));
}

using glm5_bindings::fastcall;

PyMethodDef methods[] = {
    {"first_outside", fastcall<first_outside>(), METH_FASTCALL,
     "first_outside(t, low, high, allowed): flat index of the first element outside [low, high) other than "
     "allowed (None: no exception), -1 if none; None if t is not a contiguous int32/int64 CPU tensor"},
    {"smallest_repeat", fastcall<smallest_repeat>(), METH_FASTCALL,
     "smallest_repeat(t): the smallest value >= 0 occurring more than once, -1 if none; None as first_outside"},
    {"sum_of", fastcall<sum_of>(), METH_FASTCALL, "sum_of(t): the sum; None as first_outside"},
    {"first_bad_block", fastcall<first_bad_block>(), METH_FASTCALL,
     "first_bad_block(block_table, context_lens, block_size, num_blocks): (b, j) of the first block in use "
     "whose id is outside [0, num_blocks), (-1, -1) if none; None unless both are contiguous int32 CPU tensors"},
    {"first_bad_paging", fastcall<first_bad_paging>(), METH_FASTCALL,
     "first_bad_paging(block_table, context_lens, block_size, num_blocks): (1, b, -1) for the first context_lens[b] "
     "outside [0, max_blocks * block_size], else (2, b, j) for the first block in use whose id is outside "
     "[0, num_blocks), else (0, -1, -1); None unless both are contiguous int32 CPU tensors"},
    {"first_bad_range", fastcall<first_bad_range>(), METH_FASTCALL,
     "first_bad_range(start, end, num_keys): (1, t) for the first end outside [0, num_keys], else (2, t) for the "
     "first start < 0 or > end, else (0, -1); None unless both are contiguous int32 CPU tensors"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

void glm5_bind_value_checks(pybind11::module_& m) {
  if (PyModule_AddFunctions(m.ptr(), methods) != 0) throw pybind11::error_already_set();
}
