#include "view.h"

namespace glm5 {

int64_t View::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= size[d];
  return n;
}

namespace {

View with_sizes(const void* data, DType dtype, std::initializer_list<int64_t> sizes) {
  GLM5_REQUIRE(sizes.size() <= static_cast<size_t>(kMaxDims), "View", "sizes", "at most " + str(kMaxDims) + " dims",
               str(static_cast<int64_t>(sizes.size())));
  View v;
  v.data = const_cast<void*>(data);
  v.dtype = dtype;
  v.ndim = static_cast<int>(sizes.size());
  int d = 0;
  for (int64_t s : sizes) v.size[d++] = s;
  return v;
}

}  // namespace

View strided(const void* data, DType dtype, std::initializer_list<int64_t> sizes,
             std::initializer_list<int64_t> strides) {
  GLM5_REQUIRE(strides.size() == sizes.size(), "View", "strides", "as many strides as sizes",
               str(static_cast<int64_t>(strides.size())));
  View v = with_sizes(data, dtype, sizes);
  int d = 0;
  for (int64_t s : strides) v.stride[d++] = s;
  return v;
}

View dense(const void* data, DType dtype, std::initializer_list<int64_t> sizes) {
  View v = with_sizes(data, dtype, sizes);
  int64_t step = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.stride[d] = step;
    step *= v.size[d];
  }
  return v;
}

std::string shape_str(const View& v) {
  std::string s = "[";
  for (int d = 0; d < v.ndim; ++d) s += (d ? ", " : "") + str(v.size[d]);
  return s + "]";
}

namespace {

std::string strides_str(const View& v) {
  std::string s = "[";
  for (int d = 0; d < v.ndim; ++d) s += (d ? ", " : "") + str(v.stride[d]);
  return s + "]";
}

void require_sizes_and_data(const View& v, const char* op, const char* arg) {
  bool ok = v.ndim >= 0 && v.ndim <= kMaxDims;
  for (int d = 0; ok && d < v.ndim; ++d) ok = v.size[d] >= 0;
  GLM5_REQUIRE(ok, op, arg, "sizes >= 0", "shape " + shape_str(v));
  GLM5_REQUIRE(v.data != nullptr || v.numel() == 0, op, arg, "a non-null data pointer", "null");
}

// The row stride of v's leading dims merged into one (rows_of), or false if they do not merge.
bool merged_row_stride(const View& v, int64_t* row_stride) {
  const int last = v.ndim - 1;
  *row_stride = v.size[last];
  int64_t rows = 1;
  for (int d = 0; d < last; ++d) rows *= v.size[d];
  if (rows <= 1) return true;
  // The innermost leading dim of size > 1 sets the row stride; every outer one must step over
  // exactly the rows inside it.
  int inner = -1;
  for (int d = last - 1; d >= 0; --d) {
    if (v.size[d] == 1) continue;
    if (inner < 0) *row_stride = v.stride[d];
    else if (v.stride[d] != v.stride[inner] * v.size[inner]) return false;
    inner = d;
  }
  return true;
}

bool is_contiguous(const View& v) {
  int64_t step = 1;
  bool contiguous = true;
  for (int d = v.ndim - 1; d >= 0; --d) {
    if (v.size[d] != 1) contiguous = contiguous && v.stride[d] == step;
    step *= v.size[d];
  }
  return contiguous || step == 0;
}

bool unit_last(const View& v) { return v.ndim == 0 || v.size[v.ndim - 1] <= 1 || v.stride[v.ndim - 1] == 1; }

// Each stride of a dim of size > 1 at least the extent of the dims inside it.
bool disjoint(const View& v) {
  if (v.numel() == 0) return true;
  int64_t extent = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    if (v.size[d] == 1) continue;
    if (v.stride[d] < extent) return false;
    extent += (v.size[d] - 1) * v.stride[d];
  }
  return true;
}

}  // namespace

