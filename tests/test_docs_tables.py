"""Tables in the docs that list ops are checked against the op table and the backends'
declared implementations, so they cannot drift."""
from __future__ import annotations

import re

import pytest

import glm5_hal as hal
import glm5_hal.ops  # noqa: F401  (defines every op)
from glm5_hal.opdef import OPS

from conftest import REPO

_CELL_NAMES = re.compile(r"`([a-z0-9_]+)`")


def table_ops(text: str) -> set[str]:
    """The op names in the first cell of every table row of `text`."""
    names = set()
    for line in text.splitlines():
        if line.startswith("|"):
            first = line.split("|")[1]
            names.update(n for n in _CELL_NAMES.findall(first) if n in OPS)
    return names


def test_the_ops_index_lists_every_op():
    assert table_ops((REPO / "docs" / "ops.md").read_text()) == set(OPS)


BACKENDS = sorted(p.name for p in (REPO / "backends").iterdir()
                  if (p / "README.md").exists() and not p.name.startswith("_"))


@pytest.mark.parametrize("name", BACKENDS)
def test_a_backend_readme_maps_exactly_the_ops_it_implements(name):
    implemented = set(hal.get_backend(name).impls)
    listed = table_ops((REPO / "backends" / name / "README.md").read_text())
    assert listed == implemented, (f"README lists {sorted(listed - implemented)} it does not implement, "
                                   f"misses {sorted(implemented - listed)}")
