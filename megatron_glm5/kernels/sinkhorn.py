"""mHC weights as Triton kernels: the Sinkhorn-Knopp normalisation alone (:func:`sinkhorn`; the reference is
:func:`sinkhorn_reference`, HF's op order) and the whole map from the mixes to the weights
(:func:`mhc_weights`; the reference is ``HyperConnection.weights_from_mixes`` on its PyTorch path), one kernel forward
and one backward each.

Sinkhorn: for every token the ``[n, n]`` matrix goes through ``K = 2 * iters - 1`` normalisations (a column one,
then ``iters - 1`` times row + column), each ``y = x / (sum_axis(x) + eps)``. In plain PyTorch that is ``~6 K`` tiny
kernel launches forward and more backward per mHC site; here one program handles ``BLOCK_T`` tokens entirely in
registers.

Backward of one step (``S = sum_axis(x) + eps``, ``y = x / S``): ``dx = (dy - sum_axis(dy * y)) / S``. The backward
kernels replay the ``K`` steps from the saved input, storing each step's input in a per-program scratch (a
persistent grid of at most ``BWD_PROGRAMS_PER_SM`` programs per SM, so the scratch is ``K x BLOCK_T x n^2`` fp32 per
program whatever the token count), then walk the steps backwards loading them: ``O(K)`` work per token.
(Recomputing each step's input from the first instead was ``O(K^2)``: 165 us per call at 4K tokens on the H200.)

mHC weights (``M = (2 + n) n`` mixes per token, split ``[n | n | n n]``; ``base [M]``, ``scale [3]``)::

    pre  = sigmoid(mixes_pre * scale[0] + base_pre) + hc_eps                       [T, n]
    post = 2 sigmoid(mixes_post * scale[1] + base_post)                            [T, n]
    comb = sinkhorn(softmax_j(mixes_comb * scale[2] + base_comb) + hc_eps)         [T, n, n]

In PyTorch that is ~24 launches forward per site (and a replay plus ~50 backward); the fused backward writes
``d_mixes [T, M]`` and per-program partial sums of ``d_base`` / ``d_scale`` (``[programs, M + 3]``, summed after:
deterministic, no atomics). Values and gradients match the references to fp32 rounding.

Layouts: fp32, contiguous; ``comb [T, n, n]``, ``mixes [T, M]`` (leading dims are flattened by the entry points).
"""

from __future__ import annotations

from typing import Tuple

import torch

from megatron_glm5.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["sinkhorn", "sinkhorn_reference", "mhc_weights", "HAVE_TRITON"]

BLOCK_T = 64


