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
fp32 reference does.
"""

from __future__ import annotations

import torch

from megatron_glm5.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["HAVE_TRITON", "indexer_scores", "indexer_scores_reference"]

_BM, _BN = 64, 64


def indexer_scores_reference(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """Plain PyTorch definition (see the module docstring): ``[b, c, H, D], [b, p, D], [b, c, H] -> [b, c, p]``."""
    per_head = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1))   # [b, c, H, p]
    per_head = torch.relu(per_head * scale)
    return torch.matmul(weights.float().unsqueeze(-2), per_head).squeeze(-2)           # [b, c, p]


if HAVE_TRITON:

    @triton.jit
    def _indexer_scores_kernel(Q, K, W, OUT, C, P, H, D, scale,
                               sqb, sqc, sqh, skb, skp, swb, swc, sob, soc,
                               BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr):
        """Program (i, j, b): queries ``[i BM, +BM)`` x pools ``[j BN, +BN)`` of batch row ``b``."""
        b = tl.program_id(2).to(tl.int64)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        d = tl.arange(0, BD)
        rmask, cmask, dmask = rows < C, cols < P, d < D
        keys_t = tl.load(K + b * skb + cols[None, :].to(tl.int64) * skp + d[:, None],
                         mask=dmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)   # [BD, BN]
        q_ptr = Q + b * sqb + rows[:, None].to(tl.int64) * sqc + d[None, :]
        w_ptr = W + b * swb + rows.to(tl.int64) * swc
        qmask = rmask[:, None] & dmask[None, :]
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for h in range(0, H):
            q = tl.load(q_ptr + h * sqh, mask=qmask, other=0.0).to(tl.float32)          # [BM, BD]
            w = tl.load(w_ptr + h, mask=rmask, other=0.0)                                  # [BM]
            s = tl.dot(q, keys_t, input_precision=PREC)                                   # [BM, BN]
            acc += w[:, None] * tl.maximum(s * scale, 0.0)
        tl.store(OUT + b * sob + rows[:, None].to(tl.int64) * soc + cols[None, :], acc,
                 mask=rmask[:, None] & cmask[None, :])


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`indexer_scores_reference` as one Triton kernel (CUDA tensors; any ``D``, ``H``, ``c``, ``p``)."""
    if not HAVE_TRITON:
        raise RuntimeError("the fused indexer scores need triton")
    b, c, H, D = q.shape
    p = keys.shape[1]
    if keys.shape != (b, p, D) or weights.shape != (b, c, H):
        raise ValueError(f"indexer_scores: shapes q {tuple(q.shape)}, keys {tuple(keys.shape)}, "
                         f"weights {tuple(weights.shape)} do not match")
    if q.stride(-1) != 1:
        q = q.contiguous()
    keys = keys.float().contiguous()
    weights = weights.float()
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    out = torch.empty(b, c, p, device=q.device, dtype=torch.float32)
    if not (b and c and p):
        return out.zero_()
    grid = (triton.cdiv(c, _BM), triton.cdiv(p, _BN), b)
    _indexer_scores_kernel[grid](q, keys, weights, out, c, p, H, D, float(scale),
                                 q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1),
                                 weights.stride(0), weights.stride(1), out.stride(0), out.stride(1),
                                 BM=_BM, BN=_BN, BD=max(16, triton.next_power_of_2(D)),
                                 PREC="ieee" if q.dtype == torch.float32 else "tf32x3", num_warps=4)
    return out
