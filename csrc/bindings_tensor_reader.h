// A torch.Tensor's metadata read straight from its c10::TensorImpl, for glm5_hal._C.call_key
// (csrc/bindings_tensors.cpp): about 20 ns a tensor where torch's Python getters (t.shape,
// t.dtype, t.device, t.requires_grad) take about 300 ns together, because each of those builds
// Python objects. It is its own extension module, glm5_hal._tensor_reader, built only when CMake
// finds the headers and libc10 of the torch the package is built for, so that glm5_hal._C stays
// free of libtorch: _C imports it after torch (which loads libc10) and takes this API from its
// capsule. Without it, or where it declines at import (tensor_reader_init), call_key reads
// through the getters.
#pragma once

#include <Python.h>

#include <cstdint>

namespace glm5_bindings {

struct TensorMeta {
  int64_t scalar_type;  // c10::ScalarType
  int8_t device_type;   // c10::DeviceType
  int8_t device_index;
  bool requires_grad;   // read only when asked
  bool contiguous;      // read only when asked
  int64_t ndim;
  const int64_t* sizes;  // valid while the tensor lives
};

// A host tensor's elements, for the value checks (csrc/bindings_value_checks.cpp).
constexpr int kHostMaxDims = 8;
struct HostData {
  const void* data;   // null when empty
  int64_t int_bytes;  // 4 for int32, 8 for int64, 0 for any other dtype
  int64_t numel;
  int64_t ndim;
  int64_t sizes[kHostMaxDims];
};

// The module's API, in the capsule glm5_hal._tensor_reader.api.
struct TensorReaderApi {
  int abi;  // kTensorReaderAbi
  // Whether the reader may be used with the torch now imported: the same version as the
  // headers it was compiled with, the TensorImpl found in the Python object where it is
  // expected, and sample tensors reading as their Python getters say. Call once, with the GIL
  // held, after `import torch`.
  bool (*init)(PyObject* torch);
  // The metadata of `t`, a torch.Tensor or nn.Parameter instance (the caller checks the type);
  // false when it cannot be read exactly here (symbolic or custom sizes, Python dispatch, an
  // undefined tensor), and the caller falls back. requires_grad and contiguous are read only
  // when asked (false otherwise).
  bool (*read)(PyObject* t, bool contiguity, bool grad, TensorMeta* out);
  // The elements of `t` (same caller's type check) if it is a contiguous CPU tensor of at most
  // kHostMaxDims dims whose storage holds its memory; false otherwise.
  bool (*host)(PyObject* t, HostData* out);
};
constexpr int kTensorReaderAbi = 2;
constexpr const char* kTensorReaderCapsule = "glm5_hal._tensor_reader.api";

}  // namespace glm5_bindings
