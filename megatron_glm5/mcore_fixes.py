"""Workarounds for megatron-core 0.16.1 bugs that hit every device.

* ``moe_utils.router_gating_linear`` tests ``te_general_gemm is not None``, but without Transformer Engine the
  name is never defined (NameError). Define it as ``None`` so the plain torch GEMM path runs.
* ``TopKRouter._apply_expert_bias`` masks the ``[tokens, experts]`` routing map with the flattened ``[tokens]``
  padding mask, which broadcasts along the expert dim (an error, or a wrong count when tokens == experts): the
  padding tokens must leave the expert loads of the aux-loss-free bias update. The replacement masks per token;
  without a padding mask it counts exactly as upstream.

Applied once, on import of :mod:`megatron_glm5.models`.
"""

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter


def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask=None):
    """Add this forward's tokens per expert to ``local_tokens_per_expert`` (not during recompute or evaluation,
    i.e. only with autograd on); ``padding_mask`` (True = padding, any shape with one entry per token) drops
    tokens from the count."""
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1).bool()
            self.local_tokens_per_expert += routing_map.sum(dim=0)


def apply_mcore_fixes() -> None:
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    TopKRouter._apply_expert_bias = _apply_expert_bias


apply_mcore_fixes()
