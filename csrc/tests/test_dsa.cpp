// Native tests of the DSA kernels (built with -DGLM5_HAL_NATIVE_TESTS=ON; run `ctest` or the
// binary). Each kernel is compared with a naive float64 implementation on every instruction
// tier the CPU has, over odd sizes; invalid inputs must throw glm5::InvalidInput before any
// output is written. Every buffer is a std::vector of exactly the size the layout needs, so a
// build with -DGLM5_HAL_SANITIZE=ON turns any out-of-bounds access into a failure.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "dsa.h"
#include "dsa_kernels.h"
#include "dsa_select.h"

#include "check.h"

using glm5::DType;
using glm5::View;

namespace {

using glm5_test::g_checks;
using glm5_test::name;
using glm5_test::g_failures;
using glm5_test::randint;
using glm5_test::randn;
using glm5_test::rng;

// Values of dtype D, stored as raw elements, plus their exact float values.
struct Tensor {
  DType dtype;
  std::vector<uint16_t> h;  // F16 / BF16
  std::vector<float> f;     // F32
  std::vector<uint8_t> b;   // F8E4M3
  std::vector<double> value;
  const void* data() const {
    if (dtype == DType::F32) return f.data();
    if (dtype == DType::F8E4M3) return b.data();
    return h.data();
  }
};

Tensor make(DType d, size_t n, float scale = 1.0f) {
  Tensor t{d, {}, {}, {}, {}};
  t.value.resize(n);
  if (d == DType::F32) t.f.resize(n);
  else if (d == DType::F8E4M3) t.b.resize(n);
  else t.h.resize(n);
  const float* table = glm5::dsa::fp8_table();
  for (size_t i = 0; i < n; ++i) {
    const float x = randn() * scale;
    switch (d) {
      case DType::F32: t.f[i] = x; t.value[i] = x; break;
      case DType::F16: t.h[i] = glm5::f32_to_f16(x); t.value[i] = glm5::f16_to_f32(t.h[i]); break;
      case DType::BF16: t.h[i] = glm5::f32_to_bf16(x); t.value[i] = glm5::bf16_to_f32(t.h[i]); break;
      default: {
        uint8_t code;
        do code = static_cast<uint8_t>(randint(0, 255)); while ((code & 0x7f) == 0x7f);  // no nan
        t.b[i] = code;
        t.value[i] = table[code];
      }
    }
  }
  return t;
}

double out_value(DType d, const std::vector<uint8_t>& raw, size_t i) {
  switch (d) {
    case DType::F32: { float v; std::memcpy(&v, raw.data() + 4 * i, 4); return v; }
    case DType::F16: { uint16_t v; std::memcpy(&v, raw.data() + 2 * i, 2); return glm5::f16_to_f32(v); }
    default: { uint16_t v; std::memcpy(&v, raw.data() + 2 * i, 2); return glm5::bf16_to_f32(v); }
  }
}

size_t esize(DType d) { return d == DType::F32 ? 4 : 2; }

double rel_tol(DType d) { return d == DType::F32 ? 1e-5 : d == DType::F16 ? 2e-3 : 2e-2; }

// Runs f; true iff it threw glm5::InvalidInput.
bool throws_invalid(const std::function<void()>& f) {
  try {
    f();
  } catch (const glm5::InvalidInput&) {
    return true;
  }
  return false;
}

// ---- select ------------------------------------------------------------------------------

void test_select() {
  glm5::dsa::SelectScratch scratch;
  for (int trial = 0; trial < 300; ++trial) {
    const int n = randint(0, 3000);
    const int k = randint(1, 3100);
    std::vector<float> v(static_cast<size_t>(n));
    const int mode = trial % 4;
    for (auto& x : v) {
      x = mode == 0 ? randn() : static_cast<float>(randint(-3, 3));  // many ties
      if (mode == 2 && randint(0, 20) == 0) x = -std::numeric_limits<float>::infinity();
      if (mode == 3 && randint(0, 50) == 0) x = std::numeric_limits<float>::quiet_NaN();
    }
    std::vector<int32_t> sel(static_cast<size_t>(std::max(n, 1)));
    const int64_t got = glm5::dsa::select_topk(v.data(), n, k, sel.data(), scratch);
    const int64_t want = std::min(n, k);
    CHECK(got == want, "n=%d k=%d got %lld", n, k, static_cast<long long>(got));
    std::vector<uint32_t> keys(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) keys[i] = glm5::dsa::order_key(v[i]);
    std::vector<uint32_t> sorted = keys;
    std::sort(sorted.begin(), sorted.end(), std::greater<uint32_t>());
    std::vector<char> seen(static_cast<size_t>(n), 0);
    bool ok = true;
    for (int64_t i = 0; i < got; ++i) {
      const int32_t s = sel[i];
      if (s < 0 || s >= n || seen[s]) { ok = false; break; }
      seen[s] = 1;
      if (keys[s] < sorted[want - 1]) ok = false;  // at least the k-th largest
    }
    CHECK(ok, "select n=%d k=%d mode=%d", n, k, mode);
  }
}

// ---- conversions and exp -----------------------------------------------------------------

void test_tier_helpers(const glm5::dsa::Kernels& K) {
  const float* table = glm5::dsa::fp8_table();
  std::vector<uint8_t> codes(256);
  for (int i = 0; i < 256; ++i) codes[i] = static_cast<uint8_t>(i);
  std::vector<float> f(256);
  std::vector<uint16_t> h(256);
  K.to_f32(DType::F8E4M3, codes.data(), 256, f.data());
  K.fp8_to_bf16(codes.data(), 256, h.data());
  int bad = 0;
  for (int i = 0; i < 256; ++i) {
    const float want = table[i];
    const float bf = glm5::bf16_to_f32(h[i]);
    if (std::isnan(want)) {
      bad += !std::isnan(f[i]) || !std::isnan(bf);
    } else {
      bad += f[i] != want || bf != want;
    }
  }
  CHECK(bad == 0, "tier %d: %d fp8 codes convert wrongly", K.isa, bad);
  CHECK(table[0x7e] == 448.0f && table[0x01] == std::ldexp(1.0f, -9) && std::isnan(table[0xff]), "fp8 table");

  // exp inside softmax_tile: one column, scale 1, so s <- exp(s - max(s))
  const int n = 4096;
  std::vector<float> s(static_cast<size_t>(n) * 16, 0.0f);
  for (int i = 0; i < n; ++i) s[static_cast<size_t>(i) * 16] = -100.0f * i / (n - 1);
  std::vector<float> in = s;
  float m[16], l[16], alpha[16];
  std::fill(m, m + 16, -std::numeric_limits<float>::infinity());
  std::fill(l, l + 16, 0.0f);
  K.softmax_tile(s.data(), n, 16, 1.0f, m, l, alpha);
  double worst = 0;
  for (int i = 0; i < n; ++i) {
    const double want = std::exp(static_cast<double>(in[static_cast<size_t>(i) * 16]));
    const double got = s[static_cast<size_t>(i) * 16];
    if (want > 1e-37) worst = std::max(worst, std::fabs(got - want) / want);
  }
  CHECK(worst < 4e-7, "tier %d: exp relative error %g", K.isa, worst);
  CHECK(m[0] == 0.0f && alpha[0] == 0.0f, "tier %d: running max / alpha", K.isa);
}

// ---- naive references --------------------------------------------------------------------

// Attention of one query (heads x dqk values) over the given key rows (each dqk values).
void naive_attention(const double* q, int64_t heads, int64_t dqk, const std::vector<const double*>& rows, double scale,
                     int64_t dv, double* out, double* lse) {
  for (int64_t h = 0; h < heads; ++h) {
    if (rows.empty()) {
      std::fill(out + h * dv, out + (h + 1) * dv, 0.0);
      lse[h] = -std::numeric_limits<double>::infinity();
      continue;
    }
    std::vector<double> z(rows.size());
    double mx = -1e300;
    for (size_t j = 0; j < rows.size(); ++j) {
      double acc = 0;
      for (int64_t d = 0; d < dqk; ++d) acc += q[h * dqk + d] * rows[j][d];
      z[j] = acc * scale;
      mx = std::max(mx, z[j]);
    }
    double sum = 0;
    for (double& x : z) sum += (x = std::exp(x - mx));
    for (int64_t d = 0; d < dv; ++d) {
      double acc = 0;
      for (size_t j = 0; j < rows.size(); ++j) acc += z[j] * rows[j][d];
      out[h * dv + d] = acc / sum;
    }
    lse[h] = mx + std::log(sum);
  }
}

bool close_outputs(DType d, const std::vector<uint8_t>& out, const std::vector<float>& lse,
                   const std::vector<double>& want_out, const std::vector<double>& want_lse, std::string* why) {
  const double rt = rel_tol(d);
  for (size_t i = 0; i < want_out.size(); ++i) {
    const double got = out_value(d, out, i);
    if (!(std::fabs(got - want_out[i]) <= 1e-5 + rt * std::fabs(want_out[i]))) {
      *why = "out[" + std::to_string(i) + "] " + std::to_string(got) + " vs " + std::to_string(want_out[i]);
      return false;
    }
  }
  for (size_t i = 0; i < want_lse.size(); ++i) {
    const bool both_inf = std::isinf(want_lse[i]) && lse[i] == want_lse[i];
    if (!both_inf && !(std::fabs(lse[i] - want_lse[i]) <= 1e-5 + 1e-5 * std::fabs(want_lse[i]))) {
      *why = "lse[" + std::to_string(i) + "] " + std::to_string(lse[i]) + " vs " + std::to_string(want_lse[i]);
      return false;
    }
  }
  return true;
}

// ---- sparse_mla_attention ----------------------------------------------------------------

void test_sparse_attention(DType d, int nthreads) {
  for (int trial = 0; trial < 12; ++trial) {
    const int64_t tokens = randint(0, 5), heads = randint(1, 70), dqk = randint(1, 80), rows = randint(0, 90);
    const int64_t topk = randint(1, 150), dv = randint(1, static_cast<int>(dqk));
    const float scale = 0.05f + 0.3f * static_cast<float>(randint(0, 10)) / 10.0f;
    Tensor q = make(d, static_cast<size_t>(tokens * heads * dqk));
    Tensor kv = make(d, static_cast<size_t>(rows * dqk));
    std::vector<int32_t> idx(static_cast<size_t>(tokens * topk));
    for (auto& x : idx) x = randint(-3, static_cast<int>(rows) + 3);
    if (tokens > 0 && trial % 3 == 0) std::fill(idx.begin(), idx.begin() + topk, -1);  // an all-invalid row
    std::vector<uint8_t> out(static_cast<size_t>(tokens * heads * dv) * esize(d));
    std::vector<float> lse(static_cast<size_t>(tokens * heads));
    glm5::sparse_mla_attention(dense(out.empty() ? nullptr : out.data(), d, {tokens, heads, dv}),
                               dense(lse.data(), DType::F32, {tokens, heads}), dense(q.data(), d, {tokens, heads, dqk}),
                               dense(rows ? kv.data() : nullptr, d, {rows, dqk}),
                               dense(idx.data(), DType::I32, {tokens, topk}), scale, nthreads);
    std::vector<double> want(static_cast<size_t>(tokens * heads * dv)), want_lse(static_cast<size_t>(tokens * heads));
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<const double*> sel;
      for (int64_t j = 0; j < topk; ++j) {
        const int32_t i = idx[static_cast<size_t>(t * topk + j)];
        if (i >= 0 && i < rows) sel.push_back(kv.value.data() + i * dqk);
      }
      naive_attention(q.value.data() + t * heads * dqk, heads, dqk, sel, scale, dv, want.data() + t * heads * dv,
                      want_lse.data() + t * heads);
    }
    std::string why;
    CHECK(close_outputs(d, out, lse, want, want_lse, &why), "sparse %s T=%lld H=%lld Dqk=%lld S=%lld topk=%lld dv=%lld: %s",
          name(d), (long long)tokens, (long long)heads, (long long)dqk, (long long)rows, (long long)topk,
          (long long)dv, why.c_str());
  }
}

