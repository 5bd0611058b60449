"""An out-of-tree glm5_hal plugin, written only from the plugin contract in DESIGN.md:
one backend, one op (rms_norm) for float32 on the CPU."""
import torch

import glm5_hal as hal


class ToyBackend(hal.Backend):
    name = "toyvendor"
    device_type = "cpu"
    priority = 50

    def probe(self) -> hal.Availability:
        return hal.Availability(True, "always available")


toy = ToyBackend()
calls = []  # lets a test see that this implementation really ran


@toy.impl("rms_norm", dtypes=(torch.float32,), supports=None)
def rms_norm(x, weight, eps):
    calls.append(tuple(x.shape))
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@hal.hookimpl
def glm5_hal_register_backends(register):
    register(toy)
