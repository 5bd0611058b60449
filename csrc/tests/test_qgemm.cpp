// Native tests of the quantized and grouped GEMMs (qgemm.h) and int8_quant: every tile tier
// the CPU has (portable, AVX2, AVX-VNNI, AVX-512, AMX) against a naive float64 / int64
// formulation, over sizes that leave tails in every dim (rows of a tile, 32-column panels, K
// steps and K blocks), strided inputs, zero-row experts, nan codes and K = 0; invalid inputs
// must throw glm5::InvalidInput before anything is written. Buffers are exactly sized
// std::vectors, so a sanitizer build catches any out-of-bounds access.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core.h"
#include "qgemm.h"
#include "view.h"
#include "quant.h"
#include "vec.h"

#include "check.h"

using glm5::dense;
using glm5::DType;
using glm5::strided;
using glm5::View;

namespace {

using glm5_test::g_checks;
using glm5_test::kFloats;
using glm5_test::name;
using glm5_test::g_failures;
using glm5_test::randint;
using glm5_test::randn;


double fp8_value(uint8_t code) {
  const unsigned mag = code & 0x7fu, e = mag >> 3, m = mag & 7u;
  if (mag == 0x7fu) return std::nan("");
  const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(1.0 + m / 8.0, static_cast<int>(e) - 7);
  return (code & 0x80u) ? -v : v;
}

uint8_t random_fp8() {
  for (;;) {
    const uint8_t c = static_cast<uint8_t>(randint(0, 255));
    if ((c & 0x7f) != 0x7f) return c;
  }
}

double out_value(const std::vector<uint8_t>& raw, DType d, size_t i) {
  if (d == DType::F32) { float v; std::memcpy(&v, raw.data() + 4 * i, 4); return v; }
  uint16_t h;
  std::memcpy(&h, raw.data() + 2 * i, 2);
  return d == DType::F16 ? glm5::f16_to_f32(h) : glm5::bf16_to_f32(h);
}

double out_ulp(DType d) { return d == DType::F32 ? 0.0 : d == DType::F16 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7); }

// Expert row counts; the dense ops are E = 1.
struct Layout {
  std::vector<int32_t> counts;
  int64_t m() const {
    int64_t s = 0;
    for (int32_t c : counts) s += c;
    return s;
  }
};

// Compares out [m, n] (row stride ldo) with want, each element within
// slack[i] + (ulp of the output dtype) * |want|.
void compare(const char* what, const std::vector<uint8_t>& out, DType od, int64_t m, int64_t n, int64_t ldo,
             const std::vector<double>& want, const std::vector<double>& slack, int isa) {
  int bad = 0;
  for (int64_t i = 0; i < m && bad < 3; ++i)
    for (int64_t j = 0; j < n && bad < 3; ++j) {
      const double got = out_value(out, od, i * ldo + j), w = want[i * n + j];
      const bool ok = std::isnan(w) ? std::isnan(got) : std::fabs(got - w) <= slack[i * n + j] + out_ulp(od) * std::fabs(w);
      if (!ok) {
        ++bad;
        CHECK(false, "%s isa %d out %s: [%lld, %lld] got %.9g want %.9g", what, isa, name(od), (long long)i,
              (long long)j, got, w);
      }
    }
  ++g_checks;
}

std::vector<uint8_t> sevens(DType od, int64_t elems) {
  std::vector<uint8_t> raw(static_cast<size_t>(elems * glm5::dtype_bytes(od)));
  for (int64_t i = 0; i < elems; ++i) {
    if (od == DType::F32) { const float v = 7.0f; std::memcpy(raw.data() + 4 * i, &v, 4); }
    else {
      const uint16_t h = od == DType::F16 ? glm5::f32_to_f16(7.0f) : glm5::f32_to_bf16(7.0f);
      std::memcpy(raw.data() + 2 * i, &h, 2);
    }
  }
  return raw;
}

// ---- FP8 ---------------------------------------------------------------------------------------