// ---- paged decode ------------------------------------------------------------------------

struct Paged {
  int64_t batch, queries, block_size, max_blocks, num_blocks;
  std::vector<int32_t> block_table, context_lens;
};

Paged make_paging(int64_t batch, int64_t queries, int64_t block_size, int64_t max_ctx) {
  Paged p{batch, queries, block_size, 0, 0, {}, {}};
  p.context_lens.resize(static_cast<size_t>(batch));
  int64_t longest = 0;
  for (auto& c : p.context_lens) longest = std::max<int64_t>(longest, c = randint(0, static_cast<int>(max_ctx)));
  p.max_blocks = (longest + block_size - 1) / block_size + randint(0, 2);
  p.num_blocks = batch * p.max_blocks + randint(0, 3);
  std::vector<int32_t> ids(static_cast<size_t>(p.num_blocks));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
  std::shuffle(ids.begin(), ids.end(), rng);
  p.block_table.resize(static_cast<size_t>(batch * p.max_blocks));
  for (size_t i = 0; i < p.block_table.size(); ++i) p.block_table[i] = ids[i];
  // entries past the used blocks are padding the kernels must not read
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = (p.context_lens[b] + block_size - 1) / block_size; j < p.max_blocks; ++j)
      p.block_table[static_cast<size_t>(b * p.max_blocks + j)] = -7;
  return p;
}

