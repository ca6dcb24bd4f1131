"""Vocab-parallel cross entropy with one read of the logits forward and one read + one write backward (Triton on
CUDA), with its PyTorch reference.

The output layer leaves each tensor-parallel rank the logits of its vocabulary shard: ``logits [s, b, V/tp]`` (any
dtype; bf16 in training) and ``target [s, b]`` (global token ids). Per token::

    loss = logsumexp_j x_j - x_target            (over the whole vocabulary; fp32)

Forward, per row and rank: the shard's max ``m_r``, ``l_r = sum_j exp(x_j - m_r)`` and the target logit when the rank
owns the target (else 0); across the TP group ``m = max_r m_r``, ``l = sum_r l_r exp(m_r - m)``, ``x_t = sum_r``, so
``lse = m + log l`` and ``loss = lse - x_t`` (three all-reduces of ``[s * b]`` values). Backward:
``dx = g (exp(x - lse) - [j == target])`` written in the logits' dtype; only ``lse`` ``[s * b]`` and the logits
themselves are kept for it.

megatron-core's ``vocab_parallel_cross_entropy`` computes the same function through an fp32 copy of the logits and
six more full passes over it (max, subtract, exp, sum, divide, and the gradient's scale); at 8K tokens and the
released 154,880-token vocabulary that is ~20 ms of an H200 step and a 5 GB fp32 buffer kept for the backward.
:func:`row_stats_reference` and :func:`softmax_grad_reference` are the plain PyTorch versions of the two kernels
(CPU runs and tests).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron_glm5.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["vocab_parallel_cross_entropy", "row_stats", "row_stats_reference", "softmax_grad",
           "softmax_grad_reference"]

BLOCK_V = 4096
"""Vocabulary columns per step (forward) / per program (backward)."""


# ============================================================================ PyTorch reference
def row_stats_reference(x: torch.Tensor, target: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [N, V]``, ``target [N]`` int (local column, ``-1`` = not on this shard) -> fp32 ``(m [N], l [N], x_t [N])``:
    row max, ``sum exp(x - m)`` and the target logit (0 where ``target < 0``)."""
    xf = x.float()
    m = xf.amax(-1)
    l = torch.exp(xf - m[:, None]).sum(-1)
    owned = target >= 0
    x_t = xf.gather(1, target.clamp(min=0).long()[:, None])[:, 0]
    return m, l, torch.where(owned, x_t, torch.zeros_like(x_t))


def softmax_grad_reference(x: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                           grad: torch.Tensor) -> torch.Tensor:
    """``dx = grad (exp(x - lse) - onehot(target))`` ``[N, V]`` in ``x.dtype`` (fp32 arithmetic); rows whose target is
    ``-1`` (on another shard) get no one-hot term."""
    p = torch.exp(x.float() - lse[:, None])
    rows = torch.nonzero(target >= 0)[:, 0]
    p[rows, target[rows].long()] -= 1.0
    return (p * grad.float()[:, None]).to(x.dtype)


# ============================================================================ Triton kernels
if HAVE_TRITON:

    @triton.jit
    def _row_stats_kernel(X, TGT, M, L, XT, V, stride_x, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = X + row * stride_x
        offs = tl.arange(0, BLOCK)
        m = tl.full([], float("-inf"), tl.float32)
        l = tl.full([], 0.0, tl.float32)
        for v0 in range(0, V, BLOCK):
            x = tl.load(base + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            l = l * tl.math.exp2((m - m_new) * 1.4426950408889634) + \
                tl.sum(tl.math.exp2((x - m_new) * 1.4426950408889634), 0)
            m = m_new
        t = tl.load(TGT + row)
        x_t = tl.load(base + tl.maximum(t, 0)).to(tl.float32)
        tl.store(M + row, m)
        tl.store(L + row, l)
        tl.store(XT + row, tl.where(t >= 0, x_t, 0.0))

    @triton.jit
    def _softmax_grad_kernel(X, TGT, LSE, G, DX, V, stride_x, stride_dx, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < V
        x = tl.load(X + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        lse = tl.load(LSE + row)
        g = tl.load(G + row).to(tl.float32)
        t = tl.load(TGT + row)
        p = tl.math.exp2((x - lse) * 1.4426950408889634)
        dx = (p - tl.where(offs == t, 1.0, 0.0)) * g
        tl.store(DX + row * stride_dx + offs, dx.to(DX.dtype.element_ty), mask=ok)


def _use_triton(x: torch.Tensor) -> bool:
    return HAVE_TRITON and x.is_cuda


def row_stats(x: torch.Tensor, target: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`row_stats_reference` in one Triton pass over ``x`` on CUDA (the reference elsewhere)."""
    if not _use_triton(x):
        return row_stats_reference(x, target)
    n, v = x.shape
    m, l, x_t = (torch.empty(n, device=x.device, dtype=torch.float32) for _ in range(3))
    if n:
        _row_stats_kernel[(n,)](x, target, m, l, x_t, v, x.stride(0), BLOCK=BLOCK_V, num_warps=8)
    return m, l, x_t


def softmax_grad(x: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """:func:`softmax_grad_reference` in one Triton pass (read ``x``, write ``dx``) on CUDA."""
    if not _use_triton(x):
        return softmax_grad_reference(x, target, lse, grad)
    n, v = x.shape
    dx = torch.empty_like(x)
    if n:
        _softmax_grad_kernel[(n, triton.cdiv(v, BLOCK_V))](x, target, lse, grad.contiguous(), dx, v, x.stride(0),
                                                           dx.stride(0), BLOCK=BLOCK_V, num_warps=8)
    return dx


# ============================================================================ autograd + TP
class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group):
        v = logits.shape[-1]
        x = logits.reshape(-1, v)
        if x.stride(-1) != 1:
            x = x.contiguous()
        world = torch.distributed.get_world_size(group) if group is not None else 1
        start = torch.distributed.get_rank(group) * v if world > 1 else 0
        t = target.reshape(-1).to(torch.int64) - start
        t = torch.where((t >= 0) & (t < v), t, -1).to(torch.int32).contiguous()
        m, l, x_t = row_stats(x, t)
        if world > 1:
            m_all = m.clone()
            torch.distributed.all_reduce(m_all, op=torch.distributed.ReduceOp.MAX, group=group)
            l = l * torch.exp(m - m_all)
            torch.distributed.all_reduce(l, group=group)
            torch.distributed.all_reduce(x_t, group=group)
            m = m_all
        lse = m + torch.log(l)
        ctx.save_for_backward(x, t, lse)
        ctx.logits_shape = logits.shape
        return (lse - x_t).view(target.shape)

    @staticmethod
    def backward(ctx, grad):
        x, t, lse = ctx.saved_tensors
        return softmax_grad(x, t, lse, grad.reshape(-1)).view(ctx.logits_shape), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 group: Optional[torch.distributed.ProcessGroup] = None) -> torch.Tensor:
    """Per-token cross entropy ``[s, b]`` (fp32) of vocab-parallel ``logits [s, b, V/tp]`` and ``target [s, b]``.

    ``group``: the tensor-parallel group the vocabulary is split over (rank ``r`` holds columns ``[r V/tp,
    (r + 1) V/tp)``, megatron's layout); None or one rank = the whole vocabulary is local. The logits are not
    modified; the gradient has their dtype.
    """
    return _VocabParallelCrossEntropy.apply(logits, target, group)
