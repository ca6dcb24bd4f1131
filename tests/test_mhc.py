"""mHC (megatron_glm5.models.mhc) against HF's Glm5NextTextHyperConnection and decoder-layer formulas (fp32, CPU)."""

import copy

import pytest
import torch
import transformers
from transformers.models.glm5_next import modeling_glm5_next as hf_mod

from megatron_glm5.config import Glm5Config, tiny_hf_config
from megatron_glm5.models.mhc import (
    HyperConnection,
    apply_hyper_connection_output,
    contract_streams,
    expand_streams,
    sinkhorn_normalize,
    streams_view,
)
from tests.helpers import rel


def _configs(n, iters):
    d = tiny_hf_config(hc_mult=n)
    d["text_config"]["hc_sinkhorn_iters"] = iters
    ours = Glm5Config.from_hf(d)
    hf = transformers.Glm5NextTextConfig(**d["text_config"])
    return ours, hf


def _close(a, b, tol):
    """rel L2 <= tol, treating two all-zero tensors as equal."""
    return float((a - b).norm()) <= tol * float(b.norm()) + 1e-12


def _pair(n, iters, seed=0):
    ours_cfg, hf_cfg = _configs(n, iters)
    torch.manual_seed(seed)
    hf = hf_mod.Glm5NextTextHyperConnection(hf_cfg)
    with torch.no_grad():
        hf.fn.normal_(0.0, 0.15)
        hf.base.normal_(0.0, 1.0)
        hf.scale.uniform_(0.5, 2.0)
    ours = HyperConnection(ours_cfg, layer_number=1)
    ours.load_state_dict(hf.state_dict())
    return ours, hf, ours_cfg


@pytest.mark.parametrize("n,iters", [(1, 1), (1, 20), (2, 1), (2, 20), (3, 5), (4, 1), (4, 20)])
def test_hyper_connection_matches_hf(n, iters):
    ours, hf, cfg = _pair(n, iters, seed=n * 100 + iters)
    b, s, h = 2, 7, cfg.hidden_size
    x_hf = (torch.randn(b, s, n, h) * 1.7 + 0.3).requires_grad_(True)
    x_ours = x_hf.detach().transpose(0, 1).contiguous().requires_grad_(True)  # [s, b, n, h]

    post_h, comb_h, col_h = hf(x_hf)
    post_o, comb_o, col_o = ours(x_ours)
    assert post_o.dtype == comb_o.dtype == torch.float32 and col_o.dtype == x_ours.dtype
    assert post_o.shape == (s, b, n) and comb_o.shape == (s, b, n, n) and col_o.shape == (s, b, h)
    diffs = {}
    for name, o, r in (("post", post_o, post_h), ("comb", comb_o, comb_h), ("collapsed", col_o, col_h)):
        r = r.transpose(0, 1)
        diffs[name] = float(((o - r).abs().max() / r.abs().max()).detach())
        assert diffs[name] <= 1e-6, (name, diffs[name])

    gp, gc, gx = torch.randn_like(post_o), torch.randn_like(comb_o), torch.randn_like(col_o)
    loss_o = (post_o * gp).sum() + (comb_o * gc).sum() + (col_o * gx).sum()
    loss_h = (post_h * gp.transpose(0, 1)).sum() + (comb_h * gc.transpose(0, 1)).sum() + (col_h * gx.transpose(0, 1)).sum()
    loss_o.backward()
    loss_h.backward()
    grads = {"streams": (x_ours.grad, x_hf.grad.transpose(0, 1))}
    for p in ("fn", "base", "scale"):
        grads[p] = (getattr(ours, p).grad, getattr(hf, p).grad)
    for name, (go, gh) in grads.items():
        assert _close(go, gh, 1e-5), (name, rel(go, gh))
    print(f"n={n} iters={iters} fwd max-rel {diffs} grad rel-L2 "
          + " ".join(f"{k}={rel(*v):.2e}" for k, v in grads.items()))


def test_pass_streams_returns_the_input_on_the_torch_path():
    """``forward(streams, pass_streams=True)`` adds the streams for the output side; off the fused CUDA path (and
    with ``mhc_stream_grad_fusion`` off) that is the input tensor itself, so autograd adds the two gradients."""
    ours, _, cfg = _pair(3, 2)
    ours.plan = ours.plan.replace(mhc_stream_grad_fusion=True)  # only the fused CUDA path routes the gradient
    x = torch.randn(5, 2, 3, cfg.hidden_size, requires_grad=True)
    post, comb, col, passed = ours(x, pass_streams=True)
    assert passed is x
    for a, b in zip((post, comb, col), ours(x)):
        assert torch.equal(a, b)


