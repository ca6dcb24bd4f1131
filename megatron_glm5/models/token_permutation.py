"""MoE token permutation whose backward gathers each token's copies instead of scattering them.

megatron-core's ``moe_utils.permute`` (the path without Transformer Engine) builds ``sorted_indices`` (expert-major:
for each expert, its tokens in order) with a stable ``argsort`` of the ``[E * T]`` routing map and returns
``tokens.index_select(0, sorted_indices)``, whose backward is an ``index_add_`` of ``[T * k, h]`` rows into
``[T, h]``: atomics, with one rounding per copy in bf16, in an order that differs run to run.

:func:`permute` gives the same results without the sort: when the caller passes ``num_out_tokens = T * k`` (the
all-to-all dispatcher without capacity or padding), every token has exactly ``k`` experts -- the contract of
Transformer Engine's fused permute for that argument, checked here on the device (``torch._assert_async``; on the
CPU it raises) -- so each copy's row is an exclusive prefix count in expert-major order (:func:`copy_positions`);
one scatter of ``t * E + e`` into those rows gives ``sorted_indices`` and the probs' gather index. The backward sums
each token's ``k`` copies with :func:`~megatron_glm5.kernels.gather_sum.gather_sum` (a gather and an fp32 sum per
row; Triton on CUDA), so it writes every row once, in a fixed order, and rounds once.

Shapes: ``tokens [T, h]``, ``routing_map [T, E]`` bool, ``probs [T, E]``; outputs ``permuted [T * k, h]``,
``permuted_probs [T * k]``, ``sorted_indices [T * k]`` (token of each row), ``None`` (no padding offsets) and the
``tokens_per_expert`` passed in, exactly as upstream. Other calls (no ``num_out_tokens``, capacity, padding,
``fused``) run upstream's function.

The way back, ``moe_utils.unpermute``, is the same scatter-add in the other direction (``zeros`` + ``scatter_add_``
of ``[T * k, h]`` rows into ``[T, h]``). :func:`permute` attaches each token's rows to the ``sorted_indices`` it
returns, as the attribute ``sorted_indices.copy_positions`` (``[T, k]`` int64; the dispatchers hand that very tensor
back to ``unpermute``), and :func:`unpermute` then computes ``out[t] = sum_j permuted[positions[t, j]]`` with the
same ``gather_sum`` (backward: ``grad[sorted_indices]`` with its ``k = 1`` case,
:func:`~megatron_glm5.kernels.gather_sum.gather_rows`, which is also the permute's own gather). Calls with ``probs``,
``drop_and_pad``, ``fused``, ``pad_offsets`` or ``sorted_indices`` from elsewhere (no attribute) run upstream's
function.

On one expert-and-tensor-parallel rank (``ep * tp == 1``, dropless) the all-to-all dispatcher has two more costs
that buy nothing there: it copies the per-expert token counts to the host and waits for them (a sync per MoE layer,
for the experts' and the chunk sort's split sizes), and its "permutation 2" (``sort_chunks_by_idxs``) splits the
permuted tokens by expert and concatenates them back in the same order -- a full copy of ``[T * k, h]`` forward and
backward, and of the expert outputs on the way back. :func:`keeps_counts_on_device` skips the host copy (the counts
stay a device tensor: ``GroupedExperts`` needs them there; megatron-core's ``SequentialMLP`` takes ``.tolist()``,
which waits correctly), and :func:`sort_chunks_by_idxs` returns its inputs when the chunk order is the identity.

:func:`install` makes megatron-core's dispatchers use all four; the entry points call it
(:func:`megatron_glm5.initialize.install_patches`), for the megatron-core releases whose dispatcher calls these
functions with the signatures above (:data:`SUPPORTED_VERSIONS`, :func:`megatron_glm5.mcore_version.version_in`).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from megatron.core.transformer.moe import moe_utils, token_dispatcher

from megatron_glm5.kernels.gather_sum import gather_rows, gather_sum
from megatron_glm5.mcore_version import MCORE_VERSION, version_in

_upstream_permute = moe_utils.permute
_upstream_unpermute = moe_utils.unpermute
_upstream_sort_chunks = moe_utils.sort_chunks_by_idxs
_upstream_dtoh = token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize


def copy_positions(routing_map: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each token's copies land in the expert-major permuted order.

    Args:
        routing_map: ``[T, E]`` bool, at most ``k`` True per row.
        k: copies per token at most.
    Returns:
        ``positions [T, k]`` int64 (rows of the permuted tensor; 0 in unused slots), ``valid [T, k]`` bool and
        ``experts [T, k]`` int64 (the expert of each slot).
    """
    num_tokens, num_experts = routing_map.shape
    expert_major = routing_map.t().reshape(-1).to(torch.int64)                       # [E * T]
    before = torch.cumsum(expert_major, 0) - expert_major                           # exclusive count
    position = before.view(num_experts, num_tokens).t()                              # [T, E]
    slots = torch.topk(routing_map.to(torch.float32), k, dim=1, sorted=False).indices  # every True among the k
    valid = routing_map.gather(1, slots)
    return position.gather(1, slots).masked_fill(~valid, 0), valid, slots


