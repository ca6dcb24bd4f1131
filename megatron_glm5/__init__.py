"""megatron_glm5: GLM-5.3-Flash (Glm5NextForConditionalGeneration) on megatron-core."""

__version__ = "0.1.0"