const double* paged_row(const Paged& p, const Tensor& cache, int64_t dim, int64_t b, int64_t pos) {
  const int64_t block = p.block_table[static_cast<size_t>(b * p.max_blocks + pos / p.block_size)];
  return cache.value.data() + (block * p.block_size + pos % p.block_size) * dim;
}

void test_paged_attention(DType d, int nthreads, bool dense) {
  for (int trial = 0; trial < 10; ++trial) {
    const int64_t batch = randint(0, 3), queries = randint(1, 3), heads = randint(1, 40), dqk = randint(1, 70);
    const int64_t dv = randint(1, static_cast<int>(dqk)), block_size = randint(1, 9), topk = randint(1, 60);
    Paged p = make_paging(batch, queries, block_size, 70);
    Tensor cache = make(d, static_cast<size_t>(p.num_blocks * block_size * dqk));
    Tensor q = make(d, static_cast<size_t>(batch * queries * heads * dqk));
    std::vector<int32_t> idx(static_cast<size_t>(batch * queries * topk));
    for (auto& x : idx) x = randint(-2, 75);
    const View c = glm5::dense(cache.data(), d, {p.num_blocks, block_size, dqk});
    const View table = glm5::dense(p.block_table.data(), DType::I32, {batch, p.max_blocks});
    const View lens = glm5::dense(p.context_lens.data(), DType::I32, {batch});
    const int64_t nq = batch * queries;
    std::vector<uint8_t> out(static_cast<size_t>(nq * heads * dv) * esize(d));
    std::vector<float> lse(static_cast<size_t>(nq * heads));
    const View out_v = glm5::dense(out.data(), d, {batch, queries, heads, dv});
    const View lse_v = glm5::dense(lse.data(), DType::F32, {batch, queries, heads});
    const View q_v = glm5::dense(q.data(), d, {batch, queries, heads, dqk});
    if (dense)
      glm5::dense_mla_decode_paged(out_v, lse_v, q_v, c, table, lens, 0.125f, nthreads);
    else
      glm5::sparse_mla_decode_paged(out_v, lse_v, q_v, c, table, lens,
                                    glm5::dense(idx.data(), DType::I32, {batch, queries, topk}), 0.125f, nthreads);
    std::vector<double> want(static_cast<size_t>(nq * heads * dv)), want_lse(static_cast<size_t>(nq * heads));
    for (int64_t t = 0; t < nq; ++t) {
      const int64_t b = t / queries, i = t % queries, ctx = p.context_lens[static_cast<size_t>(b)];
      std::vector<const double*> sel;
      if (dense) {
        for (int64_t pos = 0; pos < std::max<int64_t>(0, ctx - queries + i + 1); ++pos)
          sel.push_back(paged_row(p, cache, dqk, b, pos));
      } else {
        for (int64_t j = 0; j < topk; ++j) {
          const int32_t pos = idx[static_cast<size_t>(t * topk + j)];
          if (pos >= 0 && pos < ctx) sel.push_back(paged_row(p, cache, dqk, b, pos));
        }
      }
      naive_attention(q.value.data() + t * heads * dqk, heads, dqk, sel, 0.125, dv, want.data() + t * heads * dv,
                      want_lse.data() + t * heads);
    }
    std::string why;
    CHECK(close_outputs(d, out, lse, want, want_lse, &why), "%s %s B=%lld N=%lld H=%lld: %s",
          dense ? "dense" : "sparse-paged", name(d), (long long)batch, (long long)queries, (long long)heads,
          why.c_str());
  }
}

