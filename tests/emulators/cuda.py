"""A CPU emulator of the NVIDIA surface glm5_hal's cuda adapters call (the surface
backends/cuda/runtime.py describes): torch.cuda's device queries and torch's own CUDA ops as
they run on cuda tensors (the fused rms_norm, _grouped_mm, blockwise _scaled_mm), FlashMLA's
flash_mla_sparse_fwd in both of its interface generations, and DeepGEMM's FP8 GEMMs.

Written from the libraries' published code and tests, never from glm5_hal.reference:
* FlashMLA (github.com/deepseek-ai/FlashMLA): flash_mla/flash_mla_interface.py and
  csrc/pybind.cpp (sparse_prefill_fwd) @fd249aa -- interface 1: h_q a multiple of 64 on sm_90,
  exactly 128 on sm_100, topk % 128, bf16, d_qk 576 / d_v 512, base-2 lse and max_logits (-inf
  for a row without a valid index); csrc/api/sparse_fwd.h and tests/ref.py, tests/lib.py
  @9241ae3 -- interface 2: h_q in {64, 128}, d_qk 576 or 512, natural-log lse (+inf for a row
  without a valid index, max_logits -inf), attn_sink / topk_length. Both: one KV head, indices
  int32 [s_q, h_kv, topk], an index is invalid iff < 0 or >= s_kv; the kernel rounds P to
  bf16 before the P.V product and accumulates in fp32.
* DeepGEMM (github.com/deepseek-ai/DeepGEMM) @v2.1.1 and @54e2261: csrc/apis/gemm.hpp
  (fp8_gemm_nt, m_grouped_fp8_gemm_nt_contiguous: K-major fp8 e4m3 A and B, sfa [M, ceil(K/128)],
  sfb [ceil(N/128), ceil(K/128)] contiguous fp32, D bf16 N-major for the sm_90 1D2D kernel,
  n > 0 and k > 0 asserted in 2.1.x), csrc/utils/layout.hpp (alignment 128),
  tests/generators.py (the contiguous layout: each group's rows start at a multiple of the
  alignment, padding rows -1), deep_gemm/utils/math.py (scales multiply).
* PyTorch 2.11.0 (the +cu130 wheel's native_functions.yaml and libtorch_cuda.so strings;
  aten/src/ATen/native/cuda/GroupedBlas.cpp @00d4eaf9, ScaledBlas.cpp @0174dfab): _grouped_mm's
  CUTLASS path is bf16 on capability major 9 or 10, anything else copies offs to the host
  (counted here as a host sync); _scaled_mm's 1x128 x 128x128 blockwise scaling is sm_90 only,
  use_fast_accum False, scale_a outer-dim-major [M, K/128], scale_b = w_scale.t() (checked
  unpadded, as torch checks it), read the way cuBLASLt reads it: each row of weight blocks at a
  multiple of ceil(K/128) rounded up to 4 (test/test_scaled_matmul_cuda.py @00166b21). The same
  torch-op behaviours hold up to the 2.15 wheels (backends/cuda/arch.py).

Violating a documented constraint raises CudaOpError (a RuntimeError, as TORCH_CHECK and
DeepGEMM's DG_HOST_ASSERT do); undocumented behaviour raises NotEmulatedError. Plain CPU
tensors stand in for cuda tensors.
"""
from __future__ import annotations

import collections
import math
import types

import torch
from torch import Tensor

from . import torch_ops

#: gpu -> (capability, torch.cuda.get_device_name, multiprocessors, memory GiB)
GPUS = {
    "A100": ((8, 0), "NVIDIA A100-SXM4-80GB", 108, 80),
    "L40S": ((8, 9), "NVIDIA L40S", 142, 48),
    "H200": ((9, 0), "NVIDIA H200", 132, 141),
    "B200": ((10, 0), "NVIDIA B200", 148, 180),
    "RTX5090": ((12, 0), "NVIDIA GeForce RTX 5090", 170, 32),
    "T4": ((7, 5), "Tesla T4", 40, 16),
}

#: FlashMLA interface generation -> (dist version, sparse_fwd parameter names)
FLASH_MLA_VERSIONS = {1: "1.0.0+fd249aa", 2: "1.0.0+9241ae3"}


class CudaOpError(RuntimeError):
    """What a TORCH_CHECK / DG_HOST_ASSERT in the library raises."""


class NotEmulatedError(RuntimeError):
    """Library behaviour the sources do not document."""


def _require(ok: bool, op: str, message: str) -> None:
    if not ok:
        raise CudaOpError(f"{op}: {message}")


