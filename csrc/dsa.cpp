// Drivers of the DSA kernels: input validation, work partitioning over OpenMP threads, key
// row resolution (plain rows, sparse indices, block tables) and the tile loops around the
// kernels of dsa_kernels.h.
//
// Attention work item: (query token, head group, key split). It packs Q^T of its heads once,
// then streams tiles of kTile key rows (resolved to pointers, invalid indices skipped, no
// gathered copy): S^T = K . Q^T, an online-softmax step, O += P^T V. Splits of one
// (token, head group) are merged by their (max, sum) pairs when there are too few items to
// keep every thread busy (single-sequence decode).
//
// Indexer work item: (query group, key part). A query group is a few queries sharing key
// loads (the N queries of one sequence in paged decode, consecutive tokens with overlapping
// ranges in prefill); their (query, head) columns are packed once. Scores go to a per-query
// row buffer of one chunk of keys in thread scratch; top-k keeps a running candidate list per
// query (select the chunk's best, merge, re-select), so no [T, S] logits are formed.
#include "dsa.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <new>
#include <string>
#include <vector>

#include "dsa_kernels.h"
#include "dsa_select.h"

namespace glm5 {

namespace {

using dsa::Kernels;
using dsa::kLanes;
using dsa::kMaxVecs;
using dsa::kTile;
using dsa::kDvBlock;
using dsa::round_up;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

constexpr int kTopTier = 3;
std::atomic<int> g_isa_limit{kTopTier};

const Kernels& active_kernels() {
  const int limit = g_isa_limit.load(std::memory_order_relaxed);
#if GLM5_DSA_X86
  if (limit >= 3)
    if (const Kernels* k = dsa::avx512_bf16_kernels()) return *k;
  if (limit >= 2)
    if (const Kernels* k = dsa::avx512_kernels()) return *k;
  if (limit >= 1)
    if (const Kernels* k = dsa::avx2_kernels()) return *k;
#else
  (void)limit;
#endif
  return dsa::generic_kernels();
}

int thread_id() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// 64-byte aligned, uninitialised, grow-only storage.
template <class T>
class Buf {
 public:
  Buf() = default;
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  Buf(Buf&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; o.n_ = 0; }
  ~Buf() { release(); }
  void reserve(size_t n) {
    if (n <= n_) return;
    release();
    p_ = static_cast<T*>(::operator new(sizeof(T) * n, std::align_val_t{64}));
    n_ = n;
  }
  T* data() const { return p_; }
  T& operator[](size_t i) const { return p_[i]; }

 private:
  void release() {
    if (p_) ::operator delete(p_, std::align_val_t{64});
    p_ = nullptr;
    n_ = 0;
  }
  T* p_ = nullptr;
  size_t n_ = 0;
};

size_t elem_size(DType d) {
  switch (d) {
    case DType::F32: case DType::I32: return 4;
    case DType::F16: case DType::BF16: return 2;
    case DType::F8E4M3: case DType::I8: return 1;
    case DType::I64: return 8;
  }
  return 1;
}

std::string s(int64_t v) { return std::to_string(v); }

const char* dtype_name(DType d) {
  switch (d) {
    case DType::F32: return "float32";
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
    case DType::F8E4M3: return "float8_e4m3fn";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::I8: return "int8";
  }
  return "unknown";
}

void check_float_dtype(const char* op, const char* arg, DType d) {
  require(d == DType::F32 || d == DType::F16 || d == DType::BF16, op, arg, "dtype float32, float16 or bfloat16",
          "dtype code " + s(static_cast<int>(d)));
}

void check_ptr(const char* op, const char* arg, const void* p, bool needed) {
  require(!needed || p != nullptr, op, arg, "a non-null data pointer", "null");
}

void check_threads_and_q(const char* op, const void* q, DType qd, int64_t lead, int64_t heads, int64_t dim,
                         const char* dim_name) {
  check_float_dtype(op, "q", qd);
  require(lead >= 0, op, "q", "leading sizes >= 0", s(lead));
  require(heads >= 1, op, "q", "heads >= 1", s(heads));
  require(dim >= 1, op, "q", std::string(dim_name) + " >= 1", s(dim));
  check_ptr(op, "q", q, lead > 0);
}

// Paged-cache and block-table consistency, then the data: context lengths within the table
// and the block ids of every block holding [0, context_lens[b]) within the cache. Runs
// before anything is written; afterwards every position p < context_lens[b] resolves to an
// in-bounds row.
void check_paging(const char* op, const char* cache_arg, const DsaPagedCache& c, const DsaPaging& pg,
                  int64_t batch, int64_t dim) {
  require(pg.batch == batch, op, "block_table", "batch " + s(batch) + " (the batch of 'q')", s(pg.batch));
  require(pg.max_blocks >= 0 && pg.block_table_stride >= pg.max_blocks, op, "block_table",
          "max_blocks >= 0 and a row stride >= max_blocks",
          "max_blocks " + s(pg.max_blocks) + ", stride " + s(pg.block_table_stride));
  check_ptr(op, "context_lens", pg.context_lens, batch > 0);
  check_ptr(op, "block_table", pg.block_table, batch > 0 && pg.max_blocks > 0);
  require(c.num_blocks >= 0, op, cache_arg, "num_blocks >= 0", s(c.num_blocks));
  require(c.block_size >= 1, op, cache_arg, "block_size >= 1", s(c.block_size));
  require(c.dim == dim, op, cache_arg, "last dim " + s(dim) + " (the head dim of 'q')", s(c.dim));
  require(c.row_stride >= c.dim && c.block_stride >= (c.block_size - 1) * c.row_stride + c.dim, op, cache_arg,
          "strides of non-overlapping rows and blocks",
          "row stride " + s(c.row_stride) + ", block stride " + s(c.block_stride));
  check_ptr(op, cache_arg, c.data, c.num_blocks > 0);
  if (c.dtype == DType::F8E4M3) {
    check_ptr(op, "k_cache_scale", c.scale, c.num_blocks > 0);
    require(c.scale_row_stride >= 1 && c.scale_block_stride >= (c.block_size - 1) * c.scale_row_stride + 1, op,
            "k_cache_scale", "strides of non-overlapping rows and blocks",
            "row stride " + s(c.scale_row_stride) + ", block stride " + s(c.scale_block_stride));
  }
  const int64_t capacity = pg.max_blocks * c.block_size;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = pg.context_lens[b];
    require(len >= 0 && len <= capacity, op, "context_lens",
            "values in [0, " + s(capacity) + "] (max_blocks * block_size)", s(len) + " for sequence " + s(b));
    const int64_t used = (len + c.block_size - 1) / c.block_size;
    const int32_t* row = pg.block_table + b * pg.block_table_stride;
    for (int64_t j = 0; j < used; ++j)
      require(row[j] >= 0 && row[j] < c.num_blocks, op, "block_table",
              "block ids in [0, " + s(c.num_blocks) + ") for the blocks holding [0, context_lens[b])",
              s(row[j]) + " at [" + s(b) + ", " + s(j) + "]");
  }
}

// Paged row lookup of logical position p < context_lens[b] (validated by check_paging).
struct PagedLookup {
  const char* data;
  int64_t block_size, block_bytes, row_bytes;
  const float* scale;
  int64_t scale_block_stride, scale_row_stride;
  const int32_t* block_table;
  int64_t bt_stride;