def test_parameters_and_attributes():
    ours, _, cfg = _pair(3, 5)
    n, h = cfg.hc_mult, cfg.hidden_size
    shapes = {k: tuple(v.shape) for k, v in ours.named_parameters()}
    assert shapes == {"fn": ((2 + n) * n, n * h), "base": ((2 + n) * n,), "scale": (3,)}
    assert ours.base.dtype == ours.scale.dtype == torch.float32
    assert getattr(ours.base, "keep_fp32", False) and getattr(ours.scale, "keep_fp32", False)
    assert not getattr(ours.fn, "keep_fp32", False)
    for p in ours.parameters():
        assert hasattr(p, "sequence_parallel")
    fresh = HyperConnection(cfg)
    assert torch.equal(fresh.base, torch.zeros_like(fresh.base)) and torch.equal(fresh.scale, torch.ones(3))


def test_bf16_streams_keep_fp32_weights():
    ours, _, cfg = _pair(4, 20)
    ours.fn.data = ours.fn.data.to(torch.bfloat16)  # what a bf16 cast that honours keep_fp32 leaves behind
    x = torch.randn(5, 2, 4, cfg.hidden_size).to(torch.bfloat16)
    post, comb, col = ours(x)
    assert post.dtype == comb.dtype == torch.float32 and col.dtype == torch.bfloat16
    assert torch.allclose(comb.sum(-2), torch.ones(()), atol=1e-4)


@pytest.mark.parametrize("iters", [1, 7])
def test_sinkhorn_recompute_is_bitwise_equal(iters):
    torch.manual_seed(iters)
    c0 = (torch.softmax(torch.randn(6, 3, 4, 4) * 3, -1) + 1e-6).requires_grad_(True)
    c1 = c0.detach().clone().requires_grad_(True)
    y0 = sinkhorn_normalize(c0, iters, 1e-6, recompute=False)
    y1 = sinkhorn_normalize(c1, iters, 1e-6, recompute=True)
    assert torch.equal(y0, y1)
    g = torch.randn_like(y0)
    (y0 * g).sum().backward()
    (y1 * g).sum().backward()
    assert torch.equal(c0.grad, c1.grad)


def test_recompute_flag_end_to_end_equal():
    ours, _, cfg = _pair(4, 20)
    other = HyperConnection(cfg, recompute_sinkhorn=False)
    other.load_state_dict(ours.state_dict())
    x = torch.randn(4, 2, 4, cfg.hidden_size)
    outs = []
    for m in (ours, other):
        xx = x.clone().requires_grad_(True)
        post, comb, col = m(xx)
        (post.sum() + (comb * torch.arange(16.0).view(4, 4)).sum() + col.square().sum()).backward()
        outs.append((post, comb, col, xx.grad, m.fn.grad, m.base.grad, m.scale.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_apply_output_matches_hf_formula(n):
    torch.manual_seed(n)
    s, b, h = 5, 3, 16
    block_out = torch.randn(s, b, h)
    residual = torch.randn(s, b, n, h)
    post = torch.rand(s, b, n) * 2
    comb = torch.softmax(torch.randn(s, b, n, n), -1)
    ours = apply_hyper_connection_output(block_out, residual, post, comb)
    # HF layout [b, s, ...]
    ref = post.transpose(0, 1).unsqueeze(-1) * block_out.transpose(0, 1).unsqueeze(-2) + torch.matmul(
        comb.transpose(0, 1).transpose(-1, -2), residual.transpose(0, 1))
    assert ours.shape == (s, b, n, h)
    d = float((ours - ref.transpose(0, 1)).abs().max())
    assert d <= 1e-6, d
    # explicit definition: new[j] = post[j] * out + sum_i comb[i, j] * res[i]
    explicit = post[..., :, None] * block_out[..., None, :] + torch.einsum("sbij,sbih->sbjh", comb, residual)
    assert torch.allclose(ours, explicit, atol=1e-5)


def test_stream_layout_helpers():
    s, b, n, h = 3, 2, 4, 8
    x = torch.randn(s, b, h)
    flat = expand_streams(x, n)
    assert flat.shape == (s, b, n * h)
    hf_streams = x.transpose(0, 1).unsqueeze(2).expand(-1, -1, n, -1)  # HF: [b, s, n, h]
    assert torch.equal(streams_view(flat, n), hf_streams.transpose(0, 1))
    y = torch.randn(s, b, n * h)
    assert torch.allclose(contract_streams(y, n), y.view(s, b, n, h).mean(2))
    assert torch.allclose(contract_streams(expand_streams(x, n), n), x)
    with pytest.raises(ValueError):
        streams_view(torch.randn(2, 2, 10), 4)


def test_full_layer_formula_with_two_sites():
    """Two mHC sites (attention + MLP) around identity-ish blocks equal HF's decoder-layer wiring."""
    ours_a, hf_a, cfg = _pair(3, 5, seed=1)
    ours_f, hf_f, _ = _pair(3, 5, seed=2)
    n, h = 3, cfg.hidden_size
    blk = torch.nn.Linear(h, h)
    x = torch.randn(2, 6, n, h)  # HF [b, s, n, h]

    def hf_layer(hs):
        dtype = hs.dtype
        for site in (hf_a, hf_f):
            res = hs
            post, comb, y = site(hs)
            y = blk(y)
            hs = post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), res)
        return hs

    def our_layer(flat):
        for site in (ours_a, ours_f):
            st = streams_view(flat, n)
            post, comb, y = site(st)
            flat = apply_hyper_connection_output(blk(y), st, post, comb).reshape(flat.shape)
        return flat

    ref = hf_layer(x).mean(2)
    out = contract_streams(our_layer(x.transpose(0, 1).reshape(6, 2, n * h)), n)
    assert float((out - ref.transpose(0, 1)).abs().max() / ref.abs().max()) <= 1e-6


