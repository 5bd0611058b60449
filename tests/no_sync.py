"""No device synchronisation on the hot path: run a vendor adapter (through dispatch) on
emulated device tensors and record every host read.

An *emulated device tensor* (`DeviceTensor`) is a CPU tensor presented as a tensor of device
`DEVICE` -- torch's generic non-CPU device type `privateuseone`, which nothing else in a test
process uses. Dispatch treats it as device data (the decision key's device type is not "cpu",
so the ops' value checks are skipped outside GLM5_HAL_CHECKS=full), every op on it runs on the
CPU data underneath, and inside `watch()` every way of making the host wait for device data is
recorded as a `Sync`, with the frames that did it:

- scalar reads: `.item()`, `bool(t)` / `if t:`, `int(t)`, `float(t)`, a tensor used as an
  index or slice bound, `.tolist()`, `.numpy()`, `repr(t)` / f-strings;
- copies to the host: `.cpu()`, `.to("cpu")`, `copy_` into a host tensor;
- blocking copies from the host: `torch.tensor(data, device=...)`, `.to(device)` or `copy_` of
  a host tensor (torch's `copy_` without `non_blocking` synchronises the stream after the
  copy, and graph capture cannot record it);
- data-dependent output shapes: `nonzero` / `torch.where(cond)` / `argwhere`, boolean-mask
  indexing, `masked_select`, `unique`, `bincount`, `repeat_interleave` without
  `output_size`, `torch.equal`;
- an op mixing device tensors with a host tensor of more than one element (a real device
  raises, or copies it over first).

The vendor runtime -- the emulator, which plays the device -- and any other object standing
in for device code (a simulated kernel library) are wrapped with `device_runtime(obj)`: their
functions receive plain CPU tensors and may read them freely, and their tensor results come
back as device tensors (in-place results as the caller's own tensor). `torch._assert_async` on a
device tensor is the device's own check: it is evaluated right away (a false condition raises,
as a device-side assert would) and is not a sync.

    backend = AscendBackend(runtime=device_runtime(NpuEmulator()), name="ascend_dev",
                            device_type=DEVICE_TYPE)
    ...load it as a plugin...
    x = to_device(torch.randn(4, 8))
    with watch() as syncs:
        y = hal.ops.rms_norm(x, to_device(w), 1e-6)
    assert not syncs, syncs.report()
    torch.testing.assert_close(to_host(y), expected)

Outside `watch()` device tensors behave like plain tensors (test code may compare and print
them); factory calls with `device=DEVICE` need `watch()` (or `on_device()`, which emulates the
device without recording).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from glm5_hal.opdef import register_device_emulation

DEVICE_TYPE = "privateuseone"
DEVICE = torch.device(DEVICE_TYPE, 0)
_CPU = torch.device("cpu")
_HERE = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
aten = torch.ops.aten


def _register_device_module() -> None:
    """Makes privateuseone a device torch can use from Python: a device module (torch
    initialises a device type through `torch.<type>` before a factory call reaches dispatch),
    hooks and a device guard (indexing and a few methods set the tensor's device first),
    through torch's own helper for Python backends. The data always lives on the CPU."""
    name = torch._C._get_privateuse1_backend_name()
    if name != DEVICE_TYPE:
        raise RuntimeError(f"the privateuse1 device is renamed {name!r} in this process (a vendor bridge is "
                           "loaded); the no-sync harness needs it unused")
    if not hasattr(torch, DEVICE_TYPE):
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
        _setup_privateuseone_for_python_backend()


_register_device_module()


# -- what is recorded -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sync:
    """One host read: what it was and the frames (outside torch and this harness) that did it,
    innermost first."""
    kind: str
    what: str
    frames: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.kind}: {self.what} at {' <- '.join(self.frames[:4]) or '?'}"


class Syncs(list):
    """The syncs recorded by one `watch()`."""

    def report(self) -> str:
        return f"{len(self)} host sync(s):\n" + "\n".join(f"  {s}" for s in self)

    def kinds(self) -> list[str]:
        return [s.kind for s in self]


class _State(threading.local):
    def __init__(self) -> None:
        self.watching: list[Syncs] = []
        self.device_code = 0  # > 0 while a device_runtime() function runs


_STATE = _State()


