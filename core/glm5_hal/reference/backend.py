"""The `reference` backend: plain-torch implementations for every op on every device,
registered through the same entry-point group as any third-party plugin."""
from __future__ import annotations

from ..backend import ANY_DEVICE, Availability, Backend, Capabilities
from ..plugins import REFERENCE, hookimpl


class ReferenceBackend(Backend):
    name = REFERENCE
    device_type = ANY_DEVICE
    priority = -(2 ** 31)  # always last; dispatch also places it last explicitly

    def __init__(self) -> None:
        super().__init__()
        from ..registry import REGISTRY, _ensure_ops_imported
        _ensure_ops_imported()
        for name, op in REGISTRY.ops.items():
            self.impl(name)(op.opdef.reference)

    def probe(self) -> Availability:
        return Availability(True, "plain torch, any device")

    def capabilities(self) -> Capabilities:
        # FP8 as a storage dtype (KV caches): plain torch copies and converts it on any device.
        # Dispatch never checks the reference's capabilities; the conformance runner does.
        import torch
        return Capabilities(dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16,
                                              torch.float8_e4m3fn}))

    def versions(self) -> dict[str, str]:
        import torch
        return {"torch": torch.__version__}


@hookimpl
def glm5_hal_register_backends(register):
    register(ReferenceBackend())
