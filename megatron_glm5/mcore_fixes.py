"""Workarounds for megatron-core 0.16.1 bugs that hit every device when Transformer Engine is not installed.

* ``moe_utils.router_gating_linear`` tests ``te_general_gemm is not None``, but without TE the name is never
  defined (NameError). Define it as ``None`` so the plain torch GEMM path runs.

Applied once, on import of :mod:`megatron_glm5.models`.
"""

from megatron.core.transformer.moe import moe_utils


def apply_mcore_fixes() -> None:
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


apply_mcore_fixes()
