"""RMSNorm (megatron_glm5.models.norms) against HF's Glm5NextTextRMSNorm formula (CPU), and the fused Triton RMSNorm
(megatron_glm5.kernels.rms_norm) against its PyTorch reference (GPU)."""

import pytest
import torch
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextRMSNorm

from megatron_glm5.models.norms import RMSNorm
from tests.helpers import rel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 2, 64), (3, 4, 2, 48), (7, 40), (0, 2, 16)])
def test_rms_norm_matches_hf_cpu(dtype, shape):
    """Output and both gradients bitwise equal to HF's module (the PyTorch formula), any leading shape and a
    non-contiguous input; the positional ``RMSNorm(hidden_size, eps)`` form."""
    gen = torch.Generator().manual_seed(sum(shape))
    d = shape[-1]
    ours = RMSNorm(d, 1e-6).to(dtype)
    hf = Glm5NextTextRMSNorm(d, eps=1e-6).to(dtype)
    w = (torch.randn(d, generator=gen) * 0.5 + 1).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(w)
        hf.weight.copy_(w)
    base = (torch.randn(*shape[:-1], 2 * d, generator=gen) * 1.7 + 0.3).to(dtype)
    x = base[..., ::2]  # non-contiguous last dim
    g = torch.randn(shape, generator=gen).to(dtype)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ya, yb = ours(xa), hf(xb)
    ya.backward(g)
    yb.backward(g)
    assert ya.dtype == dtype and ya.shape == x.shape
    assert torch.equal(ya, yb)
    assert torch.equal(xa.grad, xb.grad)
    assert torch.equal(ours.weight.grad, hf.weight.grad)


# ============================================================================ GPU: fused kernels
_WIDTHS = [4096, 1536, 512, 128, 1000]


def _leading_shapes(d):
    """[N], [s, b], [s, heads], a single row, zero rows."""
    return [(257,), (37, 2), (19, 8 if d <= 1536 else 3), (), (0, 3)]


def _exact(x, w, eps, g):
    """fp32 reference (output, dx, dw) of the formula on the same (possibly bf16-representable) values."""
    xe = x.float().clone().requires_grad_(True)
    we = w.float().clone().requires_grad_(True)
    from megatron_glm5.kernels.rms_norm import rms_norm_reference

    y = rms_norm_reference(xe, we, eps)
    y.backward(g.float())
    return y.detach(), xe.grad, we.grad


def _run(fn, x, w, eps, g):
    xa = x.clone().requires_grad_(True)
    wa = w.clone().requires_grad_(True)
    y = fn(xa, wa, eps)
    y.backward(g)
    return y.detach(), xa.grad, wa.grad


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", _WIDTHS)
def test_fused_rms_norm_matches_reference_gpu(d, dtype):
    """The fused RMSNorm (one forward kernel, one backward kernel + the sum of its dw partials) against
    ``rms_norm_reference`` on fresh random inputs, for several leading shapes (3-D [s, b, h] and [s, heads, d], a
    single row, zero rows) and a non-contiguous input. fp32: to rounding. bf16: both paths against an fp32 run of the
    reference on the same bf16 values; the fused error must be no worse than the PyTorch bf16 path's (its dx / dw stay
    in fp32 inside, so they are usually better), and its output must equal the PyTorch one except where the fp32 sum
    of squares rounds differently."""
    pytest.importorskip("triton")
    from megatron_glm5.kernels import rms_norm as fused

    eps = 1e-5
    gen = torch.Generator().manual_seed(d + (dtype == torch.float32))
    w = (torch.randn(d, generator=gen) * 0.5 + 1).to(dtype).cuda()
    cases = [(lead, False) for lead in _leading_shapes(d)] + [((23, 2), True)]
    for lead, transposed in cases:
        shape = (*lead, d)
        x = (torch.randn(shape, generator=gen) * 1.7 + 0.3).to(dtype).cuda()
        if transposed:  # [b, s, h] -> [s, b, h] view: non-contiguous
            x = x.transpose(0, 1)
        g = torch.randn(x.shape, generator=gen).to(dtype).cuda()
        assert fused.fused_rms_norm_applies(x, w)
        out = _run(fused.fused_rms_norm, x, w, eps, g)
        ref = _run(fused.rms_norm_reference, x, w, eps, g)
        exact = _exact(x, w, eps, g)
        for name, o, r, e in zip(("y", "dx", "dw"), out, ref, exact):
            assert o.dtype == r.dtype == dtype and o.shape == r.shape, (name, shape, o.dtype, o.shape)
            assert torch.isfinite(o).all(), (name, shape)
            if not o.numel() or not e.abs().max() > 0:
                assert torch.equal(o, r), (name, shape)  # zero rows: empty output / dx, zero dw
                continue
            err, err_ref = rel(o, e), rel(r, e)
            print(f"{dtype} {shape}{' (transposed)' if transposed else ''} {name}: fused {err:.1e} "
                  f"(torch path {err_ref:.1e})")
            if dtype == torch.float32:
                assert err < 2e-6, (name, shape, err)
            else:
                assert err < 1.2 * err_ref + 1e-4, (name, shape, err, err_ref)
        if dtype == torch.bfloat16 and out[0].numel():  # the same rounding of the normalised value and the product
            differ = (out[0] != ref[0]).float().mean().item()
            assert differ < 1e-3, (shape, differ)


