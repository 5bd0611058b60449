"""A CPU emulator of the Hygon DCU vendor surface glm5_hal's dcu adapters call (the surface
backends/dcu/runtime.py describes): the parts of a DTK (ROCm) build of torch the probe reads
(torch.version.hip, torch.__hcu_version__, torch.cuda's device queries with gcnArchName),
torch._grouped_mm, Hygon's lightop (RMSNorm, SiLU-and-mul, per-row top-k) laid out as one
lightop version lays it out (`DcuEmulator(lightop="0.6.0")`), and vLLM's
`_C.rotary_embedding`. It can also pose as an NVIDIA or a plain AMD ROCm torch, so the
probe's "not a Hygon DCU" reasons are tested.

lightop is closed; it is written from how HYGON-AI/vllm-plugin-das calls it and from the
vLLM kernels lightop's functions mirror:
* vllm_hcu/ops/rms_norm.py @474991d4: rmsnorm_forward_autograd(x, weight, eps, training)
  returns the normalised tensor, from `lightop.norm` (LightOp 0.6; `lightop.op` before), and
  "lightop's HCU RMSNorm kernel currently rejects reductions narrower than one wave" (64);
* vllm_hcu/ops/silu_and_mul.py @10ca569f: `lightop.op.silu_and_mul_opt(out, x)` writes
  silu(x[..., :d]) * x[..., d:] into out (lightop.activation from 0.6);
* docs/superpowers/specs/2026-08-25-lightop-categorized-api-v0251-design.md @63935f8e: the
  LightOp 0.6 layout (norm / activation / attention), read from the installed 0.6.0 wheel;
  whether 0.6 still exports the old `lightop.op` names is not said, so the 0.6 emulation has
  the categorized modules only; the deprecated places it names for a lightop without them are
  the top level or `lightop.op` for norm / activation and `lightop.op` for the top-k, emulated
  for a lightop before 0.6 either way (`lightop_old_place`);
* vllm_hcu/platforms/hcu.py @01211a04: device type "cuda", gcnArchName like gfx936 / gfx938;
* vllm-project/vllm csrc/sampler.cu @00e831b2 (topKPerRowJob: float32 logits rows,
  [row_start, row_end) ranges, indices relative to the row start; a row with at most top-k
  keys gives 0..len-1 and -1 in the rest);
* vllm-project/vllm csrc/pos_encoding_kernels.cu @0f5257e2 (rotary_embedding: in place on
  query and key; the cos_sin_cache row of a position holds the rot_dim/2 cosines then the sines;
  NeoX pairs (i, i + rot_dim/2), GPT-J pairs (2i, 2i + 1); the products in float32, stored in
  the query's dtype; the schema's later rope_dim_offset=0, inverse=False default, so the
  six-argument call holds);
* FlagGems runtime: a Hygon torch build carries torch.__hcu_version__;
* upstream torch._grouped_mm (emulators/torch_ops.py).

Violating a documented constraint raises DcuOpError (a RuntimeError, as TORCH_CHECK does);
undocumented behaviour (e.g. lightop on float32, which vLLM never passes it) raises
NotEmulatedError instead of guessing. It never calls glm5_hal.reference.
"""
from __future__ import annotations

import collections
import types

import torch
from torch import Tensor

from glm5_hal.vendor_backend import leading_numbers

from . import torch_ops, vllm_kernels

HALVES = (torch.float16, torch.bfloat16)
#: the lightop versions emulated: one before the categorized API, LightOp 0.6.0
LIGHTOP_VERSIONS = ("0.5.3", "0.6.0+das.dtk2604")
RMSNORM_MIN_COLS = 64

