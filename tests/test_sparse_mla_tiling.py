"""Sparse MLA launch plans (CPU): which backward kernels run for each input width, and that every planned tiling's
staged operands (forward and backward) fit the shared-memory budget for latents other than the released 512."""

import pytest

from megatron_glm5.kernels import sparse_mla as sm
from megatron_glm5.kernels import triton_support as ts


def _smem(t, fused, R, elem):
    return ((4 if fused else 2) * t["BLOCK_H"] + t["BLOCK_N"]) * R * elem


def test_bf16_default_is_dq_kernel_then_transposed_dkv_kernel():
    plan = sm._bwd_passes(sm.BWD_CONFIG, None, 512)
    assert [(dq, dkv) for dq, dkv, _ in plan] == [(True, False), (False, True)]
    dq_t, dkv_t = plan[0][2], plan[1][2]
    assert "form" not in dq_t and dq_t["BLOCK_H"] == 64 and dq_t["BLOCK_N"] == 64
    assert dkv_t["form"] == "dkv_t" and dkv_t["BLOCK_H"] == 64 and dkv_t["BLOCK_N"] == 64
    # 192 KiB of staged operands each at 64 heads / latent 512 (Triton 3.6 on sm_90 asked 262,400 bytes for the dq
    # kernel with a second stage of rows: over the 232,448 the H200 allows)
    assert _smem(dq_t, False, 512, 2) == 192 * 1024 and _smem(dkv_t, False, 512, 2) == 192 * 1024


def test_fp32_default_is_the_fused_kernel_unfitted():
    plan = sm._bwd_passes(sm.BWD_CONFIG_FP32, None, 0)
    assert len(plan) == 1 and plan[0][:2] == (True, True)
    assert plan[0][2]["BLOCK_H"] == 32 and "form" not in plan[0][2]


@pytest.mark.parametrize("R", [16, 64, 512, 1024, 2048])
def test_every_tiling_fits_the_budget(R):
    for cfg in (sm.BWD_CONFIG, sm.BWD_CONFIG_FP32):
        for dq, dkv, t in sm._bwd_passes(cfg, None, R):
            assert _smem(t, dq and dkv, R, 2) <= ts.SMEM_BUDGET or (t["BLOCK_H"] == 16 and t["BLOCK_N"] == 16)
            assert t["BLOCK_H"] >= 16 and t["BLOCK_N"] >= 16
    wide = sm._bwd_passes(sm.BWD_CONFIG, None, 1024)
    assert (wide[0][2]["BLOCK_H"], wide[0][2]["BLOCK_N"]) == (32, 16)          # 160 KiB at latent 1024
    assert (wide[1][2]["BLOCK_H"], wide[1][2]["BLOCK_N"]) == (32, 16)


def test_explicit_passes_pick_their_own_tilings():
    plan = sm._bwd_passes(sm.BWD_CONFIG, [(False, True)], 512)
    assert len(plan) == 1 and plan[0][2]["form"] == "dkv_t"
    fused = sm._bwd_passes(sm.BWD_CONFIG, [(True, True)], 512)
    assert "form" not in fused[0][2]                                           # the fused kernel has no dkv^T form


@pytest.mark.parametrize("R", [16, 64, 512, 1024, 2048, 4096])
def test_forward_tiling_fits_the_budget(R):
    t = ts.fit_gather_tiling(sm.FWD_CONFIG, R)
    need = (t["BLOCK_H"] + t["num_stages"] * t["BLOCK_N"]) * R * 2
    assert need <= ts.SMEM_BUDGET or (t["BLOCK_H"] == 16 and t["BLOCK_N"] == 16 and t["num_stages"] == 1)
    if R <= 512:                                   # the released latent keeps the default (measured fastest)
        assert t == sm.FWD_CONFIG
    if R == 1024:                                  # rows down to 32 first, then one stage
        assert (t["BLOCK_H"], t["BLOCK_N"], t["num_stages"]) == (64, 32, 1)
