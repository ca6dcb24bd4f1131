"""KDA's short convolution with its SiLU, ``silu(causal depthwise conv1d(x))``, as one Triton kernel each way.

Reference: :func:`short_conv_silu_reference` (:func:`causal_depthwise_conv1d` then SiLU)::

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

Forward: one program a ``[BT rows, BC channels]`` tile; the ``W - 1`` shifted rows it reads again are L1 / L2 hits.
Backward: one program walks ``ROWS`` rows of ``BC`` channels in order, loading each row of ``x`` and ``dy`` once
(the next row's loads in flight while it computes) and carrying the last three rows of ``x`` and ``g`` in
registers -- the tile form of the backward, which reloads ``W^2`` shifted tiles, needs 255 registers a thread and
spills on sm_90 (2.5x slower than FLA's kernel for that reason).
Up to :data:`MAX_TAPS` taps. This replaces FLA's ``causal_conv1d`` on the ``'fla_fused'`` KDA path, whose backward kernel
runs the forward again first (both timed by ``scripts/bench_kda.py --conv-only``; docs/performance.md).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_glm5.kernels.triton_support import HAVE_TRITON, tl, triton
from megatron_glm5.kernels.documents import document_starts

__all__ = ["HAVE_TRITON", "MAX_TAPS", "SHORT_CONV_CONFIG", "causal_depthwise_conv1d", "short_conv_silu",
           "short_conv_silu_reference"]

SHORT_CONV_CONFIG = dict(fwd=dict(BT=16, BC=128, num_warps=4), bwd=dict(ROWS=128, BC=256, num_warps=2))
"""Tilings. Forward: ``[BT rows, BC channels]`` tiles (84 registers a thread on sm_90 at 16 x 128, no spills).
Backward: ``ROWS`` rows walked by each program of ``BC`` channels (``BC`` a power of two)."""
MAX_TAPS = 4
"""The backward kernel carries three earlier rows: convolutions up to 4 taps wide (wider ones take FLA's)."""


def causal_depthwise_conv1d(x: torch.Tensor, weight: torch.Tensor,
                            cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal depthwise 1-D convolution with a per-document reset (no bias, no activation).

    Args:
        x: ``[b, s, c]`` input.
        weight: ``[c, W]`` (or the checkpoint layout ``[c, 1, W]``); ``weight[:, W - 1]`` multiplies the current
            token and ``weight[:, W - 1 - j]`` the token ``j`` positions back (``F.conv1d`` with ``W - 1`` left
            zero padding).
        cu_seqlens: optional int ``[n_docs + 1]`` boundaries along ``s`` (shared by all batch rows). A tap that
            would reach into an earlier document reads zero, like the padding at the row start.

    Returns:
        ``[b, s, c]`` in ``weight.dtype`` (HF runs the conv in the fp32 weight's precision).
    """
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    b, s, c = x.shape
    if weight.shape[0] != c:
        raise ValueError(f"conv weight has {weight.shape[0]} channels, input has {c}")
    width = weight.shape[-1]
    x = x.to(weight.dtype)
    pos = torch.arange(s, device=x.device)
    if cu_seqlens is None:
        offset = pos
    else:
        offset = pos - document_starts(cu_seqlens.to(x.device), s)  # position inside its document
    out = x * weight[:, width - 1]
    for j in range(1, min(width, s + 1)):
        shifted = F.pad(x, (0, 0, j, 0))[:, :s]  # shifted[:, t] = x[:, t - j]
        valid = (offset >= j).to(x.dtype)[None, :, None]
        out = out + shifted * valid * weight[:, width - 1 - j]
    return out


def short_conv_silu_reference(x: torch.Tensor, weight: torch.Tensor,
                              cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """PyTorch reference: ``x [b, s, c]``, ``weight [c, W]`` (or ``[c, 1, W]``), optional ``cu_seqlens`` of a
    packed row -> ``silu(conv)`` ``[b, s, c]`` in ``x.dtype`` (the conv and SiLU in the weight's precision)."""
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
        t = pid_t * BT + tl.arange(0, BT)
        offs_c = pid_c * BC + tl.arange(0, BC)
        c_ok = offs_c < C
        mt = t < S
        st = tl.load(STARTS + t, mask=mt, other=0)
        pre = _preact(X, WT, st, t, mt, pid_b * stride_xb, stride_xs, offs_c, c_ok, KW, BT, BC)
        y = pre * tl.sigmoid(pre)
        tl.store(Y + pid_b * stride_yb + t[:, None] * stride_ys + offs_c[None, :], y.to(Y.dtype.element_ty),
                 mask=mt[:, None] & c_ok[None, :])

    @triton.jit
    def _lag_weight(WT, offs_c, c_ok, lag: tl.constexpr, KW: tl.constexpr):
        """``[BC]`` fp32 weight of the tap ``lag`` rows back (``weight[:, KW - 1 - lag]``; 0 for ``lag >= KW``)."""
        if lag < KW:
            return tl.load(WT + offs_c * KW + (KW - 1 - lag), mask=c_ok, other=0.0)
        else:
            return tl.zeros([offs_c.shape[0]], tl.float32)

    @triton.jit
    def _short_conv_bwd_kernel(X, WT, STARTS, DY, DX, DWP, S, C, stride_xb, stride_xs, stride_dyb, stride_dys,
                               stride_dxb, stride_dxs, n_tiles, KW: tl.constexpr, ROWS: tl.constexpr,
                               BC: tl.constexpr):
        """Program (channel block, row block, batch row): one pass down rows ``[r0, r1)`` (3 more at the end for the
        last ``dx`` rows), each row of ``x`` and ``dy`` loaded once (the next row's load in flight meanwhile) and
        the last three rows of ``x`` and of ``g`` (and their documents' starts) carried in registers; up to 4 taps
        (lags 0-3; ``KW <= 4``)."""
        pid_c, pid_r, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
        offs_c = pid_c * BC + tl.arange(0, BC)
        c_ok = offs_c < C
        r0 = pid_r.to(tl.int64) * ROWS        # int64 rows: the loop's row index is int64 too
        r1 = tl.minimum(r0 + ROWS, S)
        xb = X + pid_b * stride_xb + offs_c
        dyb = DY + pid_b * stride_dyb + offs_c
        dxb = DX + pid_b * stride_dxb + offs_c
        w0 = _lag_weight(WT, offs_c, c_ok, 0, KW)
        w1 = _lag_weight(WT, offs_c, c_ok, 1, KW)
        w2 = _lag_weight(WT, offs_c, c_ok, 2, KW)
        w3 = _lag_weight(WT, offs_c, c_ok, 3, KW)
        # x[u - 1], x[u - 2], x[u - 3] (raw: whether a tap stays inside u's document is decided per row)
        xm1 = tl.load(xb + (r0 - 1) * stride_xs, mask=c_ok & (r0 >= 1), other=0.0).to(tl.float32)
        xm2 = tl.load(xb + (r0 - 2) * stride_xs, mask=c_ok & (r0 >= 2), other=0.0).to(tl.float32)
        xm3 = tl.load(xb + (r0 - 3) * stride_xs, mask=c_ok & (r0 >= 3), other=0.0).to(tl.float32)
        gm1 = tl.zeros([BC], tl.float32)      # g[u - 1], g[u - 2], g[u - 3]
        gm2 = tl.zeros([BC], tl.float32)
        gm3 = tl.zeros([BC], tl.float32)
        sm1 = tl.zeros([], tl.int32)          # starts of the documents of rows u - 1, u - 2
        sm2 = tl.zeros([], tl.int32)
        dw0 = tl.zeros([BC], tl.float32)      # dw by lag, this program's rows
        dw1 = tl.zeros([BC], tl.float32)
        dw2 = tl.zeros([BC], tl.float32)
        dw3 = tl.zeros([BC], tl.float32)
        x_next = tl.load(xb + r0 * stride_xs, mask=c_ok & (r0 < S), other=0.0)
        dy_next = tl.load(dyb + r0 * stride_dys, mask=c_ok & (r0 < S), other=0.0)
        st_next = tl.load(STARTS + r0, mask=r0 < S, other=0)
        for u in range(r0, r1 + 3):
            xu = x_next.to(tl.float32)
            dyu = dy_next.to(tl.float32)
            st = st_next
            nxt = (u + 1 < S) & (u + 1 < r1 + 3)
            x_next = tl.load(xb + (u + 1) * stride_xs, mask=c_ok & nxt, other=0.0)
            dy_next = tl.load(dyb + (u + 1) * stride_dys, mask=c_ok & nxt, other=0.0)
            st_next = tl.load(STARTS + u + 1, mask=nxt, other=0)
            v1 = u - 1 >= st
            v2 = u - 2 >= st
            v3 = u - 3 >= st
            pre = w0 * xu + tl.where(v1, w1 * xm1, 0.0) + tl.where(v2, w2 * xm2, 0.0) + tl.where(v3, w3 * xm3, 0.0)
            sg = tl.sigmoid(pre)
            g = dyu * sg * (1.0 + pre * (1.0 - sg))            # 0 past the sequence (dy read as 0 there)
            own = (u < r1).to(tl.float32)
            gx = g * own
            dw0 += gx * xu
            dw1 += tl.where(v1, gx * xm1, 0.0)
            dw2 += tl.where(v2, gx * xm2, 0.0)
            dw3 += tl.where(v3, gx * xm3, 0.0)
            t = u - 3                                           # dx[t] = sum_i w_lag(i) g[t + i], same document
            dx = w0 * gm3 + tl.where(sm2 <= t, w1 * gm2, 0.0) + tl.where(sm1 <= t, w2 * gm1, 0.0) \
                + tl.where(st <= t, w3 * g, 0.0)
            tl.store(dxb + t * stride_dxs, dx.to(DX.dtype.element_ty), mask=c_ok & (t >= r0) & (t < r1))
            xm3 = xm2
            xm2 = xm1
            xm1 = xu
            gm3 = gm2
            gm2 = gm1
            gm1 = g
            sm2 = sm1
            sm1 = st
        part = DWP + (pid_b * n_tiles + pid_r) * (KW * C) + offs_c
        tl.store(part + (KW - 1) * C, dw0, mask=c_ok)
        if KW > 1:
            tl.store(part + (KW - 2) * C, dw1, mask=c_ok)
        if KW > 2:
            tl.store(part + (KW - 3) * C, dw2, mask=c_ok)
        if KW > 3:
            tl.store(part + (KW - 4) * C, dw3, mask=c_ok)


class _ShortConvSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, starts):
        b, s, c = x.shape
        kw = weight.shape[1]
        y = torch.empty(b, s, c, device=x.device, dtype=x.dtype)
        cfg = SHORT_CONV_CONFIG["fwd"]
        grid = (triton.cdiv(c, cfg["BC"]), triton.cdiv(s, cfg["BT"]), b)
        _short_conv_fwd_kernel[grid](x, weight, starts, y, s, c, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
                                     KW=kw, BT=cfg["BT"], BC=cfg["BC"], num_warps=cfg["num_warps"])
        ctx.save_for_backward(x, weight, starts)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, starts = ctx.saved_tensors
        b, s, c = x.shape
        kw = weight.shape[1]
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        dx = torch.empty(b, s, c, device=x.device, dtype=x.dtype)
        cfg = SHORT_CONV_CONFIG["bwd"]
        n_tiles = triton.cdiv(s, cfg["ROWS"])
        dwp = torch.empty(b * n_tiles, kw, c, device=x.device, dtype=torch.float32)
        _short_conv_bwd_kernel[(triton.cdiv(c, cfg["BC"]), n_tiles, b)](
            x, weight, starts, dy, dx, dwp, s, c, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), dx.stride(0),
            dx.stride(1), n_tiles, KW=kw, ROWS=cfg["ROWS"], BC=cfg["BC"], num_warps=cfg["num_warps"])
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
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    if x.dim() != 3 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"expected x [b, s, c] and weight [c, W], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.shape[1] > MAX_TAPS:
        raise ValueError(f"the fused short convolution takes at most {MAX_TAPS} taps, got {weight.shape[1]}")
    if starts.shape != (x.shape[1],) or starts.dtype != torch.int32:
        raise ValueError(f"starts must be int32 [{x.shape[1]}], got {starts.dtype} {tuple(starts.shape)}")
    if not HAVE_TRITON:
        raise RuntimeError("the fused short convolution needs triton")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _ShortConvSiLU.apply(x, weight.contiguous(), starts)
