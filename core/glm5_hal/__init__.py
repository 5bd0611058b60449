"""glm5_hal: backend-neutral ops for GLM-5-class models, with vendor backends as plugins.

    import glm5_hal as hal
    y = hal.ops.rms_norm(x, w, 1e-5)
    print(hal.explain("rms_norm", x, w, 1e-5))

Attributes are loaded on first access (PEP 562) so that `glm5-hal doctor` can run and
explain even where `import torch` itself fails.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Backend": "glm5_hal.backend",
    "Availability": "glm5_hal.backend",
    "Capabilities": "glm5_hal.backend",
    "hookimpl": "glm5_hal.plugins",
    "hookspec": "glm5_hal.plugins",
    "get_backend": "glm5_hal.registry",
    "use": "glm5_hal.registry",
    "explain": "glm5_hal.registry",
    "fallback_stats": "glm5_hal.registry",
    "load_plugin": "glm5_hal.registry",
    "unload_plugin": "glm5_hal.registry",
    "reload": "glm5_hal.registry",
    "BackendInfo": "glm5_hal.registry",
    "Explanation": "glm5_hal.opdef",
    "FallbackWarning": "glm5_hal.registry",
    "HalError": "glm5_hal.errors",
    "InvalidInputError": "glm5_hal.errors",
    "UnsupportedOpError": "glm5_hal.errors",
    "BackendUnavailableError": "glm5_hal.errors",
    "PluginError": "glm5_hal.errors",
}
_SUBMODULES = ("backends", "ops", "presets", "vendors", "reference", "kv", "dist", "conformance", "bench", "models", "registry",
               "plugins", "errors", "checks", "backend", "opdef", "contract")

__all__ = sorted(_EXPORTS) + ["backends", "ops", "reference", "kv", "dist", "conformance",
                              "presets", "__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is not None:
        if module in ("glm5_hal.registry", "glm5_hal.opdef"):
            importlib.import_module("glm5_hal.ops")  # the registry's queries need every op defined
        value = getattr(importlib.import_module(module), name)
    elif name in _SUBMODULES:
        if name in ("opdef", "registry"):
            importlib.import_module("glm5_hal.ops")  # their tables are only complete with every op
        value = importlib.import_module(f"glm5_hal.{name}")
    else:
        raise AttributeError(f"module 'glm5_hal' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
