"""The surface the cuda adapters and probe use, gathered in one object.

NVIDIA needs no bridge: the vendor functions are CUDA builds of torch itself plus two
optional libraries DeepSeek publishes. `CudaRuntime` bundles them; `tests/emulators/cuda.py`
implements the same surface on CPU tensors, and the backend takes either by injection
(`CudaBackend(runtime=...)`):

    torch          __version__, version.cuda / version.hip (cuda_flavor), cuda (is_available,
                   device_count, current_device, get_device_name, get_device_capability,
                   get_device_properties, current_stream(device).cuda_stream), rms_norm,
                   _grouped_mm(a, b, offs, bias, out_dtype), _scaled_mm(a, b, scale_a, scale_b,
                   bias, scale_result, out_dtype, use_fast_accum)
    flash_mla      FlashMLA (github.com/deepseek-ai/FlashMLA): flash_mla_sparse_fwd(q, kv, indices,
                   sm_scale, d_v, ...) -- or None, with flash_mla_missing the reason
    deep_gemm      DeepGEMM (github.com/deepseek-ai/DeepGEMM): fp8_gemm_nt(a, b, d),
                   m_grouped_fp8_gemm_nt_contiguous(a, b, d, layout),
                   get_mk_alignment_for_contiguous_layout() -- or None, with deep_gemm_missing
    package_versions()  {"flash_mla": ..., "flash_mla_interface": "1" | "2" | "3", "deep_gemm": ...}
                   for the installed ones, read without importing them (probing stays cheap and
                   never initialises their CUDA extensions)

FlashMLA and DeepGEMM are imported on first use by an adapter. `GLM5_HAL_CUDA_DISABLE=flash_mla,deep_gemm`
(either or both) keeps the backend off an installed library, e.g. to measure the kernels it
would otherwise replace (scripts/gpu_check.sh does).
"""
from __future__ import annotations

import ast
import importlib
import os
import importlib.util
from pathlib import Path
from typing import Any

from glm5_hal.vendor_backend import distribution_version
from glm5_hal.vendors import installed

from . import arch


DISABLE_VARIABLE = "GLM5_HAL_CUDA_DISABLE"
OPTIONAL_LIBRARIES = ("flash_mla", "deep_gemm")


def disabled() -> set[str]:
    """The optional libraries GLM5_HAL_CUDA_DISABLE turns off (an unknown name is an error)."""
    names = {n.strip() for n in os.environ.get(DISABLE_VARIABLE, "").split(",") if n.strip()}
    unknown = names - set(OPTIONAL_LIBRARIES)
    if unknown:
        from glm5_hal.errors import HalError
        raise HalError(f"{DISABLE_VARIABLE}: unknown library {sorted(unknown)}; known: {list(OPTIONAL_LIBRARIES)}")
    return names


def load_module(name: str, what: str, needs: tuple[str, ...]) -> tuple[Any, str]:
    """(module, "") or (None, why not): disabled, not installed, failed to import, or lacking a
    function."""
    if name in disabled():
        return None, f"{name} disabled ({DISABLE_VARIABLE}={os.environ[DISABLE_VARIABLE]})"
    if not installed(name):
        return None, f"{name} not installed ({what})"
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # a CUDA extension built for another torch or driver
        return None, f"importing {name} failed: {type(exc).__name__}: {exc}"
    missing = [fn for fn in needs if not callable(getattr(module, fn, None))]
    if missing:
        return None, f"{name} has no {', '.join(missing)}"
    return module, ""




def interface_level(parameters: list[str]) -> str:
    """FlashMLA's interface generation (arch.FLASH_MLA_INTERFACES) from the parameter names of
    flash_mla_sparse_fwd: "1", "2", or "3" for one with parameters neither has."""
    known = arch.FLASH_MLA_INTERFACES
    if tuple(parameters) == known[0]:
        return "1"
    if tuple(parameters[: len(known[1])]) == known[1] and len(parameters) == len(known[1]):
        return "2"
    return str(len(known) + 1)


def flash_mla_interface_parameters() -> list[str] | None:
    """flash_mla_sparse_fwd's parameter names, parsed from the installed
    flash_mla/flash_mla_interface.py (None: no such function there)."""
    try:
        spec = importlib.util.find_spec("flash_mla")
    except (ImportError, ValueError):
        return None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        source = Path(folder) / "flash_mla_interface.py"
        if not source.is_file():
            continue
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "flash_mla_sparse_fwd":
                args = node.args
                return [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    return None


class CudaRuntime:
    """A CUDA build of torch (+ FlashMLA and DeepGEMM, imported on first use)."""

    EMULATOR = False

    def __init__(self, torch_module: Any) -> None:
        self.torch = torch_module
        self.__version__ = str(getattr(torch_module, "__version__", ""))
        self._flash_mla: tuple[Any, str] | None = None
        self._deep_gemm: tuple[Any, str] | None = None
        self._versions: dict[str, str] | None = None

    def package_versions(self) -> dict[str, str]:
        if self._versions is None:
            versions, off = {}, disabled()
            if installed("flash_mla") and "flash_mla" not in off:
                versions["flash_mla"] = distribution_version("flash_mla", "flash-mla") or "unknown"
                parameters = flash_mla_interface_parameters()
                if parameters is not None:
                    versions[arch.FLASH_MLA_PACKAGE] = interface_level(parameters)
            if installed("deep_gemm") and "deep_gemm" not in off:
                versions["deep_gemm"] = distribution_version("deep_gemm", "deep-gemm") or "unknown"
            self._versions = versions
        return self._versions

    @property
    def flash_mla(self) -> Any:
        if self._flash_mla is None:
            self._flash_mla = load_module("flash_mla", "FlashMLA, built from github.com/deepseek-ai/FlashMLA",
                                          ("flash_mla_sparse_fwd",))
        return self._flash_mla[0]

    @property
    def flash_mla_missing(self) -> str:
        self.flash_mla  # noqa: B018  (loads it)
        return self._flash_mla[1]

    @property
    def deep_gemm(self) -> Any:
        if self._deep_gemm is None:
            self._deep_gemm = load_module("deep_gemm", "DeepGEMM, github.com/deepseek-ai/DeepGEMM",
                                          ("fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous",
                                           "get_mk_alignment_for_contiguous_layout"))
        return self._deep_gemm[0]

    @property
    def deep_gemm_missing(self) -> str:
        self.deep_gemm  # noqa: B018
        return self._deep_gemm[1]
