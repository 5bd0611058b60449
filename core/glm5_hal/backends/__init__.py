"""The backends: the package the backend folders are installed into (`backends/<name>/` in
the source tree is `glm5_hal.backends.<name>`: cpu, cuda, ascend, ...), and, called,
`glm5_hal.backends()`: one record per registered backend (available or not) and per
quarantined plugin (glm5_hal.registry.BackendInfo).

DESIGN.md promises both spellings, and they name one object. They cannot name two:
`import glm5_hal.backends.cpu` binds the package to the attribute `backends` of `glm5_hal`,
whatever was there before, so a function of that name would be replaced by the package in a
process that imported any backend, and `hal.backends()` would depend on import order. So the
package is the one thing, and calling it is part of its documented interface: this module's
class is `BackendsPackage`, a module type whose `__call__` lists the records (the registry's
`backends()` computes them). `hal.backends`, `glm5_hal.backends` and
`sys.modules["glm5_hal.backends"]` are the same module whichever is imported first
(tests/test_structure.py pins both orders in fresh interpreters).
"""
import sys
import types


class BackendsPackage(types.ModuleType):
    """The module type of `glm5_hal.backends`: a package that is also called."""

    def __call__(self) -> list:
        """One record per registered backend (available or not) and per quarantined plugin:
        name, device_type, priority, available, reason, versions, ops, error, plugin,
        capabilities (glm5_hal.registry.BackendInfo)."""
        from glm5_hal.registry import backends   # the registry loads the plugins on first use
        return backends()


sys.modules[__name__].__class__ = BackendsPackage
