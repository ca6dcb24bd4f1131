"""Weight gradient of a grouped GEMM accumulated into fp32 main gradients (Triton on CUDA), with its PyTorch
reference: ``main_grad[e] += dy[rows of e]^T @ x[rows of e]`` for every group ``e``.

Shapes: ``x [T, K]`` (the grouped GEMM's input: tokens sorted by expert, 16-bit or fp32), ``dy [T, N]`` (the
gradient of its output, same dtype), ``offs [E]`` int32 (cumulative row counts: rows ``offs[e-1]:offs[e]`` belong to
group ``e``, ``offs[-1] <= T``; empty groups allowed), ``main_grad [E, N, K]`` fp32, contiguous, updated in place.

This is megatron-core's gradient-accumulation fusion (Apex's ``wgrad_gemm_accum_fp32``) for the routed experts'
grouped GEMMs (``models/grouped_experts.py``): ``torch._grouped_mm`` has no accumulating form, so without it the
expert weights' gradients are written in bf16 and DDP's hook adds each one into its fp32 ``main_grad`` every micro
batch (a mixed-dtype element-wise pass over every expert weight). Here the products are summed in fp32 and added
to ``main_grad`` in one read-modify-write, without rounding them to bf16 first.

Kernel: a grid of (output tiles ``BLOCK_N x BLOCK_K`` of one group, groups). Each program reads its group's row
range from ``offs`` on the device (no host synchronisation, so the call can be captured in a CUDA graph), walks it
``BLOCK_T`` rows at a time with ``tl.dot`` on ``dy``'s columns transposed, and adds the fp32 tile into
``main_grad``. Tiles are ordered in groups of ``GROUP_N`` tile rows so that neighbouring programs share ``dy`` and
``x`` columns in L2. Index arithmetic is in int64. Programs of different groups and tiles write disjoint outputs:
the result does not depend on scheduling (no atomics).
"""

from __future__ import annotations

import torch

from megatron_glm5.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["grouped_wgrad_accum", "grouped_wgrad_accum_reference"]

BLOCK_N = 128
"""Output rows (``dy`` columns) per program."""
BLOCK_K = 128
"""Output columns (``x`` columns) per program."""
BLOCK_T = 32
"""Rows of the group summed per step."""
GROUP_N = 8
"""Tile rows walked together (L2 reuse of ``x``'s column blocks)."""
NUM_WARPS = 4
NUM_STAGES = 4
"""Software-pipeline depth of the row loop's loads for 16-bit inputs (at most 2 for fp32 inputs, whose tiles take
twice the shared memory). The tiles are the fastest of ``scripts/bench_grouped_wgrad.py --sweep`` on an H100 at the
proxy's expert shapes (12 % under ``torch._grouped_mm`` + DDP's add; docs/performance.md)."""


# ============================================================================ PyTorch reference
def grouped_wgrad_accum_reference(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor,
                                  main_grad: torch.Tensor) -> None:
    """``main_grad[e] += dy[s:t].T @ x[s:t]`` in ``main_grad``'s dtype, ``s:t`` group ``e``'s rows (reads ``offs``
    on the host)."""
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            main_grad[e].addmm_(dy[start:end].t().to(main_grad.dtype), x[start:end].to(main_grad.dtype))
        start = end


# ============================================================================ Triton kernel
if HAVE_TRITON:

    @triton.jit
    def _grouped_wgrad_kernel(X, DY, OFFS, C, N, K, stride_x, stride_dy, IEEE: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, GROUP_N: tl.constexpr):
        e = tl.program_id(1)
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(N, BLOCK_N)
        tiles_k = tl.cdiv(K, BLOCK_K)
        per_group = GROUP_N * tiles_k
        first_n = (pid // per_group) * GROUP_N
        rows_here = tl.minimum(tiles_n - first_n, GROUP_N)
        tile_n = first_n + (pid % per_group) % rows_here
        tile_k = (pid % per_group) // rows_here

        start = tl.load(OFFS + tl.maximum(e - 1, 0)).to(tl.int64)
        start = tl.where(e > 0, start, 0)
        end = tl.load(OFFS + e).to(tl.int64)

        rn = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        rk = tile_k.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K).to(tl.int64)
        ok_n = rn < N
        ok_k = rk < K
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for t0 in range(start, end, BLOCK_T):
            rt = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
            ok_t = rt < end
            dy_t = tl.load(DY + rt[None, :] * stride_dy + rn[:, None], mask=ok_n[:, None] & ok_t[None, :],
                           other=0.0)                                                       # [BLOCK_N, BLOCK_T]
            x_t = tl.load(X + rt[:, None] * stride_x + rk[None, :], mask=ok_t[:, None] & ok_k[None, :],
                          other=0.0)                                                        # [BLOCK_T, BLOCK_K]
            if IEEE:
                acc = tl.dot(dy_t, x_t, acc, input_precision="ieee")
            else:
                acc = tl.dot(dy_t, x_t, acc)
        if end > start:
            ptrs = C + e.to(tl.int64) * N * K + rn[:, None] * K + rk[None, :]
            ok = ok_n[:, None] & ok_k[None, :]
            tl.store(ptrs, tl.load(ptrs, mask=ok, other=0.0) + acc, mask=ok)


def _launch(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, main_grad: torch.Tensor) -> None:
    """Run the Triton kernel with the module's tiles (on whatever device Triton targets; its interpreter takes CPU
    tensors)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    groups, n, k = main_grad.shape
    if not groups or not n or not k:
        return
    grid = (triton.cdiv(n, BLOCK_N) * triton.cdiv(k, BLOCK_K), groups)
    _grouped_wgrad_kernel[grid](x, dy, offs, main_grad, n, k, x.stride(0), dy.stride(0),
                                IEEE=x.dtype == torch.float32, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_T=BLOCK_T,
                                GROUP_N=GROUP_N, num_warps=NUM_WARPS,
                                num_stages=NUM_STAGES if x.element_size() <= 2 else min(NUM_STAGES, 2))


def grouped_wgrad_accum(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor, main_grad: torch.Tensor) -> None:
    """:func:`grouped_wgrad_accum_reference` as one Triton kernel on CUDA (fp32 sums, ``offs`` read on the device);
    the reference elsewhere."""
    assert x.dim() == 2 and dy.dim() == 2 and x.shape[0] == dy.shape[0], (x.shape, dy.shape)
    assert main_grad.dim() == 3 and main_grad.shape[1:] == (dy.shape[1], x.shape[1]), (main_grad.shape, x.shape,
                                                                                         dy.shape)
    assert offs.dim() == 1 and offs.shape[0] == main_grad.shape[0], (offs.shape, main_grad.shape)
    if not (HAVE_TRITON and x.is_cuda and main_grad.dtype == torch.float32 and main_grad.is_contiguous()):
        grouped_wgrad_accum_reference(x, dy, offs, main_grad)
        return
    _launch(x, dy, offs, main_grad)
