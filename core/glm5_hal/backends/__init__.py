"""Namespace the backend folders (`backends/<name>/` in the source tree) are installed into
(`glm5_hal.backends.cpu`, `glm5_hal.backends.ascend`, ...) -- and, since DESIGN.md also
promises `glm5_hal.backends()`, a callable module: calling it lists the backends.

The two names necessarily coincide: importing `glm5_hal.backends.cpu` binds the package
`glm5_hal.backends` as an attribute of `glm5_hal`, so a plain function of that name could
not survive. Making the package callable keeps both spellings working.
"""
import sys
import types


class _CallableModule(types.ModuleType):
    def __call__(self):
        """One record per registered backend (available or not) and per quarantined plugin;
        see glm5_hal.registry.backends."""
        from glm5_hal.registry import backends
        return backends()


sys.modules[__name__].__class__ = _CallableModule
