"""The KPool DSA indexer of GLM-5.3-Flash (HF ``Glm5NextTextIndexer``), extended to packed rows.

The indexer picks, for every query, the key positions its sparse attention may read:

1. Per position ``t``: an indexer key ``k_t = LayerNorm(wk x_t)`` ``[D]`` and a pooling gate
   ``g_t = W_gate x_t`` ``[D]`` (``D = index_head_dim``).
2. Keys are grouped into *pools* of ``index_kpool`` consecutive tokens, counted from the first token of the
   document. Only complete pools are candidates. A pool's key is a per-dimension softmax over its ``kpool`` slots
   of ``g_t + ape[slot]`` (fp32) weighting the slot keys: ``poolkey[d] = sum_j softmax_j(g[j, d] + ape[j, d]) k[j, d]``.
3. Per query ``i`` (``H = index_n_heads`` heads, ``q_i = wq_b q_resid_i`` ``[H, D]``):
   ``score(i, p) = sum_h w_ih * relu(q_ih . poolkey_p * D^-0.5)``, ``w_i = weights_proj(x_i) * H^-0.5``.
4. A pool is selectable iff its last token is visible to the query (causal and, for packed rows, in the same
   document). The ``min(index_topk / kpool, n_pools)`` best selectable pools are expanded to their tokens; of
   pools with equal scores the earlier wins, so the selection does not depend on the layout.
5. With ``index_kpool_always_select_tail`` the query's own incomplete pool (document-local positions
   ``[visible - visible % kpool, visible)``, i.e. up to and including the query) is appended.

Packed rows (``b = 1`` plus megatron-core ``PackedSeqParams``) behave exactly like running HF on every document
separately: pools start at each document's first token, visibility is causal and same-document, tails are
document-local, and the returned indices are row positions (document start + local index). ``-1`` marks an
unused slot.

Context parallelism (a contiguous chunk of the row per CP rank, :mod:`megatron_glm5.models.context_parallel`):
the queries are this rank's tokens; keys and pooling gates are all-gathered over the CP group, so pools (which may
straddle a chunk edge), document masks and tails are those of the whole row and the indices are row positions.

Output layout ``[b, s, width]`` int32: slots ``[0, index_topk)`` hold the tokens of the selected pools (``-1``
padded), slots ``[index_topk, index_topk + kpool - 1)`` hold the tail when ``index_kpool_always_select_tail``
(``width = index_topk + kpool - 1``; otherwise ``width = index_topk``). Selected pools are disjoint and do not
overlap the tail, so no position appears twice. Only the set of positions matters to the attention.

Training (``docs/indexer_training.md``): the selection never carries a gradient. With the indexer loss off
(``config.dsa_indexer_loss_coeff`` unset or 0, the default) the indexer's parameters are frozen
(``requires_grad=False``: no gradient, no optimizer group, no weight decay; still saved). With it on,
:meth:`KPoolIndexer.forward` ``(return_features=True)`` also returns the differentiable scores' inputs
(:class:`KPoolFeatures`) for :mod:`megatron_glm5.models.indexer_loss`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule

from megatron_glm5.execution_plan import plan_of
from megatron_glm5.kernels import indexer_scores
from megatron_glm5.models.context_parallel import cp_group_of, gather_sequence, sequence_layout
from megatron_glm5.models.linear import ReplicatedLinear
from megatron_glm5.kernels.documents import document_ids, document_starts
from megatron_glm5.models.packing import row_boundaries, to_device_async
from megatron_glm5.models.params import mark_replicated, param_device

__all__ = ["KPoolFeatures", "KPoolIndexer", "kpool_pool_layout", "kpool_tail_indices"]


def kpool_pool_layout(cu_seqlens: torch.Tensor, kpool: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Complete document-local pools of one row.

    Args:
        cu_seqlens: int ``[n_docs + 1]`` document boundaries of the row.
        kpool: tokens per pool.

    Returns:
        pool_tokens: int64 ``[P, kpool]`` row positions of every complete pool, ordered by position
            (document ``d`` contributes ``len_d // kpool`` pools starting at its first token).
        pool_doc: int64 ``[P]`` document index of every pool (non-decreasing).
    """
    cu = cu_seqlens.long()
    n_pools = (cu[1:] - cu[:-1]) // kpool                      # [n_docs]
    docs = torch.arange(n_pools.numel(), device=cu.device)
    pool_doc = torch.repeat_interleave(docs, n_pools)          # [P]
    first_pool = torch.cumsum(n_pools, 0) - n_pools            # [n_docs]
    local = torch.arange(pool_doc.numel(), device=cu.device) - first_pool[pool_doc]
    pool_start = cu[pool_doc] + local * kpool                  # [P]
    pool_tokens = pool_start[:, None] + torch.arange(kpool, device=cu.device)
    return pool_tokens, pool_doc


