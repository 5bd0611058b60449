"""A CPU emulator of the MUSA vendor surface glm5_hal's musa adapters call (the surface
backends/musa/runtime.py describes): torch.musa's device queries, torch.rms_norm as it runs on
musa tensors, torch_musa's torch.nn.functional.rope, and MooreThreads' `mate` (FlashMLA's
flash_mla_sparse_fwd, the per-expert MoE GEMMs and the groupwise FP8 GEMM), each as one of
the public mate versions behaves (`MusaEmulator(mate="0.2.0")`).

Written from the vendors' public code, read at these tags (every behaviour below names its
file):
* MooreThreads/torch_musa v2.7.1 (0bc05bff; v2.7.0 7a6f07ad agrees): tests/unittest/operator/
  test_rms_norm.py, csrc/aten/ops/RMSNorm.cpp:160-167 (fp32/fp16/bf16 input, weight in the
  input's dtype), torch_patches/aten_src_ATen_native_layer_norm.cpp.patch (torch.rms_norm
  -> the fused kernel on musa), tests/unittest/operator/test_rope_apply.py (SBHD input,
  raw-angle freq_cis, rotate_half, the multi_latent_attention de-interleave, float32 only,
  arch >= 22, the MLA flag only with muDNN >= 3000), core/device.py:186-197 (bf16 from arch
  22), README.md (MCCL for the S4000 only);
* MooreThreads/mate v0.1.3 (99bbf1fe), v0.2.0 (e65c5017), v0.2.1 (9ac89cfb), v0.2.2
  (3f58cc3e): mate/flashmla.py (flash_mla_sparse_fwd, from v0.2.0), mate/sparse_mla/tilelang/
  sparse_mla_fwd_pipelined.py (v0.2.0: base-2 lse, max_logits None, -2^30 mask) and
  sparse_mla_v32_fwd_pipelined.py / sparse_mla_prefill.py (v0.2.1+: natural-log lse, real
  max_logits, +inf lse / -inf max_logits for rows without a valid index), mate/gemm.py and
  tests/test_gemm.py, tests/test_groupwise_fp8_scaled_gemm.py (the GEMMs), README.md (MP31
  only).

Violating a documented constraint raises MusaOpError (a RuntimeError, as TORCH_CHECK does) or
AssertionError (what mate's Python asserts raise); behaviour the sources do not document
raises NotEmulatedError instead of guessing. Plain CPU tensors stand in for musa tensors. It
never calls glm5_hal.reference.
"""
from __future__ import annotations

import collections
import math
import types

from glm5_hal.vendor_backend import leading_numbers

import torch
from torch import Tensor

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
        """The fused MUSA RMSNorm (FusedRMSNormForwardOut): float32 statistics over
        normalized_shape, times weight, rounded once to the input dtype."""
        op = "torch.rms_norm(musa)"
        self._emulator.calls["rms_norm"] += 1
        self._dtype_on_arch(op, input.dtype)
        shape = tuple(int(n) for n in normalized_shape)
        _require(1 <= len(shape) <= input.dim() and tuple(input.shape[-len(shape):]) == shape, op,
                 f"normalized_shape {list(shape)} does not match input shape {list(input.shape)}")
        if weight is not None:
            _require(tuple(weight.shape) == shape, op, f"weight shape {list(weight.shape)} != normalized_shape")
            # RMSNorm.cpp:166 CheckDType("input", input_dtype, "weight", weight, ...)
            _require(weight.dtype == input.dtype, op, f"DTypes of weight ({weight.dtype}) and input "
                     f"({input.dtype}) differ")
        eps = torch.finfo(input.dtype).eps if eps is None else float(eps)
        dims = tuple(range(input.dim() - len(shape), input.dim()))
        xf = input.float()
        y = xf * torch.rsqrt(xf.square().mean(dim=dims, keepdim=True) + eps)
        if weight is not None:
            y = y * weight.float()
        return y.to(input.dtype)


#: The mate versions emulated (tags of MooreThreads/mate that the adapters were read from).
MATE_VERSIONS = ("0.1.3", "0.2.0", "0.2.1", "0.2.2")
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _mate_at_least(version: str, since: tuple[int, ...]) -> bool:
    numbers = leading_numbers(version)
    return numbers + (0,) * (len(since) - len(numbers)) >= since


