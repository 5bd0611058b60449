// Native tests of the elementwise, MoE, KV and quantization kernels (built with
// -DGLM5_HAL_NATIVE_TESTS=ON; run `ctest` or the binary). Each kernel is compared with a naive
// float64 implementation on every row-kernel tier the CPU has, over odd sizes (vector tails);
// invalid inputs must throw glm5::InvalidInput before any output is written. Every buffer is a
// std::vector of exactly the size the layout needs, so a build with -DGLM5_HAL_SANITIZE=ON
// turns any out-of-bounds access into a failure.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common_ops.h"
#include "kv.h"
#include "moe.h"
#include "quant.h"
#include "vec.h"

#include "check.h"

using glm5::DType;
using glm5::dense;

namespace {

using glm5_test::g_checks;
using glm5_test::kFloats;
using glm5_test::name;
using glm5_test::g_failures;
using glm5_test::randint;
using glm5_test::randn;
using glm5_test::rng;

double rel_tol(DType d) { return d == DType::F32 ? 1e-5 : d == DType::F16 ? 2e-3 : 1.6e-2; }

// Raw elements of one float dtype (2 or 4 bytes each) and their exact values.
struct Buf {
  DType dtype;
  std::vector<uint8_t> raw;
  size_t n;
  Buf(DType d, size_t count) : dtype(d), raw(count * glm5::dtype_bytes(d)), n(count) {}
  void set(size_t i, float v) {
    if (dtype == DType::F32) std::memcpy(raw.data() + 4 * i, &v, 4);
    else {
      const uint16_t h = dtype == DType::F16 ? glm5::f32_to_f16(v) : glm5::f32_to_bf16(v);
      std::memcpy(raw.data() + 2 * i, &h, 2);
    }
  }
  double get(size_t i) const {
    if (dtype == DType::F32) { float v; std::memcpy(&v, raw.data() + 4 * i, 4); return v; }
    uint16_t h;
    std::memcpy(&h, raw.data() + 2 * i, 2);
    return dtype == DType::F16 ? glm5::f16_to_f32(h) : glm5::bf16_to_f32(h);
  }
  void* data() { return raw.data(); }
  const void* data() const { return raw.data(); }
};

Buf random_buf(DType d, size_t n, float scale = 1.0f) {
  Buf b(d, n);
  for (size_t i = 0; i < n; ++i) b.set(i, randn() * scale);
  return b;
}

bool close(double got, double want, DType d, double widen = 1.0) {
  return std::fabs(got - want) <= widen * (1e-5 + rel_tol(d) * std::fabs(want));
}

template <typename F>
bool throws_invalid(F&& f) {
  try {
    f();
  } catch (const glm5::InvalidInput&) {
    return true;
  }
  return false;
}

const int64_t kWidths[] = {1, 3, 15, 16, 17, 64, 129, 300};

void test_rms_silu_hadamard(int tier) {
  for (DType d : kFloats) {
    for (int64_t w : kWidths) {
      const int64_t rows = 3;
      Buf x = random_buf(d, rows * w, 3.0f), wt = random_buf(DType::F32, w);
      Buf out(d, rows * w);
      glm5::rms_norm(dense(out.data(), d, {rows, w}), dense(x.data(), d, {rows, w}), dense(wt.data(), DType::F32, {w}),
                     1e-5f, 2);
      for (int64_t r = 0; r < rows; ++r) {
        double ss = 0;
        for (int64_t i = 0; i < w; ++i) ss += x.get(r * w + i) * x.get(r * w + i);
        const double inv = 1.0 / std::sqrt(ss / w + 1e-5);
        for (int64_t i = 0; i < w; ++i) {
          const double want = x.get(r * w + i) * inv * wt.get(i);
          CHECK(close(out.get(r * w + i), want, d, 2), "rms_norm tier %d %s w=%lld", tier, name(d), (long long)w);
        }
      }
      Buf y(d, rows * w);
      Buf xs = random_buf(d, rows * 2 * w, 4.0f);
      glm5::silu_and_mul(dense(y.data(), d, {rows, w}), dense(xs.data(), d, {rows, 2 * w}), 2);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < w; ++i) {
          const double g = xs.get(r * 2 * w + i), u = xs.get(r * 2 * w + w + i);
          CHECK(close(y.get(r * w + i), g / (1 + std::exp(-g)) * u, d, 2), "silu tier %d %s", tier, name(d));
        }
    }
    for (int64_t dim = 1; dim <= 512; dim *= 2) {
      Buf x = random_buf(d, 2 * dim), out(d, 2 * dim);
      const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dim)));
      glm5::hadamard_transform(dense(out.data(), d, {2, dim}), dense(x.data(), d, {2, dim}), scale, 2);
      for (int64_t r = 0; r < 2; ++r)
        for (int64_t j = 0; j < dim; ++j) {
          double want = 0;
          for (int64_t i = 0; i < dim; ++i) want += x.get(r * dim + i) * (__builtin_popcountll(i & j) % 2 ? -1 : 1);
          CHECK(close(out.get(r * dim + j), want * scale, d, 1 + std::log2(static_cast<double>(dim))),
                "hadamard tier %d %s dim=%lld", tier, name(d), (long long)dim);
        }
    }
  }
}

