"""Iluvatar CoreX products, the vendor package versions the adapters were read from, and the
facts they depend on.

Every fact names its public source: flagos-ai/FlagGems @ed2508bc (src/flag_gems/runtime/
backend/_iluvatar: the vendor descriptor, the fused kernels, "BI-V150" in its kernel notes;
runtime/common.py: the `torch.corex` marker), Deep-Spark/DeepSparkInference @79773330 (the
vendor's inference examples: products MR-V100 / BI-V150 in tests/model_info.json, ixformer
call sites and versions, the CoreX compiler and its flags) and ModelTC/LightX2V @f8aee98b
(ixformer call sites). ixformer itself is closed: no public source of it was found.
"""
from __future__ import annotations

import dataclasses

from glm5_hal.vendor_backend import Behaviour, Era
from glm5_hal.vendor_backend import device_dtypes as shared_device_dtypes

#: glm5_hal itself needs torch >= 2.6 (pyproject.toml): not a vendor fact.
MIN_TORCH = (2, 6)
IXFORMER = "ixformer"
FLAG_GEMS = "flag_gems"
#: FlagGems' top_k_per_row_prefill collects a row's candidates into a buffer of
#: next_pow2(max(2 * top_k, 2048)) slots and writes every candidate at or above the threshold
#: bucket without a bound (top_k_per_row_prefill.py:207, _compact_kernel @ed2508bc): a row
#: longer than the buffer could overflow it when its values crowd one bucket, so rows are
#: kept within it.
TOPK_MIN_CANDIDATES = 2048


def topk_candidate_slots(top_k: int) -> int:
    slots = 1
    while slots < max(2 * top_k, TOPK_MIN_CANDIDATES):
        slots <<= 1
    return slots


@dataclasses.dataclass(frozen=True)
class Product:
    name: str          # as in the vendor's product lists
    bf16: bool
    unconfirmed: str = ""


#: DeepSparkInference tests/model_info.json lists models per "release_gpgpu" MR-V100 (and the
#: README the BI-V150); FlagGems' _iluvatar kernels are tuned "for Iluvatar BI-V150"
#: (ops/histc.py:25, ops/linear_backward.py:223). fp64 is off on CoreX (FlagGems descriptor
#: fp64_enabled=False); no public source declares FP8, so none is declared. That
#: torch.cuda.get_device_name() contains these names is UNVERIFIED: a CoreX device with
#: another name is usable, reported as not in the table.
PRODUCTS = (
    Product("BI-V150", bf16=True),
    Product("MR-V100", bf16=True, unconfirmed="bf16 (ixformer's fp16/bf16 functions are the source)"),
    Product("BI-V100", bf16=True, unconfirmed="product name; bf16"),
)


def product_of(device_name: str) -> Product | None:
    name = str(device_name).upper()
    return next((p for p in PRODUCTS if p.name in name), None)


def device_dtypes(product: Product | None) -> frozenset:
    return shared_device_dtypes(bf16=product is None or product.bf16, fp8=False)


#: FlagGems' Iluvatar top_k_per_row_prefill: added in 4f0d66f2 (first in v5.3.1), unchanged up to
#: v5.3.4-166-ged2508bc; its tail for a row shorter than top_k is index 0 (the zeroed candidate
#: buffer), not -1 as in vLLM's kernel.
FLAG_GEMS_TOPK = Behaviour("flag_gems_topk", FLAG_GEMS, (
    Era((5, 3, 1), "flag_gems.runtime.backend._iluvatar.fused.top_k_per_row_prefill (tail slots 0)",
        "flagos-ai/FlagGems src/flag_gems/runtime/backend/_iluvatar/fused/top_k_per_row_prefill.py "
        "@4f0d66f2 (v5.3.1) .. @ed2508bc"),
), verified_up_to=(5, 3, 4))

#: ixformer's w8a8 takes the output as its sixth positional argument in the vendor's own example
#: (DeepSparkInference flux.1-dev/xdit/w8a8_linear.py:57), whose image lists ixformer
#: 0.7.0+corex.4.5.0 (cosyvoice/igie/cv3-eval/pip3.txt:85); LightX2V calls it with out_dtype= instead,
#: without naming a version. Only 0.7.x is taken as read.
IXFORMER_W8A8 = Behaviour("ixformer_w8a8", IXFORMER, (
    Era((0, 7, 0), "w8a8(input, weight, i_scales, w_scales, bias, output)",
        "Deep-Spark/DeepSparkInference models/multimodal/diffusion_model/flux.1-dev/xdit/w8a8_linear.py:43-57 "
        "@79773330; models/speech/speech_synthesis/cosyvoice/igie/cv3-eval/pip3.txt:85 (ixformer 0.7.0+corex.4.5.0)"),
), verified_up_to=(0, 7))

#: FlagGems' generic fused silu_and_mul (a Triton kernel, built for CoreX by FlagGems' "corex" Triton
#: backend): silu in float32 times B, rounded once to the inputs' dtype (fused/silu_and_mul.py:27-31);
#: _iluvatar/op_black_list.yaml @ed2508bc (the vendor's compatibility table, 2026-03-11) lists only
#: grouped_topk and topk_softmax as unsupported on Iluvatar. The file is unchanged from v5.3.1 on.
FLAG_GEMS_SILU = Behaviour("flag_gems_silu_and_mul", FLAG_GEMS, (
    Era((5, 3, 1), "flag_gems.fused.silu_and_mul(A, B): silu(A) in float32 times B, one rounding",
        "flagos-ai/FlagGems src/flag_gems/fused/silu_and_mul.py @v5.3.1 .. @ed2508bc (unchanged)"),
), verified_up_to=(5, 3, 4))

BEHAVIOURS = (FLAG_GEMS_TOPK, FLAG_GEMS_SILU, IXFORMER_W8A8)
