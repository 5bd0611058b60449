// Ascend C kernel: row-wise Walsh-Hadamard transform (glm5_hal op hadamard_transform).
//
// torch_npu has no Hadamard op (vllm-ascend multiplies by a dense 128x128 matrix instead);
// the DSA indexer rotates every query and key row with H_128 / sqrt(128). The fast
// transform needs D log D additions instead of D^2 multiply-adds.
//
// NOT COMPILED HERE: written against the Ascend C API (kernel_operator.h, CANN 8.x) for the
// vector cores of Atlas A2/A3; built only when CMake finds CANN (ASCEND_HOME_PATH).
//
// Each core takes a contiguous range of rows. A row is copied to the unified buffer,
// widened to float32, transformed in place by log2(D) butterfly stages
// (a, b) -> (a + b, a - b) at strides h = 1, 2, 4, ..., D/2 (Sylvester order, like the
// reference), scaled, narrowed and copied out. Vector instructions need 32-byte aligned
// operands, i.e. multiples of 8 float32 elements: stages with h >= 8 are vector Add/Sub
// over whole half-blocks; the three stages inside each 8-element group use scalar
// accesses, with explicit vector<->scalar synchronisation around them.
#include "kernel_operator.h"

using namespace AscendC;

namespace {

constexpr int32_t kBufferNum = 2;
constexpr int64_t kAlignFloats = 8;  // 32 bytes of float32

template <typename T>
class HadamardRows {
 public:
  __aicore__ inline void Init(GM_ADDR x, GM_ADDR y, int64_t rows, int64_t dim, float scale) {
    dim_ = dim;
    scale_ = scale;
    const int64_t cores = GetBlockNum();
    const int64_t per_core = (rows + cores - 1) / cores;
    row_begin_ = GetBlockIdx() * per_core;
    row_end_ = row_begin_ + per_core < rows ? row_begin_ + per_core : rows;
    x_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(x), rows * dim);
    y_gm_.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(y), rows * dim);
    pipe_.InitBuffer(in_queue_, kBufferNum, dim * sizeof(T));
    pipe_.InitBuffer(out_queue_, kBufferNum, dim * sizeof(T));
    pipe_.InitBuffer(work_, 2 * dim * sizeof(float));
  }

  __aicore__ inline void Process() {
    for (int64_t row = row_begin_; row < row_end_; ++row) {
      CopyIn(row);
      Compute();
      CopyOut(row);
    }
  }

 private:
  __aicore__ inline void CopyIn(int64_t row) {
    LocalTensor<T> x = in_queue_.AllocTensor<T>();
    DataCopy(x, x_gm_[row * dim_], static_cast<uint32_t>(dim_));
    in_queue_.EnQue(x);
  }

  __aicore__ inline void Compute() {
    LocalTensor<T> x = in_queue_.DeQue<T>();
    LocalTensor<float> a = work_.Get<float>();
    LocalTensor<float> b = a[dim_];
    const uint32_t n = static_cast<uint32_t>(dim_);
    if constexpr (IsSameType<T, float>::value) {
      DataCopy(a, x, n);
    } else {
      Cast(a, x, RoundMode::CAST_NONE, n);
    }
    in_queue_.FreeTensor(x);

    // Stages inside each 32-byte group (h = 1, 2, 4): scalar butterflies.
    event_t v_to_s = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::V_S));
    SetFlag<HardEvent::V_S>(v_to_s);
    WaitFlag<HardEvent::V_S>(v_to_s);
    for (int64_t h = 1; h < kAlignFloats && h < dim_; h *= 2) {
      for (int64_t base = 0; base < dim_; base += 2 * h) {
        for (int64_t j = base; j < base + h; ++j) {
          const float u = a.GetValue(j);
          const float v = a.GetValue(j + h);
          a.SetValue(j, u + v);
          a.SetValue(j + h, u - v);
        }
      }
    }
    event_t s_to_v = static_cast<event_t>(GetTPipePtr()->FetchEventID(HardEvent::S_V));
    SetFlag<HardEvent::S_V>(s_to_v);
    WaitFlag<HardEvent::S_V>(s_to_v);

    // Stages across groups (h >= 8): every operand starts on a 32-byte boundary. Results
    // go to the other work row, so a stage never reads what it has just written.
    LocalTensor<float> src = a;
    LocalTensor<float> dst = b;
    for (int64_t h = kAlignFloats; h < dim_; h *= 2) {
      for (int64_t base = 0; base < dim_; base += 2 * h) {
        Add(dst[base], src[base], src[base + h], static_cast<uint32_t>(h));
        Sub(dst[base + h], src[base], src[base + h], static_cast<uint32_t>(h));
      }
      PipeBarrier<PIPE_V>();
      LocalTensor<float> t = src;
      src = dst;
      dst = t;
    }
    Muls(src, src, scale_, n);
    PipeBarrier<PIPE_V>();

    LocalTensor<T> y = out_queue_.AllocTensor<T>();
    if constexpr (IsSameType<T, float>::value) {
      DataCopy(y, src, n);
    } else {
      Cast(y, src, RoundMode::CAST_RINT, n);
    }
    out_queue_.EnQue(y);
  }

  __aicore__ inline void CopyOut(int64_t row) {
    LocalTensor<T> y = out_queue_.DeQue<T>();
    DataCopy(y_gm_[row * dim_], y, static_cast<uint32_t>(dim_));
    out_queue_.FreeTensor(y);
  }

  TPipe pipe_;
  TQue<QuePosition::VECIN, kBufferNum> in_queue_;
  TQue<QuePosition::VECOUT, kBufferNum> out_queue_;
  TBuf<TPosition::VECCALC> work_;
  GlobalTensor<T> x_gm_;
  GlobalTensor<T> y_gm_;
  int64_t dim_ = 0;
  int64_t row_begin_ = 0;
  int64_t row_end_ = 0;
  float scale_ = 1.0f;
};

}  // namespace

extern "C" __global__ __aicore__ void glm5_hal_hadamard_f32(GM_ADDR x, GM_ADDR y, int64_t rows,
                                                            int64_t dim, float scale) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
  HadamardRows<float> op;
  op.Init(x, y, rows, dim, scale);
  op.Process();
}

extern "C" __global__ __aicore__ void glm5_hal_hadamard_f16(GM_ADDR x, GM_ADDR y, int64_t rows,
                                                            int64_t dim, float scale) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
  HadamardRows<half> op;
  op.Init(x, y, rows, dim, scale);
  op.Process();
}

extern "C" __global__ __aicore__ void glm5_hal_hadamard_bf16(GM_ADDR x, GM_ADDR y, int64_t rows,
                                                             int64_t dim, float scale) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY);
  HadamardRows<bfloat16_t> op;
  op.Init(x, y, rows, dim, scale);
  op.Process();
}
