"""mHC stream arithmetic as Triton kernels: the hyper-connection's input side (stream RMS norm + projection onto the
``(2 + n) n`` mixes, the weighted collapse) and its output side (``post * y + comb^T @ streams``), forward and
backward. The PyTorch references are the formulas in :mod:`megatron_glm5.models.mhc`
(``HyperConnection.compute_weights`` / ``forward`` and ``apply_hyper_connection_output``) and the ``*_reference``
functions here, which spell out what each kernel computes.

Notation (``T`` tokens = the flattened leading dims, ``n = hc_mult`` streams of width ``h``, ``D = n h``,
``M = (2 + n) n`` mixes): ``streams [T, n, h]`` (bf16 or fp32), ``fn [M, D]``.

Input side (:func:`hyper_connection`, one ``autograd.Function``):

* ``mixes = (streams_flat @ fn^T) * rstd`` with ``rstd = rsqrt(mean(streams_flat^2) + norm_eps)`` -- one pass over
  the streams (``_proj_fwd_kernel``; bf16 tensor-core dots when streams and ``fn`` are bf16 -- exact products, fp32 sums --
  else fp32 through ``tf32x3`` dots; the
  norm applied to the ``[T, M]`` result instead of the ``[T, D]`` input: the same function up to fp32 rounding);
* ``pre, post, comb`` from ``mixes`` by the caller's ``weights_fn`` (tiny ``[T, M]`` PyTorch ops, the Sinkhorn);
* ``collapsed = sum_i pre_i * stream_i`` (fp32 accumulation, cast to the streams' dtype; ``_collapse_fwd_kernel``).

  Backward: ``d_pre`` (``_collapse_bwd_kernel``), then ``d_mixes`` by autograd through ``weights_fn`` replayed on
  the saved ``mixes`` (and ``d_base`` / ``d_scale`` with it), then one kernel (``_proj_bwd_kernel``) that writes
  ``d_streams = pre * d_collapsed + (d_mixes rstd) @ fn + c * streams`` (``c = -rstd^2 / D * sum_m d_mixes
  mixes``: the norm's gradient) and accumulates ``d_fn = (d_mixes rstd)^T @ streams``.

Output side (:func:`apply_output`): ``new[t, j] = post[t, j] * y[t] + sum_i comb[t, i, j] * streams[t, i]`` in fp32,
rounded once to the streams' dtype; the backward gives ``d_y``, ``d_streams``, ``d_post`` and ``d_comb`` in one
pass (``_apply_bwd_kernel``: tiles of tokens x streams, every product a tensor-core dot).

Only the inputs are saved (streams, the ``[T, M]`` mixes and ``[T]`` rstd); the fp32 ``[T, D]`` temporaries of the
PyTorch version never exist. Index arithmetic is in int64 (``T * D`` passes 2^31 at long sequences).
"""

from __future__ import annotations

from typing import Callable, Tuple

import torch

from megatron_glm5.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["HAVE_TRITON", "hyper_connection", "apply_output", "mixes_reference", "collapse_reference",
           "apply_output_reference"]

_NUM_SMS = 132  # only sizes the split grids; any value is correct


