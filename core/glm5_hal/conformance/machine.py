"""The machine a report was made on: CPU, memory, accelerators, and the vendor stacks present.

Reports from many labs are merged and compared, so each one says where it ran. Everything
here is read without initialising a vendor device: environment variables, installed
distributions, files the OS and drivers publish, and torch's own device queries for the
accelerator a run already uses. The per-backend versions (torch_npu, CANN, ...) are each
backend's own `versions()`, recorded next to this in the report's `backends`.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path


def machine() -> dict:
    import torch

    from ..vendors import VENDORS, cuda_flavor
    facts: dict = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "os": platform.platform(),
        "torch_build": {k: v for k, v in (("cuda", torch.version.cuda),
                                          ("hip", getattr(torch.version, "hip", None))) if v},
        "cuda_flavor": cuda_flavor(torch),
        "accelerators": _accelerators(torch),
    }
    driver = _first_line("/proc/driver/nvidia/version")
    if driver:
        facts["nvidia_driver"] = driver
    toolkits = {v.backend: os.environ[e] for v in VENDORS.values()
                for e in v.toolchain_env[:1] if os.environ.get(e)}
    if toolkits:
        facts["vendor_toolkits"] = toolkits
    bridges = {v.bridge: version for v in VENDORS.values() if v.bridge and (version := _version(v.bridge))}
    if bridges:
        facts["vendor_bridges"] = bridges
    return facts


def cpu_model() -> str:
    """The CPU's marketing name ("model name" in /proc/cpuinfo on Linux), else what Python knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def describe(facts: dict) -> str:
    """One line for a report header: CPU, cores, memory, accelerators."""
    parts = [f"{facts.get('cpu', '?')} ({facts.get('cores', '?')} cores"
             + (f", {facts['memory_gib']} GiB)" if facts.get("memory_gib") else ")")]
    for acc in facts.get("accelerators", []):
        parts.append(f"{acc['count']} x {acc['type']}" + (f" {acc['name']}" if acc.get("name") else ""))
    if facts.get("nvidia_driver"):
        parts.append(facts["nvidia_driver"])
    return "; ".join(parts)


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2 ** 20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _accelerators(torch) -> list[dict]:
    """The accelerator torch is built for, if a device of it is present (type, count, name)."""
    accelerator = getattr(torch, "accelerator", None)
    try:
        current = accelerator.current_accelerator() if accelerator is not None else None
        if current is None:
            return []
        count = accelerator.device_count()
        module = getattr(torch, current.type, None)
        name = module.get_device_name(0) if hasattr(module, "get_device_name") and count else ""
    except Exception as exc:   # a half-installed bridge must not take a report down
        return [{"type": "unknown", "count": 0, "name": f"({type(exc).__name__}: {exc})"}]
    return [{"type": current.type, "count": count, "name": name}]


def _first_line(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace").splitlines()[0].strip()
    except (OSError, IndexError):
        return ""


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""
