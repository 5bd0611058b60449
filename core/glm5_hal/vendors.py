"""Facts about each accelerator vendor's software stack, and how to tell the stacks apart.

One place for every vendor fact (bridge module, device type, distributed backend, toolchain,
device tool, visible-devices variable), importable without torch: it is used by the vendor
backends (probing), by `glm5_hal.dist` (process-group backend names) and by
`glm5-hal doctor` (which must work where `import torch` fails). Facts not confirmed from a
primary source are listed in `unconfirmed`, so a wrong guess is one constant to correct.
Sources: ../shared/VENDORS.md and the vendors' own projects (torch_npu wheel, torch_musa,
torch_mlu, vllm-musa, vllm-plugin-das, vLLM-Kunlun, vllm-gcu, FlagGems, DeepSpeed).
"""
from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any


@dataclasses.dataclass(frozen=True)
class Vendor:
    backend: str                    # glm5_hal backend name
    chips: str
    bridge: str | None              # PyTorch bridge module (None: a vendor build of torch itself)
    device_type: str                # torch device type the kernels accept
    dist_backend: str               # torch.distributed backend name
    toolchain_env: tuple[str, ...]  # SDK root variables, first one set wins
    compiler: str                   # kernel compiler executable
    smi: str                        # device query tool
    visible_devices: str            # visible-devices environment variable of the framework
    unconfirmed: tuple[str, ...] = ()  # fields above not confirmed from a primary source


#: Environment variables naming a CUDA toolkit (the cuda backend's nvcc; the CUDA reference path).
CUDA_TOOLCHAIN_ENV = ("CUDA_HOME", "CUDA_PATH")

VENDORS: dict[str, Vendor] = {v.backend: v for v in (
    Vendor("cuda", "NVIDIA A100 (sm_80), H100/H200 (sm_90), B200 (sm_100)", None, "cuda", "nccl",
           CUDA_TOOLCHAIN_ENV, "nvcc", "nvidia-smi", "CUDA_VISIBLE_DEVICES"),
    Vendor("ascend", "Huawei Ascend 910B (A2), 910C (A3), 950", "torch_npu", "npu", "hccl",
           ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"), "bisheng", "npu-smi",
           "ASCEND_RT_VISIBLE_DEVICES", unconfirmed=("compiler",)),
    Vendor("musa", "Moore Threads MTT S4000 (mp_22), S5000 (mp_31)", "torch_musa", "musa", "mccl",
           ("MUSA_HOME", "MUSA_PATH"), "mcc", "mthreads-gmi", "MUSA_VISIBLE_DEVICES"),
    Vendor("dcu", "Hygon DCU K100, K100_AI, Z100, BW1000", None, "cuda", "nccl",
           ("ROCM_PATH", "DTK_HOME"), "hipcc", "hy-smi", "HIP_VISIBLE_DEVICES",
           unconfirmed=("visible_devices",)),  # vLLM's DCU plugin uses CUDA_VISIBLE_DEVICES
    Vendor("cambricon", "Cambricon MLU370, MLU590", "torch_mlu", "mlu", "cncl",
           ("NEUWARE_HOME",), "cncc", "cnmon", "MLU_VISIBLE_DEVICES"),
    Vendor("kunlun", "Kunlunxin P800 (Kunlun3), R200", "torch_xmlir", "cuda", "nccl",
           ("XTDK_PATH", "XRE_PATH"), "clang++", "xpu-smi", "CUDA_VISIBLE_DEVICES",
           # xpytorch runs in CUDA-compatible mode with BKCL behind the "nccl" name
           unconfirmed=("visible_devices", "compiler")),
    Vendor("iluvatar", "Iluvatar CoreX BI-V100, BI-V150", None, "cuda", "nccl",
           ("COREX_HOME",), "clang++", "ixsmi", "CUDA_VISIBLE_DEVICES",
           unconfirmed=("dist_backend",)),
    Vendor("enflame", "Enflame GCU S60 (gcu300), gcu400", "torch_gcu", "gcu", "eccl",
           ("TOPS_HOME",), "topscc", "efsmi", "TOPS_VISIBLE_DEVICES",
           unconfirmed=("toolchain_env",)),
)}


def installed(module: str) -> bool:
    """Whether `module` can be found, without importing it (importing a bridge can fail hard)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def cuda_flavor(torch: Any) -> str:
    """Which stack a `cuda` device of this torch build really is: "dcu", "iluvatar",
    "kunlun", "rocm" (AMD), "cuda" (NVIDIA) or "none" (no CUDA-type stack at all).
    Uses only attributes and installed modules; never initialises a device."""
    if hasattr(torch, "__hcu_version__"):
        return "dcu"
    if getattr(torch, "corex", False) is True or "+corex" in getattr(torch, "__version__", ""):
        return "iluvatar"
    if installed("torch_xmlir"):
        return "kunlun"
    version = getattr(torch, "version", None)
    if getattr(version, "hip", None):
        return "rocm"
    if getattr(version, "cuda", None):
        return "cuda"
    return "none"


def identify(torch: Any) -> str | None:
    """The vendor stack this process runs on (None: CPU only). First match wins:

    1. ascend    -- torch.npu exists or the torch_npu bridge is installed
    2. musa      -- torch.musa / torch.version.musa exists or torch_musa is installed
    3. cambricon -- torch.mlu exists or torch_mlu is installed
    4. enflame   -- torch.gcu exists or torch_gcu is installed
    5. the `cuda` device type, by cuda_flavor(): dcu, iluvatar, kunlun, rocm or cuda.

    Bridges patch `torch.cuda` to answer for their own devices (torchada on MUSA,
    torch_gcu.transfer_to_gcu, torch_mlu's model transfer), so vendor-specific signals come
    before anything CUDA, and three stacks *are* `cuda` to torch.
    """
    if hasattr(torch, "npu") or installed("torch_npu"):
        return "ascend"
    if hasattr(torch, "musa") or getattr(getattr(torch, "version", None), "musa", None) or installed("torch_musa"):
        return "musa"
    if hasattr(torch, "mlu") or installed("torch_mlu"):
        return "cambricon"
    if hasattr(torch, "gcu") or installed("torch_gcu"):
        return "enflame"
    flavor = cuda_flavor(torch)
    return None if flavor == "none" else flavor
