"""The KPool indexer's scores at each query's selected pools, forward and backward, as Triton kernels.

The sparse indexer loss (:mod:`megatron_glm5.models.indexer_loss`) needs the indexer's logits only at the pools the
query selected, with gradients into the indexer's queries, pool keys and head weights::

    q          [b, s, H, D]   index queries (fp32 or 16-bit; used as fp32)
    pool_keys  [b, P, D]      fp32 pooled keys
    weights    [b, s, H]      fp32 per-head weights
    sel        [b, s, n]      int pool numbers per query, -1 = unused slot
    logits[b, i, j] = sum_h weights[b, i, h] * relu(scale * <q[b, i, h], pool_keys[b, sel[b, i, j]]>)   [b, s, n]

(the math of :func:`~megatron_glm5.kernels.indexer_scores.indexer_scores_reference` at the selected pools; an
unused slot has logit 0 and passes no gradient). Reference: :func:`selected_pool_scores_reference` (the loss's
PyTorch path in :mod:`megatron_glm5.models.indexer_loss`) and its autograd. In PyTorch that is a gather
of ``[s, n, D]`` fp32 keys, two batched products over ``[s, H, n]`` and, backward, a scatter-add of ``[s, n, D]``
into ``pool_keys``.

Here one program owns one query (``grid = b * s``): its ``q [H, D]`` and weights stay in registers, the selected
pools' keys are gathered ``BLOCK_N`` at a time (``gather_selected`` of :mod:`~megatron_glm5.kernels.triton_support`;
the whole ``pool_keys`` is ~2 MB at 16K tokens, so the gathers hit L2), and only ``[b, s, n]`` is written.

* forward: ``S = q keys^T [H, BLOCK_N]``, ``logits = sum_h w_h relu(scale S)``.
* backward (``dlogits [b, s, n]``): ``S`` recomputed, ``G = (scale S > 0) * scale * w_h * dlogits [H, BLOCK_N]``;
  ``dq = G keys`` and ``dweights = sum_j relu(scale S) dlogits`` accumulate in registers and are written once;
  ``dkeys = G^T q [BLOCK_N, D]`` is added into an fp32 ``[b, P, D]`` buffer with atomics (a pool is selected by
  many queries; within one query the pools are distinct). The atomics make ``dpool_keys`` non-deterministic in the
  last bits (the order of fp32 additions), as the PyTorch gather's backward (``scatter_add``) on CUDA is.

Precision (:func:`_precision`): on CUDA the scores as three TF32 tensor-core products (``tf32x3``, ~5e-7
relative), the backward's ``dq`` / ``dkeys`` products as one (``tf32``); exact (``ieee``) on Triton's interpreter.
Against an exact fp32 computation the logits and ``dweights`` agree to ~5e-7 and ``dq`` / ``dkeys`` to ~1e-3 of
their norm: a score within rounding of 0 takes the other side of the ReLU (a few dozen of the tens of millions of
(query, head, pool) terms of ``tests/test_selected_pool_scores.py``'s GPU test), which moves a whole term.
Tiling measured on an H100 at 16K queries (backward 6.9 ms; 32 pools a step, 4 warps, 16 programs per SM).

Tuning left open: ``BLOCK_N`` / warps (:data:`SELECTED_POOL_SCORES_CONFIG`); several queries per program sharing the
gathered keys of pools they both selected (neighbouring queries select mostly the same pools, but in score order, not
aligned); less contention in the atomics (programs of neighbouring queries run together and add into mostly the same
pools in about the same order: a slot loop starting at an offset of each program's own would spread them); fewer
atomics by reducing ``dkeys`` per program over a block of queries, or a pool-major pass (queries grouped by the pool
they selected: a sort of ``sel``) that writes each pool's gradient once, deterministically (it re-reads a query's ``q
[H, D]`` once per pool it selected, ``H`` times the traffic of the atomics' ``[D]`` rows, so it needs the blocking
too).
"""

from __future__ import annotations

import torch

from megatron_glm5.kernels.triton_support import HAVE_TRITON, block_h, tl, triton

__all__ = ["SELECTED_POOL_SCORES_CONFIG", "selected_pool_scores", "selected_pool_scores_reference", "supported"]

SELECTED_POOL_SCORES_CONFIG = dict(BLOCK_N=64, num_warps=4, bwd_BLOCK_N=32, bwd_num_warps=4, bwd_programs_per_sm=16)
"""Tiling: selected pools per step and warps, forward and backward (the backward holds ``q``, ``dq``
``[H, D]`` and a ``[BLOCK_N, D]`` key tile and its gradient)."""


def selected_pool_scores_reference(q: torch.Tensor, pool_keys: torch.Tensor, weights: torch.Tensor, pools: torch.Tensor,
                                    scale: float) -> torch.Tensor:
    """Indexer scores of per-query pool lists: ``q [b, c, H, D]``, ``pool_keys [b, P, D]``, ``weights [b, c, H]``,
    ``pools [b, c, n]`` (valid pool numbers) -> ``[b, c, n]`` fp32 (the math of ``indexer_scores_reference``)."""
    b, c, n = pools.shape
    keys = torch.gather(pool_keys.float(), 1, pools.reshape(b, c * n, 1).expand(-1, -1, pool_keys.shape[-1]))
    keys = keys.view(b, c, n, -1)                                                    # [b, c, n, D]
    per_head = torch.relu(torch.einsum("bchd,bcnd->bchn", q.float(), keys) * scale)  # [b, c, H, n]
    return torch.einsum("bch,bchn->bcn", weights.float(), per_head)


