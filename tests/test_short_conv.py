"""KDA's fused short convolution + SiLU (megatron_glm5.kernels.short_conv) against its PyTorch reference (GPU), and
the document starts it reads (CPU). The KDA layer with it against FLA's convolution: tests/test_kda.py."""

import pytest
import torch

from megatron_glm5.kernels.documents import document_starts
from megatron_glm5.models.packing import make_packed_seq_params, row_document_starts
from tests.helpers import rel


@pytest.mark.parametrize("cu", [None, [0, 7], [0, 1, 2, 30, 31, 57]])
def test_row_document_starts_match_document_starts(cu):
    s = 57 if cu is None or cu[-1] == 57 else cu[-1]
    psp = None if cu is None else make_packed_seq_params(torch.tensor(cu, dtype=torch.int32))
    got = row_document_starts(psp, s, "cpu")
    want = document_starts(torch.tensor(cu or [0, s]), s)
    assert got.dtype == torch.int32 and torch.equal(got.long(), want)
    assert row_document_starts(psp, s, "cpu") is got or psp is None   # once per PackedSeqParams


def test_wider_convolutions_are_refused():
    from megatron_glm5.kernels.short_conv import MAX_TAPS, short_conv_silu

    with pytest.raises(ValueError, match="taps"):
        short_conv_silu(torch.zeros(1, 8, 4), torch.zeros(4, MAX_TAPS + 1), torch.zeros(8, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b, s, c, width, cu", [
    (1, 300, 96, 4, [0, 1, 2, 40, 41, 200, 300]),     # one-token documents, a tile boundary inside a document
    (2, 77, 130, 3, None),                              # batch rows, channels not a multiple of the tile
    (1, 1000, 512, 4, [0, 1000]),
    (1, 65, 64, 2, [0, 33, 65]),
    (1, 700, 40, 4, [0, 1, 2, 3, 127, 128, 129, 256, 700]),   # documents starting at the backward's row blocks
])
def test_kernel_matches_reference(dtype, b, s, c, width, cu):
    """Output, input gradient and weight gradient on fresh random inputs (a strided input too): fp32 to ~1e-6,
    bf16 within its output rounding."""
    from megatron_glm5.kernels.short_conv import short_conv_silu, short_conv_silu_reference

    pytest.importorskip("triton")
    gen = torch.Generator(device="cuda").manual_seed(b * s + c)
    wide = torch.randn(b, s, 2 * c, device="cuda", generator=gen).to(dtype)
    x = wide[..., ::2] if c % 2 else wide[..., :c]       # not contiguous in channels / in rows
    weight = torch.randn(c, 1, width, device="cuda", generator=gen) * 0.5
    dy = torch.randn(b, s, c, device="cuda", generator=gen).to(dtype)
    psp = None if cu is None else make_packed_seq_params(torch.tensor(cu, dtype=torch.int32))
    starts = row_document_starts(psp, s, "cuda")
    cu_t = None if cu is None else torch.tensor(cu, device="cuda")
    outs = []
    for fn in (lambda xx, ww: short_conv_silu(xx, ww, starts), lambda xx, ww: short_conv_silu_reference(xx, ww, cu_t)):
        xi, wi = x.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
        y = fn(xi, wi)
        y.backward(dy)
        outs.append((y, xi.grad, wi.grad))
    (y, dx, dw), (y_ref, dx_ref, dw_ref) = outs
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == torch.float32
    tol = 2e-6 if dtype == torch.float32 else 8e-3
    print(f"short conv {dtype} {b}x{s}x{c} W={width}: y {rel(y, y_ref):.1e} dx {rel(dx, dx_ref):.1e} "
          f"dw {rel(dw, dw_ref):.1e}")
    assert rel(y, y_ref) < tol
    assert rel(dx, dx_ref) < tol
    assert rel(dw, dw_ref) < (2e-6 if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("width, expect", [(4, "triton"), (2, "triton"), (5, "fla")])
def test_wider_module_convolutions_take_fla(mcore, width, expect):
    """The 'fla_fused' KDA layer runs the fused kernel up to MAX_TAPS taps and FLA's convolution beyond."""
    from megatron_glm5.config import Glm5Config
    from megatron_glm5.models.kda import KimiDeltaAttention, get_kda_module_spec
    from tests.test_kda import _hf_text_dict

    text = _hf_text_dict(hidden_size=64, linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=width)
    cfg = Glm5Config.from_hf({"text_config": text}, kda_backend="fla_fused")
    layer = KimiDeltaAttention(cfg, get_kda_module_spec().submodules, layer_number=1)
    assert layer.conv_kernel_name == expect
