// Peak-rate and bandwidth loops of roofline.h. Each peak loop keeps more independent
// accumulators than the instruction's latency times its throughput (16 zmm / 12 ymm chains),
// so it measures throughput; the accumulators are folded into a result the caller cannot
// predict, so the compiler keeps every instruction.
#include "roofline.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "core.h"
#include "qgemm_kernels.h"

#if GLM5_QGEMM_X86
#include <immintrin.h>

// GCC 12 reports the deliberately undefined lanes inside its own AVX-512 intrinsic headers
// (_mm512_undefined_*, used by the reductions) as uninitialized at every inlined use.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace glm5::roofline {

namespace {

using Clock = std::chrono::steady_clock;

// Runs `chunk()` (which returns the operations it did) until `seconds` have passed, on each of
// `threads` threads; returns the sum over threads of operations / elapsed time.
template <typename Chunk>
double per_thread_rate(int threads, double seconds, Chunk chunk) {
  std::vector<double> rates(static_cast<size_t>(clamp_threads(threads)), 0.0);
#pragma omp parallel num_threads(clamp_threads(threads))
  {
#ifdef _OPENMP
    const int t = omp_get_thread_num();
#else
    const int t = 0;
#endif
    double ops = chunk();   // warm-up (clocks, caches)
    ops = 0;
    const auto start = Clock::now();
    double elapsed = 0;
    do {
      ops += chunk();
      elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    } while (elapsed < seconds);
    rates[t] = ops / elapsed;
  }
  double total = 0;
  for (double r : rates) total += r;
  return total;
}

constexpr int64_t kIters = 1 << 16;   // per chunk

#if GLM5_QGEMM_X86
__attribute__((target("avx512f"))) double fma512_chunk() {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-3f);
  for (int64_t it = 0; it < kIters; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  float sink = 0;
  for (int i = 0; i < 16; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  volatile float keep = sink;
  (void)keep;
  return 2.0 * 16 * 16 * kIters;
}

__attribute__((target("avx2,fma"))) double fma256_chunk() {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
  for (int64_t it = 0; it < kIters; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  alignas(32) float v[8];
  float sink = 0;
  for (int i = 0; i < 12; ++i) {
    _mm256_store_ps(v, acc[i]);
    for (float x : v) sink += x;
  }
  volatile float keep = sink;
  (void)keep;
  return 2.0 * 12 * 8 * kIters;
}

__attribute__((target("avx512f,avx512bf16"))) double dpbf16_chunk() {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3a833a83);
  for (int64_t it = 0; it < kIters; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  float sink = 0;
  for (int i = 0; i < 16; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  volatile float keep = sink;
  (void)keep;
  return 2.0 * 32 * 16 * kIters;   // 32 products per instruction
}

__attribute__((target("avx512f,avx512vnni"))) double vnni512_chunk() {
  __m512i acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_epi32(i);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-5);
  for (int64_t it = 0; it < kIters; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
  int64_t sink = 0;
  for (int i = 0; i < 16; ++i) sink += _mm512_reduce_add_epi32(acc[i]);
  volatile int64_t keep = sink;
  (void)keep;
  return 2.0 * 64 * 16 * kIters;   // 64 products per instruction
}

__attribute__((target("avx2,avxvnni"))) double vnni256_chunk() {
  __m256i acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_epi32(i);
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-5);
  for (int64_t it = 0; it < kIters; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_dpbusd_avx_epi32(acc[i], a, b);
  alignas(32) int32_t v[8];
  int64_t sink = 0;
  for (int i = 0; i < 12; ++i) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(v), acc[i]);
    for (int32_t x : v) sink += x;
  }
  volatile int64_t keep = sink;
  (void)keep;
  return 2.0 * 32 * 12 * kIters;
}

struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Four 16 x 16 accumulator tiles from two A and two B tiles (the GEMM tiles' 2 x 2 block),
// operands loaded once; `int8` picks tdpbssd.
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) double amx_chunk(bool int8) {
  AmxConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  alignas(64) static thread_local uint8_t operands[4][1024];
  alignas(64) static thread_local int32_t result[256];
  for (int i = 0; i < 4; ++i) std::memset(operands[i], 0x11 * (i + 1), sizeof operands[i]);
  _tile_loadconfig(&cfg);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, operands[0], 64);
  _tile_loadd(5, operands[1], 64);
  _tile_loadd(6, operands[2], 64);
  _tile_loadd(7, operands[3], 64);
  const int64_t iters = kIters / 16;
  if (int8) {
    for (int64_t it = 0; it < iters; ++it) {
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    }
  } else {
    for (int64_t it = 0; it < iters; ++it) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, result, 64);
  _tile_release();
  volatile int32_t keep = result[0];
  (void)keep;
  // a tile product: 16 x 16 outputs of 32 (bf16) or 64 (int8) products
  return 4.0 * iters * 16 * 16 * (int8 ? 64 : 32) * 2;
}

// __builtin_cpu_supports takes a literal only
#define GLM5_CPU_HAS(feature) (__builtin_cpu_init(), __builtin_cpu_supports(feature))
#endif  // GLM5_QGEMM_X86

double scalar_fma_chunk() {
  float acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = static_cast<float>(i);
  for (int64_t it = 0; it < kIters; ++it)
    for (int i = 0; i < 8; ++i) acc[i] = acc[i] * 0.999f + 1e-3f;
  float sink = 0;
  for (float x : acc) sink += x;
  volatile float keep = sink;
  (void)keep;
  return 2.0 * 8 * kIters;
}

}  // namespace

