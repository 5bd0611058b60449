"""Cambricon MLU generations, the vendor package versions the adapters were read from, and
the Neuware libraries torch_mlu needs.

Every fact names its public source: Cambricon/torch_mlu @d578002c (2024-09, the only public
torch_mlu), torch_mlu_ops 1.12.1+torch2.11.0 (torch_mlu_ops/_ops.py docstrings and
abstract.py, as published in miznchimaki/domesticated_torch_mlu_ops @9fbf7df6 -- the only
public torch_mlu_ops version), Cambricon/vllm-mlu vllm_mlu/_mlu_ops.py @8fa99fd9 (how the ops
are called), Cambricon/mlu-ops core/context.h @ee0073c0 (arch ids). Facts no public source
states are marked UNVERIFIED; where they matter the backend declines conservatively.
"""
from __future__ import annotations

import dataclasses

import torch

from glm5_hal.vendor_backend import Behaviour, Era
from glm5_hal.vendor_backend import device_dtypes as shared_device_dtypes

#: The torch_mlu_ops release the adapters follow (masked_indexer_select_paged_kv with
#: is_score_float, moe_gen_idx/moe_expand_input/moe_combine_result with cusum ranges,
#: reshape_from_cache, moe_sigmoid_topk with score_bias, smooth_quant_group_gemm): 1.12 is the
#: one public version, so this is the version the docstrings were read from, not a proven
#: minimum (older releases may or may not carry these arguments: UNVERIFIED).
MIN_TMO = (1, 12)
#: Shared libraries the bridge needs at import: CNRT (the runtime) and CNDEV (device
#: management) -- torch_mlu links both (torch_mlu/csrc/CMakeLists.txt:98-116 @d578002c,
#: cmake/modules/FindCNDEV.cmake:19 `find_library(CNDEV_LIBRARY NAMES cndev)`).
NEUWARE_LIBRARIES = ("libcnrt.so", "libcndev.so")
#: Capability majors older than this (MLU270/MLU290) are refused: UNVERIFIED which major an
#: MLU2xx reports; refusing the older parts is the conservative side.
MIN_MAJOR = 3
#: torch.mlu.is_bf16_supported(): `get_device_properties(current_device()).major >= 5`
#: (torch_mlu/mlu/__init__.py:135-137 @d578002c).
BF16_MAJOR = 5
#: FP8 is declared only when the installed torch_mlu says so through
#: `torch.mlu.is_fp8_supported()`. The public torch_mlu (@d578002c) has no such function, and no
#: public source ties FP8 to a capability major (the `major >= 6` this backend once assumed has
#: none): without it, no FP8.
FP8_QUERY = "is_fp8_supported"

#: Every adapter calls torch_mlu_ops, whose argument orders and semantics were read from one
#: public version only: 1.12.1 (no other release is public, so how the signatures change
#: across versions cannot be checked). Any other version narrows the backend.
TMO_API = Behaviour("tmo_api", "torch_mlu_ops", (
    Era((1, 12, 1), "1.12.1 signatures and docstring semantics",
        "torch_mlu_ops 1.12.1+torch2.11.0: torch_mlu_ops/_ops.py, abstract.py and _version.py as published in "
        "miznchimaki/domesticated_torch_mlu_ops @9fbf7df6; call forms in Cambricon/vllm-mlu vllm_mlu/_mlu_ops.py "
        "@8fa99fd9"),
), verified_up_to=(1, 12, 1))

BEHAVIOURS = (TMO_API,)


@dataclasses.dataclass(frozen=True)
class Generation:
    major: int
    label: str
    bf16: bool
    fp8: bool


#: Labels for known capability majors. The arch ids are public (mlu-ops core/context.h
#: @ee0073c0: MLUOP_MLU370 = 372, MLUOP_MLU590 = 592); the capability major each reports is
#: UNVERIFIED (inferred from the ids). Only labels key on it: the dtype rules key on the major.
KNOWN_ARCHS = {3: "MLU370 class (mtp_372)", 5: "MLU590 class (mtp_592)"}


def generation_of(major: int, fp8: bool = False) -> Generation | None:
    """`fp8`: what the installed torch_mlu's is_fp8_supported() answered (False without it)."""
    if major < MIN_MAJOR:
        return None
    label = KNOWN_ARCHS.get(major, f"capability {major}.x")
    return Generation(major, label, bf16=major >= BF16_MAJOR, fp8=fp8)


def device_dtypes(gen: Generation) -> frozenset:
    """The float dtypes of the generation, and int8 (the W8A8 GEMMs' codes: torch_mlu_ops
    1.12.1 smooth_quant_group_gemm's "Type: a: int8", with no generation named)."""
    return shared_device_dtypes(bf16=gen.bf16, fp8=gen.fp8) | {torch.int8}