  PagedLookup(const DsaPagedCache& c, const DsaPaging& pg)
      : data(static_cast<const char*>(c.data)), block_size(c.block_size),
        block_bytes(c.block_stride * static_cast<int64_t>(elem_size(c.dtype))),
        row_bytes(c.row_stride * static_cast<int64_t>(elem_size(c.dtype))), scale(c.scale),
        scale_block_stride(c.scale_block_stride), scale_row_stride(c.scale_row_stride), block_table(pg.block_table),
        bt_stride(pg.block_table_stride) {}

  const void* row(int64_t b, int64_t p) const {
    const int64_t block = block_table[b * bt_stride + p / block_size];
    return data + block * block_bytes + (p % block_size) * row_bytes;
  }
  // f(i, row, block, offset) for positions p0 .. p0 + n - 1, walking the blocks (one division).
  template <class F>
  void walk(int64_t b, int64_t p0, int64_t n, F&& f) const {
    const int32_t* table = block_table + b * bt_stride;
    int64_t j = p0 / block_size, off = p0 % block_size;
    const char* base = data + table[j] * block_bytes;
    for (int64_t i = 0; i < n; ++i) {
      f(i, base + off * row_bytes, table[j], off);
      if (++off == block_size && i + 1 < n) {
        off = 0;
        base = data + table[++j] * block_bytes;
      }
    }
  }
};

// Asks for the cache lines of a row that the next tile will read, so a tile's rows arrive
// from memory while the previous tile computes (rows come from scattered cache blocks or
// sparse indices, which the hardware prefetchers do not follow).
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

// Heads [head0, head0 + ncols) of one query (q: heads x dim) as ncols columns of a packed
// Q^T with leading dimension ld (dst points at the first column). Heads >= `heads` pack as 0.
void pack_q_f32(const Kernels& K, DType qd, const void* q, int64_t heads, int64_t dim, int64_t head0, int ncols,
                float* dst, int64_t ld, float* tmp_row) {
  const size_t es = elem_size(qd);
  for (int c = 0; c < ncols; ++c) {
    const int64_t h = head0 + c;
    if (h < heads) {
      K.to_f32(qd, static_cast<const char*>(q) + h * dim * es, dim, tmp_row);
      for (int64_t d = 0; d < dim; ++d) dst[d * ld + c] = tmp_row[d];
    } else {
      for (int64_t d = 0; d < dim; ++d) dst[d * ld + c] = 0.0f;
    }
  }
}

// As pack_q_f32 for bfloat16 q, in the pair layout of Kernels::qk_bf16.
void pack_q_bf16(const uint16_t* q, int64_t heads, int64_t dim, int64_t head0, int ncols, uint32_t* dst, int64_t ld) {
  const int64_t npairs = (dim + 1) / 2;
  for (int c = 0; c < ncols; ++c) {
    const int64_t h = head0 + c;
    const uint16_t* row = h < heads ? q + h * dim : nullptr;
    for (int64_t p = 0; p < npairs; ++p) {
      uint32_t lo = 0, hi = 0;
      if (row) {
        lo = row[2 * p];
        hi = 2 * p + 1 < dim ? row[2 * p + 1] : 0;
      }
      dst[p * ld + c] = lo | (hi << 16);
    }
  }
}

// ================================ attention ================================================

enum class AttnPath { Bf16Dot, F32Direct, F32Staged };

struct AttnSetup {
  const char* op;
  const void* q;
  DType dtype;
  int64_t tokens, heads, dqk, dv;
  float scale;
  void* out;
  float* lse;
};

struct AttnScratch {
  Buf<float> qt;         // packed Q^T (fp32, or bf16 pairs reinterpreted)
  Buf<float> tmp_row;
  Buf<float> s;          // [kTile][ncols]
  Buf<const void*> rows, next_rows;
  Buf<float> staged;     // [kTile][dqk] for F32Staged
  Buf<const float*> frows;
  Buf<float> o;          // [ncols][dvp]
  Buf<float> m, l, alpha;
};

// Merged-state record of one (token, head group, split): o [ncols][dvp], m [ncols], l [ncols].
struct Partial {
  float* o;
  float* m;
  float* l;
};

template <class Rows>
void run_attention(const AttnSetup& st, const Rows& rows, int nthreads) {
  if (st.tokens == 0) return;
  const Kernels& K = active_kernels();
  const AttnPath path = (st.dtype == DType::BF16 && K.qk_bf16) ? AttnPath::Bf16Dot
                        : st.dtype == DType::F32                ? AttnPath::F32Direct
                                                                : AttnPath::F32Staged;
  const bool paired = path == AttnPath::Bf16Dot;  // pv_bf16's output layout
  const int64_t hp = round_up(st.heads, kLanes);
  const int64_t nvec_total = hp / kLanes;
  const int64_t groups = (nvec_total + kMaxVecs - 1) / kMaxVecs;
  const int64_t vecs_per_group = (nvec_total + groups - 1) / groups;
  const int max_cols = static_cast<int>(vecs_per_group * kLanes);
  const int64_t dvp = round_up(st.dv, kDvBlock);
  const int64_t units = st.tokens * groups;

  int64_t max_count = 0;
  for (int64_t t = 0; t < st.tokens; ++t) max_count = std::max(max_count, rows.count(t));
  int64_t splits = 1;
  if (nthreads > 1 && units < 4 * nthreads) {
    splits = (4 * nthreads + units - 1) / units;
    splits = std::max<int64_t>(1, std::min(splits, max_count / 256));
  }

  std::vector<AttnScratch> scratch(static_cast<size_t>(nthreads));
  const int64_t qt_floats = (path == AttnPath::Bf16Dot ? (st.dqk + 1) / 2 : st.dqk) * max_cols;
  for (AttnScratch& sc : scratch) {
    sc.qt.reserve(static_cast<size_t>(qt_floats));
    sc.tmp_row.reserve(static_cast<size_t>(st.dqk));
    sc.s.reserve(static_cast<size_t>(kTile * max_cols));
    sc.rows.reserve(kTile);
    sc.next_rows.reserve(kTile);
    sc.frows.reserve(kTile);
    if (path == AttnPath::F32Staged) sc.staged.reserve(static_cast<size_t>(kTile * st.dqk));
    sc.o.reserve(static_cast<size_t>(max_cols * dvp));
    sc.m.reserve(max_cols);
    sc.l.reserve(max_cols);
    sc.alpha.reserve(max_cols);
  }
  Buf<float> partial_store;
  const int64_t partial_floats = max_cols * (dvp + 2);
  if (splits > 1) partial_store.reserve(static_cast<size_t>(units * splits * partial_floats));
  auto partial_at = [&](int64_t unit, int64_t split) {
    float* base = partial_store.data() + (unit * splits + split) * partial_floats;
    return Partial{base, base + max_cols * dvp, base + max_cols * dvp + max_cols};
  };

  const size_t qes = elem_size(st.dtype);
  const int64_t row_bytes = st.dqk * static_cast<int64_t>(qes);
  auto group_cols = [&](int64_t g, int64_t* col0) {
    const int64_t v0 = g * vecs_per_group;
    *col0 = v0 * kLanes;
    return static_cast<int>(std::min(vecs_per_group, nvec_total - v0) * kLanes);
  };

  // Writes out/lse of (token t, heads col0 ..) from an accumulated state.
  auto finalize = [&](int64_t t, int64_t col0, int ncols, const float* o, const float* m, const float* l) {
    const int64_t nh = std::min<int64_t>(ncols, st.heads - col0);
    for (int64_t hl = 0; hl < nh; ++hl) {
      const int64_t h = col0 + hl;
      const float* oh = o + hl * dvp;
      const int64_t orow = (t * st.heads + h) * st.dv;
      const bool any = l[hl] > 0.0f;
      const float inv = any ? 1.0f / l[hl] : 0.0f;
      st.lse[t * st.heads + h] = any ? m[hl] + std::log(l[hl]) : kNegInf;
      dispatch_float(st.dtype, st.op, "q", [&](auto tag) {
        constexpr DType D = decltype(tag)::value;
        auto* out = static_cast<typename Storage<D>::type*>(st.out) + orow;
        for (int64_t d = 0; d < st.dv; ++d) {
          int64_t src = d;
          if (paired) {
            const int64_t i = d % kDvBlock;
            src = d - i + (i & 1) * (kDvBlock / 2) + i / 2;
          }
          store<D>(out, d, any ? oh[src] * inv : 0.0f);
        }
      });
    }
  };

#pragma omp parallel num_threads(nthreads)
  {
    AttnScratch& sc = scratch[static_cast<size_t>(thread_id())];
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < units * splits; ++item) {
      const int64_t unit = item / splits, split = item % splits;
      const int64_t t = unit / groups, g = unit % groups;
      int64_t col0 = 0;
      const int ncols = group_cols(g, &col0);
      const int nvec = ncols / kLanes;
      const void* qtok = static_cast<const char*>(st.q) + t * st.heads * st.dqk * qes;
      if (path == AttnPath::Bf16Dot)
        pack_q_bf16(static_cast<const uint16_t*>(qtok), st.heads, st.dqk, col0, ncols,
                    reinterpret_cast<uint32_t*>(sc.qt.data()), ncols);
      else
        pack_q_f32(K, st.dtype, qtok, st.heads, st.dqk, col0, ncols, sc.qt.data(), ncols, sc.tmp_row.data());

      Partial acc = splits > 1 ? partial_at(unit, split) : Partial{sc.o.data(), sc.m.data(), sc.l.data()};
      std::fill(acc.o, acc.o + ncols * dvp, 0.0f);
      std::fill(acc.m, acc.m + ncols, kNegInf);
      std::fill(acc.l, acc.l + ncols, 0.0f);
      const int64_t count = rows.count(t);
      const int64_t j_begin = count * split / splits, j_end = count * (split + 1) / splits;
      int64_t j = j_begin;
      // the next tile's valid rows, resolved (and prefetched) one tile ahead
      auto fill = [&](const void** tile) {
        int n = 0;
        while (n < kTile && j < j_end) {
          const void* r = rows.row(t, j++);
          if (r) {
            tile[n++] = r;
            prefetch_row(r, row_bytes);
          }
        }
        return n;
      };
      const void** cur = sc.rows.data();
      const void** next = sc.next_rows.data();
      int n_next = fill(next);
      while (n_next > 0) {
        std::swap(cur, next);
        const int n = n_next;
        n_next = fill(next);
        if (path == AttnPath::Bf16Dot) {
          K.qk_bf16(reinterpret_cast<const uint32_t*>(sc.qt.data()), nvec,
                    reinterpret_cast<const uint16_t* const*>(cur), n, st.dqk, sc.s.data());
        } else {
          if (path == AttnPath::F32Staged) {
            for (int i = 0; i < n; ++i) {
              float* dst = sc.staged.data() + i * st.dqk;
              K.to_f32(st.dtype, cur[i], st.dqk, dst);
              sc.frows[i] = dst;
            }
          } else {
            for (int i = 0; i < n; ++i) sc.frows[i] = static_cast<const float*>(cur[i]);
          }
          K.qk_f32(sc.qt.data(), nvec, sc.frows.data(), n, st.dqk, sc.s.data());
        }
        K.softmax_tile(sc.s.data(), n, ncols, st.scale, acc.m, acc.l, sc.alpha.data());
        if (paired)
          K.pv_bf16(sc.s.data(), ncols, reinterpret_cast<const uint16_t* const*>(cur), n, st.dv, acc.o,
                    dvp, sc.alpha.data());
        else
          K.pv_f32(sc.s.data(), ncols, sc.frows.data(), n, st.dv, acc.o, dvp, sc.alpha.data());
      }
      if (splits == 1) finalize(t, col0, ncols, acc.o, acc.m, acc.l);
    }

    if (splits > 1) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t unit = 0; unit < units; ++unit) {
        const int64_t t = unit / groups, g = unit % groups;
        int64_t col0 = 0;
        const int ncols = group_cols(g, &col0);
        float* o = sc.o.data();
        float* m = sc.m.data();
        float* l = sc.l.data();
        for (int c = 0; c < ncols; ++c) {
          float mx = kNegInf;
          for (int64_t sp = 0; sp < splits; ++sp) mx = std::max(mx, partial_at(unit, sp).m[c]);
          m[c] = mx;
          l[c] = 0.0f;
          float* oc = o + c * dvp;
          std::fill(oc, oc + dvp, 0.0f);
          for (int64_t sp = 0; sp < splits; ++sp) {
            const Partial p = partial_at(unit, sp);
            if (p.l[c] == 0.0f) continue;  // a split without valid keys
            const float w = std::exp(p.m[c] - mx);
            l[c] += p.l[c] * w;
            const float* po = p.o + c * dvp;
            for (int64_t d = 0; d < dvp; ++d) oc[d] += po[d] * w;
          }
        }
        finalize(t, col0, ncols, o, m, l);
      }
    }
  }
}

