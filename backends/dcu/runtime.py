"""The vendor surface the dcu adapters and probe use, gathered in one object.

A Hygon DCU has no bridge module: its PyTorch is a ROCm/DTK build of torch itself (device
type "cuda", HIP underneath, `torch.__hcu_version__` as the Hygon marker). The fused ops
come from Hygon's closed `lightop` package and, where vLLM is installed, from vLLM's `_C`
extension. `DcuRuntime` bundles them; `tests/emulators/dcu.py` implements the same surface
on CPU tensors, and the backend takes either by injection (`DcuBackend(runtime=...)`):

    torch          __version__, version.hip / version.cuda, __hcu_version__, cuda (is_available,
                   device_count, current_device, get_device_properties(i).name / .gcnArchName,
                   current_stream(device).cuda_stream), _grouped_mm(a, b, offs, bias, out_dtype)
    lightop        rmsnorm_forward_autograd(x, weight, eps, training), silu_and_mul_opt(out, x),
                   top_k_per_row_prefill(logits, row_starts, row_ends, indices, rows, s0, s1, k),
                   in the submodules arch.LIGHTOP_LAYOUT names for the installed version
                   -- or None, with lightop_missing the reason
    package_version(name)                                     an installed distribution's version
    vllm_ops       torch.ops._C with rotary_embedding(positions, query, key, head_size,
                   cos_sin_cache, is_neox) -- or None, with vllm_ops_missing the reason
"""
from __future__ import annotations

import importlib
import re
from typing import Any

from glm5_hal.vendor_backend import distribution_version
from glm5_hal.vendors import installed

_MISSING_LIBRARY = re.compile(r"(lib[\w.+-]*\.so[\w.]*)")


def load_lightop() -> tuple[Any, str]:
    if not installed("lightop"):
        return None, "lightop not installed (Hygon's fused-op package from DTK / the DAS image)"
    try:
        return importlib.import_module("lightop"), ""
    except Exception as exc:  # a closed native package without its DTK libraries
        library = _MISSING_LIBRARY.search(str(exc))
        if library and "cannot open shared object" in str(exc):
            return None, (f"runtime library missing: {library.group(1)} (lightop is installed, but the DTK "
                          f"runtime is not on the library path; source /opt/dtk/env.sh or set ROCM_PATH)")
        return None, f"importing lightop failed: {type(exc).__name__}: {exc}"


def load_vllm_ops(torch_module: Any) -> tuple[Any, str]:
    """vLLM's compiled `_C` ops (loaded by importing vllm._C), or the reason they are absent."""
    if not installed("vllm"):
        return None, "vLLM's _C ops unavailable (vllm not installed)"
    try:
        importlib.import_module("vllm._C")
    except Exception as exc:
        return None, f"vLLM's _C ops unavailable (importing vllm._C failed: {type(exc).__name__}: {exc})"
    ops = getattr(torch_module.ops, "_C", None)
    if ops is None or not hasattr(ops, "rotary_embedding"):
        return None, "vLLM's _C ops have no rotary_embedding"
    return ops, ""


def lightop_function(lightop: Any, places: tuple[tuple[str, str], ...]) -> Any:
    """The first of `places` ((submodule or "", name)) that lightop has, or None."""
    if lightop is None:
        return None
    for submodule, name in places:
        owner = getattr(lightop, submodule, None) if submodule else lightop
        if owner is None and submodule:
            try:
                owner = importlib.import_module(f"{lightop.__name__}.{submodule}")
            except Exception:
                owner = None
        fn = getattr(owner, name, None) if owner is not None else None
        if callable(fn):
            return fn
    return None


class DcuRuntime:
    """torch (a DTK build) + lightop + vLLM's _C, as the adapters see them. lightop and vLLM
    are imported on first use, so probing never pays for them."""

    EMULATOR = False

    def __init__(self, torch_module: Any) -> None:
        self.torch = torch_module
        self.__version__ = str(getattr(torch_module, "__version__", ""))
        self._lightop: tuple[Any, str] | None = None
        self._vllm: tuple[Any, str] | None = None

    @staticmethod
    def package_version(name: str) -> str | None:
        return distribution_version(name)

    @property
    def lightop(self) -> Any:
        if self._lightop is None:
            self._lightop = load_lightop()
        return self._lightop[0]

    @property
    def lightop_missing(self) -> str:
        self.lightop  # noqa: B018  (loads it)
        return self._lightop[1]

    @property
    def vllm_ops(self) -> Any:
        if self._vllm is None:
            self._vllm = load_vllm_ops(self.torch)
        return self._vllm[0]

    @property
    def vllm_ops_missing(self) -> str:
        self.vllm_ops  # noqa: B018
        return self._vllm[1]
