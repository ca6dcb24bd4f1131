"""Fused sparse MLA attention in the absorbed (MQA) form, forward and backward in Triton, with its PyTorch reference.

The KPool DSA layer (``models/kpool_dsa.py``) attends, for every query, only to the positions its indexer selected.
In the absorbed form all heads share one key/value row per position: the normalised KV latent ``c_t`` ``[R]``
(``R = kv_lora_rank``). With ``q_lat = q W_kc`` ``[H, R]`` per query::

    S_ij = scale * q_lat_i . c_j            for j in sel(i)           (per head)
    P_i  = softmax_j(S_i)                                             (fp32)
    o_i  = sum_j P_ij c_j                   [H, R]                    (o = o_lat; the caller applies W_vc)

Layouts: ``q_lat [b, s, H, R]``, ``kv_lat [b, s, R]``, ``topk_indices [b, s, W]`` int (row positions in ``[0, s)``,
``-1`` = unused slot) -> ``o_lat [b, s, H, R]``. Document masks need nothing here: the KPool indexer only selects
positions of the query's own document (built from ``PackedSeqParams``), so following the indices is exactly the
document-masked attention. The selected pools and the always-selected tail of the indexer are disjoint, so the
kernel requires every row's valid indices to be **distinct** (a duplicate would be counted twice; the masked-dense
reference counts it once). Rows without any valid index output zeros.

Kernels (one program per query and block of heads; ``BLOCK_N`` selected rows gathered per step):

* forward: online softmax over the gathered latent rows; saves ``lse`` ``[T, H]`` (log2 units). ``O(T (H R + W))``
  memory, linear in the sequence length.
* backward: recomputes ``P`` from ``lse``; ``dS = P (dO c^T - rowsum(dO o))``; ``dq_lat = scale dS c`` accumulated
  in registers; ``dc = P^T dO + scale dS^T q_lat`` scattered with fp32 atomic adds into a ``[T, R]`` buffer. For
  16-bit inputs it runs as two kernels with 64 heads per program: dq, and dc in the transposed form
  ``dc^T = dO^T P + scale q_lat^T dS`` (``[R, BLOCK_N]`` per step), where q and dO are only ever the A operand of
  the matrix products, so one shared-memory copy of each serves both of their products (the untransposed form needs
  two and does not fit at 64 heads). fp32 inputs (tests, parity checks) run the single fused kernel.

:func:`sparse_mla_reference` is the plain PyTorch reference (fp32 masked dense softmax over all positions,
``O(s^2)``, for tests). Kernel tiling lives in :data:`FWD_CONFIG` / :data:`BWD_CONFIG`.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from megatron_glm5.kernels import triton_support
from megatron_glm5.kernels.triton_support import (
    HAVE_TRITON,
    LOG2E,
    SMEM_BUDGET,
    block_h,
    dot_precision,
    fit_gather_tiling,
    tl,
    triton,
)

__all__ = ["sparse_mla", "sparse_mla_reference", "prepare_indices", "FWD_CONFIG", "FWD_CONFIG_FP32", "BWD_CONFIG",
           "BWD_CONFIG_FP32", "HAVE_TRITON"]

FWD_CONFIG = dict(BLOCK_H=64, BLOCK_N=64, num_warps=8, num_stages=2)
"""Forward tiling: heads per program (capped at the padded head count), selected rows per step, warps, stages
(16-bit inputs: cut by ``triton_support.fit_gather_tiling`` until q and the staged rows fit ``SMEM_BUDGET``).
Optional in every forward and backward tiling: ``prefetch=1`` gathers the next step's rows into registers before
this step's products (a load in flight across the step without another shared-memory stage; default 0)."""
FWD_CONFIG_FP32 = dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2)
"""Forward tiling for fp32 inputs (tests, parity checks): 64 rows at two stages need 279,040 bytes of shared memory
at latent 512, over the H200's 232,448."""
BWD_CONFIG = dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=1, split=True, vec_red=1,
                  dq=dict(BLOCK_N=64), dkv=dict(form="dkv_t", BLOCK_N=64, programs_per_sm=8))