def test_sharded_state_dict_replicated(mcore):
    ours, _, _ = _pair(2, 3)
    sd = ours.sharded_state_dict(prefix="decoder.layers.0.attn_hc.")
    assert set(sd) == {f"decoder.layers.0.attn_hc.{k}" for k in ("fn", "base", "scale")}
    for k, t in sd.items():
        assert t.global_shape == t.local_shape  # not sharded over TP
        assert t.key == k


@pytest.mark.gpu
@pytest.mark.parametrize("n,iters,programs_per_sm", [(4, 20, 4), (3, 5, 4), (4, 20, 0), (5, 3, 0)])
def test_fused_sinkhorn_matches_reference_gpu(n, iters, programs_per_sm, monkeypatch):
    """The Triton Sinkhorn (forward + backward in one kernel each) against the PyTorch op sequence, fp32.
    ``programs_per_sm`` 0: a backward grid of 2 programs, so each walks several token blocks through its scratch."""
    pytest.importorskip("triton")
    from megatron_glm5.kernels import sinkhorn as fused_sinkhorn
    from megatron_glm5.kernels.sinkhorn import sinkhorn
    from megatron_glm5.kernels.sinkhorn import sinkhorn_reference

    if programs_per_sm == 0:
        monkeypatch.setattr(fused_sinkhorn, "BWD_PROGRAMS_PER_SM", 1)
        monkeypatch.setattr(fused_sinkhorn, "_NUM_SMS", 2)

    gen = torch.Generator().manual_seed(n * 100 + iters)
    x = (torch.rand(2, 333, n, n, generator=gen) + 1e-3).softmax(-1).cuda().requires_grad_(True)
    g = torch.randn(2, 333, n, n, generator=gen).cuda()
    y = sinkhorn(x, iters, 1e-6)
    ref = sinkhorn_reference(x, iters, 1e-6)
    (dx,) = torch.autograd.grad((y * g).sum(), x)
    (rdx,) = torch.autograd.grad((ref * g).sum(), x)
    assert torch.isfinite(dx).all()
    assert (y - ref).abs().max().item() < 1e-6
    assert ((dx - rdx).norm() / rdx.norm()).item() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("stream_grad_fusion", [False, True], ids=["autograd-add", "fused-add"])
@pytest.mark.parametrize("n,h,tokens,dtype", [(4, 256, 389, torch.float32), (3, 1100, 130, torch.float32),
                                              (4, 512, 1000, torch.bfloat16), (2, 96, 77, torch.bfloat16)])
