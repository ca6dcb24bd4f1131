"""KDA's short convolution with its SiLU -- ``silu(causal depthwise conv1d(x))`` with per-document resets -- as one
Triton kernel forward and one backward.

Reference: ``F.silu(causal_depthwise_conv1d(x, weight, cu_seqlens))`` (:mod:`megatron_glm5.models.kda`; fp32
arithmetic, one rounding to ``x``'s dtype here, :func:`causal_conv1d_silu_reference`)::

    x [R, C] (rows = b s tokens, row r at position r % s of its batch row), weight [C, W], offset [s] int
    pre[r, c] = sum_{j < W, offset[r % s] >= j} weight[c, W - 1 - j] x[r - j, c]      (offset: position in the document)
    y = silu(pre)                                                                      [R, C] in x's dtype

Backward (``dpre = dy sg (1 + pre (1 - sg))``, ``sg = sigmoid(pre)``): the forward kernel writes the fp32 ``pre``
once more (a temporary of the backward, not kept from the forward), then one kernel over (column blocks x row blocks)
gives ``dx[r] = sum_j weight[:, W - 1 - j] dpre[r + j]`` over the taps whose output row ``r + j`` is in ``r``'s
document (the shifted rows of ``pre`` and ``dy`` are L1/L2 hits) and each row block's ``dweight`` partial
``sum_r dpre[r] x[r - j]`` (``[row blocks, W, C]`` fp32, summed afterwards: no atomics).

FLA's ``causal_conv1d`` took 285 us per backward call at 4K tokens x 8192 channels on the H200 (bf16; 200 MB to move:
about a quarter of the bandwidth); it is what this replaces in ``kda_backend='fla_fused'``. (A first version that
recomputed ``pre`` inside one persistent backward kernel, looping over row blocks through a scratch, took 698 us.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_glm5.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["HAVE_TRITON", "causal_conv1d_silu", "causal_conv1d_silu_reference"]

_BT, _BC = 32, 128  # forward tile (rows x columns)
_BWD_BT = 64  # backward rows per block: each block writes one [W, C] fp32 dweight partial
_BWD_WARPS = 4  # 64 x 32 x 4 warps: 136 registers a thread on sm_90 (Triton 3.6), three blocks an SM
_BWD_BC = 32


def causal_conv1d_silu_reference(x: torch.Tensor, weight: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``x [b, s, C]``, ``weight [C, W]``, ``offset [s]`` (position of every row position in its document) ->
    ``silu(conv)`` in fp32 arithmetic, cast to ``x.dtype``."""
    s, width = x.shape[1], weight.shape[-1]
    xf, w = x.float(), weight.float()
    out = xf * w[:, width - 1]
    for j in range(1, min(width, s + 1)):
        shifted = F.pad(xf, (0, 0, j, 0))[:, :s]
        out = out + shifted * (offset >= j).to(xf.dtype)[None, :, None] * w[:, width - 1 - j]
    return F.silu(out).to(x.dtype)


