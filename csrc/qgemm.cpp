// Drivers of the quantized and grouped GEMMs (qgemm.h): validation, the padded copies of the
// activations, weight packing, the loop over (expert, column block) tasks and the epilogue.
// The tile kernels (qgemm_kernels*.cpp) compute mr x 32 blocks of float32 / int32 sums.
//
// Loop structure (per task: one expert's rows times one block of nc output columns):
//   for each K block of kc: pack the nc weight rows into 32-column panels (L2-sized block),
//     then for each row tile of the expert, for each panel: tile kernel into the task's C buffer;
//   then the epilogue rounds (int8: scales, bias) the C buffer into the output.
// The activations are copied once per call into a zero-padded row-major scratch (bfloat16 for
// the float path, FP8 converted exactly; int8, or int8 + 128 for unsigned-by-signed tiers), so
// that every tile reads whole row tiles and whole K steps in bounds.
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

constexpr int64_t kMaxNc = 8 * kNr;     // output columns per task (at most)
constexpr int64_t kFloatKc = 1024;      // K block of the float path (a multiple of 128)
constexpr int64_t kIntKc = 2048;        // K block of the int8 path (a multiple of 64)
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

void check_problem(const Problem& p) {
  const char* op = p.op;
  const GemmOperand& a = p.a;
  const GemmWeights& w = p.w;
  const bool int8 = p.kind == Kind::kInt8;
  const DType in = p.kind == Kind::kFp8 ? DType::F8E4M3 : int8 ? DType::I8 : DType::BF16;
  const std::string in_name = p.kind == Kind::kFp8 ? "float8_e4m3fn" : int8 ? "int8" : "bfloat16";
  require(a.dtype == in, op, p.a_arg, "dtype " + in_name, "dtype code " + str(static_cast<int>(a.dtype)));
  require(w.dtype == in, op, "w", "dtype " + in_name, "dtype code " + str(static_cast<int>(w.dtype)));
  require(a.rows >= 0 && a.cols >= 0 && a.row_stride >= 0, op, p.a_arg, "sizes and strides >= 0",
          str(a.rows) + " x " + str(a.cols) + ", stride " + str(a.row_stride));
  require(w.experts >= 0 && w.rows >= 0 && w.cols >= 0 && w.row_stride >= 0 && w.expert_stride >= 0, op, "w",
          "sizes and strides >= 0", str(w.experts) + " x " + str(w.rows) + " x " + str(w.cols));
  require(w.cols == a.cols, op, "w", "a last dim K = " + str(a.cols) + " (the last dim of '" + p.a_arg + "')",
          str(w.cols));
  if (p.kind == Kind::kFp8)
    require(a.cols % kScaleBlock == 0, op, p.a_arg, "a last dim K that is a multiple of 128 (the FP8 block)",
            str(a.cols));
  if (int8)
    require(a.cols <= kInt8MaxK, op, p.a_arg, "a last dim K <= " + str(kInt8MaxK) + " (the int32 accumulator)",
            str(a.cols));
  require(p.out.dtype == DType::F32 || p.out.dtype == DType::F16 || p.out.dtype == DType::BF16, op, "out_dtype",
          "float32, float16 or bfloat16", "dtype code " + str(static_cast<int>(p.out.dtype)));
  require(p.out.row_stride >= w.rows, op, "out", "a row stride >= N = " + str(w.rows), str(p.out.row_stride));
  // tokens_per_expert: counts >= 0 summing to M (the same words as the op's Python check)
  const std::string summing = "counts summing to " + str(a.rows) + " (the rows of '" + p.a_arg + "')";
  require(w.experts > 0 || a.rows == 0, op, "tokens_per_expert", summing, "no experts");
  int64_t total = 0;
  for (int64_t e = 0; e < w.experts; ++e) {
    require(p.counts[e] >= 0, op, "tokens_per_expert", "counts >= 0", str(p.counts[e]) + " for expert " + str(e));
    total += p.counts[e];
  }
  require(total == a.rows, op, "tokens_per_expert", summing, "sum " + str(total));
  // scales are read when there are products to scale (FP8: K > 0) or outputs to scale (INT8)
  const bool scaled = p.kind == Kind::kInt8 || (p.kind == Kind::kFp8 && a.cols > 0);
  if (scaled && a.rows > 0 && w.rows > 0) {
    require(a.scale != nullptr, op, int8 ? "x_scale" : "a_scale", "a float32 tensor", "none");
    require(w.scale != nullptr, op, "w_scale", "a float32 tensor", "none");
  }
}

