"""KDA's short convolution with its SiLU -- ``silu(causal depthwise conv1d(x))`` with per-document resets -- as one
Triton kernel forward and one backward.

Reference: ``F.silu(causal_depthwise_conv1d(x, weight, cu_seqlens))`` (:mod:`megatron_glm5.models.kda`; fp32
arithmetic, one rounding to ``x``'s dtype here, :func:`causal_conv1d_silu_reference`)::

    x [R, C] (rows = b s tokens, row r at position r % s of its batch row), weight [C, W], offset [s] int
    pre[r, c] = sum_{j < W, offset[r % s] >= j} weight[c, W - 1 - j] x[r - j, c]      (offset: position in the document)
    y = silu(pre)                                                                      [R, C] in x's dtype

Backward (``dpre = dy sg (1 + pre (1 - sg))``, ``sg = sigmoid(pre)``, ``pre`` recomputed from ``x``):
``dx[r] = sum_j weight[:, W - 1 - j] dpre[r + j]`` over the taps whose output row ``r + j`` is in ``r``'s document, and
``dweight[:, W - 1 - j] = sum_r dpre[r] x[r - j]`` over the valid taps. The backward is a persistent grid of column
blocks x row splits; each program writes ``dpre`` of a row block (and of the ``W - 1`` rows after it) to its own
scratch slot and reads it back shifted by each tap for ``dx`` (recomputing ``dpre`` at every shift instead needed more
registers than an SM thread has), and adds its rows' ``dweight`` into its own ``[W, C]`` slot of an fp32 partial
buffer (no atomics), summed afterwards.

FLA's ``causal_conv1d`` took 285 us per backward call at 4K tokens x 8192 channels on the H200 (bf16; 200 MB to move:
about a quarter of the bandwidth); it is what this replaces in ``kda_backend='fla_fused'``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_glm5.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["HAVE_TRITON", "causal_conv1d_silu", "causal_conv1d_silu_reference"]

_BT, _BC = 32, 128  # forward tile (rows x columns)
_BWD_BT = 16  # backward rows per block (x _BC columns): 32 needs 255 registers a thread on sm_90 (Triton 3.6)
_NUM_SMS = 132  # only sizes the backward's persistent grid; any value is correct
BWD_PROGRAMS_PER_SM = 4


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
    def _pre(X, Wt, OFF, r, c, R, S, C, W: tl.constexpr):
        """Pre-activation ``[BT, BC]`` fp32 at rows ``r`` (0 where ``r`` is outside ``[0, R)``)."""
        rm = (r >= 0) & (r < R)
        off = tl.load(OFF + r % S, mask=rm, other=0)
        cm = c < C
        acc = tl.zeros([r.shape[0], c.shape[0]], dtype=tl.float32)
        for j in tl.static_range(W):
            ok = rm & (off >= j)
            xv = tl.load(X + (r - j)[:, None] * C + c[None, :], mask=ok[:, None] & cm[None, :], other=0.0)
            w = tl.load(Wt + c * W + (W - 1 - j), mask=cm, other=0.0).to(tl.float32)
            acc += xv.to(tl.float32) * w[None, :]
        return acc

    @triton.jit
    def _conv_fwd_kernel(X, Wt, OFF, Y, R, S, C, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
        r = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        pre = _pre(X, Wt, OFF, r, c, R, S, C, W)
        y = pre * tl.sigmoid(pre)
        tl.store(Y + r[:, None] * C + c[None, :], y.to(Y.dtype.element_ty), mask=(r < R)[:, None] & (c < C)[None, :])

    @triton.jit
    def _dpre(X, Wt, OFF, DY, r, c, R, S, C, W: tl.constexpr):
        """``dy * silu'(pre)`` ``[BT, BC]`` fp32 at rows ``r`` (0 outside ``[0, R)``)."""
        pre = _pre(X, Wt, OFF, r, c, R, S, C, W)
        ok = ((r >= 0) & (r < R))[:, None] & (c < C)[None, :]
        dy = tl.load(DY + r[:, None] * C + c[None, :], mask=ok, other=0.0).to(tl.float32)
        sg = tl.sigmoid(pre)
        return dy * sg * (1.0 + pre * (1.0 - sg))

    @triton.jit
    def _conv_bwd_kernel(X, Wt, OFF, DY, DX, PART, SCRATCH, R, S, C, W: tl.constexpr, HALO: tl.constexpr,
                         BT: tl.constexpr, BC: tl.constexpr):
        """Column block ``program_id(0)``; row blocks ``program_id(1), + num_programs(1), ...``. Per row block:
        ``dpre`` of its rows and of the ``HALO >= W - 1`` rows after it go to this program's ``SCRATCH`` slot
        ``[BT + HALO, BC]`` (L1/L2-resident) and are read back shifted by each tap for ``dx``; this program's
        ``dweight`` partial goes to ``PART[program_id(1), :, columns]`` (``[splits, W, C]`` fp32, zeroed)."""
        c = tl.program_id(0) * BC + tl.arange(0, BC)
        cm = c < C
        part = PART + tl.program_id(1).to(tl.int64) * W * C + c
        pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)
        lr = tl.arange(0, BT)
        lh = tl.arange(0, HALO)
        cc = tl.arange(0, BC)
        scratch = SCRATCH + pid * ((BT + HALO) * BC)
        for r0 in range(tl.program_id(1) * BT, R, tl.num_programs(1) * BT):
            r = (r0 + lr).to(tl.int64)
            rm = r < R
            off = tl.load(OFF + r % S, mask=rm, other=0)
            dp = _dpre(X, Wt, OFF, DY, r, c, R, S, C, W)
            tl.store(scratch + lr[:, None] * BC + cc[None, :], dp)
            dph = _dpre(X, Wt, OFF, DY, (r0 + BT + lh).to(tl.int64), c, R, S, C, W)
            tl.store(scratch + (BT + lh)[:, None] * BC + cc[None, :], dph)
            for j in tl.static_range(W):
                # d weight[:, W - 1 - j] += sum_r dpre[r] x[r - j] over the valid taps
                ok = rm & (off >= j)
                xv = tl.load(X + (r - j)[:, None] * C + c[None, :], mask=ok[:, None] & cm[None, :], other=0.0)
                slot = part + (W - 1 - j) * C
                tl.store(slot, tl.load(slot, mask=cm, other=0.0) + tl.sum(dp * xv.to(tl.float32), axis=0), mask=cm)
            tl.debug_barrier()
            dx = tl.zeros([BT, BC], dtype=tl.float32)
            for j in tl.static_range(W):
                # dx[r] += weight[:, W - 1 - j] dpre[r + j] where row r + j is in r's document
                same = rm & (r + j < R) & (r % S + j < S)
                off_o = tl.load(OFF + (r % S + j), mask=same, other=0)
                same = same & (off_o == off + j)
                dpo = tl.load(scratch + (lr + j)[:, None] * BC + cc[None, :], mask=same[:, None], other=0.0)
                w = tl.load(Wt + c * W + (W - 1 - j), mask=cm, other=0.0).to(tl.float32)
                dx += dpo * w[None, :]
            tl.store(DX + r[:, None] * C + c[None, :], dx.to(DX.dtype.element_ty), mask=rm[:, None] & cm[None, :])
            tl.debug_barrier()  # the next row block overwrites the scratch