#: card -> (torch.cuda.get_device_properties().name, gcnArchName)
CARDS = {
    "K100_AI": ("K100_AI", "gfx928:sramecc+:xnack-"),
    "K100": ("K100", "gfx926:sramecc+:xnack-"),
    "Z100L": ("Z100L", "gfx906:sramecc+:xnack-"),
    "BW1000": ("BW1000", "gfx936:sramecc+:xnack-"),
    "MI300X": ("AMD Instinct MI300X", "gfx942:sramecc+:xnack-"),
    "H100": ("NVIDIA H100 80GB HBM3", ""),
}
#: flavor -> (torch.version.hip, torch.version.cuda, has torch.__hcu_version__)
FLAVORS = {
    "dcu": ("6.3.25211", None, True),
    "rocm": ("6.4.43482", None, False),
    "cuda": (None, "12.8", False),
    "cpu": (None, None, False),
}


class DcuOpError(RuntimeError):
    """What a TORCH_CHECK / HIP error in the vendor op raises."""


class NotEmulatedError(RuntimeError):
    """Vendor behaviour the sources do not document."""


def _require(ok: bool, op: str, message: str) -> None:
    if not ok:
        raise DcuOpError(f"{op}: {message}")


class _CudaDevice:
    """torch.cuda on a ROCm build: HIP devices answer as cuda."""

    def __init__(self, emulator: "DcuEmulator") -> None:
        self._emulator = emulator

    def is_available(self) -> bool:
        return self._emulator.devices > 0

    def device_count(self) -> int:
        return self._emulator.devices

    def _lazy_init(self) -> None:
        if self._emulator.devices == 0:
            raise RuntimeError("No HIP GPUs are available")

    def current_device(self) -> int:
        self._lazy_init()
        return 0

    def get_device_properties(self, device: object = None) -> types.SimpleNamespace:
        self._lazy_init()
        name, gcn = CARDS[self._emulator.card]
        return types.SimpleNamespace(name=name, gcnArchName=gcn, total_memory=64 << 30, multi_processor_count=120)

    def get_device_name(self, device: object = None) -> str:
        return self.get_device_properties(device).name

    def current_stream(self, device: object = None) -> types.SimpleNamespace:
        """A torch.cuda.Stream; on ROCm `cuda_stream` is the raw hipStream_t."""
        self._lazy_init()
        return types.SimpleNamespace(cuda_stream=0x4843, device=device)


class _Torch:
    """The attributes of a DTK / ROCm / CUDA torch build the probe and adapters read."""

    def __init__(self, emulator: "DcuEmulator", flavor: str, version: str, grouped_mm: str) -> None:
        hip, cuda, hcu = FLAVORS[flavor]
        self._emulator = emulator
        self._grouped_mm_mode = grouped_mm
        self.__version__ = version
        self.version = types.SimpleNamespace(hip=hip, cuda=cuda)
        if hcu:
            self.__hcu_version__ = version
        self.cuda = _CudaDevice(emulator)

    def __getattr__(self, name: str):
        if name == "_grouped_mm" and self._grouped_mm_mode != "absent":
            return self._grouped_mm_impl
        raise AttributeError(name)

    def _grouped_mm_impl(self, mat_a: Tensor, mat_b: Tensor, offs: Tensor | None = None,
                         bias: Tensor | None = None, out_dtype: torch.dtype | None = None) -> Tensor:
        op = "torch._grouped_mm(hip)"
        self._emulator.calls["_grouped_mm"] += 1
        if self._grouped_mm_mode == "raises":
            # what an upstream ROCm build without the fallback path says off MI300-class GPUs
            raise DcuOpError(f"{op}: grouped gemm is only supported on ROCm MI300+ devices")
        try:
            return torch_ops.grouped_mm(op, mat_a, mat_b, offs, bias, out_dtype)
        except torch_ops.TorchCheckError as exc:
            raise DcuOpError(str(exc)) from None
        except torch_ops.GroupedMmNotEmulated as exc:
            raise NotEmulatedError(str(exc)) from None