// Row layout: expert e's rows are a.rows [src_row[e], src_row[e] + counts[e]) and scratch rows
// [pad_row[e], pad_row[e] + round_up(counts[e], mr)).
struct Rows {
  std::vector<int64_t> src_row, pad_row;
  int64_t padded = 0;
  Rows(const int32_t* counts, int64_t experts, int mr) : src_row(experts), pad_row(experts) {
    int64_t src = 0;
    for (int64_t e = 0; e < experts; ++e) {
      src_row[e] = src;
      pad_row[e] = padded;
      src += counts[e];
      padded += round_up(counts[e], mr);
    }
  }
};

// The activations as the tiles read them: rows copied into a zero-padded scratch [padded, kp].
template <typename T, typename Convert>
void pack_activations(const Problem& p, const Rows& rows, int64_t kp, std::vector<T>& dst, int nt, Convert convert) {
  dst.assign(static_cast<size_t>(rows.padded * kp), T{});
  const int64_t m = p.a.rows, k = p.a.cols;
  std::vector<int64_t> dst_row(static_cast<size_t>(m));
  for (int64_t e = 0; e < p.w.experts; ++e)
    for (int64_t r = 0; r < p.counts[e]; ++r) dst_row[rows.src_row[e] + r] = rows.pad_row[e] + r;
  const int64_t es = dtype_bytes(p.a.dtype);
  const char* base = static_cast<const char*>(p.a.data);
  const int threads = threads_for(m * k, nt);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < m; ++r) convert(base + r * p.a.row_stride * es, k, dst.data() + dst_row[r] * kp);
}

// float32 values of one row segment into the output dtype.
void store_row(const GemmOutput& out, int64_t row, int64_t col, const float* v, int64_t n) {
  const int64_t es = dtype_bytes(out.dtype);
  vec::kernels().store(out.dtype, v, n, static_cast<char*>(out.data) + (row * out.row_stride + col) * es);
}

struct TaskScratch {
  std::vector<uint16_t> bf;     // float path: packed panels of one K block
  std::vector<int8_t> bi;       // int8 path
  std::vector<int32_t> col_sum;
  std::vector<float> cf;        // C buffer [rows, nc]
  std::vector<int32_t> ci;
  std::vector<float> row;       // epilogue row
};

