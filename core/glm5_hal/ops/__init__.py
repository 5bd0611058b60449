"""The public, backend-neutral ops (`glm5_hal.ops.<name>`), one module per family:
common (elementwise/small), quant, dsa (indexer + sparse MLA), moe, kv (paged cache).

Each function validates its inputs (InvalidInputError), dispatches to the best available
backend implementation (reference last) and is also `torch.ops.glm5_hal.<name>`. Each family
module defines its ops with `glm5_hal.opdef.define` from the reference implementation, the
input contract, the fake and the docstring; nothing else lists them.
"""
from .. import registry as _registry  # noqa: F401  (installs the dispatcher the ops call)
from . import common, dsa, kv, moe, quant
from .common import *  # noqa: F401,F403
from .dsa import *  # noqa: F401,F403
from .kv import *  # noqa: F401,F403
from .moe import *  # noqa: F401,F403
from .quant import *  # noqa: F401,F403

__all__ = [*common.__all__, *quant.__all__, *dsa.__all__, *moe.__all__, *kv.__all__]
