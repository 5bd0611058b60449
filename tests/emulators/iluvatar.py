"""A CPU emulator of the Iluvatar CoreX surface glm5_hal's iluvatar adapters call (the surface
backends/iluvatar/runtime.py describes): the parts of a CoreX build of torch the probe reads
(the `torch.corex` attribute FlagGems keys on, torch.version.cuda, torch.cuda's device
queries), the `ixsmi` device query tool, ixformer's inference functions (rms_norm,
dynamic_scaled_int8_quant, w8a8) and FlagGems' Iluvatar top_k_per_row_prefill. It can also
pose as an NVIDIA, a Hygon DCU or an Enflame torch (a Kunlun one is torch_xmlir being installed:
tests patch glm5_hal.vendors.installed), so that detection is tested
against every stack that answers to `cuda`.

ixformer is closed (no public source of it was found); its emulation is written from how
public code calls it, and the numerics follow the vLLM kernels of the same names:
* ModelTC/LightX2V @f8aee98b lightx2v_platform/ops/norm/iluvatar_cuda/iluvatar_rms_norm.py:17
  (`ixf.rms_norm(x.contiguous(), weight, eps)` returns the output) and
  ops/mm/iluvatar_cuda/mm_weight.py:84-97 (`dynamic_scaled_int8_quant(output=int8 like x,
  input=x, scale=float32 x.shape[:-1])`; `w8a8(input=int8 [M, K], weight=int8 [N, K],
  i_scales=[M], w_scales=[N], bias=..., out_dtype=...)`);
* Deep-Spark/DeepSparkInference @79773330 models/multimodal/diffusion_model/flux.1-dev/xdit/
  w8a8_linear.py:4, 43-57 (the same two functions; w8a8's sixth positional argument is a
  preallocated output of x's dtype, which it also returns) and models/speech/
  speech_synthesis/cosyvoice/igie/cv3-eval/pip3.txt:85 (ixformer 0.7.0+corex.4.5.0);
  models/cv/classification/dinov2/igie/dinov2-patch/export.py:9 ("ixformer flash-attn only
  supports fp16/bf16": the emulation takes fp16/bf16 activations only);
* vllm-project/vllm csrc/quantization/compressed_tensors/int8_quant_kernels.cu (scale =
  absmax / 127, codes round-to-nearest-even(x * 127 / absmax)) and csrc/layernorm_kernels.cu
  (float32 sums, x * rsqrt rounded to the type, then times the weight).
FlagGems' kernels are public: fused/silu_and_mul.py @ed2508bc (silu in float32 times B, one
rounding) and src/flag_gems/runtime/backend/_iluvatar/fused/
top_k_per_row_prefill.py @ed2508bc (unchanged since v5.3.1): float32 logits, int32 row
[start, end), indices relative to the start; candidates packed (monotonic key << 32 | index)
into a zeroed buffer of CAND_PAD = next_pow2(max(2 * top_k, 2048)) slots and sorted
descending, so ties go to the larger index and a row shorter than top_k gets index 0 in its
tail slots (the zeroed buffer's packs); every element at or above the threshold bucket is
written to that buffer without a bound, so a row whose candidates exceed CAND_PAD writes past
its row (emulated as an error). Histogram buckets are the top 12 bits of the key.

Violating a documented constraint raises IxOpError (a RuntimeError); behaviour no source
documents raises NotEmulatedError. It never calls glm5_hal.reference.
"""
from __future__ import annotations

import collections
import types

import torch
from torch import Tensor

from . import vllm_kernels

HALVES = (torch.float16, torch.bfloat16)

