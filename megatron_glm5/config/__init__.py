"""GLM-5.3-Flash configuration on top of megatron-core's ``MLATransformerConfig``, by job:

* :mod:`~megatron_glm5.config.schema`: ``Glm5Config`` (every field with its docstring, validation);
* :mod:`~megatron_glm5.config.vision`: ``Glm5VisionConfig`` (the vision tower);
* :mod:`~megatron_glm5.config.hf`: HF ``config.json`` import (``Glm5Config.from_hf``) and export (``to_hf_dict``);
* :mod:`~megatron_glm5.config.hf_defaults`: what an absent HF key means (transformers' config classes' defaults);
* :mod:`~megatron_glm5.config.presets`: ``glm5_flash_config()`` (the released sizes) and ``tiny_config()``;
* :mod:`~megatron_glm5.config.parallelism`: where every layer lives under a parallel layout, one-line refusals.
"""

from megatron_glm5.config.hf import check_hf_config_types
from megatron_glm5.config.presets import (
    PRESETS,
    glm5_flash_config,
    glm5_flash_hf_config,
    glm5_flash_hf_text_config,
    tiny_config,
    tiny_hf_config,
)
from megatron_glm5.config.schema import (
    DSA_BACKENDS,
    KDA_BACKENDS,
    KDA_CONV_KERNELS,
    MOE_EXPERTS_BACKENDS,
    Glm5Config,
)
from megatron_glm5.config.vision import Glm5VisionConfig
from megatron_glm5.errors import Glm5ConfigError
from megatron_glm5.layer_types import DENSE_MLP, INDEXED_ATTENTION, LINEAR_ATTENTION, SPARSE_MLP

__all__ = [
    "DENSE_MLP", "DSA_BACKENDS", "INDEXED_ATTENTION", "KDA_BACKENDS", "KDA_CONV_KERNELS", "LINEAR_ATTENTION",
    "MOE_EXPERTS_BACKENDS", "PRESETS", "SPARSE_MLP", "Glm5Config", "Glm5ConfigError", "Glm5VisionConfig",
    "check_hf_config_types", "glm5_flash_config", "glm5_flash_hf_config", "glm5_flash_hf_text_config",
    "tiny_config", "tiny_hf_config",
]
