// The machine's own limits, measured by small native loops (glm5-hal bench's roofline): peak
// rates of the arithmetic instructions the kernels use, each from independent register-only
// accumulations, and STREAM-triad memory bandwidth. Every function runs `threads` OpenMP
// threads for about `seconds` each and returns the summed rate (operations per second); 0 when
// the CPU (or, for AMX, the OS) does not offer the instructions.
#pragma once

#include <cstdint>

namespace glm5::roofline {

// float32 fused multiply-adds (2 flops each): AVX-512F, else AVX2 + FMA, else plain C++.
double fp32_fma_flops(int threads, double seconds);
// vdpbf16ps (AVX-512 BF16): 2 flops per bfloat16 product.
double bf16_dot_flops(int threads, double seconds);
// vpdpbusd (AVX-512 VNNI, else AVX-VNNI): 2 ops per int8 product.
double int8_dot_ops(int threads, double seconds);
// AMX tdpbf16ps / tdpbssd on tiles held in registers.
double amx_bf16_flops(int threads, double seconds);
double amx_int8_ops(int threads, double seconds);
// STREAM triad a[i] = b[i] + s * c[i] over float64 arrays of `elements` each (make them much
// larger than the last-level cache): bytes read and written (24 per element) per second, the
// best of `passes` passes after one untimed pass.
double triad_bytes(int threads, int64_t elements, int passes);

}  // namespace glm5::roofline