def _frames() -> tuple[str, ...]:
    frames, frame = [], sys._getframe(1)
    while frame is not None and len(frames) < 8:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _HERE and not path.startswith(_TORCH):
            frames.append(f"{os.path.basename(path)}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return tuple(frames)


def _record(kind: str, what: str) -> None:
    if _STATE.watching and not _STATE.device_code:
        _STATE.watching[-1].append(Sync(kind, what, _frames()))


# -- the device tensor ----------------------------------------------------------------------------
class DeviceTensor(torch.Tensor):
    """A CPU tensor (`elem`) presented as a tensor on DEVICE."""
    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> "DeviceTensor":
        out = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            layout=elem.layout, device=DEVICE, requires_grad=elem.requires_grad)
        out.elem = elem
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})

    # host reads that do not pass through dispatch
    def tolist(self):
        _record("scalar read", "Tensor.tolist()")
        return self.elem.tolist()

    def numpy(self, *, force: bool = False):
        _record("scalar read", "Tensor.numpy()")
        return self.elem.numpy(force=force)

    def __array__(self, dtype=None):
        _record("scalar read", "numpy.asarray(tensor)")
        return self.elem.__array__(dtype)

    def __repr__(self, *, tensor_contents=None) -> str:
        _record("scalar read", "repr(tensor) (formatting device data copies it to the host)")
        return f"DeviceTensor({self.elem!r}, device={DEVICE})"

    def data_ptr(self) -> int:  # a pointer handed to device code reads nothing
        return self.elem.data_ptr()

    def untyped_storage(self):
        return self.elem.untyped_storage()


def to_device(tree: Any) -> Any:
    """Tensors in `tree` as device tensors over the same memory (writes show in the originals)."""
    return tree_map(lambda t: DeviceTensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, DeviceTensor)
                    else t, tree)


def to_host(tree: Any) -> Any:
    """Device tensors in `tree` as their CPU data."""
    return tree_map(lambda t: t.elem if isinstance(t, DeviceTensor) else t, tree)


def _rewrap(out: Any, owners: dict[int, "DeviceTensor"]) -> Any:
    """Tensor results as device tensors; a result that is an input's own data (in-place,
    out=) as that input."""
    def wrap(t):
        if not isinstance(t, torch.Tensor) or isinstance(t, DeviceTensor):
            return t
        owner = owners.get(id(t))
        return owner if owner is not None else DeviceTensor(t)
    return tree_map(wrap, out)


def _is_device(d: Any) -> bool:
    if isinstance(d, torch.device):
        return d.type == DEVICE_TYPE
    return isinstance(d, str) and d.split(":")[0] == DEVICE_TYPE


def _run(func, args: tuple, kwargs: dict) -> Any:
    """Runs `func` on the CPU data underneath; its results are device tensors when any input
    was (or a device= argument named DEVICE). In-place and out= results are the caller's own
    device tensors."""
    on_device = False
    owners: dict[int, DeviceTensor] = {}

    def unwrap(x):
        nonlocal on_device
        if isinstance(x, DeviceTensor):
            on_device = True
            owners[id(x.elem)] = x
            return x.elem
        if _is_device(x):
            on_device = True
            return _CPU
        return x

    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    if not on_device:
        return out
    return _rewrap(out, owners)


# -- the checks -----------------------------------------------------------------------------------
_SCALAR_READS = {aten._local_scalar_dense.default: ".item() / bool(t) / int(t) / float(t) / t as an index",
                 aten.equal.default: "torch.equal (returns a host bool)"}
_DATA_DEPENDENT = {aten.nonzero.default, aten.nonzero.out, aten.masked_select.default, aten._unique.default,
                   aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
                   aten.unique_dim_consecutive.default, aten.bincount.default}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_ASSERTS = {aten._assert_async.default, aten._assert_async.msg}


def _tensors(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map(lambda t: found.append(t) if isinstance(t, torch.Tensor) else None, tree)
    return found


def _check(func, args: tuple, kwargs: dict) -> None:
    """Records what calling `func` on these arguments would make the host wait for."""
    tensors = _tensors((args, kwargs))
    device = [t for t in tensors if isinstance(t, DeviceTensor)]
    host = [t for t in tensors if not isinstance(t, DeviceTensor) and t.numel() > 1]
    name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
    if func in (aten._to_copy.default, aten.copy_.default):
        source = args[1] if func is aten.copy_.default else args[0]
        if func is aten.copy_.default:
            target_on_device = isinstance(args[0], DeviceTensor)
        else:
            target_on_device = _is_device(kwargs.get("device")) or (
                kwargs.get("device") is None and isinstance(source, DeviceTensor))
        if isinstance(source, DeviceTensor) and not target_on_device:
            _record("copy to the host", f"{name} of device data into host memory (.cpu(), .to('cpu'))")
        elif not isinstance(source, DeviceTensor) and target_on_device:
            _record("blocking host-to-device copy", f"{name} of host data {list(source.shape)} to the device "
                    "(torch.tensor(..., device=), .to(device)): the copy waits for the stream")
        return
    if not device:
        return
    if func in _SCALAR_READS:
        _record("scalar read", _SCALAR_READS[func])
    elif func in _DATA_DEPENDENT:
        _record("data-dependent shape", f"{name} (its output size is read from device data)")
    elif func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor) and \
            kwargs.get("output_size") is None:
        _record("data-dependent shape", "repeat_interleave without output_size")
    elif func in _INDEXING and any(t is not None and t.dtype in (torch.bool, torch.uint8)
                                   for t in (args[1] if len(args) > 1 else ())):
        _record("data-dependent shape", f"{name} with a boolean mask (a nonzero on device data)")
    if host:
        _record("host tensor in a device op", f"{name} mixes device tensors with a host tensor of shape "
                f"{list(host[0].shape)} (a device raises, or copies it first)")


