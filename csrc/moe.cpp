#include "moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "vec.h"

namespace glm5 {

namespace {

constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();

void check_src(const char* op, const int32_t* src, int64_t rows, int64_t flat) {
  for (int64_t r = 0; r < rows; ++r) {
    if (src[r] < 0 || src[r] >= flat)
      throw InvalidInput(op, "src", "values in [0, " + str(flat) + ") (T * k)",
                         str(src[r]) + " at index " + str(r));
  }
}

}  // namespace

namespace {

// nan compares as +inf (a total order on the keys), so nan ranks highest
// as torch.topk ranks it.
inline float rank_value(float x) { return x != x ? std::numeric_limits<float>::infinity() : x; }

// The indices of the `k` largest of v[0, n) (n >= k >= 1), by descending value, ties by index:
// one pass keeping a sorted list of the best k (k is small: 8 of 256 experts); a value joins
// only if strictly larger than the k-th, so among equals the earlier index stays ahead.
// `best` holds k floats of scratch.
void top_indices(const float* v, int64_t n, int64_t k, float* best, int32_t* out) {
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float x = rank_value(v[i]);
    if (count == k && !(x > best[k - 1])) continue;
    int64_t j = count < k ? count++ : k - 1;
    while (j > 0 && x > best[j - 1]) {
      best[j] = best[j - 1];
      out[j] = out[j - 1];
      --j;
    }
    best[j] = x;
    out[j] = static_cast<int32_t>(i);
  }
}

}  // namespace

void moe_route(const View& weights_out, const View& ids_out, const RowsIn& logits, const DenseIn* bias, int64_t n_group,
               int64_t topk_group, float routed_scaling_factor, bool norm_topk_prob, bool softmax, int num_threads) {
  const char* op = "moe_route";
  require_float(logits.dtype, op, "logits");
  require_ndim(logits, 2, op, "logits");
  const Rows lg = rows_of(logits, op, "logits");
  const int64_t tokens = lg.rows, experts = lg.cols, logits_row_stride = lg.row_stride;
  GLM5_REQUIRE(experts >= 1 && experts <= kMaxInt32, op, "logits", "E in [1, 2^31 - 1]", str(experts));
  GLM5_REQUIRE(logits_row_stride >= 0, op, "logits", "a row stride >= 0", str(logits_row_stride));
  if (bias) {
    require_float(bias->dtype, op, "bias");
    require_dense(*bias, {experts}, op, "bias");
  }
  GLM5_REQUIRE(n_group >= 1 && experts % n_group == 0, op, "n_group", "a divisor of the expert count " + str(experts),
               str(n_group));
  GLM5_REQUIRE(topk_group >= 1 && topk_group <= n_group, op, "topk_group", "an int in [1, n_group=" + str(n_group) + "]",
               str(topk_group));
  const int64_t per_group = experts / n_group;
  require_ndim(ids_out, 2, op, "ids");
  const int64_t top_k = ids_out.size[1];
  GLM5_REQUIRE(top_k >= 1 && top_k <= topk_group * per_group, op, "top_k",
               "an int in [1, " + str(topk_group * per_group) + "] (topk_group * experts per group)", str(top_k));
  GLM5_REQUIRE(std::isfinite(routed_scaling_factor), op, "routed_scaling_factor", "a finite number",
               std::to_string(routed_scaling_factor));
  require_dtype(ids_out, DType::I32, op, "ids");
  require_dense(ids_out, {tokens, top_k}, op, "ids");
  require_dtype(weights_out, DType::F32, op, "weights");
  require_dense(weights_out, {tokens, top_k}, op, "weights");
  const DType logits_dtype = logits.dtype;
  const DType bias_dtype = bias ? bias->dtype : DType::F32;
  float* weights = static_cast<float*>(weights_out.data);
  int32_t* ids = static_cast<int32_t*>(ids_out.data);
  if (tokens == 0) return;
  const vec::Kernels& K = vec::kernels();
  std::vector<float> bias_f;
  if (bias) {
    bias_f.resize(static_cast<size_t>(experts));
    K.load(bias_dtype, bias->data, experts, bias_f.data());
  }
  const int64_t es = dtype_bytes(logits_dtype);
  const char* lb = static_cast<const char*>(lg.data);
  const int nt = threads_for(tokens * experts * 16, num_threads);
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> s(static_cast<size_t>(experts)), c(static_cast<size_t>(experts));
    std::vector<float> group_score(static_cast<size_t>(n_group));
    std::vector<float> best(static_cast<size_t>(std::max(experts, n_group)));
    std::vector<int32_t> keep(static_cast<size_t>(n_group));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      K.load(logits_dtype, lb + t * logits_row_stride * es, experts, s.data());
      if (softmax) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t e = 0; e < experts; ++e) m = std::max(m, s[e]);
        float sum = 0.f;
        for (int64_t e = 0; e < experts; ++e) sum += (s[e] = std::exp(s[e] - m));
        for (int64_t e = 0; e < experts; ++e) s[e] /= sum;
      } else {
        K.sigmoid(s.data(), experts);
      }
      for (int64_t e = 0; e < experts; ++e) c[e] = bias ? s[e] + bias_f[e] : s[e];
      if (n_group > 1) {
        const int64_t top = std::min<int64_t>(2, per_group);
        int32_t top2[2];
        for (int64_t g = 0; g < n_group; ++g) {
          top_indices(c.data() + g * per_group, per_group, top, best.data(), top2);
          float sum = 0.f;
          for (int64_t i = 0; i < top; ++i) sum += c[g * per_group + top2[i]];
          group_score[g] = sum;
        }
        top_indices(group_score.data(), n_group, topk_group, best.data(), keep.data());
        std::vector<char> kept(static_cast<size_t>(n_group), 0);
        for (int64_t i = 0; i < topk_group; ++i) kept[keep[i]] = 1;
        for (int64_t g = 0; g < n_group; ++g)
          if (!kept[g])
            for (int64_t i = 0; i < per_group; ++i) c[g * per_group + i] = -std::numeric_limits<float>::infinity();
      }
      int32_t* row_ids = ids + t * top_k;
      float* row_w = weights + t * top_k;
      top_indices(c.data(), experts, top_k, best.data(), row_ids);
      float sum = 0.f;
      for (int64_t j = 0; j < top_k; ++j) sum += (row_w[j] = s[row_ids[j]]);
      const float denom = sum + 1e-20f;
      for (int64_t j = 0; j < top_k; ++j) {
        if (norm_topk_prob) row_w[j] /= denom;
        row_w[j] *= routed_scaling_factor;
      }
    }
  }
}

