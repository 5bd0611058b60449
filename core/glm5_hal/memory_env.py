"""The process's memory allocator and the kernel's transparent-huge-page (THP) mode: the two
settings that decide whether large CPU tensors are fresh, page-faulting memory on every
allocation (docs/performance.md, "Steady state"). Standard library only: `glm5-hal doctor`
imports it without torch, and `glm5-hal bench` records it with every run.
"""
from __future__ import annotations

import os
import platform

THP_ROOT = "/sys/kernel/mm/transparent_hugepage"
# malloc replacements recognised by the library mapped into the process (LD_PRELOAD or linked)
ALLOCATOR_LIBRARIES = (("tcmalloc", "libtcmalloc"), ("jemalloc", "libjemalloc"), ("mimalloc", "libmimalloc"))
# glibc's own malloc settings, when a user set them (glibc manual, "Memory Allocation Tunables")
GLIBC_MALLOC_ENV = ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")


def allocator(maps: str | None = None) -> str:
    """Who serves malloc in this process: tcmalloc, jemalloc or mimalloc when one of their
    libraries is mapped (/proc/self/maps, or `maps` given), else the C library's own
    ("glibc", or whatever platform.libc_ver names; "unknown" where nothing says)."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            maps = ""
    names = {line.rsplit("/", 1)[-1] for line in maps.splitlines() if "/" in line}
    for name, prefix in ALLOCATOR_LIBRARIES:
        if any(n.startswith(prefix) for n in names):
            return name
    libc = platform.libc_ver()[0]
    return libc or "unknown"


def thp_mode(root: str = THP_ROOT) -> dict[str, str | None]:
    """The THP settings in force: `enabled` (always / madvise / never) and `defrag` (always /
    defer / defer+madvise / madvise / never), the bracketed choice of each sysfs file; None
    where unreadable (not Linux, or no THP)."""
    mode: dict[str, str | None] = {}
    for key in ("enabled", "defrag"):
        try:
            with open(os.path.join(root, key)) as f:
                text = f.read()
        except OSError:
            mode[key] = None
            continue
        start, end = text.find("["), text.find("]")
        mode[key] = text[start + 1:end] if 0 <= start < end else text.strip() or None
    return mode


def describe(maps: str | None = None, root: str = THP_ROOT, environ=None) -> dict:
    environ = os.environ if environ is None else environ
    thp = thp_mode(root)
    return {"allocator": allocator(maps), "ld_preload": environ.get("LD_PRELOAD") or None,
            "malloc_env": {k: environ[k] for k in GLIBC_MALLOC_ENV if environ.get(k)},
            "thp_enabled": thp["enabled"], "thp_defrag": thp["defrag"]}


def summary(info: dict) -> str:
    """One line: `allocator glibc; THP enabled=madvise defrag=madvise`."""
    extra = f" (LD_PRELOAD={info['ld_preload']})" if info.get("ld_preload") else ""
    settings = "".join(f" {k}={v}" for k, v in info.get("malloc_env", {}).items())
    return (f"allocator {info['allocator']}{extra}{settings}; THP enabled={info['thp_enabled'] or 'n/a'} "
            f"defrag={info['thp_defrag'] or 'n/a'}")


def findings(info: dict) -> list[str]:
    """What in `info` costs speed on large CPU tensors, and what to do about it."""
    out = []
    if info["allocator"] == "glibc":
        out.append(
            "malloc is glibc's: it maps every allocation above its mmap threshold (at most 32 MiB) "
            "fresh and unmaps it on free, so a large tensor page-faults all of its memory each time "
            "it is made. glm5_hal's cpu backend reuses its own large outputs (GLM5_HAL_CPU_OUTPUT_CACHE_MB), "
            "but torch's ops in between still pay it; for a serving process preload tcmalloc "
            "(apt: libtcmalloc-minimal4; LD_PRELOAD=libtcmalloc_minimal.so.4), as vLLM's CPU docs advise. "
            "docs/performance.md, 'Steady state', has the measurements.")
    elif info["allocator"] == "jemalloc":
        out.append(
            "malloc is jemalloc's: large tensors made fresh on every call measured as slow under it as "
            "under glibc's (docs/performance.md, 'Steady state'); glm5_hal's cpu backend reuses its own "
            "large outputs, and for torch's ops in between tcmalloc (LD_PRELOAD=libtcmalloc_minimal.so.4) "
            "kept them fast in the same measurement.")
    if info["thp_enabled"] == "always" and info["thp_defrag"] == "always":
        out.append(
            "transparent huge pages: enabled=always with defrag=always makes every large first touch "
            "wait for memory compaction (stalls of tens of ms on a fragmented machine); "
            "`echo defer+madvise > /sys/kernel/mm/transparent_hugepage/defrag` (root) keeps huge pages "
            "without the stalls.")
    elif info["thp_enabled"] == "never":
        out.append(
            "transparent huge pages are off (enabled=never): the cpu backend's cached output blocks get "
            "4 KiB pages (more TLB misses on every pass over them); `echo madvise > "
            "/sys/kernel/mm/transparent_hugepage/enabled` (root) lets them ask for huge pages.")
    return out