class _FlashMla:
    """mate.flashmla: flash_mla_sparse_fwd exists from v0.2.0 (mate/flashmla.py), with the
    lse convention of the installed version."""

    NEG_MASK = -(2.0 ** 30)  # the kernels' logit for an invalid index (m_i init, masked acc_s)

    def __init__(self, emulator: "MusaEmulator", version: str) -> None:
        self._emulator = emulator
        self._version = version
        if _mate_at_least(version, (0, 2, 0)):
            self.flash_mla_sparse_fwd = self._sparse_fwd

    def _sparse_fwd(self, q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float, d_v: int = 512,
                    attn_sink: Tensor | None = None, topk_length: Tensor | None = None):
        """Sparse MLA prefill -> (out [s_q, h_q, 512] bf16, max_logits, lse [s_q, h_q] float32).
        v0.2.0: max_logits None, lse base 2, a row without a valid index gets a finite lse
        (log2(topk) - 2^30 * sm_scale * log2(e)) and out 0. v0.2.1+: max_logits the max of
        the scaled logits, lse natural, a row without a valid index lse +inf, max_logits -inf,
        out 0."""
        op = "flash_mla_sparse_fwd"
        emu = self._emulator
        emu.calls[op] += 1
        _require(emu.arch == 31, op, f"mate kernels are built for MP31 only (README.md), this is mp_{emu.arch}")
        new = _mate_at_least(self._version, (0, 2, 1))
        if not new:
            assert attn_sink is None, "attn_sink Not supported Now"
            assert topk_length is None, "topk_length Not supported Now"
        elif attn_sink is not None or topk_length is not None:
            raise NotEmulatedError(f"{op}: attn_sink / topk_length (mate >= 0.2.1) are not emulated")
        assert d_v == 512, "sprase prefill only support d_v 512"
        for name, t, dtype in (("q", q, torch.bfloat16), ("kv", kv, torch.bfloat16), ("indices", indices, torch.int32)):
            _require(isinstance(t, Tensor) and t.dim() == 3, op, f"{name} must be 3-D")
            if new:   # sparse_mla_prefill.py:30-33 asserts the dtypes
                assert t.dtype == dtype, f"{name} must be {dtype}"
            else:     # the v0.2.0 kernel is compiled for bfloat16 / int32 tensors
                _require(t.dtype == dtype, op, f"{name} must be {dtype}, got {t.dtype}")
            # v0.2.0 sparse_mla_fwd_pipelined.py:697, v0.2.1 sparse_mla_v32_fwd_pipelined.py interface
            assert t.is_contiguous(), f"{name} must be contiguous"
        s_q, heads, dqk = q.shape
        s_kv, kv_heads, _ = kv.shape
        topk = indices.shape[2]
        assert kv.shape[2] == dqk
        assert tuple(indices.shape[:2]) == (s_q, kv_heads) and kv_heads == 1
        if dqk == 512 and new:
            raise NotEmulatedError(f"{op}: the d_qk 512 (MODEL1) kernel is not emulated")
        _require(dqk == 576, op, f"expects d_qk = 512 + 64 rope dims = 576, got {dqk}")
        assert topk % 64 == 0, "otherwise will load some index=0 thus causing wrong kv to be loaded"
        if heads > 64:
            assert heads % 64 == 0, "head_kv should be a multiple of 64"
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
        lse2 = torch.log2(total) + peak[..., 0] * scale
        if not new:
            return out.to(torch.bfloat16), None, lse2
        empty = ~valid.any(-1)[:, None].expand(s_q, heads)
        lse = torch.where(empty, math.inf, lse2 * math.log(2.0))
        max_logits = torch.where(empty, -math.inf, peak[..., 0] * float(sm_scale))
        return out.masked_fill(empty[..., None], 0.0).to(torch.bfloat16), max_logits, lse


