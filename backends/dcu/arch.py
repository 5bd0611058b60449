"""Hygon DCU generations, the vendor package versions the adapters were read from, and the
facts they depend on.

Every fact names its public source: HYGON-AI/vllm-plugin-das (the DCU plugin of vLLM, which
calls Hygon's closed `lightop`): vllm_hcu/platforms/hcu.py @01211a04, vllm_hcu/ops/
rms_norm.py @474991d4 and @13272b6f, vllm_hcu/ops/silu_and_mul.py @10ca569f, docs/superpowers/specs/
2026-08-25-lightop-categorized-api-v0251-design.md @63935f8e (LightOp 0.6's module layout,
read from the installed 0.6.0+das.dtk2604 wheel); vllm-project/vllm csrc/sampler.cu @00e831b2
(the top-k kernel lightop's mirrors); FlagGems (torch.__hcu_version__). lightop itself is
closed: facts only lightop's code could confirm are marked UNVERIFIED.
"""
from __future__ import annotations

import dataclasses

from glm5_hal.vendor_backend import Behaviour, Era
from glm5_hal.vendor_backend import device_dtypes as shared_device_dtypes

#: glm5_hal itself needs torch >= 2.6 (pyproject.toml): not a vendor fact.
MIN_TORCH = (2, 6)
#: The distribution whose version decides where lightop keeps its functions (the design doc
#: names the installed wheel "LightOp 0.6.0+das.dtk2604.torch2110..."; that the distribution
#: is called `lightop` is UNVERIFIED: an unreadable version narrows the lightop adapters away).
LIGHTOP = "lightop"
#: lightop's RMSNorm "rejects reductions narrower than one wave": vllm-plugin-das routes
#: hidden sizes below this to vLLM's own kernel (_LIGHTOP_RMSNORM_MIN_COLS,
#: vllm_hcu/ops/rms_norm.py:17 @474991d4).
LIGHTOP_RMSNORM_MIN_COLS = 64


@dataclasses.dataclass(frozen=True)
class LightopLayout:
    """Where one lightop version keeps the functions the adapters call: (submodule, name)
    places, tried in order."""
    rms_norm: tuple[tuple[str, str], ...]
    silu_and_mul: tuple[tuple[str, str], ...]
    top_k: tuple[tuple[str, str], ...]


#: Before LightOp 0.6 the functions lived in `lightop.op` or at lightop's top level:
#: vllm-plugin-das's older call sites import `lightop.op` (vllm_hcu/ops/rms_norm.py @13272b6f:
#: `from lightop.op import rmsnorm_forward_autograd`, next to `from lightop import
#: fused_add_rms_norm`; silu_and_mul.py @10ca569f: `import lightop.op as op; op.silu_and_mul_opt`),
#: and the LightOp 0.6 design doc names both as the deprecated places its categorized modules
#: replace: norm and activation functions get a "Compatible top-level/`lightop.op` fallback", the
#: sparse top-k a "Compatible move from `lightop.op`" (docs/superpowers/specs/
#: 2026-08-25-lightop-categorized-api-v0251-design.md @63935f8e, "Interface Migration Map").
#: 0.6 moved them to lightop.norm, lightop.activation and lightop.attention, and vllm-plugin-das
#: imports those first, the old places only as a fallback. Which versions before 0.6 export
#: which of the two old places is not documented (UNVERIFIED), so both are tried, and the
#: adapters check the function is there before using it.
LIGHTOP_LAYOUT = Behaviour("lightop_layout", LIGHTOP, (
    Era((0,), LightopLayout(rms_norm=(("op", "rmsnorm_forward_autograd"), ("", "rmsnorm_forward_autograd")),
                            silu_and_mul=(("op", "silu_and_mul_opt"), ("", "silu_and_mul_opt")),
                            top_k=(("op", "top_k_per_row_prefill"),)),
        "HYGON-AI/vllm-plugin-das vllm_hcu/ops/silu_and_mul.py @10ca569f (lightop.op.silu_and_mul_opt), "
        "vllm_hcu/ops/rms_norm.py @13272b6f (lightop.op.rmsnorm_forward_autograd), docs/superpowers/specs/"
        "2026-08-25-lightop-categorized-api-v0251-design.md @63935f8e (norm / activation: top-level or lightop.op; "
        "top_k_per_row_prefill: lightop.op)"),
    Era((0, 6, 0), LightopLayout(rms_norm=(("norm", "rmsnorm_forward_autograd"), ("", "rmsnorm_forward_autograd"),
                                           ("op", "rmsnorm_forward_autograd")),
                                 silu_and_mul=(("activation", "silu_and_mul_opt"), ("", "silu_and_mul_opt"),
                                               ("op", "silu_and_mul_opt")),
                                 top_k=(("attention", "top_k_per_row_prefill"), ("op", "top_k_per_row_prefill"))),
        "HYGON-AI/vllm-plugin-das docs/superpowers/specs/2026-08-25-lightop-categorized-api-v0251-design.md "
        "@63935f8e (LightOp 0.6.0+das.dtk2604: lightop.norm, lightop.activation, lightop.attention; compatible "
        "fallbacks: top-level / lightop.op for norm and activation, lightop.op for the top-k); "
        "vllm_hcu/ops/rms_norm.py @474991d4 (`from lightop.norm import ... rmsnorm_forward_autograd`)"),
), verified_up_to=(0, 6, 0))

BEHAVIOURS = (LIGHTOP_LAYOUT,)


@dataclasses.dataclass(frozen=True)
class Generation:
    gfx: str
    products: str
    bf16: bool
    fp8: bool
    unconfirmed: str = ""

    @property
    def label(self) -> str:
        return f"{self.gfx} ({self.products})"


#: gfx -> product. Only gfx936 and gfx938 appear in a public Hygon source (vllm-plugin-das
#: vllm_hcu/platforms/hcu.py @01211a04 checks gcnArchName for them); the product names and
#: every other gfx number are UNVERIFIED (they are labels: nothing keys on them but the
#: dtype flags, which are conservative: no FP8 anywhere, no bf16 on gfx906, which is also
#: AMD's Vega 20 (MI50/MI60) and alone does not make a DCU).
GENERATIONS = (
    Generation("gfx906", "Z100/Z100L", bf16=False, fp8=False,
               unconfirmed="product name; bf16 (the Vega 20 ISA has none; DTK may still emulate it)"),
    Generation("gfx916", "K100 (UNVERIFIED)", bf16=True, fp8=False, unconfirmed="gfx number per product"),
    Generation("gfx926", "K100", bf16=True, fp8=False, unconfirmed="gfx number per product"),
    Generation("gfx928", "K100_AI", bf16=True, fp8=False, unconfirmed="product name; fp8 support"),
    Generation("gfx936", "BW1000", bf16=True, fp8=False, unconfirmed="product name; fp8 support"),
    Generation("gfx938", "BW1100", bf16=True, fp8=False, unconfirmed="product name; fp8 support"),
)

def generation_of(gcn_arch_name: str) -> Generation | None:
    """gcnArchName looks like "gfx928" or "gfx928:sramecc+:xnack-"."""
    gfx = str(gcn_arch_name).split(":")[0].strip()
    for gen in GENERATIONS:
        if gen.gfx == gfx:
            return gen
    return None


def device_dtypes(gen: Generation | None) -> frozenset:
    # unknown generation: assume bf16 (it is the common case), no FP8
    return shared_device_dtypes(bf16=gen is None or gen.bf16, fp8=gen is not None and gen.fp8)
