"""The vendor surface the musa adapters and probe use, gathered in one object.

On MUSA, the vendor functions live on torch itself once torch_musa is imported (torch_musa
renames the PrivateUse1 device to "musa" and sets `torch.musa`; `torch.rms_norm` dispatches
to torch_musa's fused kernel for musa tensors; `torch.nn.functional.rope` is added by
torch_musa), plus MooreThreads' `mate` (FlashMLA and the MoE / FP8 GEMMs). `MusaRuntime`
bundles them; `tests/emulators/musa.py` implements the same surface on CPU tensors, and the
backend takes either by injection (`MusaBackend(runtime=...)`):

    torch.rms_norm(x, normalized_shape, weight, eps)          fused RMSNorm on musa
    torch.nn.functional.rope(input, freq_cis, rotary_interleaved, batch_first,
                             multi_latent_attention)          RoPE, SBHD, raw angles
    musa                                                      torch.musa: is_available,
        device_count, current_device, get_device_name, get_device_capability, current_stream
    __version__                                               torch_musa.__version__
    mudnn_version()                                           torch.backends.mudnn.version()
    package_version(name)                                     an installed distribution's version
    mate / mate_missing                                       the mate package (its `flashmla`
        and `gemm` submodules imported), or None and the reason
"""
from __future__ import annotations

import importlib
from typing import Any

from glm5_hal.vendor_backend import distribution_version
from glm5_hal.vendors import installed

from . import arch


def load_mate() -> tuple[Any, str]:
    """mate with the submodules the adapters call (mate.flashmla, mate.gemm), or (None, why
    not). Never raises: a broken extension is a reason, not a crash. mate exports
    flash_mla_sparse_fwd only from its `flashmla` submodule (mate/__init__.py's lazy attribute
    table lists flash_mla_with_kvcache and get_mla_metadata, not it: v0.2.0-v0.2.2)."""
    if not installed(arch.MATE):
        return None, "mate not installed (MooreThreads' MUSA kernels: FlashMLA, MoE and FP8 GEMMs)"
    try:
        module = importlib.import_module(arch.MATE)
        for submodule in ("flashmla", "gemm"):
            importlib.import_module(f"{arch.MATE}.{submodule}")
    except Exception as exc:  # a native extension without its MUSA libraries
        return None, f"importing mate failed: {type(exc).__name__}: {exc}"
    return module, ""


class MusaRuntime:
    """torch + torch_musa (+ mate, imported on first use) as the adapters see them."""

    EMULATOR = False

    def __init__(self, torch_module: Any, bridge: Any) -> None:
        self.torch = torch_module
        self.bridge = bridge
        self.musa = torch_module.musa
        self.__version__ = str(getattr(bridge, "__version__", ""))
        self._mate: tuple[Any, str] | None = None

    def mudnn_version(self) -> int | None:
        mudnn = getattr(getattr(self.torch, "backends", None), "mudnn", None)
        try:
            return int(mudnn.version())
        except Exception:  # an old bridge without torch.backends.mudnn
            return None

    @staticmethod
    def package_version(name: str) -> str | None:
        return distribution_version(name)

    @property
    def mate(self) -> Any:
        if self._mate is None:
            self._mate = load_mate()
        return self._mate[0]

    @property
    def mate_missing(self) -> str:
        self.mate  # noqa: B018  (loads it)
        return self._mate[1]
