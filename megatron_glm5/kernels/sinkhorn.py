"""mHC Sinkhorn-Knopp normalisation as one Triton kernel forward and one backward (the reference is
``megatron_glm5.models.mhc._sinkhorn``, HF's op order).

For every token the ``[n, n]`` matrix goes through ``K = 2 * iters - 1`` normalisations (a column one, then
``iters - 1`` times row + column), each ``y = x / (sum_axis(x) + eps)``. In plain PyTorch that is ``~6 K`` tiny
kernel launches forward and more backward per mHC site; here one program handles ``BLOCK_T`` tokens entirely in
registers.

Backward of one step (``S = sum_axis(x) + eps``, ``y = x / S``): ``dx = (dy - sum_axis(dy * y)) / S``. The kernel
replays the ``K`` steps from the saved ``x_0``, storing each step's input in a per-program scratch (a persistent grid
of at most ``BWD_PROGRAMS_PER_SM`` programs per SM, so the scratch is ``K x BLOCK_T x n^2`` fp32 per program whatever
the token count), then walks the steps backwards loading them: ``O(K)`` work per token. (Recomputing each step's
input from ``x_0`` instead was ``O(K^2)``: 165 us per call at 4K tokens on the H200.) Values and gradients match the
reference to fp32 rounding.

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
    def _load(X, t0, T, N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr):
        t = t0 + tl.arange(0, BT)
        i = tl.arange(0, NP)
        offs = t[:, None, None] * (N * N) + i[None, :, None] * N + i[None, None, :]
        mask = (t < T)[:, None, None] & (i < N)[None, :, None] & (i < N)[None, None, :]
        return offs, mask

    @triton.jit
    def _sinkhorn_fwd_kernel(X, Y, T, eps, ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
                             BT: tl.constexpr):
        offs, mask = _load(X, tl.program_id(0) * BT, T, N, NP, BT)
        x = tl.load(X + offs, mask=mask, other=0.0)
        x = _normalize(x, False, eps)
        for _ in range(ITERS - 1):
            x = _normalize(x, True, eps)
            x = _normalize(x, False, eps)
        tl.store(Y + offs, x, mask=mask)

    @triton.jit
    def _sinkhorn_bwd_kernel(X, DY, DX, SCRATCH, T, eps, ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
                             BT: tl.constexpr):
        """A persistent program per token block: the forward steps again, each step's input stored to this
        program's ``SCRATCH`` slots ``[2 ITERS - 1, BT, NP, NP]`` (L2-resident), then the steps backwards, each
        loading its input back."""
        K: tl.constexpr = 2 * ITERS - 1
        STEP: tl.constexpr = BT * NP * NP
        b = tl.arange(0, BT)
        i = tl.arange(0, NP)
        local = b[:, None, None] * (NP * NP) + i[None, :, None] * NP + i[None, None, :]
        scratch = SCRATCH + tl.program_id(0).to(tl.int64) * (K * STEP) + local
        for t0 in range(tl.program_id(0) * BT, T, tl.num_programs(0) * BT):
            offs, mask = _load(X, t0, T, N, NP, BT)
            x = tl.load(X + offs, mask=mask, other=0.0)
            g = tl.load(DY + offs, mask=mask, other=0.0)
            # step k (0-based) normalises columns for even k, rows for odd k
            tl.store(scratch, x)
            x = _normalize(x, False, eps)
            for it in range(ITERS - 1):
                tl.store(scratch + (1 + 2 * it) * STEP, x)
                x = _normalize(x, True, eps)
                tl.store(scratch + (2 + 2 * it) * STEP, x)
                x = _normalize(x, False, eps)
            tl.debug_barrier()
            for r in range(ITERS - 1):
                it = ITERS - 2 - r
                x = tl.load(scratch + (2 + 2 * it) * STEP)
                g = tl.where(mask, _normalize_bwd(x, g, False, eps), 0.0)
                x = tl.load(scratch + (1 + 2 * it) * STEP)
                g = tl.where(mask, _normalize_bwd(x, g, True, eps), 0.0)
            x = tl.load(scratch)
            g = tl.where(mask, _normalize_bwd(x, g, False, eps), 0.0)
            tl.store(DX + offs, g, mask=mask)
            tl.debug_barrier()  # the next block reuses the scratch


_NUM_SMS = 132  # only sizes the backward's persistent grid; any value is correct
BWD_PROGRAMS_PER_SM = 4


def _np2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


class _SinkhornFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comb, iters, eps):
        x = comb.contiguous()
        y = torch.empty_like(x)
        n = x.shape[-1]
        T = x.numel() // (n * n)
        if T:
            _sinkhorn_fwd_kernel[(triton.cdiv(T, BLOCK_T),)](x, y, T, eps, ITERS=iters, N=n, NP=_np2(n), BT=BLOCK_T,
                                                             num_warps=4)
        ctx.save_for_backward(x)
        ctx.iters, ctx.eps = iters, eps
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dy = dy.contiguous().float()
        dx = torch.empty_like(x)
        n = x.shape[-1]
        T, np2, iters = x.numel() // (n * n), _np2(n), ctx.iters
        programs = min(triton.cdiv(T, BLOCK_T), BWD_PROGRAMS_PER_SM * _NUM_SMS)
        if T:
            scratch = torch.empty(programs, 2 * iters - 1, BLOCK_T, np2, np2, device=x.device, dtype=torch.float32)
            _sinkhorn_bwd_kernel[(programs,)](x, dy, dx, scratch, T, ctx.eps, ITERS=iters, N=n, NP=np2, BT=BLOCK_T,
                                              num_warps=4)
        return dx, None, None


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Fused Sinkhorn on ``comb [..., n, n]`` fp32 (CUDA + triton); saves only its input for backward."""
    if not HAVE_TRITON:
        raise RuntimeError("the fused Sinkhorn needs triton")
    if comb.dtype != torch.float32:
        raise ValueError(f"the fused Sinkhorn runs in fp32, got {comb.dtype}")
    return _SinkhornFunction.apply(comb, int(iters), float(eps))
