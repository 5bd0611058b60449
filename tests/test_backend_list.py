"""The backend list is written once: pyproject.toml's `[project.entry-points."glm5_hal.backends"]`.
Everything else that lists backends -- the wheel's package map, CMake's kernel builds,
glm5_hal/vendors.py, the README table, the backend folders -- is checked against it here, and
every vendor adapter table against the op definitions."""
from __future__ import annotations

import importlib
import inspect
import re
import tomllib

import pytest

import glm5_hal as hal
from glm5_hal.vendor_backend import VendorBackend
from glm5_hal.vendors import VENDORS

from conftest import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
ENTRY_POINTS: dict[str, str] = PYPROJECT["project"]["entry-points"]["glm5_hal.backends"]
WHEEL_PACKAGES: dict[str, str] = PYPROJECT["tool"]["scikit-build"]["wheel"]["packages"]
#: backends/<folder>/ holding a Python package (a backend, or code backends share)
BACKEND_FOLDERS = sorted(p.parent.name for p in (REPO / "backends").glob("*/__init__.py"))


def registered(module_name: str) -> list:
    """The backends an entry-point module registers through its hook."""
    backends = []
    importlib.import_module(module_name).glm5_hal_register_backends(register=backends.append)
    return backends


BACKENDS = {name: registered(module) for name, module in ENTRY_POINTS.items()}
VENDOR_BACKENDS = sorted(name for name, found in BACKENDS.items() if isinstance(found[0], VendorBackend))


def test_every_entry_point_registers_the_backend_it_is_named_after():
    assert {name: [b.name for b in found] for name, found in BACKENDS.items()} == {
        name: [name] for name in ENTRY_POINTS}
    assert {"reference", "cpu"} < set(ENTRY_POINTS) and VENDOR_BACKENDS


def test_the_wheel_packages_every_backend_folder_and_nothing_else():
    packaged = {key: value for key, value in WHEEL_PACKAGES.items() if value.startswith("backends/")}
    assert packaged == {f"glm5_hal/backends/{folder}": f"backends/{folder}" for folder in BACKEND_FOLDERS}
    for name, module in ENTRY_POINTS.items():
        folder = module.removeprefix("glm5_hal.backends.")
        assert folder == module or folder in BACKEND_FOLDERS or (REPO / "core/glm5_hal/backends" / folder).is_dir(), \
            (name, module)


def test_every_vendor_backend_is_a_vendor_of_vendors_py_with_its_own_folder():
    for name in VENDOR_BACKENDS:
        backend = BACKENDS[name][0]
        assert backend.vendor_name == name and VENDORS[name].backend == name
        assert ENTRY_POINTS[name] == f"glm5_hal.backends.{name}" and name in BACKEND_FOLDERS
        assert (REPO / "backends" / name / "README.md").is_file()
    # every backend folder (shared code lives in _-prefixed ones) is registered under its name
    assert all(ENTRY_POINTS.get(f) == f"glm5_hal.backends.{f}" for f in BACKEND_FOLDERS if not f.startswith("_"))


def test_cmake_builds_the_kernels_of_every_folder_that_has_them():
    calls = re.findall(r"^glm5_hal_kernels\(\"[^\"]+\" OPTION (\w+) DIR (\S+)", (REPO / "CMakeLists.txt").read_text(),
                       re.M)
    folders = {f"backends/{f}/csrc" for f in BACKEND_FOLDERS
               if (REPO / "backends" / f / "csrc/CMakeLists.txt").exists()}
    assert {folder for _, folder in calls} == folders
    for option, folder in calls:
        name = folder.split("/")[1]
        if name in VENDOR_BACKENDS:
            assert option == f"GLM5_HAL_WITH_{name.upper()}"


def test_the_readme_table_lists_every_backend():
    readme = (REPO / "README.md").read_text()
    table = readme.split("## Backends", 1)[1].split("\n\n", 2)[1]
    assert re.findall(r"^\| `(\w+)` \|", table, re.M) == list(ENTRY_POINTS)


@pytest.mark.parametrize("vendor", VENDOR_BACKENDS)
def test_every_adapter_takes_the_backend_then_exactly_the_ops_parameters(vendor):
    """An adapter is `fn(backend, <glm5_hal.reference.<op>'s parameters, same names, same
    order>)`, its supports check the same; bound to a backend, both take the op's parameters."""
    backend = BACKENDS[vendor][0]
    adapters = importlib.import_module(f"glm5_hal.backends.{vendor}.ops").ADAPTERS
    assert sorted(a.op for a in adapters) == sorted(backend.impls)
    for adapter in adapters:
        params = list(inspect.signature(getattr(hal.reference, adapter.op)).parameters)
        assert list(inspect.signature(adapter.fn).parameters) == ["backend", *params], adapter.op
        impl = backend.impls[adapter.op]
        assert list(inspect.signature(impl.fn).parameters) == params, adapter.op
        if adapter.supports is not None:
            assert list(inspect.signature(adapter.supports).parameters) == ["backend", *params], adapter.op
            assert list(inspect.signature(impl.supports).parameters) == params, adapter.op