#: card -> torch.cuda.get_device_name (CoreX names its products BI-V150 / MR-V100:
#: DeepSparkInference tests/model_info.json "release_gpgpu"; the exact name string is UNVERIFIED)
CARDS = {
    "BI-V150": "Iluvatar BI-V150",
    "MR-V100": "Iluvatar MR-V100",
    "H100": "NVIDIA H100 80GB HBM3",
}
#: flavor -> (torch.__version__, torch.version.cuda, torch.version.hip, marker attributes)
FLAVORS = {
    "corex": ("2.7.1+corex.4.4.0", "10.2", None, {"corex": True}),
    "corex-plain": ("2.7.1", "10.2", None, {}),       # no marker at all: ixsmi decides
    "cuda": ("2.9.0+cu128", "12.8", None, {}),
    "dcu": ("2.9.0+das.opt1.dtk2604", None, "6.3.25211", {"__hcu_version__": "2.9.0"}),
    "enflame": ("2.7.0", "12.8", None, {"gcu": types.SimpleNamespace()}),
    "cpu": ("2.9.0+cpu", None, None, {}),
}


class IxOpError(RuntimeError):
    """What a check in ixformer / FlagGems raises."""


class NotEmulatedError(RuntimeError):
    """Vendor behaviour the sources do not document."""


def _require(ok: bool, op: str, message: str) -> None:
    if not ok:
        raise IxOpError(f"{op}: {message}")


class _CudaDevice:
    """torch.cuda of a CoreX build: Iluvatar GPUs answer as cuda."""

    def __init__(self, emulator: "IluvatarEmulator") -> None:
        self._emulator = emulator

    def is_available(self) -> bool:
        return self._emulator.devices > 0

    def device_count(self) -> int:
        return self._emulator.devices

    def current_device(self) -> int:
        if self._emulator.devices == 0:
            raise RuntimeError("No CUDA GPUs are available")
        return 0

    def get_device_name(self, device: object = None) -> str:
        self.current_device()
        return CARDS[self._emulator.card]

    def current_stream(self, device: object = None) -> types.SimpleNamespace:
        return types.SimpleNamespace(cuda_stream=0x1C0E, device=device)


class _Torch:
    def __init__(self, emulator: "IluvatarEmulator", flavor: str) -> None:
        version, cuda, hip, markers = FLAVORS[flavor]
        self.__version__ = version
        self.version = types.SimpleNamespace(cuda=cuda, hip=hip)
        for name, value in markers.items():
            setattr(self, name, value)
        self.cuda = _CudaDevice(emulator)