void test_rope(int tier) {
  for (DType d : kFloats)
    for (bool interleaved : {true, false})
      for (int64_t rot : {2, 6, 64}) {
        const int64_t T = 5, H = 3;
        Buf x = random_buf(d, T * H * rot), out(d, T * H * rot);
        std::vector<int64_t> pos(T);
        for (auto& p : pos) p = randint(-200000, 200000);
        glm5::apply_rope(dense(out.data(), d, {T, H, rot}), dense(x.data(), d, {T, H, rot}),
                         dense(pos.data(), DType::I64, {T}), 1e6, interleaved, 2);
        const int64_t half = rot / 2;
        for (int64_t t = 0; t < T; ++t)
          for (int64_t h = 0; h < H; ++h)
            for (int64_t i = 0; i < half; ++i) {
              const double ang = static_cast<double>(pos[t]) * std::pow(1e6, -2.0 * i / rot);
              const int64_t ia = (t * H + h) * rot + (interleaved ? 2 * i : i);
              const int64_t ib = (t * H + h) * rot + (interleaved ? 2 * i + 1 : i + half);
              const double a = x.get(ia), b = x.get(ib);
              CHECK(close(out.get(ia), a * std::cos(ang) - b * std::sin(ang), d, 4) &&
                        close(out.get(ib), a * std::sin(ang) + b * std::cos(ang), d, 4),
                    "rope tier %d %s rot=%lld", tier, name(d), (long long)rot);
            }
      }
}