void run_fp8(const Layout& lay, int64_t n, int64_t k, DType od, int isa, bool with_nan) {
  const int64_t m = lay.m(), e = static_cast<int64_t>(lay.counts.size());
  const int64_t lda = k + 16, ldw = k + 3, wes = n * ldw + 5, ldo = n;
  const int64_t kb = k / 128, nb = (n + 127) / 128;
  std::vector<uint8_t> a(static_cast<size_t>(m * lda)), w(static_cast<size_t>(e * wes));
  for (auto& v : a) v = random_fp8();
  for (auto& v : w) v = random_fp8();
  std::vector<float> as(static_cast<size_t>(m * kb)), ws(static_cast<size_t>(e * nb * kb));
  for (auto& v : as) v = std::ldexp(1.0f + 0.37f * randn(), randint(-12, -4));
  for (auto& v : ws) v = std::ldexp(1.0f + 0.21f * randn(), randint(-12, -4));
  if (with_nan && m > 0 && k > 0) a[(m / 2) * lda + k - 1] = 0x7f;
  if (with_nan && e > 0 && n > 0 && k > 0) w[(n - 1) * ldw] = 0xff;
  std::vector<double> want(static_cast<size_t>(m * n)), slack(static_cast<size_t>(m * n));
  int64_t row = 0;
  for (int64_t x = 0; x < e; ++x)
    for (int64_t r = 0; r < lay.counts[x]; ++r, ++row)
      for (int64_t j = 0; j < n; ++j) {
        double sum = 0, mag = 0;
        for (int64_t kk = 0; kk < k; ++kk) {
          const double s = double(as[row * kb + kk / 128]) * ws[(x * nb + j / 128) * kb + kk / 128];
          const double t = fp8_value(a[row * lda + kk]) * fp8_value(w[x * wes + j * ldw + kk]) * s;
          sum += t;
          mag += std::fabs(t);
        }
        want[row * n + j] = sum;
        slack[row * n + j] = 1e-5 * mag + 1e-30;
      }
  auto out = sevens(od, m * ldo);
  const View ao = strided(a.data(), DType::F8E4M3, {m, k}, {lda, 1}), asv = dense(as.data(), DType::F32, {m, kb});
  const View oo = dense(out.data(), od, {m, n}), counts = dense(lay.counts.data(), DType::I32, {e});
  const std::string what = "fp8 m" + std::to_string(m) + " n" + std::to_string(n) + " k" + std::to_string(k) +
                           " e" + std::to_string(e);
  try {
    if (e == 1 && !with_nan)
      glm5::fp8_block_gemm(oo, ao, asv, strided(w.data(), DType::F8E4M3, {n, k}, {ldw, 1}),
                           dense(ws.data(), DType::F32, {nb, kb}), 2);
    else
      glm5::fp8_grouped_gemm(oo, ao, asv, strided(w.data(), DType::F8E4M3, {e, n, k}, {wes, ldw, 1}),
                             dense(ws.data(), DType::F32, {e, nb, kb}), counts, 2);
  } catch (const std::exception& ex) {
    CHECK(false, "%s threw %s", what.c_str(), ex.what());
    return;
  }
  compare(what.c_str(), out, od, m, n, ldo, want, slack, isa);
}

// ---- INT8 --------------------------------------------------------------------------------------

