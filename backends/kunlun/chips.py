"""Kunlunxin XPU generations, version minimums and the limits the adapters check.

Sources: vLLM-Kunlun (vllm_kunlun/platforms/kunlun.py: device type "cuda", dist backend
"nccl", fp32/fp16/bf16/int8 and no FP8; vllm_kunlun/ops/_kunlun_ops.py: the <= 512 expert
ceiling of moe_sigmoid_group_topk_norm and moe_pre_sorted; vllm_kunlun/ops/moe/router.py:
the softmax kernels' 512 / 480 ceilings; its install guide: xpytorch is a torch 2.5.1 build),
sglang-kunlun (a platform is Kunlun iff torch_xmlir imports), field notes on the fused
SWISH_GLU activation of moe_fc. Every fact is one constant here, so a wrong one is one edit.
"""
from __future__ import annotations


import torch

#: xpytorch, the CUDA-compatible-mode torch for Kunlun3 (P800), is a torch 2.5.1 build;
#: older torch builds are the XMLIR/PrivateUse1 stacks of the R200 era.
MIN_TORCH = (2, 5)
#: Device-name markers of Kunlun2 (R200 family): not served by xpytorch's CUDA mode.
KUNLUN2_MARKERS = ("R200", "R300", "K200", "KUNLUN2")
#: P800 MoE kernels (moe_sigmoid_group_topk_norm, moe_pre_sorted, moe_softmax_topk_norm)
#: are limited to this many experts; moe_fc is held to the same bound (unconfirmed for it).
MOE_MAX_EXPERTS = 512
#: moe_softmax_topk_norm's ceiling once a block_statistic buffer is passed (router.py).
SOFTMAX_MAX_EXPERTS_WITH_STATISTIC = 480
#: Rows of the block_statistic histogram the MoE kernels take: one per XPU cluster.
BLOCK_STATISTIC_ROWS = 12
#: moe_fc's fused act="SWISH_GLU" is wrong for M >= this (field report); never used.
SWISH_GLU_BROKEN_FROM_ROWS = 1024
#: xspeedgate_ops.hadamard_transform's largest D (the fast-hadamard-transform API it
#: mirrors; unconfirmed for the Kunlun build).
HADAMARD_MAX_DIM = 32768

DTYPES_KUNLUN3 = frozenset({torch.float32, torch.float16, torch.bfloat16})








def is_kunlun2(device_name: str) -> bool:
    upper = device_name.upper()
    return any(marker in upper for marker in KUNLUN2_MARKERS)
