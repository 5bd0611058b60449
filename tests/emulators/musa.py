"""A CPU emulator of the MUSA vendor surface glm5_hal's musa adapters call (the surface
backends/musa/runtime.py describes): torch.musa's device queries, torch.rms_norm and
torch._grouped_mm as they run on musa tensors, torch_musa's torch.nn.functional.rope, and
the MUSA build of FlashMLA's flash_mla_sparse_fwd.

Written from the vendors' published code and tests (summarised in /work/notes/vendors_other.md
section 1 and backends/musa/README.md, "Sources"):
* torch_musa tests/unittest/operator/test_rms_norm.py, test_rope (SBHD input, raw-angle
  freq_cis, rotate_half, the multi_latent_attention de-interleave, float32 only, arch >= 22,
  MLA flag only with muDNN >= 3000) and test_grouped_mm.py (2-D x 3-D with int32 end
  offsets, b as a transposed view, fp32/fp16/bf16, bf16 not below arch 22);
* upstream PyTorch's _grouped_mm argument checks (emulators/torch_ops.py);
* MooreThreads/mate's flash_mla_sparse_fwd and its tilelang kernel (bf16, one KV head,
  d_v 512 + 64 rope dims, topk a multiple of 64, heads <= 64 or a multiple of 64, invalid
  indices masked to -2^30 before the softmax, base-2 log-sum-exp, max_logits None) and
  vllm-musa's gate (FlashMLA sparse needs capability major 3).

Violating a documented constraint raises MusaOpError (a RuntimeError, as TORCH_CHECK does);
behaviour the sources do not document raises NotEmulatedError instead of guessing. Plain
CPU tensors stand in for musa tensors. It never calls glm5_hal.reference.
"""
from __future__ import annotations

import collections
import math
import types

import torch
from torch import Tensor

from . import torch_ops

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

#: card -> (capability, torch.musa.get_device_name)
CARDS = {
    "S80": ((2, 1), "MTT S80"),
    "S3000": ((2, 1), "MTT S3000"),
    "S4000": ((2, 2), "MTT S4000"),
    "S5000": ((3, 1), "MTT S5000"),
    "S2000": ((1, 1), "MTT S2000"),
}


class MusaOpError(RuntimeError):
    """What a TORCH_CHECK in the vendor op raises."""


class NotEmulatedError(RuntimeError):
    """Vendor behaviour the sources do not document."""


def _require(ok: bool, op: str, message: str) -> None:
    if not ok:
        raise MusaOpError(f"{op}: {message}")


class _MusaDevice:
    """The torch.musa functions the probe and the kernel launchers use."""

    def __init__(self, emulator: "MusaEmulator") -> None:
        self._emulator = emulator

    def is_available(self) -> bool:
        return self._emulator.devices > 0

    def device_count(self) -> int:
        return self._emulator.devices

    def _lazy_init(self) -> None:
        if self._emulator.devices == 0:
            raise RuntimeError("MUSA call failed lazily at initialization: no MUSA-capable device is detected")

    def current_device(self) -> int:
        self._lazy_init()
        return 0

    def get_device_name(self, device: object = None) -> str:
        self._lazy_init()
        return self._emulator.device_name

    def get_device_capability(self, device: object = None) -> tuple[int, int]:
        self._lazy_init()
        return self._emulator.capability

    def get_device_properties(self, device: object = None) -> types.SimpleNamespace:
        self._lazy_init()
        major, minor = self._emulator.capability
        return types.SimpleNamespace(name=self._emulator.device_name, major=major, minor=minor,
                                     total_memory=48 << 30, multi_processor_count=128)

    def is_bf16_supported(self) -> bool:
        return self._emulator.arch >= 22

    def current_stream(self, device: object = None) -> types.SimpleNamespace:
        """A torch.musa.Stream; `musa_stream` is the raw musaStream_t."""
        self._lazy_init()
        return types.SimpleNamespace(musa_stream=0x4D55, device=device)


