"""Shared test helpers. Tests are parallel-safe under pytest-xdist: global HAL state
(run-time plugins, environment settings) is restored after each test that touches it, and
entry-point discovery is exercised in subprocesses with their own sys.path."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import glm5_hal as hal

REPO = Path(__file__).resolve().parents[1]

# Under pytest-xdist every worker would otherwise start one torch/OpenMP thread per core:
# N workers x N threads oversubscribe the machine and make kernels crawl (a tiny decode step
# went from 6 ms to 240 ms). Give each worker its share of the cores.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture
def one_thread():
    """torch at one thread for the test: small model-level matrices gain nothing from intra-op
    threads, and threads per pytest-xdist worker oversubscribe a small machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def hal_state(monkeypatch):
    """Isolates HAL plugin state: run-time plugins loaded by the test are unloaded and
    GLM5_HAL_* variables restored afterwards. Yields a `load(plugin, name)` function."""
    for var in ("GLM5_HAL_PLUGINS", "GLM5_HAL_DISABLE", "GLM5_HAL_STRICT"):
        monkeypatch.delenv(var, raising=False)
    loaded: list[str] = []

    def load(plugin, name):
        hal.load_plugin(plugin, name)
        loaded.append(name)

    hal.reload()
    yield load
    for name in loaded:
        hal.unload_plugin(name)
    monkeypatch.undo()
    hal.reload()


def write_dist(root: Path, dist: str, module: str, source: str, entry_points: dict[str, str]) -> Path:
    """Writes `module.py` plus a `.dist-info` folder declaring `glm5_hal.backends` entry
    points into `root` -- what `pip install` leaves behind, minus the RECORD."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    eps = "\n".join(f"{k} = {v}" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[glm5_hal.backends]\n{eps}\n")
    return root


def run_python(code: str, *, path: list[Path] = (), env: dict[str, str] | None = None,
               timeout: float = 180) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter with `path` prepended to PYTHONPATH."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GLM5_HAL_")}
    full_env.update(env or {})
    pythonpath = [str(p) for p in path] + ([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else [])
    if pythonpath:
        full_env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=full_env, timeout=timeout)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_invalid(fn, args, op: str, arg: str, expected: str) -> None:
    """fn(*args) raises InvalidInputError (a ValueError) for op `op` naming argument `arg`, and
    its message contains `expected`."""
    with pytest.raises(hal.InvalidInputError) as info:
        fn(*args)
    err = info.value
    assert isinstance(err, ValueError) and err.op == op and err.arg == arg, str(err)
    assert expected in str(err), str(err)
