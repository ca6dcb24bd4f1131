"""GLM-5.3-Flash modules built from megatron-core specs."""

from megatron_glm5 import mcore_fixes  # noqa: F401  (megatron-core without TE)
from megatron_glm5.models import token_permutation

token_permutation.install()
