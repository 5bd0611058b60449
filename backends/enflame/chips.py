"""Enflame GCU generations, the vendor package versions the adapters were read from, and the
facts they depend on.

Every fact names its public source: EnflameTechnology/vllm-gcu @7b5aaca9 (the vendor's vLLM
plugin: vllm_gcu/gcu.py, csrc/torch_bindings.cpp, csrc/src/*.cpp, docs/source/installation.md)
and flagos-ai/FlagGems @ed2508bc (src/flag_gems/runtime/backend/_enflame/__init__.py: the
gcu300 / gcu400 architecture names from triton_gcu's driver).
"""
from __future__ import annotations

import dataclasses

from glm5_hal.vendor_backend import Behaviour, Era
from glm5_hal.vendor_backend import device_dtypes as shared_device_dtypes

#: vllm-gcu's installation guide: "torch-gcu | Compatible with PyTorch 2.7"
#: (docs/source/installation.md:15 @7b5aaca9); the adapters use the torch 2.7 op API.
MIN_TORCH_GCU = (2, 7)
#: the distribution (and package) of vllm-gcu's compiled ops: setup.py:327, 361 @7b5aaca9
#: (ext module "vllm_gcu._C", package name "vllm_gcu")
VLLM_GCU = "vllm_gcu"


@dataclasses.dataclass(frozen=True)
class Generation:
    arch: str           # FlagGems' name (triton_gcu's driver.get_arch())
    major: int          # torch.gcu.get_device_capability()[0]
    products: str
    fp8: bool

    @property
    def label(self) -> str:
        return f"{self.arch} ({self.products})"


#: torch.gcu's capability major -> generation. vllm-gcu reports capability major + 10
#: (vllm_gcu/gcu.py:108-109), turns an fp8 KV cache into int8 at 13.0 (gcu.py:259-261) and
#: supports FP8 from 14.0 (gcu.py:392-397); FlagGems' _enflame maps arch 3 -> "gcu300",
#: 4 -> "gcu400" (ARCH_MAP, __init__.py:48). S60 is the gcu300 product vllm-gcu's install
#: guide names (installation.md:3); no public source names a gcu400 product.
GENERATIONS = (
    Generation("gcu300", 3, "S60", fp8=False),
    Generation("gcu400", 4, "gcu400", fp8=True),
)


def generation_of(capability: tuple[int, ...]) -> Generation | None:
    major = tuple(capability)[0] if capability else None
    return next((g for g in GENERATIONS if g.major == major), None)


def supported() -> str:
    return ", ".join(f"{g.arch} (capability {g.major}.x)" for g in GENERATIONS)


def device_dtypes(gen: Generation) -> frozenset:
    # bf16: vllm-gcu's ops and FlagGems' _enflame kernels run bfloat16 models on both
    return shared_device_dtypes(bf16=True, fp8=gen.fp8)


#: vllm-gcu's version is vLLM's plus the TopsRider tag (setup.py:60-64 @7b5aaca9: "0.9.2+3.6...").
#: The op schemas the adapters call (csrc/torch_bindings.cpp @7b5aaca9) are vLLM's of the same
#: names; vllm-gcu carries patches for vLLM 0.8.0 to 0.9.2 (vllm_gcu/patch/patch_0_8_0 ...
#: patch_0_9_2), the range read here. A vllm-gcu outside it narrows the backend: its ops'
#: adapters decline rather than call a schema that may have changed.
VLLM_GCU_OPS = Behaviour("vllm_gcu_ops", VLLM_GCU, (
    Era((0, 8, 0), "vLLM's _C / _C_cache_ops schemas (rms_norm, silu_and_mul, rotary_embedding, "
                   "dynamic_scaled_int8_quant, concat_and_cache_mla, fused_grouped_topk as grouped_topk) and "
                   "linear_quant as w8a8_block_fp8_matmul",
        "EnflameTechnology/vllm-gcu csrc/torch_bindings.cpp @7b5aaca9 (vllm-gcu on vLLM 0.8.0-0.9.2: "
        "vllm_gcu/patch/patch_0_8_0 .. patch_0_9_2)"),
), verified_up_to=(0, 9, 2))

BEHAVIOURS = (VLLM_GCU_OPS,)
