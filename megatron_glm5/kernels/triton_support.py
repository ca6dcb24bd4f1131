"""The kernels' one optional import of Triton (on a machine without it ``triton`` and ``tl`` are None and
``HAVE_TRITON`` is False, and the models run the PyTorch references), and the helpers several kernels share.

Shared by the kernels over a query's selected latent rows (:mod:`~megatron_glm5.kernels.sparse_mla`,
:mod:`~megatron_glm5.kernels.pool_mass`, :mod:`~megatron_glm5.kernels.selected_pool_scores`): the device's
shared-memory budget (:func:`device_limits`, :func:`tensor_limits`), the forward tiling cut to it
(:func:`fit_gather_tiling`), heads per program (:func:`block_h`), the dot precision of a dtype
(:func:`dot_precision`), and the Triton functions that load a query's heads (``program_query``) and gather its
selected rows (``gather_selected``).
"""

import functools
import os
from typing import Tuple

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "LOG2E", "SMEM_BUDGET", "block_h", "cache_dir", "device_limits", "dot_precision",
           "fit_gather_tiling", "tensor_limits", "tl", "triton"]

LOG2E = 1.4426950408889634
"""``log2(e)``: the kernels' softmax runs in ``exp2`` (scores scaled by it, log-sum-exps in log2 units)."""
SMEM_BUDGET = 200 * 1024
"""Shared-memory bytes a program may plan for on sm_90 (which allows 227 KiB per block); block sizes are halved
until the estimate fits, so wider latents than the released 512 still compile. Other devices get
:func:`device_limits`' budget."""


def cache_dir() -> str:
    """The folder of Triton's disk cache: compiled kernels and, with ``TRITON_CACHE_AUTOTUNING=1`` (set by the
    training entry), autotuning results. Triton's own setting where it has one (``TRITON_CACHE_DIR``, default
    ``~/.triton/cache``)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return str(knobs.cache.dir)
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


@functools.lru_cache(maxsize=None)
def device_limits(index: int) -> Tuple[int, bool]:
    """``(shared-memory budget in bytes, 16-byte vector reductions available)`` of CUDA device ``index``: the
    sm_90 budget :data:`SMEM_BUDGET` where the device's opt-in per-block shared memory allows it, else that maximum
    less 8 KiB (the compiler's own use; A100: 155 KiB, sm_86 / sm_89: 91 KiB); ``red.global.add.v4.f32`` from
    compute capability 9.0 on (older devices take scalar atomics). With these the kernels compile on any device
    Triton supports; the execution plan still picks them only on sm_90."""
    props = torch.cuda.get_device_properties(index)
    optin = int(getattr(props, "shared_memory_per_block_optin", 0) or 0) or SMEM_BUDGET + 8 * 1024
    return min(SMEM_BUDGET, optin - 8 * 1024), (props.major, props.minor) >= (9, 0)


def tensor_limits(t: torch.Tensor) -> Tuple[int, bool]:
    """:func:`device_limits` of the CUDA device ``t`` lives on."""
    return device_limits(t.device.index if t.device.index is not None else torch.cuda.current_device())


def fit_gather_tiling(cfg: dict, R: int, budget: int = SMEM_BUDGET) -> dict:
    """A gathering forward's tiling (``BLOCK_H``, ``BLOCK_N``, ``num_stages``) cut until q ``[BLOCK_H, R]`` and
    ``num_stages`` buffers of gathered rows ``[BLOCK_N, R]`` (16-bit) fit ``budget`` bytes: ``BLOCK_N`` halved down
    to 32, then fewer stages, then ``BLOCK_N`` down to 16, then ``BLOCK_H`` halved."""
    t = dict(cfg)

    def need():
        return (t["BLOCK_H"] + t["num_stages"] * t["BLOCK_N"]) * R * 2

    while need() > budget and t["BLOCK_N"] > 32:
        t["BLOCK_N"] //= 2
    while need() > budget and t["num_stages"] > 1:
        t["num_stages"] -= 1
    while need() > budget and t["BLOCK_N"] > 16:
        t["BLOCK_N"] //= 2
    while need() > budget and t["BLOCK_H"] > 16:
        t["BLOCK_H"] //= 2
    return t


def block_h(H: int, cap: int = 0) -> int:
    """Heads per program: ``H`` padded to a power of two (at least 16, the matrix product's smallest tile), at most
    ``cap`` (0: no cap)."""
    padded = triton.next_power_of_2(H)
    return max(16, min(int(cap), padded) if cap else padded)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for operands of ``dtype``: ``'ieee'`` for fp32 (exact fp32 products),
    ``'tf32'`` otherwise (16-bit operands take the tensor cores whatever the setting)."""
    return "ieee" if dtype == torch.float32 else "tf32"


if HAVE_TRITON:

    @triton.jit
    def program_query(Q, t, hb, stride_qt, stride_qh, H, R: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_N: tl.constexpr):
        """Query row ``t`` (int64), head block ``hb``: head / latent / slot offsets and its ``q [BLOCK_H, R]`` block."""
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_r = tl.arange(0, R)
        offs_nb = tl.arange(0, BLOCK_N)
        h_ok = offs_h < H
        q = tl.load(Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_r[None, :], mask=h_ok[:, None],
                    other=0.0)
        return t, offs_h, offs_r, offs_nb, h_ok, q

    @triton.jit
    def gather_selected(IDX, KV, t, stride_it, stride_kvt, n0, n_end, offs_nb, offs_r):
        """Rows ``n0 .. n0 + BLOCK_N`` of this query's selection: ``(rows int64, ok, kv [BLOCK_N, R])``."""
        offs_n = n0 + offs_nb
        idx = tl.load(IDX + t * stride_it + offs_n, mask=offs_n < n_end, other=-1)
        ok = idx >= 0
        rows = idx.to(tl.int64)
        kv = tl.load(KV + rows[:, None] * stride_kvt + offs_r[None, :], mask=ok[:, None], other=0.0)
        return rows, ok, kv
