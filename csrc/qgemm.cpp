// Drivers of the quantized and grouped GEMMs (qgemm.h): validation, operand layouts, the
// loops over tasks and the epilogues. The tile kernels (qgemm_kernels*.cpp) compute mr x 32
// blocks of float32 / int32 sums from mr rows of a row operand and one packed 32-column panel.
//
// Each expert takes one of two forms (every element is computed the same way in both, so the
// result does not depend on the form, the thread count or the task split):
// - packed weights (experts with many rows): the activations are copied into a zero-padded
//   row-major scratch (the tiles' rows); per task (expert, block of nc output columns) the
//   weight rows are packed into panels once, then row tiles x panels x K blocks run with the C
//   block of 256 rows kept in L2;
// - streamed weights (experts with at most 64 rows: decode, small MoE groups): C^T = W A^T, the
//   activations packed into panels once, each weight row copied (converted) once into the
//   tiles' row scratch; no weight packing.
// Row operands are zero-padded to whole row tiles and K steps, so every tile reads in bounds.
// The epilogue rounds the C buffer into the output dtype (int8: removes the unsigned bias,
// then scales and adds the bias).
//
// The bfloat16 grouped GEMM on a tier with a dot_rows kernel (AVX-512 BF16) takes neither form:
// every expert runs in one third form (run_dot_rows), both operands read in place, so there too
// the result does not depend on an expert's row count, the thread count or the task split.
#include "qgemm.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "qgemm_kernels.h"
#include "vec.h"

namespace glm5 {

namespace {

using qgemm::FloatTile;
using qgemm::Int8Tile;
using qgemm::kNr;
using qgemm::kScaleBlock;

std::atomic<int> g_isa_limit{qgemm::kAmx};

const FloatTile& float_tile() {
  const int limit = g_isa_limit.load(std::memory_order_relaxed);
#if GLM5_QGEMM_X86
  if (limit >= qgemm::kAmx)
    if (const FloatTile* t = qgemm::amx_float_tile()) return *t;
  if (limit >= qgemm::kAvx512)
    if (const FloatTile* t = qgemm::avx512_float_tile()) return *t;
  if (limit >= qgemm::kAvx2)
    if (const FloatTile* t = qgemm::avx2_float_tile()) return *t;
#else
  (void)limit;
#endif
  return qgemm::portable_float_tile();
}

const Int8Tile& int8_tile() {
  const int limit = g_isa_limit.load(std::memory_order_relaxed);
#if GLM5_QGEMM_X86
  if (limit >= qgemm::kAmx)
    if (const Int8Tile* t = qgemm::amx_int8_tile()) return *t;
  if (limit >= qgemm::kAvx512)
    if (const Int8Tile* t = qgemm::avx512_int8_tile()) return *t;
  if (limit >= qgemm::kAvxVnni)
    if (const Int8Tile* t = qgemm::avx_vnni_int8_tile()) return *t;
  if (limit >= qgemm::kAvx2)
    if (const Int8Tile* t = qgemm::avx2_int8_tile()) return *t;
#else
  (void)limit;
#endif
  return qgemm::portable_int8_tile();
}

enum class Kind { kFp8, kInt8, kBf16 };

// The operands as the drivers index them, read from the views and checked (operands()).
struct GemmOperand {   // [rows, cols], unit stride along cols
  const void* data;
  DType dtype;
  int64_t rows, cols, row_stride;
  const float* scale;
};
struct GemmWeights {   // [experts, rows, cols], unit stride along cols
  const void* data;
  DType dtype;
  int64_t experts, rows, cols, expert_stride, row_stride;
  const float* scale;
};
struct GemmOutput {
  void* data;
  DType dtype;
  int64_t row_stride;
};

constexpr int64_t kMaxNc = 8 * kNr;     // output columns per task (at most)
constexpr int64_t kFloatKc = 512;       // K block of the float path (a multiple of 128)
constexpr int64_t kIntKc = 1024;        // K block of the int8 path (a multiple of 64)
constexpr int64_t kRowBlock = 256;      // rows whose C block (x nc columns) stays in L2
constexpr int64_t kStreamedMaxRows = 64;  // experts with at most this many rows stream the weights
constexpr int64_t kDotBlock = 192;        // weight rows per task of the dot_rows form (32 of its 6-row tiles)
constexpr int64_t kDotChunkBytes = 512 * 1024;  // x rows per dot_rows call: half of a 1-2 MiB L2
constexpr int64_t kInt8MaxK = (int64_t{1} << 31) / (128 * 128) - 1;  // |sum| < 2^31: 131071

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

struct Problem {
  Kind kind;
  const char* op;
  const char* a_arg;        // the activations' argument name ("a" or "x")
  GemmOperand a;
  GemmWeights w;
  const int32_t* counts;    // [E], validated
  const float* bias;        // int8 dense only
  GemmOutput out;
};

// tokens_per_expert: counts >= 0 summing to M (the same words as the op's Python check). The
// views' metadata are checked when they are read (operands()).
void check_counts(const Problem& p) {
  const char* op = p.op;
  const std::string summing = "counts summing to " + str(p.a.rows) + " (the rows of '" + p.a_arg + "')";
  GLM5_REQUIRE(p.w.experts > 0 || p.a.rows == 0, op, "tokens_per_expert", summing, "no experts");
  int64_t total = 0;
  for (int64_t e = 0; e < p.w.experts; ++e) {
    GLM5_REQUIRE(p.counts[e] >= 0, op, "tokens_per_expert", "counts >= 0",
                 str(p.counts[e]) + " for expert " + str(e));
    total += p.counts[e];
  }
  GLM5_REQUIRE(total == p.a.rows, op, "tokens_per_expert", summing, "sum " + str(total));
}

// The call's shared, read-only state.
struct Call {
  const Problem& p;
  bool int8, fp8;
  const FloatTile& ft;
  const Int8Tile& it;
  int mr;                 // rows per tile call
  bool biased;            // int8 tiles multiply unsigned (x + 128) by signed bytes
  int64_t m, n, k, kp;    // kp: K padded to whole K steps
  int64_t kc_max;         // K block
  int64_t kb, nb;         // FP8 scale blocks along K and along N
  std::vector<int64_t> src_row;  // expert e's rows: [src_row[e], src_row[e] + counts[e])