void run(const Problem& p, int num_threads) {
  check_problem(p);
  const int64_t m = p.a.rows, n = p.w.rows, k = p.a.cols, experts = p.w.experts;
  if (m == 0 || n == 0) return;
  const int nt = clamp_threads(num_threads);
  const bool int8 = p.kind == Kind::kInt8;
  const FloatTile& ft = float_tile();
  const Int8Tile& it = int8_tile();
  const int mr = int8 ? it.mr : ft.mr;
  const Rows rows(p.counts, experts, mr);
  const int64_t kp = round_up(k, int8 ? qgemm::kIntKStep : qgemm::kFloatKStep);
  const int64_t kc_max = int8 ? kIntKc : kFloatKc;
  const int64_t kb = k / kScaleBlock;              // FP8 scale blocks along K
  const int64_t nb = ceil_div(n, kScaleBlock);     // FP8 weight blocks along N

  // activations
  std::vector<uint16_t> af;
  std::vector<int8_t> ai;
  std::vector<float> row_scale;  // FP8: a_scale rows at the padded row positions
  if (p.kind == Kind::kFp8) {
    const uint16_t* table = qgemm::fp8_bf16_table();
    pack_activations(p, rows, kp, af, nt, [table](const char* src, int64_t len, uint16_t* dst) {
      const uint8_t* s = reinterpret_cast<const uint8_t*>(src);
      for (int64_t i = 0; i < len; ++i) dst[i] = table[s[i]];
    });
    row_scale.assign(static_cast<size_t>(rows.padded * kb), 0.0f);
    for (int64_t e = 0; e < experts && kb > 0; ++e)
      std::memcpy(row_scale.data() + rows.pad_row[e] * kb, p.a.scale + rows.src_row[e] * kb,
                  sizeof(float) * static_cast<size_t>(p.counts[e] * kb));
  } else if (p.kind == Kind::kBf16) {
    pack_activations(p, rows, kp, af, nt, [](const char* src, int64_t len, uint16_t* dst) {
      std::memcpy(dst, src, sizeof(uint16_t) * static_cast<size_t>(len));
    });
  } else {
    const bool biased = it.biased_a;
    // x + 128 as an unsigned byte is x with its sign bit flipped (K padding stays 0: the packed
    // weights are 0 there, so it contributes nothing either way)
    pack_activations(p, rows, kp, ai, nt, [biased](const char* src, int64_t len, int8_t* dst) {
      const uint8_t flip = biased ? 0x80u : 0u;
      for (int64_t i = 0; i < len; ++i) dst[i] = static_cast<int8_t>(static_cast<uint8_t>(src[i]) ^ flip);
    });
  }

  // tasks: (expert with rows, column block)
  int64_t active = 0;
  for (int64_t e = 0; e < experts; ++e) active += p.counts[e] > 0;
  int64_t nc = kMaxNc;
  if (active * ceil_div(n, nc) < 4 * nt)  // few big tasks: smaller column blocks balance the threads
    nc = std::max<int64_t>(kNr, round_up(ceil_div(n * active, 4 * nt), kNr));
  nc = std::min(nc, round_up(n, kNr));
  const int64_t col_blocks = ceil_div(n, nc);
  std::vector<std::pair<int64_t, int64_t>> tasks;
  for (int64_t e = 0; e < experts; ++e)
    if (p.counts[e] > 0)
      for (int64_t c = 0; c < col_blocks; ++c) tasks.emplace_back(e, c * nc);
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  advise_fresh_output(p.out.data, m * p.out.row_stride * dtype_bytes(p.out.dtype));
  const char* wbase = static_cast<const char*>(p.w.data);
  const int64_t wes = dtype_bytes(p.w.dtype);

#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(nt, ntasks)))
  {
    TaskScratch s;
    void (*begin)() = int8 ? it.begin : ft.begin;
    void (*end)() = int8 ? it.end : ft.end;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < ntasks; ++t) {
      if (begin) begin();
      const int64_t e = tasks[t].first, n0 = tasks[t].second;
      const int64_t ncur = std::min(nc, n - n0);
      const int64_t panels = ceil_div(ncur, kNr);
      const int64_t erows = p.counts[e], eprows = round_up(erows, mr);
      const int64_t ldc = panels * kNr;
      const void* we = wbase + e * p.w.expert_stride * wes;
      if (int8) {
        s.ci.assign(static_cast<size_t>(eprows * ldc), 0);
        s.col_sum.assign(static_cast<size_t>(ldc), 0);
      } else {
        s.cf.assign(static_cast<size_t>(eprows * ldc), 0.0f);
      }
      for (int64_t k0 = 0; k0 < kp; k0 += kc_max) {
        const int64_t kc = std::min(kc_max, kp - k0);
        if (int8) {
          s.bi.resize(static_cast<size_t>(panels * kc * kNr));
          for (int64_t j = 0; j < panels; ++j)
            qgemm::pack_int8_panel(static_cast<const int8_t*>(we), p.w.row_stride, n, k, n0 + j * kNr, k0, kc,
                                   s.bi.data() + j * kc * kNr, it.biased_a ? s.col_sum.data() + j * kNr : nullptr);
          for (int64_t r0 = 0; r0 < eprows; r0 += mr)
            for (int64_t j = 0; j < panels; ++j)
              it.tile(ai.data() + (rows.pad_row[e] + r0) * kp + k0, kp, s.bi.data() + j * kc * kNr, kc,
                      s.ci.data() + r0 * ldc + j * kNr, ldc, k0 > 0);
        } else {
          s.bf.resize(static_cast<size_t>(panels * kc * kNr));
          for (int64_t j = 0; j < panels; ++j)
            qgemm::pack_float_panel(we, p.w.dtype, p.w.row_stride, n, k, n0 + j * kNr, k0, kc,
                                    s.bf.data() + j * kc * kNr);
          for (int64_t r0 = 0; r0 < eprows; r0 += mr)
            for (int64_t j = 0; j < panels; ++j) {
              const float* rs = nullptr;
              const float* cs = nullptr;
              if (p.kind == Kind::kFp8) {
                rs = row_scale.data() + (rows.pad_row[e] + r0) * kb + k0 / kScaleBlock;
                cs = p.w.scale + (e * nb + (n0 + j * kNr) / kScaleBlock) * kb + k0 / kScaleBlock;
              }
              ft.tile(af.data() + (rows.pad_row[e] + r0) * kp + k0, kp, s.bf.data() + j * kc * kNr, kc,
                      s.cf.data() + r0 * ldc + j * kNr, ldc, k0 > 0, rs, kb, cs);
            }
        }
      }
      if (end) end();
      // epilogue
      const int64_t row0 = rows.src_row[e];
      if (!int8) {
        for (int64_t r = 0; r < erows; ++r) store_row(p.out, row0 + r, n0, s.cf.data() + r * ldc, ncur);
        continue;
      }
      s.row.resize(static_cast<size_t>(ncur));
      const float* ws = p.w.scale + e * n + n0;
      for (int64_t r = 0; r < erows; ++r) {
        const int32_t* c = s.ci.data() + r * ldc;
        const float xs = p.a.scale[row0 + r];
        for (int64_t j = 0; j < ncur; ++j) {
          // remove the bias of unsigned A (wrapping: the true sum fits int32, the biased one may not)
          const uint32_t sum = static_cast<uint32_t>(c[j]) - 128u * static_cast<uint32_t>(s.col_sum[j]);
          float v = static_cast<float>(static_cast<int32_t>(sum)) * xs * ws[j];
          if (p.bias) v += p.bias[n0 + j];
          s.row[j] = v;
        }
        store_row(p.out, row0 + r, n0, s.row.data(), ncur);
      }
    }
  }
}

}  // namespace

