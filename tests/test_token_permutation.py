"""MoE token permutation with the gather-and-sum backward (models/token_permutation.py) against megatron-core's."""

import pytest
import torch
from megatron.core.transformer.moe import moe_utils, token_dispatcher

from megatron_glm5.kernels import gather_sum as gather_sum_mod
from megatron_glm5.models import token_permutation


def _routing(T, E, k, seed, ragged=False):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    routing = torch.zeros(T, E, dtype=torch.bool).scatter_(1, scores.topk(k, dim=1).indices, True)
    if ragged:  # some tokens with fewer than k experts (and one with none)
        drop = torch.rand(T, E, generator=g) < 0.3
        routing &= ~drop
        routing[0] = False
    return routing, torch.rand(T, E, generator=g)


def test_dispatcher_uses_it():
    assert token_dispatcher.permute is token_permutation.permute
    assert token_dispatcher.unpermute is token_permutation.unpermute


@pytest.mark.parametrize("T,E,k,dtype", [(37, 8, 3, torch.float32), (64, 16, 8, torch.float32),
                                         (29, 5, 5, torch.float32), (50, 12, 4, torch.bfloat16)])
def test_matches_megatron_core(T, E, k, dtype):
    """Same permuted rows, probs and indices as upstream; the probs' gradient equal; the token gradient equals
    upstream's index_add_ (fp32: to rounding; bf16: to one rounding of an fp32 sum, upstream rounds once per copy)."""
    routing, probs = _routing(T, E, k, seed=T * E + k)
    h = 24
    x = torch.randn(T, h, generator=torch.Generator().manual_seed(1)).to(dtype)
    grad = torch.randn(int(routing.sum()), h, generator=torch.Generator().manual_seed(2)).to(dtype)

    outs = []
    for fn in (moe_utils.permute, token_permutation.permute):
        xi = x.clone().requires_grad_(True)
        pi = probs.clone().requires_grad_(True)
        permuted, permuted_probs, idx, pad_offsets, _ = fn(xi, routing, probs=pi, num_out_tokens=T * k)
        assert pad_offsets is None
        (permuted.float() * grad.float()).sum().add_((permuted_probs * torch.arange(len(idx))).sum()).backward()
        outs.append((permuted.detach(), permuted_probs.detach(), idx, xi.grad, pi.grad))
    (ref_p, ref_pp, ref_i, ref_gx, ref_gp), (p, pp, i, gx, gp) = outs
    assert torch.equal(p, ref_p) and torch.equal(pp, ref_pp) and torch.equal(i, ref_i)
    assert i.dtype == ref_i.dtype and pp.dtype == ref_pp.dtype
    assert torch.equal(gp, ref_gp)
    exact = torch.zeros(T, h, dtype=torch.float64).index_add_(0, ref_i, grad.double())
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    assert (gx.double() - exact).abs().max() <= tol * exact.abs().max()
    assert (gx.double() - exact).abs().max() <= (ref_gx.double() - exact).abs().max() + tol * exact.abs().max()


def test_ragged_routing():
    """Tokens with fewer than k experts: with ``num_out_tokens = T * k`` (Transformer Engine's contract: exactly k
    each) the call stops with one line instead of returning rows that do not exist; with the routed count (not a
    multiple of the tokens) upstream runs and the results are upstream's, including the token routed nowhere."""
    T, E, k = 40, 10, 4
    routing, probs = _routing(T, E, k, seed=3, ragged=True)
    x = torch.randn(T, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="fewer than 4 experts"):
        token_permutation.permute(x, routing, probs=probs, num_out_tokens=T * k)
    routed = int(routing.sum())
    assert routed % T
    ours = token_permutation.permute(x, routing, probs=probs, num_out_tokens=routed)
    ref = moe_utils.permute(x, routing, probs=probs, num_out_tokens=routed)
    assert len(ours) == len(ref) == 5
    for a, b in zip(ours, ref):
        assert (a is None and b is None) or torch.equal(a, b)


def test_no_grad_and_no_probs():
    """Inference (no autograd) and calls without probs take the same sync-free path and give upstream's results."""
    T, E, k = 33, 7, 2
    routing, _ = _routing(T, E, k, seed=11)
    x = torch.randn(T, 5)
    with torch.no_grad():
        p, pp, i, _, _ = token_permutation.permute(x, routing, num_out_tokens=T * k)
    rp, rpp, ri, _, _ = moe_utils.permute(x, routing, num_out_tokens=T * k)
    assert pp is None and rpp is None and torch.equal(p, rp) and torch.equal(i, ri)


