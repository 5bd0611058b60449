"""Ascend chip generations, version minimums, and the CANN libraries torch_npu needs.

Sources: torch_npu 2.13.0's SocVersion enum (torch_npu/csrc/core/npu/NpuVariables.h), the
SoC name strings in libtorch_npu.so, vllm-ascend's `check_ascend_device_type`, the op
documentation's product lists, and the NEEDED entries of torch_npu's shared objects
(see README.md, "Sources"). Every fact is one constant here, so a wrong one is one edit.
"""
from __future__ import annotations

import dataclasses

from glm5_hal.vendor_backend import device_dtypes as shared_device_dtypes

#: torch_npu releases whose op schemas the adapters are written against: 2.13.0 made
#: npu_sparse_flash_attention's sparse_block_size keyword-only and made it return
#: (out, softmax_max, softmax_sum); earlier releases return one tensor.
MIN_TORCH_NPU = (2, 13)
#: CANN release line that ships the DSA kernels (LightningIndexer, SparseFlashAttention),
#: released for DeepSeek-V3.2-Exp. Compared on (major, minor). Unconfirmed from a primary
#: source: if an older CANN turns out to carry the same kernels, lower this one constant.
MIN_CANN = (8, 3)
#: Shared libraries torch_npu's extension modules need at import (readelf -d NEEDED of
#: torch_npu/_C*.so and lib/libtorch_npu.so); libhccl.so is the first the loader misses.
CANN_LIBRARIES = ("libhccl.so", "libascendcl.so")


@dataclasses.dataclass(frozen=True)
class Generation:
    key: str                  # "A2", "A3", "950"
    label: str
    soc_versions: range
    fp8: bool                 # float8_e4m3fn compute (npu_dynamic_block_quant dst fp8, ...)
    indexer_key_quant: str    # how the DSA indexer keys are quantised on this generation
    notes: str


GENERATIONS = (
    Generation("A2", "Atlas A2 (Ascend 910B)", range(220, 226), False, "none (bf16/fp16 keys)",
               "bf16/fp16; no FP8"),
    Generation("A3", "Atlas A3 (Ascend 910C, 910_93xx)", range(250, 257), False,
               "int8 per-token-head (npu_quant_lightning_indexer)",
               "bf16/fp16; int8-quantised indexer keys; no FP8"),
    Generation("950", "Ascend 950PR/950DT", range(260, 261), True,
               "float8_e4m3fn / hifloat8 per-token-head (npu_quant_lightning_indexer)",
               "bf16/fp16 plus FP8 (float8_e4m3fn, hifloat8) and MX formats"),
)


def generation_of(soc_version: int) -> Generation | None:
    for gen in GENERATIONS:
        if soc_version in gen.soc_versions:
            return gen
    return None


def supported_socs() -> str:
    return ", ".join(f"{g.label}: soc {g.soc_versions.start}-{g.soc_versions.stop - 1}"
                     if len(g.soc_versions) > 1 else f"{g.label}: soc {g.soc_versions.start}"
                     for g in GENERATIONS)


def device_dtypes(gen: Generation) -> frozenset:
    return shared_device_dtypes(fp8=gen.fp8)





