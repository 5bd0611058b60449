"""The pytest entry: `pytest --pyargs glm5_hal.conformance --glm5-backend B -n auto`.

Registered through the `pytest11` entry point (pyproject.toml), not as a conftest.py:
with `--pyargs`, pytest only loads conftest files found from path arguments (and only
below its rootdir), so a conftest inside an installed package is never loaded early enough
to define `--glm5-backend`. An entry-point plugin is loaded by every pytest session of the
environment, which is why this module imports nothing heavy at import time, and why the
suite is collected only when it is asked for: when the `glm5_hal.conformance` package (or
its `suite.py`) is named on the command line. A repository run over `tests/` -- or even
over the whole checkout -- therefore never collects it by accident.

One test per (backend, case): pass -> pass; fail/error -> failure with the record's
details; skip -> skip with the reason; fallback -> skip "fallback: <reason>" (not a pass).
Collection is deterministic, so pytest-xdist workers agree on the items.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

SUITE_DIR = Path(__file__).resolve().parent
SUITE_FILE = SUITE_DIR / "suite.py"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("glm5_hal", "glm5_hal conformance (pytest --pyargs glm5_hal.conformance)")
    group.addoption("--glm5-backend", action="append", default=[], metavar="B",
                    help="backend to judge (repeatable; default: every available one except reference)")
    group.addoption("--glm5-op", action="append", default=[], metavar="O",
                    help="op to test (repeatable; default: every op with cases)")
    group.addoption("--glm5-preset", action="append", default=[], metavar="P", choices=("tiny", "glm5"),
                    help="case preset (repeatable; default: tiny and glm5)")
    group.addoption("--glm5-ref", default="cpu", choices=("cpu", "cuda"),
                    help="reference: float64 on the CPU (default) or float64 on an NVIDIA GPU")


def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    if file_path.name == SUITE_FILE.name and file_path.resolve() == SUITE_FILE \
            and _requested(parent.config):
        return SuiteFile.from_parent(parent, path=file_path)
    return None


def _requested(config: pytest.Config) -> bool:
    """Whether a command-line argument names the conformance package or its suite file."""
    for arg in config.args:
        path = arg.split("::")[0]
        target = None
        if config.option.pyargs:
            try:
                spec = importlib.util.find_spec(path)
            except (ImportError, ValueError):
                spec = None
            if spec is not None and spec.origin:
                origin = Path(spec.origin)
                target = origin.parent if origin.name == "__init__.py" else origin
        if target is None:
            target = config.invocation_params.dir / path
        if target.resolve() in (SUITE_DIR, SUITE_FILE):
            return True
    return False


class SuiteFile(pytest.File):
    def collect(self):
        from ..errors import HalError
        from . import runner, suite
        opt = self.config.option
        try:
            runner.check_reference_mode(opt.glm5_ref)
            backends = suite.resolve_backends(opt.glm5_backend)
            ops = suite.resolve_ops(opt.glm5_op)
            presets = suite.resolve_presets(opt.glm5_preset)
        except HalError as exc:
            raise self.CollectError(str(exc)) from None
        worker = os.environ.get("PYTEST_XDIST_WORKER", "")
        if worker.startswith("gw") and worker[2:].isdigit():
            runner.pin_worker_device(int(worker[2:]))
        for item in suite.plan(backends, ops, presets):
            yield CaseItem.from_parent(self, name=item.test_name, work=item)


class ConformanceFailure(Exception):
    """A fail or error record; its message is the report."""


class CaseItem(pytest.Item):
    def __init__(self, *, work, **kwargs):
        super().__init__(**kwargs)
        self.work = work

    def runtest(self) -> None:
        from .record import FALLBACK, PASS, SKIP
        from .runner import run_item
        record = run_item(self.work, self.config.option.glm5_ref)
        for key in ("status", "impl", "device", "max_abs", "max_rel", "margin", "swaps"):
            value = getattr(record, key)
            if value not in (None, ""):
                self.user_properties.append((key, value))
        if record.status == PASS:
            return
        if record.status == SKIP:
            pytest.skip(record.reason)
        if record.status == FALLBACK:
            pytest.skip(f"fallback: {record.reason}")
        raise ConformanceFailure(_describe(record))

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ConformanceFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, self.name


def _describe(record) -> str:
    d = record.to_dict()
    keep = ("impl", "device", "max_abs", "max_rel", "atol", "rtol", "margin", "swaps", "worst")
    facts = {k: d[k] for k in keep if d[k] not in (None, "")}
    return f"{record.status.upper()} {record.backend} {record.case}\n{record.reason}\n{json.dumps(facts, indent=1)}"