  Call(const Problem& problem, const FloatTile& f, const Int8Tile& i)
      : p(problem), int8(problem.kind == Kind::kInt8), fp8(problem.kind == Kind::kFp8), ft(f), it(i),
        mr(int8 ? i.mr : f.mr), biased(int8 && i.biased_a), m(problem.a.rows), n(problem.w.rows),
        k(problem.a.cols), kp(round_up(k, int8 ? qgemm::kIntKStep : qgemm::kFloatKStep)),
        kc_max(int8 ? kIntKc : kFloatKc), kb(k / kScaleBlock), nb(ceil_div(n, kScaleBlock)),
        src_row(static_cast<size_t>(problem.w.experts)) {
    int64_t row = 0;
    for (int64_t e = 0; e < problem.w.experts; ++e) {
      src_row[e] = row;
      row += problem.counts[e];
    }
  }
  const void* weights(int64_t e) const {
    return static_cast<const char*>(p.w.data) + e * p.w.expert_stride * dtype_bytes(p.w.dtype);
  }
  void begin() const {
    void (*f)() = int8 ? it.begin : ft.begin;
    if (f) f();
  }
  void end() const {
    void (*f)() = int8 ? it.end : ft.end;
    if (f) f();
  }
};

// float32 values of one row segment into the output dtype.
void store_row(const GemmOutput& out, int64_t row, int64_t col, const float* v, int64_t n) {
  const int64_t es = dtype_bytes(out.dtype);
  vec::kernels().store(out.dtype, v, n, static_cast<char*>(out.data) + (row * out.row_stride + col) * es);
}

// out[row, n0 : n0 + count] of expert e from int32 sums[j * step]: the sum less 128 times the
// biased operand's partner sums (offset + col_offset[j], wrapping: the true sum fits int32,
// the biased one need not), times x_scale[row] * w_scale[e, n], plus bias[n].
void store_int8_row(const Call& c, int64_t e, int64_t row, int64_t n0, const int32_t* sums, int64_t step,
                    int32_t offset, const int32_t* col_offset, int64_t count, std::vector<float>& tmp) {
  tmp.resize(static_cast<size_t>(count));
  const float xs = c.p.a.scale[row];
  const float* ws = c.p.w.scale + e * c.n + n0;
  for (int64_t j = 0; j < count; ++j) {
    const uint32_t bias128 = 128u * (static_cast<uint32_t>(offset) + (col_offset ? static_cast<uint32_t>(col_offset[j]) : 0u));
    const int32_t sum = static_cast<int32_t>(static_cast<uint32_t>(sums[j * step]) - bias128);
    float v = static_cast<float>(sum) * xs * ws[j];
    if (c.p.bias) v += c.p.bias[n0 + j];
    tmp[j] = v;
  }
  store_row(c.p.out, row, n0, tmp.data(), count);
}

// ---- packed-weights form: experts with many rows ---------------------------------------------
// The activations are copied into a zero-padded row-major scratch (whole row tiles per expert,
// whole K steps); per task (expert, block of nc output columns) and K block the nc weight rows
// are packed into 32-column panels, then every row tile of the expert runs against every panel.
void run_packed(const Call& c, const std::vector<int64_t>& experts, int nt) {
  const Problem& p = c.p;
  // padded rows of the scratch, per expert
  std::vector<int64_t> pad_row(static_cast<size_t>(p.w.experts), 0);
  int64_t padded = 0;
  for (int64_t e : experts) {
    pad_row[e] = padded;
    padded += round_up(p.counts[e], c.mr);
  }
  // Row stride of the scratch: one cache line more than K, so that the rows of a tile do not
  // all fall into the same L1 sets (a stride that is a multiple of 4 KiB would).
  const int64_t lda = c.kp + (c.int8 ? 64 : 32);
  std::vector<uint16_t> af;
  std::vector<int8_t> ai;
  std::vector<float> row_scale;  // FP8: a_scale rows at the padded row positions
  if (c.int8) ai.assign(static_cast<size_t>(padded * lda), 0);
  else af.assign(static_cast<size_t>(padded * lda), 0);
  if (c.fp8) row_scale.assign(static_cast<size_t>(padded * c.kb), 0.0f);
  std::vector<std::pair<int64_t, int64_t>> copies;  // (source row, scratch row)
  for (int64_t e : experts)
    for (int64_t r = 0; r < p.counts[e]; ++r) copies.emplace_back(c.src_row[e] + r, pad_row[e] + r);
  const int64_t ncopies = c.k > 0 ? static_cast<int64_t>(copies.size()) : 0;   // K = 0: nothing to copy
  const int64_t es = dtype_bytes(p.a.dtype);
  const char* abase = static_cast<const char*>(p.a.data);
#pragma omp parallel for num_threads(threads_for(ncopies * c.k, nt)) schedule(static)
  for (int64_t i = 0; i < ncopies; ++i) {
    const char* src = abase + copies[i].first * p.a.row_stride * es;
    const int64_t dst = copies[i].second;
    if (c.fp8) {
      c.ft.fp8_to_bf16(reinterpret_cast<const uint8_t*>(src), c.k, &af[dst * lda]);
      if (c.kb) std::memcpy(&row_scale[dst * c.kb], p.a.scale + copies[i].first * c.kb, sizeof(float) * c.kb);
    } else if (c.int8) {
      // x + 128 as an unsigned byte is x with its sign bit flipped; the K padding may stay 0:
      // the packed weights are 0 there
      const uint8_t flip = c.biased ? 0x80u : 0u;
      for (int64_t j = 0; j < c.k; ++j)
        ai[dst * lda + j] = static_cast<int8_t>(static_cast<uint8_t>(src[j]) ^ flip);
    } else {
      std::memcpy(&af[dst * lda], src, sizeof(uint16_t) * static_cast<size_t>(c.k));
    }
  }

  // tasks: (expert, column block); smaller column blocks when there are few of them
  int64_t nc = kMaxNc;
  const int64_t count = static_cast<int64_t>(experts.size());
  if (count * ceil_div(c.n, nc) < 4 * nt) nc = std::max<int64_t>(kNr, round_up(ceil_div(c.n * count, 4 * nt), kNr));
  nc = std::min(nc, round_up(c.n, kNr));
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t e : experts)
    for (int64_t n0 = 0; n0 < c.n; n0 += nc) tasks.emplace_back(e, n0);
  const int64_t ntasks = static_cast<int64_t>(tasks.size());

#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(nt, ntasks)))
  {
    std::vector<uint16_t> bf;      // packed weight panels
    std::vector<int8_t> bi;
    std::vector<int32_t> col_sum;  // biased int8: the packed weight columns' sums
    std::vector<float> cf, tmp;    // C buffer [rows, nc]
    std::vector<int32_t> ci;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < ntasks; ++t) {
      const int64_t e = tasks[t].first, n0 = tasks[t].second;
      const int64_t ncur = std::min(nc, c.n - n0), panels = ceil_div(ncur, kNr), ldc = panels * kNr;
      const int64_t erows = p.counts[e], eprows = round_up(erows, c.mr);
      const void* we = c.weights(e);
      // the task's weights, packed once for all of K: [panels][kp / 2|4][32][2|4]
      if (c.int8) {
        ci.assign(static_cast<size_t>(eprows * ldc), 0);
        col_sum.assign(static_cast<size_t>(ldc), 0);
        bi.resize(static_cast<size_t>(panels * c.kp * kNr));
        for (int64_t j = 0; j < panels; ++j)
          c.it.pack(static_cast<const int8_t*>(we), p.w.row_stride, c.n, c.k, n0 + j * kNr, 0, c.kp,
                    bi.data() + j * c.kp * kNr, c.biased ? col_sum.data() + j * kNr : nullptr);
      } else {
        cf.assign(static_cast<size_t>(eprows * ldc), 0.0f);
        bf.resize(static_cast<size_t>(panels * c.kp * kNr));
        for (int64_t j = 0; j < panels; ++j)
          c.ft.pack(we, p.w.dtype, p.w.row_stride, c.n, c.k, n0 + j * kNr, 0, c.kp, bf.data() + j * c.kp * kNr);
      }
      c.begin();
      // Blocks of row tiles whose C rows stay in L2 over the K blocks; within a K block a row
      // tile's activations (mr x kc) stay in L1 while every panel passes by.
      const int64_t mc = round_up(kRowBlock, c.mr);
      for (int64_t m0 = 0; m0 < eprows; m0 += mc)
        for (int64_t k0 = 0; k0 < c.kp; k0 += c.kc_max) {
          const int64_t kc = std::min(c.kc_max, c.kp - k0);
          for (int64_t r0 = m0; r0 < std::min(eprows, m0 + mc); r0 += c.mr)
            for (int64_t j = 0; j < panels; ++j) {
              if (c.int8) {
                c.it.tile(ai.data() + (pad_row[e] + r0) * lda + k0, lda, bi.data() + (j * c.kp + k0) * kNr, kc,
                          ci.data() + r0 * ldc + j * kNr, ldc, k0 > 0);
                continue;
              }
              qgemm::BlockScales scales{};
              if (c.fp8)  // a_scale per row, w_scale one per block for the panel
                scales = {row_scale.data() + (pad_row[e] + r0) * c.kb + k0 / kScaleBlock, c.kb,
                          p.w.scale + (e * c.nb + (n0 + j * kNr) / kScaleBlock) * c.kb + k0 / kScaleBlock, 1, 0};
              c.ft.tile(af.data() + (pad_row[e] + r0) * lda + k0, lda, bf.data() + (j * c.kp + k0) * kNr, kc,
                        cf.data() + r0 * ldc + j * kNr, ldc, k0 > 0, c.fp8 ? &scales : nullptr);
            }
        }
      c.end();
      for (int64_t r = 0; r < erows; ++r) {
        const int64_t row = c.src_row[e] + r;
        if (c.int8) store_int8_row(c, e, row, n0, ci.data() + r * ldc, 1, 0, col_sum.data(), ncur, tmp);
        else store_row(p.out, row, n0, cf.data() + r * ldc, ncur);
      }
    }
  }
}

