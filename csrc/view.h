// Tensors as the native kernels take them, declared once for the kernels, the bindings and the
// native tests: a strided View (data pointer, element type, sizes and strides), and the checks a
// kernel runs on a view before it touches memory. glm5_hal._C builds a View from each torch
// tensor argument (csrc/bindings.cpp) or takes a glm5_hal._C.View built by keyword; the native
// tests build them with dense() / strided().
//
// A kernel entry point takes its tensors as views (outputs first) and its options as scalars:
// sizes are read from the views, never passed a second time, so a kernel knows the extent of
// every buffer it reads or writes and checks them all (InvalidInput naming the op and argument)
// before the first access. An input's parameter type also says which layouts the kernel reads
// in place (In<Layout>), so that the bindings, not the Python wrappers, copy the rest.
#pragma once

#include <initializer_list>
#include <string>

#include "core.h"

namespace glm5 {

// Tensors of more dims cross the binding with their leading dims merged where the layout
// allows (no kernel needs more than 4).
constexpr int kMaxDims = 8;

// A strided tensor [size[0], ..., size[ndim - 1]]: element (i0, i1, ...) at
// data + (i0 * stride[0] + i1 * stride[1] + ...) elements. Non-owning; kernels never write
// through the views of their inputs.
struct View {
  void* data = nullptr;
  DType dtype = DType::F32;
  int ndim = 0;
  int64_t size[kMaxDims] = {};
  int64_t stride[kMaxDims] = {};

  int64_t numel() const;
};

// A row-major contiguous view of `sizes`.
View dense(const void* data, DType dtype, std::initializer_list<int64_t> sizes);
// A view with explicit strides (as many as sizes).
View strided(const void* data, DType dtype, std::initializer_list<int64_t> sizes,
             std::initializer_list<int64_t> strides);

// "[2, 3, 4]"
std::string shape_str(const View& v);

// A view read as a matrix [rows, cols]: cols is its last dim (contiguous), rows the product of
// the others, which must merge into one row stride (as torch's reshape(-1, cols) without a
// copy). A 1-D view is one row. row_stride is in elements; it is cols when rows <= 1. Like
// require_dense, rows_of rejects negative sizes and a null pointer to a non-empty view.
struct Rows {
  void* data;
  DType dtype;
  int64_t rows, cols, row_stride;
};
Rows rows_of(const View& v, const char* op, const char* arg);

// The layouts a kernel reads an input in place. Strides of size-1 dims never matter.
enum class Layout {
  Dense,     // row-major contiguous
  Rows,      // rows_of applies: a unit last stride, leading dims merging into one row stride (rows may overlap)
  UnitLast,  // a unit stride along the last dim, any others
  Disjoint,  // no two elements overlap (each stride at least the extent of the dims inside it), a unit last stride
  Scales,    // no two elements overlap, any last stride (per-row float8 scales)
};

// True iff a kernel reads `v` in place as an input of layout `l`.
bool has_layout(const View& v, Layout l);

// An input a kernel reads in place in layout L. Any View converts to one: the kernel checks the
// layout itself. glm5_hal._C copies a tensor argument without the layout (tensor.contiguous(),
// which has every layout) before the call; outputs are plain Views, never copied.
template <Layout L>
struct In : View {
  In() = default;
  In(const View& v) : View(v) {}  // implicit: any view may be passed, and is checked
};
using DenseIn = In<Layout::Dense>;
using RowsIn = In<Layout::Rows>;
using UnitLastIn = In<Layout::UnitLast>;
using DisjointIn = In<Layout::Disjoint>;
using ScalesIn = In<Layout::Scales>;

// ndim == n
void require_ndim(const View& v, int n, const char* op, const char* arg);
void require_dtype(const View& v, DType d, const char* op, const char* arg);
// v.dtype == like.dtype, `like` being argument `like_arg`.
void require_dtype_of(const View& v, const View& like, const char* op, const char* arg, const char* like_arg);
// Row-major contiguous (strides of size-1 dims do not matter), sizes >= 0, data non-null
// unless empty.
void require_contiguous(const View& v, const char* op, const char* arg);
// Exactly `sizes`, and require_contiguous.
void require_dense(const View& v, std::initializer_list<int64_t> sizes, const char* op, const char* arg);
// A paged cache [num_blocks, ...] written in place: each block (the dims after the first) is
// row-major contiguous and blocks do not overlap (stride[0] >= a block's extent), so block b
// starts at data + b * stride[0] elements. A contiguous cache is paged; so is one block-strided
// view of a serving engine's pages (vLLM keeps an indexer page's FP8 rows and scales side by
// side). Returns stride[0] (the block's extent when there is at most one block).
int64_t require_paged(const View& v, const char* op, const char* arg);

}  // namespace glm5
