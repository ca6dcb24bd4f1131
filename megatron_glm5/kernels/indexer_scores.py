"""The KPool indexer's pool scores as one Triton kernel (forward only: the indexer has no gradient).

Reference: :func:`indexer_scores_reference` (the PyTorch ops :class:`~megatron_glm5.models.kpool_indexer.KPoolIndexer`
runs on CPU)::

    q        [b, c, H, D]   index queries of c queries (any float dtype; used as fp32)
    keys     [b, p, D]      fp32 pooled keys of p candidate pools
    weights  [b, c, H]      fp32 per-head weights
    scores[b, i, j] = sum_h weights[b, i, h] * relu(scale * <q[b, i, h], keys[b, j]>)      [b, c, p] fp32

In PyTorch that is an fp32 GEMM producing the ``[b, c, H, p]`` per-head scores (``H`` = 32 at the released widths:
8.6 GB of fp32 at 16K queries x 4K pools, written and read by every elementwise step), a ReLU and a second GEMM
over the heads. Here one program owns a ``[BM queries, BN pools]`` tile: the pool keys are loaded once, every
head's ``q_h @ keys^T`` runs in registers, and the ReLU and the weighted head sum happen there too, so only
``[b, c, p]`` is written.

Precision follows the model: bf16 / fp16 queries use the tensor cores (``tf32x3``: three TF32 products, about fp32
accuracy); fp32 queries (the parity runs) use exact fp32 products (``ieee``), as PyTorch's fp32 GEMM does with TF32
off. The difference matters for the selection, not the scores: many pools score exactly 0 (every head's ReLU is 0)
and ties go to the earlier pool, so a ``tf32x3`` rounding that lifts a score to 1e-9 picks another pool than the
fp32 reference does. ``INDEXER_SCORES_CONFIG['bf16x3']`` (off until timed) runs bf16 queries, which need no split,
against the keys cut once per program into three bf16 parts (``k = k1 + k2 + k3`` to ~2^-24): three bf16 products
instead of three TF32 ones, each exact in the fp32 accumulator.

:func:`indexer_topk_keys` runs the same kernel up to the selection's sort keys: the causal / document mask applied
in the kernel (``valid[i, j] = pool_doc[j] == doc(i) and pool_end[j] <= pos(i)``; tiles without a valid pair skip
the head loop, about half of them for one long document) and each masked score turned into the int64 key of
:func:`tie_ordered_keys` (reference: :func:`indexer_topk_keys_reference`), so the indexer's ``topk`` reads one
tensor instead of the masking and key-building passes over ``[b, c, p]`` in PyTorch.
"""

from __future__ import annotations

import torch

from megatron_glm5.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["HAVE_TRITON", "INDEXER_SCORES_CONFIG", "indexer_scores", "indexer_scores_reference", "indexer_topk_keys",
           "indexer_topk_keys_reference", "masked_topk_keys", "stable_topk_reference", "tie_ordered_keys"]

_MASKED = float(torch.finfo(torch.float32).min)
"""The score a masked (query, pool) pair takes before the keys are built."""

INDEXER_SCORES_CONFIG = dict(BM=64, BN=64, num_warps=4, bf16x3=False)
"""Tiling: queries and pools per program, warps. (Compiled for sm_90 with Triton 3.6 in bf16 / tf32x3 at
``D = 128``, 64 x 64 at 4 warps takes 255 registers a thread and spills 624 bytes, 1008 with ``KEYS``; 32 x 64 at
8 warps spills none, 48 bytes with ``KEYS``: not timed yet, ``bench_dsa.py --indexer-tiles`` sweeps them.)
``bf16x3``: bf16 queries against three bf16 parts of the keys (module docstring) instead of ``tf32x3``."""


def indexer_scores_reference(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """Plain PyTorch definition (see the module docstring): ``[b, c, H, D], [b, p, D], [b, c, H] -> [b, c, p]``."""
    per_head = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1))   # [b, c, H, p]
    per_head = torch.relu(per_head * scale)
    return torch.matmul(weights.float().unsqueeze(-2), per_head).squeeze(-2)           # [b, c, p]


