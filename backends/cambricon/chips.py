"""Cambricon MLU generations, version minimums and the Neuware libraries torch_mlu needs.

Sources: torch_mlu's `torch_mlu/mlu/__init__.py` (is_bf16_supported: `major >= 5`,
is_fp8_supported: `major >= 6`; device count through libcndev), the torch_mlu_ops 1.12
docstrings (the op semantics the adapters rely on), mlu-ops' arch enum (MLU370 = mtp_372,
MLU590 = mtp_592), GPUStack's Cambricon detector (libcndev.so under NEUWARE_HOME/lib64).
Every fact is one constant here, so a wrong one is one edit. Which capability major an
MLU370 or MLU590 reports is inferred from the arch numbers, not read from a device: the
dtype rules below key on the major itself, so a wrong guess only mislabels a generation.
"""
from __future__ import annotations

import dataclasses

from glm5_hal.vendor_backend import device_dtypes as shared_device_dtypes

#: torch_mlu_ops release whose docstrings the adapters follow (masked_indexer_select_paged_kv
#: with is_score_float, moe_gen_idx/moe_expand_input/moe_combine_result with cusum ranges,
#: reshape_from_cache, moe_sigmoid_topk with score_bias). Older releases lack some of these
#: arguments; if one turns out to carry them all, lower this one constant.
MIN_TMO = (1, 12)
#: Shared libraries the bridge needs at import: CNRT (the runtime) and CNDEV (device
#: management; torch.mlu.device_count() goes through it).
NEUWARE_LIBRARIES = ("libcnrt.so", "libcndev.so")
#: Capability majors older than this (MLU270/MLU290, mtp_2xx) are not supported: the fused
#: ops library does not target them.
MIN_MAJOR = 3
BF16_MAJOR = 5   # torch.mlu.is_bf16_supported(): properties.major >= 5
FP8_MAJOR = 6    # torch.mlu.is_fp8_supported(): properties.major >= 6


@dataclasses.dataclass(frozen=True)
class Generation:
    major: int
    label: str
    bf16: bool
    fp8: bool


#: Labels for known capability majors (inferred from the arch numbers; unconfirmed).
KNOWN_ARCHS = {3: "MLU370 class (mtp_372)", 5: "MLU590 class (mtp_592)"}


def generation_of(major: int) -> Generation | None:
    if major < MIN_MAJOR:
        return None
    label = KNOWN_ARCHS.get(major, f"capability {major}.x")
    return Generation(major, label, bf16=major >= BF16_MAJOR, fp8=major >= FP8_MAJOR)


def device_dtypes(gen: Generation) -> frozenset:
    return shared_device_dtypes(bf16=gen.bf16, fp8=gen.fp8)





