"""The shape of the code base: no import cycle in the core package (imports inside
functions count too: they only defer a cycle), and every backend implementation takes
exactly its op's parameters."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import glm5_hal as hal
from glm5_hal import opdef

from conftest import REPO

CORE = REPO / "core" / "glm5_hal"


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = CORE) -> dict[str, set[str]]:
    """module -> the glm5_hal modules it imports (anywhere in its body). Importing a.b.c
    also runs a.b's __init__; the root package's lazy attributes are not imports."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                # a.b.c imports a.b first (its parent packages, except the lazy root)
                parts = target.split(".")
                for i in range(2, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    if dep != name and dep in modules and not name.startswith(dep + "."):
                        graph[name].add(dep)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_core_package_has_no_import_cycle():
    graph = import_graph()
    assert "glm5_hal.opdef" in graph["glm5_hal.registry"]      # the analysis sees imports
    assert cycles(graph) == []


def test_the_cycle_check_can_fail(tmp_path):
    pkg = tmp_path / "glm5_hal"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\n")
    assert cycles(import_graph(pkg)) == [["glm5_hal.a", "glm5_hal.b", "glm5_hal.sub.c"]]


def test_every_registered_implementation_takes_its_ops_parameters():
    for row in hal.backends():
        if row.error:
            continue
        for name, impl in hal.get_backend(row.name).impls.items():
            assert opdef.signature_mismatch(opdef.lookup(name), impl.fn) is None, (row.name, name)


def test_an_implementation_with_other_parameters_quarantines_its_plugin(hal_state):
    import types

    class Odd(hal.Backend):
        name, device_type = "oddsig", "cpu"
    odd = Odd()
    odd.impl("rms_norm")(lambda x, w, eps: x)
    plugin = types.ModuleType("oddsig")
    plugin.glm5_hal_register_backends = hal.hookimpl(lambda register: register(odd))
    hal_state(plugin, "oddsig")
    row = next(r for r in hal.backends() if r.name == "oddsig")
    assert row.error and "plugin 'oddsig'" in row.error
    assert "the implementation of rms_norm takes (x, w, eps), the op takes (x, weight, eps)" in row.error


@pytest.mark.parametrize("fn,ok", [
    (lambda x, weight, eps: x, True),
    (lambda x, weight, eps=1e-5: x, True),          # defaults are ignored: dispatch passes everything
    (lambda *args: args[0], True),                   # a forwarder
    (lambda x, weight: x, False),
    (lambda x, eps, weight: x, False),
    (lambda x, weight, eps, *, extra: x, False),     # a required keyword dispatch never passes
    (lambda x, weight, eps, block=16: x, True),      # a tuning parameter with a default
])
def test_signature_rule(fn, ok):
    assert (opdef.signature_mismatch(opdef.lookup("rms_norm"), fn) is None) == ok


_BACKENDS_ORDERS = {
    "backend module first": """
import sys
import glm5_hal.backends.cpu as cpu
import glm5_hal as hal
names = {row.name for row in hal.backends()}
""",
    "records first": """
import sys
import glm5_hal as hal
names = {row.name for row in hal.backends()}
import glm5_hal.backends.cpu as cpu
names &= {row.name for row in hal.backends()}
""",
}


@pytest.mark.parametrize("order", list(_BACKENDS_ORDERS))
def test_backends_is_one_object_called_and_imported_from_in_either_order(order):
    """`hal.backends()` (the records) and `glm5_hal.backends.<name>` (the backend folders) name
    one module, whichever a fresh interpreter touches first (glm5_hal/backends/__init__.py)."""
    import subprocess
    import sys
    check = _BACKENDS_ORDERS[order] + """
package = sys.modules["glm5_hal.backends"]
assert hal.backends is package and type(package).__name__ == "BackendsPackage", hal.backends
assert cpu is sys.modules["glm5_hal.backends.cpu"] and package.cpu is cpu
assert {"reference", "cpu"} <= names, names
from glm5_hal import backends
assert backends is package and callable(backends)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