def sinkhorn_reference(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """HF's Sinkhorn-Knopp on the last two dims of ``comb [..., n, n]`` (same shape back): one column
    normalisation, then ``iters - 1`` times row + column, ``eps`` in every denominator (HF's op order)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


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
    def _tile(t0, T, N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr):
        """Tokens ``t0 .. t0 + BT``: ``(t [BT] int64, offsets [BT, NP, NP] of their [N, N] matrices, mask)``."""
        t = (t0 + tl.arange(0, BT)).to(tl.int64)
        i = tl.arange(0, NP)
        offs = t[:, None, None] * (N * N) + i[None, :, None] * N + i[None, None, :]
        mask = (t < T)[:, None, None] & (i < N)[None, :, None] & (i < N)[None, None, :]
        return t, offs, mask

    @triton.jit
    def _sinkhorn_steps(x, eps, ITERS: tl.constexpr):
        x = _normalize(x, False, eps)
        for _ in range(ITERS - 1):
            x = _normalize(x, True, eps)
            x = _normalize(x, False, eps)
        return x

    @triton.jit
    def _sinkhorn_steps_bwd(x, g, mask, scratch, eps, ITERS: tl.constexpr, STEP: tl.constexpr):
        """Gradient of :func:`_sinkhorn_steps` at input ``x`` for output gradient ``g``: the steps again, each
        step's input stored at ``scratch + k STEP`` (this program's slots, same layout as ``x``), then backwards."""
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
        tl.debug_barrier()  # the caller's next token block reuses the scratch
        return g

    @triton.jit
    def _scratch_slots(SCRATCH, ITERS: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr):
        """This program's scratch pointers ``[BT, NP, NP]`` (slot 0) and the slot stride."""
        STEP: tl.constexpr = BT * NP * NP
        b = tl.arange(0, BT)
        i = tl.arange(0, NP)
        local = b[:, None, None] * (NP * NP) + i[None, :, None] * NP + i[None, None, :]
        return SCRATCH + tl.program_id(0).to(tl.int64) * ((2 * ITERS - 1) * STEP) + local

    @triton.jit
    def _sinkhorn_fwd_kernel(X, Y, T, eps, ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
                             BT: tl.constexpr):
        _, offs, mask = _tile(tl.program_id(0) * BT, T, N, NP, BT)
        x = tl.load(X + offs, mask=mask, other=0.0)
        tl.store(Y + offs, _sinkhorn_steps(x, eps, ITERS), mask=mask)

    @triton.jit
    def _sinkhorn_bwd_kernel(X, DY, DX, SCRATCH, T, eps, ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr,
                             BT: tl.constexpr):
        """A persistent program per token block (see :func:`_sinkhorn_steps_bwd`)."""
        scratch = _scratch_slots(SCRATCH, ITERS, NP, BT)
        for t0 in range(tl.program_id(0) * BT, T, tl.num_programs(0) * BT):
            _, offs, mask = _tile(t0, T, N, NP, BT)
            x = tl.load(X + offs, mask=mask, other=0.0)
            g = tl.load(DY + offs, mask=mask, other=0.0)
            g = _sinkhorn_steps_bwd(x, g, mask, scratch, eps, ITERS, BT * NP * NP)
            tl.store(DX + offs, g, mask=mask)

    @triton.jit
    def _gate_inputs(MIX, BASE, t, T, N: tl.constexpr, NP: tl.constexpr, FIRST: tl.constexpr):
        """``(mixes [BT, NP], base [NP], mask [BT, NP])`` of the gate whose mixes start at column ``FIRST``."""
        i = tl.arange(0, NP)
        mask = (t < T)[:, None] & (i < N)[None, :]
        m = tl.load(MIX + t[:, None] * ((2 + N) * N) + FIRST + i[None, :], mask=mask, other=0.0)
        b = tl.load(BASE + FIRST + i, mask=i < N, other=0.0)
        return m, b, mask

    @triton.jit
    def _comb_inputs(MIX, BASE, t, mask, N: tl.constexpr, NP: tl.constexpr):
        """``(mixes [BT, NP, NP], base [NP, NP])`` of the comb block (columns ``2 N + i N + j``)."""
        i = tl.arange(0, NP)
        col = 2 * N + i[:, None] * N + i[None, :]
        m = tl.load(MIX + t[:, None, None] * ((2 + N) * N) + col[None, :, :], mask=mask, other=0.0)
        b = tl.load(BASE + col, mask=(i < N)[:, None] & (i < N)[None, :], other=0.0)
        return m, b

    @triton.jit
    def _row_softmax(z, mask):
        """Softmax over the last axis of ``[BT, NP, NP]`` on the unmasked entries (0 elsewhere)."""
        z = tl.where(mask, z, -1e30)
        e = tl.exp(z - tl.max(z, axis=2)[:, :, None])
        return tl.where(mask, e / tl.sum(e, axis=2)[:, :, None], 0.0)

    @triton.jit
    def _weights_fwd_kernel(MIX, BASE, SCALE, PRE, POST, COMB, T, hc_eps, ITERS: tl.constexpr, N: tl.constexpr,
                            NP: tl.constexpr, BT: tl.constexpr):
        t, offs, mask = _tile(tl.program_id(0) * BT, T, N, NP, BT)
        i = tl.arange(0, NP)
        m, b, gmask = _gate_inputs(MIX, BASE, t, T, N, NP, 0)
        pre = tl.sigmoid(m * tl.load(SCALE) + b[None, :]) + hc_eps
        tl.store(PRE + t[:, None] * N + i[None, :], pre, mask=gmask)
        m, b, gmask = _gate_inputs(MIX, BASE, t, T, N, NP, N)
        post = 2.0 * tl.sigmoid(m * tl.load(SCALE + 1) + b[None, :])
        tl.store(POST + t[:, None] * N + i[None, :], post, mask=gmask)
        m, b = _comb_inputs(MIX, BASE, t, mask, N, NP)
        p = _row_softmax(m * tl.load(SCALE + 2) + b[None, :, :], mask)
        x = tl.where(mask, p + hc_eps, 0.0)
        tl.store(COMB + offs, _sinkhorn_steps(x, hc_eps, ITERS), mask=mask)

    @triton.jit
    def _weights_bwd_kernel(MIX, BASE, SCALE, DPRE, DPOST, DCOMB, DMIX, PART, SCRATCH, T, hc_eps,
                            ITERS: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr):
        """Persistent programs over token blocks: ``DMIX [T, M]`` and this program's partial ``d_base`` / ``d_scale``
        (``PART[program] = [d_base (M) | d_scale (3)]``)."""
        M: tl.constexpr = (2 + N) * N
        scratch = _scratch_slots(SCRATCH, ITERS, NP, BT)
        i = tl.arange(0, NP)
        s_pre = tl.load(SCALE)
        s_post = tl.load(SCALE + 1)
        s_comb = tl.load(SCALE + 2)
        acc_pre = tl.zeros([NP], dtype=tl.float32)
        acc_post = tl.zeros([NP], dtype=tl.float32)
        acc_comb = tl.zeros([NP, NP], dtype=tl.float32)
        acc_s0 = tl.zeros([1], dtype=tl.float32)
        acc_s1 = tl.zeros([1], dtype=tl.float32)
        acc_s2 = tl.zeros([1], dtype=tl.float32)
        for t0 in range(tl.program_id(0) * BT, T, tl.num_programs(0) * BT):
            t, offs, mask = _tile(t0, T, N, NP, BT)
            gofs = t[:, None] * N + i[None, :]
            # pre = sigmoid(a) + eps: da = d_pre sg (1 - sg)
            m, b, gmask = _gate_inputs(MIX, BASE, t, T, N, NP, 0)
            sg = tl.sigmoid(m * s_pre + b[None, :])
            da = tl.where(gmask, tl.load(DPRE + gofs, mask=gmask, other=0.0) * sg * (1.0 - sg), 0.0)
            tl.store(DMIX + t[:, None] * M + i[None, :], da * s_pre, mask=gmask)
            acc_pre += tl.sum(da, axis=0)
            acc_s0 += tl.sum(tl.sum(da * m, axis=1), axis=0)
            # post = 2 sigmoid(a)
            m, b, gmask = _gate_inputs(MIX, BASE, t, T, N, NP, N)
            sg = tl.sigmoid(m * s_post + b[None, :])
            da = tl.where(gmask, tl.load(DPOST + gofs, mask=gmask, other=0.0) * 2.0 * sg * (1.0 - sg), 0.0)
            tl.store(DMIX + t[:, None] * M + N + i[None, :], da * s_post, mask=gmask)
            acc_post += tl.sum(da, axis=0)
            acc_s1 += tl.sum(tl.sum(da * m, axis=1), axis=0)
            # comb = sinkhorn(softmax(a) + eps)
            m, b = _comb_inputs(MIX, BASE, t, mask, N, NP)
            p = _row_softmax(m * s_comb + b[None, :, :], mask)
            g = tl.load(DCOMB + offs, mask=mask, other=0.0)
            g = _sinkhorn_steps_bwd(tl.where(mask, p + hc_eps, 0.0), g, mask, scratch, hc_eps, ITERS,
                                    BT * NP * NP)
            da = tl.where(mask, p * (g - tl.sum(g * p, axis=2)[:, :, None]), 0.0)
            col = 2 * N + i[:, None] * N + i[None, :]
            tl.store(DMIX + t[:, None, None] * M + col[None, :, :], da * s_comb, mask=mask)
            acc_comb += tl.sum(da, axis=0)
            acc_s2 += tl.sum(tl.sum(tl.sum(da * m, axis=2), axis=1), axis=0)
        part = PART + tl.program_id(0).to(tl.int64) * (M + 3)
        tl.store(part + i, acc_pre, mask=i < N)
        tl.store(part + N + i, acc_post, mask=i < N)
        tl.store(part + 2 * N + i[:, None] * N + i[None, :], acc_comb, mask=(i < N)[:, None] & (i < N)[None, :])
        one = tl.arange(0, 1)
        tl.store(part + M + one, acc_s0)
        tl.store(part + M + 1 + one, acc_s1)
        tl.store(part + M + 2 + one, acc_s2)