void run_int8(const Layout& lay, int64_t n, int64_t k, DType od, int isa, bool bias, bool extreme = false) {
  const int64_t m = lay.m(), e = static_cast<int64_t>(lay.counts.size());
  const int64_t lda = k + 5, ldw = k + 1, wes = n * ldw + 3, ldo = n;
  std::vector<int8_t> x(static_cast<size_t>(m * lda)), w(static_cast<size_t>(e * wes));
  for (auto& v : x) v = static_cast<int8_t>(extreme ? -128 : randint(-128, 127));
  for (auto& v : w) v = static_cast<int8_t>(extreme ? -128 : randint(-128, 127));
  std::vector<float> xs(static_cast<size_t>(m)), ws(static_cast<size_t>(e * n)), b(static_cast<size_t>(n));
  for (auto& v : xs) v = extreme ? 1.0f : std::ldexp(1.0f + 0.4f * randn(), randint(-10, -5));
  for (auto& v : ws) v = extreme ? std::ldexp(1.0f, -31) : std::ldexp(1.0f + 0.4f * randn(), randint(-10, -5));
  for (auto& v : b) v = randn();
  std::vector<double> want(static_cast<size_t>(m * n)), slack(static_cast<size_t>(m * n));
  int64_t row = 0;
  for (int64_t g = 0; g < e; ++g)
    for (int64_t r = 0; r < lay.counts[g]; ++r, ++row)
      for (int64_t j = 0; j < n; ++j) {
        int64_t acc = 0;
        for (int64_t kk = 0; kk < k; ++kk) acc += int64_t{x[row * lda + kk]} * w[g * wes + j * ldw + kk];
        const double v = double(acc) * xs[row] * ws[g * n + j];
        want[row * n + j] = v + (bias ? b[j] : 0.0);
        slack[row * n + j] = 4e-7 * (std::fabs(v) + (bias ? std::fabs(b[j]) : 0.0)) + 1e-30;  // float32 scaling
      }
  auto out = sevens(od, m * ldo);
  const View xo = strided(x.data(), DType::I8, {m, k}, {lda, 1}), xsv = dense(xs.data(), DType::F32, {m});
  const View oo = dense(out.data(), od, {m, n}), counts = dense(lay.counts.data(), DType::I32, {e});
  const glm5::DenseIn bv = dense(b.data(), DType::F32, {n});
  const std::string what = "int8 m" + std::to_string(m) + " n" + std::to_string(n) + " k" + std::to_string(k) +
                           " e" + std::to_string(e) + (bias ? " bias" : "");
  try {
    if (e == 1)
      glm5::int8_gemm(oo, xo, xsv, strided(w.data(), DType::I8, {n, k}, {ldw, 1}), dense(ws.data(), DType::F32, {n}),
                      bias ? &bv : nullptr, 2);
    else
      glm5::int8_grouped_gemm(oo, xo, xsv, strided(w.data(), DType::I8, {e, n, k}, {wes, ldw, 1}),
                              dense(ws.data(), DType::F32, {e, n}), counts, 2);
  } catch (const std::exception& ex) {
    CHECK(false, "%s threw %s", what.c_str(), ex.what());
    return;
  }
  compare(what.c_str(), out, od, m, n, ldo, want, slack, isa);
}

// ---- bfloat16 grouped ---------------------------------------------------------------------------

void run_bf16(const Layout& lay, int64_t n, int64_t k, int isa) {
  const int64_t m = lay.m(), e = static_cast<int64_t>(lay.counts.size());
  const int64_t lda = k + 2, ldw = k, wes = n * ldw, ldo = n;
  std::vector<uint16_t> x(static_cast<size_t>(m * lda)), w(static_cast<size_t>(e * wes));
  for (auto& v : x) v = glm5::f32_to_bf16(randn());
  for (auto& v : w) v = glm5::f32_to_bf16(randn() * 0.1f);
  std::vector<double> want(static_cast<size_t>(m * n)), slack(static_cast<size_t>(m * n));
  int64_t row = 0;
  for (int64_t g = 0; g < e; ++g)
    for (int64_t r = 0; r < lay.counts[g]; ++r, ++row)
      for (int64_t j = 0; j < n; ++j) {
        double sum = 0, mag = 0;
        for (int64_t kk = 0; kk < k; ++kk) {
          const double t = double(glm5::bf16_to_f32(x[row * lda + kk])) * glm5::bf16_to_f32(w[g * wes + j * ldw + kk]);
          sum += t;
          mag += std::fabs(t);
        }
        want[row * n + j] = sum;
        slack[row * n + j] = 1e-5 * mag + 1e-30;
      }
  std::vector<uint8_t> out(static_cast<size_t>(m * ldo * 2));
  const View xo = strided(x.data(), DType::BF16, {m, k}, {lda, 1});
  const View wo = strided(w.data(), DType::BF16, {e, n, k}, {wes, ldw, 1});
  const View oo = dense(out.data(), DType::BF16, {m, n}), counts = dense(lay.counts.data(), DType::I32, {e});
  const std::string what = "bf16 m" + std::to_string(m) + " n" + std::to_string(n) + " k" + std::to_string(k) +
                           " e" + std::to_string(e);
  try {
    glm5::bf16_grouped_gemm(oo, xo, wo, counts, 2);
  } catch (const std::exception& ex) {
    CHECK(false, "%s threw %s", what.c_str(), ex.what());
    return;
  }
  compare(what.c_str(), out, DType::BF16, m, n, ldo, want, slack, isa);
}