void check_attention_scalars(const char* op, int64_t dqk, float sm_scale, int64_t d_v) {
  require(std::isfinite(sm_scale) && sm_scale > 0.0f, op, "sm_scale", "a finite number > 0",
          std::to_string(sm_scale));
  require(d_v >= 1 && d_v <= dqk, op, "d_v", "an int in [1, " + s(dqk) + "] (Dqk)", s(d_v));
}

struct SparseRows {
  const int32_t* indices;
  int64_t topk, nrows;
  const char* kv;
  int64_t row_bytes;
  int64_t count(int64_t) const { return topk; }
  const void* row(int64_t t, int64_t j) const {
    const int64_t idx = indices[t * topk + j];
    return (idx >= 0 && idx < nrows) ? kv + idx * row_bytes : nullptr;
  }
};

struct PagedSparseRows {
  PagedLookup lookup;
  const int32_t* indices;
  const int32_t* context_lens;
  int64_t topk, queries;
  int64_t count(int64_t) const { return topk; }
  const void* row(int64_t t, int64_t j) const {
    const int64_t b = t / queries;
    const int64_t p = indices[t * topk + j];
    return (p >= 0 && p < context_lens[b]) ? lookup.row(b, p) : nullptr;
  }
};

inline int64_t decode_visible(const int32_t* context_lens, int64_t queries, int64_t t) {
  const int64_t b = t / queries, i = t % queries;
  return std::max<int64_t>(0, static_cast<int64_t>(context_lens[b]) - queries + i + 1);
}