bool has_layout(const View& v, Layout l) {
  int64_t row_stride;
  switch (l) {
    case Layout::Dense: return is_contiguous(v);
    case Layout::Rows: return v.ndim >= 1 && unit_last(v) && merged_row_stride(v, &row_stride) && row_stride >= 0;
    case Layout::UnitLast: return unit_last(v);
    case Layout::Disjoint: return unit_last(v) && disjoint(v);
    case Layout::Scales: return disjoint(v);
  }
  return false;
}

Rows rows_of(const View& v, const char* op, const char* arg) {
  GLM5_REQUIRE(v.ndim >= 1, op, arg, "at least 1 dim", "a 0-dim view");
  require_sizes_and_data(v, op, arg);
  const int last = v.ndim - 1;
  const int64_t cols = v.size[last];
  GLM5_REQUIRE(unit_last(v), op, arg, "a unit stride along the last dim", "strides " + strides_str(v));
  int64_t rows = 1;
  for (int d = 0; d < last; ++d) rows *= v.size[d];
  int64_t row_stride;
  GLM5_REQUIRE(merged_row_stride(v, &row_stride), op, arg,
               "leading dims that merge into one row stride (reshape(-1, " + str(cols) + ") without a copy)",
               "shape " + shape_str(v) + ", strides " + strides_str(v));
  return Rows{v.data, v.dtype, rows, cols, row_stride};
}

void require_ndim(const View& v, int n, const char* op, const char* arg) {
  GLM5_REQUIRE(v.ndim == n, op, arg, str(n) + " dims", str(v.ndim) + " (shape " + shape_str(v) + ")");
}

void require_dtype(const View& v, DType d, const char* op, const char* arg) {
  GLM5_REQUIRE(v.dtype == d, op, arg, std::string("dtype ") + dtype_name(d), dtype_name(v.dtype));
}

void require_dtype_of(const View& v, const View& like, const char* op, const char* arg, const char* like_arg) {
  GLM5_REQUIRE(v.dtype == like.dtype, op, arg, "dtype " + dtype_name(like.dtype) + " (that of '" + like_arg + "')",
               dtype_name(v.dtype));
}

void require_dense(const View& v, std::initializer_list<int64_t> sizes, const char* op, const char* arg) {
  bool same = v.ndim == static_cast<int>(sizes.size());
  int d = 0;
  for (int64_t s : sizes) same = same && v.size[d++] == s;
  if (!same) {
    View want;
    want.ndim = static_cast<int>(sizes.size());
    d = 0;
    for (int64_t s : sizes) want.size[d++] = s;
    throw InvalidInput(op, arg, "shape " + shape_str(want), shape_str(v));
  }
  require_contiguous(v, op, arg);
}

int64_t require_paged(const View& v, const char* op, const char* arg) {
  require_sizes_and_data(v, op, arg);
  GLM5_REQUIRE(v.ndim >= 1, op, arg, "a paged cache [num_blocks, ...]", "0 dims");
  int64_t extent = 1;
  bool dense_block = true;
  for (int d = v.ndim - 1; d >= 1; --d) {
    if (v.size[d] != 1 && v.stride[d] != extent) dense_block = false;
    extent *= v.size[d];
  }
  const bool disjoint = v.size[0] <= 1 || extent == 0 || v.stride[0] >= extent;
  GLM5_REQUIRE(dense_block && disjoint, op, arg,
               "a paged layout (each block row-major contiguous, blocks not overlapping)",
               "strides " + strides_str(v) + " for shape " + shape_str(v));
  return v.size[0] <= 1 ? extent : v.stride[0];
}

void require_contiguous(const View& v, const char* op, const char* arg) {
  require_sizes_and_data(v, op, arg);
  GLM5_REQUIRE(is_contiguous(v), op, arg, "a contiguous tensor", "strides " + strides_str(v));
}

}  // namespace glm5