// ---- streamed-weights form: experts with few rows (decode, small MoE groups) -----------------
// The tiles compute C^T = W A^T: their row operand is mr weight rows, read in place where the
// tier takes the weights' format (bfloat16; int8 on tiers that multiply signed bytes) and
// otherwise converted per K block into a small scratch (FP8 -> bfloat16; int8 + 128); their
// panels are the expert's activations, packed once per call (32 rows per panel). No weight
// packing: the weights stream through once.
void run_streamed(const Call& c, const std::vector<int64_t>& experts, int nt) {
  const Problem& p = c.p;
  const int64_t count = static_cast<int64_t>(experts.size());
  // activation panels, per expert: [panels][kp / pairs|quads][32][2|4]
  std::vector<int64_t> panel0(static_cast<size_t>(count + 1), 0);
  for (int64_t i = 0; i < count; ++i) panel0[i + 1] = panel0[i] + ceil_div(p.counts[experts[i]], kNr);
  const int64_t panels_total = panel0[count];
  std::vector<uint16_t> af;
  std::vector<int8_t> ai;
  std::vector<int32_t> a_sum;    // biased int8: the packed activation rows' sums
  std::vector<float> a_scale_t;  // FP8: a_scale per panel as [kb][32]
  if (c.int8) {
    ai.assign(static_cast<size_t>(panels_total * c.kp * kNr), 0);
    a_sum.assign(static_cast<size_t>(panels_total * kNr), 0);
  } else {
    af.assign(static_cast<size_t>(panels_total * c.kp * kNr), 0);
  }
  if (c.fp8) a_scale_t.assign(static_cast<size_t>(panels_total * c.kb * kNr), 0.0f);
#pragma omp parallel for num_threads(threads_for(p.a.rows * c.k, nt)) schedule(dynamic, 1)
  for (int64_t q = 0; q < panels_total; ++q) {
    const int64_t i = std::upper_bound(panel0.begin(), panel0.end(), q) - panel0.begin() - 1;
    const int64_t e = experts[i], m0 = (q - panel0[i]) * kNr;
    const int64_t es = dtype_bytes(p.a.dtype);
    const char* rows = static_cast<const char*>(p.a.data) + c.src_row[e] * p.a.row_stride * es;
    if (c.int8) {
      c.it.pack(reinterpret_cast<const int8_t*>(rows), p.a.row_stride, p.counts[e], c.k, m0, 0, c.kp,
                ai.data() + q * c.kp * kNr, a_sum.data() + q * kNr);
    } else {
      c.ft.pack(rows, p.a.dtype, p.a.row_stride, p.counts[e], c.k, m0, 0, c.kp, af.data() + q * c.kp * kNr);
    }
    if (c.fp8)
      for (int64_t r = 0; r < std::min<int64_t>(kNr, p.counts[e] - m0); ++r)
        for (int64_t b = 0; b < c.kb; ++b)
          a_scale_t[(q * c.kb + b) * kNr + r] = p.a.scale[(c.src_row[e] + m0 + r) * c.kb + b];
  }

  // tasks: (expert, group of row tiles of the weights)
  const int64_t tiles = ceil_div(c.n, c.mr);
  int64_t group = std::max<int64_t>(1, kMaxNc / c.mr);
  if (count * ceil_div(tiles, group) < 4 * nt) group = std::max<int64_t>(1, ceil_div(tiles * count, 4 * nt));
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (index into experts, first weight row)
  for (int64_t i = 0; i < count; ++i)
    for (int64_t t = 0; t < tiles; t += group) tasks.emplace_back(i, t * c.mr);
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  const int64_t wes = dtype_bytes(p.w.dtype);
  const int64_t lda = c.kp + (c.int8 ? 64 : 32);   // scratch row stride off 4 KiB multiples

#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(nt, ntasks)))
  {
    std::vector<uint16_t> wf;   // converted weight rows [mr][kp]
    std::vector<int8_t> wi;
    std::vector<float> rs, cf, tmp;  // FP8 row scales [mr][kb]; C^T [mr][ldc]
    std::vector<int32_t> ci;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < ntasks; ++t) {
      const int64_t i = tasks[t].first, e = experts[i];
      const int64_t panels = panel0[i + 1] - panel0[i], ldc = panels * kNr, erows = p.counts[e];
      const char* we = static_cast<const char*>(c.weights(e));
      const int64_t nend = std::min(c.n, tasks[t].second + group * c.mr);
      c.begin();
      for (int64_t n0 = tasks[t].second; n0 < nend; n0 += c.mr) {
        const int64_t rows = std::min<int64_t>(c.mr, c.n - n0);
        if (c.int8) ci.assign(static_cast<size_t>(c.mr * ldc), 0);
        else cf.assign(static_cast<size_t>(c.mr * ldc), 0.0f);
        if (c.fp8 && c.kb > 0) {
          rs.assign(static_cast<size_t>(c.mr * c.kb), 0.0f);
          for (int64_t r = 0; r < rows; ++r)
            std::memcpy(&rs[r * c.kb], p.w.scale + (e * c.nb + (n0 + r) / kScaleBlock) * c.kb,
                        sizeof(float) * static_cast<size_t>(c.kb));
        }
        // The tile's weight rows, copied (converted) whole into a zero-padded scratch: each row
        // is read once from start to end, which the hardware prefetches; tiles (or K blocks of
        // a row at a time) striding over mr rows defeat it.
        // zero once per thread (the K padding is never written); rows past N are zeroed again
        if (c.int8 && wi.empty()) wi.assign(static_cast<size_t>(c.mr * lda), 0);
        if (!c.int8 && wf.empty()) wf.assign(static_cast<size_t>(c.mr * lda), 0);
        if (rows < c.mr) {
          if (c.int8) std::fill(wi.begin() + rows * lda, wi.end(), int8_t{0});
          else std::fill(wf.begin() + rows * lda, wf.end(), uint16_t{0});
        }
        for (int64_t r = 0; r < rows; ++r) {
          const char* src = we + (n0 + r) * p.w.row_stride * wes;
          if (c.fp8) {
            c.ft.fp8_to_bf16(reinterpret_cast<const uint8_t*>(src), c.k, &wf[r * lda]);
          } else if (c.int8 && c.biased) {   // x + 128 as an unsigned byte
            for (int64_t j = 0; j < c.k; ++j) wi[r * lda + j] = static_cast<int8_t>(static_cast<uint8_t>(src[j]) ^ 0x80u);
          } else if (c.k > 0) {
            std::memcpy(c.int8 ? static_cast<void*>(&wi[r * lda]) : static_cast<void*>(&wf[r * lda]), src,
                        static_cast<size_t>(c.k * wes));
          }
        }
        const char* a = c.int8 ? reinterpret_cast<const char*>(wi.data()) : reinterpret_cast<const char*>(wf.data());
        for (int64_t k0 = 0; k0 < c.kp; k0 += c.kc_max) {
          const int64_t kc = std::min(c.kc_max, c.kp - k0);
          for (int64_t q = 0; q < panels; ++q) {
            const int64_t panel = panel0[i] + q;
            if (c.int8) {
              c.it.tile(reinterpret_cast<const int8_t*>(a) + k0, lda, ai.data() + panel * c.kp * kNr + k0 * kNr, kc,
                        ci.data() + q * kNr, ldc, k0 > 0);
              continue;
            }
            qgemm::BlockScales scales{};
            if (c.fp8)  // w_scale per weight row, a_scale per activation row (a column of C^T)
              scales = {rs.data() + k0 / kScaleBlock, c.kb,
                        a_scale_t.data() + (panel * c.kb + k0 / kScaleBlock) * kNr, kNr, 1};
            c.ft.tile(reinterpret_cast<const uint16_t*>(a) + k0, lda, af.data() + panel * c.kp * kNr + k0 * kNr, kc,
                      cf.data() + q * kNr, ldc, k0 > 0, c.fp8 ? &scales : nullptr);
          }
        }
        // C^T [rows][erows] -> out[row, n0 : n0 + rows]
        tmp.resize(static_cast<size_t>(rows));
        for (int64_t r = 0; r < erows; ++r) {
          const int64_t row = c.src_row[e] + r;
          if (c.int8) {
            const int32_t offset = c.biased ? a_sum[(panel0[i] + r / kNr) * kNr + r % kNr] : 0;
            // here the biased operand is the weights: 128 * sum of the activation row
            store_int8_row(c, e, row, n0, ci.data() + r, ldc, offset, nullptr, rows, tmp);
          } else {
            for (int64_t j = 0; j < rows; ++j) tmp[j] = cf[j * ldc + r];
            store_row(p.out, row, n0, tmp.data(), rows);
          }
        }
      }
      c.end();
    }
  }
}