struct DenseRows {
  PagedLookup lookup;
  const int32_t* context_lens;
  int64_t queries;
  int64_t count(int64_t t) const { return decode_visible(context_lens, queries, t); }
  const void* row(int64_t t, int64_t j) const { return lookup.row(t / queries, j); }
};

// ================================ indexer ==================================================

enum class IdxPath { Bf16Dot, F32Direct, F32Staged };

// One query group: queries [q_first, q_first + nq) of sequence `seq`, key union [lo, hi).
struct QueryGroup {
  int64_t seq, q_first, nq, lo, hi;
};

struct IndexerSetup {
  const char* op;
  const void* q;
  DType qdtype;
  int64_t heads, dim;
  const float* weights;
  DType kdtype;
  std::vector<int64_t> start, end;  // per query
  std::vector<QueryGroup> groups;
  int64_t max_group_queries;
  // outputs: exactly one of these
  float* logits = nullptr;
  int64_t logits_stride = 0, logits_width = 0;
  int32_t* topk_out = nullptr;
  int64_t topk = 0;
};

// Column groups of a query group: vectors of kLanes (query, head) columns, <= kMaxVecs each.
struct ColumnGroup {
  int nvec;
  int vec_slot[kMaxVecs];   // query slot in the group
  int vec_lanes[kMaxVecs];  // real heads in the vector
};

struct IdxScratch {
  Buf<float> qpack;  // all column groups, each [pairs or dim][ncols]
  Buf<float> w;      // per column group [ncols]
  Buf<float> tmp_row;
  Buf<float> s;
  Buf<const void*> rows;
  Buf<float> scales;
  Buf<float> staged;  // [kTile][dim] fp32, or bf16 reinterpreted
  Buf<const void*> srows;
  Buf<float> rowbuf;  // [nq][chunk]
  Buf<float> cand_val;
  Buf<int32_t> cand_pos;
  Buf<float> tmp_val;
  Buf<int32_t> tmp_pos;
  Buf<int32_t> sel;
  std::vector<int64_t> cand_n;
  std::vector<ColumnGroup> cgroups;
  std::vector<float*> out_rows, tile_out;
  dsa::SelectScratch select;
};