def tie_ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 sort keys of ``scores [..., n]`` (float32): ``topk`` of the keys picks the largest scores with equal
    scores going to the lower index, the order a stable descending sort gives. The score's float bits made
    monotonic (``-0.0`` counted as ``+0.0``) are the high 32 bits, ``n - 1 - index`` the low ones, so the keys are
    distinct and order like (score, -index)."""
    n = scores.shape[-1]
    bits = (scores.float() + 0.0).view(torch.int32)                   # + 0.0: -0.0 -> +0.0
    monotonic = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)  # signed order of the floats (not NaN)
    rank_in_ties = n - 1 - torch.arange(n, device=scores.device, dtype=torch.int64)
    return (monotonic << 32) | rank_in_ties


def stable_topk_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Plain PyTorch reference of the order :func:`tie_ordered_keys` gives: the ``k`` first indices of a stable
    descending sort (``tie_ordered_keys(scores).topk(k).indices`` equals it; ``torch.topk`` of the scores alone
    breaks ties by its own layout, so the pools chosen among equal scores would depend on how the candidates were
    chunked: CP ranks, score chunks)."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]


def masked_topk_keys(scores: torch.Tensor, query_doc: torch.Tensor, first_pos: int, pool_doc: torch.Tensor,
                     pool_end: torch.Tensor) -> torch.Tensor:
    """:func:`tie_ordered_keys` of the pool scores ``[b, c, p]`` with every pair outside the query's document or
    past its position set to the lowest float32 first (``query_doc [c]``, query ``i`` at row position
    ``first_pos + i``; ``pool_doc``, ``pool_end [p]``: each pool's document and last position)."""
    pos = first_pos + torch.arange(scores.shape[-2], device=scores.device)
    valid = (pool_doc[None, :] == query_doc[:, None]) & (pool_end[None, :] <= pos[:, None])
    return tie_ordered_keys(scores.masked_fill(~valid, _MASKED))


def indexer_topk_keys_reference(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float,
                                query_doc: torch.Tensor, first_pos: int, pool_doc: torch.Tensor,
                                pool_end: torch.Tensor) -> torch.Tensor:
    """PyTorch definition of :func:`indexer_topk_keys`: ``[b, c, p]`` int64, :func:`masked_topk_keys` of
    :func:`indexer_scores_reference`."""
    return masked_topk_keys(indexer_scores_reference(q, keys, weights, scale), query_doc, first_pos, pool_doc,
                            pool_end)


if HAVE_TRITON:

    @triton.jit
    def _indexer_scores_kernel(Q, K, W, OUT, C, P, H, D, scale,
                               sqb, sqc, sqh, skb, skp, swb, swc, sob, soc,
                               QDOC, first_pos, PDOC, PEND,
                               BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
                               KEYS: tl.constexpr):
        """Program (i, j, b): queries ``[i BM, +BM)`` x pools ``[j BN, +BN)`` of batch row ``b``. ``KEYS``: the
        masked scores' int64 sort keys (``QDOC``, ``first_pos``, ``PDOC``, ``PEND`` give the mask) instead of the
        fp32 scores."""
        b = tl.program_id(2).to(tl.int64)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        d = tl.arange(0, BD)
        rmask, cmask, dmask = rows < C, cols < P, d < D
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        if KEYS:
            qdoc = tl.load(QDOC + rows, mask=rmask, other=-1)
            pdoc = tl.load(PDOC + cols, mask=cmask, other=-2)
            pend = tl.load(PEND + cols, mask=cmask, other=0)
            valid = (pdoc[None, :] == qdoc[:, None]) & (pend[None, :] <= (first_pos + rows)[:, None])
            n_valid = tl.sum(valid.to(tl.int32))
        else:
            n_valid = 1
        if n_valid > 0:
            keys_t = tl.load(K + b * skb + cols[None, :].to(tl.int64) * skp + d[:, None],
                             mask=dmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)   # [BD, BN]
            if PREC == "bf16x3":                      # keys = k1 + k2 + k3, each bf16 (to ~2^-24 of the keys)
                k1 = keys_t.to(tl.bfloat16)
                r1 = keys_t - k1.to(tl.float32)
                k2 = r1.to(tl.bfloat16)
                k3 = (r1 - k2.to(tl.float32)).to(tl.bfloat16)
            q_ptr = Q + b * sqb + rows[:, None].to(tl.int64) * sqc + d[None, :]
            w_ptr = W + b * swb + rows.to(tl.int64) * swc
            qmask = rmask[:, None] & dmask[None, :]
            for h in range(0, H):
                w = tl.load(w_ptr + h, mask=rmask, other=0.0)                                  # [BM]
                if PREC == "bf16x3":
                    qb = tl.load(q_ptr + h * sqh, mask=qmask, other=0.0)                       # [BM, BD] bf16
                    s = tl.dot(qb, k3)                                                         # smallest part first
                    s = tl.dot(qb, k2, s)
                    s = tl.dot(qb, k1, s)                                                      # [BM, BN] fp32
                else:
                    q = tl.load(q_ptr + h * sqh, mask=qmask, other=0.0).to(tl.float32)      # [BM, BD]
                    s = tl.dot(q, keys_t, input_precision=PREC)                               # [BM, BN]
                acc += w[:, None] * tl.maximum(s * scale, 0.0)
        out_ptr = OUT + b * sob + rows[:, None].to(tl.int64) * soc + cols[None, :]
        if KEYS:
            score = tl.where(valid, acc, -3.4028234663852886e38)          # float32 min, as the reference fills
            score = tl.where(score == 0.0, 0.0, score)                     # -0.0 -> +0.0
            bits = score.to(tl.int32, bitcast=True)
            monotonic = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)
            key = (monotonic << 32) | (P - 1 - cols).to(tl.int64)[None, :]
            tl.store(out_ptr, key, mask=rmask[:, None] & cmask[None, :])
        else:
            tl.store(out_ptr, acc, mask=rmask[:, None] & cmask[None, :])


