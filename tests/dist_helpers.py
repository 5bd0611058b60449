"""Runs a function on every rank of a real multi-process world (one subprocess per rank).

    results = run_world(my_rank_fn, world_size=3)        # my_rank_fn(rank, world_size, port, *args)

The parent hosts the rendezvous store (a TCPStore bound to a free port on 127.0.0.1 chosen
by the OS, so concurrent tests under pytest-xdist never collide); ranks connect to it with
`init_world`. Each rank's return value comes back through a pickle file. A rank that raises
fails the test with its traceback; the other ranks are then killed rather than left to
wait for their collective timeout. A world that outlives `timeout` is killed and reported.
"""
from __future__ import annotations

import datetime
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch.distributed as dist

TESTS = Path(__file__).resolve().parent
_CHILD = """
import importlib, os, pickle, sys
sys.path.insert(0, {tests!r})
module, _, name = {target!r}.partition(":")
fn = getattr(importlib.import_module(module), name)
result = fn({rank}, {world}, {port}, *pickle.loads(bytes.fromhex({args!r})))
with open({out!r}, "wb") as f:
    pickle.dump(result, f)
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)  # a process group that timed out can block interpreter shutdown
"""


def run_world(fn: Callable | str, world_size: int, *args: Any, ranks: Sequence[int] | None = None,
              timeout: float = 90, env: dict[str, str] | None = None) -> list[Any]:
    """Starts `ranks` (default: all) of a `world_size` world, each calling
    `fn(rank, world_size, port, *args)`, and returns their results in rank order."""
    target = fn if isinstance(fn, str) else f"{fn.__module__}:{fn.__qualname__}"
    ranks = list(range(world_size)) if ranks is None else list(ranks)
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    child_env = dict(os.environ)
    child_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    if sys.platform.startswith("linux"):
        child_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    child_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="glm5_dist_") as tmp:
        procs, logs, outs = [], [], []
        for rank in ranks:
            out = os.path.join(tmp, f"rank{rank}.pkl")
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
            code = _CHILD.format(tests=str(TESTS), target=target, rank=rank, world=world_size,
                                 port=store.port, args=pickle.dumps(args).hex(), out=out)
            procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=log,
                                          stderr=subprocess.STDOUT, env=child_env, cwd=tmp))
            logs.append(log)
            outs.append(out)
        try:
            failure = _wait(procs, ranks, time.monotonic() + timeout, timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if failure:
            report = [failure]
            for rank, p, log in zip(ranks, procs, logs):
                log.seek(0)
                text = log.read()
                if p.returncode != 0 or "Traceback" in text:
                    report.append(f"--- rank {rank} (exit {p.returncode}) ---\n{text[-4000:]}")
            for log in logs:
                log.close()
            raise AssertionError("\n".join(report))
        for log in logs:
            log.close()
        results = []
        for out in outs:
            with open(out, "rb") as f:
                results.append(pickle.load(f))
        return results


def _wait(procs: list[subprocess.Popen], ranks: list[int], deadline: float, timeout: float) -> str:
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in zip(ranks, codes) if c not in (None, 0)]
        if failed:
            time.sleep(0.5)  # let a simultaneous failure on another rank finish its report
            return f"rank(s) {failed} failed"
        if all(c == 0 for c in codes):
            return ""
        if time.monotonic() > deadline:
            running = [r for r, c in zip(ranks, codes) if c is None]
            return f"world of {len(procs)} rank(s) did not finish within {timeout:g} s; still running: {running}"
        time.sleep(0.02)


def init_world(rank: int, world_size: int, port: int, *, timeout: float = 30, backend: str = "auto",
               init_method: str | None = None) -> str:
    """Joins the world through glm5_hal.dist.init_process_group: via the parent's store, or
    through `init_method` (e.g. "file://...") when given. Returns the backend name."""
    import glm5_hal as hal
    if init_method is not None:
        return hal.dist.init_process_group(backend, init_method=init_method, world_size=world_size,
                                           rank=rank, timeout=timeout)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout))
    return hal.dist.init_process_group(backend, store=store, world_size=world_size, rank=rank,
                                       timeout=timeout)