class _DispatchWatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _STATE.device_code:
            if func in _ASSERTS and isinstance(args[0], DeviceTensor):
                # the device evaluates its own assertion; a failing one surfaces as an error
                if not bool(args[0].elem):
                    raise RuntimeError(f"device-side assertion failed: {args[1] if len(args) > 1 else ''}")
                return None
            _check(func, args, kwargs)
        return _run(func, args, kwargs)


class _FactoryWatch(TorchFunctionMode):
    """torch.tensor(data, device=DEVICE) and friends build on the host and copy (their copy
    does not pass the Python dispatch key): built on the CPU here, recorded as the upload."""
    FACTORIES = (torch.tensor, torch.as_tensor, torch.asarray)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FACTORIES and _is_device(kwargs.get("device")) and not (
                args and isinstance(args[0], torch.Tensor)):
            if not _STATE.device_code:
                _record("blocking host-to-device copy", f"torch.{func.__name__}(host data, device={DEVICE_TYPE}): "
                        "the copy waits for the stream")
            return DeviceTensor(func(*args, **{**kwargs, "device": _CPU}))
        return func(*args, **kwargs)


# device tensors and the watch are a device, not a transform: dispatch takes its eager path with
# them, as with real device tensors
register_device_emulation(DeviceTensor, _DispatchWatch, _FactoryWatch)


@contextlib.contextmanager
def on_device() -> Iterator[None]:
    """Emulates DEVICE (factory calls with device=DEVICE work) without recording."""
    with _FactoryWatch(), _DispatchWatch():
        yield


@contextlib.contextmanager
def watch() -> Iterator[Syncs]:
    """Emulates DEVICE and records every host sync outside device code into the yielded list."""
    syncs = Syncs()
    _STATE.watching.append(syncs)
    try:
        with on_device():
            yield syncs
    finally:
        _STATE.watching.pop()


# -- device code ----------------------------------------------------------------------------------
_PLAIN = (str, bytes, int, float, bool, type(None), dict, list, tuple, set, frozenset, torch.dtype, torch.device)


def _device_call(fn: Callable) -> Callable:
    def call(*args, **kwargs):
        owners: dict[int, DeviceTensor] = {}

        def unwrap(x):
            if isinstance(x, DeviceTensor):
                owners[id(x.elem)] = x
                return x.elem
            return x

        _STATE.device_code += 1
        try:
            out = fn(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        finally:
            _STATE.device_code -= 1
        return _rewrap(out, owners)

    call.__name__ = getattr(fn, "__name__", "device_call")
    call.__wrapped__ = fn
    return call


class DeviceRuntime:
    """`target` (a vendor runtime emulator, a simulated kernel library) as device code: its
    functions take and return device tensors and may read their data; nested objects
    (`emulator.npu`, `emulator.tmo`) are wrapped the same way; plain values pass through."""

    def __init__(self, target: Any) -> None:
        object.__setattr__(self, "_target", target)

    @property
    def wrapped(self) -> Any:
        return object.__getattribute__(self, "_target")

    def __getattr__(self, name: str) -> Any:
        value = getattr(object.__getattribute__(self, "_target"), name)
        if isinstance(value, torch.Tensor):
            return to_device(value)
        if isinstance(value, _PLAIN) or isinstance(value, type):
            return value
        if callable(value):
            return _device_call(value)
        return DeviceRuntime(value)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_target"), name, value)

    def __repr__(self) -> str:
        return f"DeviceRuntime({object.__getattribute__(self, '_target')!r})"


def device_runtime(target: Any) -> DeviceRuntime:
    return DeviceRuntime(target)