// ---- invalid inputs ----------------------------------------------------------------------------

void expect_invalid(const char* what, const char* arg, const std::function<void()>& call) {
  try {
    call();
    CHECK(false, "%s: no error", what);
  } catch (const glm5::InvalidInput& e) {
    CHECK(e.arg == arg, "%s: error names '%s', expected '%s' (%s)", what, e.arg.c_str(), arg, e.what());
  }
}

void test_invalid() {
  std::vector<uint8_t> a(4 * 256, 0x38), w(3 * 5 * 256, 0x38);
  std::vector<float> as(4 * 2, 1.0f), ws(3 * 1 * 2, 1.0f);
  std::vector<uint8_t> out = sevens(DType::F32, 4 * 5);
  const auto untouched = out;
  const View ao = dense(a.data(), DType::F8E4M3, {4, 256}), asv = dense(as.data(), DType::F32, {4, 2});
  const View wo = dense(w.data(), DType::F8E4M3, {3, 5, 256}), wsv = dense(ws.data(), DType::F32, {3, 1, 2});
  const View oo = dense(out.data(), DType::F32, {4, 5});
  std::vector<int32_t> negative{5, -1, 0}, short_sum{1, 1, 1}, long_sum{2, 2, 1}, ok{1, 2, 1};
  auto counts = [](std::vector<int32_t>& c) { return dense(c.data(), DType::I32, {static_cast<int64_t>(c.size())}); };
  auto grouped = [&](const View& o, const View& av, const View& wv, const View& wsw, const View& cv) {
    glm5::fp8_grouped_gemm(o, av, asv, wv, wsw, cv, 1);
  };
  expect_invalid("negative count", "tokens_per_expert", [&] { grouped(oo, ao, wo, wsv, counts(negative)); });
  expect_invalid("counts below M", "tokens_per_expert", [&] { grouped(oo, ao, wo, wsv, counts(short_sum)); });
  expect_invalid("counts above M", "tokens_per_expert", [&] { grouped(oo, ao, wo, wsv, counts(long_sum)); });
  expect_invalid("no experts", "tokens_per_expert", [&] {
    grouped(oo, ao, dense(w.data(), DType::F8E4M3, {0, 5, 256}), dense(ws.data(), DType::F32, {0, 1, 2}),
            dense(ok.data(), DType::I32, {0}));
  });
  expect_invalid("counts of another length", "tokens_per_expert", [&] {
    grouped(oo, ao, wo, wsv, dense(ok.data(), DType::I32, {2}));
  });
  expect_invalid("K % 128", "a", [&] {
    grouped(oo, dense(a.data(), DType::F8E4M3, {4, 200}), dense(w.data(), DType::F8E4M3, {3, 5, 200}), wsv,
            counts(ok));
  });
  expect_invalid("K mismatch", "w", [&] { grouped(oo, ao, dense(w.data(), DType::F8E4M3, {3, 5, 128}), wsv, counts(ok)); });
  expect_invalid("w_scale rows", "w_scale", [&] { grouped(oo, ao, wo, dense(ws.data(), DType::F32, {3, 2, 1}), counts(ok)); });
  expect_invalid("out dtype", "out_dtype", [&] { grouped(dense(out.data(), DType::I32, {4, 5}), ao, wo, wsv, counts(ok)); });
  expect_invalid("out shape", "out", [&] { grouped(dense(out.data(), DType::F32, {5, 4}), ao, wo, wsv, counts(ok)); });
  expect_invalid("a dtype", "a", [&] { grouped(oo, dense(a.data(), DType::BF16, {4, 128}), wo, wsv, counts(ok)); });
  expect_invalid("w strided along K", "w", [&] {
    grouped(oo, ao, strided(w.data(), DType::F8E4M3, {3, 5, 128}, {5 * 256, 256, 2}), wsv, counts(ok));
  });
  expect_invalid("dense with experts", "w", [&] { glm5::fp8_block_gemm(oo, ao, asv, wo, wsv, 1); });
  std::vector<int8_t> xi(1), wi(1);
  float one = 1.0f;
  expect_invalid("int8 K beyond int32", "x", [&] {
    glm5::int8_gemm(oo, strided(xi.data(), DType::I8, {1, 131072}, {0, 1}), dense(&one, DType::F32, {1}),
                    strided(wi.data(), DType::I8, {1, 131072}, {0, 1}), dense(&one, DType::F32, {1}), nullptr, 1);
  });
  CHECK(out == untouched, "an invalid call wrote its output");
  std::vector<int8_t> q(3);
  float s;
  expect_invalid("int8_quant K = 0", "x", [&] {
    glm5::int8_quant(dense(q.data(), DType::I8, {1, 0}), dense(&s, DType::F32, {1}), dense(a.data(), DType::F32, {1, 0}), 1);
  });
}