class _CudaDevice:
    """The torch.cuda functions the probe and the kernel launchers use."""

    def __init__(self, emulator: "CudaEmulator") -> None:
        self._emulator = emulator

    def is_available(self) -> bool:
        return self._emulator.devices > 0

    def device_count(self) -> int:
        return self._emulator.devices

    def current_device(self) -> int:
        return 0

    def get_device_name(self, device: object = None) -> str:
        return self._emulator.device_name

    def get_device_capability(self, device: object = None) -> tuple[int, int]:
        return self._emulator.capability

    def get_device_properties(self, device: object = None) -> types.SimpleNamespace:
        emu = self._emulator
        return types.SimpleNamespace(name=emu.device_name, major=emu.capability[0], minor=emu.capability[1],
                                     multi_processor_count=emu.multiprocessors, total_memory=emu.memory_gib << 30)

    def current_stream(self, device: object = None) -> types.SimpleNamespace:
        return types.SimpleNamespace(cuda_stream=0)

    def synchronize(self, device: object = None) -> None:
        self._emulator.host_syncs += 1


class _Torch:
    """The functions of a CUDA build of `torch` the adapters reach."""

    def __init__(self, emulator: "CudaEmulator", version: str) -> None:
        self._emulator = emulator
        self.__version__ = version
        self.version = types.SimpleNamespace(cuda="13.0", hip=None)
        self.cuda = _CudaDevice(emulator)

    def rms_norm(self, input: Tensor, normalized_shape, weight: Tensor | None = None,
                 eps: float | None = None) -> Tensor:
        """rms_norm -> _fused_rms_norm_cuda: float32 statistics, times weight, rounded once."""
        op = "torch.rms_norm(cuda)"
        self._emulator.calls["rms_norm"] += 1
        shape = tuple(int(n) for n in normalized_shape)
        _require(tuple(input.shape[-len(shape):]) == shape, op, f"normalized_shape {list(shape)} does not match "
                 f"{list(input.shape)}")
        if weight is not None and weight.dtype != input.dtype:
            raise NotEmulatedError(f"{op}: a weight of another dtype than the input (2.11's choice is unverified)")
        eps = torch.finfo(input.dtype).eps if eps is None else float(eps)
        dims = tuple(range(input.dim() - len(shape), input.dim()))
        xf = input.float()
        y = xf * torch.rsqrt(xf.square().mean(dim=dims, keepdim=True) + eps)
        return (y * weight.float() if weight is not None else y).to(input.dtype)

    def _grouped_mm(self, mat_a: Tensor, mat_b: Tensor, offs: Tensor | None = None, bias: Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> Tensor:
        op = "torch._grouped_mm(cuda)"
        emu = self._emulator
        emu.calls["_grouped_mm"] += 1
        fast = mat_a.dtype == mat_b.dtype == torch.bfloat16 and (out_dtype in (None, torch.bfloat16)) \
            and emu.capability[0] in (9, 10)
        if not fast:
            emu.host_syncs += 1  # _grouped_mm_fallback: offs.cpu(), then one mm per group
        try:
            return torch_ops.grouped_mm(op, mat_a, mat_b, offs, bias, out_dtype)
        except torch_ops.TorchCheckError as exc:
            raise CudaOpError(str(exc)) from None
        except torch_ops.GroupedMmNotEmulated as exc:
            raise NotEmulatedError(str(exc)) from None

    def _scaled_mm(self, mat_a: Tensor, mat_b: Tensor, scale_a: Tensor, scale_b: Tensor, bias: Tensor | None = None,
                   scale_result: Tensor | None = None, out_dtype: torch.dtype | None = None,
                   use_fast_accum: bool = False) -> Tensor:
        """The DeepSeek blockwise recipe only: A [M, K] row-major e4m3 with scale_a [M, K/128]
        outer-dim-major, B [K, N] column-major e4m3 with scale_b [K/128, N/128] (the transpose of
        a contiguous [N/128, K/128])."""
        op = "torch._scaled_mm(cuda)"
        emu = self._emulator
        emu.calls["_scaled_mm"] += 1
        m, k = mat_a.shape
        n = mat_b.shape[1]
        blockwise = scale_a.dim() == 2 and scale_a.shape == (m, math.ceil(k / 128))
        if not blockwise:
            raise NotEmulatedError(f"{op}: only the 1x128 x 128x128 blockwise recipe is emulated")
        _require(emu.capability[0] == 9, op, "DeepSeek style (1x128, 128x128) scaling only supported in CUDA for SM90")
        _require(not use_fast_accum, op, "scaled_gemm doesn't support fast accum with 1x128/128x128 blockwise scaling")
        _require(mat_a.dtype == mat_b.dtype == torch.float8_e4m3fn, op, "expected float8_e4m3fn operands")
        _require(mat_a.stride(1) == 1 and mat_b.stride(0) == 1, op,
                 "Only multiplication of row-major and column-major matrices is supported by cuBLASLt")
        _require(k % 16 == 0 and n % 16 == 0, op, "mat2 dims must be multiples of 16")
        _require(scale_a.stride(0) == 1 and scale_a.dtype == torch.float32, op,
                 "scale_a for 1x128 must be outer-dim-major float32 [M, K/128]")
        _require(scale_b.shape == (math.ceil(k / 128), math.ceil(n / 128)) and scale_b.t().is_contiguous(), op,
                 "scale_b for 128x128 must be the transpose of a contiguous [N/128, K/128]")
        _require(bias is None and scale_result is None, op, "bias and scale_result are not emulated")
        out_dtype = out_dtype or mat_a.dtype
        _require(out_dtype == torch.bfloat16, op, "only a bf16 output is emulated (others unverified in 2.11)")
        a = mat_a.float() * scale_a.repeat_interleave(128, dim=1)[:, :k]
        weight_scales = _as_cublaslt_reads_128x128(scale_b.t(), math.ceil(k / 128))    # [N/128, K/128]
        b = mat_b.float() * weight_scales.t().repeat_interleave(128, dim=0)[:k].repeat_interleave(128, dim=1)[:, :n]
        return (a @ b).to(out_dtype)


def _as_cublaslt_reads_128x128(scales: Tensor, k_blocks: int) -> Tensor:
    """The [ceil(N/128), ceil(K/128)] weight scales cuBLASLt reads from the pointer torch passes:
    row r starts at element r * L4, L4 = ceil(K/128) rounded up to 4 (pytorch
    test/test_scaled_matmul_cuda.py @00166b21 _pad_128x128_scales, after cuBLAS's "128x128 2D
    block scaling" layout; torch._scaled_mm hands over only data_ptr(), ScaledBlas.cpp @0174dfab).
    A buffer laid out with another row stride is read wrongly, as on the GPU; what lies past the
    buffer's end is undefined and read here as NaN."""
    rows = scales.shape[0]
    padded = -(-k_blocks // 4) * 4
    storage = scales.untyped_storage()
    flat = torch.empty(0, dtype=scales.dtype).set_(storage, 0, (storage.nbytes() // scales.element_size(),))
    start = scales.storage_offset()
    wanted = rows * padded
    window = torch.full((wanted,), math.nan, dtype=scales.dtype)
    available = max(0, min(wanted, flat.numel() - start))
    window[:available] = flat[start:start + available]
    return window.view(rows, padded)[:, :k_blocks]


class FlashMlaEmulator:
    """FlashMLA's Python interface, generation `interface` (1: fd249aa, 2: 082094b .. 9241ae3)."""

    def __init__(self, emulator: "CudaEmulator", interface: int) -> None:
        self._emulator = emulator
        self.interface = interface
        self.__version__ = "1.0.0"

    def flash_mla_sparse_fwd(self, q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float, d_v: int = 512,
                             attn_sink: Tensor | None = None, topk_length: Tensor | None = None):
        """(out [s_q, h_q, d_v] bf16, max_logits [s_q, h_q] fp32, lse [s_q, h_q] fp32)."""
        op = "flash_mla_sparse_fwd"
        emu = self._emulator
        emu.calls[op] += 1
        major, minor = emu.capability
        if self.interface == 1:
            _require(attn_sink is None and topk_length is None, op, "interface 1 has no attn_sink / topk_length")
            _require(major == 9 and minor == 0 or major == 10, op, "Unsupported architecture")
        else:
            _require(major == 9 and minor == 0 or major == 10, op, "Unsupported architecture for sparse fwd")
            if attn_sink is not None or topk_length is not None:
                raise NotEmulatedError(f"{op}: attn_sink / topk_length")
        for name, t, dtype in (("q", q, torch.bfloat16), ("kv", kv, torch.bfloat16), ("indices", indices, torch.int32)):
            _require(t.dim() == 3 and t.dtype == dtype, op, f"{name} must be a 3-D {dtype} tensor")
            _require(t.stride(-1) == 1, op, f"{name}'s last dim must be contiguous")
        s_q, heads, dqk = q.shape
        s_kv, kv_heads, _ = kv.shape
        topk = indices.shape[2]
        dims = ((576, 512),) if self.interface == 1 else ((576, 512), (512, 512))
        _require((dqk, d_v) in dims and kv.shape[2] == dqk, op, f"unsupported d_qk {dqk} / d_v {d_v}")
        _require(kv_heads == 1 and tuple(indices.shape[:2]) == (s_q, 1), op, "h_kv must be 1")
        _require(topk > 0 and topk % 128 == 0, op, f"topk must be a multiple of 128, got {topk}")
        if self.interface == 1:
            _require(heads % 64 == 0 if major == 9 else heads == 128, op, f"unsupported h_q {heads}")
        else:
            _require(heads in (64, 128), op, f"h_q must be 64 or 128, got {heads}")
        idx = indices[:, 0, :].long()
        valid = (idx >= 0) & (idx < s_kv)
        rows = kv[:, 0, :].float()[torch.where(valid, idx, 0)]            # [s_q, topk, d_qk]
        z = torch.einsum("shd,skd->shk", q.float(), rows) * float(sm_scale)
        z = torch.where(valid[:, None, :], z, torch.full_like(z, -math.inf))
        peak = z.amax(dim=-1, keepdim=True)
        empty = ~valid.any(-1)                                            # [s_q]
        p = torch.exp(z - torch.where(torch.isinf(peak), 0.0, peak))
        total = p.sum(-1)
        p_bf16 = (p / total.clamp(min=1e-30)[..., None]).to(torch.bfloat16).float()  # P rounded before P.V
        out = torch.einsum("shk,skd->shd", p_bf16, rows[..., :d_v])
        out = out.masked_fill(empty[:, None, None], 0.0)
        lse = torch.log(total) + peak[..., 0]
        max_logits = peak[..., 0]
        if self.interface == 1:   # base 2: log2-sum-exp2 of the log2-scaled scores; empty rows -inf
            lse, max_logits = lse * math.log2(math.e), max_logits * math.log2(math.e)
        else:                     # natural; empty rows: lse +inf, max_logits -inf
            lse = lse.masked_fill(empty[:, None], math.inf)
        return out.to(torch.bfloat16), max_logits.float(), lse.float()


class DeepGemmEmulator:
    """DeepGEMM's FP8 GEMMs of version `version` ("2.1.1", "2.3.0", "2.6.1", ...)."""

    ALIGNMENT = 128

    def __init__(self, emulator: "CudaEmulator", version: str) -> None:
        self._emulator = emulator
        self.__version__ = version
        self._numbers = tuple(int(v) for v in version.split("+")[0].split("."))

    def get_mk_alignment_for_contiguous_layout(self) -> int:
        return self.ALIGNMENT

    def _arch(self, op: str) -> None:
        major = self._emulator.capability[0]
        _require(major in (9, 10), op, "Unsupported architecture or scaling factor types")
        if major == 10:
            raise NotEmulatedError(f"{op}: the sm_100 UE8M0 scale path")

    def _operand(self, op: str, name: str, pair, rows: int | None = None) -> tuple[Tensor, Tensor]:
        x, scale = pair
        _require(x.dtype == torch.float8_e4m3fn, op, f"{name} must be float8_e4m3fn")
        _require(x.stride(-1) == 1, op, f"{name} must be K-major")
        _require(scale.dtype == torch.float32, op, f"the scales of {name} must be float32 for the sm_90 recipe")
        return x, scale

    @staticmethod
    def _dequant(x: Tensor, scale: Tensor, gran_mn: int) -> Tensor:
        k = x.shape[-1]
        s = scale.repeat_interleave(128, dim=-1)[..., :k]
        if gran_mn > 1:
            s = s.repeat_interleave(gran_mn, dim=-2)[..., : x.shape[-2], :]
        return x.float() * s

    def fp8_gemm_nt(self, a, b, d: Tensor, c: Tensor | None = None, recipe=None, compiled_dims: str = "nk",
                    disable_ue8m0_cast: bool = False) -> None:
        """d = a @ b^T with 1x128 scales for a and 128x128 for b (scales multiply), in place."""
        op = "fp8_gemm_nt"
        self._emulator.calls[op] += 1
        self._arch(op)
        (xa, sa), (xb, sb) = self._operand(op, "a", a), self._operand(op, "b", b)
        m, k = xa.shape
        n = xb.shape[0]
        _require(xb.shape[1] == k and tuple(d.shape) == (m, n), op, "shape mismatch")
        _require(d.dtype == torch.bfloat16 and c is None, op, "the 1D2D kernel writes bf16 D without C")
        _require(d.stride(-1) == 1, op, "D must be N-major")
        if m == 0:
            return
        if self._numbers < (2, 3, 0):
            _require(n > 0 and k > 0, op, "n > 0 and k > 0")
        _require(tuple(sa.shape) == (m, math.ceil(k / 128)), op, "sfa must be [M, ceil(K/128)]")
        _require(tuple(sb.shape) == (math.ceil(n / 128), math.ceil(k / 128)) and sb.is_contiguous(), op,
                 "sfb must be a contiguous [ceil(N/128), ceil(K/128)]")
        d.copy_((self._dequant(xa, sa, 1) @ self._dequant(xb, sb, 128).T).to(d.dtype))

    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d: Tensor, layout: Tensor, recipe=None, *args, **kwargs) -> None:
        """Rows grouped per expert, each group's rows starting at a multiple of the alignment,
        layout[r] = the row's group or -1 (padding); padding rows of d are left as they are."""
        op = "m_grouped_fp8_gemm_nt_contiguous"
        self._emulator.calls[op] += 1
        self._arch(op)
        if kwargs.get("use_psum_layout"):
            raise NotEmulatedError(f"{op}: use_psum_layout")
        (xa, sa), (xb, sb) = self._operand(op, "a", a), self._operand(op, "b", b)
        m, k = xa.shape
        groups, n, _ = xb.shape
        _require(d.dtype == torch.bfloat16 and tuple(d.shape) == (m, n), op, "D must be bf16 [M, N]")
        _require(layout.dtype == torch.int32 and tuple(layout.shape) == (m,) and layout.is_contiguous(), op,
                 "m_indices must be a contiguous int32 [M]")
        _require(m % self.ALIGNMENT == 0, op, f"M must be a multiple of {self.ALIGNMENT}")
        _require(tuple(sb.shape) == (groups, math.ceil(n / 128), math.ceil(k / 128)) and sb.is_contiguous(), op,
                 "sfb must be a contiguous [G, ceil(N/128), ceil(K/128)]")
        ids = layout.tolist()
        for first in range(0, m, self.ALIGNMENT):   # a block of rows belongs to one group (or padding)
            block = {g for g in ids[first:first + self.ALIGNMENT] if g >= 0}
            _require(len(block) <= 1, op, "a block of 128 rows mixes groups")
        _require(all(-1 <= g < groups for g in ids), op, "m_indices out of range")
        rows = [r for r, g in enumerate(ids) if g >= 0]
        if not rows:
            return
        a_rows = self._dequant(xa[rows], sa[rows], 1)
        for g in sorted({ids[r] for r in rows}):
            picked = [i for i, r in enumerate(rows) if ids[r] == g]
            d[[rows[i] for i in picked]] = (a_rows[picked] @ self._dequant(xb[g], sb[g], 128).T).to(d.dtype)


class CudaEmulator:
    """Stands in for CudaRuntime. `gpu` is a key of GPUS; `flash_mla` an interface generation
    (1, 2) or None (not installed); `deep_gemm` a version or None; `torch_version` what
    torch.__version__ says. `calls` counts library calls, `host_syncs` the device syncs a real
    GPU would have made inside the library (torch's _grouped_mm fallback copying offs)."""

    EMULATOR = True

    def __init__(self, gpu: str = "H200", *, devices: int = 8, torch_version: str = "2.11.0+cu130",
                 flash_mla: int | None = 2, deep_gemm: str | None = "2.1.1") -> None:
        if gpu not in GPUS:
            raise ValueError(f"unknown gpu {gpu!r}; known: {sorted(GPUS)}")
        self.gpu = gpu
        self.capability, self.device_name, self.multiprocessors, self.memory_gib = GPUS[gpu]
        self.devices = devices
        self.calls: collections.Counter = collections.Counter()
        self.host_syncs = 0
        self.torch = _Torch(self, torch_version)
        self.__version__ = torch_version
        self.flash_mla = FlashMlaEmulator(self, flash_mla) if flash_mla else None
        self.flash_mla_missing = "" if flash_mla else "flash_mla not installed (FlashMLA, built from " \
                                                      "github.com/deepseek-ai/FlashMLA)"
        self.deep_gemm = DeepGemmEmulator(self, deep_gemm) if deep_gemm else None
        self.deep_gemm_missing = "" if deep_gemm else "deep_gemm not installed (DeepGEMM, " \
                                                      "github.com/deepseek-ai/DeepGEMM)"

    def __repr__(self) -> str:
        return f"CudaEmulator(gpu={self.gpu!r}, sm_{self.capability[0]}{self.capability[1]})"

    def package_versions(self) -> dict[str, str]:
        versions = {}
        if self.flash_mla is not None:
            versions.update(flash_mla=FLASH_MLA_VERSIONS[self.flash_mla.interface],
                            flash_mla_interface=str(self.flash_mla.interface))
        if self.deep_gemm is not None:
            versions["deep_gemm"] = self.deep_gemm.__version__
        return versions
