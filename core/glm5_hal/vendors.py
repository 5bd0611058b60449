"""Facts about each accelerator vendor's software stack, in one place, importable without torch.

Used by the vendor backends (probing), by `glm5_hal.dist` (process-group backend names)
and by `glm5-hal doctor` (which must work even when `import torch` fails). Where a fact is
unconfirmed (see ../shared/VENDORS.md), it is marked so here and nowhere else: a wrong
guess is one constant to correct.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Vendor:
    backend: str                    # glm5_hal backend name
    chips: str
    bridge: str | None              # PyTorch bridge module (None: built into torch)
    device_type: str                # torch device type the kernels accept
    dist_backend: str               # torch.distributed backend name
    toolchain_env: tuple[str, ...]  # SDK root variables, first found wins
    compiler: str                   # kernel compiler executable
    smi: str                        # device query tool
    visible_devices: str            # visible-devices environment variable
    unconfirmed: tuple[str, ...] = ()  # which of the fields above are unconfirmed


VENDORS: dict[str, Vendor] = {v.backend: v for v in (
    Vendor("ascend", "Huawei Ascend 910B (A2), 910C (A3), 950", "torch_npu", "npu", "hccl",
           ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"), "bisheng", "npu-smi",
           "ASCEND_RT_VISIBLE_DEVICES"),
    Vendor("musa", "Moore Threads MTT S4000, S5000", "torch_musa", "musa", "mccl",
           ("MUSA_HOME", "MUSA_PATH"), "mcc", "mthreads-gmi", "MUSA_VISIBLE_DEVICES",
           unconfirmed=("visible_devices",)),
    Vendor("dcu", "Hygon DCU K100, Z100, BW1000", None, "cuda", "nccl",
           ("ROCM_PATH", "DTK_HOME"), "hipcc", "hy-smi", "HIP_VISIBLE_DEVICES",
           unconfirmed=("visible_devices",)),
    Vendor("cambricon", "Cambricon MLU370, MLU590", "torch_mlu", "mlu", "cncl",
           ("NEUWARE_HOME",), "cncc", "cnmon", "MLU_VISIBLE_DEVICES",
           unconfirmed=("visible_devices",)),
    Vendor("kunlun", "Kunlunxin P800, R200", "torch_xmlir", "cuda", "bkcl",
           ("XTDK_HOME", "XPU_HOME"), "clang", "xpu-smi", "XPU_VISIBLE_DEVICES",
           unconfirmed=("device_type", "dist_backend", "visible_devices", "toolchain_env")),
)}

#: Environment variables naming a CUDA toolkit (the CUDA reference path).
CUDA_TOOLCHAIN_ENV = ("CUDA_HOME", "CUDA_PATH")
