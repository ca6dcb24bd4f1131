"""Kimi Delta Attention under contiguous context parallelism: the conv tail and the recurrent state cross CP ranks.

CP rank ``r`` holds row positions ``[r L, (r + 1) L)`` of a packed row (:mod:`megatron_glm5.models.context_parallel`).
A document that crosses the chunk's left edge needs, from earlier ranks,

1. the ``W - 1`` conv inputs before the edge (:func:`cp_causal_depthwise_conv1d`: one all-gather of every chunk's
   last ``W - 1`` inputs; taps into another document read zero, as without CP);
2. the recurrent state ``S_in`` ``[H, K, V]`` its document has reached at the edge (:func:`cp_chunk_kda`).

The state hand-off runs in parallel, with no rank waiting for its left neighbour's result. Per head the delta rule
is affine in the state, ``S_t = A_t S_{t-1} + B_t`` with ``A_t = (I - beta_t k_t k_t^T) diag(exp g_t)``, so inside the
chunk's first document ``S_t = S0_t + Phi_t S_in`` (``S0``: the state from zero, ``Phi_t = A_t ... A_1``) and
``o_t = q_t^T S0_t + (q_t^T Phi_t) S_in``. One call of the unchanged per-rank kernel (any backend with the
``chunk_kda_torch`` signature) computes all of it, because value columns evolve independently:

* the values are widened to ``[v | 0_K]`` (``V + K`` columns);
* ``K`` *write* tokens are put in front of the chunk's first document (``k = e_i``, ``v = [0 | e_i]``,
  ``beta = 1``, ``g = 0``): the state is ``[0 | I]`` before the first real token, so the extra ``K`` columns carry
  ``Phi_t`` and the kernel's output there is ``q_t^T Phi_t``;
* ``K`` *probe* tokens are put after the chunk's last document (``q = e_i``, ``k = 0``, ``v = 0``, ``beta = 0``,
  ``g = 0``): probe ``i`` outputs row ``i`` of the final state, ``[h | M]`` (``h``: the last document's state from
  zero; ``M = Phi`` at the chunk end, meaningful when the chunk is the middle of one document).

The ``[H, K, V + K]`` summaries are all-gathered (volume ``cp H K (V + K)`` floats per layer) and each rank composes
its ``S_in`` from those of the ranks its document spans: ``S_in(j + 1) = h_j + M_j S_in(j)`` through chunks that are
one piece of a document, ``h_j`` after a chunk in which the document starts, 0 where the chunk starts a document.
The whole computation is autograd: the backward of the all-gather reduce-scatters the gradient of every summary to
its owner, so gradients flow back through the state into earlier ranks, and every rank joins the collective
(gathered tensors always feed this rank's output, with zero weight where unused).

q and k are L2-normalised and q is scaled here (the kernel is then called with ``use_qk_l2norm=False, scale=1``),
so that the write and probe tokens are exact unit vectors.
Cost over the plain kernel: ``2 K`` extra tokens per chunk and ``V + K`` instead of ``V`` value columns.
"""

from __future__ import annotations

import torch

from megatron_glm5.models.context_parallel import SequenceLayout, gather_sequence, local_cu_seqlens
from megatron_glm5.kernels.kda import l2norm
from megatron_glm5.kernels.short_conv import causal_depthwise_conv1d

__all__ = ["cp_causal_depthwise_conv1d", "cp_chunk_kda"]