def supported(head_dim: int) -> bool:
    """Whether the kernels take this index-head width ``D``: a power of two ``>= 16`` (``tl.arange`` and the
    smallest matrix-product tile). Otherwise the PyTorch code of the loss runs."""
    return HAVE_TRITON and head_dim >= 16 and not head_dim & (head_dim - 1)


if HAVE_TRITON:
    from megatron_glm5.kernels.triton_support import gather_selected, program_query

    @triton.jit
    def _selected_pool_scores_fwd_kernel(Q, K, W, SEL, OUT, s, P, n, H, scale, stride_qt, stride_qh,
                                         D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                                         PREC: tl.constexpr):
        """Program ``t`` (query ``t % s`` of batch row ``t // s``): ``OUT[t, :n]``."""
        t, offs_h, offs_d, offs_nb, h_ok, q = program_query(Q, tl.program_id(0).to(tl.int64), 0, stride_qt,
                                                             stride_qh, H, D, BLOCK_H, BLOCK_N)
        q = q.to(tl.float32)                                                              # [BLOCK_H, D]
        w = tl.load(W + t * H + offs_h, mask=h_ok, other=0.0)                             # [BLOCK_H]
        keys_row = K + (t // s) * P * D
        for n0 in range(0, n, BLOCK_N):
            _, _, keys = gather_selected(SEL, keys_row, t, n, D, n0, n, offs_nb, offs_d)  # [BLOCK_N, D]
            scores = tl.dot(q, tl.trans(keys), input_precision=PREC) * scale              # [BLOCK_H, BLOCK_N]
            logits = tl.sum(w[:, None] * tl.maximum(scores, 0.0), 0)
            cols = n0 + offs_nb
            tl.store(OUT + t * n + cols, logits, mask=cols < n)

    @triton.jit
    def _selected_pool_scores_bwd_kernel(Q, K, W, SEL, DOUT, DQ, DK, DW, SCRATCH, T, s, P, n, H, scale, stride_qt,
                                         stride_qh, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                                         PREC: tl.constexpr, GRAD_PREC: tl.constexpr):
        """Persistent: program ``pid`` takes queries ``pid, pid + num_programs, ...`` of the ``T`` in all; for each,
        ``DQ[t]`` and ``DW[t]`` are written and ``DK[t // s, sel[t, j]]`` is added to (fp32 atomics). ``G`` (built
        from the recomputed scores, an operand of both products) passes through this program's ``SCRATCH``
        ``[BLOCK_H, BLOCK_N]``: on sm_90 the Triton of torch 2.11 gives wrong products when a matrix-product result
        is an operand directly (as ``sparse_mla``'s dkv kernel notes); loaded back it has a plain blocked layout."""
        pid = tl.program_id(0)
        scr = SCRATCH + pid.to(tl.int64) * (BLOCK_H * BLOCK_N)
        offs_s = tl.arange(0, BLOCK_H)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        for work in range(pid, T, tl.num_programs(0)):
            t, offs_h, offs_d, offs_nb, h_ok, q = program_query(Q, tl.cast(work, tl.int64), 0, stride_qt, stride_qh, H,
                                                                 D, BLOCK_H, BLOCK_N)
            q = q.to(tl.float32)
            w = tl.load(W + t * H + offs_h, mask=h_ok, other=0.0)
            keys_row = K + (t // s) * P * D
            dkeys_row = DK + (t // s) * P * D
            dq = tl.zeros([BLOCK_H, D], tl.float32)
            dw = tl.zeros([BLOCK_H], tl.float32)
            for n0 in range(0, n, BLOCK_N):
                rows, ok, keys = gather_selected(SEL, keys_row, t, n, D, n0, n, offs_nb, offs_d)
                cols = n0 + offs_nb
                dl = tl.load(DOUT + t * n + cols, mask=ok, other=0.0)                        # [BLOCK_N]
                scores = tl.dot(q, tl.trans(keys), input_precision=PREC) * scale
                dw += tl.sum(tl.maximum(scores, 0.0) * dl[None, :], 1)
                g = tl.where(scores > 0.0, (w * scale)[:, None] * dl[None, :], 0.0)          # [BLOCK_H, BLOCK_N]
                tl.store(scr + offs_s, g)
                tl.debug_barrier()
                g = tl.load(scr + offs_s)
                dq += tl.dot(g, keys, input_precision=GRAD_PREC)
                dk = tl.dot(tl.trans(g), q, input_precision=GRAD_PREC)                           # [BLOCK_N, D]
                tl.debug_barrier()                        # every read of the scratch done before the next step
                tl.atomic_add(dkeys_row + rows[:, None] * D + offs_d[None, :], dk, mask=ok[:, None], sem="relaxed")
            tl.store(DQ + t * H * D + offs_h[:, None] * D + offs_d[None, :], dq.to(DQ.dtype.element_ty),
                     mask=h_ok[:, None])
            tl.store(DW + t * H + offs_h, dw, mask=h_ok)


def _precision(t: torch.Tensor, gradient: bool = False) -> str:
    """The products' precision on CUDA: the scores (forward, and recomputed for the backward's ReLU mask) as
    ``tf32x3`` (three TF32 tensor-core products per fp32 product, ~5e-7 relative; the ``ieee`` form runs on the
    CUDA cores at ~1/20 of the speed), the backward's two gradient products (``gradient``) as ``tf32`` (one, ~5e-4
    relative, finer than the bf16 rounding of the gradients the model's own layers carry). ``ieee`` elsewhere
    (Triton's interpreter)."""
    if not t.is_cuda:
        return "ieee"
    return "tf32" if gradient else "tf32x3"


def _flat(q: torch.Tensor, pool_keys: torch.Tensor, weights: torch.Tensor, sel: torch.Tensor):
    """Contiguous ``q [b s, H, D]``, ``keys [b, P, D]`` fp32, ``weights [b s, H]`` fp32, ``sel [b s, n]``."""
    b, s, H, D = q.shape
    return (q.reshape(b * s, H, D).contiguous(), pool_keys.float().contiguous(),
            weights.float().reshape(b * s, H).contiguous(), sel.reshape(b * s, sel.shape[-1]).contiguous())


class _SelectedPoolScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, pool_keys, weights, sel, scale):
        b, s, H, D = q.shape
        P, n = pool_keys.shape[1], sel.shape[-1]
        qf, kf, wf, sf = _flat(q, pool_keys, weights, sel)
        out = torch.empty(b, s, n, device=q.device, dtype=torch.float32)
        cfg = SELECTED_POOL_SCORES_CONFIG
        if b * s and n:
            _selected_pool_scores_fwd_kernel[(b * s,)](
                qf, kf, wf, sf, out, s, P, n, H, float(scale), qf.stride(0), qf.stride(1),
                D=D, BLOCK_H=block_h(H), BLOCK_N=cfg["BLOCK_N"], PREC=_precision(qf),
                num_warps=cfg["num_warps"])
        ctx.save_for_backward(qf, kf, wf, sf)
        ctx.shape, ctx.scale = (b, s, H, D, P, n), float(scale)
        ctx.dtypes = (pool_keys.dtype, weights.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        qf, kf, wf, sf = ctx.saved_tensors
        b, s, H, D, P, n = ctx.shape
        dout = dout.float().reshape(b * s, n).contiguous()
        dq = torch.empty_like(qf)
        dk = torch.zeros(b, P, D, device=qf.device, dtype=torch.float32)
        dw = torch.empty(b * s, H, device=qf.device, dtype=torch.float32)
        cfg = SELECTED_POOL_SCORES_CONFIG
        if b * s and n:
            sms = torch.cuda.get_device_properties(qf.device).multi_processor_count if qf.is_cuda else 1
            programs = max(1, min(b * s, sms * cfg["bwd_programs_per_sm"]))
            bh, bn = block_h(H), cfg["bwd_BLOCK_N"]
            scratch = torch.empty(programs, bh, bn, device=qf.device, dtype=torch.float32)
            _selected_pool_scores_bwd_kernel[(programs,)](
                qf, kf, wf, sf, dout, dq, dk, dw, scratch, b * s, s, P, n, H, ctx.scale, qf.stride(0), qf.stride(1),
                D=D, BLOCK_H=bh, BLOCK_N=bn, PREC=_precision(qf), GRAD_PREC=_precision(qf, gradient=True),
                num_warps=cfg["bwd_num_warps"])
        else:
            dq.zero_()
            dw.zero_()
        return (dq.view(b, s, H, D), dk.to(ctx.dtypes[0]), dw.view(b, s, H).to(ctx.dtypes[1]), None, None)


def selected_pool_scores(q: torch.Tensor, pool_keys: torch.Tensor, weights: torch.Tensor, sel: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """The selected pools' indexer scores (module docstring) as Triton kernels, differentiable in ``q``, ``pool_keys`` and
    ``weights``: ``[b, s, H, D], [b, P, D], [b, s, H], [b, s, n] -> [b, s, n]`` fp32 (whatever device Triton
    targets; ``D`` as :func:`supported` says; ``sel`` entries ``-1`` or in ``[0, P)``)."""
    b, s, H, D = q.shape
    if pool_keys.shape[0] != b or pool_keys.shape[-1] != D or weights.shape != (b, s, H) or sel.shape[:2] != (b, s):
        raise ValueError(f"selected_pool_scores: shapes q {tuple(q.shape)}, pool_keys {tuple(pool_keys.shape)}, "
                         f"weights {tuple(weights.shape)}, sel {tuple(sel.shape)} do not match")
    if not supported(D):
        raise ValueError(f"selected_pool_scores needs triton and a power-of-two head width >= 16 (got {D})")
    return _SelectedPoolScores.apply(q, pool_keys, weights, sel, scale)