class _Functional:
    def __init__(self, emulator: "MusaEmulator") -> None:
        self._emulator = emulator

    def rope(self, input: Tensor, freq_cis: Tensor, rotary_interleaved: bool = False, batch_first: bool = False,
             multi_latent_attention: bool = False) -> Tensor:
        """torch_musa's rope: t = input[..., :rot] (rot = freq_cis.shape[-1]); with the MLA
        flag t is first de-interleaved (even dims, then odd dims); out = t * cos(freq) +
        rotate_half(t) * sin(freq) with rotate_half(t) = cat(-t2, t1); the rest passes."""
        op = "torch.nn.functional.rope"
        emu = self._emulator
        emu.calls["rope"] += 1
        if emu.arch < 22:
            raise NotEmulatedError(f"{op}: torch_musa tests rope only on arch >= 22 (this is mp_{emu.arch})")
        if rotary_interleaved:
            raise NotEmulatedError(f"{op}: rotary_interleaved=True is not covered by torch_musa's tests")
        if multi_latent_attention and emu.mudnn < 3000:
            raise NotEmulatedError(f"{op}: multi_latent_attention is tested only with muDNN >= 3000 "
                                   f"(this is {emu.mudnn})")
        _require(isinstance(input, Tensor) and input.dim() == 4, op, "input must be 4-D (SBHD or BSHD)")
        if input.dtype != torch.float32 or freq_cis.dtype != torch.float32:
            raise NotEmulatedError(f"{op}: torch_musa's rope tests cover float32 only, got {input.dtype} / "
                                   f"{freq_cis.dtype}")
        if freq_cis.dim() == 4:
            _require(freq_cis.shape[1] == freq_cis.shape[2] == 1, op, "a 4-D freq_cis must be [S, 1, 1, D]")
            freq_cis = freq_cis.reshape(freq_cis.shape[0], freq_cis.shape[-1])
        _require(freq_cis.dim() == 2, op, f"freq_cis must be [S, D] or [S, 1, 1, D], got {list(freq_cis.shape)}")
        seq_dim = 1 if batch_first else 0
        _require(freq_cis.shape[0] == input.shape[seq_dim], op,
                 f"freq_cis has {freq_cis.shape[0]} positions, input has {input.shape[seq_dim]} on its sequence dim")
        rot = freq_cis.shape[-1]
        _require(rot % 2 == 0 and rot <= input.shape[-1], op, f"rotary dim {rot} must be even and <= "
                 f"{input.shape[-1]}")
        freq = freq_cis.view(1, -1, 1, rot) if batch_first else freq_cis.view(-1, 1, 1, rot)
        t, rest = input[..., :rot], input[..., rot:]
        if multi_latent_attention:
            t = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)
        first, second = t[..., : rot // 2], t[..., rot // 2:]
        rotated = torch.cat((-second, first), dim=-1)
        return torch.cat((t * torch.cos(freq) + rotated * torch.sin(freq), rest), dim=-1)


class _Torch:
    """The functions of `torch` whose musa kernels the adapters reach."""

    def __init__(self, emulator: "MusaEmulator") -> None:
        self._emulator = emulator
        self.musa = emulator.musa
        self.nn = types.SimpleNamespace(functional=_Functional(emulator))

    def _dtype_on_arch(self, op: str, dtype: torch.dtype) -> None:
        _require(dtype in FLOAT_DTYPES, op, f"dtype {dtype} not supported")
        _require(dtype != torch.bfloat16 or self._emulator.arch >= 22, op,
                 f"bf16 is not supported on arch less than 22 (this is mp_{self._emulator.arch})")

    def rms_norm(self, input: Tensor, normalized_shape, weight: Tensor | None = None,
                 eps: float | None = None) -> Tensor:
        """The fused MUSA RMSNorm: float32 statistics over normalized_shape, times weight,
        rounded once to the input dtype."""
        op = "torch.rms_norm(musa)"
        self._emulator.calls["rms_norm"] += 1
        self._dtype_on_arch(op, input.dtype)
        shape = tuple(int(n) for n in normalized_shape)
        _require(1 <= len(shape) <= input.dim() and tuple(input.shape[-len(shape):]) == shape, op,
                 f"normalized_shape {list(shape)} does not match input shape {list(input.shape)}")
        if weight is not None:
            _require(tuple(weight.shape) == shape, op, f"weight shape {list(weight.shape)} != normalized_shape")
            if weight.dtype != input.dtype:
                raise NotEmulatedError(f"{op}: mixed input/weight dtypes ({input.dtype}, {weight.dtype}) are "
                                       f"not covered by torch_musa's tests")
        eps = torch.finfo(input.dtype).eps if eps is None else float(eps)
        dims = tuple(range(input.dim() - len(shape), input.dim()))
        xf = input.float()
        y = xf * torch.rsqrt(xf.square().mean(dim=dims, keepdim=True) + eps)
        if weight is not None:
            y = y * weight.float()
        return y.to(input.dtype)

    def _grouped_mm(self, mat_a: Tensor, mat_b: Tensor, offs: Tensor | None = None, bias: Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> Tensor:
        """Upstream torch._grouped_mm (emulators/torch_ops.py) with torch_musa's device rule:
        bf16 not below arch 22."""
        op = "torch._grouped_mm(musa)"
        self._emulator.calls["_grouped_mm"] += 1
        _require(mat_a.dtype == mat_b.dtype, op, "mat_a and mat_b must have the same dtype")
        self._dtype_on_arch(op, mat_a.dtype)
        try:
            return torch_ops.grouped_mm(op, mat_a, mat_b, offs, bias, out_dtype)
        except torch_ops.TorchCheckError as exc:
            raise MusaOpError(str(exc)) from None
        except torch_ops.GroupedMmNotEmulated as exc:
            raise NotEmulatedError(str(exc)) from None


class FlashMlaEmulator:
    """The MUSA build of FlashMLA's Python interface (flash_mla_sparse_fwd)."""

    NEG_MASK = -(2.0 ** 30)  # the kernel's logit for an invalid index

    def __init__(self, emulator: "MusaEmulator") -> None:
        self._emulator = emulator

    def flash_mla_sparse_fwd(self, q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float, d_v: int = 512,
                             attn_sink: Tensor | None = None, topk_length: Tensor | None = None):
        """Sparse MLA prefill: (out [s_q, h_q, 512] bf16, None, lse [s_q, h_q] float32, base 2)."""
        op = "flash_mla_sparse_fwd"
        emu = self._emulator
        emu.calls[op] += 1
        _require(emu.capability[0] == 3, op, f"FlashMLA Sparse requires device capability major == 3, got "
                 f"{emu.capability}")
        assert attn_sink is None, "attn_sink Not supported Now"
        assert topk_length is None, "topk_length Not supported Now"
        assert d_v == 512, "sprase prefill only support d_v 512"
        for name, t, dtype in (("q", q, torch.bfloat16), ("kv", kv, torch.bfloat16), ("indices", indices, torch.int32)):
            _require(isinstance(t, Tensor) and t.dim() == 3, op, f"{name} must be 3-D")
            _require(t.dtype == dtype, op, f"{name} must be {dtype}, got {t.dtype}")
            _require(t.is_contiguous(), op, f"{name} must be contiguous")
        s_q, heads, dqk = q.shape
        s_kv, kv_heads, _ = kv.shape
        topk = indices.shape[2]
        _require(kv.shape[2] == dqk and dqk - d_v == 64, op, f"expects d_qk = d_v + 64 = 576 in q and kv, got "
                 f"{dqk} and {kv.shape[2]}")
        _require(kv_heads == 1 and tuple(indices.shape[:2]) == (s_q, 1), op,
                 f"one KV head: kv [s_kv, 1, d_qk], indices [s_q, 1, topk]; got {list(kv.shape)}, {list(indices.shape)}")
        _require(topk % 64 == 0, op, f"topk must be a multiple of block_I=64, got {topk}")
        _require(heads <= 64 or heads % 64 == 0, op, f"head_kv should be a multiple of 64, got {heads}")
        idx = indices[:, 0, :].long()
        valid = (idx >= 0) & (idx < s_kv)
        rows = kv[:, 0, :].float()[torch.where(valid, idx, 0)]  # [s_q, topk, d_qk]
        rows = rows * valid[..., None]                          # the robust loads return 0
        raw = torch.einsum("shd,skd->shk", q.float(), rows)
        raw = torch.where(valid[:, None, :], raw, torch.full_like(raw, self.NEG_MASK))
        scale = float(sm_scale) * math.log2(math.e)
        peak = raw.amax(dim=-1, keepdim=True)
        weights = torch.exp2((raw - peak) * scale)
        total = weights.sum(-1)
        out = torch.einsum("shk,skd->shd", weights, rows[..., :d_v]) / total[..., None]
        lse = torch.log2(total) + peak[..., 0] * scale
        return out.to(torch.bfloat16), None, lse


class MusaEmulator:
    """Stands in for MusaRuntime. `card` is a key of CARDS; `devices`, `version`, `mudnn` and
    `flash_mla` configure what the probe and the adapters see. `calls` counts vendor calls."""

    EMULATOR = True

    def __init__(self, card: str = "S4000", *, devices: int = 8, version: str = "2.9.1", mudnn: int = 3100,
                 flash_mla: bool = True) -> None:
        if card not in CARDS:
            raise ValueError(f"unknown card {card!r}; known: {sorted(CARDS)}")
        self.card = card
        self.capability, self.device_name = CARDS[card]
        self.arch = self.capability[0] * 10 + self.capability[1]
        self.devices = devices
        self.__version__ = version
        self.mudnn = mudnn
        self.calls: collections.Counter = collections.Counter()
        self.musa = _MusaDevice(self)
        self.torch = _Torch(self)
        self.flash_mla = FlashMlaEmulator(self) if flash_mla else None
        self.flash_mla_missing = "" if flash_mla else "MUSA FlashMLA unavailable (flash_mla not installed; mate not installed)"

    def __repr__(self) -> str:
        return f"MusaEmulator(card={self.card!r}, arch=mp_{self.arch})"

    def mudnn_version(self) -> int:
        return self.mudnn