def kpool_tail_indices(cu_seqlens: torch.Tensor, seq_len: int, kpool: int) -> torch.Tensor:
    """The query's own incomplete pool, as row positions.

    For query ``i`` with ``v = i - doc_start + 1`` visible tokens in its document, the tail is the ``v % kpool``
    positions ``[i + 1 - v % kpool, i]``.

    Returns:
        int64 ``[seq_len, kpool - 1]``, ``-1`` in unused slots.
    """
    device = cu_seqlens.device
    pos = torch.arange(seq_len, device=device)
    visible = pos - document_starts(cu_seqlens, seq_len) + 1
    tail_count = visible % kpool
    offsets = torch.arange(kpool - 1, device=device)
    tail = (pos + 1 - tail_count)[:, None] + offsets
    return tail.masked_fill(offsets[None, :] >= tail_count[:, None], -1)


@dataclass
class KPoolFeatures:
    """What the indexer computes for one micro batch before its top-k (``b`` rows of ``s`` queries at row positions
    ``[offset, offset + s)`` of a row of ``global_len`` tokens; ``P`` complete pools of the whole row).

    ``q [b, s, H, D]`` indexer queries, ``pool_keys [b, P, D]`` fp32, ``weights [b, s, H]`` fp32 (times
    ``H^-0.5``): the pool score is :func:`~megatron_glm5.kernels.indexer_scores.indexer_scores_reference` of them.
    ``pool_tokens [P, kpool]`` / ``pool_doc [P]`` / ``pool_end [P]``: row positions, document and last position of
    every pool (``*_h``: host copies); ``query_doc [s]``: document of every query; ``bounds``: the row's document
    boundaries (host list); ``selected_pools [b, s, index_topk // kpool]``: the selection's pool numbers
    (``-1`` unused), set by :meth:`KPoolIndexer.forward`.
    """

    q: torch.Tensor
    pool_keys: torch.Tensor
    weights: torch.Tensor
    cu_seqlens: torch.Tensor
    offset: int
    global_len: int
    bounds: List[int]
    pool_tokens: torch.Tensor
    pool_doc: torch.Tensor
    pool_end: torch.Tensor
    pool_doc_h: torch.Tensor
    pool_end_h: torch.Tensor
    query_doc: torch.Tensor
    cp_group: object = None
    selected_pools: Optional[torch.Tensor] = None

    def candidate_range(self, a: int, e: int) -> Tuple[int, int]:
        """Pools ``[lo, hi)`` that queries ``[a, e)`` (local) may see: from the first pool of the first query's
        document up to the last pool that ends at or before the last query (one contiguous range)."""
        if not self.pool_doc_h.numel():
            return 0, 0
        first_doc = bisect.bisect_right(self.bounds, self.offset + a) - 1            # document of query off + a
        lo = int(torch.searchsorted(self.pool_doc_h, torch.tensor([first_doc])).item())
        hi = int(torch.searchsorted(self.pool_end_h, torch.tensor([self.offset + e - 1]), right=True).item())
        return lo, hi


