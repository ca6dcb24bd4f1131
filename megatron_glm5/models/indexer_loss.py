"""The KPool indexer loss (DeepSeek-V3.2's indexer KL objective, over pools) and its plain-PyTorch reference.

For every query ``i`` of a micro batch the main attention's probabilities ``p_h(i, t)`` (per head ``h``, over the
positions ``A_i`` the attention reads) give the *target* over the query's candidate pools ``C_i``::

    mass(i, P) = sum_h sum_{t in P} p_h(i, t)           target(i, .) = mass(i, .) / sum_{P in C_i} mass(i, P)

and the indexer's pool scores ``score(i, P)`` (:mod:`megatron_glm5.models.kpool_indexer`) its *prediction*
``log_softmax_{P in C_i} score(i, P)``. The loss is ``KL(target || prediction)`` per query, summed
(megatron-core's ``dsa_indexer_loss`` helpers: ``normalize_indexer_target``, ``indexer_kl_per_row``).

* dense (the warm-up, or ``dsa_indexer_use_sparse_loss`` off): ``A_i`` = every position of the query's document up
  to and including it (dense causal attention), ``C_i`` = every complete pool it sees.
* sparse (``dsa_indexer_use_sparse_loss``): ``A_i`` = the selection (the selected pools' tokens and the
  always-selected tail), ``C_i`` = the selected pools: the attention's own softmax over what it read.

The always-selected tail (the query's own incomplete pool) is in ``A_i``, so it takes its share of each head's
probability, but it is not a candidate: the indexer does not score it (it is always attended), and the target is
the distribution over the pools the indexer chooses among. Queries with no candidate pool (the first tokens of a
document) have no loss term and are not counted.

Gradients: only the indexer's tensors (``KPoolFeatures.q / pool_keys / weights``) carry them; the target is built
from detached attention tensors and the indexer's inputs are detached by the caller, so the LM loss never reaches
the indexer and the indexer loss never reaches the model.

Kernels: on CUDA with Triton the target's per-pool mass (sparse with the attention's ``lse``, and dense) comes from
:mod:`megatron_glm5.kernels.pool_mass` (no ``[c, H, width]`` / ``[c, H, S]`` probabilities), and the sparse
target's indexer logits at the selected pools, with their gradients, from
:mod:`megatron_glm5.kernels.selected_pool_scores` (no gathered ``[c, n, D]`` keys): the sparse loss then runs over
all queries at once, no chunks. Elsewhere, and for shapes the kernels do not take, the PyTorch code here runs,
chunked over queries; it is their reference.

Parallelism: the main attention's heads are split over TP (the head sum is all-reduced over TP; the indexer is
replicated and sees the whole sequence). Under CP the queries are this rank's, the keys / latents / pools the whole
row's; :func:`indexer_loss_value` divides by the row's count of queries with a loss term (summed over CP), so the
CP ranks' losses add up to one rank's.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.transformer.experimental_attention_variant import dsa_indexer_loss, dsa_masking

from megatron_glm5.kernels import pool_mass, selected_pool_scores
from megatron_glm5.kernels.indexer_scores import indexer_scores_reference
from megatron_glm5.kernels.documents import document_ids

__all__ = ["dense_pool_mass", "kpool_indexer_kl", "kpool_indexer_kl_reference", "indexer_loss_value", "indexer_loss_slot"]


def _tp_sum(x: torch.Tensor, tp_group) -> torch.Tensor:
    if tp_group is not None and dist.is_initialized() and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(x, group=tp_group)
    return x


def _kl_rows(target_mass: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor) -> Tuple[torch.Tensor,
                                                                                            torch.Tensor]:
    """``(sum of KL over rows with a candidate, number of such rows)`` from the unnormalised target mass, the
    indexer scores and the candidate mask (all ``[..., n]``). A row without a candidate has target 0 and log
    probabilities 0 (``masked_log_softmax``), so its terms are 0."""
    target = dsa_indexer_loss.normalize_indexer_target(target_mass.masked_fill(~valid, 0.0))
    log_probs = dsa_masking.masked_log_softmax(logits.float(), valid)
    kl = dsa_indexer_loss.indexer_kl_per_row(target, log_probs, valid)     # 0 on rows without a candidate
    return kl.sum(), valid.any(-1).sum()


def _real_rows(feats, a: int, e: int, row_length: Optional[int]) -> torch.Tensor:
    """``[e - a]`` bool: queries ``[a, e)`` (local) that lie before ``row_length``."""
    pos = torch.arange(feats.offset + a, feats.offset + e, device=feats.query_doc.device)
    return pos < (row_length if row_length else feats.global_len)


def kpool_indexer_kl(feats, q_lat: torch.Tensor, kv_lat: torch.Tensor, attn_scale: float, index_scale: float,
                     topk_indices: Optional[torch.Tensor], kpool: int, index_topk: int, sparse: bool,
                     tp_group=None, chunk_elements: int = 1 << 24,
                     row_length: Optional[int] = None,
                     lse: Optional[torch.Tensor] = None,
                     fused: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The indexer KL of this rank's queries: chunked over queries, or, for the sparse target with the kernels
    (``fused`` and ``lse``), over all of them in one pass.

    Args:
        feats: the indexer's :class:`~megatron_glm5.models.kpool_indexer.KPoolFeatures` (``selected_pools`` set
            for ``sparse``); gradients flow into its ``q``, ``pool_keys`` and ``weights``.
        q_lat: ``[b, s, Hl, r]`` absorbed main queries (``q W_kc``) of this rank's heads, detached.
        kv_lat: ``[b, S, r]`` the whole row's KV latents, detached.
        attn_scale / index_scale: softmax scale of the attention / the indexer (``D^-0.5``).
        topk_indices: ``[b, s, width]`` the selection (``sparse`` only).
        kpool, index_topk: the indexer's pool size and token budget.
        sparse: target over the selection (else dense causal, see the module docstring).
        tp_group: the attention's TP group (the head sum is all-reduced over it).
        chunk_elements: bound on the elements of a chunk's per-head score tensors (or, with the kernels, of their
            per-pool mass; the sparse target with the kernels runs every query in one pass).
        row_length: queries at row positions from it on (a context-parallel split's padding) have no term.
        lse: ``[b, s, Hl]`` the sparse attention's log-sum-exp over the selection (``sparse_mla(...,
            return_lse=True)``, ``sparse`` only): the probabilities are ``exp(score - lse)`` instead of a softmax
            over the recomputed scores.
        fused: use the kernels: the dense target's mass from :mod:`megatron_glm5.kernels.pool_mass`; the sparse
            target (with ``lse``, and an index-head width :mod:`megatron_glm5.kernels.selected_pool_scores` takes)
            in one pass, mass and logits from the kernels;
            ``None``: on CUDA tensors when the kernels take the shape (:func:`~megatron_glm5.kernels.pool_mass.
            supported`).

    Returns:
        ``(kl_sum, rows)``: the summed KL (fp32 scalar, differentiable) and the number of queries with a term.
    """
    b, s, Hl, _ = q_lat.shape
    S = kv_lat.shape[1]
    device = q_lat.device
    kl_total = torch.zeros((), dtype=torch.float32, device=device)
    rows_total = torch.zeros((), dtype=torch.long, device=device)
    fused = _use_kernels(fused, q_lat, kpool)
    Hi = feats.q.shape[2]
    if sparse:
        n_sel = index_topk // kpool
        if fused and lse is not None and selected_pool_scores.supported(feats.pool_keys.shape[-1]):
            # all queries at once: [b, s, n_sel] fp32 mass and logits (32 MB each at 16K), one KL pass
            mass = _tp_sum(pool_mass.sparse_pool_mass(q_lat, kv_lat, topk_indices, lse, attn_scale, kpool,
                                                      n_sel * kpool), tp_group)
            sel = feats.selected_pools
            valid = (sel >= 0) & _real_rows(feats, 0, s, row_length)[None, :, None]
            logits = selected_pool_scores.selected_pool_scores(feats.q, feats.pool_keys, feats.weights, sel,
                                                               index_scale)
            return _kl_rows(mass, logits, valid)
        chunk = max(1, chunk_elements // max(1, b * Hl * topk_indices.shape[-1]))
        for a in range(0, s, chunk):
            e = min(s, a + chunk)
            mass = _tp_sum(pool_mass.sparse_pool_mass_reference(q_lat[:, a:e], kv_lat, topk_indices[:, a:e],
                                                                attn_scale, kpool, n_sel,
                                                                None if lse is None else lse[:, a:e]), tp_group)
            sel = feats.selected_pools[:, a:e]
            valid = (sel >= 0) & _real_rows(feats, a, e, row_length)[None, :, None]
            logits = selected_pool_scores.selected_pool_scores_reference(
                feats.q[:, a:e], feats.pool_keys, feats.weights[:, a:e], sel.clamp(min=0), index_scale)
            kl, rows = _kl_rows(mass, logits, valid)
            kl_total, rows_total = kl_total + kl, rows_total + rows
        return kl_total, rows_total

    # dense: two levels of chunks, the target's mass over blocks of queries (the PyTorch code holds per-head
    # [Hl, S] scores per query, the kernel only its [n] output) and the KL over sub-chunks of those, bounded by the
    # indexer side's [Hi, n] per-head scores (n candidate pools)
    n_pools = max(1, feats.pool_doc.numel())
    outer = max(1, chunk_elements // max(1, b * (n_pools if fused else max(Hl * S, n_pools * Hi))))
    inner = max(1, chunk_elements // max(1, b * n_pools * Hi)) if fused else outer
    for A in range(0, s, outer):
        E = min(s, A + outer)
        LO, HI = feats.candidate_range(A, E)
        if HI <= LO:
            continue
        block, block_visible = dense_pool_mass(feats, q_lat, kv_lat, attn_scale, A, E, LO, HI, tp_group,
                                               fused=fused)                           # [b, C, HI - LO]
        for a in range(A, E, inner):
            e = min(E, a + inner)
            lo, hi = feats.candidate_range(a, e)                                       # within [LO, HI)
            if hi <= lo:
                continue
            mass = block[:, a - A:e - A, lo - LO:hi - LO]
            logits = indexer_scores_reference(feats.q[:, a:e], feats.pool_keys[:, lo:hi], feats.weights[:, a:e],
                                              index_scale)
            valid = block_visible[a - A:e - A, lo - LO:hi - LO] & _real_rows(feats, a, e, row_length)[:, None]
            kl, rows = _kl_rows(mass, logits, valid[None].expand_as(logits))
            kl_total, rows_total = kl_total + kl, rows_total + rows
    return kl_total, rows_total


def _use_kernels(fused: Optional[bool], q_lat: torch.Tensor, kpool: int) -> bool:
    if fused is None:
        return q_lat.is_cuda and pool_mass.supported(kpool, q_lat.shape[-1])
    return bool(fused)


def dense_pool_mass(feats, q_lat: torch.Tensor, kv_lat: torch.Tensor, attn_scale: float, a: int, e: int, lo: int,
                    hi: int, tp_group=None, fused: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dense causal attention's probability per pool, summed over all heads: queries ``[a, e)`` (local) and pools
    ``[lo, hi)`` (``feats.candidate_range(a, e)``) -> ``(mass [b, c, hi - lo], visible [c, hi - lo])``.
    Shapes of ``q_lat`` / ``kv_lat`` as in :func:`kpool_indexer_kl`; no gradient. ``fused`` as there: the kernel
    :func:`~megatron_glm5.kernels.pool_mass.dense_pool_mass`, else the PyTorch code here (its reference)."""
    off, device = feats.offset, q_lat.device
    qpos = torch.arange(off + a, off + e, device=device)
    qdoc = feats.query_doc[a:e]
    pools_visible = ((feats.pool_doc[lo:hi][None, :] == qdoc[:, None])
                     & (feats.pool_end[lo:hi][None, :] <= qpos[:, None]))
    kpool = feats.pool_tokens.shape[1]
    if _use_kernels(fused, q_lat, kpool):
        first = torch.searchsorted(feats.pool_doc, qdoc)                          # the document's first pool
        count = torch.searchsorted(feats.pool_doc, qdoc, right=True) - first      # and its number of pools
        mass = pool_mass.dense_pool_mass(q_lat[:, a:e].detach(), kv_lat.detach(), feats.cu_seqlens[qdoc], qpos + 1,
                                         first - lo, count, hi - lo, attn_scale, kpool)
        return _tp_sum(mass, tp_group), pools_visible
    key_doc = document_ids(feats.cu_seqlens, kv_lat.shape[1])
    k0 = int(feats.pool_tokens[lo, 0])            # first pool of the chunk's first document: its first token
    k1 = off + e
    kpos = torch.arange(k0, k1, device=device)
    visible = (key_doc[k0:k1][None, :] == qdoc[:, None]) & (kpos[None, :] <= qpos[:, None])       # [c, K]
    with torch.no_grad():
        scores = torch.einsum("bchr,bkr->bchk", q_lat[:, a:e].float(), kv_lat[:, k0:k1].float()) * attn_scale
        probs = dsa_masking.masked_softmax(scores, visible[None, :, None].expand_as(scores))
        mass = _tp_sum(probs.sum(2), tp_group)                                       # [b, c, K]
        mass = mass[:, :, feats.pool_tokens[lo:hi] - k0].sum(-1)                      # [b, c, P']
    return mass, pools_visible


def kpool_indexer_kl_reference(q_idx: torch.Tensor, pool_keys: torch.Tensor, weights: torch.Tensor,
                               q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, kpool: int,
                               attn_scale: float, index_scale: float, topk_indices: Optional[torch.Tensor] = None,
                               selected_pools: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch definition of :func:`kpool_indexer_kl` on one rank: whole ``[b, H, s, s]`` probabilities from
    expanded per-head keys, pooled by a token-to-pool matrix, masks built by scatter.

    ``q_idx [b, s, Hi, D]``, ``pool_keys [b, P, D]``, ``weights [b, s, Hi]`` (the indexer's), ``q [b, s, H, dq]``,
    ``k [b, s, H, dq]`` (the attention's), ``cu_seqlens [n + 1]`` of the row; ``topk_indices [b, s, w]`` and
    ``selected_pools [b, s, n]`` for the sparse target (``None``: dense). Returns ``(kl_sum, rows)``.
    """
    from megatron_glm5.models.kpool_indexer import kpool_pool_layout

    b, s = q.shape[:2]
    pos = torch.arange(s)
    doc = document_ids(cu_seqlens.long(), s)
    causal = (doc[None, :] == doc[:, None]) & (pos[None, :] <= pos[:, None])          # [s, s]
    pool_tokens, pool_doc = kpool_pool_layout(cu_seqlens, kpool)
    P = pool_doc.numel()
    member = torch.zeros(s, P)
    member[pool_tokens.reshape(-1), torch.arange(P).repeat_interleave(kpool)] = 1.0  # [s, P] token -> pool
    pool_visible = (pool_doc[None, :] == doc[:, None]) & (pool_tokens[:, -1][None, :] <= pos[:, None])   # [s, P]
    if topk_indices is None:
        attend = causal[None].expand(b, -1, -1)
        candidates = pool_visible[None].expand(b, -1, -1)
    else:
        attend = torch.zeros(b, s, s + 1, dtype=torch.bool)
        attend.scatter_(2, torch.where(topk_indices >= 0, topk_indices.long(), s), True)
        attend = attend[..., :s]
        candidates = torch.zeros(b, s, P + 1, dtype=torch.bool)
        candidates.scatter_(2, torch.where(selected_pools >= 0, selected_pools.long(), P), True)
        candidates = candidates[..., :P]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * attn_scale
    scores = scores.masked_fill(~attend[:, None], float("-inf"))
    has = attend.any(-1)[:, None, :, None]
    probs = torch.where(has, scores, 0.0).softmax(-1) * has                       # [b, H, s, s]
    mass = probs.sum(1) @ member                                                   # [b, s, P]
    target = mass.masked_fill(~candidates, 0.0)
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-10)
    logits = indexer_scores_reference(q_idx, pool_keys, weights, index_scale)      # [b, s, P]
    logits = logits.masked_fill(~candidates, float("-inf"))
    row = candidates.any(-1)
    log_probs = torch.where(row[..., None], logits, 0.0).log_softmax(-1)
    terms = torch.where(candidates, target * (torch.log(target.clamp_min(1e-10)) - log_probs), 0.0)
    return terms.sum(), row.sum()


def indexer_loss_value(kl_sum: torch.Tensor, rows: torch.Tensor, coeff: float, calculate_per_token_loss: bool,
                       cp_group=None) -> torch.Tensor:
    """The micro batch's indexer loss: ``coeff * kl_sum / rows`` with ``rows`` summed over the CP group (so the
    CP ranks' values add up to one rank's), or ``coeff * kl_sum`` with ``calculate_per_token_loss``
    (megatron-core's ``reduce_indexer_kl_sum``: the gradient reduction divides by the token count)."""
    if calculate_per_token_loss:
        return kl_sum * coeff
    count = rows.detach().float().clone()
    if cp_group is not None and dist.is_initialized() and dist.get_world_size(cp_group) > 1:
        dist.all_reduce(count, group=cp_group)
    return kl_sum / count.clamp_min(1.0) * coeff


def indexer_loss_slot(config, layer_number: int, is_mtp_layer: bool = False) -> Tuple[int, int]:
    """``(slot, n_slots)``: the 1-based place of a layer's indexer among the model's (the decoder's 'full' DSA layers
    in order, then the MTP layers; ``layer_number`` is the global layer number, or the MTP depth with
    ``is_mtp_layer``), for megatron-core's ``DSAIndexerLossLoggingHelper`` (whose logged 'indexer loss' is the mean
    over the slots)."""
    from megatron_glm5.config import INDEXED_ATTENTION

    full = [i + 1 for i in range(config.num_layers) if config.layer_types[i] == INDEXED_ATTENTION
            and config.indexer_types[i] == "full"]
    n_slots = len(full) + int(config.mtp_num_layers or 0)
    if is_mtp_layer:
        return len(full) + layer_number, n_slots
    return full.index(layer_number) + 1, n_slots
