"""The exception hierarchy of glm5_hal.

Every message names the op (where one is involved), the argument, the expected and the
actual value, and the backend where a backend is involved, so that a user reading only
the message knows what to fix.
"""
from __future__ import annotations


class HalError(Exception):
    """Base class of every error raised by glm5_hal."""


class InvalidInputError(HalError, ValueError):
    """An op was called with an argument that violates its contract (shape, dtype,
    device, layout or value range). Raised before anything is written."""

    def __init__(self, op: str, arg: str, expected: object, actual: object,
                 backend: str | None = None):
        self.op, self.arg, self.expected, self.actual, self.backend = (
            op, arg, expected, actual, backend)
        where = f" (backend {backend!r})" if backend else ""
        super().__init__(f"{op}: argument '{arg}': expected {expected}, got {actual}{where}")

    def __reduce__(self):
        return (type(self), (self.op, self.arg, self.expected, self.actual, self.backend))


class UnsupportedOpError(HalError):
    """No acceptable implementation exists for a call (or, under GLM5_HAL_STRICT=1, only
    the reference would run while a device backend is available)."""


class BackendUnavailableError(HalError):
    """A backend was asked for by name but is not registered or not available."""


class PluginError(HalError):
    """A plugin failed to load or register, or the plugin configuration (environment
    variables, duplicate names) is wrong."""
