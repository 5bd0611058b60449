"""Moore Threads GPU generations, the torch_musa minimum, and the facts the adapters depend on.

Sources (see README.md, "Sources"): torch_musa's build script (device name -> MUSA_ARCH),
torchada's capability table (2.1 mp_21 MTT S80, 2.2 mp_22 MTT S4000, 3.1 mp_31 MTT S5000),
torch_musa's operator tests (bf16 skipped below arch 22, FP8 grouped GEMM only from arch 31,
rope tested only from arch 22), vllm-musa (FlashMLA sparse needs capability major 3; FP8
compiled only for mp_31), torch_musa's README (MCCL ships for the S4000, not the S80/S3000).
Every fact is one constant here, so a wrong one is one edit.
"""
from __future__ import annotations

import dataclasses

from glm5_hal.vendor_backend import device_dtypes as shared_device_dtypes

#: torch_musa releases the adapters are written against. v2.7.0 is the first release line
#: numbered after the upstream torch it extends (its README); F.rope, the fused
#: torch.rms_norm and torch.musa.current_stream().musa_stream exist there. Unconfirmed
#: whether older releases would do: lower this one constant if they do.
MIN_TORCH_MUSA = (2, 7)
#: torch.nn.functional.rope's multi_latent_attention flag is exercised by torch_musa's tests
#: only when torch.backends.mudnn.version() >= 3000.
MIN_MUDNN_FOR_MLA_ROPE = 3000
#: Python packages that provide the MUSA build of FlashMLA's interface, tried in order.
FLASH_MLA_MODULES = ("flash_mla", "mate")
#: FlashMLA's sparse prefill returns a base-2 log-sum-exp (the MUSA kernel computes
#: log2(sum) + max * sm_scale * log2(e); upstream FlashMLA's docstring says "2-based").
#: Upstream's newest reference uses the natural log: if a MUSA build follows it, set math.e.
FLASH_MLA_LSE_BASE = 2.0
#: flash_mla_sparse_fwd processes indices in tiles of 64 and heads in groups of 64.
FLASH_MLA_TOPK_MULTIPLE = 64
FLASH_MLA_HEAD_MULTIPLE = 64
FLASH_MLA_DQK, FLASH_MLA_DV = 576, 512


@dataclasses.dataclass(frozen=True)
class Generation:
    arch: str                     # "mp_22"
    capability: tuple[int, int]   # torch.musa.get_device_capability()
    cards: str
    bf16: bool                    # bfloat16 compute (torch_musa skips bf16 below arch 22)
    fp8: bool                     # float8_e4m3fn (scaled grouped GEMM, vllm-musa ENABLE_FP8)
    flash_mla_sparse: bool        # FlashMLA sparse kernels (capability major 3)
    rope: bool                    # torch.nn.functional.rope (tests run from arch 22 on)
    mccl: bool                    # MCCL ships for this card

    @property
    def label(self) -> str:
        return f"{self.arch} ({self.cards})"


GENERATIONS = (
    Generation("mp_21", (2, 1), "MTT S80/S3000", bf16=False, fp8=False, flash_mla_sparse=False, rope=False,
               mccl=False),
    Generation("mp_22", (2, 2), "MTT S4000", bf16=True, fp8=False, flash_mla_sparse=False, rope=True, mccl=True),
    Generation("mp_31", (3, 1), "MTT S5000", bf16=True, fp8=True, flash_mla_sparse=True, rope=True, mccl=True),
)


def generation_of(capability: tuple[int, int]) -> Generation | None:
    for gen in GENERATIONS:
        if gen.capability == tuple(capability):
            return gen
    return None


def supported_archs() -> str:
    return ", ".join(g.label for g in GENERATIONS)


def device_dtypes(gen: Generation) -> frozenset:
    return shared_device_dtypes(bf16=gen.bf16, fp8=gen.fp8)





