"""Block-FP8 (e4m3, 128x128 ``weight_scale_inv``) dequantisation and quantisation of HF GLM-5.3 weights.

``weight_scale_inv`` is an fp32 grid [ceil(out/bo), ceil(in/bi)]; despite its name it *multiplies*:
``w = fp8.float() * scale`` block-wise, cropped at the edges for sizes that are not multiples of the block.
The block size comes from ``quantization_config.weight_block_size`` when given and is checked against the grid.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Optional, Sequence

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def _block_sizes(shape, scale_shape, block_size: Optional[Sequence[int]]):
    rows, cols = shape
    srows, scols = scale_shape
    if block_size is not None:
        bo, bi = int(block_size[0]), int(block_size[1])
        if math.ceil(rows / bo) != srows or math.ceil(cols / bi) != scols:
            raise ValueError(f"weight_scale_inv grid {tuple(scale_shape)} does not match weight {tuple(shape)} "
                             f"with block size {bo}x{bi}")
        return bo, bi
    bo = 128 if math.ceil(rows / 128) == srows else math.ceil(rows / srows)
    bi = 128 if math.ceil(cols / 128) == scols else math.ceil(cols / scols)
    return bo, bi


def dequantize_fp8_reference(weight: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                             block_size: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The plain definition: weight [out, in] float8_e4m3fn, scale_inv [ceil(out/bo), ceil(in/bi)] fp32 ->
    ``(weight.float() * scale expanded to [out, in]).to(out_dtype)``."""
    if weight.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(f"FP8 weight and scale must be 2-D, got {tuple(weight.shape)} and {tuple(scale_inv.shape)}")
    bo, bi = _block_sizes(weight.shape, scale_inv.shape, block_size)
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
    return (weight.float() * scale).to(out_dtype)


_TWO_POW_120 = 2.0 ** 120
# int32 mask of the sign bit and of bits 26..20, where ``code << 20`` puts the 7 bits ``eeeemmm`` of an e4m3 code
_CODE_BITS = 0x87F00000 - (1 << 32)
_CHUNK_ELEMENTS = 1 << 20
_scratch = threading.local()  # per thread: the int32 chunk buffer, reused call after call


def _chunk_buffer(n: int) -> torch.Tensor:
    buf = getattr(_scratch, "bits", None)
    if buf is None or buf.numel() < n:
        buf = _scratch.bits = torch.empty(max(n, _CHUNK_ELEMENTS), dtype=torch.int32)
    return buf[:n]


