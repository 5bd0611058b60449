"""The vendor surface the iluvatar adapters and probe use, gathered in one object.

Iluvatar CoreX has no bridge module: its PyTorch is a vendor build of torch itself (device
type "cuda", wheels with a '+corex' suffix, the `torch.corex` attribute FlagGems keys on).
The fused ops come from Iluvatar's closed `ixformer` (ixformer.inference.functions) and from
FlagGems' Iluvatar kernels. `IluvatarRuntime` bundles them; `tests/emulators/iluvatar.py`
implements the same surface on CPU tensors:

    torch          __version__, version.cuda / hip, corex, cuda (is_available, device_count,
                   current_device, get_device_name, current_stream(device).cuda_stream)
    ixformer       ixformer.inference.functions: rms_norm(input, weight, eps) -> out,
                   dynamic_scaled_int8_quant(output, input, scale), w8a8(input, weight,
                   i_scales, w_scales, bias, output) -- or None, with ixformer_missing the reason
    top_k_per_row_prefill(logits, row_starts, row_ends, indices, num_rows, stride0, stride1,
                   top_k)   FlagGems' Iluvatar kernel -- or None, with flag_gems_missing the reason
    silu_and_mul(A, B)      FlagGems' fused silu_and_mul -- or None, with flag_gems_silu_missing the reason
    query_tool()   (whether `ixsmi` ran and exited 0, its output or why not): FlagGems'
                   fallback when torch carries no marker
    package_version(name)                                     an installed distribution's version
"""
from __future__ import annotations

import importlib
import re
import shutil
import subprocess
from typing import Any

from glm5_hal.vendor_backend import distribution_version
from glm5_hal.vendors import VENDORS, installed

from . import chips

#: ixformer's module the vendor's examples import (DeepSparkInference flux.1-dev/xdit/
#: w8a8_linear.py:4, LightX2V iluvatar_rms_norm.py:5)
IXFORMER_FUNCTIONS = "ixformer.inference.functions"
FLAG_GEMS_FUSED = "flag_gems.runtime.backend._iluvatar.fused"
FLAG_GEMS_GENERIC = "flag_gems.fused"


_MISSING_LIBRARY = re.compile(r"(lib[\w.+-]*\.so[\w.]*)")


def _load(module: str, package: str, what: str) -> tuple[Any, str]:
    if not installed(package):
        return None, f"{package} not installed ({what})"
    try:
        return importlib.import_module(module), ""
    except Exception as exc:  # a closed native package without its CoreX libraries
        library = _MISSING_LIBRARY.search(str(exc))
        if library and "cannot open shared object" in str(exc):
            # the vendor's run scripts put the SDK's libraries on the path themselves
            # (DeepSparkInference bevformer/igie/adapt/run_igie.sh: /opt/sw_home/local/corex/lib64)
            return None, (f"runtime library missing: {library.group(1)} ({package} is installed, but the CoreX "
                          "runtime is not on the library path; add the SDK's lib64, e.g. /usr/local/corex/lib64, "
                          "to LD_LIBRARY_PATH)")
        return None, f"importing {module} failed: {type(exc).__name__}: {exc}"


def run_query_tool(timeout: float = 10.0) -> tuple[bool, str]:
    """Runs `ixsmi` as FlagGems' device finder does (exit status 0 = an Iluvatar machine)."""
    tool = VENDORS["iluvatar"].smi
    path = shutil.which(tool)
    if path is None:
        return False, f"{tool} not found on PATH"
    try:
        done = subprocess.run([path], capture_output=True, text=True, timeout=timeout)
    except Exception as exc:  # a hung or broken driver tool
        return False, f"{tool} failed: {type(exc).__name__}: {exc}"
    if done.returncode != 0:
        return False, f"{tool} exited {done.returncode}"
    return True, done.stdout.strip().splitlines()[0] if done.stdout.strip() else tool


class IluvatarRuntime:
    """torch (a CoreX build) + ixformer + FlagGems, as the adapters see them; the libraries
    are imported on first use, so probing never pays for them."""

    EMULATOR = False

    def __init__(self, torch_module: Any) -> None:
        self.torch = torch_module
        self.__version__ = str(getattr(torch_module, "__version__", ""))
        self._ixformer: tuple[Any, str] | None = None
        self._gems: tuple[Any, str] | None = None
        self._generic: tuple[Any, str] | None = None

    @staticmethod
    def package_version(name: str) -> str | None:
        return distribution_version(name, name.replace("_", "-"))

    @staticmethod
    def query_tool() -> tuple[bool, str]:
        return run_query_tool()

    @property
    def ixformer(self) -> Any:
        if self._ixformer is None:
            self._ixformer = _load(IXFORMER_FUNCTIONS, chips.IXFORMER, "Iluvatar's op library, from the CoreX SDK")
        return self._ixformer[0]

    @property
    def ixformer_missing(self) -> str:
        self.ixformer  # noqa: B018  (loads it)
        return self._ixformer[1]

    @property
    def top_k_per_row_prefill(self) -> Any:
        if self._gems is None:
            self._gems = _load(FLAG_GEMS_FUSED, chips.FLAG_GEMS, "FlagGems' Iluvatar kernels")
        return getattr(self._gems[0], "top_k_per_row_prefill", None)

    @property
    def silu_and_mul(self) -> Any:
        if self._generic is None:
            self._generic = _load(FLAG_GEMS_GENERIC, chips.FLAG_GEMS, "FlagGems' fused ops")
        return getattr(self._generic[0], "silu_and_mul", None)

    @property
    def flag_gems_missing(self) -> str:
        self.top_k_per_row_prefill  # noqa: B018
        return self._gems[1] or f"{FLAG_GEMS_FUSED} has no top_k_per_row_prefill"

    @property
    def flag_gems_silu_missing(self) -> str:
        self.silu_and_mul  # noqa: B018
        return self._generic[1] or f"{FLAG_GEMS_GENERIC} has no silu_and_mul"
