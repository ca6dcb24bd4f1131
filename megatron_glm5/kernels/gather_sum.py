"""Gather-and-sum of rows (Triton on CUDA), with its PyTorch reference: ``out[t] = sum_j src[index[t, j]]``.

Shapes: ``src [N, h]`` (any float dtype), ``index [T, k]`` int64 (rows of ``src``, each in ``[0, N)``; repeats
allowed) -> ``out [T, h]`` in ``src.dtype``, summed in fp32 and rounded once.

This is the MoE token unpermute (``src`` the ``[T * k, h]`` expert outputs, ``index`` each token's ``k`` rows) and
the permute's backward (``src`` the permuted rows' gradient). megatron-core does both as a scatter-add into a zeroed
``[T, h]``: atomics, ``k`` roundings per element in bf16, in an order that differs run to run. Here every output
element is written once, by one program, in a fixed order. With ``k = 1`` (:func:`gather_rows`) it is also the
permute's gather and the unpermute's backward (``src[rows]``; in the H200 train-step proxy about twice as fast as
``index_select``'s gather kernel).

Kernel: a grid of (token blocks of ``BLOCK_T``, column blocks of ``BLOCK_H``); each program loads its tokens' ``k``
indices and accumulates the ``k`` rows' columns in fp32, then stores once. ``k`` is a compile-time constant (the
``k`` loads are unrolled); ``T``, ``h`` and the row stride are runtime values, with masks for the last blocks. Index
arithmetic is in int64 (``N * h`` passes 2^31 at training sizes). Indices are not bounds-checked on the GPU (the
reference raises on one out of range).
"""

from __future__ import annotations

import torch

from megatron_glm5.kernels.triton_support import HAVE_TRITON, tl, triton

__all__ = ["gather_rows", "gather_sum", "gather_sum_reference"]

BLOCK_T = 4
"""Tokens per program."""
BLOCK_H = 1024
"""Columns per program at most (fewer when ``h`` is small)."""


# ============================================================================ PyTorch reference
def gather_sum_reference(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``src [N, h]``, ``index [T, k]`` -> ``sum_j src[index[:, j]]`` ``[T, h]``: fp32 sum, cast to ``src.dtype``."""
    return src.float()[index].sum(1).to(src.dtype)


# ============================================================================ Triton kernel
if HAVE_TRITON:

    @triton.jit
    def _gather_sum_kernel(SRC, INDEX, OUT, T, H, stride_src, stride_out, K: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_H: tl.constexpr):
        tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
        ok_t = tokens < T
        ok = ok_t[:, None] & (cols < H)[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            rows = tl.load(INDEX + tokens * K + j, mask=ok_t, other=0).to(tl.int64)
            acc += tl.load(SRC + rows[:, None] * stride_src + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(OUT + tokens[:, None] * stride_out + cols[None, :], acc.to(OUT.dtype.element_ty), mask=ok)


def _launch(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Run the Triton kernel (on whatever device Triton targets; its interpreter takes CPU tensors)."""
    if src.stride(-1) != 1:
        src = src.contiguous()
    index = index.contiguous()
    num_tokens, k = index.shape
    h = src.shape[1]
    out = torch.empty(num_tokens, h, device=src.device, dtype=src.dtype)
    if num_tokens and h:
        block_h = min(BLOCK_H, triton.next_power_of_2(h))
        grid = (triton.cdiv(num_tokens, BLOCK_T), triton.cdiv(h, block_h))
        _gather_sum_kernel[grid](src, index, out, num_tokens, h, src.stride(0), out.stride(0), K=k,
                                 BLOCK_T=BLOCK_T, BLOCK_H=block_h, num_warps=4)
    return out


def gather_sum(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """:func:`gather_sum_reference` in one Triton pass (each ``src`` row read once per use, each output row written
    once) on CUDA; the reference elsewhere."""
    assert src.dim() == 2 and index.dim() == 2, (src.shape, index.shape)
    if not (HAVE_TRITON and src.is_cuda):
        return gather_sum_reference(src, index)
    return _launch(src, index)


def gather_rows(src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``src [N, h]``, ``rows [T]`` int64 -> ``src[rows]`` ``[T, h]`` (bitwise: one row per sum): the
    :func:`gather_sum` kernel with ``k = 1`` on CUDA, ``index_select`` elsewhere."""
    assert src.dim() == 2 and rows.dim() == 1, (src.shape, rows.shape)
    if not (HAVE_TRITON and src.is_cuda):
        return src.index_select(0, rows)
    return _launch(src, rows.view(-1, 1))