void test_moe(int tier) {
  for (DType d : kFloats) {
    const int64_t T = 13, k = 3, E = 7, D = 37;
    std::vector<int32_t> ids(T * k);
    for (auto& e : ids) e = randint(-2, E + 1);
    std::vector<int32_t> tpe(E), src(T * k);
    const int64_t M = glm5::moe_permute_plan(dense(tpe.data(), DType::I32, {E}), dense(src.data(), DType::I32, {T * k}),
                                             dense(ids.data(), DType::I32, {T, k}));
    // naive plan: by expert, then flat index
    std::vector<int32_t> want;
    for (int e = 0; e < E; ++e)
      for (int64_t f = 0; f < T * k; ++f)
        if (ids[f] == e) want.push_back(static_cast<int32_t>(f));
    CHECK(M == static_cast<int64_t>(want.size()), "permute M %lld vs %zu", (long long)M, want.size());
    CHECK(std::equal(want.begin(), want.end(), src.begin()), "permute src order");
    for (int e = 0; e < E; ++e)
      CHECK(tpe[e] == std::count(ids.begin(), ids.end(), e), "tokens_per_expert[%d]", e);
    Buf x = random_buf(d, T * D);
    Buf xp(d, M * D);
    const int64_t es = glm5::dtype_bytes(d);
    glm5::moe_permute_gather(dense(xp.data(), d, {M, D}), dense(x.data(), d, {T, D}), dense(src.data(), DType::I32, {T * k}),
                             k, 2);
    for (int64_t r = 0; r < M; ++r)
      CHECK(std::memcmp(xp.raw.data() + r * D * es, x.raw.data() + (src[r] / k) * D * es, D * es) == 0,
            "permute row %lld", (long long)r);
    std::vector<float> w(T * k);
    for (auto& v : w) v = randn();
    // several rows per slot too: append duplicates of some src values
    std::vector<int32_t> src2(src.begin(), src.begin() + M);
    src2.push_back(src2.empty() ? 0 : src2[0]);
    src2.push_back(5);
    const int64_t M2 = static_cast<int64_t>(src2.size());
    Buf y = random_buf(d, M2 * D), out(d, T * D);
    glm5::moe_unpermute(dense(out.data(), d, {T, D}), dense(y.data(), d, {M2, D}), dense(src2.data(), DType::I32, {M2}),
                        dense(w.data(), DType::F32, {T, k}), 2);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < D; ++i) {
        double want_v = 0;
        for (int64_t r = 0; r < M2; ++r)
          if (src2[r] / k == t) want_v += w[src2[r]] * y.get(r * D + i);
        CHECK(close(out.get(t * D + i), want_v, d, 4), "unpermute tier %d %s t=%lld", tier, name(d), (long long)t);
      }
    // invalid src: throws, out untouched
    Buf before = out;
    std::vector<int32_t> bad(src2);
    bad.back() = static_cast<int32_t>(T * k);
    CHECK(throws_invalid([&] {
            glm5::moe_unpermute(dense(out.data(), d, {T, D}), dense(y.data(), d, {M2, D}), dense(bad.data(), DType::I32, {M2}),
                                dense(w.data(), DType::F32, {T, k}), 2);
          }),
          "unpermute accepts src = T*k");
    bad.back() = -1;
    CHECK(throws_invalid([&] {
            glm5::moe_permute_gather(dense(xp.data(), d, {M2, D}), dense(x.data(), d, {T, D}),
                                     dense(bad.data(), DType::I32, {M2}), k, 2);
          }),
          "permute gather accepts src = -1");
    CHECK(out.raw == before.raw, "unpermute wrote before raising");
  }
  std::vector<int32_t> tpe(4), src(4), ids(4, 0);
  CHECK(throws_invalid([&] {
          glm5::moe_permute_plan(dense(tpe.data(), DType::I32, {0}), dense(src.data(), DType::I32, {4}),
                                 dense(ids.data(), DType::I32, {2, 2}));
        }),
        "num_experts = 0");
  CHECK(throws_invalid([&] {
          glm5::moe_permute_plan(dense(tpe.data(), DType::I32, {4}), dense(src.data(), DType::I32, {0}),
                                 glm5::strided(ids.data(), DType::I32, {2, 0}, {2, 1}));
        }),
        "k = 0");
}

