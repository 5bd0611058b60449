"""glm5_hal.integrations.vllm: vLLM serves GLM-5 (DeepSeek Sparse Attention) on glm5_hal ops.

Installed with `pip install 'glm5-hal[vllm]'` (or beside any vLLM 0.32), vLLM finds it through
two entry points (pyproject.toml):

- `vllm.general_plugins` -> `register()`, run in every vLLM process (API server, engine core,
  each worker): registers the sparse-MLA attention backend `GLM5_HAL_SPARSE_MLA`
  (attention.py), the out-of-tree `SparseAttnIndexer` (indexer.py) and the indexer's cache
  backend, all running `glm5_hal.ops` on whichever glm5_hal backend serves the device.
- `vllm.platform_plugins` -> `platform_plugin()`: on a vLLM CPU build it activates
  `Glm5HalCpuPlatform` (platform.py), vLLM's CPU platform unchanged except that a sparse-MLA
  model (GLM-5, DeepSeek-V3.2) gets the glm5_hal attention backend instead of vLLM's
  "Sparse Attention is not supported on CPU", with prefix caching and chunked prefill kept.
  Elsewhere it stays inactive (CUDA, ROCm and the vendor platforms keep their own).

`import glm5_hal` never imports vLLM; this package imports it lazily, in the functions vLLM
calls. `GLM5_HAL_VLLM=0` turns both entry points off. See docs/integrations.md.
"""
from __future__ import annotations

import os

__all__ = ["TESTED_VERSIONS", "ATTENTION_BACKEND", "platform_plugin", "register", "enabled"]

#: The vLLM releases this integration is tested against (tests/test_integrations_vllm.py).
TESTED_VERSIONS = ("0.32.0",)
#: The name of the sparse-MLA attention backend in vLLM's registry (`--attention-backend`).
ATTENTION_BACKEND = "GLM5_HAL_SPARSE_MLA"
PLATFORM = "glm5_hal.integrations.vllm.platform.Glm5HalCpuPlatform"


def enabled() -> bool:
    """False when the user turned the plugin off with GLM5_HAL_VLLM=0."""
    return os.environ.get("GLM5_HAL_VLLM", "1").strip().lower() not in ("0", "false", "no", "off")


def platform_plugin() -> str | None:
    """vLLM's `vllm.platform_plugins` hook: the platform class to use, or None to stay out.

    Active exactly where vLLM's own CPU platform would be (a CPU build of vLLM, or
    VLLM_TARGET_DEVICE=cpu is handled by vLLM before any plugin runs), so a machine with an
    accelerator platform never gets two. vLLM calls this twice per process at import time:
    it only reads the environment and vLLM's own CPU detection."""
    if not enabled():
        return None
    from vllm.platforms import cpu_platform_plugin
    return PLATFORM if cpu_platform_plugin() is not None else None


def register() -> None:
    """vLLM's `vllm.general_plugins` hook, run once in every vLLM process: registers the
    glm5_hal sparse-MLA attention backend, the indexer and its cache backend (vLLM's
    registries are per process)."""
    if not enabled():
        return
    from . import registration
    registration.register_all()
