"""Moore Threads GPU generations, the vendor package versions the adapters were read from,
and the facts they depend on.

Every fact names its public source: a repository, a path and a tag (commit). The ones read:
MooreThreads/torch_musa v2.7.0 (7a6f07ad) and v2.7.1 (0bc05bff, the newest public tag) and
MooreThreads/mate v0.1.3 (99bbf1fe), v0.2.0 (e65c5017), v0.2.1 (9ac89cfb), v0.2.2 (3f58cc3e).
Facts no public source states are marked UNVERIFIED. Behaviours that changed between vendor
versions are `Behaviour` records: the probe picks one by the installed version, and a version
outside the range they were read from narrows the backend (the adapters that depend on it
decline, saying so).
"""
from __future__ import annotations

import dataclasses
import math

from glm5_hal.vendor_backend import Behaviour, Era
from glm5_hal.vendor_backend import device_dtypes as shared_device_dtypes

#: torch_musa releases the adapters are written against: mate's README (v0.2.2) requires
#: "TorchMUSA 2.7 or later"; the fused rms_norm, F.rope and Stream.musa_stream used here are
#: in torch_musa v2.7.0 and v2.7.1.
MIN_TORCH_MUSA = (2, 7)
#: torch.nn.functional.rope's multi_latent_attention flag is exercised by torch_musa's tests
#: only when torch.backends.mudnn.version() >= 3000 (tests/unittest/operator/test_rope_apply.py:46,
#: torch_musa v2.7.1).
MIN_MUDNN_FOR_MLA_ROPE = 3000
#: The Python package of MooreThreads' MUSA kernels (FlashMLA, DeepGEMM-style GEMMs). Its
#: version is read from the distribution metadata, as mate/__init__.py itself does
#: (`importlib.metadata.version("mate")`, v0.2.0-v0.2.2); the `flash_mla` wrapper package
#: (wrappers/FlashMLA) carries a meaningless version ("0.1.0" at mate v0.2.0) and only
#: re-exports mate, so it is never consulted.
MATE = "mate"

#: flash_mla_sparse_fwd processes indices in tiles of 64 (`topk % block_I == 0`, "otherwise
#: will load some index=0") and heads in groups of 64 (`head_kv % 64 == 0` above 64; fewer are
#: padded): mate/sparse_mla/tilelang/sparse_mla_fwd_pipelined.py (v0.2.0) and
#: sparse_mla_v32_fwd_pipelined.py:49, :78-86 (v0.2.1).
FLASH_MLA_TOPK_MULTIPLE = 64
FLASH_MLA_HEAD_MULTIPLE = 64
#: d_qk 576 = 512 + 64 rope dims is the V3.2 kernel, d_v "Can only be 512" (mate/flashmla.py
#: docstring, v0.2.0 :104 / v0.2.1 :119; sparse_mla_prefill.py:30-60, v0.2.1).
FLASH_MLA_DQK, FLASH_MLA_DV = 576, 512
#: mate's groupwise FP8 GEMMs take (1, 128, 128) scale granularity (the DeepSeek-V3 format) and
#: write bfloat16 or float16 only (mate/gemm.py gemm_fp8_nt_groupwise, "Only bf16 and fp16 are
#: supported for out_type!", v0.2.1 :628-760; tests/test_groupwise_fp8_scaled_gemm.py).
MATE_FP8_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class LseConvention:
    """What flash_mla_sparse_fwd returns as its log-sum-exp, in one mate version."""
    base: float                 # the logarithm's base
    empty_row: str              # what a row with no valid index gets

    @property
    def to_natural(self) -> float:
        """The factor turning this lse into the natural-log lse of the contract."""
        return math.log(self.base)


#: mate changed the lse of flash_mla_sparse_fwd between v0.2.0 and v0.2.1, silently.
FLASH_MLA_LSE = Behaviour("flash_mla_lse", MATE, (
    Era((0, 2, 0), LseConvention(2.0, "finite, very negative (the -2^30 mask logit)"),
        "MooreThreads/mate v0.2.0 (e65c5017) mate/sparse_mla/tilelang/sparse_mla_fwd_pipelined.py:439 "
        "`sumexp = T.log2(sumexp) + m_i * sm_scale` with sm_scale pre-multiplied by log2(e); "
        "mate/flashmla.py:104-154 returns (out, None, lse)"),
    Era((0, 2, 1), LseConvention(math.e, "+inf (max_logits -inf, out 0)"),
        "MooreThreads/mate v0.2.1 (9ac89cfb) mate/sparse_mla/tilelang/sparse_mla_v32_fwd_pipelined.py:402-432 "
        "`lse = sumexp * 0.6931471805599453`, rows with m_i <= -2^29 get lse +inf and max_logits -inf; "
        "unchanged in v0.2.2 (3f58cc3e)"),
), verified_up_to=(0, 2, 2))

