"""Hygon DCU generations, minimum versions, and the facts the adapters depend on.

Sources (README.md, "Sources"): vllm-plugin-das (HCUPlatform: device type "cuda", dist
backend "nccl", gcnArchName checks for gfx936/gfx938; lightop wrappers for RMSNorm and
SiLU-and-mul), FlagGems (torch.__hcu_version__ marks a Hygon torch build), GPUStack
(PCI vendor 0x1d94, product names K100_AI, Z100L, BW1000), field notes (gfx numbers per
product: the public sources disagree, so the table marks what is unconfirmed), and a field
report on lightop's top-k (it leaves the unused slots unwritten when a row has fewer keys
than top-k). Every fact is one constant here, so a wrong one is one edit.
"""
from __future__ import annotations

import dataclasses
import re

from glm5_hal.vendor_backend import device_dtypes as shared_device_dtypes

#: glm5_hal itself needs torch >= 2.6 (pyproject.toml); a DTK torch older than that is refused.
MIN_TORCH = (2, 6)
#: Where lightop keeps the functions the adapters call (tried in order; vllm-plugin-das moved
#: silu_and_mul_opt from lightop.op to lightop.activation).
LIGHTOP_RMS_NORM = (("op", "rmsnorm_forward_autograd"),)
LIGHTOP_SILU_AND_MUL = (("activation", "silu_and_mul_opt"), ("op", "silu_and_mul_opt"))
#: lightop's per-row top-k with vLLM's top_k_per_row_prefill signature (the field report's
#: kernel). Its module path is unconfirmed: both places are tried.
LIGHTOP_TOP_K = (("", "top_k_per_row_prefill"), ("op", "top_k_per_row_prefill"))


@dataclasses.dataclass(frozen=True)
class Generation:
    gfx: str
    products: str
    bf16: bool
    fp8: bool
    unconfirmed: str = ""

    @property
    def label(self) -> str:
        return f"{self.gfx} ({self.products})"


#: gfx -> product. gfx906 is also AMD's Vega 20 (MI50/MI60): it alone does not make a DCU.
GENERATIONS = (
    Generation("gfx906", "Z100/Z100L", bf16=False, fp8=False,
               unconfirmed="bf16: the Vega 20 ISA has no bf16 instructions; DTK may still emulate it"),
    Generation("gfx916", "K100 (one field note)", bf16=True, fp8=False, unconfirmed="gfx number per product"),
    Generation("gfx926", "K100", bf16=True, fp8=False, unconfirmed="gfx number per product"),
    Generation("gfx928", "K100_AI", bf16=True, fp8=False, unconfirmed="fp8 support"),
    Generation("gfx936", "BW1000", bf16=True, fp8=False, unconfirmed="fp8 support"),
    Generation("gfx938", "BW1100", bf16=True, fp8=False, unconfirmed="fp8 support"),
)

#: Hygon product names as torch.cuda.get_device_properties().name / hy-smi show them.
HYGON_NAME = re.compile(r"^(K100|Z100|BW\d*|DCU)", re.IGNORECASE)


def generation_of(gcn_arch_name: str) -> Generation | None:
    """gcnArchName looks like "gfx928" or "gfx928:sramecc+:xnack-"."""
    gfx = str(gcn_arch_name).split(":")[0].strip()
    for gen in GENERATIONS:
        if gen.gfx == gfx:
            return gen
    return None


def device_dtypes(gen: Generation | None) -> frozenset:
    # unknown generation: assume bf16 (it is the common case), no FP8
    return shared_device_dtypes(bf16=gen is None or gen.bf16, fp8=gen is not None and gen.fp8)





