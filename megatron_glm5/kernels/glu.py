"""The routed experts' clamped SwiGLU with the routing probability, as one Triton kernel forward and one backward.

Reference: :func:`megatron_glm5.models.grouped_experts.grouped_glu` (megatron-core MLP's op order)::

    gate, up = y1[:, :F], y1[:, F:]                                   y1 [R, 2F], one row per (token, expert) pair
    a = silu(clamp(gate, max=L)) * (clamp(up, -L, L) + offset) * probs[:, None]   -> y1.dtype   [R, F]

In PyTorch that is about seven elementwise passes over ``[R, F]`` forward and more backward; here one pass each way
(fp32 arithmetic, one rounding to ``y1``'s dtype). Backward: with ``g = min(gate, L)``, ``u = clamp(up, -L, L)``,
``sg = sigmoid(g)``: ``d_gate = da p (u + offset) sg (1 + g (1 - sg)) [gate <= L]``, ``d_up = da p silu(g)
[-L <= up <= L]`` (PyTorch's clamp passes the gradient where the input lies inside the closed interval), and
``d_probs = sum_f da silu(g) (u + offset)``.
"""

from __future__ import annotations

import torch

from megatron_glm5.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["HAVE_TRITON", "clamped_swiglu"]

_BR, _BF = 4, 512


if HAVE_TRITON:

    @triton.jit
    def _glu_fwd_kernel(Y1, P, A, R, F, limit, offset, CLAMP: tl.constexpr, BR: tl.constexpr, BF: tl.constexpr):
        r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        f = tl.program_id(1) * BF + tl.arange(0, BF)
        mask = (r < R)[:, None] & (f < F)[None, :]
        gate = tl.load(Y1 + r[:, None] * (2 * F) + f[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(Y1 + r[:, None] * (2 * F) + F + f[None, :], mask=mask, other=0.0).to(tl.float32)
        p = tl.load(P + r, mask=r < R, other=0.0).to(tl.float32)
        if CLAMP:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        a = gate * tl.sigmoid(gate) * (up + offset) * p[:, None]
        tl.store(A + r[:, None] * F + f[None, :], a.to(A.dtype.element_ty), mask=mask)

    @triton.jit
    def _glu_bwd_kernel(Y1, P, DA, DY1, DP, R, F, limit, offset, CLAMP: tl.constexpr, BR: tl.constexpr,
                        BF: tl.constexpr):
        r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
        rmask = r < R
        p = tl.load(P + r, mask=rmask, other=0.0).to(tl.float32)
        acc = tl.zeros([BR, BF], dtype=tl.float32)
        for f0 in range(0, F, BF):
            f = f0 + tl.arange(0, BF)
            mask = rmask[:, None] & (f < F)[None, :]
            gate = tl.load(Y1 + r[:, None] * (2 * F) + f[None, :], mask=mask, other=0.0).to(tl.float32)
            up = tl.load(Y1 + r[:, None] * (2 * F) + F + f[None, :], mask=mask, other=0.0).to(tl.float32)
            da = tl.load(DA + r[:, None] * F + f[None, :], mask=mask, other=0.0).to(tl.float32)
            if CLAMP:
                g = tl.minimum(gate, limit)
                u = tl.minimum(tl.maximum(up, -limit), limit)
            else:
                g = gate
                u = up
            sg = tl.sigmoid(g)
            silu = g * sg
            uo = u + offset
            dap = da * p[:, None]
            d_gate = dap * uo * sg * (1.0 + g * (1.0 - sg))
            d_up = dap * silu
            if CLAMP:
                d_gate = tl.where(gate <= limit, d_gate, 0.0)
                d_up = tl.where((up >= -limit) & (up <= limit), d_up, 0.0)
            tl.store(DY1 + r[:, None] * (2 * F) + f[None, :], d_gate.to(DY1.dtype.element_ty), mask=mask)
            tl.store(DY1 + r[:, None] * (2 * F) + F + f[None, :], d_up.to(DY1.dtype.element_ty), mask=mask)
            acc += da * silu * uo
        tl.store(DP + r, tl.sum(acc, axis=1), mask=rmask)


class _ClampedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y1, probs, limit, offset):
        R, F2 = y1.shape
        F = F2 // 2
        a = torch.empty(R, F, device=y1.device, dtype=y1.dtype)
        clamp = limit is not None
        lim = float(limit) if clamp else 0.0
        _glu_fwd_kernel[(triton.cdiv(R, _BR), triton.cdiv(F, _BF))](y1, probs, a, R, F, lim, float(offset),
                                                                    CLAMP=clamp, BR=_BR, BF=_BF, num_warps=4)
        ctx.save_for_backward(y1, probs)
        ctx.lim, ctx.clamp, ctx.offset = lim, clamp, float(offset)
        return a

    @staticmethod
    def backward(ctx, da):
        y1, probs = ctx.saved_tensors
        R, F2 = y1.shape
        F = F2 // 2
        da = da.contiguous()
        dy1 = torch.empty_like(y1)
        dp = torch.empty(R, device=y1.device, dtype=torch.float32)
        _glu_bwd_kernel[(triton.cdiv(R, _BR),)](y1, probs, da, dy1, dp, R, F, ctx.lim, ctx.offset, CLAMP=ctx.clamp,
                                               BR=_BR, BF=_BF, num_warps=4)
        return dy1, dp.to(probs.dtype), None, None


def clamped_swiglu(y1: torch.Tensor, probs: torch.Tensor, limit, offset: float = 0.0) -> torch.Tensor:
    """``y1 [R, 2F]`` ([gate | up]), ``probs [R]`` -> ``silu(clamp(gate, max=limit)) * (clamp(up, -limit, limit) +
    offset) * probs`` ``[R, F]`` in ``y1``'s dtype (``limit=None``: no clamping)."""
    if not HAVE_TRITON:
        raise RuntimeError("the fused SwiGLU needs triton")
    return _ClampedSwiGLU.apply(y1.contiguous(), probs.contiguous(), limit, offset)