// ---- bfloat16 in place: tiers with a dot_rows kernel (bfloat16 only) ------------------------------
// Every expert, whatever its row count, in one form: tasks (expert, block of weight rows), each
// the tier's dot_rows on chunks of the expert's rows (a chunk's x rows stay in L2 while the
// block's weight rows stream by) against the block's weight rows, both read where they are; the
// float32 sums rounded into the output row by row. An element's computation does not depend on
// its chunk, block or thread (dot_rows), so neither does the result.
void run_dot_rows(const Call& c, const std::vector<int64_t>& experts, int nt) {
  const Problem& p = c.p;
  const int64_t count = static_cast<int64_t>(experts.size());
  int64_t block = kDotBlock;
  if (count * ceil_div(c.n, block) < 4 * nt) block = std::max<int64_t>(1, ceil_div(c.n * count, 4 * nt));
  block = std::min(block, c.n);
  // x rows per chunk: about kDotChunkBytes of them, a multiple of 4, 4 to 64
  const int64_t chunk_rows = kDotChunkBytes / (2 * std::max<int64_t>(c.k, 1)) / 4 * 4;
  const int64_t chunk = std::max<int64_t>(4, std::min<int64_t>(64, chunk_rows));
  std::vector<std::pair<int64_t, int64_t>> tasks;  // (expert, first weight row)
  for (int64_t e : experts)
    for (int64_t n0 = 0; n0 < c.n; n0 += block) tasks.emplace_back(e, n0);
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  const int64_t es = dtype_bytes(p.a.dtype);
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(threads_for(p.a.rows * c.n * c.k, nt), ntasks)))
  {
    std::vector<float> cf;   // [chunk rows][block]
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < ntasks; ++t) {
      const int64_t e = tasks[t].first, n0 = tasks[t].second, ncur = std::min(block, c.n - n0);
      const uint16_t* w = static_cast<const uint16_t*>(c.weights(e)) + n0 * p.w.row_stride;
      for (int64_t r0 = 0; r0 < p.counts[e]; r0 += chunk) {
        const int64_t rows = std::min<int64_t>(chunk, p.counts[e] - r0), row0 = c.src_row[e] + r0;
        cf.resize(static_cast<size_t>(rows * ncur));
        const uint16_t* x = reinterpret_cast<const uint16_t*>(static_cast<const char*>(p.a.data) +
                                                              row0 * p.a.row_stride * es);
        c.ft.dot_rows(x, p.a.row_stride, rows, w, p.w.row_stride, ncur, c.k, cf.data(), ncur);
        for (int64_t r = 0; r < rows; ++r) store_row(p.out, row0 + r, n0, cf.data() + r * ncur, ncur);
      }
    }
  }
}