class _Ixformer:
    """ixformer.inference.functions: the three functions the adapters call."""

    def __init__(self, emulator: "IluvatarEmulator") -> None:
        self._emulator = emulator

    def rms_norm(self, input: Tensor, weight: Tensor, eps: float) -> Tensor:
        op = "ixformer rms_norm"
        self._emulator.calls["rms_norm"] += 1
        if input.dtype not in HALVES:
            raise NotEmulatedError(f"{op}: public callers run it on fp16/bf16 only, got {input.dtype}")
        _require(input.is_contiguous(), op, "input must be contiguous (callers pass input.contiguous())")
        _require(weight.dtype == input.dtype and weight.shape == (input.shape[-1],), op,
                 f"weight must be [{input.shape[-1]}] {input.dtype}, got {list(weight.shape)} {weight.dtype}")
        xf = input.float()
        normed = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + float(eps))).to(input.dtype)
        return normed * weight

    def dynamic_scaled_int8_quant(self, output: Tensor, input: Tensor, scale: Tensor) -> None:
        op = "ixformer dynamic_scaled_int8_quant"
        self._emulator.calls["dynamic_scaled_int8_quant"] += 1
        if input.dtype not in HALVES:
            raise NotEmulatedError(f"{op}: public callers run it on fp16/bf16 only, got {input.dtype}")
        _require(input.is_contiguous() and output.is_contiguous(), op, "input and output must be contiguous")
        _require(output.dtype == torch.int8 and output.shape == input.shape, op,
                 "output must be int8 shaped like input")
        _require(scale.dtype == torch.float32 and scale.shape == input.shape[:-1], op,
                 f"scale must be float32 {list(input.shape[:-1])}")
        codes, row_scale = vllm_kernels.dynamic_int8(input)  # a zero row: -128 codes
        output.copy_(codes)
        scale.copy_(row_scale.squeeze(-1))

    def w8a8(self, input: Tensor, weight: Tensor, i_scales: Tensor, w_scales: Tensor, bias: Tensor | None = None,
             output: Tensor | None = None, out_dtype: torch.dtype | None = None) -> Tensor:
        op = "ixformer w8a8"
        self._emulator.calls["w8a8"] += 1
        _require(input.dtype == torch.int8 and weight.dtype == torch.int8, op, "input and weight must be int8")
        _require(input.dim() == 2 and weight.dim() == 2 and input.shape[1] == weight.shape[1], op,
                 f"input [M, K] and weight [N, K] must agree on K, got {list(input.shape)}, {list(weight.shape)}")
        rows, cols = input.shape[0], weight.shape[0]
        _require(i_scales.dtype == torch.float32 and i_scales.numel() == rows, op, f"i_scales must be float32 [{rows}]")
        _require(w_scales.dtype == torch.float32 and w_scales.numel() == cols, op, f"w_scales must be float32 [{cols}]")
        dtype = output.dtype if output is not None else out_dtype
        if dtype not in HALVES:
            raise NotEmulatedError(f"{op}: public callers take fp16/bf16 outputs only, got {dtype}")
        if output is not None:
            _require(output.shape == (rows, cols) and output.is_contiguous(), op, f"output must be [{rows}, {cols}]")
        if bias is not None:
            _require(bias.shape == (cols,) and bias.dtype == dtype, op, f"bias must be [{cols}] {dtype}")
        # int32 accumulation (exact in float64), scaled in float32
        acc = (input.to(torch.float64) @ weight.to(torch.float64).T).float()
        result = acc * i_scales.reshape(rows, 1) * w_scales.reshape(1, cols)
        if bias is not None:
            result = result + bias.float()
        if output is None:
            return result.to(dtype)
        output.copy_(result)
        return output


class _FlagGemsIluvatar:
    """flag_gems.runtime.backend._iluvatar.fused (top_k_per_row_prefill) and flag_gems.fused
    (silu_and_mul)."""

    def __init__(self, emulator: "IluvatarEmulator") -> None:
        self._emulator = emulator

    def silu_and_mul(self, A: Tensor, B: Tensor) -> Tensor:
        """FlagGems fused/silu_and_mul.py: a pointwise Triton kernel (any strides, same shapes),
        silu(A) in float32 times B, the result in the promoted dtype of A and B."""
        op = "flag_gems silu_and_mul"
        self._emulator.calls["silu_and_mul"] += 1
        _require(A.shape == B.shape, op, f"A and B must have one shape, got {list(A.shape)}, {list(B.shape)}")
        if A.dtype not in (torch.float32, *HALVES) or B.dtype != A.dtype:
            raise NotEmulatedError(f"{op}: only same-dtype float32/float16/bfloat16 inputs are emulated")
        a = A.float()
        return (a / (1.0 + torch.exp(-a)) * B.float()).to(A.dtype)

    @staticmethod
    def _keys(values: Tensor) -> Tensor:
        """The kernel's monotonic uint32 key of a float32, as int64."""
        bits = values.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        return torch.where(bits >= 0x80000000, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)

    def top_k_per_row_prefill(self, logits: Tensor, row_starts: Tensor, row_ends: Tensor, indices: Tensor,
                              num_rows: int, stride0: int, stride1: int, top_k: int) -> None:
        op = "flag_gems _iluvatar top_k_per_row_prefill"
        self._emulator.calls["top_k_per_row_prefill"] += 1
        _require(logits.dtype == torch.float32 and logits.dim() == 2, op, "logits must be 2-D float32")
        for name, t in (("row_starts", row_starts), ("row_ends", row_ends)):
            _require(t.dtype == torch.int32 and t.numel() >= num_rows, op, f"{name} must be int32 [{num_rows}]")
        _require(indices.dtype == torch.int32 and indices.dim() == 2 and indices.shape[0] >= num_rows
                 and indices.shape[1] >= top_k and indices.is_contiguous(), op,
                 f"indices must be contiguous int32 [>= {num_rows}, >= {top_k}]")
        columns = logits.shape[1]
        cand_pad = 1
        while cand_pad < max(2 * top_k, 2048):
            cand_pad <<= 1
        for r in range(num_rows):
            start, end = int(row_starts[r]), int(row_ends[r])
            start_c, end_c = max(start, 0), min(end, columns)
            keys = self._keys(logits[r, start_c:end_c]) if end_c > start_c else torch.zeros(0, dtype=torch.int64)
            buckets = keys >> 20
            hist = torch.bincount(buckets, minlength=4096)
            from_top = hist.flip(0).cumsum(0).flip(0)
            threshold = max(int((from_top >= top_k).sum()) - 1, 0)
            chosen = buckets >= threshold
            _require(int(chosen.sum()) <= cand_pad, op,
                     f"row {r}: {int(chosen.sum())} candidates at or above the threshold bucket overflow the "
                     f"{cand_pad}-slot candidate buffer (written without a bound)")
            relative = torch.arange(start_c, end_c, dtype=torch.int64)[chosen] - start
            packs = torch.zeros(cand_pad, dtype=torch.int64)
            packs[: relative.numel()] = (keys[chosen] << 32) | (relative & 0xFFFFFFFF)
            # descending as uint64: the key's top bit is the int64 sign bit
            order = torch.argsort(packs ^ (-(2 ** 63)), descending=True, stable=True)
            low = (packs[order] & 0xFFFFFFFF)
            low = torch.where(low >= 2 ** 31, low - 2 ** 32, low)
            indices[r, :top_k] = low[:top_k].to(torch.int32)


