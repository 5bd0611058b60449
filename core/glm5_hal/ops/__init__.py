"""The public, backend-neutral ops (`glm5_hal.ops.<name>`), one module per family.

Each function validates its inputs (InvalidInputError), dispatches to the best available
backend implementation (reference last) and is also `torch.ops.glm5_hal.<name>`.
"""
from .common import rms_norm

__all__ = ["rms_norm"]
