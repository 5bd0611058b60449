"""glm5_hal.integrations.transformers: HF transformers' GLM-5 (`GlmMoeDsaForCausalLM`,
model_type "glm_moe_dsa") running on glm5_hal ops.

    from transformers import AutoModelForCausalLM
    from glm5_hal.integrations import transformers as hal_transformers

    hal_transformers.register()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="glm5_hal",
                                                 experts_implementation="glm5_hal")

or `hal_transformers.apply(model)` for a model already built. Then the DSA attention runs
absorbed MLA through `sparse_mla_attention` on the indexer's `indexer_topk` (attention.py),
the routed experts through `moe_permute -> grouped_gemm -> silu_and_mul -> grouped_gemm ->
moe_unpermute` or their FP8 versions (experts.py), and the RMSNorms through `rms_norm`
(norm.py), on whatever backend dispatch picks (`glm5_hal.use(name)` pins one). See
docs/integrations.md. Install with `pip install 'glm5-hal[transformers]'`; importing
`glm5_hal` itself never imports transformers.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
import warnings
from typing import Any, Callable, Iterator

import transformers
from transformers.integrations.finegrained_fp8 import FP8Experts

from ...errors import InvalidInputError
from . import attention, experts, norm

__all__ = ["NAME", "TESTED_VERSIONS", "UntestedVersionWarning", "Applied", "register", "apply", "record_ops"]

#: The name registered as an attention, attention-mask and experts implementation.
NAME = "glm5_hal"
#: The transformers releases this integration is tested against (tests/test_integrations_transformers.py).
TESTED_VERSIONS = ("5.23.0", "5.24.0")

try:
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as _glm
except ImportError as e:  # transformers older than the GLM-5 model
    raise ImportError("glm5_hal.integrations.transformers needs a transformers with the glm_moe_dsa model "
                      f"(tested: {', '.join(TESTED_VERSIONS)}); found {transformers.__version__}. "
                      "pip install 'glm5-hal[transformers]'") from e


class UntestedVersionWarning(UserWarning):
    """The installed transformers is not one of TESTED_VERSIONS (warned once per process)."""


_lock = threading.Lock()
_registered = False
_warned = False


def register() -> None:
    """Registers "glm5_hal" with transformers: as an attention implementation (with its mask
    function, `attention.key_ranges_mask`) and as an experts implementation (plain and FP8).
    From then on GLM-MoE-DSA models built with `attn_implementation="glm5_hal"` run their
    attention and RMSNorms on glm5_hal ops, and with `experts_implementation="glm5_hal"`
    their routed experts. Idempotent; warns once if transformers is an untested version.

    The attention forward itself is replaced, not only the attention function: HF's forward
    would expand the cached latents into per-head keys before any attention function runs.
    So `GlmMoeDsaAttention.forward` and `GlmMoeDsaRMSNorm.forward` become dispatchers that
    run the glm5_hal version for models whose config says "glm5_hal" and HF's own otherwise.
    """
    global _registered
    _warn_if_untested()
    with _lock:
        if _registered:
            return
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
        from transformers.integrations.moe import ExpertsInterface
        AttentionInterface.register(NAME, attention.unsupported_attention)
        AttentionMaskInterface.register(NAME, attention.key_ranges_mask)
        ExpertsInterface.register(NAME, experts.experts_forward)
        FP8ExpertsInterface.register(NAME, experts.fp8_experts_forward)
        _dispatch(_glm.GlmMoeDsaAttention, "forward", attention.glm_moe_dsa_attention,
                  lambda self, *args, **kwargs: self.config._attn_implementation == NAME)
        _dispatch(_glm.GlmMoeDsaRMSNorm, "forward", norm.rms_norm_forward, _norm_routed)
        _before(_glm.GlmMoeDsaModel, "forward", _link_norms_once)
        _registered = True


@dataclasses.dataclass
class Applied:
    """What `apply` changed on a model: the implementations it replaced and the modules that
    now run on glm5_hal ops (qualified names). `restore()` puts the replaced ones back."""
    model: Any
    attn_implementation: str
    experts_implementation: str
    attention: list[str]
    experts: list[str]
    norms: list[str]

    def restore(self) -> None:
        self.model.set_attn_implementation(self.attn_implementation)
        self.model.set_experts_implementation(self.experts_implementation)


def apply(model) -> Applied:
    """Runs an already-built transformers GLM-MoE-DSA model on glm5_hal ops: what `register()`
    plus `attn_implementation="glm5_hal", experts_implementation="glm5_hal"` do at build time.
    Returns what it replaced (`Applied`; `.restore()` undoes it). A model that is not a
    GLM-MoE-DSA model, or one with experts these ops cannot compute, raises
    InvalidInputError and is left unchanged."""
    config = getattr(model, "config", None)
    layers = {name: m for name, m in model.named_modules()} if hasattr(model, "named_modules") else {}
    found = {kind: [n for n, m in layers.items() if isinstance(m, cls)] for kind, cls in (
        ("attention", _glm.GlmMoeDsaAttention), ("norms", _glm.GlmMoeDsaRMSNorm),
        ("experts", (_glm.GlmMoeDsaExperts, FP8Experts)))}
    if getattr(config, "model_type", None) != "glm_moe_dsa" or not found["attention"]:
        raise InvalidInputError("glm5_hal.integrations.transformers.apply", "model",
                                "a transformers GLM-MoE-DSA model (model_type 'glm_moe_dsa', GlmMoeDsaAttention "
                                "modules)", f"{type(model).__name__} (model_type {getattr(config, 'model_type', None)!r})")
    for name in found["experts"]:
        experts._check_layout(layers[name])
    register()
    applied = Applied(model, config._attn_implementation, config._experts_implementation, **found)
    _link_norms(model)
    model.set_attn_implementation(NAME)
    model.set_experts_implementation(NAME)
    return applied


def record_ops() -> Iterator:
    """`glm5_hal.models.record_ops` for this integration: within the block, every glm5_hal op
    the transformers model calls is counted and its first arguments kept (for
    `glm5_hal.explain`)."""
    from ...models.trace import record_ops as record
    return record(attention, experts, norm)


def _warn_if_untested() -> None:
    global _warned
    if transformers.__version__ not in TESTED_VERSIONS and not _warned:
        _warned = True
        warnings.warn(f"glm5_hal.integrations.transformers is tested with transformers {', '.join(TESTED_VERSIONS)}; "
                      f"this is {transformers.__version__}. Check the logits against attn_implementation='eager' "
                      "(docs/integrations.md).", UntestedVersionWarning, stacklevel=3)


def _dispatch(cls: type, name: str, hal_method: Callable, routed: Callable[..., bool]) -> None:
    """cls.<name> becomes: hal_method where routed(self, ...) holds, the original otherwise."""
    original = getattr(cls, name)
    if getattr(original, "_glm5_hal_original", None) is not None:
        return

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        if routed(self, *args, **kwargs):
            return hal_method(self, *args, **kwargs)
        return original(self, *args, **kwargs)
    method._glm5_hal_original = original
    setattr(cls, name, method)


def _before(cls: type, name: str, first: Callable) -> None:
    """cls.<name> becomes: first(self), then the original."""
    original = getattr(cls, name)
    if getattr(original, "_glm5_hal_original", None) is not None:
        return

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        first(self)
        return original(self, *args, **kwargs)
    method._glm5_hal_original = original
    setattr(cls, name, method)


def _link_norms(model) -> None:
    """An RMSNorm has no config; each learns its model's, so that it follows the model's
    attention implementation (set at build time or later by `set_attn_implementation`)."""
    for module in model.modules():
        if isinstance(module, _glm.GlmMoeDsaRMSNorm):
            module._glm5_hal_config = model.config
    model.__dict__["_glm5_hal_norms_linked"] = True


def _link_norms_once(model) -> None:
    """Before a GlmMoeDsaModel's forward: models built before `register()` too."""
    if "_glm5_hal_norms_linked" not in model.__dict__:
        _link_norms(model)


def _norm_routed(self, hidden_states, *args, **kwargs) -> bool:
    config = self.__dict__.get("_glm5_hal_config")
    return config is not None and config._attn_implementation == NAME and norm.routable(self, hidden_states)