class _CausalConv1dSiLU(torch.autograd.Function):
    """``(x [R, C], weight [C, W], offset [S], S) -> y [R, C]`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, offset, S):
        R, C = x.shape
        W = weight.shape[1]
        y = torch.empty_like(x)
        if R:
            _conv_fwd_kernel[(triton.cdiv(R, _BT), triton.cdiv(C, _BC))](x, weight, offset, y, R, S, C, W=W, BT=_BT,
                                                                          BC=_BC, num_warps=4)
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
        n_c = triton.cdiv(C, _BC)
        splits = max(1, min(triton.cdiv(R, _BWD_BT), triton.cdiv(BWD_PROGRAMS_PER_SM * _NUM_SMS, n_c)))
        part = torch.zeros(splits, W, C, device=x.device, dtype=torch.float32)
        halo = max(1, triton.next_power_of_2(W - 1))
        if R:
            scratch = torch.empty(splits * n_c, _BWD_BT + halo, _BC, device=x.device, dtype=torch.float32)
            _conv_bwd_kernel[(n_c, splits)](x, weight, offset, dy, dx, part, scratch, R, ctx.S, C, W=W, HALO=halo,
                                            BT=_BWD_BT, BC=_BC, num_warps=4)
        return dx, part.sum(0).t().to(weight.dtype), None, None


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