class _GatherTokens(torch.autograd.Function):
    """``tokens[sorted_indices]`` with a gather-and-sum backward over each token's copies (``positions [T, k]``)."""

    @staticmethod
    def forward(ctx, tokens, sorted_indices, positions):
        ctx.save_for_backward(positions)
        return gather_rows(tokens, sorted_indices)

    @staticmethod
    def backward(ctx, grad_permuted):
        (positions,) = ctx.saved_tensors
        return gather_sum(grad_permuted, positions), None, None


class _ScatterTokens(torch.autograd.Function):
    """``out[t] = sum_j permuted[positions[t, j]]`` (the unpermute), backward ``grad[sorted_indices]``."""

    @staticmethod
    def forward(ctx, permuted, sorted_indices, positions):
        ctx.save_for_backward(sorted_indices)
        return gather_sum(permuted, positions)

    @staticmethod
    def backward(ctx, grad_tokens):
        (sorted_indices,) = ctx.saved_tensors
        return gather_rows(grad_tokens, sorted_indices), None, None


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: Optional[torch.Tensor] = None,
            num_out_tokens: Optional[int] = None, fused: bool = False, drop_and_pad: bool = False,
            tokens_per_expert: Optional[torch.Tensor] = None, align_size: int = 0):
    """Drop-in for ``moe_utils.permute`` (same arguments and results; see the module docstring)."""
    num_tokens, num_experts = routing_map.shape
    k = num_out_tokens // num_tokens if isinstance(num_out_tokens, int) and num_tokens else 0
    if fused or drop_and_pad or not k or k * num_tokens != num_out_tokens or k > num_experts:
        return _upstream_permute(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused,
                                 drop_and_pad=drop_and_pad, tokens_per_expert=tokens_per_expert,
                                 align_size=align_size)
    positions, valid, slots = copy_positions(routing_map.bool(), k)
    torch._assert_async(valid.all(), f"MoE permute: num_out_tokens = {k} x tokens, but a token has fewer than {k} "
                                     "experts in the routing map")
    rows = positions.reshape(-1)
    token_expert = torch.arange(num_tokens, device=slots.device)[:, None] * num_experts + slots      # [T, k]
    flat = torch.empty_like(rows).scatter_(0, rows, token_expert.reshape(-1))   # t * E + e of each permuted row
    sorted_indices = torch.div(flat, num_experts, rounding_mode="floor")
    permuted_probs = None if probs is None else probs.reshape(-1).index_select(0, flat)
    if torch.is_grad_enabled() and tokens.requires_grad:
        permuted = _GatherTokens.apply(tokens, sorted_indices, positions)
    else:
        permuted = gather_rows(tokens, sorted_indices)
    sorted_indices.copy_positions = positions      # for unpermute
    return permuted, permuted_probs, sorted_indices, None, tokens_per_expert


def unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, restore_shape: torch.Size,
              probs: Optional[torch.Tensor] = None, routing_map: Optional[torch.Tensor] = None, fused: bool = False,
              drop_and_pad: bool = False, pad_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Drop-in for ``moe_utils.unpermute``: a gather-and-sum when ``sorted_indices`` came from :func:`permute` and
    no ``probs`` / ``fused`` / ``drop_and_pad`` (see the module docstring); upstream's function otherwise."""
    positions = getattr(sorted_indices, "copy_positions", None)
    if (fused or drop_and_pad or probs is not None or pad_offsets is not None or positions is None
            or permuted_tokens.dim() != 2
            or permuted_tokens.shape[0] != positions.numel() or tuple(restore_shape) != (positions.shape[0],
                                                                                         permuted_tokens.shape[1])):
        return _upstream_unpermute(permuted_tokens, sorted_indices, restore_shape, probs=probs,
                                   routing_map=routing_map, fused=fused, drop_and_pad=drop_and_pad,
                                   pad_offsets=pad_offsets)
    if torch.is_grad_enabled() and permuted_tokens.requires_grad:
        return _ScatterTokens.apply(permuted_tokens, sorted_indices, positions)
    return gather_sum(permuted_tokens, positions)


def sort_chunks_by_idxs(input: torch.Tensor, split_sizes: torch.Tensor, sorted_idxs: torch.Tensor,
                        probs: Optional[torch.Tensor] = None, fused: bool = False):
    """Drop-in for ``moe_utils.sort_chunks_by_idxs``: ``(input, probs)`` unchanged when ``sorted_idxs`` (a host
    tensor, as the dispatcher keeps it without permute fusion) is ``0, 1, ..., n - 1``; else upstream's function."""
    if (not fused and sorted_idxs.device.type == "cpu"
            and torch.equal(sorted_idxs, torch.arange(sorted_idxs.numel(), dtype=sorted_idxs.dtype))):
        return input, probs
    return _upstream_sort_chunks(input, split_sizes, sorted_idxs, probs=probs, fused=fused)


def keeps_counts_on_device(dispatcher) -> bool:
    """Whether an all-to-all dispatcher runs on one EP x TP rank, dropless (``num_out_tokens`` a Python int)."""
    return (dispatcher.ep_size == 1 and dispatcher.tp_size == 1 and not dispatcher.drop_and_pad
            and isinstance(dispatcher.num_out_tokens, int))


def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert: Optional[torch.Tensor] = None):
    """``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` that leaves everything on the device (no copy,
    no wait) when :func:`keeps_counts_on_device`; upstream's method otherwise."""
    if keeps_counts_on_device(self):
        return tokens_per_expert
    return _upstream_dtoh(self, point, tokens_per_expert)


SUPPORTED_VERSIONS = ("0.16.1", "0.19.2")
"""First and last megatron-core release whose ``token_dispatcher`` calls the replaced functions as they are here."""

# name -> (module or class, attribute, replacement)
PATCHES = {
    "permute": (token_dispatcher, "permute", permute),
    "unpermute": (token_dispatcher, "unpermute", unpermute),
    "sort_chunks_by_idxs": (token_dispatcher, "sort_chunks_by_idxs", sort_chunks_by_idxs),
    "counts_on_device": (token_dispatcher.MoEAlltoAllTokenDispatcher, "_maybe_dtoh_and_synchronize",
                         _maybe_dtoh_and_synchronize),
}


def install(version: Optional[str] = None) -> Tuple[str, ...]:
    """Make megatron-core's token dispatchers use :func:`permute`, :func:`unpermute`, :func:`sort_chunks_by_idxs`
    and the device-side counts of :func:`keeps_counts_on_device` (idempotent) when the installed megatron-core (or
    ``version``) lies in :data:`SUPPORTED_VERSIONS`; returns the names installed (``()`` outside the range, where
    megatron-core's own functions run)."""
    if not version_in(SUPPORTED_VERSIONS, version or MCORE_VERSION):
        return ()
    from megatron_glm5 import extensions

    record = extensions.BY_NAME["token_permutation"]
    for owner, attr, replacement in PATCHES.values():
        extensions.apply(record, replacement, owner=owner, attr=attr)
    return tuple(PATCHES)