// ---- indexer -----------------------------------------------------------------------------

// logits of one query (heads x dim) against one key row.
double naive_logit(const double* q, const double* w, int64_t heads, int64_t dim, const double* key, double key_scale) {
  double total = 0;
  for (int64_t h = 0; h < heads; ++h) {
    double dot = 0;
    for (int64_t d = 0; d < dim; ++d) dot += q[h * dim + d] * key[d] * key_scale;
    total += w[h] * std::max(dot, 0.0);
  }
  return total;
}

double naive_logit_bound(const double* q, const double* w, int64_t heads, int64_t dim, const double* key,
                         double key_scale) {
  double total = 0;
  for (int64_t h = 0; h < heads; ++h) {
    double dot = 0;
    for (int64_t d = 0; d < dim; ++d) dot += std::fabs(q[h * dim + d] * key[d] * key_scale);
    total += std::fabs(w[h]) * dot;
  }
  return total;
}

// Checks a top-k row: count, distinct, in range, left-packed, and every selected logit at
// least the k-th largest minus the fp32 error bound.
bool topk_row_ok(const int32_t* row, int64_t topk, const std::vector<double>& logits, const std::vector<double>& bound,
                 int64_t lo, int64_t hi, std::string* why) {
  const int64_t count = std::min(topk, std::max<int64_t>(0, hi - lo));
  std::vector<double> sorted(logits.begin() + lo, logits.begin() + std::max(lo, hi));
  std::sort(sorted.begin(), sorted.end(), std::greater<double>());
  std::vector<int32_t> seen;
  for (int64_t j = 0; j < topk; ++j) {
    const int32_t p = row[j];
    if (j >= count) {
      if (p != -1) { *why = "padding entry " + std::to_string(p); return false; }
      continue;
    }
    if (p < lo || p >= hi) { *why = "position " + std::to_string(p) + " out of range"; return false; }
    if (std::find(seen.begin(), seen.end(), p) != seen.end()) { *why = "duplicate"; return false; }
    seen.push_back(p);
    const double tol = 1e-5 * bound[static_cast<size_t>(p)] + 1e-5;
    if (logits[static_cast<size_t>(p)] < sorted[static_cast<size_t>(count - 1)] - tol) {
      *why = "position " + std::to_string(p) + " is not among the top " + std::to_string(count);
      return false;
    }
  }
  return true;
}