int64_t moe_permute_plan(const View& tokens_per_expert_out, const View& src_out, const RowsIn& ids_view) {
  const char* op = "moe_permute";
  require_dtype(ids_view, DType::I32, op, "ids");
  require_ndim(ids_view, 2, op, "ids");
  const Rows id = rows_of(ids_view, op, "ids");
  const int64_t tokens = id.rows, k = id.cols, ids_row_stride = id.row_stride;
  GLM5_REQUIRE(k >= 1, op, "ids", "shape [T, k] with k >= 1", "k = " + str(k));
  GLM5_REQUIRE(ids_row_stride >= 0, op, "ids", "a row stride >= 0", str(ids_row_stride));
  GLM5_REQUIRE(tokens * k <= kMaxInt32, op, "ids", "T * k <= 2^31 - 1 (int32 flat indices)", str(tokens * k));
  require_ndim(tokens_per_expert_out, 1, op, "tokens_per_expert");
  const int64_t num_experts = tokens_per_expert_out.size[0];
  GLM5_REQUIRE(num_experts >= 1 && num_experts <= kMaxInt32, op, "num_experts", "an int in [1, 2^31 - 1]",
               str(num_experts));
  require_dtype(tokens_per_expert_out, DType::I32, op, "tokens_per_expert");
  require_dense(tokens_per_expert_out, {num_experts}, op, "tokens_per_expert");
  require_dtype(src_out, DType::I32, op, "src");
  require_dense(src_out, {tokens * k}, op, "src");
  const int32_t* ids = static_cast<const int32_t*>(id.data);
  int32_t* tokens_per_expert = static_cast<int32_t*>(tokens_per_expert_out.data);
  int32_t* src = static_cast<int32_t*>(src_out.data);
  // Counting sort by expert: one pass to count, one to place (stable, so ascending flat
  // index within an expert). Offsets in int64: counts of one expert can reach T * k.
  std::vector<int64_t> offset(static_cast<size_t>(num_experts) + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t* row = ids + t * ids_row_stride;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = row[j];
      if (e >= 0 && e < num_experts) ++offset[e + 1];
    }
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    tokens_per_expert[e] = static_cast<int32_t>(offset[e + 1]);
    offset[e + 1] += offset[e];
  }
  const int64_t rows = offset[num_experts];
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t* row = ids + t * ids_row_stride;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = row[j];
      if (e >= 0 && e < num_experts) src[offset[e]++] = static_cast<int32_t>(t * k + j);
    }
  }
  return rows;
}

void moe_permute_gather(const View& x_perm, const RowsIn& x, const DenseIn& src_view, int64_t k, int num_threads) {
  const char* op = "moe_permute";
  require_ndim(x, 2, op, "x");
  const Rows xr = rows_of(x, op, "x");
  const int64_t tokens = xr.rows, dim = xr.cols, es = dtype_bytes(x.dtype);
  GLM5_REQUIRE(es > 0, op, "x", "a dtype of the glm5::DType enum", dtype_name(x.dtype));
  GLM5_REQUIRE(xr.row_stride >= 0, op, "x", "a row stride >= 0", str(xr.row_stride));
  GLM5_REQUIRE(k >= 1, op, "ids", "k >= 1", str(k));
  require_ndim(x_perm, 2, op, "x_perm");
  const int64_t rows = x_perm.size[0];
  require_dense(x_perm, {rows, dim}, op, "x_perm");
  require_dtype_of(x_perm, x, op, "x_perm", "x");
  require_dtype(src_view, DType::I32, op, "src");
  require_ndim(src_view, 1, op, "src");
  GLM5_REQUIRE(src_view.size[0] >= rows, op, "src", "at least M = " + str(rows) + " entries", str(src_view.size[0]));
  require_dense(src_view, {src_view.size[0]}, op, "src");
  const int32_t* src = static_cast<const int32_t*>(src_view.data);
  const int64_t row_bytes = dim * es, x_row_stride_bytes = xr.row_stride * es;
  check_src(op, src, rows, tokens * k);
  if (rows == 0 || row_bytes == 0) return;
  const char* xb = static_cast<const char*>(xr.data);
  char* ob = static_cast<char*>(x_perm.data);
  const int nt = threads_for(rows * row_bytes / 2, num_threads);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(ob + r * row_bytes, xb + (src[r] / k) * x_row_stride_bytes, static_cast<size_t>(row_bytes));
}

