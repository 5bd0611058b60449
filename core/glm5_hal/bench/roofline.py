"""The machine's limits, measured in the same run as the ops they bound.

Small native loops (glm5_hal._C.roofline_*, csrc/roofline.cpp) measure what this CPU does with
the instructions the kernels use -- float32 FMA, AVX-512 BF16 dot products (vdpbf16ps), int8
dot products (vpdpbusd: AVX-512 VNNI or AVX-VNNI), AMX tiles (bf16 and int8) -- and STREAM-triad
bandwidth over arrays larger than the last-level cache, all with torch's thread count. A row is
judged against the limit that binds it: its flops at the machine's best rate for its
arithmetic (`compute`: "fp32", "bf16" or "int8"), or its bytes at triad bandwidth, whichever
takes longer. Torch's float32 and bfloat16 GEMMs and `copy_` are measured too: the peer column
(what a user gets from torch here), not a limit.

On an accelerator (`device`) there are no native loops: the limits are torch's own GEMMs and
`copy_` on that device (after warm-up, each timed batch synchronised), and where a backend
states them, the device's datasheet peaks (`capabilities().limits`: peak_bf16_tflops,
peak_hbm_tbps, peak_source) give a second percentage.
"""
from __future__ import annotations

import dataclasses
import glob

import torch

from .timing import median_time

COMPUTE_KINDS = ("fp32", "bf16", "int8")


@dataclasses.dataclass(frozen=True)
class Roofline:
    threads: int
    # the machine's limits (native loops), GFLOP/s or GOP/s and GB/s; 0: not on this CPU
    fp32_fma_gflops: float
    bf16_dot_gflops: float      # AVX-512 BF16 vdpbf16ps
    int8_dot_gops: float        # vpdpbusd
    amx_bf16_gflops: float
    amx_int8_gops: float
    triad_gbps: float
    # torch's peers, same run
    torch_fp32_gemm_gflops: float
    torch_bf16_gemm_gflops: float
    torch_copy_gbps: float
    device: str = "cpu"
    peak_gflops: float | None = None   # the datasheet's dense bf16 peak, where known
    peak_gbps: float | None = None     # the datasheet's memory bandwidth, where known
    peak_source: str = ""

    def compute_limit(self, compute: str) -> tuple[float, str]:
        """(rate in G/s, what sets it) of the fastest instructions for `compute` products:
        bf16 and FP8 (converted exactly to bf16) products may run on AMX, AVX-512 BF16 or
        float32 FMA (exact for bf16 operands); int8 on AMX or VNNI."""
        if compute not in COMPUTE_KINDS:
            raise ValueError(f"compute must be one of {COMPUTE_KINDS}, got {compute!r}")
        if self.device != "cpu":   # torch's GEMMs on the device (no int8 rate measured there)
            if compute == "fp32":
                return self.fp32_fma_gflops, "fp32 GEMM"
            return max(self.bf16_dot_gflops, self.fp32_fma_gflops), "bf16 GEMM"
        options = [(self.fp32_fma_gflops, "fp32 FMA")]
        if compute == "bf16":
            options += [(self.bf16_dot_gflops, "AVX-512 BF16"), (self.amx_bf16_gflops, "AMX bf16")]
        elif compute == "int8":
            options += [(self.int8_dot_gops, "VNNI int8"), (self.amx_int8_gops, "AMX int8")]
        return max(options)

    def percent(self, seconds: float, flops: float, nbytes: float, compute: str = "fp32") -> tuple[float, str]:
        """Percentage of the binding limit reached, and which limit binds (flops or bytes)."""
        rate, _ = self.compute_limit(compute)
        t_flops = flops / (rate * 1e9) if flops else 0.0
        t_bytes = nbytes / (self.triad_gbps * 1e9) if nbytes else 0.0
        if t_flops >= t_bytes:
            return 100.0 * t_flops / seconds, "flops"
        return 100.0 * t_bytes / seconds, "bytes"

    def torch_percent(self, seconds: float, flops: float, nbytes: float, compute: str = "fp32") -> float:
        """The same against torch's peers: its GEMM (bfloat16 for bf16 and int8 products,
        float32 otherwise) for flops, its copy_ for bytes, whichever takes longer."""
        gemm = self.torch_fp32_gemm_gflops if compute == "fp32" else self.torch_bf16_gemm_gflops
        t = max(flops / (gemm * 1e9) if flops else 0.0, nbytes / (self.torch_copy_gbps * 1e9) if nbytes else 0.0)
        return 100.0 * t / seconds

    def peak_percents(self, seconds: float, flops: float, nbytes: float) -> tuple[float | None, float | None]:
        """(% of the datasheet's compute peak, % of its memory bandwidth) reached; None where
        the peak is unknown or the case states no such work."""
        compute = 100.0 * flops / (self.peak_gflops * 1e9) / seconds if self.peak_gflops and flops else None
        memory = 100.0 * nbytes / (self.peak_gbps * 1e9) / seconds if self.peak_gbps and nbytes else None
        return compute, memory

    def describe(self) -> str:
        def rate(v: float, unit: str) -> str:
            return f"{v:.1f} {unit}" if v else "n/a"
        if self.device != "cpu":
            return (f"roofline ({self.device}: torch's GEMMs and copy_ on the device): fp32 GEMM "
                    f"{self.fp32_fma_gflops:.1f} GFLOP/s, bf16 GEMM {self.bf16_dot_gflops:.1f} GFLOP/s, "
                    f"copy_ {self.triad_gbps:.1f} GB/s")
        return (f"roofline ({self.threads} threads, native loops): fp32 FMA {rate(self.fp32_fma_gflops, 'GFLOP/s')}, "
                f"AVX-512 BF16 {rate(self.bf16_dot_gflops, 'GFLOP/s')}, AMX bf16 {rate(self.amx_bf16_gflops, 'GFLOP/s')}, "
                f"VNNI int8 {rate(self.int8_dot_gops, 'GOP/s')}, AMX int8 {rate(self.amx_int8_gops, 'GOP/s')}, "
                f"triad {rate(self.triad_gbps, 'GB/s')}\n"
                f"torch peers: fp32 GEMM {self.torch_fp32_gemm_gflops:.1f} GFLOP/s, bf16 GEMM "
                f"{self.torch_bf16_gemm_gflops:.1f} GFLOP/s, copy_ {self.torch_copy_gbps:.1f} GB/s")


