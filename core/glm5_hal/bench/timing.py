"""Timing primitives shared by every benchmark: warm-up, repeated batches, their times and medians."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def median_time(fn: Callable[[], object], *, min_time: float = 0.2, repeats: int = 7,
                warmup: int = 3, sync: Callable[[], None] | None = None) -> float:
    """Median seconds per call of `fn` over `repeats` batches (see batch_times)."""
    return statistics.median(batch_times(fn, min_time=min_time, repeats=repeats, warmup=warmup, sync=sync))


def batch_times(fn: Callable[[], object], *, min_time: float = 0.2, repeats: int = 7,
                warmup: int = 3, sync: Callable[[], None] | None = None) -> list[float]:
    """Seconds per call of `fn` in each of `repeats` batches, each batch sized to last about
    `min_time / repeats` seconds (so microsecond calls are not lost in timer noise)."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    t0 = time.perf_counter()
    fn()
    if sync:
        sync()
    single = max(time.perf_counter() - t0, 1e-7)
    per_batch = max(1, int(min_time / repeats / single))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn()
        if sync:
            sync()
        samples.append((time.perf_counter() - t0) / per_batch)
    return samples


def paired_difference(samples: list[list[float]], a: int, b: int) -> float:
    """The median over the rounds of `paired_samples` of (fns[a] - fns[b]): load that changes
    between rounds cancels out of each difference."""
    return statistics.median(x - y for x, y in zip(samples[a], samples[b]))


def paired_samples(fns: list[Callable[[], object]], *, min_time: float = 0.2, repeats: int = 9,
                   warmup: int = 3) -> list[list[float]]:
    """Seconds per call of each of `fns` in each of `repeats` rounds of interleaved batches."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    singles = []
    for fn in fns:
        t0 = time.perf_counter()
        fn()
        singles.append(max(time.perf_counter() - t0, 1e-7))
    per_batch = max(1, int(min_time / repeats / len(fns) / max(singles)))
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            t0 = time.perf_counter()
            for _ in range(per_batch):
                fn()
            out.append((time.perf_counter() - t0) / per_batch)
    return samples
