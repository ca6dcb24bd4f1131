"""Attention probability mass per pool, summed over heads: the KPool indexer loss's target as Triton kernels.

The indexer loss (:mod:`megatron_glm5.models.indexer_loss`) compares the indexer's pool distribution with the main
attention's probability per pool of ``kpool`` consecutive positions, summed over heads. In the absorbed MLA form
(:mod:`megatron_glm5.kernels.sparse_mla`) every head reads the same latent rows ``c_t`` ``[R]``; with
``q_lat [H, R]`` per query::

    p_h(i, t)  = exp(scale * q_lat_ih . c_t - lse_ih)          (lse_ih: head h's log-sum-exp over what i reads)
    mass(i, P) = sum_h sum_{t in P} p_h(i, t)

Two kernels, one program per query and block of heads, ``BLOCK_N`` latent rows per step, only the ``q c^T``
product (no ``P V``), probabilities by ``exp2`` in log2 units, the head sum, then the ``[BLOCK_N]`` row masses
reshaped to ``[BLOCK_N // KPOOL, KPOOL]`` and summed per pool (``KPOOL`` divides ``BLOCK_N``; both powers of two):

* :func:`sparse_pool_mass` (the sparse stage): the rows are the selection's pool slots, gathered like the sparse
  attention gathers them (``program_query`` / ``gather_selected`` of :mod:`~megatron_glm5.kernels.triton_support`),
  and ``lse`` is the sparse attention's own (``sparse_mla(..., return_lse=True)``).
* :func:`dense_pool_mass` (the dense warm-up): the rows are every position of the query's document up to and
  including it (contiguous), read twice: a first pass computes each head's log-sum-exp (online max / sum), a second
  the pooled mass. Nothing of size ``[s, s]`` exists.

Head blocks (more heads than ``BLOCK_H``) write partial sums to their own ``[n_head_blocks, ...]`` slice, added in
PyTorch afterwards (deterministic, no atomics). Both launchers run on whatever device Triton targets (its
interpreter, ``TRITON_INTERPRET=1``, takes CPU tensors); :mod:`~megatron_glm5.models.indexer_loss` picks them on
CUDA and the PyTorch references elsewhere (:func:`sparse_pool_mass_reference`; the dense mass's is the loss's
own PyTorch code). Tiling: :data:`POOL_MASS_CONFIG`, cut to the device's
shared memory like the sparse attention's forward.

Tuning left open: the dense kernel reads every key once per query (a block of queries per program would share the
key tiles, as flash attention does) and twice (lse, then mass); the tiling is the sparse attention forward's, not
tuned for a kernel without the ``P V`` product.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_glm5.kernels import triton_support
from megatron_glm5.kernels.sparse_mla import prepare_indices
from megatron_glm5.kernels.triton_support import (
    HAVE_TRITON,
    LOG2E,
    block_h,
    dot_precision,
    fit_gather_tiling,
    tl,
    triton,
)

__all__ = ["POOL_MASS_CONFIG", "supported", "sparse_pool_mass", "sparse_pool_mass_reference", "dense_pool_mass"]

POOL_MASS_CONFIG = dict(BLOCK_H=64, BLOCK_N=128, num_warps=8, num_stages=1)
"""Tiling of both kernels: heads per program (capped at the padded head count), latent rows per step (raised to
``kpool`` when smaller), warps, stages. On CUDA ``BLOCK_N``, the stages, then ``BLOCK_H`` are cut until q
``[BLOCK_H, R]`` and the staged rows ``[BLOCK_N, R]`` fit the device's shared memory (``triton_support.device_limits``).
Measured on an H100 (sparse mass, 16K queries, 64 heads, latent 512): 128 rows at one stage 10.0 ms, 64 at two
10.8 ms, 32 at two 14.9 ms."""


def sparse_pool_mass_reference(q_lat: torch.Tensor, kv_lat: torch.Tensor, topk_indices: torch.Tensor,
                               attn_scale: float, kpool: int, n_sel: int,
                               lse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The sparse attention's probability per selected pool, summed over the heads given (PyTorch; the reference
    of :func:`sparse_pool_mass`): ``q_lat [b, c, Hl, r]``, ``kv_lat [b, S, r]``, ``topk_indices [b, c, w]`` (the
    indexer's order: pools first), ``lse [b, c, Hl]`` or ``None`` (a softmax over the recomputed scores of the
    valid slots) -> ``[b, c, n_sel]`` fp32."""
    from megatron.core.transformer.experimental_attention_variant import dsa_masking

    b, c, width = topk_indices.shape
    idx = topk_indices.long()                                                       # [b, c, w]
    tok_valid = idx >= 0
    kv_sel = torch.gather(kv_lat, 1, idx.clamp(min=0).reshape(b, c * width, 1)
                          .expand(-1, -1, kv_lat.shape[-1])).view(b, c, width, -1)
    scores = torch.einsum("bchr,bcwr->bchw", q_lat.float(), kv_sel.float()) * attn_scale
    if lse is None:
        probs = dsa_masking.masked_softmax(scores, tok_valid[:, :, None].expand_as(scores))
    else:
        probs = torch.exp(scores - lse[:, :, :, None].float()).masked_fill(~tok_valid[:, :, None], 0.0)
    mass = probs.sum(2)                                                             # [b, c, w]
    return mass[..., : n_sel * kpool].reshape(b, c, n_sel, kpool).sum(-1)          # [b, c, n_sel]


