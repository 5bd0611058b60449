"""The `reference` backend: the plain-torch implementations in glm5_hal.reference, the
last-resort implementation of every op on every device, registered through the same
entry-point group as any third-party plugin (and loaded first: it defines the op table the
other plugins are checked against)."""
from __future__ import annotations

import torch

import glm5_hal.ops  # noqa: F401  (defines every op)
from glm5_hal import Availability, Backend, Capabilities, hookimpl
from glm5_hal.backend import ANY_DEVICE, REFERENCE
from glm5_hal.opdef import OPS


class ReferenceBackend(Backend):
    name = REFERENCE
    device_type = ANY_DEVICE
    priority = -(2 ** 31)  # always last; dispatch also places it last explicitly

    def __init__(self) -> None:
        super().__init__()
        for name, op in OPS.items():
            self.impl(name)(op.reference)

    def probe(self) -> Availability:
        return Availability(True, "plain torch, any device")

    def capabilities(self) -> Capabilities:
        # FP8 as a storage dtype (KV caches): plain torch copies and converts it on any device.
        # Dispatch never checks the reference's capabilities; the conformance runner does.
        return Capabilities(dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16,
                                              torch.float8_e4m3fn}))

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__}


@hookimpl
def glm5_hal_register_backends(register):
    register(ReferenceBackend())