template <class Src>
void run_indexer(const IndexerSetup& st, const Src& src, int nthreads) {
  const int64_t ngroups = static_cast<int64_t>(st.groups.size());
  if (ngroups == 0) return;
  const Kernels& K = active_kernels();
  const bool fp8 = st.kdtype == DType::F8E4M3;
  const IdxPath path = (st.qdtype == DType::BF16 && K.qk_bf16) ? IdxPath::Bf16Dot
                       : (st.qdtype == DType::F32 && !fp8)       ? IdxPath::F32Direct
                                                                 : IdxPath::F32Staged;
  const bool topk_mode = st.topk_out != nullptr;
  const int64_t hp = round_up(st.heads, kLanes);
  const int64_t vecs_per_query = hp / kLanes;
  const int64_t qdepth = path == IdxPath::Bf16Dot ? (st.dim + 1) / 2 : st.dim;  // rows of a packed Q^T
  int64_t gq = 1;  // queries in the largest group: sizes the per-query scratch
  for (const QueryGroup& g : st.groups) gq = std::max(gq, g.nq);
  const int64_t max_vecs = gq * vecs_per_query;
  const int64_t max_cgroups = (max_vecs + kMaxVecs - 1) / kMaxVecs;

  int64_t max_len = 0;
  for (const QueryGroup& g : st.groups) max_len = std::max(max_len, g.hi - g.lo);
  int64_t parts = 1;
  if (nthreads > 1 && ngroups < 4 * nthreads) {
    parts = (4 * nthreads + ngroups - 1) / ngroups;
    parts = std::max<int64_t>(1, std::min(parts, max_len / 2048));
  }
  // keys scored per chunk into the row buffer (topk mode); logits go straight to the output
  const int64_t chunk = topk_mode ? std::min<int64_t>(round_up(std::max<int64_t>(max_len / parts + 1, 1), kTile),
                                                      16384)
                                  : 0;
  const int64_t cap = topk_mode ? std::min(st.topk, max_len) : 0;  // candidates kept per query

  std::vector<IdxScratch> scratch(static_cast<size_t>(nthreads));
  for (IdxScratch& sc : scratch) {
    sc.qpack.reserve(static_cast<size_t>(max_cgroups * qdepth * kMaxVecs * kLanes));
    sc.w.reserve(static_cast<size_t>(max_cgroups * kMaxVecs * kLanes));
    sc.tmp_row.reserve(static_cast<size_t>(st.dim));
    sc.cgroups.resize(static_cast<size_t>(max_cgroups));
    sc.out_rows.resize(static_cast<size_t>(gq));
    sc.tile_out.resize(static_cast<size_t>(gq));
    sc.s.reserve(static_cast<size_t>(kTile * kMaxVecs * kLanes));
    sc.rows.reserve(kTile);
    sc.srows.reserve(kTile);
    sc.scales.reserve(kTile);
    if (path == IdxPath::F32Staged || fp8) sc.staged.reserve(static_cast<size_t>(kTile * st.dim));
    if (topk_mode) {
      sc.rowbuf.reserve(static_cast<size_t>(gq * chunk));
      sc.cand_val.reserve(static_cast<size_t>(gq * 2 * cap));
      sc.cand_pos.reserve(static_cast<size_t>(gq * 2 * cap));
      sc.tmp_val.reserve(static_cast<size_t>(2 * cap));
      sc.tmp_pos.reserve(static_cast<size_t>(2 * cap));
      sc.sel.reserve(static_cast<size_t>(std::max(chunk, 2 * cap)));
      sc.cand_n.assign(static_cast<size_t>(gq), 0);
      sc.select.reserve(static_cast<size_t>(std::max(chunk, 2 * cap)));
    }
  }
  // candidates of each (group, part, query slot) when parts > 1: count, then values/positions
  std::vector<int64_t> part_n;
  Buf<float> part_val;
  Buf<int32_t> part_pos;
  if (topk_mode && parts > 1) {
    part_n.assign(static_cast<size_t>(ngroups * parts * gq), 0);
    part_val.reserve(static_cast<size_t>(ngroups * parts * gq * cap));
    part_pos.reserve(static_cast<size_t>(ngroups * parts * gq * cap));
  }
  auto part_slot = [&](int64_t g, int64_t p, int64_t qs) { return (g * parts + p) * gq + qs; };

  const size_t qes = elem_size(st.qdtype);
  const int64_t key_row_bytes = st.dim * static_cast<int64_t>(elem_size(st.kdtype));

  // Keeps a query's candidate list (capacity 2 * cap) at its best `cap` entries.
  auto compact = [&](IdxScratch& sc, float* cv, int32_t* cp, int64_t& cn) {
    if (cn <= cap) return;
    const int64_t kept = dsa::select_topk(cv, cn, cap, sc.sel.data(), sc.select);
    for (int64_t i = 0; i < kept; ++i) {
      sc.tmp_val[i] = cv[sc.sel[i]];
      sc.tmp_pos[i] = cp[sc.sel[i]];
    }
    std::copy(sc.tmp_val.data(), sc.tmp_val.data() + kept, cv);
    std::copy(sc.tmp_pos.data(), sc.tmp_pos.data() + kept, cp);
    cn = kept;
  };

  // Adds the best `cap` of vals[0, n) (positions base + i) to query slot qs's candidates.
  auto add_candidates = [&](IdxScratch& sc, int64_t qs, const float* vals, int64_t n, int64_t base) {
    float* cv = sc.cand_val.data() + qs * 2 * cap;
    int32_t* cp = sc.cand_pos.data() + qs * 2 * cap;
    int64_t& cn = sc.cand_n[static_cast<size_t>(qs)];
    const int64_t m = dsa::select_topk(vals, n, cap, sc.sel.data(), sc.select);
    for (int64_t i = 0; i < m; ++i) {
      cv[cn + i] = vals[sc.sel[i]];
      cp[cn + i] = static_cast<int32_t>(base + sc.sel[i]);
    }
    cn += m;
    compact(sc, cv, cp, cn);
  };

  auto write_topk = [&](int64_t query, const int32_t* pos, int64_t n) {
    int32_t* out = st.topk_out + query * st.topk;
    std::copy(pos, pos + n, out);
    std::fill(out + n, out + st.topk, -1);
  };

#pragma omp parallel num_threads(nthreads)
  {
    IdxScratch& sc = scratch[static_cast<size_t>(thread_id())];
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < ngroups * parts; ++item) {
      const QueryGroup& grp = st.groups[static_cast<size_t>(item / parts)];
      const int64_t part = item % parts;
      const int64_t len = grp.hi - grp.lo;
      const int64_t p_lo = grp.lo + len * part / parts, p_hi = grp.lo + len * (part + 1) / parts;

      // column groups of this query group, and their packed Q^T and weights
      ColumnGroup* cgs = sc.cgroups.data();
      int ncg = 0;
      const int64_t nvec_all = grp.nq * vecs_per_query;
      for (int64_t v0 = 0; v0 < nvec_all; v0 += kMaxVecs) {
        ColumnGroup& cg = cgs[ncg];
        cg.nvec = static_cast<int>(std::min<int64_t>(kMaxVecs, nvec_all - v0));
        const int ncols = cg.nvec * kLanes;
        float* qpack = sc.qpack.data() + ncg * qdepth * kMaxVecs * kLanes;
        float* w = sc.w.data() + ncg * kMaxVecs * kLanes;
        for (int v = 0; v < cg.nvec; ++v) {
          const int64_t qs = (v0 + v) / vecs_per_query;
          const int64_t h0 = ((v0 + v) % vecs_per_query) * kLanes;
          cg.vec_slot[v] = static_cast<int>(qs);
          cg.vec_lanes[v] = static_cast<int>(std::min<int64_t>(kLanes, st.heads - h0));
          const int64_t query = grp.q_first + qs;
          const void* qrow = static_cast<const char*>(st.q) + query * st.heads * st.dim * qes;
          if (path == IdxPath::Bf16Dot)
            pack_q_bf16(static_cast<const uint16_t*>(qrow), st.heads, st.dim, h0, kLanes,
                        reinterpret_cast<uint32_t*>(qpack) + v * kLanes, ncols);
          else
            pack_q_f32(K, st.qdtype, qrow, st.heads, st.dim, h0, kLanes, qpack + v * kLanes, ncols,
                       sc.tmp_row.data());
          for (int lane = 0; lane < kLanes; ++lane) {
            const int64_t h = h0 + lane;
            w[v * kLanes + lane] = h < st.heads ? st.weights[query * st.heads + h] : 0.0f;
          }
        }
        ++ncg;
      }

      if (topk_mode)
        for (int64_t qs = 0; qs < grp.nq; ++qs) sc.cand_n[static_cast<size_t>(qs)] = 0;

      const int64_t step = topk_mode ? chunk : std::max<int64_t>(p_hi - p_lo, 1);
      for (int64_t c0 = p_lo; c0 < p_hi; c0 += step) {
        const int64_t c1 = std::min(p_hi, c0 + step);
        float** out_rows = sc.out_rows.data();
        for (int64_t qs = 0; qs < grp.nq; ++qs) {
          float* r = topk_mode ? sc.rowbuf.data() + qs * chunk
                               : st.logits + (grp.q_first + qs) * st.logits_stride + c0;
          std::fill(r, r + (c1 - c0), 0.0f);
          out_rows[qs] = r;
        }
        for (int64_t k0 = c0; k0 < c1; k0 += kTile) {
          const int n = static_cast<int>(std::min<int64_t>(kTile, c1 - k0));
          src.resolve(grp.seq, k0, n, sc.rows.data(), fp8 ? sc.scales.data() : nullptr);
          if (k0 + kTile < c1)
            src.prefetch(grp.seq, k0 + kTile, std::min<int64_t>(kTile, c1 - k0 - kTile), key_row_bytes);
          const void* const* krows = sc.rows.data();
          if (path == IdxPath::Bf16Dot && fp8) {
            uint16_t* staged = reinterpret_cast<uint16_t*>(sc.staged.data());
            for (int i = 0; i < n; ++i) {
              K.fp8_to_bf16(static_cast<const uint8_t*>(sc.rows[i]), st.dim, staged + i * st.dim);
              sc.srows[i] = staged + i * st.dim;
            }
            krows = sc.srows.data();
          } else if (path == IdxPath::F32Staged) {
            for (int i = 0; i < n; ++i) {
              float* row = sc.staged.data() + i * st.dim;
              K.to_f32(st.kdtype, sc.rows[i], st.dim, row);
              // FP8 keys dequantised as the contract writes it, k_fp8.float() * k_scale, so
              // an fp32 query gets exactly the float-key result on dequantised keys
              if (fp8)
                for (int64_t d = 0; d < st.dim; ++d) row[d] *= sc.scales[i];
              sc.srows[i] = row;
            }
            krows = sc.srows.data();
          }
          // the bfloat16 dot path stages exact bf16(e4m3) keys; the scale multiplies each dot
          const float* key_scale = (fp8 && path == IdxPath::Bf16Dot) ? sc.scales.data() : nullptr;
          float** tile_out = sc.tile_out.data();
          for (int64_t qs = 0; qs < grp.nq; ++qs) tile_out[qs] = out_rows[qs] + (k0 - c0);
          for (int cgi = 0; cgi < ncg; ++cgi) {
            const ColumnGroup& cg = cgs[cgi];
            const float* qpack = sc.qpack.data() + cgi * qdepth * kMaxVecs * kLanes;
            if (path == IdxPath::Bf16Dot)
              K.qk_bf16(reinterpret_cast<const uint32_t*>(qpack), cg.nvec,
                        reinterpret_cast<const uint16_t* const*>(krows), n, st.dim, sc.s.data());
            else
              K.qk_f32(qpack, cg.nvec, reinterpret_cast<const float* const*>(krows), n, st.dim, sc.s.data());
            K.indexer_reduce(sc.s.data(), n, cg.nvec, cg.vec_slot, cg.vec_lanes,
                             sc.w.data() + cgi * kMaxVecs * kLanes, key_scale, tile_out);
          }
        }
        for (int64_t qs = 0; qs < grp.nq; ++qs) {
          const int64_t query = grp.q_first + qs;
          const int64_t a = std::max(c0, st.start[query]), b = std::min(c1, st.end[query]);
          if (topk_mode) {
            if (b > a) add_candidates(sc, qs, out_rows[qs] + (a - c0), b - a, a);
          } else {
            // keys of the group's union outside this query's own range
            float* r = out_rows[qs];
            const int64_t own_lo = st.start[query], own_hi = st.end[query];
            for (int64_t p = c0; p < std::min(c1, own_lo); ++p) r[p - c0] = kNegInf;
            for (int64_t p = std::max(c0, own_hi); p < c1; ++p) r[p - c0] = kNegInf;
          }
        }
      }

      if (!topk_mode) {
        if (part == 0)  // outside the union
          for (int64_t qs = 0; qs < grp.nq; ++qs) {
            float* r = st.logits + (grp.q_first + qs) * st.logits_stride;
            std::fill(r, r + grp.lo, kNegInf);
            std::fill(r + grp.hi, r + st.logits_width, kNegInf);
          }
        continue;
      }
      for (int64_t qs = 0; qs < grp.nq; ++qs) {
        const int64_t cn = sc.cand_n[static_cast<size_t>(qs)];
        const int32_t* cp = sc.cand_pos.data() + qs * 2 * cap;
        if (parts == 1) {
          write_topk(grp.q_first + qs, cp, cn);  // add_candidates keeps cn <= cap = topk or less
        } else {
          const int64_t slot = part_slot(item / parts, part, qs);
          part_n[static_cast<size_t>(slot)] = cn;
          std::copy(sc.cand_val.data() + qs * 2 * cap, sc.cand_val.data() + qs * 2 * cap + cn,
                    part_val.data() + slot * cap);
          std::copy(cp, cp + cn, part_pos.data() + slot * cap);
        }
      }
    }

    if (topk_mode && parts > 1) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t gqi = 0; gqi < ngroups * gq; ++gqi) {
        const int64_t g = gqi / gq, qs = gqi % gq;
        const QueryGroup& grp = st.groups[static_cast<size_t>(g)];
        if (qs >= grp.nq) continue;
        // the parts' lists (each <= cap) one after another, keeping the best cap
        float* cv = sc.cand_val.data();
        int32_t* cp = sc.cand_pos.data();
        int64_t cn = 0;
        for (int64_t p = 0; p < parts; ++p) {
          const int64_t slot = part_slot(g, p, qs);
          const int64_t n = part_n[static_cast<size_t>(slot)];
          std::copy(part_val.data() + slot * cap, part_val.data() + slot * cap + n, cv + cn);
          std::copy(part_pos.data() + slot * cap, part_pos.data() + slot * cap + n, cp + cn);
          cn += n;
          compact(sc, cv, cp, cn);
        }
        write_topk(grp.q_first + qs, cp, cn);
      }
    }
  }
}