def _check_shapes(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> None:
    b, c, H, D = q.shape
    p = keys.shape[1]
    if keys.shape != (b, p, D) or weights.shape != (b, c, H):
        raise ValueError(f"indexer_scores: shapes q {tuple(q.shape)}, keys {tuple(keys.shape)}, "
                         f"weights {tuple(weights.shape)} do not match")


def _precision(dtype: torch.dtype, cfg: dict) -> str:
    """The products' form for queries of ``dtype`` (module docstring)."""
    if dtype == torch.float32:
        return "ieee"
    return "bf16x3" if dtype == torch.bfloat16 and cfg.get("bf16x3") else "tf32x3"


def _launch(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float, out: torch.Tensor,
            mask_args) -> torch.Tensor:
    """One launch of :func:`_indexer_scores_kernel` writing ``out`` ``[b, c, p]`` (fp32 scores, or int64 keys when
    ``mask_args = (query_doc, first_pos, pool_doc, pool_end)``)."""
    if not HAVE_TRITON:
        raise RuntimeError("the fused indexer scores need triton")
    b, c, H, D = q.shape
    p = keys.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    keys = keys.float().contiguous()
    weights = weights.float()
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    if not (b and c and p):
        return out
    with_keys = mask_args is not None
    qdoc, first_pos, pdoc, pend = mask_args if with_keys else (out, 0, out, out)
    cfg = INDEXER_SCORES_CONFIG
    grid = (triton.cdiv(c, cfg["BM"]), triton.cdiv(p, cfg["BN"]), b)
    _indexer_scores_kernel[grid](q, keys, weights, out, c, p, H, D, float(scale),
                                 q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1),
                                 weights.stride(0), weights.stride(1), out.stride(0), out.stride(1),
                                 qdoc, int(first_pos), pdoc, pend,
                                 BM=cfg["BM"], BN=cfg["BN"], BD=max(16, triton.next_power_of_2(D)),
                                 PREC=_precision(q.dtype, cfg), KEYS=with_keys,
                                 num_warps=cfg["num_warps"])
    return out


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`indexer_scores_reference` as one Triton kernel (CUDA tensors; any ``D``, ``H``, ``c``, ``p``)."""
    _check_shapes(q, keys, weights)
    b, c, p = q.shape[0], q.shape[1], keys.shape[1]
    out = torch.empty(b, c, p, device=q.device, dtype=torch.float32)
    if not (b and c and p):
        return out.zero_()
    return _launch(q, keys, weights, scale, out, None)


def indexer_topk_keys(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float,
                      query_doc: torch.Tensor, first_pos: int, pool_doc: torch.Tensor,
                      pool_end: torch.Tensor) -> torch.Tensor:
    """:func:`indexer_topk_keys_reference` as one Triton kernel: ``[b, c, p]`` int64 (``query_doc [c]``,
    ``pool_doc`` / ``pool_end [p]`` int64, contiguous)."""
    _check_shapes(q, keys, weights)
    b, c, p = q.shape[0], q.shape[1], keys.shape[1]
    if query_doc.shape != (c,) or pool_doc.shape != (p,) or pool_end.shape != (p,):
        raise ValueError(f"indexer_topk_keys: query_doc {tuple(query_doc.shape)}, pool_doc {tuple(pool_doc.shape)}, "
                         f"pool_end {tuple(pool_end.shape)} for {c} queries and {p} pools")
    out = torch.empty(b, c, p, device=q.device, dtype=torch.int64)
    return _launch(q, keys, weights, scale, out, (query_doc.long().contiguous(), first_pos,
                                                  pool_doc.long().contiguous(), pool_end.long().contiguous()))