class IluvatarEmulator:
    """Stands in for IluvatarRuntime. `card` is a key of CARDS, `flavor` a key of FLAVORS
    (which torch build); `ixsmi` whether the device query tool runs; `ixformer` and
    `flag_gems` (versions, or None: not installed) configure the op libraries. `calls`
    counts vendor calls."""

    EMULATOR = True

    def __init__(self, card: str = "BI-V150", *, flavor: str = "corex", devices: int = 8, ixsmi: bool = True,
                 ixformer: str | None = "0.7.0+corex.4.5.0", flag_gems: str | None = "5.3.4") -> None:
        if card not in CARDS or flavor not in FLAVORS:
            raise ValueError(f"unknown card/flavor {card!r}/{flavor!r}")
        self.card, self.devices, self._ixsmi = card, devices, ixsmi
        self.calls: collections.Counter = collections.Counter()
        self.torch = _Torch(self, flavor)
        self.__version__ = self.torch.__version__
        self.ixformer = _Ixformer(self) if ixformer else None
        self.ixformer_missing = "" if ixformer else "ixformer not installed (Iluvatar's op library, from the CoreX SDK)"
        gems = _FlagGemsIluvatar(self) if flag_gems else None
        self.top_k_per_row_prefill = gems.top_k_per_row_prefill if gems else None
        self.silu_and_mul = gems.silu_and_mul if gems else None
        self.flag_gems_missing = "" if flag_gems else "flag_gems not installed (FlagGems' Iluvatar kernels)"
        self.flag_gems_silu_missing = "" if flag_gems else "flag_gems not installed (FlagGems' fused ops)"
        self._packages = {k: v for k, v in (("ixformer", ixformer), ("flag_gems", flag_gems)) if v}

    def package_version(self, name: str) -> str | None:
        return self._packages.get(name)

    def query_tool(self) -> tuple[bool, str]:
        """(whether `ixsmi` ran and exited 0, what it said or why not)."""
        if self._ixsmi:
            return True, "ixsmi: 8 devices"
        return False, "ixsmi not found on PATH"

    def __repr__(self) -> str:
        return f"IluvatarEmulator(card={self.card!r})"