void test_indexer(DType d, bool fp8, int nthreads) {
  for (int trial = 0; trial < 10; ++trial) {
    const int64_t tokens = randint(0, 12), heads = randint(1, 40), dim = randint(1, 70), rows = randint(0, 300);
    const int64_t topk = randint(1, 80);
    Tensor q = make(d, static_cast<size_t>(tokens * heads * dim));
    Tensor k = make(fp8 ? DType::F8E4M3 : d, static_cast<size_t>(rows * dim));
    std::vector<float> kscale(static_cast<size_t>(rows));
    for (auto& s : kscale) s = 0.01f + 0.001f * static_cast<float>(randint(0, 100));
    std::vector<float> w(static_cast<size_t>(tokens * heads));
    std::vector<double> wd(w.size());
    for (size_t i = 0; i < w.size(); ++i) wd[i] = w[i] = randn();
    std::vector<int32_t> ks(static_cast<size_t>(tokens)), ke(static_cast<size_t>(tokens));
    for (int64_t t = 0; t < tokens; ++t) {
      ks[t] = randint(0, static_cast<int>(rows));
      ke[t] = randint(ks[t], static_cast<int>(rows));
    }
    const View keys = glm5::dense(rows ? k.data() : nullptr, k.dtype, {rows, dim});
    const glm5::ScalesIn key_scale = glm5::dense(kscale.data(), DType::F32, {rows});
    const View q_v = glm5::dense(q.data(), d, {tokens, heads, dim}), w_v = glm5::dense(w.data(), DType::F32, {tokens, heads});
    const View ks_v = glm5::dense(ks.data(), DType::I32, {tokens}), ke_v = glm5::dense(ke.data(), DType::I32, {tokens});
    std::vector<float> logits(static_cast<size_t>(tokens * rows));
    std::vector<int32_t> top(static_cast<size_t>(tokens * topk));
    glm5::indexer_logits(glm5::dense(logits.data(), DType::F32, {tokens, rows}), q_v, keys, fp8 ? &key_scale : nullptr,
                         w_v, ks_v, ke_v, nthreads);
    glm5::indexer_topk(glm5::dense(top.data(), DType::I32, {tokens, topk}), q_v, keys, fp8 ? &key_scale : nullptr, w_v,
                       ks_v, ke_v, nthreads);
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<double> want(static_cast<size_t>(rows)), bound(static_cast<size_t>(rows));
      bool ok = true;
      for (int64_t s = 0; s < rows; ++s) {
        const double sc = fp8 ? kscale[static_cast<size_t>(s)] : 1.0;
        want[s] = naive_logit(q.value.data() + t * heads * dim, wd.data() + t * heads, heads, dim,
                              k.value.data() + s * dim, sc);
        bound[s] = naive_logit_bound(q.value.data() + t * heads * dim, wd.data() + t * heads, heads, dim,
                                     k.value.data() + s * dim, sc);
        const float got = logits[static_cast<size_t>(t * rows + s)];
        if (s < ks[t] || s >= ke[t]) ok &= std::isinf(got) && got < 0;
        else ok &= std::fabs(got - want[s]) <= 1e-5 * bound[s] + 1e-6;
      }
      CHECK(ok, "indexer_logits %s fp8=%d t=%lld H=%lld D=%lld S=%lld", name(d), fp8, (long long)t, (long long)heads,
            (long long)dim, (long long)rows);
      std::string why;
      CHECK(topk_row_ok(top.data() + t * topk, topk, want, bound, ks[t], ke[t], &why),
            "indexer_topk %s fp8=%d t=%lld topk=%lld: %s", name(d), fp8, (long long)t, (long long)topk, why.c_str());
    }
  }
}