#: mate's MoE GEMMs over contiguous per-expert rows: ragged_m_moe_gemm_16bit / _8bit with
#: gemm_mode="per_expert" (tokens per expert) first appear in v0.1.3; gemm_fp8_nt_groupwise in
#: v0.1.0. Read from mate/gemm.py and tests/test_gemm.py (test_m_contig_gemm_8bit/_16bit) and
#: tests/test_groupwise_fp8_scaled_gemm.py at v0.1.3-v0.2.2.
MATE_GEMM = Behaviour("mate_gemm", MATE, (
    Era((0, 1, 3), "per_expert ragged GEMMs; K-major (1, 128, 128) groupwise FP8 scales",
        "MooreThreads/mate v0.1.3 (99bbf1fe) .. v0.2.2 (3f58cc3e) mate/gemm.py ragged_m_moe_gemm_16bit, "
        "ragged_m_moe_gemm_8bit, gemm_fp8_nt_groupwise; tests/test_gemm.py, tests/test_groupwise_fp8_scaled_gemm.py"),
), verified_up_to=(0, 2, 2))

#: torch_musa's fused RMSNorm and F.rope, as the adapters call them.
TORCH_MUSA_OPS = Behaviour("torch_musa_ops", "torch_musa", (
    Era((2, 7, 0), "torch.rms_norm -> _fused_rmsnorm_forward (fp32/fp16/bf16, weight in x's dtype); "
                   "F.rope(input, freq_cis, rotary_interleaved, batch_first, multi_latent_attention)",
        "MooreThreads/torch_musa v2.7.0 (7a6f07ad), v2.7.1 (0bc05bff): torch_patches/"
        "aten_src_ATen_native_layer_norm.cpp.patch, torch_musa/csrc/aten/ops/RMSNorm.cpp:160-167, "
        "tests/unittest/operator/test_rms_norm.py, test_rope_apply.py"),
), verified_up_to=(2, 7, 1))

BEHAVIOURS = (FLASH_MLA_LSE, MATE_GEMM, TORCH_MUSA_OPS)


@dataclasses.dataclass(frozen=True)
class Generation:
    arch: str                     # "mp_22"
    capability: tuple[int, int]   # torch.musa.get_device_capability()
    cards: str
    bf16: bool                    # bfloat16 compute
    fp8: bool                     # float8_e4m3fn (torch._scaled_mm, mate's FP8 GEMMs)
    mate: bool                    # mate's kernels (FlashMLA sparse, the MoE / FP8 GEMMs)
    rope: bool                    # torch.nn.functional.rope (tests run from arch 22 on)
    mccl: bool                    # MCCL ships for this card

    @property
    def label(self) -> str:
        return f"{self.arch} ({self.cards})"


#: Sources, per field:
#: - arch numbers 21 / 22 / 31 and mcc's `--offload-arch=mp_XX`: torch_musa v2.7.1
#:   torch_musa/core/_utils.py:62-90, CMakeLists.txt:253;
#: - capability (major, minor) -> arch: major * 10 + minor, torch_musa v2.7.1 core/device.py:191-193;
#: - card names per arch: mp_21 = MTT S80/S3000 and MCCL only for the S4000, torch_musa v2.7.1
#:   README.md:39,91; mp_22 = S4000 (the MCCL card); mp_31 = S5000: UNVERIFIED (no public
#:   repository states it; only labels, no behaviour keys on them);
#: - bf16 from arch 22: torch_musa v2.7.1 core/device.py:186-197 (is_bf16_supported);
#: - fp8 on mp_31 only: torch_musa v2.7.1 csrc/aten/ops/Matmul.cpp:560-567 (_scaled_mm needs
#:   MUSA_ARCH >= 310 and capability major >= 3), tests/unittest/operator/test_mm.py:161;
#: - mate on mp_31 only: mate README.md @v0.2.2 "Architecture: Pinghu (MP31)";
#: - rope from arch 22: torch_musa v2.7.1 tests/unittest/operator/test_rope_apply.py:57
#:   (`skipif(get_musa_arch() < 22)`).
GENERATIONS = (
    Generation("mp_21", (2, 1), "MTT S80/S3000", bf16=False, fp8=False, mate=False, rope=False, mccl=False),
    Generation("mp_22", (2, 2), "MTT S4000", bf16=True, fp8=False, mate=False, rope=True, mccl=True),
    Generation("mp_31", (3, 1), "MTT S5000", bf16=True, fp8=True, mate=True, rope=True, mccl=True),
)


def generation_of(capability: tuple[int, int]) -> Generation | None:
    for gen in GENERATIONS:
        if gen.capability == tuple(capability):
            return gen
    return None


def supported_archs() -> str:
    return ", ".join(g.label for g in GENERATIONS)


def device_dtypes(gen: Generation) -> frozenset:
    return shared_device_dtypes(bf16=gen.bf16, fp8=gen.fp8)
