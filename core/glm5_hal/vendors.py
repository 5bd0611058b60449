"""Facts about each accelerator vendor's software stack, and how to tell the stacks apart.

One place for every vendor fact (bridge module, device type, distributed backend, toolchain,
device tool, visible-devices variable), importable without torch: it is used by the vendor
backends (probing), by `glm5_hal.dist` (process-group backend names) and by
`glm5-hal doctor` (which must work where `import torch` fails). Facts not confirmed from a
primary source are listed in `unconfirmed`, so a wrong guess is one constant to correct;
SOURCES names the public source (repository, path, tag) of the others, per vendor.
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
           # npu-smi and bisheng: in CANN, which is not public in a form the sources above cite
           "ASCEND_RT_VISIBLE_DEVICES", unconfirmed=("compiler", "smi")),
    Vendor("musa", "Moore Threads MTT S4000 (mp_22), S5000 (mp_31)", "torch_musa", "musa", "mccl",
           ("MUSA_HOME", "MUSA_PATH"), "mcc", "mthreads-gmi", "MUSA_VISIBLE_DEVICES"),
    Vendor("dcu", "Hygon DCU K100, K100_AI, Z100, BW1000", None, "cuda", "nccl",
           ("ROCM_PATH", "DTK_HOME"), "hipcc", "hy-smi", "CUDA_VISIBLE_DEVICES",
           unconfirmed=("toolchain_env", "compiler")),
    Vendor("cambricon", "Cambricon MLU370, MLU590", "torch_mlu", "mlu", "cncl",
           ("NEUWARE_HOME",), "cncc", "cnmon", "MLU_VISIBLE_DEVICES"),
    Vendor("kunlun", "Kunlunxin P800 (Kunlun3), R200", "torch_xmlir", "cuda", "nccl",
           ("XTDK_PATH", "XRE_PATH"), "clang++", "xpu-smi", "XPU_VISIBLE_DEVICES",
           # xpytorch runs in CUDA-compatible mode with BKCL behind the "nccl" name
           unconfirmed=("bridge", "toolchain_env", "compiler")),
    Vendor("iluvatar", "Iluvatar CoreX MR-V100, BI-V150", None, "cuda", "nccl",
           ("COREX_HOME",), "clang++", "ixsmi", "CUDA_VISIBLE_DEVICES",
           # COREX_HOME: no public source names the variable (the SDK sits in /usr/local/corex)
           unconfirmed=("dist_backend", "toolchain_env")),
    Vendor("enflame", "Enflame GCU S60 (gcu300), gcu400", "torch_gcu", "gcu", "eccl",
           ("TOPS_HOME",), "topscc", "efsmi", "TOPS_VISIBLE_DEVICES",
           unconfirmed=("toolchain_env",)),
)}

#: The public source of each fact above (repository, path, tag or commit), per backend and field;
#: a field without one is listed in that vendor's `unconfirmed`.
SOURCES: dict[str, dict[str, str]] = {
    "ascend": {
        "bridge": "torch-npu 2.13.0 wheel (PyPI): the torch_npu package",
        "device_type": "torch-npu 2.13.0 wheel torch_npu/_init/registry/backend.py:47 "
                       "(torch.utils.rename_privateuse1_backend(\"npu\"))",
        "dist_backend": "torch-npu 2.13.0 wheel torch_npu/_init/registry/distributed.py:37-38 "
                        "(Backend.register_backend(\"hccl\", ...))",
        "toolchain_env": "torch-npu 2.13.0 wheel torch_npu/_inductor/triton_experimental/npu_triton_heuristics.py:127 "
                         "(ASCEND_HOME_PATH, else ASCEND_TOOLKIT_HOME)",
        "visible_devices": "torch-npu 2.13.0 wheel torch_npu/npu/__init__.py:419-420 (ASCEND_RT_VISIBLE_DEVICES)",
    },
    "musa": {
        "bridge": "MooreThreads/torch_musa v2.7.1 (0bc05bff): the torch_musa package",
        "device_type": "MooreThreads/torch_musa v2.7.1 tests (`.musa()` tensors, device 'musa')",
        "dist_backend": "MooreThreads/torch_musa v2.7.1 torch_musa/csrc/distributed/ProcessGroupMCCL.h:196 "
                        "MCCL_BACKEND_NAME = \"mccl\"",
        "toolchain_env": "MooreThreads/torch_musa v2.7.1 CMakeLists.txt:231-235 (MUSA_HOME, default /usr/local/musa; "
                         "MUSA_PATH is that file's CMake variable, also accepted here)",
        "compiler": "MooreThreads/torch_musa v2.7.1 CMakeLists.txt:253 (mcc --offload-arch=mp_XX)",
        "smi": "MooreThreads/torch_musa v2.7.1 torch_musa/core/memory.py:92 (`mthreads-gmi`)",
        "visible_devices": "MooreThreads/torch_musa v2.7.1 docs/markdown/source/04_quick_start.md:23",
    },
    "dcu": {
        "bridge": "HYGON-AI/vllm-plugin-das vllm_hcu/platforms/hcu.py @01211a04: a DTK build of torch itself",
        "device_type": "HYGON-AI/vllm-plugin-das vllm_hcu/platforms/hcu.py @01211a04 (device_type = \"cuda\")",
        "dist_backend": "HYGON-AI/vllm-plugin-das vllm_hcu/platforms/hcu.py @01211a04 (dist_backend = \"nccl\")",
        "smi": "FlagGems src/flag_gems/runtime/backend/_hygon/__init__.py @3d3dc860 (hy-smi)",
        "visible_devices": "HYGON-AI/vllm-plugin-das vllm_hcu/platforms/hcu.py @01211a04 "
                           "(device_control_env_var = \"CUDA_VISIBLE_DEVICES\")",
    },
    "cambricon": {
        "bridge": "Cambricon/torch_mlu @d578002c: the torch_mlu package",
        "device_type": "Cambricon/torch_mlu @d578002c torch_mlu/mlu/__init__.py (the 'mlu' device)",
        "dist_backend": "Cambricon/torch_mlu @d578002c torch_mlu/csrc/framework/distributed/process_group_cncl.hpp:51",
        "toolchain_env": "Cambricon/torch_mlu @d578002c setup.py:59-62 (NEUWARE_HOME must be set)",
        "compiler": "Cambricon/torch_mlu @d578002c torch_mlu/csrc/CMakeLists.txt:84-95 (cncc flags, --bang-mlu-arch)",
        "smi": "Cambricon/torch_mlu @d578002c test/common_utils.py:101 (`cnmon info`)",
        "visible_devices": "Cambricon/torch_mlu @d578002c torch_mlu/mlu/device.py:38 (MLU_VISIBLE_DEVICES)",
    },
    "kunlun": {
        "bridge": "baidu/vLLM-Kunlun v0.10.1.1 (ba13599) vllm_kunlun/ops/_kunlun_ops.py:19 `import torch_xmlir`; "
                  "v0.11.0+ import kunlun_ops / xspeedgate_ops and no torch_xmlir: whether current xpytorch "
                  "stacks still ship it is UNVERIFIED",
        "device_type": "baidu/vLLM-Kunlun main (09869ee) vllm_kunlun/platforms/kunlun.py:31 (device_type 'cuda')",
        "dist_backend": "baidu/vLLM-Kunlun main (09869ee) vllm_kunlun/platforms/kunlun.py:26 (dist_backend = \"nccl\")",
        "smi": "baidu/vLLM-Kunlun main (09869ee) docs/source/locale/zh_CN/LC_MESSAGES/faqs.po:200 (`xpu-smi info`)",
        "visible_devices": "baidu/vLLM-Kunlun main (09869ee) docs/source/tutorials/multi_xpu_GLM-5-W8A8-INT8.md:51 "
                           "(export XPU_VISIBLE_DEVICES=...)",
    },
    "iluvatar": {
        "bridge": "flagos-ai/FlagGems src/flag_gems/runtime/backend/_iluvatar/__init__.py @ed2508bc "
                  "(device_name=\"cuda\": CoreX ships a vendor build of torch itself, wheels '+corex')",
        "device_type": "flagos-ai/FlagGems src/flag_gems/runtime/backend/_iluvatar/__init__.py @ed2508bc "
                       "(VendorDescriptor(device_name=\"cuda\"))",
        "compiler": "Deep-Spark/DeepSparkInference models/cv/instance_segmentation/mask_rcnn/ixrt/scripts/init.sh "
                    "@79773330 (/usr/local/corex/bin/clang++) and plugins/CMakeLists.txt:48 "
                    "(--cuda-gpu-arch=ivcore11, .cu compiled as CXX)",
        "smi": "flagos-ai/FlagGems src/flag_gems/runtime/backend/_iluvatar/__init__.py @ed2508bc "
               "(device_query_cmd=\"ixsmi\")",
        "visible_devices": "Deep-Spark/DeepSparkInference @79773330 (the CUDA_VISIBLE_DEVICES of its run scripts)",
    },
    "enflame": {
        "bridge": "EnflameTechnology/vllm-gcu vllm_gcu/gcu.py:161-162 @7b5aaca9 (import torch_gcu, "
                  "torch_gcu.transfer_to_gcu)",
        "device_type": "EnflameTechnology/vllm-gcu vllm_gcu/gcu.py:48-49 @7b5aaca9 (device_type = \"gcu\", "
                       "dispatch_key = \"PrivateUse1\")",
        "dist_backend": "EnflameTechnology/vllm-gcu vllm_gcu/worker/worker.py:238 @7b5aaca9 (backend=\"eccl\"); "
                        "vllm_gcu/distributed/utils.py:50-53 (torch_gcu._C._distributed_c10d.ProcessGroupECCL)",
        "compiler": "EnflameTechnology/vllm-gcu setup.py:325-338 @7b5aaca9 (TopsTorchExtension, \"topscc\" flags)",
        "smi": "EnflameTechnology/vllm-gcu docs/source/installation.md:29 @7b5aaca9 (`efsmi` validates the install)",
        "visible_devices": "EnflameTechnology/vllm-gcu vllm_gcu/gcu.py:51 @7b5aaca9 "
                           "(device_control_env_var = \"TOPS_VISIBLE_DEVICES\")",
    },
}

def installed(module: str) -> bool:
    """Whether `module` can be found, without importing it (importing a bridge can fail hard)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def cuda_flavor(torch: Any) -> str:
    """Which stack a `cuda` device of this torch build really is: "enflame", "dcu", "iluvatar",
    "kunlun", "rocm" (AMD), "cuda" (NVIDIA) or "none" (no CUDA-type stack at all).
    Uses only attributes and installed modules; never initialises a device."""
    if hasattr(torch, "gcu"):
        # torch_gcu's transfer_to_gcu makes torch.cuda answer for GCUs (vllm-gcu's platform
        # imports it: vllm_gcu/gcu.py:161-162 @7b5aaca9)
        return "enflame"
    if hasattr(torch, "__hcu_version__"):
        return "dcu"
    # FlagGems keys on the attribute (runtime/common.py _VENDOR_TORCH_ATTR, hasattr(torch, "corex"))
    if hasattr(torch, "corex") or "+corex" in str(getattr(torch, "__version__", "")):
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
