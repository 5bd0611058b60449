"""Collective bandwidth through glm5_hal.dist, reported the way nccl-tests reports it.

For each collective and message size: the median time of one call (the slowest rank's
median), algorithm bandwidth `algbw = size / time` and bus bandwidth `busbw = algbw * factor`
with nccl-tests' factors for n ranks: all_reduce 2(n-1)/n; all_gather, reduce_scatter and
all_to_all (n-1)/n; broadcast 1. `size` is nccl-tests' too: the buffer for all_reduce and
broadcast, the gathered output for all_gather, the input for reduce_scatter, the bytes each
rank sends for all_to_all. Every result is checked against the mathematical definition
(integer-valued float32 data, so sums are exact) and the number of wrong elements, summed
over ranks, is reported: it must be 0. Timed calls use check=False (the payload only); the
cost of check=True is reported separately as "metadata check".

Run it:
    glm5-hal bench --collectives --world-size 4 --sizes 4K,1M,64M     # local ranks, spawned
    torchrun --nproc-per-node 8 -m glm5_hal.bench.collectives --sizes 1M,256M   # real devices
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from ..errors import HalError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
DEFAULT_SIZES = tuple(4096 * 4 ** i for i in range(8))  # 4 KiB .. 64 MiB
_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": 1024 ** 2, "MB": 1024 ** 2,
          "MIB": 1024 ** 2, "G": 1024 ** 3, "GB": 1024 ** 3, "GIB": 1024 ** 3}
_ELEMENT = 4  # float32


def bus_factor(collective: str, n: int) -> float:
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if collective == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {collective!r}; known: {COLLECTIVES}")


def parse_sizes(text: str) -> list[int]:
    """'4K,1M,64MiB,4096' -> bytes (K/M/G are powers of 1024)."""
    sizes = []
    for part in text.split(","):
        part = part.strip().upper()
        if not part:
            continue
        digits = part.rstrip("BKMGI")
        unit = part[len(digits):]
        if not digits.isdigit() or unit not in _UNITS or int(digits) <= 0:
            raise HalError(f"bench --sizes: expected sizes like 4K, 1M, 64MiB or 4096, got {part!r}")
        sizes.append(int(digits) * _UNITS[unit])
    if not sizes:
        raise HalError("bench --sizes: no sizes given")
    return sizes


# -- one rank -------------------------------------------------------------------------------
def _values(start: int, count: int, rank: int, device) -> torch.Tensor:
    """Rank `rank`'s elements [start, start+count): small integers, exact in any sum."""
    i = torch.arange(start, start + count, dtype=torch.int64, device=device)
    return ((i * 7 + rank * 13) % 17 - 8).to(torch.float32)