class _Gemm:
    """mate.gemm: gemm_fp8_nt_groupwise (v0.1.0+) and the MoE GEMMs ragged_m_moe_gemm_16bit /
    _8bit whose gemm_mode="per_expert" takes tokens per expert (v0.1.3+), as mate's own tests
    call them (tests/test_gemm.py test_m_contig_gemm_8bit / _16bit,
    tests/test_groupwise_fp8_scaled_gemm.py)."""

    def __init__(self, emulator: "MusaEmulator", version: str) -> None:
        self._emulator = emulator
        self._version = version
        if _mate_at_least(version, (0, 1, 3)):
            self.ragged_m_moe_gemm_16bit = self._ragged_16bit
            self.ragged_m_moe_gemm_8bit = self._ragged_8bit

    def _device(self, op: str) -> None:
        self._emulator.calls[op] += 1
        _require(self._emulator.arch == 31, op, "mate kernels are built for MP31 only (README.md), this is "
                 f"mp_{self._emulator.arch}")

    @staticmethod
    def _per_expert_rows(op: str, info: Tensor, experts: int, rows: int) -> list[int]:
        _require(info.dtype == torch.int32 and tuple(info.shape) == (experts,), op,
                 f"ragged_tokens_info must be int32 [{experts}] tokens per expert")
        counts = [int(v) for v in info.tolist()]
        _require(all(c >= 0 for c in counts), op, "tokens per expert must be >= 0")
        if sum(counts) != rows:
            raise NotEmulatedError(f"{op}: rows past the experts' tokens (sum {sum(counts)} of {rows}) are not emulated")
        return counts

    @staticmethod
    def _check_modes(op: str, gemm_mode: str, major_a_mode: str, major_b_mode: str) -> None:
        if gemm_mode != "per_expert":
            raise NotEmulatedError(f"{op}: gemm_mode={gemm_mode!r} (only 'per_expert' is emulated)")
        if (major_a_mode, major_b_mode) != ("K", "K"):
            raise NotEmulatedError(f"{op}: major modes {major_a_mode}/{major_b_mode} (only K/K is emulated)")

    def _ragged_16bit(self, input_a: Tensor, input_b: Tensor, ragged_tokens_info: Tensor, out: Tensor,
                      gemm_mode: str = "per_token", major_a_mode: str = "K", major_b_mode: str = "K",
                      num_mp: int | None = None, alignment_m: int | None = None):
        op = "ragged_m_moe_gemm_16bit"
        self._device(op)
        self._check_modes(op, gemm_mode, major_a_mode, major_b_mode)
        a, b = input_a, input_b
        _require(a.dtype in (torch.float16, torch.bfloat16) and b.dtype == a.dtype, op,
                 "input_a and input_b must be fp16/bf16 of one dtype")
        _require(a.dim() == 2 and b.dim() == 3 and a.shape[1] == b.shape[2] and a.is_contiguous()
                 and b.is_contiguous(), op, "a (total_tokens, K) and b (num_expert, N, K), contiguous")
        _require(out.dtype == a.dtype and tuple(out.shape) == (a.shape[0], b.shape[1]), op,
                 f"out must be ({a.shape[0]}, {b.shape[1]}) {a.dtype}")
        counts = self._per_expert_rows(op, ragged_tokens_info, b.shape[0], a.shape[0])
        start = 0
        for e, count in enumerate(counts):
            out[start:start + count] = (a[start:start + count].float() @ b[e].float().T).to(out.dtype)
            start += count
        return out

    @staticmethod
    def _fp8_pair(op: str, name: str, pair, shape_of_scale) -> tuple[Tensor, Tensor]:
        values, scale = pair
        _require(values.dtype in _FP8_DTYPES and values.is_contiguous(), op, f"{name} must be contiguous fp8")
        _require(scale.dtype == torch.float32 and scale.is_contiguous(), op, f"{name} scale must be contiguous fp32")
        _require(tuple(scale.shape) == shape_of_scale(values), op,
                 f"{name} scale must be {shape_of_scale(values)}, got {tuple(scale.shape)}")
        return values, scale

    @staticmethod
    def _granularity(op: str, scale_granularity_mnk) -> None:
        if scale_granularity_mnk not in (None, (1, 128, 128)):
            raise NotEmulatedError(f"{op}: scale granularity {scale_granularity_mnk} (only (1, 128, 128) is emulated)")

    def _ragged_8bit(self, input_a, input_b, ragged_tokens_info: Tensor, out: Tensor, gemm_mode: str = "per_token",
                     major_a_mode: str = "K", major_b_mode: str = "K", scale_granularity_mnk=None,
                     num_mp: int | None = None, alignment_m: int | None = None):
        op = "ragged_m_moe_gemm_8bit"
        self._device(op)
        self._check_modes(op, gemm_mode, major_a_mode, major_b_mode)
        self._granularity(op, scale_granularity_mnk)
        a, a_scale = self._fp8_pair(op, "input_a", input_a, lambda v: (v.shape[0], -(-v.shape[1] // 128)))
        b, b_scale = self._fp8_pair(op, "input_b", input_b,
                                    lambda v: (v.shape[0], -(-v.shape[1] // 128), -(-v.shape[2] // 128)))
        _require(a.dim() == 2 and b.dim() == 3 and a.shape[1] == b.shape[2], op, "a (M, K), b (E, N, K)")
        _require(out.dtype in (torch.float16, torch.bfloat16) and tuple(out.shape) == (a.shape[0], b.shape[1]), op,
                 "out must be (M, N) fp16/bf16")
        counts = self._per_expert_rows(op, ragged_tokens_info, b.shape[0], a.shape[0])
        a_deq = _dequantize_blocks(a, a_scale, 1)
        start = 0
        for e, count in enumerate(counts):
            if count:
                out[start:start + count] = (a_deq[start:start + count] @ _dequantize_blocks(b[e], b_scale[e], 128).T
                                            ).to(out.dtype)
            start += count
        return out

    def gemm_fp8_nt_groupwise(self, a: Tensor, b: Tensor, a_scale: Tensor, b_scale: Tensor, scale_major_mode=None,
                              mma_sm=None, scale_granularity_mnk=None, out: Tensor | None = None,
                              out_dtype: torch.dtype | None = None, backend: str = "auto", **newer):
        op = "gemm_fp8_nt_groupwise"
        self._device(op)
        if newer.get("output_scale") is not None or set(newer) - {"output_scale"}:
            raise NotEmulatedError(f"{op}: {sorted(newer)} (the FP8-output path) is not emulated")
        if scale_major_mode not in (None, "K"):
            raise NotEmulatedError(f"{op}: scale_major_mode={scale_major_mode!r} (only K-major scales are emulated)")
        self._granularity(op, scale_granularity_mnk)
        a, a_scale = self._fp8_pair(op, "a", (a, a_scale), lambda v: (v.shape[0], -(-v.shape[1] // 128)))
        b, b_scale = self._fp8_pair(op, "b", (b, b_scale), lambda v: (-(-v.shape[0] // 128), -(-v.shape[1] // 128)))
        _require(a.dim() == b.dim() == 2 and a.shape[1] == b.shape[1], op, "a (m, k) and b (n, k)")
        if out is None:
            out_dtype = torch.bfloat16 if out_dtype is None else out_dtype
            if out_dtype not in (torch.bfloat16, torch.float16):
                raise ValueError("Only bf16 and fp16 are supported for out_type!")
            out = torch.empty((a.shape[0], b.shape[0]), dtype=out_dtype)
        elif out.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError("Only bf16 and fp16 are supported for out_type!")
        out.copy_((_dequantize_blocks(a, a_scale, 1) @ _dequantize_blocks(b, b_scale, 128).T).to(out.dtype))
        return out


def _dequantize_blocks(values: Tensor, scale: Tensor, rows_per_scale: int) -> Tensor:
    """fp8 values [R, K] times their scales [ceil(R / rows_per_scale), ceil(K / 128)], float32."""
    expanded = scale.repeat_interleave(rows_per_scale, dim=0)[: values.shape[0]]
    return values.float() * expanded.repeat_interleave(128, dim=1)[:, : values.shape[1]]


class MateEmulator:
    """The mate package at one version: `__version__`, `flashmla`, `gemm`."""

    def __init__(self, emulator: "MusaEmulator", version: str) -> None:
        self.__version__ = version
        self.flashmla = _FlashMla(emulator, version)
        self.gemm = _Gemm(emulator, version)


class MusaEmulator:
    """Stands in for MusaRuntime. `card` is a key of CARDS; `devices`, `version` (torch_musa),
    `mudnn` and `mate` (a version of MATE_VERSIONS, another string, or None: not installed)
    configure what the probe and the adapters see. `calls` counts vendor calls."""

    EMULATOR = True

    def __init__(self, card: str = "S4000", *, devices: int = 8, version: str = "2.7.1", mudnn: int = 3100,
                 mate: str | None = "0.2.2") -> None:
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
        self.mate = MateEmulator(self, mate) if mate is not None else None
        self.mate_missing = "" if mate is not None else \
            "mate not installed (MooreThreads' MUSA kernels: FlashMLA, MoE and FP8 GEMMs)"
        self._packages = {"torch_musa": version, **({"mate": mate} if mate is not None else {})}

    def __repr__(self) -> str:
        return f"MusaEmulator(card={self.card!r}, arch=mp_{self.arch})"

    def mudnn_version(self) -> int:
        return self.mudnn

    def package_version(self, name: str) -> str | None:
        return self._packages.get(name)
