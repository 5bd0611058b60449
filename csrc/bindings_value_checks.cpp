// The value checks (csrc/value_checks.h) as glm5_hal._C functions taking the int tensors
// themselves: glm5_hal.checks calls each once per check, and the tensor is read here
// (bindings_tensors.h: host_tensor) instead of through five Python attribute reads per tensor.
// Each returns None when its tensors are not what the native scan reads (not contiguous int32
// or int64 CPU tensors of the expected ranks, bounds beyond int64; pages_apart and
// first_bad_write read the caches' layouts, sizes and addresses only, on any device):
// glm5_hal.checks then runs the torch formulation, which is also the one for other devices.
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
      table.sizes[1] > (INT64_MAX - 1) / block_size)
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

// Whether two paged caches one call writes share no byte: their address ranges are apart, or
// they interleave page by page (one page stride, disjoint spans within a page).
// glm5_hal.checks.pages_apart restated. Both have at least one dim.
bool layouts_apart(const glm5_bindings::Layout& a, const glm5_bindings::Layout& b) {
  if (a.numel == 0 || b.numel == 0) return true;
  // [low, high) of each, in bytes (__int128: no overflow on any size a tensor can have)
  auto span = [](const glm5_bindings::Layout& t, __int128& low, __int128& high, __int128& block) {
    block = t.itemsize;
    for (int64_t d = 1; d < t.ndim; ++d) block *= t.sizes[d];
    low = static_cast<__int128>(t.address);
    high = low + static_cast<__int128>(t.sizes[0] - 1) * t.strides[0] * t.itemsize + block;
  };
  __int128 a_lo, a_hi, a_block, b_lo, b_hi, b_block;
  span(a, a_lo, a_hi, a_block);
  span(b, b_lo, b_hi, b_block);
  if (a_hi <= b_lo || b_hi <= a_lo) return true;
  const __int128 page = static_cast<__int128>(a.strides[0]) * a.itemsize;
  if (a.sizes[0] == b.sizes[0] && page > 0 && page == static_cast<__int128>(b.strides[0]) * b.itemsize) {
    __int128 offset = (b_lo - a_lo) % page;
    if (offset < 0) offset += page;   // Python's modulo
    if (offset >= a_block && offset + b_block <= page) return true;
  }
  return false;
}

// pages_apart(a, b) -> bool (layouts_apart); None if either layout is not read here.
PyObject* pages_apart(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("pages_apart", nargs, 2)) return nullptr;
  glm5_bindings::Layout a, b;
  if (!host_reading() || !glm5_bindings::tensor_layout(args[0], a) || !glm5_bindings::tensor_layout(args[1], b) ||
      a.ndim < 1 || b.ndim < 1)
    Py_RETURN_NONE;
  return PyBool_FromLong(layouts_apart(a, b));
}

// (kind, at) of the slot check: (1, flat index) for the first slot outside [0, num_slots) other
// than -1, else (2, slot) for the smallest slot given twice, else (0, -1).
PyObject* slot_verdict(const HostData& t, int64_t num_slots) {
  const int64_t i = glm5::first_outside(t.data, t.numel, int_dtype(t), 0, num_slots, true, -1);
  if (i >= 0) return Py_BuildValue("(iL)", 1, static_cast<long long>(i));
  const int64_t repeated = glm5::smallest_repeat(t.data, t.numel, int_dtype(t));
  return Py_BuildValue("(iL)", repeated >= 0 ? 2 : 0, static_cast<long long>(repeated));
}

// first_bad_write(slot_mapping, cache, other | None) -> (kind, at): a paged cache write's whole
// value check in one call: (3, -1) if `other` (a second cache the call writes) shares bytes
// with `cache`, else slot_verdict with num_slots = cache's first two sizes. None if a tensor is
// not read here.
PyObject* first_bad_write(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("first_bad_write", nargs, 3)) return nullptr;
  glm5_bindings::Layout cache, other;
  HostData slots;
  const bool has_other = args[2] != Py_None;
  if (!host_reading() || !glm5_bindings::tensor_layout(args[1], cache) || cache.ndim < 2 ||
      (has_other && (!glm5_bindings::tensor_layout(args[2], other) || other.ndim < 1)) ||
      !host_tensor(args[0], slots) || !slots.int_bytes ||
      (cache.sizes[1] != 0 && cache.sizes[0] > INT64_MAX / cache.sizes[1]))   // num_slots below
    Py_RETURN_NONE;
  if (has_other && !layouts_apart(cache, other)) return Py_BuildValue("(iL)", 3, -1LL);
  return slot_verdict(slots, cache.sizes[0] * cache.sizes[1]);
}

// first_bad_slot(slot_mapping, num_slots) -> (kind, i): (1, flat index) for the first slot
// outside [0, num_slots) other than -1, else (2, slot) for the smallest slot given twice, else
// (0, -1), in one read of the slots (first_bad_write adds the caches). None as first_outside.
PyObject* first_bad_slot(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (!arity("first_bad_slot", nargs, 2)) return nullptr;
  HostData t;
  int64_t num_slots;
  if (!host_reading() || !host_tensor(args[0], t) || !t.int_bytes || !int_arg(args[1], num_slots)) Py_RETURN_NONE;
  return slot_verdict(t, num_slots);
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
    {"pages_apart", fastcall<pages_apart>(), METH_FASTCALL,
     "pages_apart(a, b): whether two paged caches share no byte (apart, or interleaved page by page); None if "
     "either is not an exact tensor of concrete sizes"},
    {"first_bad_write", fastcall<first_bad_write>(), METH_FASTCALL,
     "first_bad_write(slot_mapping, cache, other): (3, -1) if the second written cache `other` (or None) shares "
     "bytes with `cache`, else first_bad_slot's verdict with num_slots = cache.shape[0] * cache.shape[1]; None if "
     "a tensor is not read here"},
    {"first_bad_slot", fastcall<first_bad_slot>(), METH_FASTCALL,
     "first_bad_slot(slot_mapping, num_slots): (1, i) for the first slot outside [0, num_slots) other than -1, "
     "else (2, s) for the smallest slot given twice, else (0, -1); None as first_outside"},
    {"first_bad_range", fastcall<first_bad_range>(), METH_FASTCALL,
     "first_bad_range(start, end, num_keys): (1, t) for the first end outside [0, num_keys], else (2, t) for the "
     "first start < 0 or > end, else (0, -1); None unless both are contiguous int32 CPU tensors"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

void glm5_bind_value_checks(pybind11::module_& m) {
  if (PyModule_AddFunctions(m.ptr(), methods) != 0) throw pybind11::error_already_set();
}