void fp8_block_gemm(const GemmOutput& out, const GemmOperand& a, const GemmWeights& w, int num_threads) {
  require(w.experts == 1, "fp8_block_gemm", "w", "one weight", str(w.experts));
  const int32_t count = static_cast<int32_t>(a.rows);
  require(a.rows <= INT32_MAX, "fp8_block_gemm", "a", "at most 2^31 - 1 rows", str(a.rows));
  run({Kind::kFp8, "fp8_block_gemm", "a", a, w, &count, nullptr, out}, num_threads);
}

void fp8_grouped_gemm(const GemmOutput& out, const GemmOperand& a, const GemmWeights& w,
                      const int32_t* tokens_per_expert, int num_threads) {
  run({Kind::kFp8, "fp8_grouped_gemm", "a", a, w, tokens_per_expert, nullptr, out}, num_threads);
}

void int8_gemm(const GemmOutput& out, const GemmOperand& x, const GemmWeights& w, const float* bias,
               int num_threads) {
  require(w.experts == 1, "int8_gemm", "w", "one weight", str(w.experts));
  require(x.rows <= INT32_MAX, "int8_gemm", "x", "at most 2^31 - 1 rows", str(x.rows));
  const int32_t count = static_cast<int32_t>(x.rows);
  run({Kind::kInt8, "int8_gemm", "x", x, w, &count, bias, out}, num_threads);
}

void int8_grouped_gemm(const GemmOutput& out, const GemmOperand& x, const GemmWeights& w,
                       const int32_t* tokens_per_expert, int num_threads) {
  run({Kind::kInt8, "int8_grouped_gemm", "x", x, w, tokens_per_expert, nullptr, out}, num_threads);
}

void bf16_grouped_gemm(const GemmOutput& out, const GemmOperand& x, const GemmWeights& w,
                       const int32_t* tokens_per_expert, int num_threads) {
  require(out.dtype == DType::BF16, "grouped_gemm", "out", "bfloat16", "dtype code " + str(static_cast<int>(out.dtype)));
  run({Kind::kBf16, "grouped_gemm", "x", x, w, tokens_per_expert, nullptr, out}, num_threads);
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