@pytest.mark.gpu
def test_fused_rms_norm_persistent_grid_gpu(monkeypatch):
    """A backward grid of 3 programs (each loops over many row blocks) gives the same gradients as the default grid
    to fp32 summation order, the same bits when run twice (no atomics), and the same dx with a frozen weight."""
    pytest.importorskip("triton")
    from megatron_glm5.kernels import rms_norm as fused

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1001, 3, 512, generator=gen).bfloat16().cuda()
    w = (torch.randn(512, generator=gen) * 0.5 + 1).bfloat16().cuda()
    g = torch.randn(x.shape, generator=gen).bfloat16().cuda()
    default = _run(fused.fused_rms_norm, x, w, 1e-6, g)
    monkeypatch.setattr(fused, "_NUM_SMS", 3)
    monkeypatch.setattr(fused, "BWD_PROGRAMS_PER_SM", 1)
    small = _run(fused.fused_rms_norm, x, w, 1e-6, g)
    again = _run(fused.fused_rms_norm, x, w, 1e-6, g)
    assert torch.equal(default[0], small[0]) and torch.equal(default[1], small[1])
    assert rel(small[2], default[2]) < 1e-2  # bf16 dw: one rounding apart at most
    assert all(torch.equal(a, b) for a, b in zip(small, again))
    xa = x.clone().requires_grad_(True)  # frozen weight: no dw partials
    fused.fused_rms_norm(xa, w, 1e-6).backward(g)
    assert torch.equal(xa.grad, default[1])


@pytest.mark.gpu
def test_rms_norm_module_fused_path_gpu():
    """The module takes the fused path on CUDA (bf16 weight and input) and matches its PyTorch formula; a weight of
    another dtype (fp32 weight, bf16 input: fp32 output) and a width over ``MAX_D`` keep the formula."""
    pytest.importorskip("triton")
    from megatron_glm5.kernels import rms_norm as fused

    gen = torch.Generator().manual_seed(3)
    for d, wdtype in ((1536, torch.bfloat16), (1536, torch.float32), (fused.MAX_D + 16, torch.bfloat16)):
        norm = RMSNorm(hidden_size=d, eps=1e-6).to(device="cuda", dtype=wdtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(d, generator=gen) * 0.5 + 1)
        x = torch.randn(9, 2, d, generator=gen).bfloat16().cuda()
        assert fused.fused_rms_norm_applies(x, norm.weight) == (wdtype == torch.bfloat16 and d <= fused.MAX_D)
        y = norm(x)
        norm.plan = norm.plan.replace(rms_norm_fused=False)
        y_ref = norm(x)
        assert y.dtype == y_ref.dtype == torch.promote_types(x.dtype, wdtype)
        assert rel(y, y_ref) < 5e-3
