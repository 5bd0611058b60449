"""Process groups: which torch.distributed backend serves a device, creating the default
group, and turning backend failures into errors that say which collective failed, on which
rank, after how long.

The HAL adds only the backend choice and the error reporting; everything else is
torch.distributed (`new_group`, `barrier`, device selection through `torch.accelerator`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import importlib.util
import os
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..errors import BackendUnavailableError, HalError, InvalidInputError
from ..vendors import VENDORS


class CollectiveError(HalError):
    """A collective (or the rendezvous of `init_process_group`) failed inside the
    process-group backend. The message names the collective, the rank, the group size,
    the backend and how long the call ran; the backend's own exception is the __cause__."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete within the process group's timeout: some rank of the
    group never called it (stuck, dead, or calling a different collective) or never joined."""


AUTO = "auto"

# Process-group backends built into torch, with the function that says whether this torch
# build has them. Anything else is registered by a vendor bridge (Backend.register_backend).
_BUILTIN = {"gloo": "is_gloo_available", "nccl": "is_nccl_available", "mpi": "is_mpi_available",
            "ucc": "is_ucc_available", "xccl": "is_xccl_available"}


# -- which backend -------------------------------------------------------------------------
def device_type_of(device: "torch.device | str | None" = None) -> str:
    """The device type `device` names; None means the current accelerator, or "cpu" when
    there is none. Strings are not parsed by torch, so "npu" works without torch_npu."""
    if device is None:
        accelerator = _current_accelerator()
        return accelerator.type if accelerator is not None else "cpu"
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str) and device.strip():
        return device.split(":")[0].strip().lower()
    raise InvalidInputError("init_process_group", "device", "a torch.device, a device string "
                            "such as 'npu' or 'cuda:1', or None", repr(device))


def _current_accelerator() -> "torch.device | None":
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None:
        return torch.device("cuda") if torch.cuda.is_available() else None
    try:
        return accelerator.current_accelerator(check_available=True)
    except TypeError:  # torch < 2.7 has no check_available
        found = accelerator.current_accelerator()
        return found if found is not None and accelerator.device_count() > 0 else None


def backend_for_device(device: "torch.device | str | None" = None) -> str:
    """The torch.distributed backend name for `device` (None: the current accelerator, else
    the CPU). In this order:

    1. the `Capabilities.dist_backend` of the highest-priority *available* glm5_hal backend
       for that device type (the vendor backend that serves the device knows its library);
    2. torch.distributed's own default for the device type, which vendor bridges extend when
       they load (cpu -> gloo, cuda -> nccl, and e.g. npu -> hccl once torch_npu is imported);
    3. the vendor table (`glm5_hal.vendors`) for device types only one vendor uses
       (npu -> hccl, musa -> mccl, mlu -> cncl), so that a missing bridge is reported by
       name when the group is created.
    """
    device_type = device_type_of(device)
    from ..registry import REGISTRY
    for backend in REGISTRY.loaded().by_device.get(device_type, []):
        name = backend.cached_capabilities().dist_backend
        if name:
            return name
    torch_default = dist.Backend.default_device_backend_map.get(device_type) if dist.is_available() else None
    if torch_default:
        return torch_default
    vendors = [v for v in VENDORS.values() if v.device_type == device_type]
    if len(vendors) == 1:
        return vendors[0].dist_backend
    raise BackendUnavailableError(
        f"glm5_hal.dist: no process-group backend is known for device type {device_type!r}: no "
        f"available glm5_hal backend of that device type declares Capabilities.dist_backend, "
        f"torch.distributed has no default for it and glm5_hal.vendors lists "
        f"{'no vendor' if not vendors else 'several vendors'} for it; pass backend= explicitly")


def check_backend_usable(backend: str) -> None:
    """Raises BackendUnavailableError unless torch.distributed can create `backend` (a name,
    or torch's "cpu:gloo,cuda:nccl" form) in this process. A vendor backend whose bridge
    is installed but not yet imported is imported here, since importing it is what
    registers the backend; a missing or broken bridge is named in the error."""
    if not dist.is_available():
        raise BackendUnavailableError(f"glm5_hal.dist: torch {torch.__version__} was built "
                                      "without torch.distributed")
    for part in backend.split(","):
        _check_one(part.split(":")[-1].strip().lower())


def _check_one(name: str) -> None:
    vendors = [v for v in VENDORS.values() if v.dist_backend == name]
    who = "; ".join(f"vendor {v.backend} ({v.chips})" + (" [name unconfirmed, see glm5_hal/vendors.py]"
                                                         if "dist_backend" in v.unconfirmed else "")
                    for v in vendors)
    if name in _BUILTIN:
        available = getattr(dist, _BUILTIN[name], None)
        if available is not None and available():
            return
        used_by = f" It is the backend of {who}, which needs that vendor's build of PyTorch." if who else ""
        raise BackendUnavailableError(f"glm5_hal.dist: process-group backend {name!r} is not available "
                                      f"in this torch build ({torch.__version__}).{used_by}")
    if name in dist.Backend.backend_list:
        return
    if not vendors:
        raise BackendUnavailableError(
            f"glm5_hal.dist: unknown process-group backend {name!r}: torch.distributed knows "
            f"{sorted(n for n in dist.Backend.backend_list if n != 'undefined')}, glm5_hal.vendors "
            f"knows {sorted({v.dist_backend for v in VENDORS.values()})}")
    for vendor in vendors:
        if vendor.bridge is None:
            continue
        if importlib.util.find_spec(vendor.bridge) is None:
            raise BackendUnavailableError(
                f"glm5_hal.dist: process-group backend {name!r} ({who}) is not registered with "
                f"torch.distributed because that vendor's PyTorch bridge {vendor.bridge!r} is not "
                f"installed; install {vendor.bridge} (matching torch {torch.__version__}) and the "
                f"vendor runtime, or pass backend='gloo' to use CPU tensors")
        try:
            importlib.import_module(vendor.bridge)
        except BaseException as exc:  # a broken bridge may even sys.exit(); report it instead
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise BackendUnavailableError(
                f"glm5_hal.dist: process-group backend {name!r} ({who}): the PyTorch bridge "
                f"{vendor.bridge!r} is installed but failed to import: {type(exc).__name__}: {exc}"
            ) from exc
        if name in dist.Backend.backend_list:
            return
    bridges = ", ".join(repr(v.bridge) for v in vendors if v.bridge) or "none"
    raise BackendUnavailableError(
        f"glm5_hal.dist: process-group backend {name!r} ({who}) is still not registered with "
        f"torch.distributed after importing its bridge ({bridges}); the bridge version may not "
        f"match torch {torch.__version__}")


# -- the default group ---------------------------------------------------------------------
def init_process_group(backend: str = AUTO, init_method: str | None = None,
                       timeout: "datetime.timedelta | float | None" = None, world_size: int = -1,
                       rank: int = -1, store: "dist.Store | None" = None, group_name: str = "",
                       pg_options: Any = None, device_id: "torch.device | int | None" = None, *,
                       device: "torch.device | str | None" = None) -> str:
    """`torch.distributed.init_process_group` with the backend chosen for the device.

    backend: "auto" (default) takes `backend_for_device(device)`: the declared distributed
        backend of the glm5_hal backend serving `device` (gloo on CPU, hccl on Ascend, mccl
        on Moore Threads, nccl = RCCL on Hygon DCU, cncl on Cambricon, Kunlun's BKCL); any
        other string is used as given (e.g. "gloo" to run CPU tensors on an accelerator host).
    device: the device the group will serve; None means the current accelerator, else CPU.
    init_method, timeout, world_size, rank, store, group_name, pg_options, device_id: as in
        torch.distributed (timeout may also be given in seconds).

    Before any rendezvous starts, the backend is checked to exist in this process: a vendor
    backend whose bridge is missing or broken raises BackendUnavailableError naming the
    vendor and the bridge. A rendezvous that does not complete (a rank never joins) raises
    CollectiveTimeoutError within the timeout. Returns the backend name used.
    """
    if not isinstance(backend, str) or not backend.strip():
        raise InvalidInputError("init_process_group", "backend", "'auto' or a torch.distributed "
                                "backend name", repr(backend))
    name = backend_for_device(device) if backend.strip().lower() == AUTO else backend.strip()
    check_backend_usable(name)
    timeout = _timedelta("init_process_group", timeout)
    kwargs = {} if device_id is None else {"device_id": device_id}
    start = time.monotonic()
    try:
        dist.init_process_group(name, init_method=init_method, timeout=timeout,
                                world_size=world_size, rank=rank, store=store,
                                group_name=group_name, pg_options=pg_options, **kwargs)
    except (RuntimeError, TimeoutError) as exc:
        rank_text = rank if rank >= 0 else os.environ.get("RANK", "?")
        size_text = world_size if world_size >= 0 else os.environ.get("WORLD_SIZE", "?")
        elapsed = time.monotonic() - start
        limit = timeout.total_seconds() if timeout is not None else None
        if _is_timeout(exc, elapsed, limit):
            raise CollectiveTimeoutError(
                f"glm5_hal.dist.init_process_group: rank {rank_text} of {size_text} ({name}): the "
                f"rendezvous timed out after {elapsed:.1f} s (timeout {_seconds(limit)}): not every "
                f"rank joined. Backend said: {_first_line(exc)}") from exc
        raise CollectiveError(f"glm5_hal.dist.init_process_group: rank {rank_text} of {size_text} "
                              f"({name}) failed after {elapsed:.1f} s: {_first_line(exc)}") from exc
    return name


def destroy_process_group(group: "dist.ProcessGroup | None" = None) -> None:
    """`torch.distributed.destroy_process_group`; does nothing if no group exists."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group(group)


def _timedelta(op: str, timeout: object) -> datetime.timedelta | None:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return datetime.timedelta(seconds=float(timeout))
    raise InvalidInputError(op, "timeout", "a datetime.timedelta or a number of seconds > 0", repr(timeout))


# -- per-call group facts and error reporting ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GroupInfo:
    pg: Any          # the ProcessGroup (the default group when the caller passed None)
    rank: int        # this process's rank in the group
    size: int


def group_info(op: str, group: "dist.ProcessGroup | None") -> GroupInfo:
    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidInputError(op, "group", "an initialized process group (call "
                                "glm5_hal.dist.init_process_group first)", "no process group")
    pg = dist.group.WORLD if group is None else group
    rank = dist.get_rank(pg)
    if rank < 0:
        raise InvalidInputError(op, "group", "a process group this process belongs to",
                                f"a group of global ranks {dist.get_process_group_ranks(pg)}, "
                                f"this process is global rank {dist.get_rank()}")
    return GroupInfo(pg, rank, dist.get_world_size(pg))


def served_device_types(info: GroupInfo) -> tuple[str, ...] | None:
    """Device types the group's backends accept tensors on (None: torch does not say)."""
    try:
        return tuple(d.type for d in info.pg._device_types)
    except Exception:
        return None


def metadata_device(info: GroupInfo, like: object) -> torch.device:
    """Where the small metadata tensors live: the CPU when the group serves it (no device
    sync), else the device of the payload, else the current accelerator device."""
    served = served_device_types(info)
    if served is None or "cpu" in served:
        return torch.device("cpu")
    if isinstance(like, torch.Tensor) and like.device.type in served:
        return like.device
    device_type = served[0]
    return torch.device(device_type, torch.accelerator.current_device_index()) \
        if hasattr(torch, "accelerator") else torch.device(device_type)


@contextlib.contextmanager
def guard(op: str, info: GroupInfo) -> Iterator[None]:
    """Re-raises a backend failure inside the block as CollectiveTimeoutError /
    CollectiveError saying which collective, on which rank, after how long."""
    start = time.monotonic()
    try:
        yield
    except (RuntimeError, TimeoutError) as exc:
        if isinstance(exc, HalError):
            raise
        elapsed = time.monotonic() - start
        limit = _group_timeout_s(info)
        backend = _backend_name(info)
        where = f"glm5_hal.dist.{op}: rank {info.rank} of {info.size} ({backend})"
        if _is_timeout(exc, elapsed, limit):
            raise CollectiveTimeoutError(
                f"{where} timed out after {elapsed:.1f} s (process-group timeout "
                f"{_seconds(limit)}): some rank of the group did not call {op.split(' ')[0]} (it is "
                f"stuck, dead, or calling a different collective). Backend said: {_first_line(exc)}"
            ) from exc
        raise CollectiveError(f"{where} failed after {elapsed:.1f} s: {_first_line(exc)}") from exc


def _group_timeout_s(info: GroupInfo) -> float | None:
    for device_type in served_device_types(info) or ("cpu",):
        try:
            return info.pg._get_backend(torch.device(device_type)).options._timeout.total_seconds()
        except Exception:
            continue
    return None


def _backend_name(info: GroupInfo) -> str:
    try:
        return str(dist.get_backend(info.pg))
    except Exception:
        return "unknown backend"


def _is_timeout(exc: BaseException, elapsed: float, limit: float | None) -> bool:
    text = str(exc).lower()
    return (isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text
            or (limit is not None and elapsed >= 0.9 * limit))


def _seconds(limit: float | None) -> str:
    return "unknown" if limit is None else f"{limit:g} s"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
