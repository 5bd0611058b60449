"""The reference implementations: the exact meaning of every op, in plain torch.

`glm5_hal.reference.<op>` is the plain function (no validation, no dispatch); it runs on
any torch device and is what every backend is judged against. Its annotated signature is
the op's (glm5_hal.opdef infers the torch schema from it). The `reference` backend
(glm5_hal.backends.reference, registered through the `glm5_hal.backends` entry point like
any other) serves these functions as the last-resort implementation of every op. One module
per op family.
"""
from . import common, dsa, kv, moe, quant
from .common import *  # noqa: F401,F403
from .dsa import *  # noqa: F401,F403
from .kv import *  # noqa: F401,F403
from .moe import *  # noqa: F401,F403
from .quant import *  # noqa: F401,F403

__all__ = [*common.__all__, *quant.__all__, *dsa.__all__, *moe.__all__, *kv.__all__]
