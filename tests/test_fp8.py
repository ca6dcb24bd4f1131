"""Block-FP8 (e4m3 + 128x128 weight_scale_inv) dequantisation against transformers' own, and edge blocks."""

import math

import pytest
import torch

from megatron_glm5.checkpoint.fp8 import dequantize_fp8_blockwise, is_fp8_in_release, quantize_fp8_blockwise


def _transformers_dequant(w, s, dtype):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(hf_quantizer=None)._dequantize_one(w, s, output_dtype=dtype)


@pytest.mark.parametrize("shape", [(256, 384), (128, 128), (64, 48), (512, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequant_equals_transformers(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=g) * 0.05
    q, s = quantize_fp8_blockwise(w)
    s = s * (1 + 0.5 * torch.rand(s.shape, generator=g))  # independent scales per block
    ours = dequantize_fp8_blockwise(q, s, out_dtype=dtype, block_size=[128, 128])
    ref = _transformers_dequant(q, s, dtype)
    assert ours.dtype == ref.dtype == dtype
    assert torch.equal(ours, ref)


def test_edge_blocks_against_a_loop():
    """Sizes that are not multiples of 128: the scale grid covers partial blocks and is cropped."""
    g = torch.Generator().manual_seed(0)
    rows, cols = 300, 200
    q = (torch.randn(rows, cols, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(math.ceil(rows / 128), math.ceil(cols / 128), generator=g) + 0.1
    ours = dequantize_fp8_blockwise(q, s, out_dtype=torch.float32, block_size=[128, 128])
    ref = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            ref[i, j] = q[i, j].float() * s[i // 128, j // 128]
    assert torch.equal(ours, ref)
    # without a weight_block_size the block comes from the grid (128 here)
    assert torch.equal(dequantize_fp8_blockwise(q, s, out_dtype=torch.float32), ref)


def test_quantise_round_trip_and_grid_checks():
    w = torch.randn(300, 260) * 0.02
    q, s = quantize_fp8_blockwise(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 3)
    back = dequantize_fp8_blockwise(q, s, out_dtype=torch.float32)
    assert ((back - w).abs() <= 0.07 * w.abs() + 1e-6 * s.max()).float().mean() > 0.99
    with pytest.raises(ValueError, match="does not match"):
        dequantize_fp8_blockwise(q, s[:2], block_size=[128, 128])


def test_release_fp8_set():
    text = {"num_hidden_layers": 4, "layer_types": ["linear_attention", "indexed_attention"] * 2}
    lm = "model.language_model.layers."
    assert is_fp8_in_release(lm + "1.self_attn.o_proj.weight", text)
    assert not is_fp8_in_release(lm + "0.self_attn.o_proj.weight", text)  # KDA o_proj is BF16
    assert is_fp8_in_release(lm + "1.self_attn.q_a_proj.weight", text)
    assert not is_fp8_in_release(lm + "1.self_attn.kv_b_proj.weight", text)
    assert not is_fp8_in_release(lm + "1.self_attn.indexer.wq_b.weight", text)
    assert is_fp8_in_release(lm + "2.mlp.experts.7.up_proj.weight", text)
    assert is_fp8_in_release(lm + "2.mlp.shared_experts.down_proj.weight", text)
    assert not is_fp8_in_release(lm + "2.mlp.gate.weight", text)
    assert is_fp8_in_release(lm + "4.self_attn.o_proj.weight", text)  # the MTP layer is a DSA layer


@pytest.mark.parametrize("shape,block", [((300, 200), (128, 128)), ((129, 1), (128, 128)), ((1, 1000), (128, 128)),
                                         ((96, 64), (32, 16)), ((0, 5), (128, 128))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fast_dequant_is_bitwise_the_reference(shape, block, dtype):
    """The bit-pattern fast path against the plain definition on fresh random codes: every one of the 256 e4m3
    codes (zeros, subnormals, negative, the NaN codes), partial blocks, random positive scales."""
    from megatron_glm5.checkpoint.fp8 import dequantize_fp8_reference, fp8_nan_count

    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes.view(-1)[: min(256, codes.numel())] = torch.arange(min(256, codes.numel()), dtype=torch.uint8)
    q = codes.view(torch.float8_e4m3fn)
    grid = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    s = torch.rand(grid, generator=g) * 10.0 ** torch.randint(-6, 2, grid, generator=g) + 1e-9
    fast = dequantize_fp8_blockwise(q, s, out_dtype=dtype, block_size=block)
    ref = dequantize_fp8_reference(q, s, out_dtype=dtype, block_size=block)
    assert fast.dtype == ref.dtype == dtype and fast.shape == ref.shape
    assert torch.equal(fast.isnan(), ref.isnan()) and torch.equal(fast.nan_to_num(0.0), ref.nan_to_num(0.0))
    assert fp8_nan_count(q) == int(ref.isnan().sum())


def test_all_finite_on_the_bit_pattern():
    from megatron_glm5.checkpoint.hf_io import all_finite

    g = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        x = torch.randn(333, generator=g).to(dtype)
        assert all_finite(x) and all_finite(x[::2]) and all_finite(x[:0])
        for bad in (float("nan"), float("inf"), -float("inf")):
            y = x.clone()
            y[int(torch.randint(0, 333, (1,), generator=g))] = bad
            assert not all_finite(y) and not all_finite(y[::1]), (dtype, bad)


def test_all_finite_every_half_precision_pattern():
    """Every NaN/inf bit pattern of bf16 and fp16 (any sign, any payload), at any lane of a vectorised reduction,
    is found; a tensor of every finite pattern passes."""
    from megatron_glm5.checkpoint.hf_io import all_finite

    g = torch.Generator().manual_seed(2)
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    for dtype, exp in ((torch.bfloat16, 0x7F80), (torch.float16, 0x7C00)):
        bad = every[(every.int() & exp) == exp]
        assert all_finite(every[(every.int() & exp) != exp].view(dtype))
        for n in (1, 33, 4099):
            x = torch.randn(n, generator=g).to(dtype)
            where = torch.randint(0, n, (len(bad),), generator=g)
            for pattern, i in zip(bad.tolist(), where.tolist()):
                y = x.clone()
                y.view(torch.int16)[i] = pattern
                assert not all_finite(y), (dtype, n, pattern, i)


@pytest.mark.parametrize("shape", [(1100, 1024), (300, 200), (129, 4000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fast_path_into_out_and_checked(shape, dtype):
    """The fast path proper (no NaN codes): several chunks and a partial block row, written into a reused ``out``
    and with the reader's ``checked=True``, bitwise the reference."""
    from megatron_glm5.checkpoint.fp8 import dequantize_fp8_reference

    g = torch.Generator().manual_seed(shape[0] + shape[1])
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] ^= 1
    codes.view(-1)[:254] = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    q = codes.view(torch.float8_e4m3fn)
    grid = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    s = torch.rand(grid, generator=g) * 10.0 ** torch.randint(-6, 2, grid, generator=g) + 1e-9
    ref = dequantize_fp8_reference(q, s, out_dtype=dtype)
    out = torch.full(shape, 7.0, dtype=dtype)
    for checked in (False, True):
        got = dequantize_fp8_blockwise(q, s, out_dtype=dtype, out=out, checked=checked)
        assert got is out and torch.equal(out, ref)
    with pytest.raises(ValueError, match="out must be"):
        dequantize_fp8_blockwise(q, s, out_dtype=dtype, out=torch.empty(shape, dtype=torch.float16))


def test_nan_code_count_finds_each_nan_code():
    from megatron_glm5.checkpoint.fp8 import fp8_nan_count

    codes = torch.arange(256, dtype=torch.uint8)
    clean = codes[(codes & 0x7F) != 0x7F]
    assert fp8_nan_count(clean.view(torch.float8_e4m3fn)) == 0
    for nan in (0x7F, 0xFF):
        assert fp8_nan_count(torch.cat([clean, torch.tensor([nan, nan], dtype=torch.uint8)])
                             .view(torch.float8_e4m3fn)) == 2
    assert fp8_nan_count(torch.empty(0, dtype=torch.float8_e4m3fn)) == 0
