"""KPool DSA attention of GLM-5.3-Flash (HF ``Glm5NextTextAttention``): NoPE MLA + sparse attention over the
positions picked by the KPool indexer, on megatron-core linears.

Math (``H`` heads, ``dq = qk_head_dim``, ``dv = v_head_dim``, ``r = kv_lora_rank``; no RoPE anywhere)::

    q_resid = RMSNorm(q_a_proj x)                       [s, b, q_lora_rank]
    q       = q_b_proj q_resid                          [s, b, H, dq]
    c       = RMSNorm(kv_a_proj_with_mqa x)             [s, b, r]       (the KV latent, shared by all heads)
    k, v    = split(kv_b_proj c)                        [s, b, H, dq], [s, b, H, dv]
    S       = indexer(x, q_resid)  or the previous full layer's selection ('shared' layers)
    o_i     = sum_{j in S_i} softmax_j(q_i . k_j * dq^-0.5) v_j
    out     = o_proj o

Three backends (the execution plan's ``dsa_backend``) compute the same ``o``:

* ``'torch'``: masked dense reference: a boolean ``[b, s, s]`` mask from the selection and
  ``scaled_dot_product_attention`` over expanded per-head K/V. ``O(s^2)`` memory.
* ``'sparse'``: the absorbed form, linear in ``s``: with ``kv_b_proj`` split into ``W_kc [H, dq, r]`` and
  ``W_vc [H, dv, r]``, ``q_lat = q W_kc`` ``[s, H, r]``; per query, gather the selected latent rows
  ``c[S_i]`` ``[width, r]``, ``p = softmax(q_lat . c[S_i] * scale)``, ``o = (p c[S_i]) W_vc^T``. Queries are
  processed in chunks under activation checkpointing, so the gathered ``[chunk, width, r]`` rows are never held
  for more than one chunk.
* ``'fused'`` (the GPU fast path): the same absorbed form with the attention over the selected latents in one
  Triton kernel, forward and backward (``megatron_glm5/kernels/sparse_mla.py``); linear memory. It relies on the
  indexer's selections being duplicate-free (selected pools and the tail are disjoint). Queries whose causal span
  fits the selection (the first ``index_topk + kpool - 1`` positions of each document, with
  ``index_kpool_always_select_tail``: every complete pool before them is selected, and the tail holds the rest)
  attend to every earlier position of their document, so they run as dense causal attention instead
  (:func:`dense_prefix_layout`; torch's fused SDPA over the expanded K/V): the same result, without gathering.

Packed rows (``b = 1`` + ``PackedSeqParams``) need nothing beyond the indexer: it only selects positions of the
query's own document, so queries never attend across documents. Queries with an empty selection (possible only
with ``index_kpool_always_select_tail = False``, for the first ``kpool - 1`` tokens of a document) output zeros
(HF's output is undefined there).

Tensor parallelism: heads are sharded (``q_b_proj``/``kv_b_proj`` column-parallel, ``o_proj`` row-parallel);
``q_a_proj``, ``kv_a_proj_with_mqa``, the two RMSNorms and the indexer are replicated. Sequence parallelism: the
input ``[s/tp, b, h]`` is all-gathered once on entry (the indexer and the latents need the whole sequence), the
layer then runs as under plain TP (its replicated parts see identical gradients on every TP rank, so the gather's
backward only takes this rank's slice), and ``o_proj`` reduce-scatters the output back to ``[s/tp, b, h]``.

Indexer training (``docs/indexer_training.md``): with ``config.dsa_indexer_loss_coeff`` > 0 (in training, autograd
on) the indexer reads detached inputs and its KL loss (:mod:`megatron_glm5.models.indexer_loss`) joins the backward
at this layer's output through megatron-core's ``DSAIndexerLossAutoScaler``; with ``config.dsa_indexer_warmup`` the
attention is dense over every causal position of the query's document (the warm-up stage).

Context parallelism (a contiguous chunk of a packed row per CP rank, :mod:`megatron_glm5.models.context_parallel`):
queries are this rank's tokens; the KV latents ``c`` (``r`` values per token) are all-gathered over the CP group
(backward: reduce-scatter), the indexer selects row positions of the whole row, and both backends attend over the
gathered latents.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.utils import get_pg_size
from torch.utils.checkpoint import checkpoint

from megatron_glm5.execution_plan import plan_of
from megatron_glm5.kernels.sparse_mla import sparse_mla, topk_indices_to_mask
from megatron_glm5.models.context_parallel import cp_group_of, gather_sequence
from megatron_glm5.models.kpool_indexer import KPoolIndexer
from megatron_glm5.models.linear import ReplicatedLinear, linear_output
from megatron_glm5.models.norms import RMSNorm

__all__ = [
    "RMSNorm",
    "Glm5DSAttentionSubmodules",
    "Glm5DSAttention",
    "get_dsa_module_spec",
    "fused_masked_attention",
    "topk_indices_to_mask",
    "dense_topk_attention",
    "sparse_topk_attention",
]


_FUSED_MASKED_BACKENDS = ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
"""torch SDPA backends that take a boolean mask and never build the ``[b, H, s, t]`` score tensor."""
_dense_fallback_reason: Optional[str] = None


def fused_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Masked softmax attention ``[b, H, s, dq] x [b, H, t, dq] x [b, H, t, dv]`` with a boolean ``mask [s, t]``
    (True = attend) -> ``[b, H, s, dv]``. On CUDA it runs one of torch's fused SDPA kernels
    (:data:`_FUSED_MASKED_BACKENDS`: memory-efficient attention, cuDNN) and never the unfused math path, whose
    ``[b, H, s, t]`` scores do not fit at long contexts; where neither kernel takes the inputs it says why once
    (``dense_attention_fallback()``) and runs torch's default choice. CPU: torch's default."""
    global _dense_fallback_reason
    if q.is_cuda and _dense_fallback_reason is None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        try:
            with sdpa_kernel([getattr(SDPBackend, name) for name in _FUSED_MASKED_BACKENDS]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:  # no fused kernel takes these inputs (head widths, dtype, device)
            _dense_fallback_reason = " ".join(str(e).split())[:300]
            logging.getLogger(__name__).warning(
                "dense DSA attention (indexer warm-up): no fused SDPA kernel takes these inputs, torch's default "
                "path runs instead: %s", _dense_fallback_reason)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def dense_attention_fallback() -> Optional[str]:
    """Why :func:`fused_masked_attention` fell back on CUDA in this process (None: it has not)."""
    return _dense_fallback_reason


@dataclass
class DensePrefixLayout:
    """Which queries of a packed row run as dense causal attention (:meth:`Glm5DSAttention._attention_dense_prefix`),
    as host int64 tensors of row positions: ``docs_padded [n, d]`` each document's leading positions (``d`` = the
    longest such prefix; a shorter one is padded at its end with its last position, whose outputs are dropped and
    which, as keys, come after every real query of its row), ``valid [n, d]`` which of them are real, ``dense`` the
    real ones in that order, ``rest`` the other positions of the row (ascending)."""

    docs_padded: torch.Tensor
    valid: torch.Tensor
    dense: torch.Tensor
    rest: torch.Tensor


def dense_prefix_layout(bounds: list, prefix: int) -> Optional[DensePrefixLayout]:
    """The :class:`DensePrefixLayout` of a row with document boundaries ``bounds`` (``[0, ..., s]``, host ints) where
    each document's first ``prefix`` positions attend densely; None when no query would."""
    cu = torch.tensor(bounds, dtype=torch.long)
    starts, lens = cu[:-1], (cu[1:] - cu[:-1]).clamp(max=max(prefix, 0))
    starts, lens = starts[lens > 0], lens[lens > 0]
    if lens.numel() == 0:
        return None
    steps = torch.arange(int(lens.max()))
    valid = steps[None, :] < lens[:, None]                                           # [n, d]
    docs_padded = starts[:, None] + torch.minimum(steps[None, :], lens[:, None] - 1)
    is_dense = torch.zeros(int(cu[-1]), dtype=torch.bool)
    dense = docs_padded[valid]
    is_dense[dense] = True
    return DensePrefixLayout(docs_padded, valid, dense, (~is_dense).nonzero().flatten())


@dataclass
class Glm5DSAttentionSubmodules:
    """Module classes / specs of :class:`Glm5DSAttention` (attribute names are the HF checkpoint names)."""

    q_a_proj: Union[ModuleSpec, type] = None
    q_a_layernorm: Union[ModuleSpec, type] = None
    q_b_proj: Union[ModuleSpec, type] = None
    kv_a_proj_with_mqa: Union[ModuleSpec, type] = None
    kv_a_layernorm: Union[ModuleSpec, type] = None
    kv_b_proj: Union[ModuleSpec, type] = None
    o_proj: Union[ModuleSpec, type] = None
    indexer: Union[ModuleSpec, type] = None


def get_dsa_module_spec() -> ModuleSpec:
    """ModuleSpec of the KPool DSA attention with megatron-core local (non-TE) TP linears."""
    return ModuleSpec(
        module=Glm5DSAttention,
        submodules=Glm5DSAttentionSubmodules(
            q_a_proj=ReplicatedLinear,
            q_a_layernorm=RMSNorm,
            q_b_proj=ColumnParallelLinear,
            kv_a_proj_with_mqa=ReplicatedLinear,
            kv_a_layernorm=RMSNorm,
            kv_b_proj=ColumnParallelLinear,
            o_proj=RowParallelLinear,
            indexer=KPoolIndexer,
        ),
    )


# ---------------------------------------------------------------------------- attention kernels
def dense_topk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topk_indices: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Masked dense reference. ``q [b, s, H, dq]``, ``k [b, t, H, dq]``, ``v [b, t, H, dv]``,
    ``topk_indices [b, s, w]`` -> ``[b, s, H, dv]``. Builds the ``[b, s, t]`` mask: ``O(s t)`` memory.
    Rows with an empty selection output zeros."""
    mask = topk_indices_to_mask(topk_indices, k.shape[1])          # [b, s, t]
    has_any = mask.any(-1)                                         # [b, s]
    mask = mask | ~has_any[..., None]                              # keep every row finite; zeroed below
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=scale)   # [b, H, s, dv]
    out = out.transpose(1, 2)
    return out * has_any[..., None, None].to(out.dtype)


def _sparse_chunk(q_lat: torch.Tensor, kv_lat: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """One query chunk of the absorbed sparse attention.

    ``q_lat [c, H, r]``, ``kv_lat [N, r]`` (all latent rows), ``idx [c, w]`` (row numbers, safe), ``valid [c, w]``
    -> ``o_lat [c, H, r]``.
    """
    kv_sel = kv_lat[idx]                                                       # [c, w, r]
    scores = torch.einsum("chr,cwr->chw", q_lat, kv_sel).float() * scale      # [c, H, w]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    has_any = valid.any(-1)                                                    # [c]
    scores = scores.masked_fill(~has_any[:, None, None], 0.0)                 # empty rows: finite, zeroed below
    probs = scores.softmax(dim=-1).to(kv_sel.dtype)
    o_lat = torch.einsum("chw,cwr->chr", probs, kv_sel)
    return o_lat * has_any[:, None, None].to(o_lat.dtype)


def sparse_topk_attention(q: torch.Tensor, kv_lat: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor,
                          topk_indices: torch.Tensor, scale: float, query_chunk: int = 1024) -> torch.Tensor:
    """Absorbed-MLA sparse attention, linear in the sequence length.

    Args:
        q: ``[b, s, H, dq]`` queries.
        kv_lat: ``[b, t, r]`` normalised KV latents.
        w_kc: ``[H, dq, r]`` key part of ``kv_b_proj`` (``k_h = W_kc[h] c``).
        w_vc: ``[H, dv, r]`` value part of ``kv_b_proj``.
        topk_indices: ``[b, s, w]`` selected positions in ``[0, t)``, ``-1`` unused; duplicates count once.
        scale: softmax scale.
        query_chunk: queries per chunk; the peak extra memory is ``O(query_chunk * w * (r + H))``.

    Returns:
        ``[b, s, H, dv]``; rows with an empty selection are zero. Differentiable w.r.t. ``q``, ``kv_lat``,
        ``w_kc`` and ``w_vc`` (each chunk is recomputed in backward when autograd is on).
    """
    b, s, H, _ = q.shape
    t, r = kv_lat.shape[1], kv_lat.shape[2]
    q_lat = torch.einsum("bshd,hdr->bshr", q, w_kc).reshape(b * s, H, r)      # [b*s, H, r]
    flat_kv = kv_lat.reshape(b * t, r)

    # Sort each row so duplicates are adjacent and count them once (a mask built by scatter does the same).
    idx, _ = topk_indices.long().sort(dim=-1)
    valid = (idx >= 0) & (idx < t)
    dup = torch.zeros_like(valid)
    dup[..., 1:] = idx[..., 1:] == idx[..., :-1]
    valid = valid & ~dup
    row_offset = (torch.arange(b, device=idx.device) * t)[:, None, None]
    idx = torch.where(valid, idx + row_offset, 0).reshape(b * s, -1)
    valid = valid.reshape(b * s, -1)

    use_ckpt = torch.is_grad_enabled() and (q_lat.requires_grad or flat_kv.requires_grad)
    outs = []
    for a in range(0, b * s, query_chunk):
        e = min(b * s, a + query_chunk)
        if use_ckpt:
            outs.append(checkpoint(_sparse_chunk, q_lat[a:e], flat_kv, idx[a:e], valid[a:e], scale,
                                   use_reentrant=False))
        else:
            outs.append(_sparse_chunk(q_lat[a:e], flat_kv, idx[a:e], valid[a:e], scale))
    o_lat = torch.cat(outs, dim=0) if len(outs) != 1 else outs[0]            # [b*s, H, r]
    out = torch.einsum("nhr,hvr->nhv", o_lat, w_vc)                           # [b*s, H, dv]
    return out.reshape(b, s, H, -1)


# ---------------------------------------------------------------------------- the module
class Glm5DSAttention(MegatronModule):
    """KPool DSA: NoPE MLA whose queries attend only to the indexer's positions (see the module docstring).

    Parameters (HF ``model.language_model.layers.{i}.self_attn.<name>``): ``q_a_proj.weight [q_lora, h]``,
    ``q_a_layernorm.weight``, ``q_b_proj.weight [H*dq, q_lora]``, ``kv_a_proj_with_mqa.weight [r, h]``,
    ``kv_a_layernorm.weight``, ``kv_b_proj.weight [H*(dq+dv), r]`` (per head: ``dq`` key rows then ``dv`` value
    rows), ``o_proj.weight [h, H*dv]`` and ``indexer.*`` (absent on 'shared' layers). TP shards the ``H`` rows of
    ``q_b_proj``/``kv_b_proj`` and the ``H*dv`` columns of ``o_proj``.

    Args:
        config: ``Glm5Config``.
        submodules: :class:`Glm5DSAttentionSubmodules`.
        layer_number: 1-based global layer number; the layer is 'shared' iff
            ``config.indexer_types[layer_number - 1] == 'shared'`` (no indexer; the caller passes the previous
            full layer's ``topk_indices`` as ``shared_topk_indices``).
        pg_collection: process groups (``tp`` is used); default: megatron's global groups.
    """

    sparse_query_chunk: int = 1024

    def __init__(self, config, submodules: Glm5DSAttentionSubmodules, layer_number: int,
                 pg_collection: Optional[ProcessGroupCollection] = None):
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        tp = get_pg_size(self.tp_group)
        self.sequence_parallel = bool(config.sequence_parallel) and tp > 1
        # everything before o_proj runs on the gathered sequence, as under plain TP
        full_seq_config = copy.copy(config)
        full_seq_config.sequence_parallel = False
        self.cp_group = cp_group_of(pg_collection)
        if config.qk_pos_emb_head_dim:
            raise ValueError("GLM-5.3 DSA is NoPE: qk_pos_emb_head_dim must be 0")

        self.layer_number = layer_number
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        if self.num_heads % tp:
            raise ValueError(f"num_attention_heads {self.num_heads} is not divisible by TP size {tp}")
        self.num_heads_local = self.num_heads // tp
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_head_dim = config.qk_head_dim
        self.v_head_dim = config.v_head_dim
        self.softmax_scale = self.qk_head_dim ** -0.5
        self.backend = plan_of(config).dsa_backend
        # layers past the decoder (the MTP layer) always run their own indexer
        idx = layer_number - 1
        self.is_shared = idx < len(config.indexer_types) and config.indexer_types[idx] == "shared"

        h, H = self.hidden_size, self.num_heads
        eps = config.layernorm_epsilon
        self.q_a_proj = build_module(submodules.q_a_proj, h, self.q_lora_rank, config=config,
                                     init_method=config.init_method, bias=False)
        self.q_a_layernorm = build_module(submodules.q_a_layernorm, config=full_seq_config,
                                          hidden_size=self.q_lora_rank, eps=eps)
        self.q_b_proj = build_module(submodules.q_b_proj, self.q_lora_rank, H * self.qk_head_dim,
                                     config=full_seq_config, init_method=config.init_method, bias=False,
                                     gather_output=False, skip_bias_add=False, tp_group=self.tp_group)
        self.kv_a_proj_with_mqa = build_module(submodules.kv_a_proj_with_mqa, h, self.kv_lora_rank, config=config,
                                               init_method=config.init_method, bias=False)
        self.kv_a_layernorm = build_module(submodules.kv_a_layernorm, config=full_seq_config,
                                           hidden_size=self.kv_lora_rank, eps=eps)
        self.kv_b_proj = build_module(submodules.kv_b_proj, self.kv_lora_rank,
                                      H * (self.qk_head_dim + self.v_head_dim), config=full_seq_config,
                                      init_method=config.init_method, bias=False, gather_output=False,
                                      skip_bias_add=False, tp_group=self.tp_group)
        self.o_proj = build_module(submodules.o_proj, H * self.v_head_dim, h, config=config,
                                   init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
                                   skip_bias_add=False, tp_group=self.tp_group)
        self.indexer = None
        if not self.is_shared:
            self.indexer = build_module(submodules.indexer, config=config, layer_number=layer_number,
                                        pg_collection=pg_collection)

    # ------------------------------------------------------------------ helpers
    def absorbed_weights(self):
        """``(W_kc [H_local, dq, r], W_vc [H_local, dv, r])`` views of the local ``kv_b_proj`` weight."""
        w = self.kv_b_proj.weight.view(self.num_heads_local, self.qk_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_head_dim], w[:, self.qk_head_dim:]

    def expanded_kv(self, kv_lat: torch.Tensor):
        """Per-head keys and values from the latents through ``kv_b_proj``: ``kv_lat [t, b, r]`` ->
        ``(k [t, b, Hl, dq], v [t, b, Hl, dv])``."""
        t, b = kv_lat.shape[:2]
        kv = linear_output(self.kv_b_proj(kv_lat)).view(t, b, self.num_heads_local, self.qk_head_dim + self.v_head_dim)
        return torch.split(kv, [self.qk_head_dim, self.v_head_dim], dim=-1)

    def _attention_torch(self, q, kv_lat, topk_indices):
        """'torch' backend: expand K/V with ``kv_b_proj`` and run masked dense SDPA. ``q [s, b, Hl, dq]``,
        ``kv_lat [t, b, r]`` (``t = s``, or the whole row under CP) -> ``[s, b, Hl, dv]``."""
        k, v = self.expanded_kv(kv_lat)
        out = dense_topk_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), topk_indices,
                                   self.softmax_scale)
        return out.transpose(0, 1)

    def _attention_sparse(self, q, kv_lat, topk_indices):
        """'sparse' backend: absorbed MLA over the gathered latents, ``O(s * width)``. Same shapes as
        :meth:`_attention_torch`. The latent bypasses ``kv_b_proj``'s forward, so its TP input-gradient all-reduce
        is done here."""
        w_kc, w_vc = self.absorbed_weights()
        if get_pg_size(self.tp_group) > 1:
            kv_lat = copy_to_tensor_model_parallel_region(kv_lat, group=self.tp_group)
        out = sparse_topk_attention(q.transpose(0, 1), kv_lat.transpose(0, 1), w_kc, w_vc, topk_indices,
                                    self.softmax_scale, query_chunk=self.sparse_query_chunk)
        return out.transpose(0, 1)

    def dense_prefix_length(self) -> int:
        """How many leading positions of every document attend to all earlier positions of it under the indexer's
        selection: ``index_topk + kpool - 1`` with ``index_kpool_always_select_tail`` (a query at document position
        ``i`` has ``(i + 1) // kpool <= index_topk / kpool`` complete pools before it, all selected, and the tail
        covers the rest up to itself); 0 without the tail."""
        if not self.config.index_kpool_always_select_tail:
            return 0
        return self.config.index_topk + self.config.index_kpool - 1

    def _attention_fused(self, q, kv_lat, topk_indices, return_lse: bool = False, packed_seq_params=None):
        """'fused' backend: :meth:`_attention_sparse`'s absorbed form with the Triton sparse MLA kernel. Same
        shapes. Without ``return_lse`` and context parallelism, each document's first :meth:`dense_prefix_length`
        queries run as dense causal attention (:meth:`_attention_dense_prefix`, the same result) and only the
        others through the kernel (:meth:`_attention_fused_all`). ``return_lse``: ``(out, lse, q_lat)``, also the
        kernel's log-sum-exp ``[b, s, Hl]`` and the absorbed queries ``[b, s, Hl, r]`` (for the sparse indexer
        loss), every query through the kernel."""
        prefix = self.dense_prefix_length()
        if not return_lse and prefix > 0 and get_pg_size(self.cp_group) == 1:
            from megatron_glm5.models.packing import row_boundaries

            bounds = row_boundaries(packed_seq_params, q.shape[0])
            if len(bounds) == 2:  # one document: its positions [0, prefix) are dense
                return self._attention_dense_prefix_of_one_document(q, kv_lat, topk_indices, prefix)
            layout = dense_prefix_layout(bounds, prefix)
            if layout is not None:
                return self._attention_dense_prefix(q, kv_lat, topk_indices, layout)
        return self._attention_fused_all(q, kv_lat, topk_indices, return_lse)

    def _attention_dense_prefix_of_one_document(self, q, kv_lat, topk_indices, prefix: int):
        """:meth:`_attention_dense_prefix` of rows that are one document each: positions ``[0, prefix)`` dense."""
        p = min(prefix, q.shape[0])
        o_dense = self._dense_causal(q[:p].unsqueeze(0), kv_lat[:p].unsqueeze(0))[0]
        if p == q.shape[0]:
            return o_dense
        o_rest = self._attention_fused_all(q[p:], kv_lat, topk_indices[:, p:].contiguous())
        return torch.cat([o_dense, o_rest], dim=0)

    def _attention_dense_prefix(self, q, kv_lat, topk_indices, layout: "DensePrefixLayout"):
        """:meth:`_attention_fused` of a packed row with the queries of ``layout.dense`` (every document's leading
        positions) as dense causal attention (:meth:`_dense_causal`, documents as batch rows) and the rest through
        the sparse kernel. ``q [s, b, Hl, dq]``, ``kv_lat [s, b, r]``, ``topk_indices [b, s, w]`` ->
        ``[s, b, Hl, dv]``."""
        from megatron_glm5.models.packing import to_device_async

        idx, valid, dense_pos, rest_pos = (to_device_async(t, q.device) for t in
                                           (layout.docs_padded, layout.valid, layout.dense, layout.rest))
        o = self._dense_causal(q[idx], kv_lat[idx])                                 # [n, d, b, Hl, dv]
        out = o.new_zeros(q.shape[0], *o.shape[2:]).index_copy(0, dense_pos, o[valid])
        if layout.rest.numel() == 0:
            return out
        o_rest = self._attention_fused_all(q[rest_pos], kv_lat, topk_indices[:, rest_pos].contiguous())
        return out.index_copy(0, rest_pos, o_rest)

    def _dense_causal(self, q, kv_lat):
        """Causal attention within each of ``n`` documents: ``q [n, d, b, Hl, dq]``, ``kv_lat [n, d, b, r]`` ->
        ``[n, d, b, Hl, dv]``, K/V expanded by ``kv_b_proj``, torch's SDPA over ``n * b`` rows (a fused kernel on
        CUDA)."""
        n, d, b = q.shape[:3]
        k, v = (t.unflatten(0, (n, d)) for t in self.expanded_kv(kv_lat.flatten(0, 1)))   # [n, d, b, Hl, .]
        rows = lambda t: t.permute(0, 2, 3, 1, 4).flatten(0, 1)                      # noqa: E731 [n*b, Hl, d, .]
        o = F.scaled_dot_product_attention(rows(q), rows(k), rows(v), is_causal=True, scale=self.softmax_scale)
        return o.unflatten(0, (n, b)).permute(0, 3, 1, 2, 4)                         # [n, d, b, Hl, dv]

    def _attention_fused_all(self, q, kv_lat, topk_indices, return_lse: bool = False):
        """Every query of ``q [c, b, Hl, dq]`` through the sparse kernel; ``topk_indices [b, c, w]`` are positions
        of ``kv_lat [t, b, r]`` -> ``[c, b, Hl, dv]``. The indexer's tail slots (the last ``kpool - 1``) are moved
        to the front so that every row's valid slots end early and the kernel skips the unused pool slots of short
        contexts. ``return_lse``: as :meth:`_attention_fused`."""
        w_kc, w_vc = self.absorbed_weights()
        if get_pg_size(self.tp_group) > 1:
            kv_lat = copy_to_tensor_model_parallel_region(kv_lat, group=self.tp_group)
        topk = self.config.index_topk
        if topk_indices.shape[-1] > topk:
            topk_indices = torch.cat([topk_indices[..., topk:], topk_indices[..., :topk]], dim=-1)
        q_lat = torch.einsum("sbhd,hdr->bshr", q, w_kc)                               # [b, s, H, r]
        o_lat = sparse_mla(q_lat, kv_lat.transpose(0, 1), topk_indices, self.softmax_scale, return_lse=return_lse)
        if return_lse:
            o_lat, lse = o_lat
            return torch.einsum("bshr,hvr->sbhv", o_lat, w_vc), lse, q_lat
        return torch.einsum("bshr,hvr->sbhv", o_lat, w_vc)                           # [s, b, H, dv]

    # ------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None,
                shared_topk_indices: Optional[torch.Tensor] = None, **kwargs):
        """
        Args:
            hidden_states: ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism).
            attention_mask: ignored (causality and document boundaries come from the indexer's selection).
            packed_seq_params: document boundaries of a packed row (``b = 1``).
            shared_topk_indices: ``[b, s, w]`` selection of the previous full DSA layer; required on 'shared'
                layers, ignored otherwise.
            **kwargs: other megatron attention arguments (rotary embeddings etc.), ignored (NoPE).

        Returns:
            ``(output [s(/tp), b, h], topk_indices [b, s, w] int32)``; the selection is returned so that a later
            'shared' layer can reuse it.
        """
        if self.sequence_parallel:  # [s/tp, b, h] -> [s, b, h]; backward: this rank's slice of the equal grads
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False,
                                                                 group=self.tp_group)
        s, b, _ = hidden_states.shape
        q_resid = self.q_a_layernorm(linear_output(self.q_a_proj(hidden_states)))                 # [s, b, q_lora]
        q = linear_output(self.q_b_proj(q_resid)).view(s, b, self.num_heads_local, self.qk_head_dim)
        kv_lat = self.kv_a_layernorm(linear_output(self.kv_a_proj_with_mqa(hidden_states)))       # [s, b, r]
        kv_lat = gather_sequence(kv_lat, self.cp_group)  # the whole row's latents under CP: [S, b, r]

        coeff = self.config.dsa_indexer_loss_coeff or 0.0
        use_indexer_loss = self.indexer is not None and coeff > 0 and self.training and torch.is_grad_enabled()
        if use_indexer_loss:  # the indexer's inputs are detached: the LM loss never reaches it
            topk_indices, feats = self.indexer(hidden_states.detach(), q_resid.detach(),
                                               packed_seq_params=packed_seq_params, return_features=True)
        elif self.indexer is not None:
            topk_indices = self.indexer(hidden_states, q_resid, packed_seq_params=packed_seq_params)
        else:
            if shared_topk_indices is None:
                raise ValueError(f"layer {self.layer_number} is a 'shared' DSA layer: pass the previous full "
                                 f"layer's topk indices as shared_topk_indices")
            topk_indices = shared_topk_indices

        lse = q_lat = None
        if self.config.dsa_indexer_warmup:
            out = self._attention_dense(q, kv_lat, packed_seq_params)
        elif self.backend == "fused" and use_indexer_loss and self.config.dsa_indexer_use_sparse_loss:
            out, lse, q_lat = self._attention_fused(q, kv_lat, topk_indices, return_lse=True)
        elif self.backend == "fused":
            out = self._attention_fused(q, kv_lat, topk_indices, packed_seq_params=packed_seq_params)
        elif self.backend == "sparse":
            out = self._attention_sparse(q, kv_lat, topk_indices)
        elif self.backend == "torch":
            out = self._attention_torch(q, kv_lat, topk_indices)
        else:
            raise ValueError(f"unknown dsa_backend {self.backend!r}")
        out = out.reshape(s, b, self.num_heads_local * self.v_head_dim)
        output = linear_output(self.o_proj(out))
        if use_indexer_loss:
            output = self._attach_indexer_loss(output, q, kv_lat, topk_indices, feats, coeff,
                                               getattr(packed_seq_params, "row_length", None), lse, q_lat)
        return output, topk_indices

    def _attach_indexer_loss(self, output, q, kv_lat, topk_indices, feats, coeff, row_length=None, lse=None,
                             q_lat=None):
        """The indexer loss of this micro batch (:mod:`megatron_glm5.models.indexer_loss`; target from the detached
        attention tensors), recorded for the 'indexer loss' log line and attached to ``output`` through
        megatron-core's ``DSAIndexerLossAutoScaler`` (its gradient, scaled like the main loss, joins the backward;
        the output and its gradient pass unchanged). ``lse`` / ``q_lat``: the fused kernel's log-sum-exp of the
        sparse attention and its absorbed queries (the sparse target then reuses both)."""
        from megatron.core.transformer.experimental_attention_variant.dsa import (
            DSAIndexerLossAutoScaler,
            DSAIndexerLossLoggingHelper,
        )

        from megatron_glm5.models.indexer_loss import indexer_loss_slot, indexer_loss_value, kpool_indexer_kl

        if q_lat is None:
            w_kc, _ = self.absorbed_weights()
            q_lat = torch.einsum("sbhd,hdr->bshr", q.detach(), w_kc.detach())         # [b, s, Hl, r]
        q_lat = q_lat.detach()
        sparse = bool(self.config.dsa_indexer_use_sparse_loss) and not self.config.dsa_indexer_warmup
        kl, rows = kpool_indexer_kl(feats, q_lat, kv_lat.detach().transpose(0, 1), self.softmax_scale,
                                    self.indexer.softmax_scale, topk_indices, self.indexer.kpool,
                                    self.indexer.index_topk, sparse, tp_group=self.tp_group, row_length=row_length,
                                    lse=lse if sparse else None)
        cp = self.cp_group if get_pg_size(self.cp_group) > 1 else None
        loss = indexer_loss_value(kl, rows, coeff, bool(self.config.calculate_per_token_loss), cp)
        slot, n_slots = indexer_loss_slot(self.config, self.layer_number, getattr(self, "is_mtp_layer", False))
        DSAIndexerLossLoggingHelper.save_loss_to_tracker(loss, slot, n_slots, reduce_group=cp)
        return DSAIndexerLossAutoScaler.apply(output, loss)

    def _attention_dense(self, q, kv_lat, packed_seq_params):
        """The warm-up's dense attention: every query attends to every position of its document up to and including
        itself (the whole row under CP). ``q [s, b, Hl, dq]``, ``kv_lat [t, b, r]`` -> ``[s, b, Hl, dv]``."""
        from megatron_glm5.models.context_parallel import sequence_layout
        from megatron_glm5.kernels.documents import document_ids

        s = q.shape[0]
        layout = sequence_layout(packed_seq_params, s, q.device, self.cp_group)
        t = kv_lat.shape[0]
        doc = document_ids(layout.cu_seqlens, t)
        qpos = torch.arange(layout.offset, layout.offset + s, device=q.device)
        kpos = torch.arange(t, device=q.device)
        mask = (doc[None, :] == doc[qpos][:, None]) & (kpos[None, :] <= qpos[:, None])     # [s, t]
        k, v = self.expanded_kv(kv_lat)
        out = fused_masked_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), mask,
                                     self.softmax_scale)                                    # [b, Hl, s, dv]
        return out.permute(2, 0, 1, 3)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: Optional[dict] = None):
        """megatron-core default: ``q_b_proj``/``kv_b_proj`` shard axis 0 and ``o_proj`` axis 1 over TP (their own
        ``sharded_state_dict``); everything else (replicated linears, norms, the indexer) is saved as a TP
        replica."""
        return super().sharded_state_dict(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