def test_fused_mhc_matches_reference_gpu(n, h, tokens, dtype, stream_grad_fusion):
    """The fused mHC kernels (input side: norm + projection + collapse; output side: post * y + comb^T @ streams)
    against the PyTorch module path, forward and every gradient (streams, block output, fn, base, scale), on fresh
    random inputs with ragged sizes (h and the token count not multiples of the block sizes). fp32: to rounding;
    bf16: both against an fp32 run of the PyTorch path on the same (bf16-representable) values. With
    ``mhc_stream_grad_fusion`` the output side's streams gradient reaches the input side's projection kernel
    instead of an autograd add (checked on the Triton interpreter in fp32 when written)."""
    pytest.importorskip("triton")
    from megatron_glm5.kernels import mhc as fused_mhc

    d = tiny_hf_config(hc_mult=n)
    d["text_config"].update(hc_sinkhorn_iters=20, hidden_size=h)
    d["vision_config"]["out_hidden_size"] = h
    cfg = Glm5Config.from_hf(d)
    gen = torch.Generator().manual_seed(n * 1000 + h + tokens)
    hc = HyperConnection(cfg, layer_number=1).cuda()
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=gen) * 0.15)
        hc.base.copy_(torch.randn(hc.base.shape, generator=gen))
        hc.scale.copy_(torch.rand(3, generator=gen) * 1.5 + 0.5)
    fn_bits = hc.fn.detach().to(dtype)  # the fn a bf16 model holds
    streams = (torch.randn(tokens // 2, 2, n, h, generator=gen) * 1.7 + 0.3).to(dtype).cuda()
    block_out = torch.randn(tokens // 2, 2, h, generator=gen).to(dtype).cuda()
    grads = [torch.randn(tokens // 2, 2, *shape, generator=gen).cuda() for shape in ((n,), (n, n), (h,), (n, h))]

    def run(fused, run_dtype):
        mod = copy.deepcopy(hc)
        mod.plan = mod.plan.replace(mhc_fused=fused, mhc_stream_grad_fusion=stream_grad_fusion and fused)
        mod.fn = torch.nn.Parameter(fn_bits.to(run_dtype))
        s = streams.to(run_dtype).clone().requires_grad_(True)
        y = block_out.to(run_dtype).clone().requires_grad_(True)
        post, comb, col, s_out = mod(s, pass_streams=True)
        assert (s_out is s) != mod.plan.mhc_stream_grad_fusion
        new = apply_hyper_connection_output(y, s_out, post, comb, fused=fused)
        assert post.dtype == comb.dtype == torch.float32 and col.dtype == new.dtype == run_dtype
        loss = sum((o.float() * g).sum() for o, g in zip((post, comb, col, new), grads))
        loss.backward()
        return [t.detach().float().clone() for t in (post, comb, col, new, s.grad, y.grad, mod.fn.grad,
                                                     mod.base.grad, mod.scale.grad)]

    names = ("post", "comb", "collapsed", "new", "d_streams", "d_block_out", "d_fn", "d_base", "d_scale")
    out, ref, exact = run(True, dtype), run(False, dtype), run(False, torch.float32)
    assert fused_mhc.HAVE_TRITON
    for name, o, r, e in zip(names, out, ref, exact):
        assert torch.isfinite(o).all(), name
        err, err_ref = rel(o, e), rel(r, e)
        print(f"{dtype} n={n} h={h} T={tokens} {name}: fused {err:.1e} (torch path {err_ref:.1e})")
        if dtype == torch.float32:
            assert err < 2e-5, (name, err)
        else:
            assert err < max(2.0 * err_ref, 1e-4) + 2e-3, (name, err, err_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("n,h,tokens,rows,columns,dtype", [
    (4, 4096, 300, 64, 64, torch.bfloat16), (4, 4096, 300, 32, 128, torch.bfloat16),
    (3, 1000, 77, 64, 64, torch.bfloat16), (5, 333, 64, 16, 32, torch.bfloat16), (1, 96, 5, 64, 64, torch.bfloat16),
    (8, 200, 21, 64, 64, torch.bfloat16), (2, 130, 37, 128, 16, torch.bfloat16), (4, 64, 0, 64, 64, torch.bfloat16),
    (4, 520, 50, 64, 64, torch.float32), (3, 100, 9, 32, 32, torch.float32)])
def test_fused_apply_output_backward_gpu(n, h, tokens, rows, columns, dtype, monkeypatch):
    """The apply-output kernels (``post * y + comb^T @ streams``) against ``apply_output_reference`` on fresh random
    inputs, forward and all four gradients, for the backward's row / column tiles (its block-diagonal coefficient
    dots, its partial d_post / d_comb summed over the column splits), stream counts that are not powers of two,
    token counts that do not fill a tile, zero tokens, and bf16 or fp32 streams. Both are compared with an fp64
    evaluation of the same formula; the fused error must be within 2x of the fp32 reference's."""
    pytest.importorskip("triton")
    from megatron_glm5.kernels import mhc as fused_mhc

    monkeypatch.setattr(fused_mhc, "APPLY_BWD_ROWS", rows)
    monkeypatch.setattr(fused_mhc, "APPLY_BWD_COLUMNS", columns)
    gen = torch.Generator().manual_seed(n * 7 + h + tokens)
    y = torch.randn(tokens, h, generator=gen).to(dtype).cuda()
    s = torch.randn(tokens, n, h, generator=gen).to(dtype).cuda()
    post = torch.rand(tokens, n, generator=gen).cuda() * 2
    comb = torch.rand(tokens, n, n, generator=gen).cuda()
    g = torch.randn(tokens, n, h, generator=gen).to(dtype).cuda()

    def run(fn, run_dtype):  # block output and streams in ``run_dtype``; post / comb fp32 (as the model passes them)
        ins = [t.to(run_dtype if t.dtype == dtype else torch.promote_types(run_dtype, torch.float32)).clone()
               .requires_grad_(True) for t in (y, s, post, comb)]
        out = fn(*ins)
        out.backward(g.to(out.dtype))
        return [out.detach().double()] + [t.grad.double() for t in ins]

    fused = run(fused_mhc.apply_output, dtype)
    exact = run(lambda a, b, c, d: c.unsqueeze(-1) * a.unsqueeze(-2) + torch.matmul(d.transpose(-1, -2), b),
                torch.float64)
    ref = run(fused_mhc.apply_output_reference, torch.float32)
    for name, f, e, r in zip(("new", "d_y", "d_streams", "d_post", "d_comb"), fused, exact, ref):
        assert f.shape == e.shape and torch.isfinite(f).all(), name
        if tokens == 0:
            continue
        err, err_ref = rel(f, e), rel(r, e)
        print(f"n={n} h={h} T={tokens} rows={rows} columns={columns} {dtype} {name}: fused {err:.1e} "
              f"(fp32 {err_ref:.1e})")
        if dtype == torch.bfloat16 and name in ("new", "d_y", "d_streams"):
            assert err < 4e-3, (name, err)  # bf16 outputs round once (2^-9 relative)
        else:  # fp32 results match the fp32 reference's accuracy
            assert err < max(2 * err_ref, 1e-6), (name, err, err_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("n,iters,tokens,programs_per_sm", [(4, 20, 1000, 4), (3, 5, 333, 4), (4, 20, 700, 0),
                                                            (1, 1, 64, 4), (5, 3, 129, 0), (4, 20, 0, 4)])
def test_fused_mhc_weights_match_reference_gpu(n, iters, tokens, programs_per_sm, monkeypatch):
    """``kernels/sinkhorn.py: mhc_weights`` (gates, softmax and Sinkhorn in one kernel each way) against
    ``HyperConnection.weights_from_mixes`` on its PyTorch path, fp32, on fresh random mixes / base / scale: the
    three outputs and the gradients of mixes, base and scale (``programs_per_sm`` 0: two backward programs, each
    walking several token blocks and adding its partial d_base / d_scale)."""
    pytest.importorskip("triton")
    from megatron_glm5.kernels import sinkhorn as fused_sinkhorn

    if programs_per_sm == 0:
        monkeypatch.setattr(fused_sinkhorn, "BWD_PROGRAMS_PER_SM", 1)
        monkeypatch.setattr(fused_sinkhorn, "_NUM_SMS", 2)
    ours_cfg, _ = _configs(n, iters)
    hc = HyperConnection(ours_cfg, layer_number=1).cuda()
    M = (2 + n) * n
    gen = torch.Generator().manual_seed(n * 31 + iters + tokens)
    mixes = (torch.randn(tokens, M, generator=gen) * 2).cuda()
    base = torch.randn(M, generator=gen).cuda()
    scale = (torch.rand(3, generator=gen) * 1.5 + 0.5).cuda()
    grads = [torch.randn(tokens, *shape, generator=gen).cuda() for shape in ((n,), (n,), (n, n))]

    def run(fused):
        hc.plan = hc.plan.replace(mhc_fused=fused)
        ins = [t.clone().requires_grad_(True) for t in (mixes, base, scale)]
        outs = hc.weights_from_mixes(*ins)
        got = torch.autograd.grad(outs, ins, grads)
        return [o.detach() for o in outs] + list(got)

    out, ref = run(True), run(False)
    for name, o, r in zip(("pre", "post", "comb", "d_mixes", "d_base", "d_scale"), out, ref):
        assert o.shape == r.shape and torch.isfinite(o).all(), name
        if tokens:
            assert rel(o, r) < 2e-6, (name, rel(o, r))