// ---- int8_quant --------------------------------------------------------------------------------

void test_int8_quant(int isa) {
  for (DType d : kFloats) {
    const int64_t rows = 9, cols = 37, ld = 41;
    std::vector<uint8_t> raw(static_cast<size_t>(rows * ld * glm5::dtype_bytes(d)));
    std::vector<float> vals(static_cast<size_t>(rows * ld));
    auto put = [&](int64_t i, float v) {
      if (d == DType::F32) std::memcpy(raw.data() + 4 * i, &v, 4);
      else {
        const uint16_t h = d == DType::F16 ? glm5::f32_to_f16(v) : glm5::f32_to_bf16(v);
        std::memcpy(raw.data() + 2 * i, &h, 2);
        v = d == DType::F16 ? glm5::f16_to_f32(h) : glm5::bf16_to_f32(h);
      }
      vals[i] = v;
    };
    for (int64_t i = 0; i < rows * ld; ++i) put(i, randn() * std::ldexp(1.0f, randint(-8, 8)));
    for (int64_t j = 0; j < cols; ++j) put(ld + j, 0.0f);                                  // row 1: zeros
    const float ties[] = {127.0f, 0.5f, 1.5f, 2.5f, -2.5f, -0.5f, 126.5f, -3.5f};         // row 2: scale 1
    for (int64_t j = 0; j < cols; ++j) put(2 * ld + j, ties[j % 8]);
    std::vector<int8_t> q(static_cast<size_t>(rows * cols));
    std::vector<float> scale(static_cast<size_t>(rows));
    glm5::int8_quant(dense(q.data(), DType::I8, {rows, cols}), dense(scale.data(), DType::F32, {rows}),
                     strided(raw.data(), d, {rows, cols}, {ld, 1}), 2);
    for (int64_t r = 0; r < rows; ++r) {
      float amax = 0;
      for (int64_t j = 0; j < cols; ++j) amax = std::max(amax, std::fabs(vals[r * ld + j]));
      const float s = amax / 127.0f;
      CHECK(scale[r] == s, "int8_quant isa %d %s row %lld: scale %.9g want %.9g", isa, name(d), (long long)r,
            scale[r], s);
      for (int64_t j = 0; j < cols; ++j) {
        const float v = s == 0 ? 0.0f : std::nearbyint(std::min(127.0f, std::max(-127.0f, vals[r * ld + j] / s)));
        if (q[r * cols + j] != static_cast<int8_t>(v)) {
          CHECK(false, "int8_quant isa %d %s [%lld, %lld]: %d want %g", isa, name(d), (long long)r, (long long)j,
                q[r * cols + j], v);
          break;
        }
      }
    }
  }
}

}  // namespace

