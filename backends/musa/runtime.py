"""The vendor surface the musa adapters and probe use, gathered in one object.

On MUSA, the vendor functions live on torch itself once torch_musa is imported (torch_musa
renames the PrivateUse1 device to "musa" and sets `torch.musa`; `torch.rms_norm` and
`torch._grouped_mm` dispatch to MUSA kernels for musa tensors; `torch.nn.functional.rope`
is added by torch_musa), plus an optional MUSA build of FlashMLA. `MusaRuntime` bundles
them; `tests/emulators/musa.py` implements the same surface on CPU tensors, and the backend
takes either by injection (`MusaBackend(runtime=...)`):

    torch.rms_norm(x, normalized_shape, weight, eps)          fused RMSNorm on musa
    torch.nn.functional.rope(input, freq_cis, rotary_interleaved, batch_first,
                             multi_latent_attention)          RoPE, SBHD, raw angles
    torch._grouped_mm(a, b, offs, bias, out_dtype)            grouped GEMM
    musa                                                      torch.musa: is_available,
        device_count, current_device, get_device_name, get_device_capability, current_stream
    __version__                                               torch_musa.__version__
    mudnn_version()                                           torch.backends.mudnn.version()
    flash_mla / flash_mla_missing                             the FlashMLA module with
        flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v), or None and the reason
"""
from __future__ import annotations

import importlib
from typing import Any

from glm5_hal.vendors import installed

from . import arch


def load_flash_mla() -> tuple[Any, str]:
    """The first importable MUSA FlashMLA module offering flash_mla_sparse_fwd, or
    (None, why not). Never raises: a broken extension is a reason, not a crash."""
    reasons = []
    for name in arch.FLASH_MLA_MODULES:
        if not installed(name):
            reasons.append(f"{name} not installed")
            continue
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # native extension without its libraries
            reasons.append(f"importing {name} failed: {type(exc).__name__}: {exc}")
            continue
        if not callable(getattr(module, "flash_mla_sparse_fwd", None)):
            reasons.append(f"{name} has no flash_mla_sparse_fwd")
            continue
        return module, ""
    return None, "MUSA FlashMLA unavailable (" + "; ".join(reasons) + ")"


class MusaRuntime:
    """torch + torch_musa (+ FlashMLA, imported on first use) as the adapters see them."""

    EMULATOR = False

    def __init__(self, torch_module: Any, bridge: Any) -> None:
        self.torch = torch_module
        self.bridge = bridge
        self.musa = torch_module.musa
        self.__version__ = str(getattr(bridge, "__version__", ""))
        self._flash_mla: tuple[Any, str] | None = None

    def mudnn_version(self) -> int | None:
        mudnn = getattr(getattr(self.torch, "backends", None), "mudnn", None)
        try:
            return int(mudnn.version())
        except Exception:  # an old bridge without torch.backends.mudnn
            return None

    @property
    def flash_mla(self) -> Any:
        if self._flash_mla is None:
            self._flash_mla = load_flash_mla()
        return self._flash_mla[0]

    @property
    def flash_mla_missing(self) -> str:
        self.flash_mla  # noqa: B018  (loads it)
        return self._flash_mla[1]
