"""KDA's short convolution with its SiLU, ``silu(causal depthwise conv1d(x))``, as one Triton kernel each way.

Reference: :func:`short_conv_silu_reference` (``models.kda.causal_depthwise_conv1d`` then SiLU)::

    pre[t, c] = sum_{j < W, t - j >= start(t)} w[c, W - 1 - j] x[t - j, c]      (fp32)
    y[t, c]   = silu(pre[t, c])                                                  -> x.dtype

Layouts: ``x [b, s, c]`` (channels contiguous), ``weight [c, W]`` (fp32 in the model: ``weight[:, W - 1]``
multiplies the current token), ``starts [s]`` int32: the row position where each position's document starts (a
packed row's document reset; zeros for one document a row, shared by all batch rows).

Backward, with ``g[u] = dy[u] silu'(pre[u])`` (``silu'(z) = s (1 + z (1 - s))``, ``s = sigmoid(z)``; ``pre``
recomputed from ``x``, nothing saved but ``x``)::

    dx[t, c]         = sum_{i < W, t + i < s, start(t + i) <= t} w[c, W - 1 - i] g[t + i, c]
    dw[c, W - 1 - j] = sum_{t, t - j >= start(t)} g[t, c] x[t - j, c]                (fp32, [b x row tiles] partial
                                                                                     sums added up by torch)

One program owns a ``[BT rows, BC channels]`` tile; the shifted rows it reads again are L1 / L2 hits. This replaces
FLA's ``causal_conv1d`` on the ``'fla_fused'`` KDA path (whose backward kernel took ~585 us per call on a
``[8192, 4096]`` bf16 input on an H200, and recomputes the forward first).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_glm5.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["HAVE_TRITON", "SHORT_CONV_CONFIG", "short_conv_silu", "short_conv_silu_reference"]

SHORT_CONV_CONFIG = dict(BT=32, BC=128, num_warps=4)
"""Tile of both kernels: rows, channels (a power of two), warps."""


def short_conv_silu_reference(x: torch.Tensor, weight: torch.Tensor,
                              cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """PyTorch reference: ``x [b, s, c]``, ``weight [c, W]`` (or ``[c, 1, W]``), optional ``cu_seqlens`` of a
    packed row -> ``silu(conv)`` ``[b, s, c]`` in ``x.dtype`` (the conv and SiLU in the weight's precision)."""
    from megatron_glm5.models.kda import causal_depthwise_conv1d  # the one home of the convolution's math

    return torch.nn.functional.silu(causal_depthwise_conv1d(x, weight, cu_seqlens)).to(x.dtype)


if HAVE_TRITON:

    @triton.jit
    def _preact(X, WT, STARTS_U, u, mu, x_base, stride_xs, offs_c, c_ok, KW: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr):
        """fp32 ``pre[u, c]`` ``[BT, BC]`` for the rows ``u`` (``mu``: inside the sequence; ``STARTS_U``: their
        documents' starts) of one tile."""
        pre = tl.zeros([BT, BC], tl.float32)
        for j in tl.static_range(KW):
            uj = u - j
            m = (mu & (uj >= STARTS_U))[:, None] & c_ok[None, :]
            xv = tl.load(X + x_base + uj[:, None] * stride_xs + offs_c[None, :], mask=m, other=0.0)
            wv = tl.load(WT + offs_c * KW + (KW - 1 - j), mask=c_ok, other=0.0)
            pre += xv.to(tl.float32) * wv[None, :]
        return pre

    @triton.jit
    def _short_conv_fwd_kernel(X, WT, STARTS, Y, S, C, stride_xb, stride_xs, stride_yb, stride_ys,
                               KW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        pid_c, pid_t, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        t = pid_t.to(tl.int64) * BT + tl.arange(0, BT)
        offs_c = pid_c * BC + tl.arange(0, BC)
        c_ok = offs_c < C
        mt = t < S
        st = tl.load(STARTS + t, mask=mt, other=0)
        pre = _preact(X, WT, st, t, mt, pid_b * stride_xb, stride_xs, offs_c, c_ok, KW, BT, BC)
        y = pre * tl.sigmoid(pre)
        tl.store(Y + pid_b * stride_yb + t[:, None] * stride_ys + offs_c[None, :], y.to(Y.dtype.element_ty),
                 mask=mt[:, None] & c_ok[None, :])

    @triton.jit
    def _short_conv_bwd_kernel(X, WT, STARTS, DY, DX, DWP, S, C, stride_xb, stride_xs, stride_dyb, stride_dys,
                               stride_dxb, stride_dxs, n_tiles, KW: tl.constexpr, BT: tl.constexpr,
                               BC: tl.constexpr):
        pid_c, pid_t, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        t = pid_t.to(tl.int64) * BT + tl.arange(0, BT)
        offs_c = pid_c * BC + tl.arange(0, BC)
        c_ok = offs_c < C
        mt = t < S
        x_base = pid_b * stride_xb
        dx = tl.zeros([BT, BC], tl.float32)
        g0 = tl.zeros([BT, BC], tl.float32)
        st_t = tl.load(STARTS + t, mask=mt, other=0)
        for i in tl.static_range(KW):                 # the output row u = t + i reads x[t] through tap i
            u = t + i
            mu = u < S
            st_u = tl.load(STARTS + u, mask=mu, other=0)
            pre = _preact(X, WT, st_u, u, mu, x_base, stride_xs, offs_c, c_ok, KW, BT, BC)
            dyv = tl.load(DY + pid_b * stride_dyb + u[:, None] * stride_dys + offs_c[None, :],
                          mask=mu[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
            sg = tl.sigmoid(pre)
            g = dyv * sg * (1.0 + pre * (1.0 - sg))
            wv = tl.load(WT + offs_c * KW + (KW - 1 - i), mask=c_ok, other=0.0)
            same_doc = mu & (st_u <= t)
            dx += tl.where(same_doc[:, None], g * wv[None, :], 0.0)
            if i == 0:
                g0 = g
        tl.store(DX + pid_b * stride_dxb + t[:, None] * stride_dxs + offs_c[None, :], dx.to(DX.dtype.element_ty),
                 mask=mt[:, None] & c_ok[None, :])
        tile = pid_b * n_tiles + pid_t
        for j in tl.static_range(KW):                 # dw[c, KW - 1 - j]: this tile's rows t against x[t - j]
            tj = t - j
            m = (mt & (tj >= st_t))[:, None] & c_ok[None, :]
            xv = tl.load(X + x_base + tj[:, None] * stride_xs + offs_c[None, :], mask=m, other=0.0)
            part = tl.sum(g0 * xv.to(tl.float32), 0)
            tl.store(DWP + tile * (KW * C) + (KW - 1 - j) * C + offs_c, part, mask=c_ok)


def _launch_shape(x: torch.Tensor):
    b, s, c = x.shape
    cfg = SHORT_CONV_CONFIG
    return b, s, c, (triton.cdiv(c, cfg["BC"]), triton.cdiv(s, cfg["BT"]), b)


class _ShortConvSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, starts):
        b, s, c, grid = _launch_shape(x)
        kw = weight.shape[1]
        y = torch.empty(b, s, c, device=x.device, dtype=x.dtype)
        cfg = SHORT_CONV_CONFIG
        _short_conv_fwd_kernel[grid](x, weight, starts, y, s, c, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                                     KW=kw, BT=cfg["BT"], BC=cfg["BC"], num_warps=cfg["num_warps"])
        ctx.save_for_backward(x, weight, starts)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, starts = ctx.saved_tensors
        b, s, c, grid = _launch_shape(x)
        kw = weight.shape[1]
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        dx = torch.empty(b, s, c, device=x.device, dtype=x.dtype)
        n_tiles = grid[1]
        dwp = torch.empty(b * n_tiles, kw, c, device=x.device, dtype=torch.float32)
        cfg = SHORT_CONV_CONFIG
        _short_conv_bwd_kernel[grid](x, weight, starts, dy, dx, dwp, s, c, x.stride(0), x.stride(1), dy.stride(0),
                                     dy.stride(1), dx.stride(0), dx.stride(1), n_tiles, KW=kw, BT=cfg["BT"],
                                     BC=cfg["BC"], num_warps=cfg["num_warps"])
        dw = dwp.sum(0).t().to(weight.dtype)                    # [c, W]
        return dx, dw, None


def short_conv_silu(x: torch.Tensor, weight: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """``silu(causal depthwise conv1d)`` with document resets, forward and backward in Triton.

    Args:
        x: ``[b, s, c]`` (any float dtype; channels are made contiguous).
        weight: ``[c, W]`` or ``[c, 1, W]`` (the fp32 parameter; its gradient comes back in its dtype).
        starts: int32 ``[s]``, the position where each position's document starts
            (``models.packing.row_document_starts``).

    Returns:
        ``[b, s, c]`` in ``x.dtype`` (fp32 arithmetic inside).
    """
    if not HAVE_TRITON:
        raise RuntimeError("the fused short convolution needs triton")
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    if x.dim() != 3 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"expected x [b, s, c] and weight [c, W], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if starts.shape != (x.shape[1],) or starts.dtype != torch.int32:
        raise ValueError(f"starts must be int32 [{x.shape[1]}], got {starts.dtype} {tuple(starts.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _ShortConvSiLU.apply(x, weight.contiguous(), starts)