void test_kv(int tier) {
  const int64_t blocks = 5, bs = 4, D = 19, slots = blocks * bs;
  for (DType d : {DType::F32, DType::BF16}) {
    const int64_t es = glm5::dtype_bytes(d);
    Buf cache = random_buf(d, slots * D), values = random_buf(d, 7 * D);
    std::vector<int64_t> sm = {3, -1, 19, 0, -1, 7, 12};
    Buf want = cache;
    for (int64_t t = 0; t < 7; ++t)
      if (sm[t] >= 0) std::memcpy(want.raw.data() + sm[t] * D * es, values.raw.data() + t * D * es, D * es);
    const glm5::View cache_v = dense(cache.data(), d, {blocks, bs, D}), values_v = dense(values.data(), d, {7, D});
    glm5::kv_cache_write(cache_v, values_v, dense(sm.data(), DType::I64, {7}), 2);
    CHECK(cache.raw == want.raw, "kv_cache_write %s", name(d));
    for (auto bad : {std::vector<int64_t>{3, -1, 20, 0, -1, 7, 12}, std::vector<int64_t>{3, -2, 1, 0, -1, 7, 12},
                     std::vector<int64_t>{3, -1, 1, 0, -1, 3, 12}}) {
      CHECK(throws_invalid([&] {
              glm5::kv_cache_write(cache_v, values_v, dense(bad.data(), DType::I64, {7}), 2);
            }),
            "kv_cache_write accepts a bad slot");
      CHECK(cache.raw == want.raw, "kv_cache_write wrote before raising");
    }
    // gather
    std::vector<int32_t> table = {4, 0, -1, 2, 3, 1};  // B=2, max_blocks=3
    std::vector<int32_t> lens = {6, 12};
    const glm5::View table_v = dense(table.data(), DType::I32, {2, 3}), lens_v = dense(lens.data(), DType::I32, {2});
    const int64_t rows = glm5::kv_cache_gather_rows(cache_v, table_v, lens_v);
    CHECK(rows == 18, "gather rows %lld", (long long)rows);
    Buf out(d, rows * D);
    glm5::kv_cache_gather(dense(out.data(), d, {rows, D}), cache_v, table_v, lens_v, 2);
    int64_t r = 0;
    for (int b = 0; b < 2; ++b)
      for (int p = 0; p < lens[b]; ++p, ++r) {
        const int64_t slot = table[b * 3 + p / bs] * bs + p % bs;
        CHECK(std::memcmp(out.raw.data() + r * D * es, cache.raw.data() + slot * D * es, D * es) == 0,
              "gather b=%d p=%d", b, p);
      }
    Buf untouched = out;
    std::vector<int32_t> bad_table = {4, 0, 5, 2, 3, 1};   // block 5 >= num_blocks, in use for len 12 > 8
    std::vector<int32_t> long_lens = {12, 12};
    CHECK(throws_invalid([&] {
            glm5::kv_cache_gather(dense(out.data(), d, {24, D}), cache_v, dense(bad_table.data(), DType::I32, {2, 3}),
                                  dense(long_lens.data(), DType::I32, {2}), 2);
          }),
          "gather accepts block id 5");
    std::vector<int32_t> too_long = {13, 0};
    CHECK(throws_invalid([&] { glm5::kv_cache_gather_rows(cache_v, table_v, dense(too_long.data(), DType::I32, {2})); }),
          "gather accepts len 13");
    CHECK(out.raw == untouched.raw, "gather wrote before raising");
  }
  // indexer keys: fp8 codes and scales against the scalar rule
  for (DType d : kFloats)
    for (bool ue8m0 : {false, true}) {
      const int64_t Dk = 33;
      Buf k = random_buf(d, 3 * Dk, 5.0f);
      std::vector<uint8_t> kc(slots * Dk, 0xaa);
      std::vector<float> ks(slots, -1.0f);
      std::vector<int32_t> sm = {4, -1, 9};
      glm5::indexer_k_cache_write(dense(k.data(), d, {3, Dk}), dense(kc.data(), DType::F8E4M3, {blocks, bs, Dk}),
                                  dense(ks.data(), DType::F32, {blocks, bs}), dense(sm.data(), DType::I32, {3}), ue8m0, 2);
      for (int64_t t : {0, 2}) {
        double amax = 0;
        for (int64_t i = 0; i < Dk; ++i) amax = std::max(amax, std::fabs(k.get(t * Dk + i)));
        const float s = glm5::fp8_block_scale(static_cast<float>(amax), ue8m0);
        CHECK(ks[sm[t]] == s, "indexer scale");
        for (int64_t i = 0; i < Dk; ++i) {
          // decode the e4m3 code and compare with x / s within half an e4m3 ulp (3 mantissa bits)
          const uint8_t c = kc[sm[t] * Dk + i];
          const int e = (c >> 3) & 0xf, m = c & 7;
          const double mag = e == 0 ? m / 8.0 * std::ldexp(1.0, -6) : (1 + m / 8.0) * std::ldexp(1.0, e - 7);
          const double v = (c & 0x80) ? -mag : mag;
          const double x = std::max(-448.0, std::min(448.0, k.get(t * Dk + i) / s));
          CHECK(std::fabs(v - x) <= std::max(std::fabs(x) / 16, std::ldexp(1.0, -10)) + 1e-12,
                "indexer fp8 code %d for %g", c, x);
        }
      }
      CHECK(ks[0] == -1.0f && kc[0] == 0xaa, "indexer wrote an unused slot");
      (void)tier;
    }
}