class _LightopKernels:
    """The lightop functions the adapters call, wherever a version keeps them."""

    def __init__(self, emulator: "DcuEmulator") -> None:
        self._emulator = emulator

    def rmsnorm_forward_autograd(self, x: Tensor, weight: Tensor, eps: float, training: bool) -> Tensor:
        op = "lightop rmsnorm_forward_autograd"
        self._emulator.calls["rmsnorm_forward_autograd"] += 1
        if x.dtype not in HALVES:
            raise NotEmulatedError(f"{op}: vLLM's DCU plugin runs it on bf16/fp16 only, got {x.dtype}")
        if training:
            raise NotEmulatedError(f"{op}: the training (autograd) path is not emulated")
        _require(x.dim() == 2 and x.is_contiguous(), op, f"x must be a contiguous [tokens, hidden] tensor, got "
                 f"{list(x.shape)}")
        _require(x.shape[1] >= RMSNORM_MIN_COLS, op, f"the HCU RMSNorm kernel rejects reductions narrower than one "
                 f"wave ({RMSNORM_MIN_COLS}), got {x.shape[1]}")
        _require(weight.dtype == x.dtype and tuple(weight.shape) == (x.shape[1],), op,
                 f"weight must be [{x.shape[1]}] {x.dtype}, got {list(weight.shape)} {weight.dtype}")
        xf = x.float()
        y = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + float(eps)) * weight.float()
        return y.to(x.dtype)

    def silu_and_mul_opt(self, out: Tensor, x: Tensor) -> None:
        op = "lightop silu_and_mul_opt"
        self._emulator.calls["silu_and_mul_opt"] += 1
        if x.dtype not in HALVES:
            raise NotEmulatedError(f"{op}: vLLM's DCU plugin runs it on bf16/fp16 only, got {x.dtype}")
        half = x.shape[-1] // 2
        _require(x.shape[-1] % 2 == 0 and x.is_contiguous(), op, "x must be contiguous with an even last dim")
        _require(out.dtype == x.dtype and tuple(out.shape) == (*x.shape[:-1], half), op,
                 f"out must be {[*x.shape[:-1], half]} {x.dtype}, got {list(out.shape)} {out.dtype}")
        gate, up = x[..., :half].float(), x[..., half:].float()
        out.copy_((gate * torch.sigmoid(gate) * up).to(x.dtype))


class _Lightop:
    """The lightop package at one version: before 0.6 the functions live in `lightop.op`, or (with
    `old_place="top"`) RMSNorm and SiLU-and-mul at lightop's top level -- the two deprecated places
    the LightOp 0.6 design doc names ("Compatible top-level/`lightop.op` fallback" for norm and
    activation, "Compatible move from `lightop.op`" for the top-k; @63935f8e); from LightOp 0.6 in
    `lightop.norm` / `lightop.activation` / `lightop.attention`."""

    def __init__(self, emulator: "DcuEmulator", version: str, old_place: str = "op") -> None:
        if old_place not in ("op", "top"):
            raise ValueError(f"old_place must be 'op' or 'top', got {old_place!r}")
        self._emulator = emulator
        self.__name__ = "lightop"
        kernels = _LightopKernels(emulator)
        top_k = self.top_k_per_row_prefill
        if leading_numbers(version)[:2] >= (0, 6):
            self.norm = types.SimpleNamespace(rmsnorm_forward_autograd=kernels.rmsnorm_forward_autograd)
            self.activation = types.SimpleNamespace(silu_and_mul_opt=kernels.silu_and_mul_opt)
            self.attention = types.SimpleNamespace(top_k_per_row_prefill=top_k)
        elif old_place == "top":
            self.rmsnorm_forward_autograd = kernels.rmsnorm_forward_autograd
            self.silu_and_mul_opt = kernels.silu_and_mul_opt
            self.op = types.SimpleNamespace(top_k_per_row_prefill=top_k)
        else:
            self.op = types.SimpleNamespace(rmsnorm_forward_autograd=kernels.rmsnorm_forward_autograd,
                                            silu_and_mul_opt=kernels.silu_and_mul_opt, top_k_per_row_prefill=top_k)

    def top_k_per_row_prefill(self, logits: Tensor, row_starts: Tensor, row_ends: Tensor, indices: Tensor,
                              num_rows: int, stride0: int, stride1: int, topk: int) -> None:
        """vLLM's topKPerRowJob: indices relative to the row start; a row with at most topk keys
        gets 0..len-1 (not sorted by score) and -1 in slots [len, topk)."""
        op = "lightop top_k_per_row_prefill"
        self._emulator.calls["top_k_per_row_prefill"] += 1
        _require(logits.dtype == torch.float32 and logits.dim() == 2, op, "logits must be 2-D float32")
        _require((stride0, stride1) == tuple(logits.stride()), op, f"strides {(stride0, stride1)} do not match "
                 f"logits {tuple(logits.stride())}")
        for name, t in (("row_starts", row_starts), ("row_ends", row_ends)):
            _require(t.dtype == torch.int32 and tuple(t.shape) == (num_rows,), op, f"{name} must be int32 [{num_rows}]")
        _require(indices.dtype == torch.int32 and indices.dim() == 2 and indices.shape[0] >= num_rows
                 and indices.shape[1] >= topk, op, f"indices must be int32 [>= {num_rows}, >= {topk}]")
        _require(num_rows <= logits.shape[0] and topk >= 1, op, "num_rows exceeds the logits rows")
        columns = logits.shape[1]
        for r in range(num_rows):
            start, end = int(row_starts[r]), int(row_ends[r])
            # the kernel trusts the ranges: outside the row it would read other memory
            _require(0 <= start <= end <= columns, op, f"row {r}: range [{start}, {end}) outside [0, {columns}]")
            length = end - start
            if length <= topk:
                indices[r, :length] = torch.arange(length, dtype=torch.int32)
                indices[r, length:topk] = -1
            else:
                chosen = torch.topk(logits[r, start:end], topk).indices
                indices[r, :topk] = chosen.to(torch.int32)


