// A CPU stand-in for the CUDA runtime and device built-ins the CUDA-dialect kernels
// (backends/_cuda_dialect/src) use, so tests run the very kernel code on the host.
//
// Execution model: blocks run one after another; within a block every GPU thread is an OS
// thread (the same threads serve every block of a launch), __syncthreads is a barrier over them, __shared__ variables are function statics
// (one copy, shared by the block's threads; blocks never overlap), dynamic shared memory is
// one buffer per launch. Atomics are real atomics. A kernel that lets some threads of a block
// skip a barrier the others wait at deadlocks here -- as it would hang (or worse) on a GPU.
// Not modelled: warp-level behaviour (the kernels use none), memory coalescing, timing.
//
// The triple-chevron launches and `extern __shared__` declarations are rewritten by
// build.py before compiling (the preprocessor cannot express them).
#pragma once

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static

typedef int cudaError_t;
typedef void* cudaStream_t;
#define cudaSuccess 0

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace glm5_hal_sim {

inline thread_local dim3 thread_index;
inline thread_local dim3 block_index;
inline dim3 block_dim;
inline dim3 grid_dim;
inline pthread_barrier_t block_barrier;
inline std::vector<unsigned char> dynamic_shared_memory;

template <class T>
T* dynamic_shared() {
  return reinterpret_cast<T*>(dynamic_shared_memory.data());
}

// Runs `body` (the kernel call) for every thread of every block of the grid. One OS thread
// per GPU thread of a block, reused for the blocks in turn; a second barrier ends each block,
// so a thread that returned early waits there and never stands in for a __syncthreads.
template <class Body>
void launch(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t, Body&& body) {
  grid_dim = grid;
  block_dim = block;
  dynamic_shared_memory.assign(shared_bytes + 64, 0xCD);  // garbage, as on a GPU
  const unsigned threads = block.x * block.y * block.z;
  pthread_barrier_t block_end;
  pthread_barrier_init(&block_barrier, nullptr, threads);
  pthread_barrier_init(&block_end, nullptr, threads);
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (unsigned t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      thread_index = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
      for (unsigned bz = 0; bz < grid.z; ++bz) {
        for (unsigned by = 0; by < grid.y; ++by) {
          for (unsigned bx = 0; bx < grid.x; ++bx) {
            block_index = dim3(bx, by, bz);
            body();
            pthread_barrier_wait(&block_end);
          }
        }
      }
    });
  }
  for (std::thread& thread : pool) thread.join();
  pthread_barrier_destroy(&block_end);
  pthread_barrier_destroy(&block_barrier);
}

}  // namespace glm5_hal_sim

#define threadIdx glm5_hal_sim::thread_index
#define blockIdx glm5_hal_sim::block_index
#define blockDim glm5_hal_sim::block_dim
#define gridDim glm5_hal_sim::grid_dim

inline cudaError_t cudaGetLastError() { return cudaSuccess; }

inline void __syncthreads() { pthread_barrier_wait(&glm5_hal_sim::block_barrier); }

inline int atomicAdd(int* address, int value) { return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST); }

inline float atomicAdd(float* address, float value) {
  uint32_t* bits = reinterpret_cast<uint32_t*>(address);
  uint32_t expected = __atomic_load_n(bits, __ATOMIC_SEQ_CST);
  for (;;) {
    float current;
    memcpy(&current, &expected, sizeof current);
    const float updated = current + value;
    uint32_t desired;
    memcpy(&desired, &updated, sizeof desired);
    if (__atomic_compare_exchange_n(bits, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
      return current;
    }
  }
}

inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

inline float __uint_as_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