void test_indexer_paged(DType d, bool fp8, int nthreads) {
  for (int trial = 0; trial < 10; ++trial) {
    const int64_t batch = randint(0, 3), queries = randint(1, 4), heads = randint(1, 40), dim = randint(1, 70);
    const int64_t block_size = randint(1, 20), topk = randint(1, 100);
    Paged p = make_paging(batch, queries, block_size, 400);
    Tensor cache = make(fp8 ? DType::F8E4M3 : d, static_cast<size_t>(p.num_blocks * block_size * dim));
    std::vector<float> scale(static_cast<size_t>(p.num_blocks * block_size));
    for (auto& s : scale) s = 0.01f + 0.001f * static_cast<float>(randint(0, 100));
    Tensor q = make(d, static_cast<size_t>(batch * queries * heads * dim));
    std::vector<float> w(static_cast<size_t>(batch * queries * heads));
    std::vector<double> wd(w.size());
    for (size_t i = 0; i < w.size(); ++i) wd[i] = w[i] = randn();
    const View c = glm5::dense(cache.data(), cache.dtype, {p.num_blocks, block_size, dim});
    const glm5::ScalesIn c_scale = glm5::dense(scale.data(), DType::F32, {p.num_blocks, block_size});
    std::vector<int32_t> top(static_cast<size_t>(batch * queries * topk));
    glm5::indexer_topk_paged(glm5::dense(top.data(), DType::I32, {batch, queries, topk}),
                             glm5::dense(q.data(), d, {batch, queries, heads, dim}), c, fp8 ? &c_scale : nullptr,
                             glm5::dense(w.data(), DType::F32, {batch, queries, heads}),
                             glm5::dense(p.block_table.data(), DType::I32, {batch, p.max_blocks}),
                             glm5::dense(p.context_lens.data(), DType::I32, {batch}), nthreads);
    for (int64_t t = 0; t < batch * queries; ++t) {
      const int64_t b = t / queries, i = t % queries, ctx = p.context_lens[static_cast<size_t>(b)];
      const int64_t vis = std::max<int64_t>(0, ctx - queries + i + 1);
      std::vector<double> want(static_cast<size_t>(ctx)), bound(static_cast<size_t>(ctx));
      for (int64_t pos = 0; pos < ctx; ++pos) {
        const int64_t block = p.block_table[static_cast<size_t>(b * p.max_blocks + pos / block_size)];
        const double sc = fp8 ? scale[static_cast<size_t>(block * block_size + pos % block_size)] : 1.0;
        const double* key = paged_row(p, cache, dim, b, pos);
        want[pos] = naive_logit(q.value.data() + t * heads * dim, wd.data() + t * heads, heads, dim, key, sc);
        bound[pos] = naive_logit_bound(q.value.data() + t * heads * dim, wd.data() + t * heads, heads, dim, key, sc);
      }
      std::string why;
      CHECK(topk_row_ok(top.data() + t * topk, topk, want, bound, 0, vis, &why),
            "indexer_topk_paged %s fp8=%d b=%lld i=%lld ctx=%lld topk=%lld: %s", name(d), fp8, (long long)b,
            (long long)i, (long long)ctx, (long long)topk, why.c_str());
    }
  }
}