void test_fp8_block_quant(int tier) {
  for (DType d : kFloats) {
    const int64_t rows = 3, cols = 40, block = 8;
    Buf x = random_buf(d, rows * cols, 30.0f);
    x.set(0, 0.0f);
    std::vector<uint8_t> q(rows * cols);
    std::vector<float> s(rows * cols / block);
    const glm5::View q_v = dense(q.data(), DType::F8E4M3, {rows, cols}), x_v = dense(x.data(), d, {rows, cols});
    glm5::fp8_block_quant(q_v, dense(s.data(), DType::F32, {rows, cols / block}), x_v, block, false, 2);
    for (int64_t b = 0; b < rows * cols / block; ++b) {
      double amax = 0;
      for (int64_t i = 0; i < block; ++i) amax = std::max(amax, std::fabs(x.get(b * block + i)));
      CHECK(s[b] == std::max(static_cast<float>(amax), 1e-4f) / 448.0f, "fp8 scale tier %d %s", tier, name(d));
    }
    std::vector<uint8_t> q2(q);
    CHECK(throws_invalid([&] { glm5::fp8_block_quant(q_v, dense(s.data(), DType::F32, {rows, 5}), x_v, 7, false, 2); }),
          "block 7 of 40");
    CHECK(q == q2, "fp8 wrote before raising");
  }
}

void test_int4(int tier) {
  for (DType d : kFloats)
    for (int64_t group : {1, 3, 8, 24}) {
      const int64_t rows = 3, cols = 48;
      Buf w = random_buf(d, rows * cols, 0.5f);
      Buf fake(d, rows * cols);
      std::vector<int32_t> packed(rows * cols / 8);
      std::vector<float> scale(rows * cols / group);
      const glm5::View fake_v = dense(fake.data(), d, {rows, cols}), packed_v = dense(packed.data(), DType::I32, {rows, cols / 8});
      const glm5::View scale_v = dense(scale.data(), DType::F32, {rows, cols / group});
      glm5::int4_quantize(&fake_v, &packed_v, &scale_v, dense(w.data(), d, {rows, cols}), group, 2);
      std::vector<float> back(rows * cols);
      glm5::int4_unpack(dense(back.data(), DType::F32, {rows, cols}), packed_v, scale_v, group, 2);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < cols / group; ++g) {
          double amax = 0;
          for (int64_t i = 0; i < group; ++i) amax = std::max(amax, std::fabs(w.get(r * cols + g * group + i)));
          const float s = std::max(static_cast<float>(amax) / 7.0f, 1e-5f);
          CHECK(scale[r * (cols / group) + g] == s, "int4 scale tier %d %s g=%lld", tier, name(d), (long long)group);
          for (int64_t i = 0; i < group; ++i) {
            const int64_t c = r * cols + g * group + i;
            const float q = std::max(-7.0f, std::min(7.0f, std::nearbyint(static_cast<float>(w.get(c)) / s)));
            CHECK(back[c] == q * s, "int4 unpack tier %d %s", tier, name(d));
            CHECK(close(fake.get(c), static_cast<double>(q * s), d), "int4 fake tier %d %s", tier, name(d));
          }
        }
      std::vector<int32_t> before(packed);
      CHECK(throws_invalid([&] {
              const glm5::View scale44 = dense(scale.data(), DType::F32, {rows, 11});
              glm5::int4_quantize(nullptr, &packed_v, &scale44, glm5::strided(w.data(), d, {rows, 44}, {cols, 1}), 4, 2);
            }),
            "int4_pack accepts K = 44");
      CHECK(packed == before, "int4_pack wrote before raising");
    }
}

