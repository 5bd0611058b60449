"""A small GLM-5-architecture model built only on `glm5_hal.ops`: MLA in absorbed (MQA)
mode over a paged latent cache, DeepSeek Sparse Attention (lightning indexer, optional FP8
keys), sigmoid-routed MoE with a shared expert, HF `glm_moe_dsa` parameter names.

    import glm5_hal as hal
    from glm5_hal.models import GLM5Config, GLM5ForCausalLM
    model = GLM5ForCausalLM(GLM5Config.tiny(), seed=0)
    print(model.generate([1, 2, 3, 4], max_new_tokens=8))
    model = GLM5ForCausalLM.from_pretrained("path/to/GLM-5-FP8")   # BF16 or FP8 checkpoints

See docs/models.md.
"""
from .checkpoint import CheckpointError, CheckpointInfo, SkippedTensorsWarning
from .config import GLM5Config
from .layers import LayerCache, Step
from .model import GLM5Cache, GLM5ForCausalLM, GLM5Model
from .trace import OpCalls, record_ops

__all__ = ["GLM5Config", "GLM5ForCausalLM", "GLM5Model", "GLM5Cache", "LayerCache", "Step",
           "OpCalls", "record_ops", "CheckpointError", "CheckpointInfo", "SkippedTensorsWarning"]
