"""The vendor surface the enflame adapters and probe use, gathered in one object.

torch_gcu renames PrivateUse1 to "gcu" and sets `torch.gcu` (EnflameTechnology/vllm-gcu
vllm_gcu/gcu.py @7b5aaca9 calls torch.gcu.get_device_capability / get_device_name /
set_device after `import torch_gcu`). The fused ops come from vllm-gcu's extension
`vllm_gcu._C`, which registers PrivateUse1 kernels under vLLM's op namespaces
(csrc/torch_bindings.cpp: TORCH_LIBRARY_FRAGMENT(_C, ...), (_C_cache_ops, ...); the Python
side calls torch.ops._C.rms_norm etc., vllm_gcu/kernels/_custom_ops.py). `GcuRuntime` bundles
them; `tests/emulators/enflame.py` implements the same surface on CPU tensors:

    gcu            torch.gcu: is_available, device_count, current_device, get_device_name,
                   get_device_capability
    __version__    torch_gcu.__version__
    ops            a namespace with `_C` and `_C_cache_ops` (torch.ops's, once vllm_gcu._C is
                   imported) -- or None, with ops_missing the reason
    package_version(name)                                     an installed distribution's version
"""
from __future__ import annotations

import importlib
import types
from typing import Any

from glm5_hal.vendor_backend import distribution_version
from glm5_hal.vendors import installed

from . import chips


def load_ops(torch_module: Any) -> tuple[Any, str]:
    """torch.ops._C / _C_cache_ops with vllm-gcu's kernels registered, or (None, why not)."""
    if not installed(chips.VLLM_GCU):
        return None, "vllm_gcu not installed (vllm-gcu's ops: EnflameTechnology/vllm-gcu)"
    try:
        importlib.import_module(f"{chips.VLLM_GCU}._C")
    except Exception as exc:  # a native extension without its TopsRider libraries
        return None, f"importing vllm_gcu._C failed: {type(exc).__name__}: {exc}"
    ops = torch_module.ops
    return types.SimpleNamespace(_C=ops._C, _C_cache_ops=ops._C_cache_ops), ""


class GcuRuntime:
    """torch + torch_gcu (+ vllm-gcu's ops, imported on first use) as the adapters see them."""

    EMULATOR = False

    def __init__(self, torch_module: Any, bridge: Any) -> None:
        self.torch = torch_module
        self.gcu = torch_module.gcu
        self.__version__ = str(getattr(bridge, "__version__", ""))
        self._ops: tuple[Any, str] | None = None

    @staticmethod
    def package_version(name: str) -> str | None:
        return distribution_version(name, name.replace("_", "-"))

    @property
    def ops(self) -> Any:
        if self._ops is None:
            self._ops = load_ops(self.torch)
        return self._ops[0]

    @property
    def ops_missing(self) -> str:
        self.ops  # noqa: B018  (loads them)
        return self._ops[1]
