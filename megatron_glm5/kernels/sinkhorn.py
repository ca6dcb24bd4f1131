"""mHC Sinkhorn-Knopp normalisation as one Triton kernel forward and one backward (the reference is
``megatron_glm5.models.mhc._sinkhorn``, HF's op order).

For every token the ``[n, n]`` matrix goes through ``K = 2 * iters - 1`` normalisations (a column one, then
``iters - 1`` times row + column), each ``y = x / (sum_axis(x) + eps)``. In plain PyTorch that is ``~6 K`` tiny
kernel launches forward and more backward per mHC site; here one program handles ``BLOCK_T`` tokens entirely in
registers.

Backward of one step (``S = sum_axis(x) + eps``, ``y = x / S``): ``dx = (dy - sum_axis(dy * y)) / S``. The kernel
walks the steps backwards and recomputes each step's input from the saved ``x_0`` (``O(K^2)`` tiny operations per
token, no scratch memory), so values and gradients match the reference to fp32 rounding.

Layout: ``comb [T, n, n]`` fp32 contiguous (any leading dims are flattened by :func:`sinkhorn`).
"""

from __future__ import annotations

import torch

from megatron_glm5.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["sinkhorn", "HAVE_TRITON"]

BLOCK_T = 64


if HAVE_TRITON:

    @triton.jit
    def _normalize(x, ROW: tl.constexpr, eps):
        """One Sinkhorn step on [BT, N, N]: ROW -> divide by the row sums (over j), else by the column sums."""
        if ROW:
            return x / (tl.sum(x, axis=2)[:, :, None] + eps)
        else:
            return x / (tl.sum(x, axis=1)[:, None, :] + eps)

    @triton.jit
    def _normalize_bwd(x, g, ROW: tl.constexpr, eps):
        """Gradient through one step: ``dx = (dy - sum_axis(dy * y)) / S`` with ``S = sum_axis(x) + eps``."""
        if ROW:
            s = tl.sum(x, axis=2)[:, :, None] + eps
            y = x / s
            return (g - tl.sum(g * y, axis=2)[:, :, None]) / s
        else:
            s = tl.sum(x, axis=1)[:, None, :] + eps
            y = x / s
            return (g - tl.sum(g * y, axis=1)[:, None, :]) / s

    @triton.jit
    def _load(X, T, N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr):
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        i = tl.arange(0, NP)
        offs = t[:, None, None] * (N * N) + i[None, :, None] * N + i[None, None, :]
        mask = (t < T)[:, None, None] & (i < N)[None, :, None] & (i < N)[None, None, :]
        return offs, mask

    @triton.jit
    def _sinkhorn_fwd_kernel(X, Y, T, eps, ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
                             BT: tl.constexpr):
        offs, mask = _load(X, T, N, NP, BT)
        x = tl.load(X + offs, mask=mask, other=0.0)
        x = _normalize(x, False, eps)
        for _ in range(ITERS - 1):
            x = _normalize(x, True, eps)
            x = _normalize(x, False, eps)
        tl.store(Y + offs, x, mask=mask)

    @triton.jit
    def _sinkhorn_bwd_kernel(X, DY, DX, T, eps, ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
                             BT: tl.constexpr):
        offs, mask = _load(X, T, N, NP, BT)
        x0 = tl.load(X + offs, mask=mask, other=0.0)
        g = tl.load(DY + offs, mask=mask, other=0.0)
        K: tl.constexpr = 2 * ITERS - 1
        # step k (0-based) normalises columns for even k, rows for odd k
        for kk in range(K):
            k = K - 1 - kk
            x = x0
            for m in range(k):  # recompute the input of step k
                if m % 2 == 0:
                    x = _normalize(x, False, eps)
                else:
                    x = _normalize(x, True, eps)
            if k % 2 == 0:
                g = _normalize_bwd(x, g, False, eps)
            else:
                g = _normalize_bwd(x, g, True, eps)
            g = tl.where(mask, g, 0.0)
        tl.store(DX + offs, g, mask=mask)


def _launch(kernel, *tensors, T, n, iters, eps):
    np2 = max(2, triton.next_power_of_2(n))
    kernel[(triton.cdiv(T, BLOCK_T),)](*tensors, T, eps, ITERS=iters, N=n, NP=np2, BT=BLOCK_T, num_warps=4)


class _SinkhornFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comb, iters, eps):
        x = comb.contiguous()
        y = torch.empty_like(x)
        n = x.shape[-1]
        _launch(_sinkhorn_fwd_kernel, x, y, T=x.numel() // (n * n), n=n, iters=iters, eps=eps)
        ctx.save_for_backward(x)
        ctx.iters, ctx.eps = iters, eps
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dy = dy.contiguous().float()
        dx = torch.empty_like(x)
        n = x.shape[-1]
        _launch(_sinkhorn_bwd_kernel, x, dy, dx, T=x.numel() // (n * n), n=n, iters=ctx.iters, eps=ctx.eps)
        return dx, None, None


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Fused Sinkhorn on ``comb [..., n, n]`` fp32 (CUDA + triton); saves only its input for backward."""
    if not HAVE_TRITON:
        raise RuntimeError("the fused Sinkhorn needs triton")
    if comb.dtype != torch.float32:
        raise ValueError(f"the fused Sinkhorn runs in fp32, got {comb.dtype}")
    return _SinkhornFunction.apply(comb, int(iters), float(eps))