# ----------------------------------------------------------------------------------------------- references
def mixes_reference(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``[T, n, h]`` -> fp32 ``[T, M]``: HF's RMS-normalised fp32 projection (``HyperConnection.compute_weights``)."""
    x = streams.reshape(streams.shape[0], -1).float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    return torch.nn.functional.linear(x, fn.float())


def collapse_reference(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_i pre[.., i] * streams[.., i, :]`` in fp32, cast to the streams' dtype (``HyperConnection.forward``)."""
    return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


def apply_output_reference(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
                           comb: torch.Tensor) -> torch.Tensor:
    """``post[.., j] * block_out + sum_i comb[.., i, j] * streams[.., i, :]`` in fp32, cast to the streams' dtype
    (the kernel's rounding; ``mhc.apply_hyper_connection_output`` is HF's, which rounds the coefficients first)."""
    out = post.float().unsqueeze(-1) * block_out.float().unsqueeze(-2) + torch.matmul(
        comb.float().transpose(-1, -2), streams.float())
    return out.to(streams.dtype)


# ----------------------------------------------------------------------------------------------- kernels
if HAVE_TRITON:

    @triton.jit
    def _dot(a, b, BF16: tl.constexpr):
        """fp32-accurate ``a @ b`` for fp32 ``a`` and ``b`` holding bf16 values (``BF16``: two bf16 tensor-core
        dots, ``a`` split into bf16 high and low parts, so the error is ~2^-17 relative), else ``tf32x3``."""
        if BF16:
            a_hi = a.to(tl.bfloat16)
            a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
            b16 = b.to(tl.bfloat16)
            return tl.dot(a_hi, b16) + tl.dot(a_lo, b16)
        else:
            return tl.dot(a, b, input_precision="tf32x3")

    @triton.jit
    def _proj_fwd_kernel(X, W, RAW, SS, T, D, M, D_PER_SPLIT, BT: tl.constexpr, BD: tl.constexpr,
                         MP: tl.constexpr, BF16: tl.constexpr):
        """Partial ``raw = X @ W^T`` and ``ss = sum(X^2)`` over one split of D for BT tokens (``BF16``: X and W
        are bf16, so one bf16 tensor-core dot is exact in its products)."""
        pid_t = tl.program_id(0)
        pid_s = tl.program_id(1)
        t = (pid_t * BT + tl.arange(0, BT)).to(tl.int64)
        m = tl.arange(0, MP)
        tmask = t < T
        mmask = m < M
        acc = tl.zeros([BT, MP], dtype=tl.float32)
        ss = tl.zeros([BT], dtype=tl.float32)
        d_lo = pid_s * D_PER_SPLIT
        d_hi = tl.minimum(d_lo + D_PER_SPLIT, D)
        for d0 in range(d_lo, d_hi, BD):
            d = d0 + tl.arange(0, BD)
            dmask = d < d_hi
            x = tl.load(X + t[:, None] * D + d[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0)
            w = tl.load(W + m[:, None] * D + d[None, :], mask=mmask[:, None] & dmask[None, :], other=0.0)
            if BF16:
                acc += tl.dot(x, tl.trans(w))
            else:
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="tf32x3")
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
        base = pid_s.to(tl.int64) * T
        tl.store(RAW + (base + t[:, None]) * MP + m[None, :], acc, mask=tmask[:, None])
        tl.store(SS + base + t, ss, mask=tmask)

    @triton.jit
    def _proj_bwd_kernel(X, W, DZ, C, PRE, DC, DS_IN, DX, DW, T, D, H, N, M, T_PER_SPLIT, BT: tl.constexpr,
                         BD: tl.constexpr, MP: tl.constexpr, BF16: tl.constexpr, HAS_DS_IN: tl.constexpr):
        """``DX = PRE[t, d // H] * DC[t, d % H] + DZ @ W + C * X (+ DS_IN)`` for one D block over one split of the
        tokens, and the partial ``DW = DZ^T @ X`` of that split. ``DS_IN`` (laid out like ``X``): a gradient of the
        same streams from elsewhere (the output side), added before the one rounding to ``DX``'s dtype."""
        pid_d = tl.program_id(0)
        pid_s = tl.program_id(1)
        d = pid_d * BD + tl.arange(0, BD)
        dmask = d < D
        i = d // H
        k = d % H
        m = tl.arange(0, MP)
        w = tl.load(W + m[:, None] * D + d[None, :], mask=(m < M)[:, None] & dmask[None, :], other=0.0)
        w = w.to(tl.float32)
        accw = tl.zeros([MP, BD], dtype=tl.float32)
        t_lo = pid_s * T_PER_SPLIT
        t_hi = tl.minimum(t_lo + T_PER_SPLIT, T)
        for t0 in range(t_lo, t_hi, BT):
            t = (t0 + tl.arange(0, BT)).to(tl.int64)
            tmask = t < t_hi
            mask2 = tmask[:, None] & dmask[None, :]
            x = tl.load(X + t[:, None] * D + d[None, :], mask=mask2, other=0.0).to(tl.float32)
            dz = tl.load(DZ + t[:, None] * MP + m[None, :], mask=tmask[:, None], other=0.0)
            c = tl.load(C + t, mask=tmask, other=0.0)
            pre = tl.load(PRE + t[:, None] * N + i[None, :], mask=mask2, other=0.0)
            dc = tl.load(DC + t[:, None] * H + k[None, :], mask=mask2, other=0.0).to(tl.float32)
            dx = _dot(dz, w, BF16) + c[:, None] * x + pre * dc
            if HAS_DS_IN:
                dx += tl.load(DS_IN + t[:, None] * D + d[None, :], mask=mask2, other=0.0).to(tl.float32)
            tl.store(DX + t[:, None] * D + d[None, :], dx.to(DX.dtype.element_ty), mask=mask2)
            accw += _dot(tl.trans(dz), x, BF16)
        tl.store(DW + (pid_s.to(tl.int64) * MP + m[:, None]) * D + d[None, :], accw, mask=dmask[None, :])

    @triton.jit
    def _collapse_fwd_kernel(S, PRE, OUT, N, H, NP: tl.constexpr, BH: tl.constexpr):
        """``OUT[t, k] = sum_i PRE[t, i] * S[t, i, k]`` for one token and BH columns."""
        t = tl.program_id(0).to(tl.int64)
        k = tl.program_id(1) * BH + tl.arange(0, BH)
        i = tl.arange(0, NP)
        mask = (i < N)[:, None] & (k < H)[None, :]
        s = tl.load(S + (t * N + i[:, None]) * H + k[None, :], mask=mask, other=0.0).to(tl.float32)
        p = tl.load(PRE + t * N + i, mask=i < N, other=0.0)
        out = tl.sum(p[:, None] * s, axis=0)
        tl.store(OUT + t * H + k, out.to(OUT.dtype.element_ty), mask=k < H)

    @triton.jit
    def _collapse_bwd_kernel(S, DC, DPRE, N, H, NP: tl.constexpr, BH: tl.constexpr):
        """``DPRE[t, i] = sum_k DC[t, k] * S[t, i, k]`` for one token."""
        t = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, NP)
        acc = tl.zeros([NP, BH], dtype=tl.float32)
        for k0 in range(0, H, BH):
            k = k0 + tl.arange(0, BH)
            mask = (i < N)[:, None] & (k < H)[None, :]
            s = tl.load(S + (t * N + i[:, None]) * H + k[None, :], mask=mask, other=0.0).to(tl.float32)
            g = tl.load(DC + t * H + k, mask=k < H, other=0.0).to(tl.float32)
            acc += s * g[None, :]
        tl.store(DPRE + t * N + i, tl.sum(acc, axis=1), mask=i < N)

    @triton.jit
    def _apply_fwd_kernel(Y, S, POST, COMB, OUT, N, H, NP: tl.constexpr, BH: tl.constexpr):
        """``OUT[t, j, k] = POST[t, j] * Y[t, k] + sum_i COMB[t, i, j] * S[t, i, k]`` for one token, BH columns."""
        t = tl.program_id(0).to(tl.int64)
        k = tl.program_id(1) * BH + tl.arange(0, BH)
        i = tl.arange(0, NP)
        kmask = k < H
        nmask = i < N
        mask = nmask[:, None] & kmask[None, :]
        s = tl.load(S + (t * N + i[:, None]) * H + k[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.load(Y + t * H + k, mask=kmask, other=0.0).to(tl.float32)
        comb = tl.load(COMB + t * N * N + i[:, None] * N + i[None, :], mask=nmask[:, None] & nmask[None, :],
                       other=0.0)  # [i, j]
        post = tl.load(POST + t * N + i, mask=nmask, other=0.0)  # [j]
        out = post[:, None] * y[None, :] + tl.sum(comb[:, :, None] * s[:, None, :], axis=0)
        tl.store(OUT + (t * N + i[:, None]) * H + k[None, :], out.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _apply_bwd_kernel(G, Y, S, POST, COMB, DY, DS, DPOST, DCOMB, T, N, H, SPLIT, NP: tl.constexpr,
                          BT: tl.constexpr, BTP: tl.constexpr, BH: tl.constexpr, BF16: tl.constexpr):
        """BT tokens, columns ``[SPLIT * program_id(1), + SPLIT)``, as ``R = BT * NP`` stream rows ``r = (t, i)``
        (``NP`` = n padded to a power of two; padded rows are masked) and every product a tensor-core dot:

        * ``DS [R, BH] = A_comb @ G`` with the block-diagonal ``A_comb[(t, i), (t, j)] = COMB[t, i, j]``;
        * ``DY [BTP, BH] = A_post @ G`` with ``A_post[t, (t, j)] = POST[t, j]`` (``BTP >= BT`` rows, at least 16);
        * ``acc_comb [R, R] += S @ G^T`` and ``acc_post [R, BTP] += G @ Y^T``, whose same-token entries are this
          column range's partial ``DCOMB[t, i, j] = <S_i, G_j>`` and ``DPOST[t, j] = <G_j, Y>`` (``DPOST [T, splits,
          N]``, ``DCOMB [T, splits, N, N]``, summed over the splits by the caller).

        ``BF16`` (G, Y, S bf16): the fp32 coefficients enter as a bf16 high part plus a bf16 low part (relative error
        ~2^-17, below the bf16 rounding of DS / DY) and every product of two bf16 values is exact in the fp32
        accumulators. Otherwise (fp32 streams) the dots run in IEEE fp32. The off-diagonal blocks cost ``BT`` times
        the useful products, which tensor cores absorb: the kernel is bound by its loads and stores."""
        R: tl.constexpr = BT * NP
        pid_t = tl.program_id(0)
        sp = tl.program_id(1)
        n_sp = tl.num_programs(1)
        r = tl.arange(0, R)
        r_tok = r // NP
        r_i = r % NP
        tok = pid_t.to(tl.int64) * BT + r_tok
        rmask = (tok < T) & (r_i < N)
        row = (tok * N + r_i) * H  # first element of stream row (t, i) in G / S / DS
        c_tok = r_tok  # the same (token, stream) numbering along the columns of the coefficient matrices
        c_j = r_i
        same = r_tok[:, None] == c_tok[None, :]
        a_comb = tl.load(COMB + tok[:, None] * N * N + r_i[:, None] * N + c_j[None, :],
                         mask=rmask[:, None] & same & (c_j < N)[None, :], other=0.0)
        u = tl.arange(0, BTP)
        u_tok = pid_t.to(tl.int64) * BT + u
        umask = (u < BT) & (u_tok < T)
        a_post = tl.load(POST + u_tok[:, None] * N + c_j[None, :],
                         mask=umask[:, None] & (u[:, None] == c_tok[None, :]) & (c_j < N)[None, :], other=0.0)
        if BF16:
            comb_hi = a_comb.to(tl.bfloat16)
            comb_lo = (a_comb - comb_hi.to(tl.float32)).to(tl.bfloat16)
            post_hi = a_post.to(tl.bfloat16)
            post_lo = (a_post - post_hi.to(tl.float32)).to(tl.bfloat16)
        acc_comb = tl.zeros([R, R], dtype=tl.float32)
        acc_post = tl.zeros([R, BTP], dtype=tl.float32)
        k_lo = sp * SPLIT
        for k0 in range(0, SPLIT, BH):
            k = k_lo + k0 + tl.arange(0, BH)
            kmask = k < H
            m2 = rmask[:, None] & kmask[None, :]
            g = tl.load(G + row[:, None] + k[None, :], mask=m2, other=0.0)
            s = tl.load(S + row[:, None] + k[None, :], mask=m2, other=0.0)
            y = tl.load(Y + u_tok[:, None] * H + k[None, :], mask=umask[:, None] & kmask[None, :], other=0.0)
            if BF16:
                ds = tl.dot(comb_hi, g) + tl.dot(comb_lo, g)
                dy = tl.dot(post_hi, g) + tl.dot(post_lo, g)
                acc_comb = tl.dot(s, tl.trans(g), acc_comb)
                acc_post = tl.dot(g, tl.trans(y), acc_post)
            else:
                ds = tl.dot(a_comb, g, input_precision="ieee")
                dy = tl.dot(a_post, g, input_precision="ieee")
                acc_comb = tl.dot(s, tl.trans(g), acc_comb, input_precision="ieee")
                acc_post = tl.dot(g, tl.trans(y), acc_post, input_precision="ieee")
            tl.store(DS + row[:, None] + k[None, :], ds.to(DS.dtype.element_ty), mask=m2)
            tl.store(DY + u_tok[:, None] * H + k[None, :], dy.to(DY.dtype.element_ty),
                     mask=umask[:, None] & kmask[None, :])
        part = tok * n_sp + sp
        # DCOMB[t, i, j] = acc_comb[(t, i), (t, j)]: keep the token's own block, sum the row's BT blocks of NP
        d3 = tl.reshape(tl.where(same, acc_comb, 0.0), [R, BT, NP])
        dcomb = tl.sum(d3, axis=1)
        j = tl.arange(0, NP)
        tl.store(DCOMB + (part * N + r_i)[:, None] * N + j[None, :], dcomb, mask=rmask[:, None] & (j < N)[None, :])
        dpost = tl.sum(tl.where(r_tok[:, None] == u[None, :], acc_post, 0.0), axis=1)
        tl.store(DPOST + part * N + r_i, dpost, mask=rmask)


def _np2(n: int, lo: int = 2) -> int:
    return max(lo, triton.next_power_of_2(n))


_PROJ_BT, _PROJ_BD = 32, 128
_COL_BH = 1024
# Tiles of the apply-output backward: stream rows (tokens x padded streams) and columns per step, warps, and
# programs per SM its grid aims at (each token's columns are split over programs until the grid has that many; each
# split adds a partial d_post / d_comb). The whole-row, one-token-per-program kernel it replaced (three-dimensional
# register tiles) ran at ~580 GB/s on the H200: 0.77 ms a call at 4K tokens.
APPLY_BWD_ROWS = 64
APPLY_BWD_COLUMNS = 64
APPLY_BWD_WARPS = 4
APPLY_BWD_PROGRAMS_PER_SM = 4
# Programs per SM of the projection forward's grid (token blocks x D splits; each split adds a partial product).
PROJ_FWD_PROGRAMS_PER_SM = 2
# Programs per SM of the projection backward's grid (D blocks x token splits; each split adds a partial d_fn), its
# tokens per step and warps.
PROJ_BWD_PROGRAMS_PER_SM = 16
PROJ_BWD_TOKENS = 32
PROJ_BWD_WARPS = 4


def _proj_fwd(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [T, D]``, ``fn [M, D]`` -> fp32 ``(mixes [T, M], rstd [T])``."""
    T, D = x.shape
    M = fn.shape[0]
    MP = _np2(M, 16)
    n_t = triton.cdiv(T, _PROJ_BT)
    splits = max(1, min(triton.cdiv(D, _PROJ_BD), triton.cdiv(PROJ_FWD_PROGRAMS_PER_SM * _NUM_SMS, n_t)))
    per = triton.cdiv(triton.cdiv(D, splits), _PROJ_BD) * _PROJ_BD
    splits = triton.cdiv(D, per)
    raw = torch.empty(splits, T, MP, device=x.device, dtype=torch.float32)
    ss = torch.empty(splits, T, device=x.device, dtype=torch.float32)
    bf16 = x.dtype == fn.dtype == torch.bfloat16
    _proj_fwd_kernel[(n_t, splits)](x, fn, raw, ss, T, D, M, per, BT=_PROJ_BT, BD=_PROJ_BD, MP=MP, BF16=bf16,
                                    num_warps=4)
    rstd = torch.rsqrt(ss.sum(0) / D + norm_eps)
    mixes = raw.sum(0)[:, :M] * rstd[:, None]
    return mixes, rstd


def _proj_bwd(x, fn, dz, c, pre, dc, n, h, ds_in=None):
    """See ``_proj_bwd_kernel``; returns ``(d_x [T, D] in x's dtype, d_fn [M, D] fp32)``; ``ds_in [T, D]`` (or
    None) is added to ``d_x``."""
    T, D = x.shape
    M = fn.shape[0]
    MP = dz.shape[1]
    n_d = triton.cdiv(D, _PROJ_BD)
    bt = PROJ_BWD_TOKENS
    splits = max(1, min(triton.cdiv(T, bt), triton.cdiv(PROJ_BWD_PROGRAMS_PER_SM * _NUM_SMS, n_d)))
    per = triton.cdiv(triton.cdiv(T, splits), bt) * bt
    splits = triton.cdiv(T, per)
    dx = torch.empty_like(x)
    dw = torch.empty(splits, MP, D, device=x.device, dtype=torch.float32)
    bf16 = x.dtype == fn.dtype == torch.bfloat16
    has_ds_in = ds_in is not None
    _proj_bwd_kernel[(n_d, splits)](x, fn, dz, c, pre, dc, ds_in.contiguous() if has_ds_in else dx, dx, dw, T, D, h,
                                    n, M, per, BT=bt, BD=_PROJ_BD, MP=MP, BF16=bf16, HAS_DS_IN=has_ds_in,
                                    num_warps=PROJ_BWD_WARPS)
    return dx, dw.sum(0)[:M]


class _HyperConnectionFunction(torch.autograd.Function):
    """``(streams [T, n, h], fn, base, scale) -> (post [T, n], comb [T, n, n], collapsed [T, h])``, with
    ``pass_streams`` also a view of ``streams``: whatever uses that view (the output side) hands its streams
    gradient to this backward, whose projection kernel adds it to its own instead of autograd adding the two."""

    @staticmethod
    def forward(ctx, streams, fn, base, scale, weights_fn, norm_eps, pass_streams=False):
        T, n, h = streams.shape
        x = streams.view(T, n * h)
        mixes, rstd = _proj_fwd(x, fn, norm_eps)
        with torch.no_grad():
            pre, post, comb = weights_fn(mixes, base, scale)
        pre = pre.contiguous()
        collapsed = torch.empty(T, h, device=streams.device, dtype=streams.dtype)
        _collapse_fwd_kernel[(T, triton.cdiv(h, _COL_BH))](streams, pre, collapsed, n, h, NP=_np2(n),
                                                          BH=_COL_BH, num_warps=4)
        ctx.save_for_backward(streams, fn, base, scale, mixes, rstd)
        ctx.weights_fn = weights_fn
        if pass_streams:
            return post, comb, collapsed, streams.view_as(streams)
        return post, comb, collapsed

    @staticmethod
    def backward(ctx, d_post, d_comb, d_collapsed, d_passed=None):
        streams, fn, base, scale, mixes, rstd = ctx.saved_tensors
        T, n, h = streams.shape
        if d_collapsed is None:
            d_collapsed = torch.zeros(T, h, device=streams.device, dtype=streams.dtype)
        d_collapsed = d_collapsed.contiguous()
        d_pre = torch.empty(T, n, device=streams.device, dtype=torch.float32)
        _collapse_bwd_kernel[(T,)](streams, d_collapsed, d_pre, n, h, NP=_np2(n), BH=_COL_BH // _np2(n),
                                   num_warps=4)
        with torch.enable_grad():
            m = mixes.detach().requires_grad_(True)
            b = base.detach().requires_grad_(ctx.needs_input_grad[2])
            s = scale.detach().requires_grad_(ctx.needs_input_grad[3])
            pre, post, comb = ctx.weights_fn(m, b, s)
            outs, grads = [pre], [d_pre]
            for o, g in ((post, d_post), (comb, d_comb)):
                if g is not None:
                    outs.append(o)
                    grads.append(g)
            wrt = [m] + [p for p in (b, s) if p.requires_grad]
            got = list(torch.autograd.grad(outs, wrt, grads, allow_unused=True))
        g_mixes = got.pop(0)
        d_base = got.pop(0) if b.requires_grad else None
        d_scale = got.pop(0) if s.requires_grad else None
        if d_base is not None:
            d_base = d_base.to(base.dtype)
        if d_scale is not None:
            d_scale = d_scale.to(scale.dtype)
        M = mixes.shape[1]
        MP = _np2(M, 16)
        D = n * h
        dz = torch.zeros(T, MP, device=streams.device, dtype=torch.float32)
        dz[:, :M] = g_mixes * rstd[:, None]
        c = -(rstd * rstd / D) * (g_mixes * mixes).sum(-1)
        dx, d_fn = _proj_bwd(streams.view(T, D), fn, dz, c.contiguous(), pre.detach().contiguous(), d_collapsed,
                             n, h, None if d_passed is None else d_passed.reshape(T, D))
        d_streams = dx.view(T, n, h) if ctx.needs_input_grad[0] else None
        d_fn = d_fn.to(fn.dtype) if ctx.needs_input_grad[1] else None
        return d_streams, d_fn, d_base, d_scale, None, None, None


class _ApplyOutputFunction(torch.autograd.Function):
    """``(block_out [T, h], streams [T, n, h], post [T, n], comb [T, n, n]) -> new streams [T, n, h]``."""

    @staticmethod
    def forward(ctx, block_out, streams, post, comb):
        T, n, h = streams.shape
        out = torch.empty_like(streams)
        _apply_fwd_kernel[(T, triton.cdiv(h, _COL_BH))](block_out, streams, post, comb, out, n, h, NP=_np2(n),
                                                       BH=_COL_BH, num_warps=4)
        ctx.save_for_backward(block_out, streams, post, comb)
        return out

    @staticmethod
    def backward(ctx, grad):
        block_out, streams, post, comb = ctx.saved_tensors
        T, n, h = streams.shape
        grad = grad.contiguous()
        d_y = torch.empty_like(block_out)
        d_s = torch.empty_like(streams)
        np2 = _np2(n)
        bt = max(1, APPLY_BWD_ROWS // np2)
        btp = max(16, bt)
        bh = APPLY_BWD_COLUMNS
        n_t = triton.cdiv(T, bt)
        n_sp = max(1, min(triton.cdiv(h, bh), triton.cdiv(APPLY_BWD_PROGRAMS_PER_SM * _NUM_SMS, max(n_t, 1))))
        split = triton.cdiv(triton.cdiv(h, n_sp), bh) * bh
        n_sp = triton.cdiv(h, split)
        d_post = torch.empty(T, n_sp, n, device=grad.device, dtype=torch.float32)
        d_comb = torch.empty(T, n_sp, n, n, device=grad.device, dtype=torch.float32)
        if T:
            _apply_bwd_kernel[(n_t, n_sp)](grad, block_out, streams, post, comb, d_y, d_s, d_post, d_comb, T, n, h,
                                           split, NP=np2, BT=bt, BTP=btp, BH=bh,
                                           BF16=streams.dtype == torch.bfloat16, num_warps=APPLY_BWD_WARPS)
        d_post, d_comb = (d_post[:, 0], d_comb[:, 0]) if n_sp == 1 else (d_post.sum(1), d_comb.sum(1))
        return d_y, d_s, d_post.to(post.dtype), d_comb.to(comb.dtype)


# ----------------------------------------------------------------------------------------------- entry points
def hyper_connection(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     weights_fn: Callable, norm_eps: float, pass_streams: bool = False):
    """Fused mHC input side on ``streams [..., n, h]``: returns ``(post [..., n], comb [..., n, n], collapsed
    [..., h])`` like ``HyperConnection.forward``, and with ``pass_streams`` the streams again (a view through
    which the output side's streams gradient joins this backward's kernel; see ``_HyperConnectionFunction``).
    ``weights_fn(mixes [T, M] fp32, base, scale) -> (pre, post, comb)`` is the module's own map from the mixes to
    the weights (replayed under autograd in backward)."""
    if not HAVE_TRITON:
        raise RuntimeError("the fused mHC kernels need triton")
    lead = streams.shape[:-2]
    n, h = streams.shape[-2:]
    flat = streams.reshape(-1, n, h).contiguous()
    outs = _HyperConnectionFunction.apply(flat, fn.contiguous(), base, scale, weights_fn, float(norm_eps),
                                          bool(pass_streams))
    post, comb, collapsed = outs[0].view(*lead, n), outs[1].view(*lead, n, n), outs[2].view(*lead, h)
    if pass_streams:
        return post, comb, collapsed, outs[3].view(streams.shape)
    return post, comb, collapsed


def apply_output(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
                 comb: torch.Tensor) -> torch.Tensor:
    """Fused ``post[.., j] * block_out + sum_i comb[.., i, j] * streams[.., i, :]`` on ``streams [..., n, h]``
    (fp32 arithmetic, one rounding to the streams' dtype)."""
    if not HAVE_TRITON:
        raise RuntimeError("the fused mHC kernels need triton")
    n, h = streams.shape[-2:]
    if block_out.dtype != streams.dtype:
        block_out = block_out.to(streams.dtype)
    out = _ApplyOutputFunction.apply(block_out.reshape(-1, h).contiguous(), streams.reshape(-1, n, h).contiguous(),
                                     post.reshape(-1, n).float().contiguous(),
                                     comb.reshape(-1, n, n).float().contiguous())
    return out.view(streams.shape)