def test_copy_positions_point_at_each_copy():
    routing, _ = _routing(41, 9, 4, seed=7, ragged=True)
    _, _, idx, _, _ = moe_utils.permute(torch.zeros(41, 1), routing, num_out_tokens=int(routing.sum()))
    pos, valid, experts = token_permutation.copy_positions(routing, 4)
    assert pos.shape == valid.shape == experts.shape == (41, 4)
    assert routing.gather(1, experts)[valid].all()
    assert torch.equal(valid.sum(1), routing.sum(1))
    for t in range(41):
        assert sorted(pos[t][valid[t]].tolist()) == sorted((idx == t).nonzero().flatten().tolist())


def test_other_calls_fall_back_to_megatron_core():
    """A tensor count / a drop-and-pad capacity: upstream's function (same results)."""
    routing, probs = _routing(20, 6, 2, seed=3)
    x = torch.randn(20, 8)
    for kw in ({"num_out_tokens": torch.tensor(40)}, {"num_out_tokens": 48, "drop_and_pad": True}):
        a = token_permutation.permute(x, routing, **kw)
        b = moe_utils.permute(x, routing, **kw)
        assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])


@pytest.mark.gpu
def test_matches_megatron_core_gpu():
    """On CUDA in bf16 at training-like sizes: same rows as upstream, and a token gradient at least as close to the
    exact sum as upstream's index_add_."""
    T, E, k, h = 4096, 16, 8, 1024
    routing, probs = _routing(T, E, k, seed=11)
    routing, probs = routing.cuda(), probs.cuda()
    x = torch.randn(T, h, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(T * k, h, device="cuda", dtype=torch.bfloat16)
    res = []
    for fn in (moe_utils.permute, token_permutation.permute):
        xi = x.clone().requires_grad_(True)
        permuted, _, idx, _, _ = fn(xi, routing, probs=probs, num_out_tokens=T * k)
        permuted.backward(grad)
        res.append((permuted.detach(), idx, xi.grad.double()))
    exact = torch.zeros(T, h, dtype=torch.float64, device="cuda").index_add_(0, res[0][1], grad.double())
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])
    err_ours, err_upstream = ((r[2] - exact).abs().max().item() for r in res[::-1])
    assert err_ours <= err_upstream + 1e-6


@pytest.mark.parametrize("T,E,k,h", [(37, 8, 3, 24), (64, 16, 8, 130), (29, 5, 5, 7), (1, 4, 1, 33), (50, 12, 4, 1)])
def test_unpermute_matches_megatron_core(T, E, k, h, monkeypatch):
    """After our permute, our unpermute (gather-and-sum, never upstream's) gives upstream's output to fp32 rounding
    and the very same gradient (each permuted row gets its token's gradient)."""
    routing, _ = _routing(T, E, k, seed=100 * T + E + k)
    gen = torch.Generator().manual_seed(h)
    x = torch.randn(T, h, generator=gen)
    _, _, idx, _, _ = token_permutation.permute(x, routing, num_out_tokens=T * k)
    assert idx.copy_positions.shape == (T, k)
    y = torch.randn(T * k, h, generator=gen)
    w = torch.randn(T, h, generator=gen)

    def upstream_not_called(*a, **kw):
        raise AssertionError("fell back to upstream")

    res = []
    for fn in (moe_utils.unpermute, token_permutation.unpermute):
        yi = y.clone().requires_grad_(True)
        out = fn(yi, idx, restore_shape=torch.Size([T, h]), routing_map=routing)
        (out * w).sum().backward()
        res.append((out.detach(), yi.grad))
        monkeypatch.setattr(token_permutation, "_upstream_unpermute", upstream_not_called)
    (ref, ref_g), (out, g) = res
    assert out.shape == ref.shape == (T, h) and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(g, ref_g)
    with torch.no_grad():
        torch.testing.assert_close(token_permutation.unpermute(y, idx, torch.Size([T, h])), ref, rtol=1e-6, atol=1e-6)


def test_unpermute_bf16_rounds_once():
    """bf16: one rounding of the fp32 sum, at least as close to the exact sum as upstream's bf16 scatter_add_."""
    T, E, k, h = 50, 12, 4, 40
    routing, _ = _routing(T, E, k, seed=5)
    _, _, idx, _, _ = token_permutation.permute(torch.zeros(T, 1), routing, num_out_tokens=T * k)
    y = torch.randn(T * k, h, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    exact = torch.zeros(T, h, dtype=torch.float64).index_add_(0, idx, y.double())
    ours = token_permutation.unpermute(y, idx, torch.Size([T, h]))
    ref = moe_utils.unpermute(y, idx, torch.Size([T, h]))
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, exact.float().to(torch.bfloat16))
    assert (ours.double() - exact).abs().max() <= (ref.double() - exact).abs().max()