def _joined(out: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    """``out`` plus a zero that depends on ``gathered``: this rank's backward then always reaches the all-gather's
    backward collective, whether or not it used what the other ranks sent."""
    return out + (gathered.sum() * 0).to(out.dtype)


def cp_causal_depthwise_conv1d(x: torch.Tensor, weight: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """:func:`~megatron_glm5.kernels.short_conv.causal_depthwise_conv1d` of the whole row, restricted to this CP chunk.

    Args:
        x: ``[b, L, c]`` this rank's inputs (``b = 1`` for a packed row).
        weight: ``[c, W]`` or ``[c, 1, W]``.
        layout: this rank's :class:`~megatron_glm5.models.context_parallel.SequenceLayout`.

    Returns:
        ``[b, L, c]`` in ``weight.dtype``. The ``W - 1`` inputs before the chunk come from earlier ranks (from several
        when chunks are shorter than ``W - 1``); their gradient goes back to them.
    """
    width = weight.shape[-1]
    b, s, c = x.shape
    m = min(width - 1, s)
    tails = gather_sequence(x[:, s - m:], layout.cp_group, seq_dim=1)  # [b, cp * m, c], rank order = row order
    # chunks are equal, so the tails of ranks < r end at the chunk start and their last W - 1 rows are contiguous
    halo = tails[:, : layout.cp_rank * m][:, max(0, layout.cp_rank * m - (width - 1)):]
    n = halo.shape[1]
    ext = torch.cat([halo.to(x.dtype), x], dim=1)
    cu = local_cu_seqlens(layout.cu_seqlens, layout.offset - n, n + s).to(x.device)
    return _joined(causal_depthwise_conv1d(ext, weight, cu)[:, n:], tails)


def _incoming_state(summaries: torch.Tensor, layout: SequenceLayout, v_dim: int) -> torch.Tensor:
    """``S_in`` ``[H, K, V]`` of this rank's first document from the gathered chunk summaries ``[cp, H, K, V + K]``
    (see the module docstring)."""
    h, m = summaries[..., :v_dim], summaries[..., v_dim:]
    r = layout.cp_rank
    state = h[0] * 0  # zero, connected to the gathered tensor
    if layout.chunk_starts_document(r):
        return state
    first = r - 1
    while first > 0 and layout.chunk_is_one_piece(first):
        first -= 1
    state = state + h[first]  # the document starts in chunk `first` (or is chunk 0's first document)
    for j in range(first + 1, r):
        state = h[j] + torch.matmul(m[j], state)
    return state


def cp_chunk_kda(core, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 scale: float, layout: SequenceLayout, chunk_size: int = 64) -> torch.Tensor:
    """The KDA delta rule of the whole packed row, restricted to this CP chunk (module docstring).

    Args:
        core: the per-rank kernel, ``core(q, k, v, g, beta, scale=, cu_seqlens=, chunk_size=, use_qk_l2norm=)``
            (:func:`~megatron_glm5.kernels.kda.chunk_kda_torch` or ``chunk_kda_fla``).
        q, k: ``[1, L, H, K]`` (not yet L2-normalised); v: ``[1, L, H, V]``; g: ``[1, L, H, K]`` log decay;
            beta: ``[1, L, H]``.
        scale: query scale.
        layout: this rank's layout (``cu_seqlens`` of the whole row, offset, CP group).
        chunk_size: the kernel's chunk length.

    Returns:
        ``o`` ``[1, L, H, V]`` in ``q.dtype``.
    """
    b, s, H, K = q.shape
    V = v.shape[-1]
    if b != 1:
        raise ValueError(f"context parallelism needs one packed row per micro-batch (b = 1), got b = {b}")
    dtype, dev = q.dtype, q.device
    f32 = dict(dtype=torch.float32, device=dev)
    eye = torch.eye(K, **f32)[None, :, None, :].expand(1, K, H, K)  # token i of the K virtual ones: e_i per head
    zeros = lambda *shape: torch.zeros(*shape, **f32)  # noqa: E731
    qn = l2norm(q.float()) * scale
    kn = l2norm(k.float())
    seq = [  # (q, k, v, g, beta): K writes | the chunk | K probes
        (zeros(1, K, H, K), eye, torch.cat([zeros(1, K, H, V), eye], -1), zeros(1, K, H, K), torch.ones(1, K, H, **f32)),
        (qn, kn, torch.cat([v.float(), zeros(1, s, H, K)], -1), g.float(), beta.float()),
        (eye, zeros(1, K, H, K), zeros(1, K, H, V + K), zeros(1, K, H, K), zeros(1, K, H)),
    ]
    qe, ke, ve, ge, be = (torch.cat(parts, dim=1) for parts in zip(*seq))
    cu = layout.local_cu_seqlens.to(dev).long()
    cu_ext = torch.cat([cu[:1], cu[1:-1] + K, cu[-1:] + 2 * K])  # writes join the first document, probes the last
    o = core(qe.to(dtype), ke.to(dtype), ve.to(dtype), ge, be.to(dtype), scale=1.0, cu_seqlens=cu_ext,
             chunk_size=chunk_size, use_qk_l2norm=False).float()
    o_zero, o_phi = o[:, K:K + s, :, :V], o[:, K:K + s, :, V:]  # q^T S0_t, q^T Phi_t (0 outside the first doc)
    summary = o[0, K + s:].transpose(0, 1)  # [H, K, V + K]: rows of [h | M]
    summaries = gather_sequence(summary.unsqueeze(0), layout.cp_group)  # [cp, H, K, V + K]
    s_in = _incoming_state(summaries, layout, V)  # [H, K, V]
    return (o_zero + torch.einsum("bshk,hkv->bshv", o_phi, s_in)).to(dtype)