void run(const Problem& p, int num_threads) {
  check_counts(p);
  if (p.a.rows == 0 || p.w.rows == 0) return;
  const int nt = clamp_threads(num_threads);
  const Call c(p, float_tile(), int8_tile());
  if (p.kind == Kind::kBf16 && c.ft.dot_rows) {   // one form for every expert
    std::vector<int64_t> experts;
    for (int64_t e = 0; e < p.w.experts; ++e)
      if (p.counts[e] > 0) experts.push_back(e);
    run_dot_rows(c, experts, nt);
    return;
  }
  std::vector<int64_t> streamed, packed;
  for (int64_t e = 0; e < p.w.experts; ++e) {
    if (p.counts[e] == 0) continue;
    (p.counts[e] <= kStreamedMaxRows ? streamed : packed).push_back(e);
  }
  if (!streamed.empty()) run_streamed(c, streamed, nt);
  if (!packed.empty()) run_packed(c, packed, nt);
}

// Reads and checks the views of one call (sizes, dtypes, layouts, the scales' shapes); the
// counts' values are checked by check_counts. `counts` of a dense op: null (one expert of all
// rows; `dense_count` holds it).
Problem operands(Kind kind, const char* op, const char* a_arg, const View& out, const View& a, const View* a_scale,
                 const View& w, const View* w_scale, const View* counts, const View* bias, int32_t* dense_count) {
  const bool grouped = counts != nullptr;
  const DType in = kind == Kind::kFp8 ? DType::F8E4M3 : kind == Kind::kInt8 ? DType::I8 : DType::BF16;
  require_ndim(a, 2, op, a_arg);
  require_dtype(a, in, op, a_arg);
  const Rows ar = rows_of(a, op, a_arg);
  require_ndim(w, grouped ? 3 : 2, op, "w");
  require_dtype(w, in, op, "w");
  GemmWeights wv{};
  if (grouped) {
    GLM5_REQUIRE(w.size[0] >= 0 && w.size[1] >= 0 && w.size[2] >= 0, op, "w", "sizes >= 0", "shape " + shape_str(w));
    GLM5_REQUIRE(w.size[2] <= 1 || w.stride[2] == 1, op, "w", "a unit stride along K", "shape " + shape_str(w));
    GLM5_REQUIRE(w.data != nullptr || w.numel() == 0, op, "w", "a non-null data pointer", "null");
    wv = {w.data, w.dtype, w.size[0], w.size[1], w.size[2], w.stride[0], w.stride[1], nullptr};
  } else {
    const Rows wr = rows_of(w, op, "w");
    wv = {wr.data, wr.dtype, 1, wr.rows, wr.cols, 0, wr.row_stride, nullptr};
  }
  const int64_t m = ar.rows, k = ar.cols, n = wv.rows, e = wv.experts;
  GLM5_REQUIRE(wv.cols == k, op, "w", "a last dim K = " + str(k) + " (the last dim of '" + a_arg + "')",
               "shape " + shape_str(w));
  GLM5_REQUIRE(ar.row_stride >= 0 && wv.row_stride >= 0 && wv.expert_stride >= 0, op, "w", "strides >= 0",
               "shape " + shape_str(w));
  if (kind == Kind::kFp8)
    GLM5_REQUIRE(k % kScaleBlock == 0, op, a_arg, "a last dim K that is a multiple of 128 (the FP8 block)",
                 "shape " + shape_str(a));
  if (kind == Kind::kInt8)
    GLM5_REQUIRE(k <= kInt8MaxK, op, a_arg, "a last dim K <= " + str(kInt8MaxK) + " (the int32 accumulator)",
                 "shape " + shape_str(a));
  const char* as_arg = kind == Kind::kInt8 ? "x_scale" : "a_scale";
  if (kind == Kind::kFp8) {
    require_dtype(*a_scale, DType::F32, op, as_arg);
    require_dense(*a_scale, {m, k / kScaleBlock}, op, as_arg);
    require_dtype(*w_scale, DType::F32, op, "w_scale");
    if (grouped) require_dense(*w_scale, {e, ceil_div(n, kScaleBlock), k / kScaleBlock}, op, "w_scale");
    else require_dense(*w_scale, {ceil_div(n, kScaleBlock), k / kScaleBlock}, op, "w_scale");
  } else if (kind == Kind::kInt8) {
    require_dtype(*a_scale, DType::F32, op, as_arg);
    require_dense(*a_scale, {m}, op, as_arg);
    require_dtype(*w_scale, DType::F32, op, "w_scale");
    if (grouped) require_dense(*w_scale, {e, n}, op, "w_scale");
    else require_dense(*w_scale, {n}, op, "w_scale");
  }
  if (bias) {
    require_dtype(*bias, DType::F32, op, "bias");
    require_dense(*bias, {n}, op, "bias");
  }
  GLM5_REQUIRE(is_float(out.dtype), op, "out_dtype", "float32, float16 or bfloat16", dtype_name(out.dtype));
  require_dense(out, {m, n}, op, "out");
  const int32_t* count_data = dense_count;
  if (grouped) {
    require_dtype(*counts, DType::I32, op, "tokens_per_expert");
    require_dense(*counts, {e}, op, "tokens_per_expert");
    count_data = static_cast<const int32_t*>(counts->data);
  } else {
    GLM5_REQUIRE(m <= INT32_MAX, op, a_arg, "at most 2^31 - 1 rows", "shape " + shape_str(a));
    *dense_count = static_cast<int32_t>(m);
  }
  wv.scale = w_scale ? static_cast<const float*>(w_scale->data) : nullptr;
  return {kind, op, a_arg,
          GemmOperand{ar.data, ar.dtype, m, k, ar.row_stride, a_scale ? static_cast<const float*>(a_scale->data) : nullptr},
          wv, count_data, bias ? static_cast<const float*>(bias->data) : nullptr,
          GemmOutput{out.data, out.dtype, n}};
}

}  // namespace

