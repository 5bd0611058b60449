"""The native CPU backend: C++17 + OpenMP kernels from csrc/, bound as glm5_hal._C.

Registered through the `glm5_hal.backends` entry point like any third-party plugin.
"""
from __future__ import annotations

import platform

import torch

from glm5_hal import Availability, Backend, Capabilities, hookimpl


class CpuBackend(Backend):
    name = "cpu"
    device_type = "cpu"
    priority = 10

    def probe(self) -> Availability:
        try:
            from glm5_hal import _C  # noqa: F401
        except ImportError as exc:
            return Availability(False, f"native extension glm5_hal._C not importable: {exc}")
        return Availability(True, f"native kernels ({platform.machine()}, "
                                  f"OpenMP {'on' if _C.has_openmp else 'off'})")

    def capabilities(self) -> Capabilities:
        # float8_e4m3fn: the KV ops store FP8 caches byte for byte; the FP8 GEMMs convert exactly
        return Capabilities(dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn}),
                            dist_backend="gloo", device_name=platform.processor() or platform.machine())

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "python": platform.python_version()}


cpu = CpuBackend()

from . import buffers, common, dsa, kv, moe, quant, quant_gemm  # noqa: E402,F401  (declare the kernels on `cpu`)


@hookimpl
def glm5_hal_register_backends(register):
    register(cpu)


def release_cached_outputs() -> int:
    """Frees the memory the cpu backend keeps for reuse as large outputs (backends/cpu/buffers.py)
    and returns how many bytes were freed now; outputs still in use are freed with their tensors."""
    return buffers.outputs.release()


def cached_output_stats() -> dict:
    """What the cpu backend's output cache holds: capacity, held/idle/lent bytes, hits, misses."""
    return buffers.outputs.stats()