def test_unpermute_other_calls_fall_back_to_megatron_core(monkeypatch):
    """probs, drop_and_pad, or indices not from our permute: upstream's function runs (and gives its results)."""
    T, E, k, h = 20, 6, 2, 8
    routing, probs = _routing(T, E, k, seed=3)
    x = torch.randn(T, h)
    _, _, idx, _, _ = token_permutation.permute(x, routing, num_out_tokens=T * k)
    _, _, plain_idx, _, _ = moe_utils.permute(x, routing, num_out_tokens=T * k)
    assert not hasattr(plain_idx, "copy_positions") and torch.equal(idx, plain_idx)
    y = torch.randn(T * k, h)
    calls = []

    def spy(*a, **kw):
        calls.append(kw)
        return moe_utils.unpermute(*a, **kw)

    monkeypatch.setattr(token_permutation, "_upstream_unpermute", spy)
    shape = torch.Size([T, h])
    for args, kw in (((y, idx, shape), {"probs": probs, "routing_map": routing}),
                     ((y, idx, shape), {"drop_and_pad": True}),
                     ((y, plain_idx, shape), {})):
        n = len(calls)
        out = token_permutation.unpermute(*args, **kw)
        assert len(calls) == n + 1
        assert torch.equal(out, moe_utils.unpermute(*args, **kw))
    token_permutation.unpermute(y, idx, shape)
    assert len(calls) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,h,T,k", [(64, 4096, 8, 8), (300, 1000, 77, 3), (17, 1, 9, 1), (40, 2049, 0, 4),
                                     (32768, 4096, 4096, 8), (10, 7, 5, 0)])