// Key sources of the indexer: rows (and FP8 scales) of positions p0 .. p0 + n - 1.
struct PlainKeys {
  const char* data;
  int64_t row_bytes;
  const float* scales;
  int64_t scale_stride;
  void resolve(int64_t, int64_t p0, int64_t n, const void** rows, float* row_scales) const {
    for (int64_t i = 0; i < n; ++i) rows[i] = data + (p0 + i) * row_bytes;
    if (row_scales)
      for (int64_t i = 0; i < n; ++i) row_scales[i] = scales[(p0 + i) * scale_stride];
  }
  void prefetch(int64_t, int64_t p0, int64_t n, int64_t bytes) const {
    for (int64_t i = 0; i < n; ++i) prefetch_row(data + (p0 + i) * row_bytes, bytes);
  }
};

struct PagedKeys {
  PagedLookup lookup;
  void resolve(int64_t b, int64_t p0, int64_t n, const void** rows, float* row_scales) const {
    if (row_scales)
      lookup.walk(b, p0, n, [&](int64_t i, const char* row, int64_t block, int64_t off) {
        rows[i] = row;
        row_scales[i] = lookup.scale[block * lookup.scale_block_stride + off * lookup.scale_row_stride];
      });
    else
      lookup.walk(b, p0, n, [&](int64_t i, const char* row, int64_t, int64_t) { rows[i] = row; });
  }
  void prefetch(int64_t b, int64_t p0, int64_t n, int64_t bytes) const {
    lookup.walk(b, p0, n, [&](int64_t, const char* row, int64_t, int64_t) { prefetch_row(row, bytes); });
  }
};