int main() {
  const int top = glm5::qgemm_max_isa();
  std::printf("qgemm: best tier %d (float %d, int8 %d)\n", top, glm5::qgemm_float_isa(), glm5::qgemm_int8_isa());
  test_invalid();
  int seen_float = -1, seen_int = -1;
  for (int limit = top; limit >= 0; --limit) {
    glm5::qgemm_set_isa_limit(limit);
    const int fi = glm5::qgemm_float_isa(), ii = glm5::qgemm_int8_isa();
    const bool new_float = fi != seen_float, new_int = ii != seen_int;
    seen_float = fi;
    seen_int = ii;
    if (!new_float && !new_int) continue;
    std::printf("tier limit %d: float %d, int8 %d\n", limit, fi, ii);
    if (new_float) {
      for (DType od : kFloats) {
        run_fp8({{1}}, 1, 128, od, fi, false);
        run_fp8({{17}}, 129, 256, od, fi, false);
        run_fp8({{33}}, 300, 1152, od, fi, false);  // two K blocks (1024 + 128)
      }
      run_fp8({{65}}, 64, 384, DType::F32, fi, false);
      run_fp8({{0, 5, 0, 33, 1, 0}}, 40, 256, DType::BF16, fi, false);
      run_fp8({{3, 0, 4}}, 33, 128, DType::F32, fi, true);   // nan codes
      run_fp8({{3, 2}}, 17, 0, DType::F32, fi, false);       // K = 0
      run_fp8({{0, 0}}, 17, 128, DType::F32, fi, false);     // M = 0
      run_bf16({{5, 0, 12}}, 17, 33, fi);
      run_bf16({{40, 1}}, 70, 1030, fi);                     // K tail, streamed weights
      run_bf16({{70, 3}}, 40, 300, fi);                      // packed weights (70 rows) and streamed
      run_bf16({{1}}, 1, 1, fi);
      // the AVX-512 BF16 dot-product tiles (4 x rows by 6 weight rows, 32-wide K steps): row
      // tails of 1-3, weight-row tails of 1-5, K tails, whole tiles, row chunks (130 rows)
      run_bf16({{0, 1, 3, 33}}, 13, 70, fi);
      run_bf16({{2, 7, 4}}, 6, 32, fi);
      run_bf16({{130, 5}}, 11, 40, fi);
      run_bf16({{6, 0}}, 29, 95, fi);
      run_bf16({{3, 2}}, 9, 0, fi);                          // K = 0: zeros
    }
    if (new_int) {
      for (DType od : kFloats) {
        run_int8({{1}}, 1, 1, od, ii, false);
        run_int8({{17}}, 129, 67, od, ii, true);
        run_int8({{33}}, 33, 2100, od, ii, false);          // two K blocks (2048 + 52)
      }
      run_int8({{70}}, 64, 200, DType::F32, ii, true);
      run_int8({{0, 5, 0, 36, 1, 0}}, 40, 100, DType::BF16, ii, false);
      run_int8({{3, 2}}, 17, 0, DType::F32, ii, false);      // K = 0, grouped: zeros
      run_int8({{5}}, 17, 0, DType::BF16, ii, true);         // K = 0: the bias alone
      run_int8({{2}}, 3, 131071, DType::F32, ii, false, true);  // -128 * -128 * 131071 = 2147467264
    }
  }
  for (int limit = glm5::vec::max_isa(); limit >= 0; --limit) {  // int8_quant runs on the row tiers
    glm5::vec::set_isa_limit(limit);
    test_int8_quant(glm5::vec::isa());
  }
  glm5::vec::set_isa_limit(glm5::vec::max_isa());
  glm5::qgemm_set_isa_limit(4);
  std::printf("%d checks, %d failures\n", g_checks, g_failures);
  return g_failures ? 1 : 0;
}
