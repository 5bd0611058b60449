"""The machine's limits, measured in the same run as the ops they bound: memory copy
bandwidth and fp32 GEMM throughput (both through torch, so they are what a user can get)."""
from __future__ import annotations

import dataclasses

import torch

from .timing import median_time


@dataclasses.dataclass(frozen=True)
class Roofline:
    copy_gbps: float     # bytes read + written per second / 1e9
    gemm_gflops: float   # fp32 matmul flops per second / 1e9
    threads: int

    def percent(self, seconds: float, flops: float, nbytes: float) -> tuple[float, str]:
        """Percentage of the binding limit reached, and which limit binds (flops or bytes)."""
        t_flops = flops / (self.gemm_gflops * 1e9) if flops else 0.0
        t_bytes = nbytes / (self.copy_gbps * 1e9) if nbytes else 0.0
        if t_flops >= t_bytes:
            return 100.0 * t_flops / seconds, "flops"
        return 100.0 * t_bytes / seconds, "bytes"


def measure(copy_mib: int = 256, gemm_n: int = 2048, repeats: int = 5) -> Roofline:
    src = torch.ones(copy_mib * 2**20 // 4)
    dst = torch.empty_like(src)
    copy_s = median_time(lambda: dst.copy_(src), repeats=repeats, min_time=0.5)
    a, b = torch.randn(gemm_n, gemm_n), torch.randn(gemm_n, gemm_n)
    gemm_s = median_time(lambda: torch.mm(a, b), repeats=repeats, min_time=0.5)
    return Roofline(copy_gbps=2 * src.nbytes / copy_s / 1e9,
                    gemm_gflops=2 * gemm_n**3 / gemm_s / 1e9,
                    threads=torch.get_num_threads())