int64_t group_queries_limit(int64_t heads) {
  const int64_t vecs = round_up(heads, kLanes) / kLanes;
  return std::max<int64_t>(1, std::min<int64_t>(16 / vecs, 64));
}

// Consecutive tokens whose ranges overlap enough to share key loads.
std::vector<QueryGroup> group_tokens(const std::vector<int64_t>& start, const std::vector<int64_t>& end,
                                     int64_t limit) {
  std::vector<QueryGroup> groups;
  const int64_t n = static_cast<int64_t>(start.size());
  int64_t t = 0;
  while (t < n) {
    QueryGroup g{0, t, 1, start[t], end[t]};
    int64_t longest = end[t] - start[t];
    while (g.q_first + g.nq < n && g.nq < limit) {
      const int64_t u = g.q_first + g.nq;
      const int64_t lo = std::min(g.lo, start[u]), hi = std::max(g.hi, end[u]);
      const int64_t lg = std::max(longest, end[u] - start[u]);
      // the union may exceed the longest own range by a quarter plus a tile
      if (hi - lo > lg + lg / 4 + kTile) break;
      g.lo = lo;
      g.hi = hi;
      longest = lg;
      ++g.nq;
    }
    if (g.hi < g.lo) g.hi = g.lo;
    groups.push_back(g);
    t += g.nq;
  }
  return groups;
}

void check_keys(const char* op, const DsaKeys& k, DType qd, int64_t dim) {
  require(k.dtype == qd || k.dtype == DType::F8E4M3, op, "k",
          std::string("dtype ") + dtype_name(qd) + " (that of 'q') or float8_e4m3fn with a scale",
          dtype_name(k.dtype));
  require(k.rows >= 0, op, "k", "rows >= 0", s(k.rows));
  require(k.dim == dim, op, "k", "last dim " + s(dim) + " (the head dim of 'q')", s(k.dim));
  require(k.row_stride >= k.dim, op, "k", "a row stride >= dim", s(k.row_stride));
  check_ptr(op, "k", k.data, k.rows > 0);
  if (k.dtype == DType::F8E4M3) {
    check_ptr(op, "k_scale", k.scale, k.rows > 0);
    require(k.scale_stride >= 1, op, "k_scale", "a stride >= 1", s(k.scale_stride));
  }
}

IndexerSetup indexer_setup(const char* op, const void* q, DType qd, int64_t tokens, int64_t heads, int64_t dim,
                           const DsaKeys& k, const float* weights, const int32_t* k_start, const int32_t* k_end) {
  check_threads_and_q(op, q, qd, tokens, heads, dim, "head dim");
  check_keys(op, k, qd, dim);
  check_ptr(op, "weights", weights, tokens > 0);
  check_ptr(op, "k_start", k_start, tokens > 0);
  check_ptr(op, "k_end", k_end, tokens > 0);
  IndexerSetup st{op, q, qd, heads, dim, weights, k.dtype, {}, {}, {}, group_queries_limit(heads)};
  st.start.resize(static_cast<size_t>(tokens));
  st.end.resize(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t a = k_start[t], b = k_end[t];
    require(b >= 0 && b <= k.rows, op, "k_end", "values in [0, " + s(k.rows) + "] (S, the number of keys)",
            s(b) + " at t=" + s(t));
    require(a >= 0 && a <= b, op, "k_start", "0 <= k_start[t] <= k_end[t]",
            "k_start[" + s(t) + "] = " + s(a) + " with k_end[" + s(t) + "] = " + s(b));
    st.start[static_cast<size_t>(t)] = a;
    st.end[static_cast<size_t>(t)] = b;
  }
  st.groups = group_tokens(st.start, st.end, st.max_group_queries);
  return st;
}

}  // namespace

// ================================ entry points =============================================

void indexer_logits(float* out, int64_t out_row_stride, const void* q, DType q_dtype, int64_t tokens, int64_t heads,
                    int64_t dim, const DsaKeys& k, const float* weights, const int32_t* k_start,
                    const int32_t* k_end, int num_threads) {
  const char* op = "indexer_logits";
  IndexerSetup st = indexer_setup(op, q, q_dtype, tokens, heads, dim, k, weights, k_start, k_end);
  require(out_row_stride >= k.rows, op, "out", "a row stride >= S", s(out_row_stride));
  check_ptr(op, "out", out, tokens > 0 && k.rows > 0);
  st.logits = out;
  st.logits_stride = out_row_stride;
  st.logits_width = k.rows;
  const PlainKeys src{static_cast<const char*>(k.data), k.row_stride * static_cast<int64_t>(elem_size(k.dtype)),
                      k.scale, k.scale_stride};
  run_indexer(st, src, clamp_threads(num_threads));
}

void indexer_topk(int32_t* out, int64_t topk, const void* q, DType q_dtype, int64_t tokens, int64_t heads,
                  int64_t dim, const DsaKeys& k, const float* weights, const int32_t* k_start, const int32_t* k_end,
                  int num_threads) {
  const char* op = "indexer_topk";
  require(topk >= 1 && topk <= std::numeric_limits<int32_t>::max(), op, "topk", "an int in [1, 2^31)", s(topk));
  IndexerSetup st = indexer_setup(op, q, q_dtype, tokens, heads, dim, k, weights, k_start, k_end);
  check_ptr(op, "out", out, tokens > 0);
  st.topk_out = out;
  st.topk = topk;
  const PlainKeys src{static_cast<const char*>(k.data), k.row_stride * static_cast<int64_t>(elem_size(k.dtype)),
                      k.scale, k.scale_stride};
  run_indexer(st, src, clamp_threads(num_threads));
}