if HAVE_TRITON:

    @triton.jit
    def _conv_fwd_kernel(X, Wt, OFF, Y, R, S, C, W: tl.constexpr, ACT: tl.constexpr, BT: tl.constexpr,
                         BC: tl.constexpr):
        """``Y = silu(pre)`` in ``Y``'s dtype (``ACT``), else ``Y = pre`` (the backward's fp32 pre-activations)."""
        r = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        rm = r < R
        cm = c < C
        off = tl.load(OFF + r % S, mask=rm, other=0)
        pre = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(W):
            ok = rm & (off >= j)
            xv = tl.load(X + (r - j)[:, None] * C + c[None, :], mask=ok[:, None] & cm[None, :], other=0.0)
            w = tl.load(Wt + c * W + (W - 1 - j), mask=cm, other=0.0).to(tl.float32)
            pre += xv.to(tl.float32) * w[None, :]
        if ACT:
            pre = pre * tl.sigmoid(pre)
        tl.store(Y + r[:, None] * C + c[None, :], pre.to(Y.dtype.element_ty), mask=rm[:, None] & cm[None, :])

    @triton.jit
    def _dpre(PRE, DY, rows, ok):
        """``dy * silu'(pre)`` fp32 at ``rows`` (0 where not ``ok``)."""
        pre = tl.load(PRE + rows, mask=ok, other=0.0)
        dy = tl.load(DY + rows, mask=ok, other=0.0).to(tl.float32)
        sg = tl.sigmoid(pre)
        return dy * sg * (1.0 + pre * (1.0 - sg))

    @triton.jit
    def _conv_bwd_kernel(X, Wt, OFF, PRE, DY, DX, PART, R, S, C, W: tl.constexpr, BT: tl.constexpr,
                         BC: tl.constexpr):
        """Rows ``[BT program_id(1), + BT)`` x columns ``[BC program_id(0), + BC)``: ``dx`` from the ``dpre`` of the
        ``W`` rows each row feeds, and the block's ``dweight`` partial ``PART[program_id(1), :, columns]``."""
        r = (tl.program_id(1) * BT + tl.arange(0, BT)).to(tl.int64)
        c = tl.program_id(0) * BC + tl.arange(0, BC)
        rm = r < R
        cm = c < C
        off = tl.load(OFF + r % S, mask=rm, other=0)
        ok = rm[:, None] & cm[None, :]
        dp = _dpre(PRE, DY, r[:, None] * C + c[None, :], ok)
        w = tl.load(Wt + c * W + (W - 1), mask=cm, other=0.0).to(tl.float32)
        dx = dp * w[None, :]
        for j in tl.static_range(1, W):
            # row r + j uses x[r] through tap j when it is in r's document
            same = rm & (r + j < R) & (r % S + j < S)
            off_o = tl.load(OFF + (r % S + j), mask=same, other=0)
            same = same & (off_o == off + j)
            dpo = _dpre(PRE, DY, (r + j)[:, None] * C + c[None, :], same[:, None] & cm[None, :])
            w = tl.load(Wt + c * W + (W - 1 - j), mask=cm, other=0.0).to(tl.float32)
            dx += dpo * w[None, :]
        tl.store(DX + r[:, None] * C + c[None, :], dx.to(DX.dtype.element_ty), mask=ok)
        part = PART + tl.program_id(1).to(tl.int64) * W * C + c
        for j in tl.static_range(W):
            # d weight[:, W - 1 - j] = sum_r dpre[r] x[r - j] over the valid taps
            okj = rm & (off >= j)
            xv = tl.load(X + (r - j)[:, None] * C + c[None, :], mask=okj[:, None] & cm[None, :], other=0.0)
            tl.store(part + (W - 1 - j) * C, tl.sum(dp * xv.to(tl.float32), axis=0), mask=cm)


class _CausalConv1dSiLU(torch.autograd.Function):
    """``(x [R, C], weight [C, W], offset [S], S) -> y [R, C]`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, offset, S):
        y = _conv_fwd(x, weight, offset, S, act=True)
        ctx.save_for_backward(x, weight, offset)
        ctx.S = S
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, offset = ctx.saved_tensors
        R, C = x.shape
        W = weight.shape[1]
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        n_r = triton.cdiv(R, _BWD_BT)
        part = torch.empty(n_r, W, C, device=x.device, dtype=torch.float32)
        if R:
            pre = _conv_fwd(x, weight, offset, ctx.S, act=False)
            _conv_bwd_kernel[(triton.cdiv(C, _BWD_BC), n_r)](x, weight, offset, pre, dy, dx, part, R, ctx.S, C, W=W,
                                                             BT=_BWD_BT, BC=_BWD_BC, num_warps=_BWD_WARPS)
        return dx, part.sum(0).t().to(weight.dtype), None, None


def _conv_fwd(x: torch.Tensor, weight: torch.Tensor, offset: torch.Tensor, S: int, act: bool) -> torch.Tensor:
    """``silu(pre)`` in ``x.dtype`` (``act``) or the fp32 ``pre`` of ``x [R, C]``."""
    R, C = x.shape
    y = torch.empty(R, C, device=x.device, dtype=x.dtype if act else torch.float32)
    if R:
        _conv_fwd_kernel[(triton.cdiv(R, _BT), triton.cdiv(C, _BC))](x, weight, offset, y, R, S, C, W=weight.shape[1],
                                                                      ACT=act, BT=_BT, BC=_BC, num_warps=4)
    return y


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Fused ``silu(causal depthwise conv1d)`` (CUDA + triton): ``x [b, s, C]``, ``weight [C, W]`` (or ``[C, 1,
    W]``), ``offset [s]`` int (each position's index inside its document: ``arange(s) - document_starts``) ->
    ``[b, s, C]`` in ``x.dtype``."""
    if not HAVE_TRITON:
        raise RuntimeError("the fused causal conv1d needs triton")
    if weight.dim() == 3:
        weight = weight.squeeze(1)
    b, s, C = x.shape
    if weight.shape[0] != C or offset.shape != (s,):
        raise ValueError(f"causal conv1d: x [b, s, {C}], weight [{C}, W], offset [{s}]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(offset.shape)}")
    y = _CausalConv1dSiLU.apply(x.reshape(b * s, C).contiguous(), weight.contiguous(), offset.contiguous(), s)
    return y.view(b, s, C)