double fp32_fma_flops(int threads, double seconds) {
#if GLM5_QGEMM_X86
  if (GLM5_CPU_HAS("avx512f")) return per_thread_rate(threads, seconds, fma512_chunk);
  if (GLM5_CPU_HAS("avx2") && GLM5_CPU_HAS("fma")) return per_thread_rate(threads, seconds, fma256_chunk);
#endif
  return per_thread_rate(threads, seconds, scalar_fma_chunk);
}

double bf16_dot_flops(int threads, double seconds) {
#if GLM5_QGEMM_X86
  if (GLM5_CPU_HAS("avx512f") && GLM5_CPU_HAS("avx512bf16")) return per_thread_rate(threads, seconds, dpbf16_chunk);
#endif
  (void)threads;
  (void)seconds;
  return 0;
}

double int8_dot_ops(int threads, double seconds) {
#if GLM5_QGEMM_X86
  if (GLM5_CPU_HAS("avx512f") && GLM5_CPU_HAS("avx512vnni")) return per_thread_rate(threads, seconds, vnni512_chunk);
  if (GLM5_CPU_HAS("avx2") && GLM5_CPU_HAS("avxvnni")) return per_thread_rate(threads, seconds, vnni256_chunk);
#endif
  (void)threads;
  (void)seconds;
  return 0;
}

double amx_bf16_flops(int threads, double seconds) {
#if GLM5_QGEMM_X86
  if (qgemm::amx_usable()) return per_thread_rate(threads, seconds, [] { return amx_chunk(false); });
#endif
  (void)threads;
  (void)seconds;
  return 0;
}

double amx_int8_ops(int threads, double seconds) {
#if GLM5_QGEMM_X86
  if (qgemm::amx_usable()) return per_thread_rate(threads, seconds, [] { return amx_chunk(true); });
#endif
  (void)threads;
  (void)seconds;
  return 0;
}

double triad_bytes(int threads, int64_t elements, int passes) {
  const int nt = clamp_threads(threads);
  const int64_t n = std::max<int64_t>(elements, 1);
  // first touch in the same static partition as the passes (pages land near their thread)
  double* a = new double[static_cast<size_t>(n)];
  double* b = new double[static_cast<size_t>(n)];
  double* c = new double[static_cast<size_t>(n)];
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    a[i] = 0.0;
    b[i] = 1.0;
    c[i] = 2.0;
  }
  const double s = 3.0;
  double best = 0;
  for (int pass = 0; pass <= std::max(passes, 1); ++pass) {
    const auto start = Clock::now();
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    if (pass > 0) best = std::max(best, 24.0 * static_cast<double>(n) / elapsed);
  }
  volatile double keep = a[n / 2];
  (void)keep;
  delete[] a;
  delete[] b;
  delete[] c;
  return best;
}

}  // namespace glm5::roofline
