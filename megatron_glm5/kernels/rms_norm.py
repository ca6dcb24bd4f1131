"""RMSNorm as one Triton kernel forward and one backward (plus a small ``torch.sum`` of the weight-gradient partials),
with its PyTorch reference.

Layout: ``x [..., D]`` (any leading dims: ``[s, b, h]`` activations, ``[s, b, heads, d]`` per-head norms), flattened
to ``[N, D]`` rows (a non-contiguous input is copied first); ``weight [D]`` of ``x``'s dtype (bf16, fp16 or fp32);
``D <= MAX_D`` so that one row is one block. Per row, HF's ``Glm5NextTextRMSNorm``::

    rstd = rsqrt(mean(x_f32^2) + eps)              (fp32)
    xn   = x_f32 * rstd                            (fp32)
    y    = weight * round(xn)                      (round = to x's dtype; the product in fp32, rounded once)

so ``y`` is bitwise the PyTorch formula's up to the fp32 rounding of the sum of squares (a different summation
order). Only ``x`` and the fp32 ``rstd [N]`` are saved for the backward, which recomputes ``xn = x * rstd`` (the
same fp32 product, so the same ``round(xn)``) and writes, all in fp32::

    dxn = grad * weight
    dx  = rstd * (dxn - xn * mean(dxn * xn))       (rounded to x's dtype)
    dw  = sum_rows grad * round(xn)                (what autograd of the formula gives; rounded to weight's dtype)

``dw`` is reduced without atomics: a persistent grid of at most ``BWD_PROGRAMS_PER_SM * _NUM_SMS`` programs, each
looping over row blocks, writes one fp32 partial row ``[programs, D]``, summed by ``torch.sum`` afterwards
(deterministic for a given grid). The PyTorch formula costs ~8 elementwise/reduction kernels forward and more in its
autograd backward (which also keeps an fp32 copy of ``x``); :func:`rms_norm_reference` is that formula (CPU runs and
tests). Index arithmetic is in int64 (``N * D`` passes 2^31 at long sequences).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron_glm5.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["HAVE_TRITON", "MAX_D", "fused_rms_norm", "fused_rms_norm_applies", "rms_norm_fwd", "rms_norm_bwd",
           "rms_norm_reference"]

MAX_D = 16384
"""Widest row the fused kernels take (one row is one block of registers); wider rows use the reference."""

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FWD_TILE = 8192  # elements per forward program (ROWS * BLOCK_D, at least one row)
_BWD_TILE = 8192  # elements per backward step (x, grad and the dw accumulator live in registers)
_NUM_SMS = 132  # only sizes the backward's persistent grid; any value is correct
BWD_PROGRAMS_PER_SM = 1
# H200, bf16 (the tiles / warps / grid: the best overall of a sweep over 2K-16K-element tiles, 8-32 elements per
# thread and 1-6 programs per SM, within ~15% of each shape's best): forward 23 us at [4096, 4096] (the PyTorch
# formula: 234 us graphed), 23 us at [131072, 128], 11 us at [8192, 512]; backward (dx, dw partials and their sum)
# 50 us at [4096, 4096], 44 us at [131072, 128], 28 us at [8192, 512], 105 us at [2048, 16384].


# ============================================================================ PyTorch reference
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``Glm5NextTextRMSNorm``: ``weight * (x_f32 * rsqrt(mean(x_f32^2, -1) + eps)).to(x.dtype)``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


# ============================================================================ Triton kernels
if HAVE_TRITON:

    @triton.jit
    def _rms_norm_fwd_kernel(X, W, Y, RSTD, n_rows, D, eps, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_D)
        row_ok = rows < n_rows
        col_ok = cols < D
        mask = row_ok[:, None] & col_ok[None, :]
        offs = rows[:, None] * D + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, 1) / D + eps)
        xn = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(Y + offs, (w[None, :] * xn).to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + rows, rstd, mask=row_ok)

    @triton.jit
    def _rms_norm_bwd_kernel(X, W, RSTD, DY, DX, DW_PARTIAL, n_rows, D, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                             HAS_DW: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < D
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        dw = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        for blk in range(pid, tl.cdiv(n_rows, ROWS), tl.num_programs(0)):
            rows = tl.arange(0, ROWS).to(tl.int64) + blk * ROWS  # blk * ROWS < n_rows: no int32 overflow
            row_ok = rows < n_rows
            mask = row_ok[:, None] & col_ok[None, :]
            offs = rows[:, None] * D + cols[None, :]
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            xn = x * rstd[:, None]
            dxn = dy * w[None, :]
            c = tl.sum(dxn * xn, 1) / D
            dx = (dxn - xn * c[:, None]) * rstd[:, None]
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
            if HAS_DW:
                dw += dy * xn.to(X.dtype.element_ty).to(tl.float32)
        if HAS_DW:
            tl.store(DW_PARTIAL + pid.to(tl.int64) * D + cols, tl.sum(dw, 0), mask=col_ok)


def _blocks(d: int, tile: int) -> Tuple[int, int, int]:
    """``(ROWS, BLOCK_D, num_warps)`` for rows of width ``d`` in tiles of about ``tile`` elements."""
    block_d = triton.next_power_of_2(d)
    rows = max(1, tile // block_d)
    return rows, block_d, min(32, max(4, rows * block_d // 512))  # ~16 elements per thread


def fused_rms_norm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`fused_rms_norm` takes ``x``/``weight``: CUDA + triton, one float dtype for both, ``weight``
    of shape ``[D]`` and ``D <= MAX_D``."""
    return (HAVE_TRITON and x.is_cuda and weight.is_cuda and x.dtype == weight.dtype and x.dtype in _DTYPES
            and x.dim() >= 1 and weight.dim() == 1 and 0 < x.shape[-1] == weight.shape[0] <= MAX_D)


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [N, D]`` contiguous, ``weight [D]`` -> ``(y [N, D]`` in x's dtype, ``rstd [N]`` fp32)."""
    n, d = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(n, device=x.device, dtype=torch.float32)
    if n:
        rows, block_d, warps = _blocks(d, _FWD_TILE)
        _rms_norm_fwd_kernel[(triton.cdiv(n, rows),)](x, weight, y, rstd, n, d, eps, ROWS=rows, BLOCK_D=block_d,
                                                       num_warps=warps)
    return y, rstd


def rms_norm_bwd(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                 need_dw: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``grad, x [N, D]`` contiguous, ``weight [D]``, ``rstd [N]`` -> ``(dx [N, D]`` in x's dtype, ``dw [D]`` in
    weight's dtype, or None without ``need_dw``)."""
    n, d = x.shape
    dx = torch.empty_like(x)
    if not n:
        return dx, torch.zeros_like(weight) if need_dw else None
    rows, block_d, warps = _blocks(d, _BWD_TILE)
    programs = max(1, min(triton.cdiv(n, rows), BWD_PROGRAMS_PER_SM * _NUM_SMS))
    partial = torch.empty(programs if need_dw else 1, d, device=x.device, dtype=torch.float32)
    _rms_norm_bwd_kernel[(programs,)](x, weight, rstd, grad, dx, partial, n, d, ROWS=rows, BLOCK_D=block_d,
                                      HAS_DW=need_dw, num_warps=warps)
    return dx, partial.sum(0).to(weight.dtype) if need_dw else None


# ============================================================================ autograd
class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        x2 = x.contiguous().view(-1, shape[-1])
        w = weight.contiguous()
        y, rstd = rms_norm_fwd(x2, w, eps)
        ctx.save_for_backward(x2, w, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, grad):
        x2, w, rstd = ctx.saved_tensors
        dx, dw = rms_norm_bwd(grad.contiguous().view(-1, x2.shape[-1]), x2, w, rstd,
                              need_dw=ctx.needs_input_grad[1])
        return dx.view(ctx.shape), dw, None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm_reference` through the Triton kernels (forward and backward); ``x [..., D]`` and ``weight
    [D]`` as :func:`fused_rms_norm_applies` requires. The output and ``dx`` have ``x``'s shape (contiguous) and
    dtype, ``dw`` the weight's dtype."""
    if not HAVE_TRITON:
        raise RuntimeError("the fused RMSNorm needs triton")
    return _RMSNormFunction.apply(x, weight, float(eps))