void fp8_block_gemm(const View& out, const RowsIn& a, const DenseIn& a_scale, const RowsIn& w,
                    const DenseIn& w_scale, int num_threads) {
  int32_t count = 0;
  run(operands(Kind::kFp8, "fp8_block_gemm", "a", out, a, &a_scale, w, &w_scale, nullptr, nullptr, &count),
      num_threads);
}

void fp8_grouped_gemm(const View& out, const RowsIn& a, const DenseIn& a_scale, const UnitLastIn& w,
                      const DenseIn& w_scale, const DenseIn& tokens_per_expert, int num_threads) {
  run(operands(Kind::kFp8, "fp8_grouped_gemm", "a", out, a, &a_scale, w, &w_scale, &tokens_per_expert, nullptr,
               nullptr),
      num_threads);
}

void int8_gemm(const View& out, const RowsIn& x, const DenseIn& x_scale, const RowsIn& w, const DenseIn& w_scale,
               const DenseIn* bias, int num_threads) {
  int32_t count = 0;
  run(operands(Kind::kInt8, "int8_gemm", "x", out, x, &x_scale, w, &w_scale, nullptr, bias, &count), num_threads);
}

void int8_grouped_gemm(const View& out, const RowsIn& x, const DenseIn& x_scale, const UnitLastIn& w,
                       const DenseIn& w_scale, const DenseIn& tokens_per_expert, int num_threads) {
  run(operands(Kind::kInt8, "int8_grouped_gemm", "x", out, x, &x_scale, w, &w_scale, &tokens_per_expert, nullptr,
               nullptr),
      num_threads);
}

void bf16_grouped_gemm(const View& out, const RowsIn& x, const UnitLastIn& w, const DenseIn& tokens_per_expert,
                       int num_threads) {
  GLM5_REQUIRE(out.dtype == DType::BF16, "grouped_gemm", "out", "bfloat16", dtype_name(out.dtype));
  run(operands(Kind::kBf16, "grouped_gemm", "x", out, x, nullptr, w, nullptr, &tokens_per_expert, nullptr, nullptr),
      num_threads);
}

int qgemm_float_isa() { return float_tile().isa; }
int qgemm_int8_isa() { return int8_tile().isa; }

int qgemm_max_isa() {
  const int previous = g_isa_limit.exchange(qgemm::kAmx);
  const int best = std::max(qgemm_float_isa(), qgemm_int8_isa());
  g_isa_limit.store(previous);
  return best;
}

int qgemm_set_isa_limit(int limit) { return g_isa_limit.exchange(std::max(0, std::min(limit, int{qgemm::kAmx}))); }

}  // namespace glm5
