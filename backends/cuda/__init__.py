"""The NVIDIA `cuda` backend: glm5_hal ops on a CUDA build of torch, through torch's own CUDA
ops where they are the best available (fused rms_norm, _grouped_mm, blockwise _scaled_mm),
FlashMLA and DeepGEMM when installed, and the backend's own kernels (the shared CUDA-dialect
sources built with nvcc). It is also the device the CUDA conformance reference runs on
(`glm5-hal conformance --ref cuda`).

`CudaBackend(runtime=None)` wraps the running torch; tests inject an emulator instead
(`CudaBackend(runtime=CudaEmulator("H200"), name="cuda_emu", device_type="cpu")`). Every
instance binds the adapter table (ops.ADAPTERS) to itself, so a real and an emulated backend
coexist. Registered through the `glm5_hal.backends` entry point.

Probe order (glm5_hal.vendor_backend's skeleton over the hooks below; the first failing step
is the reason; nothing raises):
1. which stack torch's `cuda` device is (glm5_hal.vendors.cuda_flavor): a CPU build, AMD ROCm,
   Hygon DCU, Kunlunxin or Iluvatar are each named   -> "torch X is a CPU build (...)", ...
2. torch >= arch.MIN_TORCH                            -> "torch X is too old: ..."
3. an NVIDIA GPU is visible                           -> "no CUDA device visible (...)"
4. its compute capability is sm_80 or newer           -> "unsupported GPU ...: sm_75 ..."
5. the behaviours of FlashMLA, DeepGEMM and torch's ops (arch.BEHAVIOURS) are chosen from the
   installed versions; an unverified version narrows the adapters that depend on it.
README.md has the op mapping and what has been verified how.
"""
from __future__ import annotations

from typing import Any

from glm5_hal import hookimpl
from glm5_hal.vendor_backend import ChipInfo, Declined, VendorBackend, dotted, module_version, require_version
from glm5_hal.vendors import cuda_flavor

from . import arch, kernels, ops
from .runtime import CudaRuntime

_OTHER_STACKS = {
    "rocm": "an AMD ROCm build (torch.version.hip = {hip}): its `cuda` device is not NVIDIA's",
    "dcu": "Hygon's DCU build (torch.__hcu_version__ is set): the dcu backend serves it",
    "kunlun": "a Kunlunxin stack (torch_xmlir is installed): the kunlun backend serves its `cuda` device",
    "iluvatar": "an Iluvatar CoreX build (torch '+corex'): its `cuda` device is not NVIDIA's",
    "enflame": "an Enflame GCU stack (torch.gcu is set; torch_gcu's transfer_to_gcu makes torch.cuda answer for GCUs)",
}


class CudaBackend(VendorBackend):
    vendor_name = "cuda"
    adapters = ops.ADAPTERS
    op_limits = ops.OP_LIMITS
    kernels_limit = "cuda_kernels"
    device_noun = "CUDA device"
    device_count_call = "torch.cuda.device_count()"

    def default_kernels(self) -> Any:
        return kernels.cuda_kernels()

    @property
    def behaviours(self) -> tuple:
        """The versioned behaviours of torch and of the optional libraries that are installed
        (a library that is absent narrows nothing: its adapters decline with "not installed")."""
        present = self._runtime.package_versions() if self._runtime is not None else {}
        return tuple(b for b in arch.BEHAVIOURS if b.package == "torch" or b.package in present)

    # -- probe hooks -----------------------------------------------------------------------
    def make_runtime(self, bridge: Any) -> tuple[Any, str]:
        import torch
        return CudaRuntime(torch), ""

    def check_versions(self, runtime: Any) -> dict[str, str]:
        torch_module = runtime.torch
        version_info = getattr(torch_module, "version", None)
        flavor = cuda_flavor(torch_module)
        if flavor == "none":
            raise Declined(f"torch {module_version(torch_module)} is a CPU build (torch.version.cuda is None): "
                           "install a CUDA build of torch to use NVIDIA GPUs")
        if flavor != "cuda":
            raise Declined("this torch is " + _OTHER_STACKS.get(flavor, flavor).format(
                hip=getattr(version_info, "hip", None)))
        version = require_version("torch", module_version(torch_module), arch.MIN_TORCH,
                                  f"glm5_hal needs torch >= {dotted(arch.MIN_TORCH)}")
        return {"torch": version, "cuda": str(getattr(version_info, "cuda", "")), **runtime.package_versions()}

    def devices(self, runtime: Any) -> Any:
        return runtime.torch.cuda

    def identify_chip(self, runtime: Any, count: int, versions: dict[str, str]) -> ChipInfo:
        cuda = runtime.torch.cuda
        device = cuda.current_device()
        major, minor = (int(v) for v in cuda.get_device_capability(device))
        name = str(cuda.get_device_name(device))
        gen = arch.generation_of((major, minor))
        if (major, minor) < arch.MIN_CAPABILITY or gen is None:
            floor = "sm_{}{}".format(*arch.MIN_CAPABILITY)
            raise Declined(f"unsupported GPU {name}: sm_{major}{minor}; the cuda backend's kernels need {floor} "
                           f"or newer (bf16), and nvcc 13 builds nothing below sm_75")
        props = cuda.get_device_properties(device)
        facts = {"sm": f"sm_{major}{minor}", "kernel_code": gen.kernel_code(minor),
                 "multiprocessors": int(getattr(props, "multi_processor_count", 0)),
                 "memory_gib": round(int(getattr(props, "total_memory", 0)) / 2**30, 1)}
        peak = arch.peak_of(name)
        if peak is not None:  # for roofline percentages (glm5-hal bench)
            facts.update(peak_bf16_tflops=peak.bf16_tflops, peak_fp8_tflops=peak.fp8_tflops,
                         peak_hbm_tbps=peak.hbm_tbps, peak_source=peak.source)
        summary = f"{count} x {name} (sm_{major}{minor}, {gen.name}), torch {versions['torch']} (CUDA {versions['cuda']})"
        extras = [f"{k} {versions[k]}" for k in ("flash_mla", "deep_gemm") if k in versions]
        if extras:
            summary += ", " + ", ".join(extras)
        return ChipInfo(name, count, summary, generation=gen, identity=f"sm_{major}{minor}", versions=versions,
                        facts=facts)

    def chip_dtypes(self, chip: ChipInfo) -> frozenset:
        return arch.device_dtypes(chip.generation, self.capability[1])

    def chip_limits(self, chip: ChipInfo) -> dict:
        gen = chip.generation
        return {"generation": gen.name, "products": gen.products, "fp8": gen.fp8(self.capability[1]),
                "tma": gen.tma, "wgmma": gen.wgmma, "tcgen05": gen.tcgen05}

    # -- used by the adapters --------------------------------------------------------------
    @property
    def capability(self) -> tuple[int, int]:
        """(major, minor) of the device the probe found ((0, 0) before a successful probe)."""
        if self.chip is None:
            return (0, 0)
        major, minor = self.chip.identity.removeprefix("sm_")[:-1], self.chip.identity[-1]
        return int(major), int(minor)

    def stream(self, device: Any) -> int:
        """The raw cudaStream_t of torch's current stream on `device`, for the kernels."""
        return int(self.runtime.torch.cuda.current_stream(device).cuda_stream)


cuda = CudaBackend()


@hookimpl
def glm5_hal_register_backends(register):
    register(cuda)