void indexer_topk_paged(int32_t* out, int64_t topk, const void* q, DType q_dtype, int64_t batch, int64_t queries,
                        int64_t heads, int64_t dim, const DsaPagedCache& k_cache, const float* weights,
                        const DsaPaging& paging, int num_threads) {
  const char* op = "indexer_topk_paged";
  require(topk >= 1 && topk <= std::numeric_limits<int32_t>::max(), op, "topk", "an int in [1, 2^31)", s(topk));
  require(queries >= 1, op, "q", "N >= 1 queries per sequence", s(queries));
  check_threads_and_q(op, q, q_dtype, batch, heads, dim, "head dim");
  require(k_cache.dtype == q_dtype || k_cache.dtype == DType::F8E4M3, op, "k_cache",
          std::string("dtype ") + dtype_name(q_dtype) + " (that of 'q') or float8_e4m3fn with a scale",
          dtype_name(k_cache.dtype));
  check_paging(op, "k_cache", k_cache, paging, batch, dim);
  check_ptr(op, "weights", weights, batch > 0);
  check_ptr(op, "out", out, batch > 0);
  IndexerSetup st{op, q, q_dtype, heads, dim, weights, k_cache.dtype, {}, {}, {}, group_queries_limit(heads)};
  const int64_t nq = batch * queries;
  st.start.assign(static_cast<size_t>(nq), 0);
  st.end.resize(static_cast<size_t>(nq));
  for (int64_t t = 0; t < nq; ++t) st.end[static_cast<size_t>(t)] = decode_visible(paging.context_lens, queries, t);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i0 = 0; i0 < queries; i0 += st.max_group_queries) {
      const int64_t n = std::min(st.max_group_queries, queries - i0);
      const int64_t first = b * queries + i0;
      // visible ranges grow with i: the last query's is the union
      st.groups.push_back(QueryGroup{b, first, n, 0, st.end[static_cast<size_t>(first + n - 1)]});
    }
  st.topk_out = out;
  st.topk = topk;
  run_indexer(st, PagedKeys{PagedLookup(k_cache, paging)}, clamp_threads(num_threads));
}

void sparse_mla_attention(void* out, float* lse, const void* q, DType q_dtype, int64_t tokens, int64_t heads,
                          int64_t dqk, const void* kv, int64_t kv_rows, int64_t kv_row_stride, const int32_t* indices,
                          int64_t topk, float sm_scale, int64_t d_v, int num_threads) {
  const char* op = "sparse_mla_attention";
  check_threads_and_q(op, q, q_dtype, tokens, heads, dqk, "Dqk");
  check_attention_scalars(op, dqk, sm_scale, d_v);
  require(kv_rows >= 0, op, "kv", "rows >= 0", s(kv_rows));
  require(kv_row_stride >= dqk, op, "kv", "a row stride >= Dqk", s(kv_row_stride));
  require(topk >= 1, op, "indices", "topk >= 1", s(topk));
  check_ptr(op, "kv", kv, kv_rows > 0);
  check_ptr(op, "indices", indices, tokens > 0);
  check_ptr(op, "out", out, tokens > 0);
  check_ptr(op, "lse", lse, tokens > 0);
  const AttnSetup st{op, q, q_dtype, tokens, heads, dqk, d_v, sm_scale, out, lse};
  const SparseRows rows{indices, topk, kv_rows, static_cast<const char*>(kv),
                        kv_row_stride * static_cast<int64_t>(elem_size(q_dtype))};
  run_attention(st, rows, clamp_threads(num_threads));
}

void sparse_mla_decode_paged(void* out, float* lse, const void* q, DType q_dtype, int64_t batch, int64_t queries,
                             int64_t heads, int64_t dqk, const DsaPagedCache& kv_cache, const DsaPaging& paging,
                             const int32_t* indices, int64_t topk, float sm_scale, int64_t d_v, int num_threads) {
  const char* op = "sparse_mla_decode_paged";
  require(queries >= 1, op, "q", "N >= 1 queries per sequence", s(queries));
  check_threads_and_q(op, q, q_dtype, batch, heads, dqk, "Dqk");
  check_attention_scalars(op, dqk, sm_scale, d_v);
  require(kv_cache.dtype == q_dtype, op, "kv_cache", std::string("dtype ") + dtype_name(q_dtype) + " (that of 'q')",
          dtype_name(kv_cache.dtype));
  check_paging(op, "kv_cache", kv_cache, paging, batch, dqk);
  require(topk >= 1, op, "indices", "topk >= 1", s(topk));
  check_ptr(op, "indices", indices, batch > 0);
  check_ptr(op, "out", out, batch > 0);
  check_ptr(op, "lse", lse, batch > 0);
  const AttnSetup st{op, q, q_dtype, batch * queries, heads, dqk, d_v, sm_scale, out, lse};
  const PagedSparseRows rows{PagedLookup(kv_cache, paging), indices, paging.context_lens, topk, queries};
  run_attention(st, rows, clamp_threads(num_threads));
}

void dense_mla_decode_paged(void* out, float* lse, const void* q, DType q_dtype, int64_t batch, int64_t queries,
                            int64_t heads, int64_t dqk, const DsaPagedCache& kv_cache, const DsaPaging& paging,
                            float sm_scale, int64_t d_v, int num_threads) {
  const char* op = "dense_mla_decode_paged";
  require(queries >= 1, op, "q", "N >= 1 queries per sequence", s(queries));
  check_threads_and_q(op, q, q_dtype, batch, heads, dqk, "Dqk");
  check_attention_scalars(op, dqk, sm_scale, d_v);
  require(kv_cache.dtype == q_dtype, op, "kv_cache", std::string("dtype ") + dtype_name(q_dtype) + " (that of 'q')",
          dtype_name(kv_cache.dtype));
  check_paging(op, "kv_cache", kv_cache, paging, batch, dqk);
  check_ptr(op, "out", out, batch > 0);
  check_ptr(op, "lse", lse, batch > 0);
  const AttnSetup st{op, q, q_dtype, batch * queries, heads, dqk, d_v, sm_scale, out, lse};
  const DenseRows rows{PagedLookup(kv_cache, paging), paging.context_lens, queries};
  run_attention(st, rows, clamp_threads(num_threads));
}

int dsa_isa() { return active_kernels().isa; }

int dsa_max_isa() {
#if GLM5_DSA_X86
  if (dsa::avx512_bf16_kernels()) return 3;
  if (dsa::avx512_kernels()) return 2;
  if (dsa::avx2_kernels()) return 1;
#endif
  return 0;
}

int dsa_set_isa_limit(int limit) { return g_isa_limit.exchange(std::max(0, std::min(limit, kTopTier))); }

}  // namespace glm5
