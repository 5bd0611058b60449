// The register-blocked QK and PV tile kernels written with GCC/Clang vector extensions, so
// one source compiles to SSE2 / NEON registers in the portable tier and to ymm FMAs in the
// AVX2 tier. Included (inside namespace glm5::dsa) by dsa_kernels_generic.cpp and
// dsa_kernels_avx2.cpp, each of which first defines:
//   GLM5_VEC_FLOATS             floats per vector: one register of the ISA (4 or 8)
//   GLM5_PORTABLE_FMA(a, b, c)  a * b + c on VecF (fused where the ISA has it)
//   GLM5_QK_VECS, GLM5_QK_KEYS  QK register block: vectors of columns x keys; GLM5_QK_VECS
//                               vectors must divide kLanes columns or be a multiple of them
//   GLM5_PV_VECS                PV register block: vectors of value dims (x 4 heads)
// Everything here has internal linkage: each includer gets its own copy, compiled for its ISA.
// No standard-library templates are used below, so nothing here can be instantiated for one
// ISA and picked by the linker for another.

namespace {

constexpr int kVecF = GLM5_VEC_FLOATS;
typedef float VecF __attribute__((vector_size(kVecF * sizeof(float))));

inline VecF load_vec(const float* p) {
  VecF v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline void store_vec(float* p, VecF v) { __builtin_memcpy(p, &v, sizeof v); }

inline VecF splat(float x) { return VecF{} + x; }

inline int min_int(int a, int b) { return a < b ? a : b; }

typedef int32_t VecI __attribute__((vector_size(kVecF * sizeof(int32_t))));

inline VecF max_vec(VecF a, VecF b) { return a > b ? a : b; }

// exp(x) to ~1 ulp, as the AVX-512 tier: x = n ln2 + r (Cody-Waite), Cephes' polynomial for
// exp(r), times 2^n built in the exponent bits. Below -87.3 (where 2^n leaves the normal
// range) the result is 0, which also makes exp(-inf) = 0; nan stays nan.
inline VecF exp_vec(VecF x) {
  const VecF lo = splat(-87.3f), hi = splat(88.3f);
  const VecF xc = x < lo ? lo : (x > hi ? hi : x);
  const VecF fx = xc * 1.44269504088896341f;
  const VecI n = __builtin_convertvector(fx + (fx >= 0.0f ? splat(0.5f) : splat(-0.5f)), VecI);
  const VecF nf = __builtin_convertvector(n, VecF);
  const VecF r = (xc - nf * 0.693359375f) - nf * -2.12194440e-4f;
  VecF y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + (r + 1.0f);
  VecF scale;
  const VecI bits = (n + 127) << 23;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  const VecF result = x < lo ? splat(0.0f) : y * scale;
  return x != x ? x : result;
}

// Kernels::softmax_tile, kVecF columns at a time (ncols is a multiple of kLanes).
void portable_softmax_tile(float* s, int nkeys, int ncols, float scale, float* m, float* l, float* alpha) {
  const VecF ninf = splat(-__builtin_inff());
  for (int c = 0; c < ncols; c += kVecF) {
    VecF mx = ninf;
    for (int k = 0; k < nkeys; ++k) mx = max_vec(mx, load_vec(s + static_cast<int64_t>(k) * ncols + c) * scale);
    const VecF m_old = load_vec(m + c);
    const VecF m_new = max_vec(m_old, mx);
    const VecF a = m_old == ninf ? splat(0.0f) : exp_vec(m_old - m_new);
    // all scores -inf so far: exp(-inf - 0) = 0 rather than exp(-inf + inf) = nan, as the reference
    const VecF shift = m_new == ninf ? splat(0.0f) : m_new;
    VecF sum = splat(0.0f);
    for (int k = 0; k < nkeys; ++k) {
      float* sk = s + static_cast<int64_t>(k) * ncols + c;
      const VecF p = exp_vec(load_vec(sk) * scale - shift);
      store_vec(sk, p);
      sum += p;
    }
    store_vec(l + c, load_vec(l + c) * a + sum);
    store_vec(m + c, m_new);
    store_vec(alpha + c, a);
  }
}

// s[k][c0 .. c0 + NV*8) for KB keys (r), over the whole dim.
template <int NV, int KB>
inline void qk_block(const float* qt, int ncols, int c0, const float* const* r, int64_t dim, float* s, int nstore) {
  VecF acc[KB][NV];
  for (int k = 0; k < KB; ++k)
    for (int v = 0; v < NV; ++v) acc[k][v] = splat(0.0f);
  for (int64_t d = 0; d < dim; ++d) {
    VecF q[NV];
    for (int v = 0; v < NV; ++v) q[v] = load_vec(qt + d * ncols + c0 + v * kVecF);
    for (int k = 0; k < KB; ++k) {
      const VecF b = splat(r[k][d]);
      for (int v = 0; v < NV; ++v) acc[k][v] = GLM5_PORTABLE_FMA(q[v], b, acc[k][v]);
    }
  }
  for (int k = 0; k < nstore; ++k)
    for (int v = 0; v < NV; ++v) store_vec(s + static_cast<int64_t>(k) * ncols + c0 + v * kVecF, acc[k][v]);
}

template <int NV>
inline void qk_columns(const float* qt, int ncols, int c0, const float* const* rows, int nkeys, int64_t dim,
                       float* s) {
  constexpr int KB = GLM5_QK_KEYS;
  for (int k0 = 0; k0 < nkeys; k0 += KB) {
    const int n = min_int(KB, nkeys - k0);
    const float* r[KB];
    // a short last block recomputes its last key instead of reading past the tile
    for (int i = 0; i < KB; ++i) r[i] = rows[k0 + min_int(i, n - 1)];
    qk_block<NV, KB>(qt, ncols, c0, r, dim, s + static_cast<int64_t>(k0) * ncols, n);
  }
}

void portable_qk_f32(const float* qt, int nvec, const float* const* rows, int nkeys, int64_t dim, float* s) {
  const int ncols = nvec * kLanes;  // whole vectors of kLanes columns
  int c0 = 0;
  for (; c0 + GLM5_QK_VECS * kVecF <= ncols; c0 += GLM5_QK_VECS * kVecF)
    qk_columns<GLM5_QK_VECS>(qt, ncols, c0, rows, nkeys, dim, s);
  for (; c0 < ncols; c0 += kLanes) qk_columns<kLanes / kVecF>(qt, ncols, c0, rows, nkeys, dim, s);
}

// o[h0 .. h0+4)[d0 .. d0 + DC*8) <- o * alpha + sum_k p[k][h] * rows[k][d].
template <int DC>
inline void pv_block(const float* p, int ncols, int h0, const float* const* rows, int nkeys, int64_t d0, float* o,
                     int64_t os, const float* alpha) {
  VecF acc[4][DC];
  for (int h = 0; h < 4; ++h) {
    const VecF a = splat(alpha[h0 + h]);
    for (int c = 0; c < DC; ++c) acc[h][c] = load_vec(o + (h0 + h) * os + d0 + c * kVecF) * a;
  }
  for (int k = 0; k < nkeys; ++k) {
    VecF v[DC];
    for (int c = 0; c < DC; ++c) v[c] = load_vec(rows[k] + d0 + c * kVecF);
    const float* pk = p + static_cast<int64_t>(k) * ncols + h0;
    for (int h = 0; h < 4; ++h) {
      const VecF b = splat(pk[h]);
      for (int c = 0; c < DC; ++c) acc[h][c] = GLM5_PORTABLE_FMA(b, v[c], acc[h][c]);
    }
  }
  for (int h = 0; h < 4; ++h)
    for (int c = 0; c < DC; ++c) store_vec(o + (h0 + h) * os + d0 + c * kVecF, acc[h][c]);
}

void portable_pv_f32(const float* p, int ncols, const float* const* rows, int nkeys, int64_t dv, float* o,
                     int64_t os, const float* alpha) {
  constexpr int DC = GLM5_PV_VECS;
  const int64_t full = dv / kVecF * kVecF;  // value dims covered by whole vectors
  int64_t d0 = 0;
  for (; d0 + DC * kVecF <= full; d0 += DC * kVecF)
    for (int h0 = 0; h0 < ncols; h0 += 4) pv_block<DC>(p, ncols, h0, rows, nkeys, d0, o, os, alpha);
  for (; d0 < full; d0 += kVecF)
    for (int h0 = 0; h0 < ncols; h0 += 4) pv_block<1>(p, ncols, h0, rows, nkeys, d0, o, os, alpha);
  if (full < dv) {  // the last dv % 8 dims, never reading a row past dv
    for (int h = 0; h < ncols; ++h) {
      float* oh = o + h * os;
      for (int64_t d = full; d < dv; ++d) oh[d] *= alpha[h];
      for (int k = 0; k < nkeys; ++k) {
        const float pk = p[static_cast<int64_t>(k) * ncols + h];
        for (int64_t d = full; d < dv; ++d) oh[d] += pk * rows[k][d];
      }
    }
  }
}

}  // namespace