// ---- invalid inputs ----------------------------------------------------------------------

void test_invalid_inputs() {
  using glm5::dense;
  using glm5::strided;
  const int64_t T = 2, H = 3, D = 8, S = 10, topk = 4;
  std::vector<float> q(T * H * D, 1.0f), k(S * D, 1.0f), w(T * H, 1.0f);
  std::vector<int32_t> ks{0, 2}, ke{5, 10}, bad_end{5, 11}, bad_start{6, 5};
  std::vector<float> logits(T * S, 7.0f);
  std::vector<int32_t> top(T * topk, 7);
  const View q_v = dense(q.data(), DType::F32, {T, H, D}), w_v = dense(w.data(), DType::F32, {T, H});
  const View keys = dense(k.data(), DType::F32, {S, D});
  const View ks_v = dense(ks.data(), DType::I32, {T}), ke_v = dense(ke.data(), DType::I32, {T});
  const View top_v = dense(top.data(), DType::I32, {T, topk});
  auto topk_of = [&](const View& q_in, const View& k_in, const View& start, const View& end, const View& out) {
    glm5::indexer_topk(out, q_in, k_in, nullptr, w_v, start, end, 1);
  };
  auto untouched = [&] {
    return std::all_of(logits.begin(), logits.end(), [](float v) { return v == 7.0f; }) &&
           std::all_of(top.begin(), top.end(), [](int32_t v) { return v == 7; });
  };
  CHECK(throws_invalid([&] {
          glm5::indexer_logits(dense(logits.data(), DType::F32, {T, S}), q_v, keys, nullptr, w_v, ks_v,
                               dense(bad_end.data(), DType::I32, {T}), 1);
        }),
        "k_end > S");
  CHECK(throws_invalid([&] { topk_of(q_v, keys, dense(bad_start.data(), DType::I32, {T}), ke_v, top_v); }),
        "k_start > k_end");
  CHECK(throws_invalid([&] { topk_of(q_v, keys, ks_v, ke_v, dense(top.data(), DType::I32, {T, 0})); }), "topk 0");
  CHECK(throws_invalid([&] { topk_of(q_v, strided(k.data(), DType::F32, {S, D + 1}, {D, 1}), ks_v, ke_v, top_v); }),
        "key dim");
  CHECK(throws_invalid([&] { topk_of(q_v, dense(k.data(), DType::BF16, {S, D}), ks_v, ke_v, top_v); }), "key dtype");
  CHECK(throws_invalid([&] { topk_of(q_v, dense(k.data(), DType::F8E4M3, {S, D}), ks_v, ke_v, top_v); }),
        "fp8 without scale");
  CHECK(throws_invalid([&] { topk_of(dense(q.data(), static_cast<DType>(9), {T, H, D}), keys, ks_v, ke_v, top_v); }),
        "q dtype code");
  CHECK(throws_invalid([&] { topk_of(q_v, keys, ks_v, ke_v, dense(top.data(), DType::I32, {T + 1, topk})); }),
        "out rows != T");
  CHECK(untouched(), "outputs written before an error");

  // paging: context_lens beyond the table, a used block id out of range, unused ones ignored
  const int64_t bs = 4, nb = 3, maxb = 2;
  std::vector<float> cache(nb * bs * D, 1.0f);
  std::vector<int32_t> table{0, -1, 2, 1};  // sequence 0 uses block 0 only
  std::vector<int32_t> lens_ok{4, 8}, lens_long{4, 9}, lens_neg{-1, 0};
  const View c = dense(cache.data(), DType::F32, {nb, bs, D});
  const View table_v = dense(table.data(), DType::I32, {2, maxb}), lens_v = dense(lens_ok.data(), DType::I32, {2});
  std::vector<float> out(2 * H * D, 7.0f), lse(2 * H, 7.0f);
  std::vector<int32_t> ptop(2 * topk, 7), idx(2 * topk, 0);
  const View out_v = dense(out.data(), DType::F32, {2, 1, H, D}), lse_v = dense(lse.data(), DType::F32, {2, 1, H});
  const View pq = dense(q.data(), DType::F32, {2, 1, H, D}), idx_v = dense(idx.data(), DType::I32, {2, 1, topk});
  auto decode = [&](const View& tab, const View& lens) {
    glm5::sparse_mla_decode_paged(out_v, lse_v, pq, c, tab, lens, idx_v, 0.5f, 1);
  };
  auto dense_decode = [&](const View& o, const View& cache_v, const View& tab, float scale) {
    glm5::dense_mla_decode_paged(o, lse_v, pq, cache_v, tab, lens_v, scale, 1);
  };
  decode(table_v, lens_v);  // valid: block -1 is padding past context_lens[0]
  std::fill(out.begin(), out.end(), 7.0f);
  std::fill(lse.begin(), lse.end(), 7.0f);
  CHECK(throws_invalid([&] { decode(table_v, dense(lens_long.data(), DType::I32, {2})); }), "context_lens > capacity");
  CHECK(throws_invalid([&] { decode(table_v, dense(lens_neg.data(), DType::I32, {2})); }), "negative context_lens");
  std::vector<int32_t> bad_table{0, -1, 2, 3};  // block 3 of 3, used by sequence 1
  const View bad_block = dense(bad_table.data(), DType::I32, {2, maxb});
  CHECK(throws_invalid([&] { decode(bad_block, lens_v); }), "block id >= num_blocks");
  CHECK(throws_invalid([&] { dense_decode(out_v, c, bad_block, 0.5f); }), "dense: bad block id");
  CHECK(throws_invalid([&] {
          glm5::indexer_topk_paged(dense(ptop.data(), DType::I32, {2, 1, topk}), pq, c, nullptr,
                                   dense(w.data(), DType::F32, {2, 1, H}), bad_block, lens_v, 1);
        }),
        "indexer paged: bad block id");
  CHECK(throws_invalid([&] { dense_decode(dense(out.data(), DType::F32, {2, 1, H, D + 1}), c, table_v, 0.5f); }),
        "d_v > Dqk");
  CHECK(throws_invalid([&] { dense_decode(out_v, c, table_v, std::nanf("")); }), "nan sm_scale");
  CHECK(throws_invalid([&] { dense_decode(out_v, dense(cache.data(), DType::BF16, {nb, bs, D}), table_v, 0.5f); }),
        "cache dtype");
  CHECK(throws_invalid([&] { dense_decode(out_v, strided(cache.data(), DType::F32, {nb, bs, D}, {bs * D, D - 1, 1}),
                                          table_v, 0.5f); }),
        "overlapping cache rows");
  CHECK(std::all_of(out.begin(), out.end(), [](float v) { return v == 7.0f; }) &&
            std::all_of(lse.begin(), lse.end(), [](float v) { return v == 7.0f; }) &&
            std::all_of(ptop.begin(), ptop.end(), [](int32_t v) { return v == 7; }),
        "paged outputs written before an error");
  CHECK(throws_invalid([&] {
          glm5::sparse_mla_attention(dense(out.data(), DType::F32, {2, H, D}), dense(lse.data(), DType::F32, {2, H}),
                                     dense(q.data(), DType::F32, {2, H, D}),
                                     strided(k.data(), DType::F32, {S, D}, {D - 1, 1}),
                                     dense(idx.data(), DType::I32, {2, topk}), 0.5f, 1);
        }),
        "kv row stride < Dqk");
}

}  // namespace

int main() {
  test_select();
  test_invalid_inputs();
  const int top_tier = glm5::dsa_max_isa();
  for (int tier = 0; tier <= top_tier; ++tier) {
    glm5::dsa_set_isa_limit(tier);
    std::printf("tier %d\n", glm5::dsa_isa());
    const glm5::dsa::Kernels* K = &glm5::dsa::generic_kernels();
#if GLM5_DSA_X86
    if (tier == 1) K = glm5::dsa::avx2_kernels();
    if (tier == 2) K = glm5::dsa::avx512_kernels();
    if (tier == 3) K = glm5::dsa::avx512_bf16_kernels();
#endif
    test_tier_helpers(*K);
    for (DType d : {DType::F32, DType::F16, DType::BF16}) {
      for (int nthreads : {1, 3}) {
        test_sparse_attention(d, nthreads);
        test_paged_attention(d, nthreads, false);
        test_paged_attention(d, nthreads, true);
        test_indexer(d, false, nthreads);
        test_indexer(d, true, nthreads);
        test_indexer_paged(d, false, nthreads);
        test_indexer_paged(d, true, nthreads);
      }
    }
  }
  std::printf("%d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
