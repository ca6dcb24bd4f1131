"""MoE token permutation whose backward gathers each token's copies instead of scattering them with atomics.

megatron-core's ``moe_utils.permute`` (the path without Transformer Engine) builds ``sorted_indices`` (expert-major:
for each expert, its tokens in order) and returns ``tokens.index_select(0, sorted_indices)``. Autograd's backward
of that is an ``index_add_`` of ``[T * k, h]`` rows into ``[T, h]``: atomics, with one rounding per copy in bf16,
and its order differs run to run. :func:`permute` computes the same forward; its backward knows where each
token's (at most ``k``) copies sit and sums them with one ``embedding_bag`` (a gather and a sum in fp32 per row),
so it writes every row once, in a fixed order, and rounds once.

Shapes: ``tokens [T, h]``, ``routing_map [T, E]`` bool (at most ``k`` experts per token), ``probs [T, E]``;
outputs ``permuted [N, h]`` (``N`` = selected pairs), ``permuted_probs [N]``, ``sorted_indices [N]`` (token of each
row), exactly as upstream. Used when the caller passes ``num_out_tokens = T * k`` as a Python int (the all-to-all
dispatcher without capacity or padding); otherwise upstream's function runs. :func:`install` makes the all-to-all
dispatcher call it (once, on import of :mod:`megatron_glm5.models`).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe import moe_utils, token_dispatcher

_upstream_permute = moe_utils.permute


def copy_positions(routing_map: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Where each token's copies land in the expert-major permuted order.

    Args:
        routing_map: ``[T, E]`` bool, at most ``k`` True per row.
        k: copies per token at most.
    Returns:
        ``positions [T, k]`` int64 (rows of the permuted tensor; 0 in unused slots) and ``valid [T, k]`` bool.
    """
    num_tokens, num_experts = routing_map.shape
    expert_major = routing_map.t().reshape(-1).to(torch.int64)                       # [E * T]
    before = torch.cumsum(expert_major, 0) - expert_major                           # exclusive count
    position = before.view(num_experts, num_tokens).t()                              # [T, E]
    slots = torch.topk(routing_map.to(torch.float32), k, dim=1, sorted=False).indices  # every True among the k
    valid = routing_map.gather(1, slots)
    return position.gather(1, slots).masked_fill(~valid, 0), valid


class _GatherTokens(torch.autograd.Function):
    """``tokens[sorted_indices]`` with a gather-and-sum backward over each token's copies."""

    @staticmethod
    def forward(ctx, tokens, sorted_indices, positions, valid):
        ctx.save_for_backward(positions, valid)
        return tokens.index_select(0, sorted_indices)

    @staticmethod
    def backward(ctx, grad_permuted):
        positions, valid = ctx.saved_tensors
        grad = grad_permuted.contiguous()
        if grad.shape[0] == 0:
            return grad.new_zeros(positions.shape[0], grad.shape[1]), None, None, None
        grad_tokens = F.embedding_bag(positions, grad, mode="sum", per_sample_weights=valid.to(grad.dtype))
        return grad_tokens, None, None, None


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: Optional[torch.Tensor] = None,
            num_out_tokens: Optional[int] = None, fused: bool = False, drop_and_pad: bool = False):
    """Drop-in for ``moe_utils.permute`` (same arguments and results; see the module docstring)."""
    num_tokens = tokens.shape[0]
    k = num_out_tokens // num_tokens if isinstance(num_out_tokens, int) and num_tokens else 0
    if (fused or drop_and_pad or not k or k * num_tokens != num_out_tokens or k > routing_map.shape[1]
            or not (torch.is_grad_enabled() and tokens.requires_grad)):
        return _upstream_permute(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused,
                                 drop_and_pad=drop_and_pad)
    # upstream's order and probs (its token gather on a zero-width stand-in costs nothing), our gather for the rows
    _, permuted_probs, sorted_indices = _upstream_permute(tokens.new_empty(num_tokens, 0), routing_map, probs=probs,
                                                          num_out_tokens=num_out_tokens)
    positions, valid = copy_positions(routing_map.bool(), k)
    return _GatherTokens.apply(tokens, sorted_indices, positions, valid), permuted_probs, sorted_indices


def install() -> None:
    """Make megatron-core's token dispatchers use :func:`permute` (idempotent)."""
    token_dispatcher.permute = permute