def supported(kpool: int, latent: int) -> bool:
    """Whether the kernels take this shape: ``kpool`` and the latent width ``R`` powers of two (``tl.reshape`` /
    ``tl.arange`` need them), ``R >= 16`` (the matrix product's smallest tile). Otherwise the PyTorch code runs."""
    return HAVE_TRITON and kpool >= 1 and not kpool & (kpool - 1) and latent >= 16 and not latent & (latent - 1)


# ============================================================================ Triton kernels
if HAVE_TRITON:
    from megatron_glm5.kernels.triton_support import gather_selected, program_query

    @triton.jit
    def _pool_sum_store(OUT, t, n_out, p, col0, n_pools, BLOCK_N: tl.constexpr, KPOOL: tl.constexpr):
        """``OUT[t, col0 + j] = sum_h sum_k p[h, j * KPOOL + k]`` for the first ``n_pools`` of the
        ``BLOCK_N // KPOOL`` pools ``j`` of a step (``p [BLOCK_H, BLOCK_N]`` fp32), columns in ``[0, n_out)``."""
        mass = tl.sum(tl.reshape(tl.sum(p, 0), [BLOCK_N // KPOOL, KPOOL]), 1)              # [BLOCK_N // KPOOL]
        j = tl.arange(0, BLOCK_N // KPOOL)
        cols = col0 + j
        tl.store(OUT + t * n_out + cols, mass, mask=(j < n_pools) & (cols >= 0) & (cols < n_out))

    @triton.jit
    def _sparse_pool_mass_kernel(Q, KV, IDX, NEND, LSE, OUT, qk_scale, T, n_out,
                                 stride_qt, stride_qh, stride_kvt, stride_it, H,
                                 R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                                 KPOOL: tl.constexpr, PREC: tl.constexpr):
        t, offs_h, offs_r, offs_nb, h_ok, q = program_query(Q, tl.program_id(0).to(tl.int64), tl.program_id(1),
                                                             stride_qt, stride_qh, H, R, BLOCK_H, BLOCK_N)
        lse = tl.load(LSE + t * H + offs_h, mask=h_ok, other=float("inf"))                 # log2 units
        out = OUT + tl.program_id(1).to(tl.int64) * T * n_out
        n_end = tl.load(NEND + tl.program_id(0))
        for n0 in range(0, n_end, BLOCK_N):
            rows, ok, kv = gather_selected(IDX, KV, t, stride_it, stride_kvt, n0, n_end, offs_nb, offs_r)
            s = tl.dot(q, tl.trans(kv), input_precision=PREC) * qk_scale
            p = tl.where(ok[None, :], tl.math.exp2(s - lse[:, None]), 0.0)
            _pool_sum_store(out, t, n_out, p, n0 // KPOOL, BLOCK_N // KPOOL, BLOCK_N, KPOOL)

    @triton.jit
    def _dense_rows(KV, row0, n0, k_end, offs_nb, offs_r, stride_kvt):
        """Rows ``n0 .. n0 + BLOCK_N`` (row positions) before ``k_end`` of the batch row at ``row0``:
        ``(ok, kv [BLOCK_N, R])``."""
        pos = n0 + offs_nb
        ok = pos < k_end
        kv = tl.load(KV + (row0 + pos)[:, None] * stride_kvt + offs_r[None, :], mask=ok[:, None], other=0.0)
        return ok, kv

    @triton.jit
    def _dense_pool_mass_kernel(Q, KV, KSTART, KEND, COL0, NPOOLS, OUT, qk_scale, T, C, S, n_out,
                                stride_qt, stride_qh, stride_kvt, H,
                                R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                                KPOOL: tl.constexpr, PREC: tl.constexpr):
        t, offs_h, offs_r, offs_nb, h_ok, q = program_query(Q, tl.program_id(0).to(tl.int64), tl.program_id(1),
                                                             stride_qt, stride_qh, H, R, BLOCK_H, BLOCK_N)
        i = tl.program_id(0) % C                                  # query of the chunk (the batch row: t // C)
        row0 = (t // C) * S
        k_start = tl.load(KSTART + i)
        k_end = tl.load(KEND + i)
        col_doc = tl.load(COL0 + i)
        n_pools = tl.load(NPOOLS + i)
        # pass 1: each head's log-sum-exp over the visible rows [k_start, k_end) (log2 units)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        for n0 in range(k_start, k_end, BLOCK_N):
            ok, kv = _dense_rows(KV, row0, n0, k_end, offs_nb, offs_r, stride_kvt)
            s = tl.dot(q, tl.trans(kv), input_precision=PREC) * qk_scale
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            l_i = l_i * tl.math.exp2(m_i - m_new) + tl.sum(tl.math.exp2(s - m_new[:, None]), 1)
            m_i = m_new
        lse = tl.where(h_ok, m_i + tl.math.log2(l_i), float("inf"))
        # pass 2: the pooled mass; steps start at the document's first position, so pools never straddle a step
        out = OUT + tl.program_id(1).to(tl.int64) * T * n_out
        for n0 in range(k_start, k_end, BLOCK_N):
            ok, kv = _dense_rows(KV, row0, n0, k_end, offs_nb, offs_r, stride_kvt)
            s = tl.dot(q, tl.trans(kv), input_precision=PREC) * qk_scale
            p = tl.where(ok[None, :], tl.math.exp2(s - lse[:, None]), 0.0)
            first = (n0 - k_start) // KPOOL                       # document-local pool of the step's first row
            _pool_sum_store(out, t, n_out, p, col_doc + first, n_pools - first, BLOCK_N, KPOOL)


def _tiling(q: torch.Tensor, kpool: int) -> dict:
    """:data:`POOL_MASS_CONFIG` with ``BLOCK_N >= kpool``, fitted to the device's shared memory on CUDA
    (``fit_gather_tiling`` counts 16-bit operands: a wider element counts as a proportionally wider latent)."""
    cfg = dict(POOL_MASS_CONFIG)
    cfg["BLOCK_N"] = max(cfg["BLOCK_N"], kpool)
    if q.is_cuda:
        cfg = fit_gather_tiling(cfg, q.shape[-1] * q.element_size() // 2, triton_support.tensor_limits(q)[0])
        cfg["BLOCK_N"] = max(cfg["BLOCK_N"], kpool)
    return cfg


def _launch_operands(q_lat: torch.Tensor, kv_lat: torch.Tensor, kpool: int, n_cols: int):
    """Both kernels' operands: ``q [b c, H, R]`` (unit-stride rows), ``kv [b S, R]`` in q's dtype, the tiling, the
    head block, the number of head blocks and the zeroed per-head-block output ``[n_hb, b c, n_cols]`` fp32."""
    b, c, H, R = q_lat.shape
    q = q_lat.reshape(b * c, H, R)
    if q.stride(-1) != 1:
        q = q.contiguous()
    kv = kv_lat.reshape(-1, R).contiguous().to(q.dtype)
    cfg = _tiling(q, kpool)
    bh = block_h(H, cfg["BLOCK_H"])
    n_hb = triton.cdiv(H, bh)
    return q, kv, cfg, bh, n_hb, torch.zeros(n_hb, b * c, n_cols, device=q.device, dtype=torch.float32)


def _check(q_lat: torch.Tensor, kpool: int) -> None:
    if not supported(kpool, q_lat.shape[-1]):
        raise ValueError(f"pool_mass kernels need triton and powers of two for kpool ({kpool}) and the latent width "
                         f"(>= 16, got {q_lat.shape[-1]}); use the PyTorch target")


def sparse_pool_mass(q_lat: torch.Tensor, kv_lat: torch.Tensor, topk_indices: torch.Tensor, lse: torch.Tensor,
                     scale: float, kpool: int, n_pool_slots: int) -> torch.Tensor:
    """The sparse attention's probability mass per selected pool, summed over heads.

    Args:
        q_lat: ``[b, s, H, R]`` absorbed queries (fp32 or 16-bit).
        kv_lat: ``[b, S, R]`` latent rows (cast to ``q_lat.dtype``, as the sparse attention does).
        topk_indices: ``[b, s, W]`` the indexer's selection in its own order: slots ``[0, n_pool_slots)`` hold the
            selected pools, pool ``j`` in slots ``[j * kpool, (j + 1) * kpool)``; the always-selected tail follows
            and is not read here (its share of each head's probability is already in ``lse``). ``-1`` = unused
            slot (adds 0).
        lse: ``[b, s, H]`` each head's log-sum-exp (natural log) over everything the attention read, as
            ``sparse_mla(..., return_lse=True)`` returns it (``+inf`` on empty rows: mass 0).
        scale: the attention's softmax scale.
        kpool: tokens per pool (a power of two).
        n_pool_slots: pool slots at the front of the selection (``index_topk``; a multiple of ``kpool``).

    Returns:
        ``[b, s, n_pool_slots // kpool]`` fp32: ``mass[i, j] = sum_h sum_{slots of pool j} exp(scale q_lat[i, h] .
        kv[idx] - lse[i, h])``.
    """
    _check(q_lat, kpool)
    if n_pool_slots % kpool:
        raise ValueError(f"n_pool_slots {n_pool_slots} is not a multiple of kpool {kpool}")
    b, s, H, R = q_lat.shape
    S = kv_lat.shape[1]
    n_out = n_pool_slots // kpool
    idx, n_end = prepare_indices(topk_indices[..., :n_pool_slots], S)                 # [b s, n_pool_slots]
    q, kv, cfg, bh, n_hb, out = _launch_operands(q_lat, kv_lat, kpool, n_out)
    lse2 = (lse.float() * LOG2E).reshape(b * s, H).contiguous()
    if b * s and n_out:
        _sparse_pool_mass_kernel[(b * s, n_hb)](
            q, kv, idx, n_end, lse2, out, float(scale) * LOG2E, b * s, n_out,
            q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), H,
            R=R, BLOCK_H=bh, BLOCK_N=cfg["BLOCK_N"], KPOOL=kpool, PREC=dot_precision(q.dtype),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out.sum(0).view(b, s, n_out)


def dense_pool_mass(q_lat: torch.Tensor, kv_lat: torch.Tensor, key_start: torch.Tensor, key_end: torch.Tensor,
                    pool_col: torch.Tensor, pool_count: torch.Tensor, n_cols: int, scale: float,
                    kpool: int) -> torch.Tensor:
    """Dense (causal, within-document) attention's probability mass per pool, summed over heads.

    Query ``i`` attends to the row positions ``[key_start[i], key_end[i])`` (its document's first position up to
    and including itself) with each head's softmax over exactly these; its document's pools are ``kpool``
    positions each from ``key_start[i]`` on, ``pool_count[i]`` complete ones, written to output columns
    ``pool_col[i] + j`` (those in ``[0, n_cols)``). A pool partly after the query gets the mass of its visible
    positions; columns of other documents' pools stay 0.

    Args:
        q_lat: ``[b, c, H, R]`` absorbed queries of the chunk (fp32 or 16-bit).
        kv_lat: ``[b, S, R]`` the whole row's latents (cast to ``q_lat.dtype``).
        key_start / key_end / pool_col / pool_count: int ``[c]`` per query (the same for every batch row).
        n_cols: output columns (the chunk's candidate pools).
        scale: softmax scale; kpool: tokens per pool (a power of two).

    Returns:
        ``[b, c, n_cols]`` fp32.
    """
    _check(q_lat, kpool)
    b, c, H, R = q_lat.shape
    S = kv_lat.shape[1]
    q, kv, cfg, bh, n_hb, out = _launch_operands(q_lat, kv_lat, kpool, n_cols)
    meta = [x.to(device=q.device, dtype=torch.int32).contiguous() for x in (key_start, key_end, pool_col, pool_count)]
    if b * c and n_cols:
        _dense_pool_mass_kernel[(b * c, n_hb)](
            q, kv, *meta, out, float(scale) * LOG2E, b * c, c, S, n_cols,
            q.stride(0), q.stride(1), kv.stride(0), H,
            R=R, BLOCK_H=bh, BLOCK_N=cfg["BLOCK_N"], KPOOL=kpool, PREC=dot_precision(q.dtype),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out.sum(0).view(b, c, n_cols)
