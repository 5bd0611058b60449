"""Ascend chip generations, the torch_npu minimum, and the CANN libraries torch_npu needs.

Every fact is one constant here, with the vendor artifact it was read from (the torch-npu
wheel is version 2.13.0 from PyPI unless a comment names another), so a wrong one is one edit.
What changed between torch_npu / CANN versions is in versions.py.
"""
from __future__ import annotations

import dataclasses

from glm5_hal.vendor_backend import device_dtypes as shared_device_dtypes

#: The oldest torch_npu the backend accepts. Each torch-npu release X requires torch==X
#: (`Requires-Dist: torch==2.13.0.*` in the 2.13.0 wheel's METADATA; the same pairing in every
#: wheel) and glm5_hal requires torch>=2.6 (pyproject.toml), so no older torch_npu can share a
#: process with glm5_hal. Which ops and arguments a given release has is versions.py's business
#: (post releases of older lines gained the DSA ops after newer base releases: a version gate
#: alone cannot say it).
MIN_TORCH_NPU = (2, 6)
#: Shared libraries torch_npu's extension modules need at import: the NEEDED entries of
#: torch_npu/lib/libtorch_npu.so (readelf -d) start libhccl.so, libascendcl.so; libhccl.so is the
#: first the loader misses without CANN.
CANN_LIBRARIES = ("libhccl.so", "libascendcl.so")


@dataclasses.dataclass(frozen=True)
class Generation:
    key: str                  # "A2", "A3", "950": the product lines the op documentation names
    label: str
    soc_versions: range
    fp8: bool                 # float8_e4m3fn as a device dtype (caches, storage)
    indexer_key_quant: str    # how npu_quant_lightning_indexer quantises indexer keys here
    notes: str


#: soc_versions: the SocVersion enum of torch_npu/include/torch_npu/csrc/core/npu/NpuVariables.h
#: (Ascend910B1 = 220 ... Ascend910B4_1 = 225; Ascend910_9391 = 250 ... Ascend910_9363 = 256;
#: Ascend950 = 260). fp8 / indexer_key_quant: ops-transformer v9.1.0.pre (121f37de)
#: attention/quant_lightning_indexer/README.md, 约束说明 -- A3: query and key INT8; Ascend
#: 950PR/950DT: FLOAT8_E4M3, HIFLOAT8, INT8 (its product table lists A2 too, with no dtype line
#: for it). That the 950 holds FP8 data is what that README says; no torch_npu op the adapters
#: use documents an FP8 output (see ops.py, "Not mapped").
GENERATIONS = (
    Generation("A2", "Atlas A2 (Ascend 910B)", range(220, 226), False, "not described (bf16/fp16 keys)",
               "bf16/fp16; no FP8"),
    Generation("A3", "Atlas A3 (Ascend 910C, 910_93xx)", range(250, 257), False,
               "int8 (npu_quant_lightning_indexer)",
               "bf16/fp16; int8-quantised indexer keys; no FP8"),
    Generation("950", "Ascend 950PR/950DT", range(260, 261), True,
               "float8_e4m3fn / hifloat8 / int8 (npu_quant_lightning_indexer)",
               "bf16/fp16 plus FP8 data (float8_e4m3fn, hifloat8)"),
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