"""Backward tiling for 16-bit inputs; ``split=True`` runs dq and dkv as two kernels (recomputes P twice; optional
``dq`` / ``dkv`` sub-dicts give each its own tiling); ``form="dkv_t"`` in the dkv pass selects the transposed-form
kernel (:func:`_sparse_mla_bwd_dkv_t_kernel`, a persistent grid of ``programs_per_sm`` programs per multiprocessor,
or ``programs`` in all);
``vec_red``: 1 = 16-byte vector reductions for dkv in the fused kernel (sm_90 ``red.global.add.v4.f32``), 0 =
scalar atomics."""
BWD_CONFIG_FP32 = dict(BLOCK_H=32, BLOCK_N=32, num_warps=8, num_stages=1, split=False, vec_red=1)
"""Backward tiling for fp32 inputs: the single fused kernel at 32 heads per program (fp32 q and dO would not fit in
shared memory at 64 heads)."""

_LN2 = 0.6931471805599453


# ============================================================================ PyTorch reference
def topk_indices_to_mask(topk_indices: torch.Tensor, kv_length: int) -> torch.Tensor:
    """Boolean ``[b, s, kv_length]`` mask (True = attend) from ``topk_indices [b, s, w]`` (``-1`` = unused)."""
    b, s, _ = topk_indices.shape
    idx = topk_indices.long()
    idx = torch.where((idx >= 0) & (idx < kv_length), idx, kv_length)
    mask = torch.zeros(b, s, kv_length + 1, dtype=torch.bool, device=topk_indices.device)
    mask.scatter_(-1, idx, True)
    return mask[..., :kv_length]


def sparse_mla_reference(q_lat: torch.Tensor, kv_lat: torch.Tensor, topk_indices: torch.Tensor,
                         scale: float, return_lse: bool = False):
    """Masked dense reference of :func:`sparse_mla` in fp32 (duplicates count once). ``O(s^2)`` memory.

    Args:
        q_lat: ``[b, s, H, R]``; kv_lat: ``[b, s, R]``; topk_indices: ``[b, s, W]`` (``-1`` unused); scale: softmax
            scale.
        return_lse: also return the log-sum-exp of the selected scores.
    Returns:
        ``[b, s, H, R]`` in ``q_lat.dtype``; rows with an empty selection are zero. With ``return_lse``:
        ``(out, lse [b, s, H] fp32)``, natural log, ``+inf`` on empty rows.
    """
    t = kv_lat.shape[1]
    mask = topk_indices_to_mask(topk_indices, t)                                  # [b, s, t]
    has_any = mask.any(-1)                                                        # [b, s]
    scores = torch.einsum("bshr,btr->bsht", q_lat.float(), kv_lat.float()) * scale
    scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
    scores = scores.masked_fill(~has_any[:, :, None, None], 0.0)
    probs = scores.softmax(dim=-1)
    out = torch.einsum("bsht,btr->bshr", probs, kv_lat.float())
    out = (out * has_any[..., None, None]).to(q_lat.dtype)
    if return_lse:
        lse = scores.logsumexp(dim=-1).masked_fill(~has_any[..., None], float("inf"))
        return out, lse
    return out


