"""The machine's limits, measured in the same run as the ops they bound: memory copy
bandwidth and GEMM throughput (both through torch, so they are what a user can get) -- fp32
on the CPU, bf16 on an accelerator -- plus, where a backend states them, the device's
datasheet peaks (`capabilities().limits`: peak_bf16_tflops, peak_hbm_tbps, peak_source)."""
from __future__ import annotations

import dataclasses

import torch

from .timing import median_time


@dataclasses.dataclass(frozen=True)
class Roofline:
    copy_gbps: float     # bytes read + written per second / 1e9
    gemm_gflops: float   # matmul flops per second / 1e9 (gemm_dtype)
    threads: int
    device: str = "cpu"
    gemm_dtype: str = "float32"
    peak_gflops: float | None = None   # the datasheet's dense bf16 peak, where known
    peak_gbps: float | None = None     # the datasheet's memory bandwidth, where known
    peak_source: str = ""

    def percent(self, seconds: float, flops: float, nbytes: float) -> tuple[float, str]:
        """Percentage of the binding limit reached, and which limit binds (flops or bytes)."""
        t_flops = flops / (self.gemm_gflops * 1e9) if flops else 0.0
        t_bytes = nbytes / (self.copy_gbps * 1e9) if nbytes else 0.0
        if t_flops >= t_bytes:
            return 100.0 * t_flops / seconds, "flops"
        return 100.0 * t_bytes / seconds, "bytes"

    def peak_percents(self, seconds: float, flops: float, nbytes: float) -> tuple[float | None, float | None]:
        """(% of the datasheet's compute peak, % of its memory bandwidth) reached; None where
        the peak is unknown or the case states no such work."""
        compute = 100.0 * flops / (self.peak_gflops * 1e9) / seconds if self.peak_gflops and flops else None
        memory = 100.0 * nbytes / (self.peak_gbps * 1e9) / seconds if self.peak_gbps and nbytes else None
        return compute, memory


def synchronizer(device: torch.device):
    """What waits for `device`'s queued work (None on the CPU)."""
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type)
    return lambda: module.synchronize(device)


def measure(copy_mib: int = 256, gemm_n: int = 2048, repeats: int = 5, device: str = "cpu",
            peaks: dict | None = None) -> Roofline:
    """On an accelerator: a 1 GiB copy and a bf16 8192^3 GEMM (after warm-up); `peaks` are a
    backend's capabilities().limits carrying the datasheet's."""
    dev = torch.device(device)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    if dev.type != "cpu":
        copy_mib, gemm_n = max(copy_mib, 1024), max(gemm_n, 8192)
    sync = synchronizer(dev)
    src = torch.ones(copy_mib * 2**20 // 4, device=dev)
    dst = torch.empty_like(src)
    copy_s = median_time(lambda: dst.copy_(src), repeats=repeats, min_time=0.5, sync=sync)
    a, b = torch.randn(gemm_n, gemm_n, device=dev, dtype=dtype), torch.randn(gemm_n, gemm_n, device=dev, dtype=dtype)
    gemm_s = median_time(lambda: torch.mm(a, b), repeats=repeats, min_time=0.5, sync=sync)
    peaks = peaks or {}
    tflops, tbps = peaks.get("peak_bf16_tflops"), peaks.get("peak_hbm_tbps")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    return Roofline(copy_gbps=2 * src.nbytes / copy_s / 1e9,
                    gemm_gflops=2 * gemm_n**3 / gemm_s / 1e9,
                    threads=torch.get_num_threads(), device=name, gemm_dtype=str(dtype).removeprefix("torch."),
                    peak_gflops=float(tflops) * 1e3 if tflops else None, peak_gbps=float(tbps) * 1e3 if tbps else None,
                    peak_source=str(peaks.get("peak_source", "")))
