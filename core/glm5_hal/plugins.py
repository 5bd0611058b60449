"""Plugin discovery and registration (pluggy).

There is one way in: a plugin is a module (or object) with a `glm5_hal_register_backends`
hookimpl. Plugins are found through the `glm5_hal.backends` entry-point group -- the
built-in `reference` and `cpu` backends included -- or handed over at run time with
`load_plugin()` (tests, notebooks). Either way the same code registers them.

A plugin that fails to import, fails pluggy's validation, or raises in its hook is
quarantined: it registers nothing, the HAL keeps working, and `glm5_hal.backends()`
lists it with the exception text. `GLM5_HAL_STRICT=1` turns quarantine into a PluginError.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import traceback
from typing import Any, Callable

import pluggy

from .backend import REFERENCE, Backend
from .errors import PluginError

PROJECT = "glm5_hal"
ENTRY_POINT_GROUP = "glm5_hal.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class HookSpecs:
    """The hooks a glm5_hal plugin may implement."""

    @hookspec
    def glm5_hal_register_backends(self, register: Callable[[Backend], None]) -> None:
        """Register this plugin's backends.

        Call ``register(backend)`` once for every `glm5_hal.Backend` instance the plugin
        provides. Do not probe hardware here (that is `Backend.probe()`'s job, done lazily);
        keep this hook cheap and free of side effects. If it raises, none of the plugin's
        backends are registered and the plugin is reported as quarantined.
        """


@dataclasses.dataclass(frozen=True)
class Settings:
    """The environment's plugin configuration, read once per (re)load."""
    allow: frozenset[str] | None  # GLM5_HAL_PLUGINS; None: everything
    deny: frozenset[str]          # GLM5_HAL_DISABLE
    strict: bool                  # GLM5_HAL_STRICT=1

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        allow = _names(env.get("GLM5_HAL_PLUGINS", ""))
        deny = _names(env.get("GLM5_HAL_DISABLE", "")) or frozenset()
        strict_text = env.get("GLM5_HAL_STRICT", "").strip().lower()
        if strict_text not in ("", "0", "1", "true", "false", "yes", "no"):
            raise PluginError(f"GLM5_HAL_STRICT: expected 0 or 1, got {strict_text!r}")
        if REFERENCE in deny:
            raise PluginError("GLM5_HAL_DISABLE: 'reference' cannot be disabled: it is the "
                              "last-resort implementation of every op")
        return cls(allow, deny, strict_text in ("1", "true", "yes"))

    def admits(self, name: str) -> bool:
        if name == REFERENCE:
            return True
        return name not in self.deny and (self.allow is None or name in self.allow)


def _names(text: str) -> frozenset[str] | None:
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    return names or None


@dataclasses.dataclass
class PluginOutcome:
    """What loading one plugin produced."""
    name: str
    source: str
    backends: list[Backend]
    error: str | None = None


class PluginHost:
    """Owns the pluggy PluginManager and turns plugins into registered backends.

    validate(backend): the registry's checks of a backend's implementations (known ops,
    the ops' signatures); raises PluginError, which quarantines the plugin."""

    def __init__(self, validate: Callable[[Backend], None]):
        self._validate = validate
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(HookSpecs)

    def entry_points(self) -> list[importlib.metadata.EntryPoint]:
        seen: dict[str, importlib.metadata.EntryPoint] = {}
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            seen.setdefault(ep.name, ep)  # first on sys.path wins, like imports do
        return sorted(seen.values(), key=lambda ep: ep.name)

    def load_entry_point(self, ep: importlib.metadata.EntryPoint,
                         taken: set[str]) -> PluginOutcome:
        source = f"entry point {ep.name} = {ep.value}"
        try:
            plugin = ep.load()
        except BaseException as exc:  # an import may even sys.exit(); never let it through
            if isinstance(exc, KeyboardInterrupt):
                raise
            return PluginOutcome(ep.name, source, [], _describe(exc, "import failed"))
        return self.load(plugin, ep.name, source, taken)

    def load(self, plugin: Any, name: str, source: str, taken: set[str]) -> PluginOutcome:
        """Register `plugin` with pluggy and collect its backends; never raises for a
        faulty plugin (the outcome carries the error instead)."""
        if self.pm.has_plugin(name):
            return PluginOutcome(name, source, [], f"a plugin named {name!r} is already loaded")
        try:
            self.pm.register(plugin, name=name)
            self.pm.check_pending()
        except Exception as exc:
            if self.pm.has_plugin(name):
                self.pm.unregister(name=name)
            return PluginOutcome(name, source, [], _describe(exc, "pluggy validation failed"))

        collected: list[Backend] = []
        names_here: set[str] = set()

        def register(backend: Backend) -> None:
            _check_backend(backend, name, taken | names_here)
            try:
                self._validate(backend)
            except PluginError as exc:
                raise PluginError(f"plugin {name!r}: {exc}") from None
            names_here.add(backend.name)
            collected.append(backend)

        others = [p for p in self.pm.get_plugins() if p is not plugin]
        caller = self.pm.subset_hook_caller("glm5_hal_register_backends", remove_plugins=others)
        try:
            caller(register=register)
        except Exception as exc:
            self.pm.unregister(name=name)
            return PluginOutcome(name, source, [], _describe(exc, "glm5_hal_register_backends raised"))
        return PluginOutcome(name, source, collected)


def _check_backend(backend: Any, plugin: str, taken: set[str]) -> None:
    where = f"plugin {plugin!r}"
    if not isinstance(backend, Backend):
        raise PluginError(f"{where}: register() expects a glm5_hal.Backend instance, "
                          f"got {type(backend).__name__}")
    if not isinstance(backend.name, str) or not backend.name.isidentifier():
        raise PluginError(f"{where}: backend name must be an identifier string, got {backend.name!r}")
    if not isinstance(backend.device_type, str) or not backend.device_type:
        raise PluginError(f"{where}: backend {backend.name!r}: device_type must be a non-empty "
                          f"string, got {backend.device_type!r}")
    if not isinstance(backend.priority, int) or isinstance(backend.priority, bool):
        raise PluginError(f"{where}: backend {backend.name!r}: priority must be an int, "
                          f"got {backend.priority!r}")
    try:
        backend.impls
    except AttributeError:
        raise PluginError(f"{where}: backend {backend.name!r}: Backend.__init__ was not called") from None
    if backend.name in taken:
        raise PluginError(f"{where}: backend name {backend.name!r} is already registered")


def _describe(exc: BaseException, what: str) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = f" at {last[0].filename}:{last[0].lineno}" if last else ""
    return f"{what}: {type(exc).__name__}: {exc}{at}"
