#include "dsa_select.h"

namespace glm5::dsa {

namespace {

// The digit whose bucket holds the `need`-th largest key among `hist` (need >= 1), and how
// many keys lie in strictly higher buckets.
template <int BINS>
int boundary_bucket(const uint32_t* hist, int64_t need, int64_t* above) {
  int64_t cum = 0;
  for (int b = BINS - 1; b > 0; --b) {
    if (cum + hist[b] >= need) {
      *above = cum;
      return b;
    }
    cum += hist[b];
  }
  *above = cum;
  return 0;
}

}  // namespace

int64_t select_topk(const float* vals, int64_t n, int64_t k, int32_t* sel, SelectScratch& scratch) {
  if (k <= 0 || n <= 0) return 0;
  if (k >= n) {
    for (int64_t i = 0; i < n; ++i) sel[i] = static_cast<int32_t>(i);
    return n;
  }
  // pass 1: the top 11 bits of every key
  uint32_t hist[2048] = {};
  for (int64_t i = 0; i < n; ++i) ++hist[order_key(vals[i]) >> 21];
  int64_t above = 0;
  const uint32_t top = static_cast<uint32_t>(boundary_bucket<2048>(hist, k, &above));
  int64_t out = 0;
  std::vector<uint32_t>* ck = &scratch.keys[0];
  std::vector<int32_t>* ci = &scratch.index[0];
  ck->clear();
  ci->clear();
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t key = order_key(vals[i]);
    const uint32_t d = key >> 21;
    if (d > top) {
      sel[out++] = static_cast<int32_t>(i);
    } else if (d == top) {
      ck->push_back(key);
      ci->push_back(static_cast<int32_t>(i));
    }
  }
  int64_t need = k - out;
  // passes 2 and 3: bits 20..10, then 9..0, of the boundary bucket only
  const int shifts[2] = {10, 0};
  const uint32_t masks[2] = {0x7ffu, 0x3ffu};
  for (int pass = 0; pass < 2 && static_cast<int64_t>(ck->size()) > need; ++pass) {
    const int shift = shifts[pass];
    const uint32_t mask = masks[pass];
    for (uint32_t& h : hist) h = 0;
    for (uint32_t key : *ck) ++hist[(key >> shift) & mask];
    const uint32_t digit = static_cast<uint32_t>(pass == 0 ? boundary_bucket<2048>(hist, need, &above)
                                                           : boundary_bucket<1024>(hist, need, &above));
    std::vector<uint32_t>* nk = &scratch.keys[(pass + 1) & 1];
    std::vector<int32_t>* ni = &scratch.index[(pass + 1) & 1];
    nk->clear();
    ni->clear();
    for (size_t j = 0; j < ck->size(); ++j) {
      const uint32_t d = ((*ck)[j] >> shift) & mask;
      if (d > digit) {
        sel[out++] = (*ci)[j];
      } else if (d == digit) {
        nk->push_back((*ck)[j]);
        ni->push_back((*ci)[j]);
      }
    }
    need = k - out;
    ck = nk;
    ci = ni;
  }
  // what is left are equal keys (or exactly the number needed): take them in index order
  for (int64_t j = 0; j < need; ++j) sel[out++] = (*ci)[j];
  return out;
}

}  // namespace glm5::dsa