def dequantize_fp8_blockwise(weight: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                             block_size: Optional[Sequence[int]] = None, out: Optional[torch.Tensor] = None, *,
                             checked: bool = False) -> torch.Tensor:
    """Bitwise equal to :func:`dequantize_fp8_reference`, several times faster on CPU (torch converts fp8 to float
    one element at a time): every e4m3 code ``s eeee mmm`` placed in the fp32 bit pattern ``s 0000eeee mmm0...``
    is exactly ``value * 2^-120`` (subnormals included), so ``value * scale`` is that float times ``scale * 2^120``
    (the same exact product, so the same rounding). Per element: the int8 code sign-extended to int32, shifted by
    20 and masked (``s 1111eeee mmm`` -> ``s 0000eeee mmm``), one multiply, one cast into ``out``, about
    ``_CHUNK_ELEMENTS`` at a time (whole block rows) through a per-thread int32 buffer. Few, large torch calls: each
    releases and retakes the GIL, which is what several converting threads contend for.

    ``out``: a contiguous ``[out, in]`` tensor of ``out_dtype`` to write into (reusing one saves the page faults of
    a fresh allocation). NaN codes give NaN, as in the reference (that rare tensor takes the reference path).
    ``checked``: the caller has established that ``weight`` holds no NaN codes and every scale is finite and in
    ``(0, 2^7)`` (those reductions are then skipped)."""
    if weight.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(f"FP8 weight and scale must be 2-D, got {tuple(weight.shape)} and {tuple(scale_inv.shape)}")
    bo, bi = _block_sizes(weight.shape, scale_inv.shape, block_size)
    rows, cols = weight.shape
    if out is not None and (tuple(out.shape) != (rows, cols) or out.dtype != out_dtype or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {out_dtype} tensor of shape {(rows, cols)}")
    if not checked and (weight.dtype != FP8_DTYPE or rows * cols == 0
                        or not float(scale_inv.abs().max()) < 2.0 ** 7 or fp8_nan_count(weight)):
        # (scale * 2^120 would overflow; NaN codes need their own pattern)
        ref = dequantize_fp8_reference(weight, scale_inv, out_dtype, block_size)
        return ref if out is None else out.copy_(ref)
    if out is None:
        out = torch.empty(rows, cols, dtype=out_dtype)
    codes = weight.view(torch.int8)
    col_scale = (scale_inv.float() * _TWO_POW_120).repeat_interleave(bi, 1)  # [gr, gc * bi]
    if col_scale.shape[1] != cols:
        col_scale = col_scale[:, :cols]
    step = bo * max(1, _CHUNK_ELEMENTS // (bo * cols))  # whole block rows
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        bits = _chunk_buffer(n * cols).view(n, cols)
        bits.copy_(codes[r0:r0 + n])  # sign-extended: s 1111111 1111111 1111111 1eeeemmm for negative codes
        bits <<= 20
        bits &= _CODE_BITS
        f = bits.view(torch.float32)
        g0, nb = r0 // bo, -(-n // bo)
        if n == nb * bo:
            f.view(nb, bo, cols).mul_(col_scale[g0:g0 + nb, None, :])
        else:  # the last, partial block row
            f.mul_(col_scale[g0].expand(n, cols) if nb == 1 else col_scale[g0:g0 + nb].repeat_interleave(bo, 0)[:n])
        out[r0:r0 + n].copy_(f)
    return out


def fp8_nan_count(weight: torch.Tensor) -> int:
    """Number of NaN codes (``s 1111 111``: 0x7F and 0xFF) in a float8_e4m3fn tensor (e4m3fn has no inf). Two max
    reductions over the bytes decide "none" (the usual case); only then are they counted."""
    if not weight.numel():
        return 0
    u8 = weight.view(torch.uint8)
    if int(u8.max()) != 0xFF and int(u8.view(torch.int8).max()) != 0x7F:
        return 0
    return int(((u8 & 0x7F) == 0x7F).sum())


def quantize_fp8_blockwise(weight: torch.Tensor, block_size: Sequence[int] = (128, 128)):
    """[out, in] float -> (float8_e4m3fn [out, in], weight_scale_inv fp32 grid). amax/448 per block."""
    bo, bi = int(block_size[0]), int(block_size[1])
    rows, cols = weight.shape
    gr, gc = math.ceil(rows / bo), math.ceil(cols / bi)
    w = torch.zeros(gr * bo, gc * bi, dtype=torch.float32, device=weight.device)
    w[:rows, :cols] = weight.float()
    blocks = w.view(gr, bo, gc, bi)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(gr * bo, gc * bi)[:rows, :cols].contiguous(), scale.float()


FP8_MLP_KEYS = re.compile(r"(mlp\.(gate_proj|up_proj|down_proj)\.weight|"
                          r"mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight|"
                          r"mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight)$")
FP8_DSA_KEYS = re.compile(r"self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)\.weight$")


def is_fp8_in_release(key: str, text_cfg: dict) -> bool:
    """Whether the released checkpoint stores ``key`` as block FP8: DSA q_a/q_b/kv_a/o_proj (not KDA's o_proj),
    dense MLPs, routed and shared experts, in the decoder and in the MTP layer (a DSA layer)."""
    if FP8_MLP_KEYS.search(key):
        return True
    m = re.match(r"model\.language_model\.layers\.(\d+)\.", key)
    if m and FP8_DSA_KEYS.search(key):
        i = int(m.group(1))
        return i >= text_cfg["num_hidden_layers"] or text_cfg["layer_types"][i] == "indexed_attention"
    return False