void moe_unpermute(const View& out, const RowsIn& y, const DenseIn& src_view, const DenseIn& weights_view,
                   int num_threads) {
  const char* op = "moe_unpermute";
  require_float(y.dtype, op, "y");
  require_ndim(y, 2, op, "y");
  const Rows yr = rows_of(y, op, "y");
  const int64_t rows = yr.rows, dim = yr.cols, y_row_stride = yr.row_stride;
  GLM5_REQUIRE(y_row_stride >= 0, op, "y", "a row stride >= 0", str(y_row_stride));
  require_dtype(weights_view, DType::F32, op, "weights");
  require_ndim(weights_view, 2, op, "weights");
  const int64_t tokens = weights_view.size[0], k = weights_view.size[1];
  GLM5_REQUIRE(k >= 1, op, "weights", "shape [T, k] with k >= 1", "k = " + str(k));
  require_dense(weights_view, {tokens, k}, op, "weights");
  GLM5_REQUIRE(tokens * k <= kMaxInt32, op, "weights", "T * k <= 2^31 - 1 (int32 flat indices)", str(tokens * k));
  require_dtype(src_view, DType::I32, op, "src");
  require_dense(src_view, {rows}, op, "src");
  require_dtype_of(out, y, op, "out", "y");
  require_dense(out, {tokens, dim}, op, "out");
  const DType dtype = y.dtype;
  const int32_t* src = static_cast<const int32_t*>(src_view.data);
  const float* weights = static_cast<const float*>(weights_view.data);
  check_src(op, src, rows, tokens * k);
  if (tokens == 0 || dim == 0) return;
  // Rows by slot t*k + j (counting sort, stable in row order): start[s]..start[s+1].
  const int64_t slots = tokens * k;
  std::vector<int32_t> start(static_cast<size_t>(slots) + 1, 0);
  std::vector<int32_t> order(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) ++start[src[r] + 1];
  for (int64_t s = 0; s < slots; ++s) start[s + 1] += start[s];
  {
    std::vector<int32_t> fill(start.begin(), start.end() - 1);
    for (int64_t r = 0; r < rows; ++r) order[fill[src[r]]++] = static_cast<int32_t>(r);
  }
  bool one_row_per_slot = true;
  for (int64_t s = 0; s < slots && one_row_per_slot; ++s) one_row_per_slot = start[s + 1] - start[s] <= 1;
  const vec::Kernels& K = vec::kernels();
  const int64_t es = dtype_bytes(dtype);
  const char* yb = static_cast<const char*>(yr.data);
  char* ob = static_cast<char*>(out.data);
  const int nt = threads_for((rows + tokens) * dim, num_threads);
#pragma omp parallel num_threads(nt)
  {
    std::vector<float> acc(static_cast<size_t>(dim)), slot_acc(static_cast<size_t>(dim));
    std::vector<const void*> row_ptrs(static_cast<size_t>(k));
    std::vector<float> row_w(static_cast<size_t>(k));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      if (one_row_per_slot) {
        int64_t n = 0;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t s = t * k + j;
          if (start[s] == start[s + 1]) continue;
          row_ptrs[n] = yb + static_cast<int64_t>(order[start[s]]) * y_row_stride * es;
          row_w[n++] = weights[s];
        }
        K.weighted_sum(dtype, row_ptrs.data(), row_w.data(), n, dim, ob + t * dim * es);
        continue;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t s = t * k + j;
        const int32_t first = start[s], last = start[s + 1];
        if (first == last) continue;
        const float w = weights[s];
        if (last - first == 1) {
          K.accumulate(dtype, yb + static_cast<int64_t>(order[first]) * y_row_stride * es, w, dim, acc.data());
          continue;
        }
        // Several rows in one slot: the weighted rows of the slot are summed first, then the
        // slot joins the token's sum (the reference's order: index_add per slot, then j).
        std::fill(slot_acc.begin(), slot_acc.end(), 0.f);
        for (int32_t i = first; i < last; ++i)
          K.accumulate(dtype, yb + static_cast<int64_t>(order[i]) * y_row_stride * es, w, dim, slot_acc.data());
        K.accumulate(DType::F32, slot_acc.data(), 1.0f, dim, acc.data());
      }
      K.store(dtype, acc.data(), dim, ob + t * dim * es);
    }
  }
}

}  // namespace glm5
