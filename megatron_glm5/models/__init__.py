"""GLM-5.3-Flash modules built from megatron-core specs."""

from megatron_glm5.mcore_fixes import apply_mcore_fixes
from megatron_glm5.models import token_permutation

apply_mcore_fixes()  # megatron-core bugs without Apex / Transformer Engine (idempotent; entry points call it too)
token_permutation.install()