class KPoolIndexer(MegatronModule):
    """KPool DSA indexer (see the module docstring). All parameters are replicated over TP.

    Parameters (HF names): ``wq_b.weight [H*D, q_lora_rank]``, ``wk.weight [D, hidden]``, ``k_norm.weight/bias [D]``
    (LayerNorm, eps 1e-6), ``weights_proj.weight [H, hidden]``, ``index_kpool_compress_ape [kpool, D]`` (kept in
    fp32, ``keep_fp32 = True``), ``index_kpool_compress_gate [D, hidden]``.
    """

    def __init__(self, config, submodules=None, layer_number: Optional[int] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None):
        super().__init__(config=config)
        self.layer_number = layer_number
        # the execution plan: indexer_fused_scores (the pool scores as one Triton kernel on CUDA tensors,
        # kernels/indexer_scores.py), indexer_fuse_topk_keys (the kernel also masks them and writes the selection's
        # sort keys: the same selection, bitwise), indexer_score_chunk_elements (bound on the per-chunk score
        # tensor: [b, chunk, H, n_pools] in PyTorch, [b, chunk, n_pools] fused)
        self.plan = plan_of(config)
        self.hidden_size = config.hidden_size
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.q_lora_rank = config.q_lora_rank
        self.index_topk = config.index_topk
        self.kpool = config.index_kpool
        self.always_select_tail = config.index_kpool_always_select_tail
        self.softmax_scale = self.head_dim ** -0.5
        if self.index_topk % self.kpool:
            raise ValueError(f"index_topk {self.index_topk} is not divisible by index_kpool {self.kpool}")

        device, dtype = param_device(config), config.params_dtype
        init = config.init_method
        self.wq_b = ReplicatedLinear(self.q_lora_rank, self.n_heads * self.head_dim, config=config, init_method=init)
        self.wk = ReplicatedLinear(self.hidden_size, self.head_dim, config=config, init_method=init)
        self.k_norm = torch.nn.LayerNorm(self.head_dim, eps=1e-6, device=device, dtype=dtype)
        self.weights_proj = ReplicatedLinear(self.hidden_size, self.n_heads, config=config, init_method=init)
        # HF init: ape = 0, gate = 1.
        self.index_kpool_compress_ape = torch.nn.Parameter(
            torch.zeros(self.kpool, self.head_dim, device=device, dtype=torch.float32))
        self.index_kpool_compress_ape.keep_fp32 = True
        self.index_kpool_compress_gate = torch.nn.Parameter(
            torch.ones(self.head_dim, self.hidden_size, device=device, dtype=dtype))
        mark_replicated(self)
        self.cp_group = cp_group_of(pg_collection)
        if not (getattr(config, "dsa_indexer_loss_coeff", None) or 0.0) > 0:
            self.requires_grad_(False)   # frozen: nothing trains the indexer without its loss

    @property
    def output_width(self) -> int:
        """Slots per query: ``index_topk`` (+ ``kpool - 1`` tail slots with ``always_select_tail``)."""
        return self.index_topk + (self.kpool - 1 if self.always_select_tail else 0)

    # ------------------------------------------------------------------ pieces
    def pooled_keys(self, keys: torch.Tensor, gates: torch.Tensor, pool_tokens: torch.Tensor) -> torch.Tensor:
        """Pool keys ``[b, P, D]`` from per-position keys / gate logits ``[b, s, D]`` and ``pool_tokens [P, kpool]``:
        a per-dimension softmax (fp32) over the ``kpool`` slots of ``gate + ape`` weights the slot keys."""
        grouped_keys = keys[:, pool_tokens]                                       # [b, P, kpool, D]
        logits = gates[:, pool_tokens].float() + self.index_kpool_compress_ape.float()[None, None]
        probs = logits.softmax(dim=2).to(grouped_keys.dtype)
        return (probs * grouped_keys).sum(dim=2)

    def features(self, hidden_states: torch.Tensor, q_resid: torch.Tensor,
                 packed_seq_params: Optional[PackedSeqParams] = None) -> "KPoolFeatures":
        """The indexer's per-query and per-pool tensors of one micro batch (differentiable where autograd is on).

        Args: as :meth:`forward`. Returns: :class:`KPoolFeatures`.
        """
        s, b, _ = hidden_states.shape
        device = hidden_states.device
        if packed_seq_params is not None and packed_seq_params.cu_seqlens_q is not None and b != 1:
            raise ValueError(f"a packed row must have batch size 1, got {b}")
        # Queries are this rank's s tokens at row positions [off, off + s); keys, pools and document masks are those
        # of the whole row of S tokens (S = s, off = 0 without context parallelism).
        layout = sequence_layout(packed_seq_params, s, device, self.cp_group)
        cu, off, S = layout.cu_seqlens, layout.offset, layout.global_len
        x = hidden_states.transpose(0, 1)                                          # [b, s, h]
        H, D, kp = self.n_heads, self.head_dim, self.kpool

        q = self.wq_b(q_resid.transpose(0, 1)).view(b, s, H, D)                   # [b, s, H, D]
        keys = self.k_norm(self.wk(x))                                             # [b, s, D]
        gates = F.linear(x, self.index_kpool_compress_gate)                        # [b, s, D]
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * (H ** -0.5)   # [b, s, H]
        keys = gather_sequence(keys, layout.cp_group, seq_dim=1)                   # [b, S, D]
        gates = gather_sequence(gates, layout.cp_group, seq_dim=1)                 # [b, S, D]

        # the pool layout and the chunks' candidate ranges come from the boundaries on the host: built from the
        # device copy they would make the host wait for the GPU (output sizes, .item()) several times per layer
        bounds = row_boundaries(packed_seq_params, S) if layout.cp_size == 1 else cu.tolist()
        pool_tokens_h, pool_doc_h = kpool_pool_layout(torch.tensor(bounds, dtype=torch.long), kp)  # host
        pool_end_h = pool_tokens_h[:, -1].contiguous()
        pool_tokens, pool_doc, pool_end = (to_device_async(t, device)
                                           for t in (pool_tokens_h, pool_doc_h, pool_end_h))  # [P, kp], [P], [P]
        pool_keys = self.pooled_keys(keys, gates, pool_tokens).float()                # [b, P, D]
        doc = document_ids(cu, S)[off:off + s]                                     # [s]
        return KPoolFeatures(q=q, pool_keys=pool_keys, weights=weights, cu_seqlens=cu, offset=off, global_len=S,
                             bounds=bounds, pool_tokens=pool_tokens, pool_doc=pool_doc, pool_end=pool_end,
                             pool_doc_h=pool_doc_h, pool_end_h=pool_end_h, query_doc=doc,
                             cp_group=layout.cp_group)

    def forward(self, hidden_states: torch.Tensor, q_resid: torch.Tensor,
                packed_seq_params: Optional[PackedSeqParams] = None, return_features: bool = False):
        """Select the attended positions of every query.

        Args:
            hidden_states: ``[s, b, hidden]`` the attention input.
            q_resid: ``[s, b, q_lora_rank]`` ``q_a_layernorm(q_a_proj(x))`` of the attention.
            packed_seq_params: document boundaries of a packed row (``b`` must be 1); ``None``: every batch row
                is one document.
            return_features: also return the :class:`KPoolFeatures` (with ``selected_pools``), computed with
                autograd on (when it is on) so that the indexer loss can train the indexer; the selection itself is
                the same, bitwise, and never differentiable.

        Returns:
            ``[b, s, output_width]`` int32 row positions, ``-1`` for unused slots (layout in the module docstring);
            with ``return_features``: ``(indices, features)``.
        """
        with torch.set_grad_enabled(return_features and torch.is_grad_enabled()):
            feats = self.features(hidden_states, q_resid, packed_seq_params)
        with torch.no_grad():
            indices, selected_pools = self._select(feats)
        if return_features:
            feats.selected_pools = selected_pools
            return indices, feats
        return indices

    def _select(self, feats: "KPoolFeatures") -> Tuple[torch.Tensor, torch.Tensor]:
        """The selection of :meth:`forward` from the features: ``(indices [b, s, width] int32, selected_pools
        [b, s, index_topk // kpool] int64)``, the pool numbers (rows of ``feats.pool_tokens``) of the selected
        pools in slot order, ``-1`` where a slot is unused."""
        q, pool_keys, weights = feats.q, feats.pool_keys, feats.weights
        b, s = q.shape[:2]
        device = q.device
        kp, off, S = self.kpool, feats.offset, feats.global_len
        pool_tokens, pool_doc, pool_end, doc = feats.pool_tokens, feats.pool_doc, feats.pool_end, feats.query_doc
        n_pools = pool_doc.numel()
        pool_first = pool_tokens[:, 0].contiguous()                                # a pool: kp consecutive tokens
        slot = torch.arange(kp, device=device, dtype=torch.int32)

        pool_part = torch.full((b, s, self.index_topk), -1, dtype=torch.int32, device=device)
        max_select = self.index_topk // kp
        selected_pools = torch.full((b, s, max_select), -1, dtype=torch.long, device=device)
        H = self.n_heads
        fused = self.plan.indexer_fused_scores and q.is_cuda
        # the PyTorch scores hold [b, chunk, H, p] per-head values; the fused kernel writes only [b, chunk, p]
        chunk = max(16, self.plan.indexer_score_chunk_elements // max(1, b * n_pools * (1 if fused else H)))
        for a in range(0, s, chunk):
            e = min(s, a + chunk)
            lo, hi = feats.candidate_range(a, e)
            if hi <= lo:
                continue
            pos = torch.arange(off + a, off + e, device=device)
            k = min(max_select, hi - lo)
            # equal scores (ReLU zeros are common) go to the earlier pool, so the same pools are picked however the
            # queries are chunked or cut over CP ranks (the candidate range differs)
            mask = (doc[a:e], off + a, pool_doc[lo:hi], pool_end[lo:hi])
            if fused and self.plan.indexer_fuse_topk_keys:
                sort_keys = indexer_scores.indexer_topk_keys(q[:, a:e], pool_keys[:, lo:hi], weights[:, a:e],
                                                             self.softmax_scale, *mask)
            else:
                score_fn = indexer_scores.indexer_scores if fused else indexer_scores.indexer_scores_reference
                index_scores = score_fn(q[:, a:e], pool_keys[:, lo:hi], weights[:, a:e], self.softmax_scale)
                sort_keys = indexer_scores.masked_topk_keys(index_scores, *mask)          # [b, c, p] int64
            selected = sort_keys.topk(k, dim=-1).indices                                   # [b, c, k]
            sel_pool = selected + lo
            selected_valid = (pool_doc[sel_pool] == doc[a:e, None]) & (pool_end[sel_pool] <= pos[:, None])
            first = torch.take(pool_first, sel_pool).to(torch.int32)                      # [b, c, k]
            tokens = torch.where(selected_valid[..., None], first[..., None] + slot, -1)   # [b, c, k, kp]
            pool_part[:, a:e, : k * kp] = tokens.flatten(-2)
            selected_pools[:, a:e, :k] = torch.where(selected_valid, sel_pool, -1)

        if self.always_select_tail and kp > 1:
            tail = kpool_tail_indices(feats.cu_seqlens, S, kp)[off:off + s][None].expand(b, -1, -1)
            return torch.cat([pool_part, tail.to(torch.int32)], dim=-1), selected_pools
        return pool_part, selected_pools
