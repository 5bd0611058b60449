"""The reference implementations: the exact meaning of every op, in plain torch.

`glm5_hal.reference.<op>` is the plain function (no validation, no dispatch); it runs on
any torch device and is what every backend is judged against. The `reference` backend
(registered through the `glm5_hal.backends` entry point like any other) exposes these
functions as the last-resort implementation of every op.
"""
from .common import rms_norm

__all__ = ["rms_norm"]
