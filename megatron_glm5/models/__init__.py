"""GLM-5.3-Flash modules built from megatron-core specs."""

from megatron_glm5 import mcore_fixes  # noqa: F401  (megatron-core without TE)