def test_gather_sum_matches_reference_gpu(N, h, T, k, dtype):
    """The Triton kernel against the PyTorch reference: fresh random rows and indices (with repeats), odd h, T = 0,
    k = 1; fp32 to summation-order rounding, bf16 within one bf16 rounding of the same fp32 sum."""
    assert gather_sum_mod.HAVE_TRITON
    gen = torch.Generator(device="cuda").manual_seed(N + h + T + k)
    src = torch.randn(N, h, device="cuda", generator=gen).to(dtype)
    idx = torch.randint(0, N, (T, k), device="cuda", generator=gen)
    if T and k > 1:
        idx[0] = idx[0, 0]  # one token with k copies of the same row
    out = gather_sum_mod.gather_sum(src, idx)
    ref = gather_sum_mod.gather_sum_reference(src, idx)
    assert out.shape == (T, h) and out.dtype == dtype and out.device == src.device
    exact = src.double()[idx].sum(1)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        assert ((out.double() - ref.double()).abs() <= 2 ** -7 * ref.double().abs() + 1e-6).all()
        assert ((out.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-5).all()
    # a strided view of the rows (row stride > h)
    wide = torch.randn(N, h + 3, device="cuda", generator=gen).to(dtype)[:, :h]
    torch.testing.assert_close(gather_sum_mod.gather_sum(wide, idx), gather_sum_mod.gather_sum_reference(wide, idx),
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,h,T", [(4096, 4096, 32768), (300, 1000, 77), (17, 1, 9), (40, 2049, 0), (5, 4097, 64)])
def test_gather_rows_is_index_select_gpu(N, h, T, dtype):
    """``gather_rows`` (the permute's gather and the unpermute's backward) is bitwise ``index_select`` on fresh
    random rows and indices (repeats, odd widths, no rows, a strided source)."""
    gen = torch.Generator(device="cuda").manual_seed(N + h + T)
    src = torch.randn(N, h + 2, device="cuda", generator=gen).to(dtype)
    rows = torch.randint(0, N, (T,), device="cuda", generator=gen)
    for s in (src[:, :h].contiguous(), src[:, :h]):
        out = gather_sum_mod.gather_rows(s, rows)
        assert out.shape == (T, h) and out.dtype == dtype
        assert torch.equal(out, s.index_select(0, rows))


@pytest.mark.gpu
def test_unpermute_matches_megatron_core_gpu():
    """On CUDA in bf16 at training-like sizes: output at least as close to the exact sum as upstream's scatter_add_,
    the same gradient."""
    T, E, k, h = 4096, 16, 8, 1024
    routing, _ = _routing(T, E, k, seed=12)
    routing = routing.cuda()
    _, _, idx, _, _ = token_permutation.permute(torch.zeros(T, 1, device="cuda"), routing, num_out_tokens=T * k)
    y = torch.randn(T * k, h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(T, h, device="cuda", dtype=torch.bfloat16)
    res = []
    for fn in (moe_utils.unpermute, token_permutation.unpermute):
        yi = y.clone().requires_grad_(True)
        out = fn(yi, idx, torch.Size([T, h]))
        out.backward(w)
        res.append((out.detach().double(), yi.grad))
    exact = torch.zeros(T, h, dtype=torch.float64, device="cuda").index_add_(0, idx, y.double())
    err_upstream, err_ours = ((r[0] - exact).abs().max().item() for r in res)
    assert err_ours <= err_upstream
    assert torch.equal(res[0][1], res[1][1])


def test_dispatcher_patches_installed():
    assert token_dispatcher.sort_chunks_by_idxs is token_permutation.sort_chunks_by_idxs
    assert (token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize
            is token_permutation._maybe_dtoh_and_synchronize)


def test_identity_chunk_sort_is_skipped():
    """Identity order: the very same tensors come back (no copy); any other order: upstream's split-and-cat."""
    x, p = torch.randn(10, 3), torch.rand(10)
    sizes = torch.tensor([4, 0, 6])
    out, out_p = token_permutation.sort_chunks_by_idxs(x, sizes, torch.arange(3), probs=p)
    assert out is x and out_p is p
    order = torch.tensor([2, 0, 1])
    ours = token_permutation.sort_chunks_by_idxs(x, sizes, order, probs=p)
    ref = moe_utils.sort_chunks_by_idxs(x, sizes, order, probs=p)
    assert torch.equal(ours[0], ref[0]) and torch.equal(ours[1], ref[1])
    assert torch.equal(ours[0], torch.cat([x[4:], x[:4]]))


def test_moe_layer_on_one_rank_keeps_counts_on_device(mcore, monkeypatch):
    """A whole MoE layer (router, all-to-all dispatcher, experts, combine) on one rank: the dispatcher never copies
    its counts to the host, hands the experts a tensor, unpermutes by gather-and-sum, and the output and every
    gradient equal those with megatron-core's own permute, unpermute, chunk sort and host copy (fp32, to rounding)."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_glm5.config import Glm5Config, tiny_hf_config
    from megatron_glm5.models.layer_specs import get_moe_spec

    seen = []
    upstream_dtoh = token_permutation._upstream_dtoh
    unpermute_fallbacks = []

    def spy_upstream_unpermute(*a, **kw):
        unpermute_fallbacks.append(kw)
        return moe_utils.unpermute(*a, **kw)

    monkeypatch.setattr(token_permutation, "_upstream_unpermute", spy_upstream_unpermute)
    gathers = []
    monkeypatch.setattr(token_permutation, "gather_sum",
                        lambda src, index: (gathers.append(index.shape), gather_sum_mod.gather_sum(src, index))[1])

    def spy_dtoh(self, point, tokens_per_expert=None):
        seen.append(token_permutation.keeps_counts_on_device(self))
        return token_permutation._maybe_dtoh_and_synchronize(self, point, tokens_per_expert)

    cfg = Glm5Config.from_hf(tiny_hf_config(with_vision=False), moe_experts_backend="grouped",
                             use_cpu_initialization=True)
    torch.manual_seed(0)
    moe = build_module(get_moe_spec(cfg), config=cfg, layer_number=2)
    moe.experts.plan = moe.experts.plan.replace(grouped_experts_on_cpu=hasattr(torch, "_grouped_mm"))
    received = []
    experts_forward = type(moe.experts).forward
    monkeypatch.setattr(type(moe.experts), "forward",
                        lambda self, x, tpe, probs: (received.append(tpe), experts_forward(self, x, tpe, probs))[1])
    torch.manual_seed(1)
    s = 9
    x = torch.randn(s, 1, cfg.hidden_size)
    w = torch.randn(s, 1, cfg.hidden_size)

    def run():
        moe.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out, _ = moe(xi)
        (out * w).sum().backward()
        return [out.detach(), xi.grad] + [p.grad.clone() for p in moe.parameters() if p.grad is not None]

    monkeypatch.setattr(token_dispatcher.MoEAlltoAllTokenDispatcher, "_maybe_dtoh_and_synchronize", spy_dtoh)
    ours = run()
    assert seen and all(seen)
    assert not unpermute_fallbacks and len(gathers) == 2  # unpermute forward, permute backward
    assert isinstance(received[-1], torch.Tensor) and int(received[-1].sum()) == s * cfg.moe_router_topk
    monkeypatch.setattr(token_dispatcher.MoEAlltoAllTokenDispatcher, "_maybe_dtoh_and_synchronize", upstream_dtoh)
    monkeypatch.setattr(token_dispatcher, "sort_chunks_by_idxs", token_permutation._upstream_sort_chunks)
    monkeypatch.setattr(token_dispatcher, "permute", moe_utils.permute)
    monkeypatch.setattr(token_dispatcher, "unpermute", moe_utils.unpermute)
    ref = run()
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        assert ((a - b).norm() / b.norm().clamp_min(1e-30)).item() < 1e-6