class _VllmOps:
    """torch.ops._C of vLLM: rotary_embedding."""

    def __init__(self, emulator: "DcuEmulator") -> None:
        self._emulator = emulator

    def rotary_embedding(self, positions: Tensor, query: Tensor, key: Tensor | None, head_size: int,
                         cos_sin_cache: Tensor, is_neox: bool) -> None:
        op = "torch.ops._C.rotary_embedding"
        self._emulator.calls["rotary_embedding"] += 1
        vllm_kernels.rotary_embedding(_require, op, positions, query, key, head_size, cos_sin_cache, is_neox)


class DcuEmulator:
    """Stands in for DcuRuntime. `card` is a key of CARDS, `flavor` a key of FLAVORS (the torch
    build); `lightop` (a version, or None: not installed), `lightop_old_place` (where a lightop
    before 0.6 keeps RMSNorm and SiLU-and-mul: "op" or "top"), `vllm` and `grouped_mm` ("ok",
    "absent", "raises") configure the optional packages. `calls` counts vendor calls."""

    EMULATOR = True

    def __init__(self, card: str = "K100_AI", *, flavor: str = "dcu", devices: int = 8,
                 version: str = "2.9.0+das.opt1.dtk2604", lightop: str | None = LIGHTOP_VERSIONS[-1],
                 vllm: bool = True, grouped_mm: str = "ok", lightop_old_place: str = "op") -> None:
        if card not in CARDS or flavor not in FLAVORS or grouped_mm not in ("ok", "absent", "raises"):
            raise ValueError(f"unknown card/flavor/grouped_mm {card!r}/{flavor!r}/{grouped_mm!r}")
        self.card = card
        self.devices = devices
        self.calls: collections.Counter = collections.Counter()
        self.torch = _Torch(self, flavor, version, grouped_mm)
        self.__version__ = version
        self.lightop = _Lightop(self, lightop, lightop_old_place) if lightop else None
        self.lightop_missing = "" if lightop else "lightop not installed (Hygon's fused-op package from DTK / the DAS image)"
        self.vllm_ops = _VllmOps(self) if vllm else None
        self.vllm_ops_missing = "" if vllm else "vLLM's _C ops unavailable (vllm not installed)"
        self._packages = {"lightop": lightop} if lightop else {}

    def package_version(self, name: str) -> str | None:
        return self._packages.get(name)

    def __repr__(self) -> str:
        return f"DcuEmulator(card={self.card!r})"