# ============================================================================ Triton kernels
if HAVE_TRITON:
    from megatron_glm5.kernels.triton_support import gather_selected, program_query

    @triton.jit
    def _sparse_mla_fwd_kernel(Q, KV, IDX, NEND, O, LSE, qk_scale,
                               stride_qt, stride_qh, stride_kvt, stride_it, stride_ot, stride_oh, H,
                               R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                               PREC: tl.constexpr, PREFETCH: tl.constexpr):
        t, offs_h, offs_r, offs_nb, h_ok, q = program_query(Q, tl.program_id(0).to(tl.int64), tl.program_id(1),
                                                             stride_qt, stride_qh, H, R, BLOCK_H, BLOCK_N)
        n_end = tl.load(NEND + tl.program_id(0))
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, R], tl.float32)
        if PREFETCH:
            rows_next, ok_next, kv_next = gather_selected(IDX, KV, t, stride_it, stride_kvt, 0, n_end, offs_nb,
                                                           offs_r)
        for n0 in range(0, n_end, BLOCK_N):
            if PREFETCH:
                rows, ok, kv = rows_next, ok_next, kv_next
                rows_next, ok_next, kv_next = gather_selected(IDX, KV, t, stride_it, stride_kvt, n0 + BLOCK_N,
                                                               n_end, offs_nb, offs_r)
            else:
                rows, ok, kv = gather_selected(IDX, KV, t, stride_it, stride_kvt, n0, n_end, offs_nb, offs_r)
            s = tl.dot(q, tl.trans(kv), input_precision=PREC) * qk_scale
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_i - m_use)
            p = tl.math.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=PREC)
            m_i = m_new
        has = l_i > 0.0
        l_safe = tl.where(has, l_i, 1.0)
        o = acc / l_safe[:, None]
        lse = tl.where(has, m_i + tl.math.log2(l_safe), float("inf"))
        tl.store(O + t * stride_ot + offs_h[:, None] * stride_oh + offs_r[None, :], o.to(O.dtype.element_ty),
                 mask=h_ok[:, None])
        tl.store(LSE + t * H + offs_h, lse, mask=h_ok)

    @triton.jit
    def _red_add_rows(DKV, rows, ok, vals, R: tl.constexpr, BLOCK_N: tl.constexpr, VEC: tl.constexpr):
        """``DKV[rows[n], :] += vals[n, :]`` for the rows with ``ok`` (fp32, fire-and-forget reductions).

        ``VEC = 0``: scalar atomics; ``1``: one 16-byte ``red.global.add.v4.f32`` (sm_90) per 4 columns; ``2``: the
        same column split done with scalar atomics (checks the split on the Triton interpreter, which has no asm).
        """
        if VEC == 0:
            tl.atomic_add(DKV + rows[:, None] * R + tl.arange(0, R)[None, :], vals, mask=ok[:, None],
                          sem="relaxed")
        else:
            v = tl.reshape(vals, [BLOCK_N, R // 4, 2, 2])        # (n, 4k + 2a + b) -> (n, k, a, b)
            b0, b1 = tl.split(v)                                   # b = 0 / 1: [BLOCK_N, R // 4, 2] over a
            x0, x2 = tl.split(b0)                                  # columns 4k, 4k + 2
            x1, x3 = tl.split(b1)                                  # columns 4k + 1, 4k + 3
            ptr = DKV + rows[:, None] * R + (tl.arange(0, R // 4) * 4)[None, :]
            if VEC == 1:
                pred = tl.broadcast_to(ok[:, None], [BLOCK_N, R // 4]).to(tl.int32)
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.u32 $0, 0; "
                    "@p red.relaxed.gpu.global.add.v4.f32 [$1], {$3, $4, $5, $6}; }",
                    "=r,l,r,f,f,f,f", [ptr.to(tl.int64), pred, x0, x1, x2, x3], dtype=tl.int32, is_pure=False,
                    pack=1)
            else:
                m = tl.broadcast_to(ok[:, None], [BLOCK_N, R // 4])
                # (`* 1.0`: the interpreter's atomics mishandle the strided views that split returns)
                tl.atomic_add(ptr, x0 * 1.0, mask=m, sem="relaxed")
                tl.atomic_add(ptr + 1, x1 * 1.0, mask=m, sem="relaxed")
                tl.atomic_add(ptr + 2, x2 * 1.0, mask=m, sem="relaxed")
                tl.atomic_add(ptr + 3, x3 * 1.0, mask=m, sem="relaxed")

    @triton.jit
    def _recompute_p_ds(q, do, kv, ok, lse, delta, qk_scale, PREC: tl.constexpr):
        """``P = exp2(scale q c^T - lse)`` (0 on unused slots) and ``dS = P (dO c^T - delta)``, ``[BLOCK_H, BLOCK_N]``
        fp32, for the gathered rows ``kv`` of one backward step."""
        s = tl.dot(q, tl.trans(kv), input_precision=PREC) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        p = tl.where(ok[None, :], p, 0.0)
        dp = tl.dot(do, tl.trans(kv), input_precision=PREC)
        return p, p * (dp - delta[:, None])

    @triton.jit
    def _sparse_mla_bwd_kernel(Q, KV, O, DO, LSE, IDX, NEND, DQ, DKV, qk_scale, sm_scale,
                               stride_qt, stride_qh, stride_kvt, stride_it, stride_ot, stride_oh, stride_dot,
                               stride_doh, H, R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                               PREC: tl.constexpr, COMPUTE_DQ: tl.constexpr, COMPUTE_DKV: tl.constexpr,
                               VEC_RED: tl.constexpr, PREFETCH: tl.constexpr):
        # O and DQ share one layout (stride_ot, stride_oh); Q and DO have their own; DKV is fp32 [T, R] contiguous.
        t, offs_h, offs_r, offs_nb, h_ok, q = program_query(Q, tl.program_id(0).to(tl.int64), tl.program_id(1),
                                                             stride_qt, stride_qh, H, R, BLOCK_H, BLOCK_N)
        o_off = t * stride_ot + offs_h[:, None] * stride_oh + offs_r[None, :]
        do = tl.load(DO + t * stride_dot + offs_h[:, None] * stride_doh + offs_r[None, :], mask=h_ok[:, None],
                     other=0.0)
        o = tl.load(O + o_off, mask=h_ok[:, None], other=0.0)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)                  # [BLOCK_H]
        lse = tl.load(LSE + t * H + offs_h, mask=h_ok, other=float("inf"))
        n_end = tl.load(NEND + tl.program_id(0))
        dq = tl.zeros([BLOCK_H, R], tl.float32)
        if PREFETCH:
            rows_next, ok_next, kv_next = gather_selected(IDX, KV, t, stride_it, stride_kvt, 0, n_end, offs_nb,
                                                           offs_r)
        for n0 in range(0, n_end, BLOCK_N):
            if PREFETCH:
                rows, ok, kv = rows_next, ok_next, kv_next
                rows_next, ok_next, kv_next = gather_selected(IDX, KV, t, stride_it, stride_kvt, n0 + BLOCK_N,
                                                               n_end, offs_nb, offs_r)
            else:
                rows, ok, kv = gather_selected(IDX, KV, t, stride_it, stride_kvt, n0, n_end, offs_nb, offs_r)
            p, ds = _recompute_p_ds(q, do, kv, ok, lse, delta, qk_scale, PREC)
            if COMPUTE_DQ:
                dq += tl.dot(ds.to(kv.dtype), kv, input_precision=PREC)
            if COMPUTE_DKV:
                dkv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
                dkv += tl.dot(tl.trans((ds * sm_scale).to(q.dtype)), q, input_precision=PREC)
                _red_add_rows(DKV, rows, ok, dkv, R, BLOCK_N, VEC_RED)
        if COMPUTE_DQ:
            tl.store(DQ + o_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=h_ok[:, None])

    @triton.jit
    def _sparse_mla_bwd_dkv_t_kernel(Q, KV, O, DO, LSE, IDX, NEND, DKV, SCRATCH, qk_scale, sm_scale,
                                     stride_qt, stride_qh, stride_kvt, stride_it, stride_ot, stride_oh, stride_dot,
                                     stride_doh, T, H, N_HBLOCKS, R: tl.constexpr, BLOCK_H: tl.constexpr,
                                     BLOCK_N: tl.constexpr, PREC: tl.constexpr, PREFETCH: tl.constexpr):
        """dkv alone, as ``dkv^T = dO^T P + scale q^T dS`` (``[R, BLOCK_N]`` per step), scattered with fp32 atomics.

        q and dO ``[BLOCK_H, R]`` are the A operand of every product (``S = q c^T``, ``dP = dO c^T`` and, transposed,
        of ``dkv^T``), so one shared-memory copy of each serves both uses. Persistent: program ``pid`` takes the work
        items ``pid, pid + num_programs, ...`` (item = query row x head block). ``P`` and ``scale dS`` (the B
        operands of ``dkv^T``) pass through this program's ``SCRATCH`` ``[2, BLOCK_H, BLOCK_N]`` (L1/L2-resident):
        the Triton of torch 2.11 (3.6) on sm_90 gives wrong dkv when a matrix-product result goes to shared memory
        as a B operand directly (the FLA / Triton Hopper reports for 3.4 - 3.7.0); loaded back, it has a plain
        blocked layout.
        """
        pid = tl.program_id(0)
        scr = SCRATCH + pid.to(tl.int64) * (2 * BLOCK_H * BLOCK_N)
        offs_s = tl.arange(0, BLOCK_H)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        for work in range(pid, T * N_HBLOCKS, tl.num_programs(0)):
            t = (work // N_HBLOCKS).to(tl.int64)
            t, offs_h, offs_r, offs_nb, h_ok, q = program_query(Q, t, work % N_HBLOCKS, stride_qt, stride_qh, H, R,
                                                                 BLOCK_H, BLOCK_N)
            o_off = t * stride_ot + offs_h[:, None] * stride_oh + offs_r[None, :]
            do = tl.load(DO + t * stride_dot + offs_h[:, None] * stride_doh + offs_r[None, :], mask=h_ok[:, None],
                         other=0.0)
            o = tl.load(O + o_off, mask=h_ok[:, None], other=0.0)
            delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)                  # [BLOCK_H]
            lse = tl.load(LSE + t * H + offs_h, mask=h_ok, other=float("inf"))
            n_end = tl.load(NEND + t)
            if PREFETCH:
                rows_next, ok_next, kv_next = gather_selected(IDX, KV, t, stride_it, stride_kvt, 0, n_end, offs_nb,
                                                               offs_r)
            for n0 in range(0, n_end, BLOCK_N):
                if PREFETCH:
                    rows, ok, kv = rows_next, ok_next, kv_next
                    rows_next, ok_next, kv_next = gather_selected(IDX, KV, t, stride_it, stride_kvt, n0 + BLOCK_N,
                                                                   n_end, offs_nb, offs_r)
                else:
                    rows, ok, kv = gather_selected(IDX, KV, t, stride_it, stride_kvt, n0, n_end, offs_nb, offs_r)
                p, ds = _recompute_p_ds(q, do, kv, ok, lse, delta, qk_scale, PREC)
                tl.store(scr + offs_s, p.to(SCRATCH.dtype.element_ty))
                tl.store(scr + BLOCK_H * BLOCK_N + offs_s, (ds * sm_scale).to(SCRATCH.dtype.element_ty))
                tl.debug_barrier()
                p_b = tl.load(scr + offs_s)
                ds_b = tl.load(scr + BLOCK_H * BLOCK_N + offs_s)
                dkv_t = tl.dot(tl.trans(do), p_b, input_precision=PREC)                  # [R, BLOCK_N]
                dkv_t += tl.dot(tl.trans(q), ds_b, input_precision=PREC)
                tl.debug_barrier()                                # all reads of the scratch done before the next step
                tl.atomic_add(DKV + rows[None, :] * R + offs_r[:, None], dkv_t, mask=ok[None, :], sem="relaxed")


def _sparse_mla_fwd(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, n_end: torch.Tensor,
                    scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``q [T, H, R]``, ``kv [T, R]``, ``idx [T, W]`` int32 (flat rows, ``-1`` unused), ``n_end [T]`` int32
    -> ``(o [T, H, R], lse [T, H] fp32, log2 units)``."""
    T, H, R = q.shape
    half = q.element_size() == 2
    cfg = fit_gather_tiling(FWD_CONFIG, R, triton_support.tensor_limits(q)[0]) if half else FWD_CONFIG_FP32
    bh = block_h(H, cfg["BLOCK_H"])
    o = torch.empty_like(q)
    lse = torch.empty(T, H, device=q.device, dtype=torch.float32)
    grid = (T, triton.cdiv(H, bh))
    _sparse_mla_fwd_kernel[grid](
        q, kv, idx, n_end, o, lse, scale * LOG2E,
        q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), o.stride(0), o.stride(1), H,
        R=R, BLOCK_H=bh, BLOCK_N=cfg["BLOCK_N"], PREC=dot_precision(q.dtype), PREFETCH=int(cfg.get("prefetch", 0)),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return o, lse


def _bwd_passes(cfg: dict, passes=None, R: int = 0, budget: int = SMEM_BUDGET):
    """Kernel launches of the backward for a :data:`BWD_CONFIG`: ``[(compute_dq, compute_dkv, tiling)]``.

    ``split`` runs dq and dkv as two launches whose tilings may differ (optional ``dq`` / ``dkv`` sub-dicts
    override the shared keys); ``passes`` (benchmarks) picks explicit ``(compute_dq, compute_dkv)`` launches.
    With ``R`` given, each tiling's ``BLOCK_N`` then ``BLOCK_H`` are halved (not below 16) until its shared-memory
    estimate fits ``budget`` bytes."""
    base = {k: v for k, v in cfg.items() if k not in ("split", "dq", "dkv")}
    split = bool(cfg.get("split"))
    if passes is None:
        passes = [(True, False), (False, True)] if split else [(True, True)]
    out = []
    for dq, dkv in passes:
        own = cfg.get("dq", {}) if dq and not dkv else cfg.get("dkv", {}) if dkv and not dq else {}
        tiling = {**base, **(own if split else {})}
        if not (dkv and not dq):
            tiling.pop("form", None)                    # the transposed form computes dkv alone
        out.append((dq, dkv, _fit_shared_memory(tiling, dq and dkv, R, budget) if R else tiling))
    return out


def _fit_shared_memory(tiling: dict, fused: bool, R: int, budget: int = SMEM_BUDGET) -> dict:
    """``tiling`` with ``BLOCK_N``, then ``BLOCK_H``, halved until the staged operands fit: q and dO
    ``[BLOCK_H, R]`` (twice each in the fused kernel, which also needs their transposed copies) and the gathered rows
    ``[BLOCK_N, R]``."""
    t = dict(tiling)

    def need():
        return ((4 if fused else 2) * t["BLOCK_H"] + t["BLOCK_N"]) * R * 2          # 16-bit operands

    while need() > budget and t["BLOCK_N"] > 16:
        t["BLOCK_N"] //= 2
    while need() > budget and t["BLOCK_H"] > 16:
        t["BLOCK_H"] //= 2
    return t


def _sparse_mla_bwd(do: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                    idx: torch.Tensor, n_end: torch.Tensor, scale: float,
                    passes=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradients ``(dq [T, H, R] in q.dtype, dkv [T_kv, R] in kv.dtype)``: ``T`` query rows, ``T_kv`` latent rows
    (fewer queries than latent rows when only some of a sequence's queries take the kernel). ``passes``: explicit
    list of ``(compute_dq, compute_dkv)`` kernel launches (benchmarks time the two halves separately)."""
    T, H, R = q.shape
    if do.stride(-1) != 1:
        do = do.contiguous()
    dq = torch.empty_like(o)
    dkv = torch.zeros(kv.shape[0], R, device=kv.device, dtype=torch.float32)
    half = q.element_size() == 2               # fp32 products run without tensor cores (ieee): no staging to fit
    budget, vec_ok = triton_support.tensor_limits(q)
    for compute_dq, compute_dkv, cfg in _bwd_passes(BWD_CONFIG if half else BWD_CONFIG_FP32, passes,
                                                    R if half else 0, budget):
        bh = block_h(H, cfg["BLOCK_H"])
        n_hblocks = triton.cdiv(H, bh)
        if cfg.get("form") == "dkv_t":
            programs = cfg.get("programs") or (torch.cuda.get_device_properties(q.device).multi_processor_count
                                               * int(cfg.get("programs_per_sm", 8)))
            programs = max(1, min(T * n_hblocks, int(programs)))
            scratch = torch.empty(programs, 2, bh, cfg["BLOCK_N"], device=q.device, dtype=q.dtype)
            _sparse_mla_bwd_dkv_t_kernel[(programs,)](
                q, kv, o, do, lse, idx, n_end, dkv, scratch, scale * LOG2E, scale,
                q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), o.stride(0), o.stride(1), do.stride(0),
                do.stride(1), T, H, n_hblocks, R=R, BLOCK_H=bh, BLOCK_N=cfg["BLOCK_N"], PREC=dot_precision(q.dtype),
                PREFETCH=int(cfg.get("prefetch", 0)), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
            continue
        _sparse_mla_bwd_kernel[(T, n_hblocks)](
            q, kv, o, do, lse, idx, n_end, dq, dkv, scale * LOG2E, scale,
            q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), o.stride(0), o.stride(1), do.stride(0),
            do.stride(1), H, R=R, BLOCK_H=bh, BLOCK_N=cfg["BLOCK_N"], PREC=dot_precision(q.dtype),
            COMPUTE_DQ=compute_dq, COMPUTE_DKV=compute_dkv, VEC_RED=int(cfg.get("vec_red", 0)) if R % 4 == 0 and vec_ok else 0,
            PREFETCH=int(cfg.get("prefetch", 0)), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return dq.to(q.dtype), dkv.to(kv.dtype)


class _SparseMLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, idx, n_end, scale):
        o, lse = _sparse_mla_fwd(q, kv, idx, n_end, scale)
        ctx.save_for_backward(q, kv, o, lse, idx, n_end)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, kv, o, lse, idx, n_end = ctx.saved_tensors
        dq, dkv = _sparse_mla_bwd(do, q, kv, o, lse, idx, n_end, ctx.scale)
        return dq, dkv, None, None, None


def prepare_indices(topk_indices: torch.Tensor, kv_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Flat kernel indices from ``topk_indices [b, s, W]`` (row positions; ``-1`` or out of range = unused).

    Returns ``idx [b*s, W]`` int32 (row ``r`` of batch ``i`` -> ``i * kv_len + r``, ``-1`` unused) and
    ``n_end [b*s]`` int32 (one past the last valid slot, so the kernel skips the unused tail of a row).
    """
    b, s, W = topk_indices.shape
    idx = topk_indices.to(torch.int32)
    valid = (idx >= 0) & (idx < kv_len)
    if b > 1:
        idx = idx + (torch.arange(b, device=idx.device, dtype=torch.int32) * kv_len)[:, None, None]
    idx = torch.where(valid, idx, -1).reshape(b * s, W).contiguous()
    pos = torch.arange(1, W + 1, device=idx.device, dtype=torch.int32)
    n_end = (valid.reshape(b * s, W).to(torch.int32) * pos).amax(-1).to(torch.int32).contiguous()
    return idx, n_end


def sparse_mla(q_lat: torch.Tensor, kv_lat: torch.Tensor, topk_indices: torch.Tensor, scale: float,
               prepared: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, return_lse: bool = False):
    """Fused sparse absorbed attention (CUDA + triton); same contract as :func:`sparse_mla_reference` except that
    each row's valid indices must be distinct.

    Args:
        q_lat: ``[b, s, H, R]`` (R a power of two >= 16); kv_lat: ``[b, s, R]``; topk_indices: ``[b, s, W]``.
        scale: softmax scale.
        prepared: optional ``prepare_indices(topk_indices, s)`` result (reused across layers sharing a selection).
        return_lse: also return the forward's log-sum-exp of the selected scores (what the sparse indexer loss
            needs to turn recomputed scores into the attention's probabilities).
    Returns:
        ``o_lat [b, s, H, R]`` in ``q_lat.dtype``; differentiable w.r.t. ``q_lat`` and ``kv_lat``. With
        ``return_lse``: ``(o_lat, lse [b, s, H] fp32)``, natural log, ``+inf`` on empty rows, not differentiable.
    """
    if not HAVE_TRITON:
        raise RuntimeError("sparse_mla needs triton; use sparse_mla_reference (or dsa_backend='torch') instead")
    b, s, H, R = q_lat.shape
    t = kv_lat.shape[1]
    if R & (R - 1) or R < 16:
        raise ValueError(f"sparse_mla needs a power-of-two latent width >= 16, got {R}")
    idx, n_end = prepared if prepared is not None else prepare_indices(topk_indices, t)
    q = q_lat.reshape(b * s, H, R)
    if q.stride(-1) != 1:  # any other layout with unit-stride rows is read as it is (o and dq take it too)
        q = q.contiguous()
    kv = kv_lat.reshape(b * t, R).contiguous().to(q.dtype)
    o, lse = _SparseMLAFunction.apply(q, kv, idx, n_end, float(scale))
    o = o.reshape(b, s, H, R)
    if return_lse:
        return o, (lse * _LN2).reshape(b, s, H)    # the kernel's lse is in log2 units
    return o


def sparse_mla_flops(topk_indices: torch.Tensor, num_heads: int, latent: int) -> Tuple[float, float]:
    """Useful (forward, backward) FLOPs of :func:`sparse_mla` for a selection: 4 H R per selected pair forward,
    10 H R backward (S and dP recomputed, dq, two dkv products)."""
    pairs = float((topk_indices >= 0).sum())
    return 4.0 * pairs * num_heads * latent, 10.0 * pairs * num_heads * latent