_NUM_SMS = 132  # only sizes the backward's persistent grid; any value is correct
BWD_PROGRAMS_PER_SM = 4


def _np2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


def _bwd_grid(T: int, n: int, iters: int, device) -> Tuple[int, torch.Tensor]:
    """The backward's persistent program count and its scratch ``[programs, K, BLOCK_T, NP, NP]`` fp32."""
    np2 = _np2(n)
    programs = max(1, min(triton.cdiv(T, BLOCK_T), BWD_PROGRAMS_PER_SM * _NUM_SMS))
    return programs, torch.empty(programs, 2 * iters - 1, BLOCK_T, np2, np2, device=device, dtype=torch.float32)


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
        T = x.numel() // (n * n)
        if T:
            programs, scratch = _bwd_grid(T, n, ctx.iters, x.device)
            _sinkhorn_bwd_kernel[(programs,)](x, dy, dx, scratch, T, ctx.eps, ITERS=ctx.iters, N=n, NP=_np2(n),
                                              BT=BLOCK_T, num_warps=4)
        return dx, None, None


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Fused Sinkhorn on ``comb [..., n, n]`` fp32 (CUDA + triton); saves only its input for backward."""
    if not HAVE_TRITON:
        raise RuntimeError("the fused Sinkhorn needs triton")
    if comb.dtype != torch.float32:
        raise ValueError(f"the fused Sinkhorn runs in fp32, got {comb.dtype}")
    return _SinkhornFunction.apply(comb, int(iters), float(eps))


class _MhcWeightsFunction(torch.autograd.Function):
    """``(mixes [T, M], base [M], scale [3]) -> (pre [T, n], post [T, n], comb [T, n, n])``, fp32."""

    @staticmethod
    def forward(ctx, mixes, base, scale, n, iters, hc_eps):
        T = mixes.shape[0]
        pre = mixes.new_empty(T, n)
        post = mixes.new_empty(T, n)
        comb = mixes.new_empty(T, n, n)
        if T:
            _weights_fwd_kernel[(triton.cdiv(T, BLOCK_T),)](mixes, base, scale, pre, post, comb, T, hc_eps,
                                                            ITERS=iters, N=n, NP=_np2(n), BT=BLOCK_T, num_warps=4)
        ctx.save_for_backward(mixes, base, scale)
        ctx.n, ctx.iters, ctx.hc_eps = n, iters, hc_eps
        return pre, post, comb

    @staticmethod
    def backward(ctx, d_pre, d_post, d_comb):
        mixes, base, scale = ctx.saved_tensors
        n, T, M = ctx.n, mixes.shape[0], mixes.shape[1]
        grads = []
        for g, shape in ((d_pre, (T, n)), (d_post, (T, n)), (d_comb, (T, n, n))):
            grads.append(mixes.new_zeros(shape) if g is None else g.contiguous().float())
        d_mixes = torch.empty_like(mixes)
        if not T:
            return d_mixes, torch.zeros_like(base), torch.zeros_like(scale), None, None, None
        programs, scratch = _bwd_grid(T, n, ctx.iters, mixes.device)
        part = mixes.new_empty(programs, M + 3)
        _weights_bwd_kernel[(programs,)](mixes, base, scale, *grads, d_mixes, part, scratch, T, ctx.hc_eps,
                                         ITERS=ctx.iters, N=n, NP=_np2(n), BT=BLOCK_T, num_warps=4)
        part = part.sum(0)
        return d_mixes, part[:M].to(base.dtype), part[M:].to(scale.dtype), None, None, None


def mhc_weights(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
                hc_eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused ``HyperConnection.weights_from_mixes`` (see the module docstring) on fp32 ``mixes [..., (2 + n) n]``,
    ``base [(2 + n) n]``, ``scale [3]`` (CUDA + triton): ``(pre [..., n], post [..., n], comb [..., n, n])``."""
    if not HAVE_TRITON:
        raise RuntimeError("the fused mHC weights need triton")
    M = (2 + n) * n
    if mixes.shape[-1] != M or base.shape != (M,) or scale.shape != (3,):
        raise ValueError(f"mHC weights for n={n}: mixes [..., {M}], base [{M}], scale [3]; got "
                         f"{tuple(mixes.shape)}, {tuple(base.shape)}, {tuple(scale.shape)}")
    lead = mixes.shape[:-1]
    pre, post, comb = _MhcWeightsFunction.apply(mixes.reshape(-1, M).float().contiguous(), base.float().contiguous(),
                                                scale.float().contiguous(), int(n), int(iters), float(hc_eps))
    return pre.view(*lead, n), post.view(*lead, n), comb.view(*lead, n, n)