def _case(collective: str, size: int, n: int, rank: int, device):
    """(bytes as nccl-tests counts them, element count, the call, expected result)."""
    from .. import dist as hd
    if collective in ("all_reduce", "broadcast"):
        count = max(1, size // _ELEMENT)
        if collective == "all_reduce":
            x = _values(0, count, rank, device)
            want = sum(_values(0, count, r, device) for r in range(n))
            return count * _ELEMENT, count, lambda check: hd.all_reduce(x, check=check), want
        x = _values(0, count, 0, device) if rank == 0 else torch.zeros(count, device=device)
        return count * _ELEMENT, count, lambda check: hd.broadcast(x, 0, check=check), _values(0, count, 0, device)
    per = max(1, size // (_ELEMENT * n))
    if collective == "all_gather":
        x = _values(0, per, rank, device)
        want = torch.cat([_values(0, per, r, device) for r in range(n)])
        return per * n * _ELEMENT, per * n, lambda check: hd.all_gather(x, check=check), want
    x = _values(0, per * n, rank, device)
    if collective == "reduce_scatter":
        want = sum(_values(rank * per, per, r, device) for r in range(n))
        return per * n * _ELEMENT, per * n, lambda check: hd.reduce_scatter(x, check=check), want
    if collective == "all_to_all":
        want = torch.cat([_values(rank * per, per, r, device) for r in range(n)])
        return per * n * _ELEMENT, per * n, lambda check: hd.all_to_all(x, check=check), want
    raise ValueError(f"unknown collective {collective!r}; known: {COLLECTIVES}")


def run_rank(sizes=DEFAULT_SIZES, collectives=COLLECTIVES, iters: int = 10, warmup: int = 5,
             device: torch.device | None = None) -> dict:
    """Runs the benchmark on this rank of the initialized default group; every rank returns
    the same report."""
    from .. import dist as hd
    from ..dist import meta
    from ..dist.group import group_info
    device = device or torch.device("cpu")
    n, rank = dist.get_world_size(), dist.get_rank()

    def sync():
        if device.type != "cpu":
            torch.accelerator.synchronize(device)

    rows = []
    for collective in collectives:
        for size in sizes:
            nbytes, count, call, want = _case(collective, size, n, rank, device)
            wrong = torch.tensor([int((call(True) != want).sum())], dtype=torch.int64, device=device)
            dist.all_reduce(wrong)
            for _ in range(warmup):
                call(False)
            sync()
            dist.barrier()
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                call(False)
                sync()
                times.append(time.perf_counter() - start)
            slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            seconds = float(slowest)
            algbw = nbytes / seconds / 1e9
            rows.append({"collective": collective, "size_bytes": nbytes, "count": count,
                         "time_us": seconds * 1e6, "algbw_GBps": algbw,
                         "busbw_GBps": algbw * bus_factor(collective, n),
                         "bus_factor": bus_factor(collective, n), "wrong": int(wrong)})

    info = group_info("bench", None)
    probe = torch.zeros(4, device=device)
    row = meta.row("all_reduce", probe, n)
    times = []
    for _ in range(max(iters, 20)):
        start = time.perf_counter()
        meta.exchange("all_reduce", info, row, probe)
        times.append(time.perf_counter() - start)
    check_us = torch.tensor([statistics.median(times) * 1e6], dtype=torch.float64, device=device)
    dist.all_reduce(check_us, op=dist.ReduceOp.MAX)
    return {"world_size": n, "backend": str(dist.get_backend()), "device": str(device),
            "dtype": "float32", "iters": iters, "metadata_check_us": float(check_us), "rows": rows}


def format_report(report: dict) -> str:
    lines = [f"collectives through glm5_hal.dist: {report['world_size']} ranks, backend "
             f"{report['backend']}, device {report['device']}, {report['dtype']}, median of "
             f"{report['iters']} calls (slowest rank)",
             f"{'collective':<15} {'size':>10} {'count':>11} {'time us':>11} {'algbw GB/s':>11} "
             f"{'busbw GB/s':>11} {'wrong':>6}"]
    for r in report["rows"]:
        lines.append(f"{r['collective']:<15} {_human(r['size_bytes']):>10} {r['count']:>11} "
                     f"{r['time_us']:>11.1f} {r['algbw_GBps']:>11.3f} {r['busbw_GBps']:>11.3f} "
                     f"{r['wrong']:>6}")
    lines.append(f"metadata check (check=True, one all_gather of "
                 f"{report['world_size'] * (15 + 2 * report['world_size'])} int64): "
                 f"{report['metadata_check_us']:.1f} us per call")
    return "\n".join(lines)


def total_wrong(report: dict) -> int:
    return sum(r["wrong"] for r in report["rows"])


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


# -- spawning a local world ---------------------------------------------------------------------
def launch(world_size: int = 2, sizes=DEFAULT_SIZES, collectives=COLLECTIVES, iters: int = 10,
           backend: str = "auto", timeout: float = 600) -> dict:
    """Runs the benchmark on `world_size` local ranks (one process each, rendezvous through
    a store this process hosts on 127.0.0.1) and returns rank 0's report."""
    if world_size < 1:
        raise HalError(f"bench --world-size: expected >= 1, got {world_size}")
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory(prefix="glm5_bench_") as tmp:
        out = os.path.join(tmp, "report.json")
        common = ["--sizes", ",".join(map(str, sizes)), "--collectives", ",".join(collectives),
                  "--iters", str(iters), "--backend", backend, "--store-port", str(store.port),
                  "--world-size", str(world_size), "--out", out]
        logs = [open(os.path.join(tmp, f"rank{r}.log"), "w+") for r in range(world_size)]
        procs = [subprocess.Popen([sys.executable, "-m", "glm5_hal.bench.collectives", "--rank", str(r),
                                   *common], stdout=logs[r], stderr=subprocess.STDOUT, env=env)
                 for r in range(world_size)]
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        tails = []
        for r in failed:
            logs[r].seek(0)
            tails.append(f"rank {r} (exit {procs[r].returncode}): {logs[r].read()[-2000:]}")
        for log in logs:
            log.close()
        if failed:
            raise HalError("collectives benchmark failed: " + "\n".join(tails))
        with open(out) as f:
            return json.load(f)


def _worker_device(backend: str) -> torch.device:
    from ..dist.group import _current_accelerator
    if backend == "gloo":
        return torch.device("cpu")
    accelerator = _current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    index = local_rank % torch.accelerator.device_count()
    torch.accelerator.set_device_index(index)
    return torch.device(accelerator.type, index)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glm5_hal.bench.collectives",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)))
    parser.add_argument("--collectives", default=",".join(COLLECTIVES))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--backend", default="auto", help="process-group backend ('auto': from the device)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (without torchrun)")
    parser.add_argument("--json", metavar="F", help="write the report as JSON to F")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)        # spawned worker
    parser.add_argument("--store-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes, collectives = parse_sizes(args.sizes), [c.strip() for c in args.collectives.split(",") if c.strip()]
    for c in collectives:
        bus_factor(c, 2)  # rejects unknown names before any process starts
    if args.rank is None and "RANK" not in os.environ:
        report = launch(args.world_size, sizes, collectives, args.iters, args.backend)
        _emit(report, args.json)
        return 0 if total_wrong(report) == 0 else 1

    from .. import dist as hd
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.rank is not None:
        store = dist.TCPStore("127.0.0.1", args.store_port, args.world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=120))
        hd.init_process_group(args.backend, store=store, world_size=args.world_size, rank=args.rank,
                              timeout=120)
    else:  # under torchrun: env:// rendezvous
        hd.init_process_group(args.backend)
    report = run_rank(sizes, collectives, args.iters, device=_worker_device(str(dist.get_backend())))
    if dist.get_rank() == 0:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f)
        else:
            _emit(report, args.json)
    hd.destroy_process_group()
    spawned = args.rank is not None  # the launcher reports wrong results from the report
    return 0 if spawned or total_wrong(report) == 0 else 1


def _emit(report: dict, path: str | None) -> None:
    print(format_report(report))
    if path:
        with open(path, "w") as f:
            json.dump({"collectives": report}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
