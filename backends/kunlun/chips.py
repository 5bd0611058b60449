"""Kunlunxin XPU generations, the vendor package versions the adapters were read from, and
the limits they check.

Every fact names its public source: baidu/vLLM-Kunlun at tags v0.10.1.1 (ba13599),
v0.11.0 (e9f0322) and main (09869ee, 2026-05-08, version 0.15.1.dev0): the `_C` op schemas
(vllm_kunlun/vllm_utils_wrapper.py up to v0.11.0, vllm_kunlun/ops/_custom_ops.py on main),
their call sites (vllm_kunlun/ops/_kunlun_ops.py, quantization/) and docs. kunlun_ops,
xspeedgate_ops and xpytorch are closed: what their kernels do beyond what vLLM-Kunlun's calls
show is UNVERIFIED, and the adapters decline conservatively there.
"""
from __future__ import annotations

import torch

from glm5_hal.vendor_backend import Behaviour, Era

#: xpytorch, the CUDA-compatible-mode torch for Kunlun3 (P800), is a torch 2.5.1 build
#: (vLLM-Kunlun docs/source/installation.md:116 @09869ee: xpytorch-cp310-torch251-...).
MIN_TORCH = (2, 5)
#: Device-name markers of Kunlun2 (R200 family), refused: UNVERIFIED (no public source gives
#: xpytorch's device names; refusing is the conservative side).
KUNLUN2_MARKERS = ("R200", "R300", "K200", "KUNLUN2")
#: The distribution whose version decides the `_C` kernels' schemas (vLLM-Kunlun's
#: pyproject.toml `name = "vllm-kunlun"`; version 0.10.1.1, 0.11.0, 0.15.1.dev0 on main).
VLLM_KUNLUN = "vllm-kunlun"
#: The largest expert count the MoE kernels (moe_softmax_topk(_norm), moe_sigmoid_group_topk_norm,
#: gen_block_statistic, moe_pre_sorted, moe_fc) are taken to handle. No public source states
#: a ceiling: the 512 / 480 this backend used to cite came from a file (vllm_kunlun/ops/moe/
#: router.py) that exists in no ref of vLLM-Kunlun. 256 is the expert count of the models
#: vLLM-Kunlun's tutorials serve with these kernels (docs/source/tutorials/
#: multi_xpu_GLM-5-W8A8-INT8.md, multi_xpu_DeepSeek-V3.2-Exp-w8a8.md @09869ee; GLM-5 and
#: DeepSeek-V3.2 have 256 routed experts, glm5_hal.presets); more are declined as unverified.
MOE_MAX_EXPERTS = 256
#: Rows of the block_statistic histogram the MoE kernels take: `num_blocks = 12`
#: (vllm_kunlun/ops/_kunlun_ops.py:405 @09869ee, :408 @e9f0322).
BLOCK_STATISTIC_ROWS = 12
#: xspeedgate_ops.hadamard_transform's largest D: UNVERIFIED (32768 is Dao-AILab
#: fast-hadamard-transform's limit, whose API it mirrors; no Kunlun source states one).
HADAMARD_MAX_DIM = 32768
#: fp32/fp16/bf16 and int8 (the W8A8 GEMMs' codes): vllm_kunlun/platforms/kunlun.py:354-363 @09869ee
#: ("Supported dtypes are: fp32, fp16, bf16, int8."); no FP8.
DTYPES_KUNLUN3 = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.int8})

#: The `_C` MoE kernels as vLLM-Kunlun registers and calls them: moe_softmax_topk(x,
#: normed_score, topk_index, block_statistic, axis=-1, turn=True), moe_softmax_topk_norm(...,
#: block_statistic, stable=True), moe_sigmoid_group_topk_norm(x, topk_index, norm_score,
#: block_static, bias, scale, n_group, topk_group), gen_block_statistic, moe_pre_sorted,
#: moe_fc(x, weight, sorted_tokens_num_lod, sorted_tokens_idx, moe_topk, y, act=None, ...,
#: topk_ids=None, ...), moe_post. The schemas the adapters use are the same in every version read
#: (moe_fc's `act` is annotated Tensor in v0.10.1.1 and Optional[str] later: never passed).
MOE_KERNELS = Behaviour("moe_kernels", VLLM_KUNLUN, (
    Era((0, 10, 1), "vllm_utils_wrapper.py schemas",
        "baidu/vLLM-Kunlun v0.10.1.1 (ba13599) vllm_kunlun/vllm_utils_wrapper.py:566-941, "
        "vllm_kunlun/ops/_kunlun_ops.py"),
    Era((0, 11, 0), "vllm_utils_wrapper.py / ops/_custom_ops.py schemas",
        "baidu/vLLM-Kunlun v0.11.0 (e9f0322) vllm_kunlun/vllm_utils_wrapper.py:871-1556; main (09869ee, "
        "0.15.1.dev0) vllm_kunlun/ops/_custom_ops.py:782-1352, vllm_kunlun/ops/_kunlun_ops.py:395-700"),
), verified_up_to=(0, 15, 1))

#: W8A8 on Kunlun: activations quantised per token by kunlun_ops.quant2d, whose scale output
#: "represents max" (vllm_kunlun/ops/_custom_ops.py:1651 @09869ee), weights with per-channel
#: scales multiplied by 127 ("NOTE: kunlun_ops use max as scale",
#: quantization/compressed_tensors/compressed_tensors_moe.py:117), then `_C.matmul(x, w, out_dtype,
#: x_pc_max=, w_pc_max=, bias=)` (quantization/kernels/scale_mm.py:83-100, whose "backup option"
#: is cutlass_scaled_mm(scale_a = x_s / 127, scale_b = (w_s / 127)^T)) and `_C.moe_fc(...,
#: x_perchannel_max=, w_perchannel_max=, topk_ids=)` (compressed_tensors_moe.py:226-274). The
#: value is the factor between a max and a scale. From v0.11.0 (ops/quantization/ then).
W8A8_MAX_SCALES = Behaviour("w8a8_max_scales", VLLM_KUNLUN, (
    Era((0, 11, 0), 127.0,
        "baidu/vLLM-Kunlun v0.11.0 (e9f0322) vllm_kunlun/ops/quantization/kernels/kunlun_scale_mm.py:86, "
        "ops/quantization/compressed_tensors/compressed_tensors_moe.py:115-261; main (09869ee) "
        "vllm_kunlun/quantization/kernels/scale_mm.py:61-92, compressed_tensors/compressed_tensors_moe.py:117-270"),
), verified_up_to=(0, 15, 1))

BEHAVIOURS = (MOE_KERNELS, W8A8_MAX_SCALES)


def is_kunlun2(device_name: str) -> bool:
    upper = device_name.upper()
    return any(marker in upper for marker in KUNLUN2_MARKERS)