void test_route() {
  // 2 tokens, 8 experts in 4 groups of 2; token 1 has a nan and ties
  std::vector<float> logits = {0.1f, 2.0f, -1.0f, 0.5f, 3.0f, -2.0f, 0.0f, 1.0f,
                               1.0f, 1.0f, std::nanf(""), 0.0f, 1.0f, 1.0f, -5.0f, -5.0f};
  std::vector<float> w(2 * 3, -1.0f);
  std::vector<int32_t> ids(2 * 3, -1);
  glm5::moe_route(dense(w.data(), DType::F32, {2, 3}), dense(ids.data(), DType::I32, {2, 3}),
                  dense(logits.data(), DType::F32, {2, 8}), nullptr, 1, 1, 2.5f, true, false, 1);
  CHECK(ids[0] == 4 && ids[1] == 1 && ids[2] == 7, "route ids %d %d %d", ids[0], ids[1], ids[2]);
  CHECK(ids[3] == 2 && ids[4] == 0 && ids[5] == 1, "route nan first, ties by index: %d %d %d", ids[3], ids[4], ids[5]);
  double sum = 0;
  for (int j = 0; j < 3; ++j) sum += w[j];
  CHECK(std::fabs(sum - 2.5) < 1e-5, "route weights sum to the scaling factor: %g", sum);
  // groups: keep the 2 best groups by top-2 sums (g0 1.41, g3 1.23 > g2 1.07 > g1 0.89), then top 3 inside
  glm5::moe_route(dense(w.data(), DType::F32, {1, 3}), dense(ids.data(), DType::I32, {1, 3}),
                  dense(logits.data(), DType::F32, {1, 8}), nullptr, 4, 2, 1.0f, false, false, 1);
  std::vector<int32_t> got(ids.begin(), ids.begin() + 3);
  std::sort(got.begin(), got.end());
  CHECK(got[0] == 0 && got[1] == 1 && got[2] == 7, "grouped route (groups 0 and 3 win) %d %d %d", got[0], got[1], got[2]);
  std::vector<int32_t> before(ids);
  CHECK(throws_invalid([&] {
          glm5::moe_route(dense(w.data(), DType::F32, {2, 5}), dense(ids.data(), DType::I32, {2, 5}),
                          dense(logits.data(), DType::F32, {2, 8}), nullptr, 4, 2, 1.0f, true, false, 1);
        }),
        "route top_k 5 > topk_group * per_group 4");
  CHECK(ids == before, "route wrote before raising");
}

void test_bad_codes() {
  std::vector<float> x(8, 1.0f), out(8, 7.0f);
  CHECK(throws_invalid([&] {
          glm5::rms_norm(dense(out.data(), DType::F32, {1, 8}), dense(x.data(), static_cast<DType>(9), {1, 8}),
                         dense(x.data(), DType::F32, {8}), 1e-5f, 1);
        }),
        "rms_norm dtype 9");
  CHECK(throws_invalid([&] {
          glm5::hadamard_transform(dense(out.data(), DType::F32, {1, 6}), dense(x.data(), DType::F32, {1, 6}), 1.0f, 1);
        }),
        "hadamard dim 6");
  CHECK(throws_invalid([&] {
          glm5::silu_and_mul(dense(out.data(), DType::F32, {1, 4}), dense(x.data(), DType::I32, {1, 8}), 1);
        }),
        "silu int dtype");
  CHECK(throws_invalid([&] {
          glm5::rms_norm(glm5::strided(out.data(), DType::F32, {2, 4}, {2, 1}), dense(x.data(), DType::F32, {2, 4}),
                         dense(x.data(), DType::F32, {4}), 1e-5f, 1);
        }),
        "rms_norm output rows overlap");
  CHECK(std::all_of(out.begin(), out.end(), [](float v) { return v == 7.0f; }), "wrote before raising");
}

}  // namespace

int main() {
  const int max_tier = glm5::vec::max_isa();
  for (int tier = 0; tier <= max_tier; ++tier) {
    glm5::vec::set_isa_limit(tier);
    if (glm5::vec::isa() != tier) {
      std::printf("FAIL: tier %d not selected\n", tier);
      return 1;
    }
    test_rms_silu_hadamard(tier);
    test_rope(tier);
    test_moe(tier);
    test_kv(tier);
    test_fp8_block_quant(tier);
    test_int4(tier);
  }
  test_route();
  test_bad_codes();
  std::printf("test_kernels: tiers 0..%d, %d checks, %d failed\n", max_tier, g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
