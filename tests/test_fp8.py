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