def last_level_cache_bytes(default: int = 64 * 2**20) -> int:
    """The largest CPU cache Linux reports (sysfs), or `default`."""
    best = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip().upper()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best or default


def synchronizer(device: torch.device):
    """What waits for `device`'s queued work (None on the CPU)."""
    if device.type == "cpu":
        return None
    module = getattr(torch, device.type)
    return lambda: module.synchronize(device)


def measure(seconds: float = 0.3, gemm_n: int = 2048, copy_mib: int = 256, repeats: int = 5,
            triad_mib: int | None = None, device: str = "cpu", peaks: dict | None = None) -> Roofline:
    """Measures every limit with torch's thread count. triad_mib: the size of each of the three
    triad arrays (default: the last-level cache, at least 64 MiB and at most 512 MiB). On an
    accelerator: a 1 GiB copy and 8192^3 GEMMs; `peaks` are a backend's capabilities().limits
    carrying the datasheet's."""
    dev = torch.device(device)
    if dev.type != "cpu":
        return _measure_device(dev, max(copy_mib, 1024), max(gemm_n, 8192), repeats, peaks or {})
    threads = torch.get_num_threads()
    src = torch.ones(copy_mib * 2**20 // 4)
    dst = torch.empty_like(src)
    copy_s = median_time(lambda: dst.copy_(src), repeats=repeats, min_time=0.5)
    del src, dst
    gemm = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(gemm_n, gemm_n).to(dtype), torch.randn(gemm_n, gemm_n).to(dtype)
        gemm[dtype] = 2 * gemm_n**3 / median_time(lambda: torch.mm(a, b), repeats=repeats, min_time=0.5) / 1e9
    try:
        from glm5_hal import _C
    except ImportError:   # no native loops: torch's own numbers stand in for the machine's
        _C = None
    torch_copy = 2 * copy_mib * 2**20 / copy_s / 1e9
    if _C is None:
        native = dict(fp32_fma_gflops=gemm[torch.float32], bf16_dot_gflops=0.0, int8_dot_gops=0.0,
                      amx_bf16_gflops=0.0, amx_int8_gops=0.0, triad_gbps=torch_copy)
    else:
        mib = triad_mib or min(512, max(64, last_level_cache_bytes() // 2**20))
        native = dict(fp32_fma_gflops=_C.roofline_fp32_fma_flops(threads, seconds) / 1e9,
                      bf16_dot_gflops=_C.roofline_bf16_dot_flops(threads, seconds) / 1e9,
                      int8_dot_gops=_C.roofline_int8_dot_ops(threads, seconds) / 1e9,
                      amx_bf16_gflops=_C.roofline_amx_bf16_flops(threads, seconds) / 1e9,
                      amx_int8_gops=_C.roofline_amx_int8_ops(threads, seconds) / 1e9,
                      triad_gbps=_C.roofline_triad_bytes(threads, mib * 2**20 // 8, repeats) / 1e9)
    return Roofline(threads=threads, **native, torch_fp32_gemm_gflops=gemm[torch.float32],
                    torch_bf16_gemm_gflops=gemm[torch.bfloat16], torch_copy_gbps=torch_copy)


def _measure_device(dev: torch.device, copy_mib: int, gemm_n: int, repeats: int, peaks: dict) -> Roofline:
    sync = synchronizer(dev)
    src = torch.ones(copy_mib * 2**20 // 4, device=dev)
    dst = torch.empty_like(src)
    copy_gbps = 2 * src.nbytes / median_time(lambda: dst.copy_(src), repeats=repeats, min_time=0.5, sync=sync) / 1e9
    del src, dst
    gemm = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(gemm_n, gemm_n, device=dev, dtype=dtype)
        b = torch.randn(gemm_n, gemm_n, device=dev, dtype=dtype)
        gemm[dtype] = 2 * gemm_n**3 / median_time(lambda: torch.mm(a, b), repeats=repeats, min_time=0.5,
                                                   sync=sync) / 1e9
    tflops, tbps = peaks.get("peak_bf16_tflops"), peaks.get("peak_hbm_tbps")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else dev.type
    # no native loops on a device: torch's GEMMs stand for the compute limits, copy_ for triad
    return Roofline(threads=torch.get_num_threads(), fp32_fma_gflops=gemm[torch.float32],
                    bf16_dot_gflops=gemm[torch.bfloat16], int8_dot_gops=0.0, amx_bf16_gflops=0.0, amx_int8_gops=0.0,
                    triad_gbps=copy_gbps, torch_fp32_gemm_gflops=gemm[torch.float32],
                    torch_bf16_gemm_gflops=gemm[torch.bfloat16], torch_copy_gbps=copy_gbps, device=name,
                    peak_gflops=float(tflops) * 1e3 if tflops else None,
                    peak_gbps=float(tbps) * 1e3 if tbps else None, peak_source=str(peaks.get("peak_source", "")))
