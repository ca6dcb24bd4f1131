"""The Triton kernels of megatron_glm5/kernels/ that had only GPU tests, on Triton's interpreter (CPU CI): forward
and backward against their PyTorch references on tiny shapes whose tiles are shrunk (the modules' tile constants set
in the interpreted process) so that every launch has several programs, partial last blocks, widths that are not
powers of two and, for the persistent grids, programs that walk several blocks.

The file runs itself as a program under ``TRITON_INTERPRET=1`` (``run_on_the_interpreter`` of
tests/test_pool_mass.py: the variable is read when the kernels are decorated), which prints one JSON line of measured
relative errors (and the edge-case facts the tests assert); the tests below read it.

Kernels: rms_norm, mhc (input and output side), sinkhorn (Sinkhorn alone and the mHC weights), indexer_scores
(scores and masked sort keys), cross_entropy, glu, short_conv, gather_sum, grouped_wgrad, adam, sparse_mla (forward
and its fp32 and 16-bit backward launch forms, fp32 inputs). fp32 everywhere;
16-bit inputs where a kernel takes them: fp16 (the same code path as bf16 in kernels without bf16 dots), and bf16
to one bf16 step per rounding, because Triton 3.7.1's interpreter converts fp32 to bf16 by truncation (PyTorch
rounds to nearest) and multiplies bf16 ``tl.dot`` operands as their uint16 bit patterns (so the bf16-dot paths,
mHC's bf16 streams and the indexer's ``bf16x3``, are left to the GPU tests). kda, pool_mass and selected_pool_scores
are tested elsewhere.
"""

from __future__ import annotations

import json
import os
import sys
import time
from types import SimpleNamespace

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from test_pool_mass import run_on_the_interpreter  # noqa: E402

from tests.helpers import rel  # noqa: E402

BF16_STEP = 2.0 ** -7
"""bf16's spacing relative to a value (8 significant bits), at most: the interpreter's truncation of an fp32 value to
bf16 moves it by less than that."""
FP16_STEP = 2.0 ** -10
"""fp16's spacing relative to a value (11 significant bits), at most: two roundings to nearest (half a step each)
move an fp32 value by no more."""


def _set(obj, **values):
    """Shrink a kernel module's tiles (attributes or config-dict keys), refusing names it does not have (a renamed
    constant would otherwise leave the default tiles, and the edge cases untested)."""
    for name, value in values.items():
        if isinstance(obj, dict):
            assert name in obj, (name, obj)
            obj[name] = value
        else:
            assert hasattr(obj, name), (obj, name)
            setattr(obj, name, value)


def _run(fn, inputs, grads):
    """``fn(*leaves)`` on fresh leaves of ``inputs``; its outputs' gradients ``grads`` back: ``[outputs..., input
    gradients...]`` (detached)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    torch.autograd.backward(outs, [g.to(o.dtype) for o, g in zip(outs, grads)])
    return [o.detach() for o in outs] + [t.grad for t in leaves]


def _errors(names, got, ref) -> dict:
    return {n: rel(g, r) for n, g, r in zip(names, got, ref)}


def _up(ts):
    return [t.float() for t in ts]


# ---------------------------------------------------------------------------------------------- rms_norm
def _rms_norm() -> dict:
    """x ``[3, 9, 48]`` (27 rows of 48: 64-wide blocks of 4 rows, 7 forward programs, the last with 3 rows; the
    backward's 2 persistent programs walk 4 and 3 row blocks) and x ``[1, 7]`` (one row in a 32-row block)."""
    from megatron_glm5.kernels import rms_norm as k

    _set(k, _FWD_TILE=256, _BWD_TILE=256, _NUM_SMS=2, BWD_PROGRAMS_PER_SM=1)
    eps = 1e-5
    gen = torch.Generator().manual_seed(0)
    names = ("y", "dx", "dw")
    out = {}

    def fused(x, w):
        return k._RMSNormFunction.apply(x, w, eps)

    def ref(x, w):
        return k.rms_norm_reference(x, w, eps)

    for tag, shape in (("rows27_d48", (3, 9, 48)), ("row1_d7", (1, 7))):
        d = shape[-1]
        x = torch.randn(shape, generator=gen) * 1.7 + 0.3
        w = torch.randn(d, generator=gen) * 0.5 + 1
        g = torch.randn(shape, generator=gen)
        got, want = _run(fused, (x, w), (g,)), _run(ref, (x, w), (g,))
        out[tag] = _errors(names, got, want)
        _, rstd = k.rms_norm_fwd(x.view(-1, d), w, eps)
        out[tag]["rstd"] = rel(rstd, torch.rsqrt(x.double().view(-1, d).square().mean(-1) + eps))
        if tag == "rows27_d48":
            xa = x.clone().requires_grad_(True)                     # frozen weight: no dw partials (HAS_DW off)
            fused(xa, w).backward(g)
            out["no_dw_dx_bitwise"] = bool(torch.equal(xa.grad, got[1]))
            for dt in (torch.float16, torch.bfloat16):
                ins = [t.to(dt) for t in (x, w)]
                got16 = _run(fused, ins, (g.to(dt),))
                exact = _run(ref, _up(ins), (g.to(dt).float(),))
                out[str(dt)[6:]] = _errors(names, got16, exact)
                out[str(dt)[6:]]["dtypes_kept"] = all(t.dtype == dt for t in got16)
                if dt == torch.float16:                             # the same formula in fp16, rounded as PyTorch does
                    y16 = ref(*ins)
                    out["fp16_y_differing_from_torch_fp16"] = float((got16[0] != y16).float().mean())
    return out


# ---------------------------------------------------------------------------------------------- mhc
def _weights_fn(n: int, iters: int, hc_eps: float):
    """``HyperConnection.weights_from_mixes`` on its PyTorch path (gates, softmax, Sinkhorn) for ``n`` streams."""
    from megatron_glm5.models.mhc import HyperConnection

    site = SimpleNamespace(hc_mult=n, hc_eps=hc_eps, hc_sinkhorn_iters=iters, recompute_sinkhorn=False,
                           plan=SimpleNamespace(mhc_fused=False))
    return lambda mixes, base, scale: HyperConnection.weights_from_mixes(site, mixes, base, scale)


def _mhc() -> dict:
    """T = 37 tokens of n = 3 streams (padded to 4) of h = 100, fp32. Input side (``hyper_connection``): the
    projection forward over 2 token blocks (the second 5 of 32) x 3 D splits (D = 300: 128, 128, 44), the collapse
    over 2 column blocks of 64, its backward in 16-column steps, the projection backward over 3 D blocks x 2 token
    splits. Output side (``apply_output``): its backward in tiles of 8 tokens (5 blocks, the last 5 tokens) x 4 column
    splits of 32 (the last 4 wide). Both together, with the output side's streams gradient handed to the input
    side's projection kernel (``pass_streams``) and added by autograd; every output and gradient (streams, block
    output, fn, base, scale) against the PyTorch references and autograd."""
    from megatron_glm5.kernels import mhc as k

    _set(k, _COL_BH=64, APPLY_BWD_ROWS=32, APPLY_BWD_COLUMNS=32)
    T, n, h, eps = 37, 3, 100, 1e-6
    M = (2 + n) * n
    gen = torch.Generator().manual_seed(1)
    streams = torch.randn(T, n, h, generator=gen) * 1.7 + 0.3
    fn = torch.randn(M, n * h, generator=gen) * 0.15
    base = torch.randn(M, generator=gen)
    scale = torch.rand(3, generator=gen) * 1.5 + 0.5
    y = torch.randn(T, h, generator=gen)
    grads = [torch.randn(T, *s, generator=gen) for s in ((n,), (n, n), (h,), (n, h))]
    wfn = _weights_fn(n, 5, 1e-6)

    def fused(pass_streams):
        def f(s, fn_, b, sc, y_):
            post, comb, col, *rest = k.hyper_connection(s, fn_, b, sc, wfn, eps, pass_streams=pass_streams)
            return post, comb, col, k.apply_output(y_, rest[0] if pass_streams else s, post, comb)
        return f

    def ref(s, fn_, b, sc, y_):
        pre, post, comb = wfn(k.mixes_reference(s, fn_, eps), b, sc)
        return post, comb, k.collapse_reference(s, pre), k.apply_output_reference(y_, s, post, comb)

    names = ("post", "comb", "collapsed", "new", "d_streams", "d_fn", "d_base", "d_scale", "d_block_out")
    inputs = (streams, fn, base, scale, y)
    want = _run(ref, inputs, grads)
    out = {tag: _errors(names, _run(fused(p), inputs, grads), want)
           for tag, p in (("autograd_add", False), ("pass_streams", True))}
    mixes, _ = k._proj_fwd(streams.view(T, n * h), fn, eps)
    out["mixes"] = rel(mixes, k.mixes_reference(streams, fn, eps))
    return out


# ---------------------------------------------------------------------------------------------- sinkhorn
def _sinkhorn() -> dict:
    """Blocks of 8 tokens; the backward's 2 persistent programs walk several blocks through their scratch.
    ``sinkhorn``: ``[2, 19, n, n]`` (38 tokens: 5 blocks, the last 6) for n = 3 (padded to 4), 5 iterations and n = 4,
    20 iterations, against ``sinkhorn_reference`` and autograd. ``mhc_weights``: mixes ``[38, (2 + n) n]`` (n = 3,
    5 iterations) and ``[5, 3]`` (n = 1, 1 iteration) against ``HyperConnection.weights_from_mixes``: pre, post,
    comb and the gradients of mixes, base, scale (the programs' partial d_base / d_scale summed)."""
    from megatron_glm5.kernels import sinkhorn as k
    from megatron_glm5.kernels.sinkhorn import sinkhorn_reference

    _set(k, BLOCK_T=8, _NUM_SMS=1, BWD_PROGRAMS_PER_SM=2)
    gen = torch.Generator().manual_seed(2)
    out = {}
    for n, iters in ((3, 5), (4, 20)):
        x = (torch.rand(2, 19, n, n, generator=gen) + 1e-3).softmax(-1)
        g = torch.randn(2, 19, n, n, generator=gen)
        got = _run(lambda c: k.sinkhorn(c, iters, 1e-6), (x,), (g,))
        want = _run(lambda c: sinkhorn_reference(c, iters, 1e-6), (x,), (g,))
        out[f"sinkhorn_n{n}_it{iters}"] = _errors(("y", "dx"), got, want)
    names = ("pre", "post", "comb", "d_mixes", "d_base", "d_scale")
    for n, iters, T in ((3, 5, 38), (1, 1, 5)):
        M = (2 + n) * n
        mixes = torch.randn(T, M, generator=gen) * 2
        base = torch.randn(M, generator=gen)
        scale = torch.rand(3, generator=gen) * 1.5 + 0.5
        grads = [torch.randn(T, *s, generator=gen) for s in ((n,), (n,), (n, n))]
        got = _run(lambda m, b, s: k.mhc_weights(m, b, s, n, iters, 1e-6), (mixes, base, scale), grads)
        want = _run(_weights_fn(n, iters, 1e-6), (mixes, base, scale), grads)
        out[f"weights_n{n}_it{iters}_T{T}"] = _errors(names, got, want)
    return out


# ---------------------------------------------------------------------------------------------- indexer_scores
def _indexer_scores() -> dict:
    """q ``[2, 37, 3, 20]`` (query rows strided: a slice of 40), keys ``[2, 40, 20]``, weights ``[2, 37, 3]`` in
    16 x 16 tiles (3 x 3 x 2 programs, partial last tiles; D = 20 padded to 32): fp32 queries (exact fp32 products),
    fp16 and bf16 queries (cast to fp32, ``tf32x3``, which the interpreter runs as fp32 products) against
    ``indexer_scores_reference``, a third of the pools all-negative for a positive query (exact zeros kept); the
    masked sort keys (``indexer_topk_keys``: documents, a pool past the query, whole tiles masked) against
    ``indexer_topk_keys_reference``: masked keys and index bits bitwise, the scores of valid pairs to 1e-6 of the
    largest."""
    from megatron_glm5.kernels import indexer_scores as k

    _set(k.INDEXER_SCORES_CONFIG, BM=16, BN=16)
    b, c, H, D, p = 2, 37, 3, 20, 40
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(b, c + 3, H, D, generator=gen)[:, 3:]
    keys = torch.randn(b, p, D, generator=gen)
    w = torch.randn(b, c, H, generator=gen)
    keys[:, : p // 3] = -keys[:, : p // 3].abs()
    q[0, 0] = q[0, 0].abs()
    scale = D ** -0.5
    out = {}
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        qd = q.to(dt)
        got = k.indexer_scores(qd, keys, w, scale)
        ref = k.indexer_scores_reference(qd, keys, w, scale)
        zero = ref[0, 0] == 0
        out[str(dt)[6:]] = dict(scores=rel(got, ref), max_abs_over_max=float((got - ref).abs().max() / ref.abs().max()),
                                zeros=int(zero.sum()), zeros_exact=bool(torch.equal(got[0, 0][zero], ref[0, 0][zero])))
    first_pos = 5
    bounds = torch.tensor([0, 20, 30, 1000])
    query_doc = torch.searchsorted(bounds, first_pos + torch.arange(c), right=True) - 1
    pool_end = torch.sort(torch.randint(0, first_pos + c + 10, (p,), generator=gen)).values
    pool_doc = torch.searchsorted(bounds, pool_end, right=True) - 1
    got = k.indexer_topk_keys(q, keys, w, scale, query_doc, first_pos, pool_doc, pool_end)
    ref = k.indexer_topk_keys_reference(q, keys, w, scale, query_doc, first_pos, pool_doc, pool_end)
    low = torch.finfo(torch.float32).min

    def decode(key):
        mono = (key >> 32).to(torch.int32)
        return (mono ^ ((mono >> 31) & 0x7FFFFFFF)).view(torch.float32), key & 0xFFFFFFFF

    (gs, gi), (rs, ri) = decode(got), decode(ref)
    masked = rs == low
    tiles = [masked[0, i:i + 16, j:j + 16] for i in range(0, c, 16) for j in range(0, p, 16)]
    out["keys"] = dict(index_bits_equal=bool(torch.equal(gi, ri)), masked=int(masked.sum()), valid=int((~masked).sum()),
                       masked_bitwise=bool(torch.equal(got[masked], ref[masked]) and torch.equal(gs == low, masked)),
                       masked_tiles=sum(int(t.all()) for t in tiles), mixed_tiles=sum(int(t.any() and not t.all())
                                                                                     for t in tiles),
                       valid_scores=float((gs[~masked] - rs[~masked]).abs().max() / rs[~masked].abs().max()),
                       dtype=str(got.dtype))
    return out


# ---------------------------------------------------------------------------------------------- cross_entropy
def _cross_entropy() -> dict:
    """Steps / programs of 64 vocabulary columns (``BLOCK_V``; V = 150: 3, the last 22 wide), the kernels on CPU
    tensors (``_use_triton`` set true). ``row_stats`` / ``softmax_grad`` on x ``[6, 150]`` with targets 0, 149,
    -1 (another shard's) against their references; ``vocab_parallel_cross_entropy`` on logits ``[3, 2, 150]`` (a
    row-strided view) against ``F.cross_entropy`` and its logit gradient: fp32, fp16 and bf16 logits (the 16-bit ones
    against fp32 of the same values)."""
    import torch.nn.functional as F

    from megatron_glm5.kernels import cross_entropy as k

    _set(k, _use_triton=lambda x: True, BLOCK_V=64)
    n, V = 6, 150
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(n, V, generator=gen) * 4
    t = torch.tensor([0, V - 1, -1, 70, 64, -1], dtype=torch.int32)
    m, sum_exp, x_t = k.row_stats(x, t)
    mr, lr, xtr = k.row_stats_reference(x, t)
    lse = mr + torch.log(lr)
    grad = torch.rand(n, generator=gen)
    out = dict(m_bitwise=bool(torch.equal(m, mr)), x_t_bitwise=bool(torch.equal(x_t, xtr)), l=rel(sum_exp, lr),
               softmax_grad=rel(k.softmax_grad(x, t, lse, grad), k.softmax_grad_reference(x, t, lse, grad)))
    wide = torch.randn(3, 2, V + 5, generator=gen) * 4
    target = torch.randint(0, V, (3, 2), generator=gen)
    target[0, 0] = V - 1
    w = torch.rand(3, 2, generator=gen)

    def fused(z):
        return k.vocab_parallel_cross_entropy(z, target) * w

    def ref(z):
        return F.cross_entropy(z.float().reshape(-1, V), target.reshape(-1), reduction="none").view(3, 2) * w

    for dt in (torch.float32, torch.float16, torch.bfloat16):
        z = wide.to(dt)[..., :V]
        got = _run(fused, (z,), (torch.ones(3, 2),))
        want = _run(ref, (z.float(),), (torch.ones(3, 2),))
        out[str(dt)[6:]] = dict(_errors(("loss", "dlogits"), got, want), grad_dtype_kept=got[1].dtype == dt,
                                row_strided=z.stride(1) == V + 5)
    return out


# ---------------------------------------------------------------------------------------------- glu
def _glu() -> dict:
    """y1 ``[11, 2 x 100]``, probs ``[11]`` in blocks of 4 rows (3, the last 3 rows) x 64 columns (2, the last 36;
    the backward steps over them): no clamp, and limit 1.5 with offset 0.5 (gate and up values on both sides of the
    clamp and exactly at +-1.5, where PyTorch's clamp passes the gradient); out, d_y1, d_probs against
    ``grouped_glu`` and autograd. fp32, and fp16 / bf16 ``y1`` against fp32 of the same values."""
    from megatron_glm5.kernels import glu as k
    from megatron_glm5.models.grouped_experts import grouped_glu

    _set(k, _BF=64)
    R, F = 11, 100
    gen = torch.Generator().manual_seed(5)
    y1 = torch.randn(R, 2 * F, generator=gen) * 2
    y1[0, :4] = torch.tensor([1.5, -1.5, 1.5, 3.0])                 # gate at / above the limit
    y1[0, F:F + 4] = torch.tensor([1.5, -1.5, -3.0, 3.0])           # up at both limits and outside
    probs = torch.rand(R, generator=gen)
    g = torch.randn(R, F, generator=gen)
    names = ("out", "d_y1", "d_probs")
    out = {}
    for limit, offset in ((None, 0.0), (1.5, 0.5)):
        cfg = SimpleNamespace(activation_func_clamp_value=limit, activation_func=torch.nn.functional.silu,
                              glu_linear_offset=offset)
        tag = "clamp" if limit else "plain"
        out[tag] = dict(clamped=int((y1.abs() >= 1.5).sum()) if limit else 0)
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            gd = g.to(dt).float()                                  # the 16-bit output's gradient, both runs
            got = _run(lambda y, p: k.clamped_swiglu(y, p, limit, offset), (y1.to(dt), probs), (gd,))
            want = _run(lambda y, p: grouped_glu(y, p, cfg), (y1.to(dt).float(), probs), (gd,))
            out[tag][str(dt)[6:]] = _errors(names, got, want)
    return out


# ---------------------------------------------------------------------------------------------- short_conv
def _short_conv() -> dict:
    """Forward tiles of 8 rows x 32 channels, the backward walking 8-row blocks of 32 channels (c = 40: 2 channel
    blocks, the last 8 wide): x ``[2, 37, 40]`` (a row-strided view), 4 taps, documents ``[0, 1, 2, 8, 9, 16, 30,
    37]`` (one-token documents, documents starting at the backward's row blocks 8 and 16 and inside one); x ``[2, 37,
    40]``, 3 taps, one document; x ``[1, 1, 5]``, 4 taps (one token). y, dx, dw against
    ``short_conv_silu_reference`` and autograd; fp32, fp16 / bf16 x against fp32 of the same values."""
    from megatron_glm5.kernels import short_conv as k
    from megatron_glm5.kernels.documents import document_starts

    _set(k.SHORT_CONV_CONFIG, fwd=dict(BT=8, BC=32, num_warps=4), bwd=dict(ROWS=8, BC=32, num_warps=2))
    gen = torch.Generator().manual_seed(6)
    names = ("y", "dx", "dw")
    out = {}
    for tag, (b, s, c, width, cu) in (("docs_w4", (2, 37, 40, 4, [0, 1, 2, 8, 9, 16, 30, 37])),
                                      ("one_doc_w3", (2, 37, 40, 3, None)), ("one_token_w4", (1, 1, 5, 4, None))):
        x = torch.randn(b, s, c + 8, generator=gen)[..., :c]
        weight = torch.randn(c, width, generator=gen) * 0.5
        dy = torch.randn(b, s, c, generator=gen)
        cu_t = None if cu is None else torch.tensor(cu)
        starts = document_starts(torch.tensor(cu or [0, s]), s).to(torch.int32)
        out[tag] = {}
        for dt in (torch.float32, torch.float16, torch.bfloat16) if tag == "docs_w4" else (torch.float32,):
            xd = x.to(dt)
            dyd = dy.to(dt).float()
            got = _run(lambda xx, ww: k.short_conv_silu(xx, ww, starts), (xd, weight), (dyd,))
            want = _run(lambda xx, ww: k.short_conv_silu_reference(xx, ww, cu_t), (xd.float(), weight), (dyd,))
            out[tag][str(dt)[6:]] = _errors(names, got, want)
    return out


# ---------------------------------------------------------------------------------------------- gather_sum
def _gather_sum() -> dict:
    """Blocks of 4 tokens x 32 columns: src ``[30, 70]`` (3 column blocks, the last 6 wide; also a row-strided view),
    index ``[11, 3]`` (3 token blocks, the last 3 tokens; repeats, one token with 3 copies of one row) against
    ``gather_sum_reference`` (fp32, fp16, bf16) and an fp64 sum; ``k = 1`` (``gather_rows``' launch) bitwise
    ``index_select``; ``h = 1``."""
    from megatron_glm5.kernels import gather_sum as k

    _set(k, BLOCK_H=32)
    N, h, T = 30, 70, 11
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(N, h + 3, generator=gen)
    idx = torch.randint(0, N, (T, 3), generator=gen)
    idx[0] = idx[0, 0]
    out = {}
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        src = wide[:, :h].contiguous().to(dt)
        got = k._launch(src, idx)
        out[str(dt)[6:]] = dict(vs_reference=rel(got, k.gather_sum_reference(src, idx)),
                                vs_fp64=rel(got, src.double()[idx].sum(1)), dtype_kept=got.dtype == dt)
    strided = wide[:, :h]
    out["strided"] = rel(k._launch(strided, idx), k.gather_sum_reference(strided, idx))
    rows = torch.randint(0, N, (T,), generator=gen)
    out["k1_bitwise"] = bool(torch.equal(k._launch(strided, rows.view(-1, 1)), strided.index_select(0, rows)))
    narrow = wide[:, :1].contiguous()
    out["h1"] = rel(k._launch(narrow, idx[:, :2]), k.gather_sum_reference(narrow, idx[:, :2]))
    return out


# ---------------------------------------------------------------------------------------------- grouped_wgrad
def _grouped_wgrad() -> dict:
    """Tiles of 16 x 16 outputs, 8 rows a step, tile rows walked 2 together: x ``[27, 40]`` (a row-strided view),
    dy ``[27, 37]``, 4 groups of 5, 0, 19 and 1 rows (offs ``[5, 5, 24, 25]``: an empty group, partial row steps, two
    trailing rows in none), main_grad ``[4, 37, 40]`` fp32 starting random (3 x 3 tiles a group, partial last ones):
    the accumulated main_grad against an fp64 sum and against ``grouped_wgrad_accum_reference``, for fp32 and fp16
    x / dy; the empty group's slice bitwise unchanged."""
    from megatron_glm5.kernels import grouped_wgrad as k

    _set(k, BLOCK_N=16, BLOCK_K=16, BLOCK_T=8, GROUP_N=2)
    gen = torch.Generator().manual_seed(8)
    T, K, N = 27, 40, 37
    wide = torch.randn(T, K + 5, generator=gen)
    dy = torch.randn(T, N, generator=gen)
    offs = torch.tensor([5, 5, 24, 25], dtype=torch.int32)
    start = torch.randn(4, N, K, generator=gen)
    out = {}
    for dt in (torch.float32, torch.float16):
        x = wide[:, :K].to(dt) if dt == torch.float32 else wide[:, :K].contiguous().to(dt)
        dyd = dy.to(dt)
        got = start.clone()
        k._launch(x, dyd, offs, got)
        want = start.double().clone()
        lo = 0
        for e, hi in enumerate(offs.tolist()):
            want[e] += dyd[lo:hi].double().t() @ x[lo:hi].double()
            lo = hi
        ref = start.clone()
        k.grouped_wgrad_accum_reference(x, dyd, offs, ref)
        out[str(dt)[6:]] = dict(vs_fp64=rel(got, want), vs_reference=rel(got, ref),
                                empty_group_unchanged=bool(torch.equal(got[1], start[1])))
    return out


# ---------------------------------------------------------------------------------------------- adam
def _adam() -> dict:
    """Blocks of 64 elements: 150 elements (two full programs, a partial third), three steps with grad_scale 0.5 from
    random moments; AdamW (decay 0.1), Adam (L2 decay 0.05) and no decay, beta1 0.9 and 0.3 (the lerp's two forms):
    weights and moments against ``adam_step_reference`` (relative); the written ``out`` (bf16, fp16, fp32) against
    the weight rounded to its dtype, in its own steps; the gradient bitwise unchanged."""
    from megatron_glm5.kernels import adam as k

    _set(k, BLOCK=64)
    gen = torch.Generator().manual_seed(9)
    n = 150
    out = {}
    for tag, wd, decoupled, beta1, dt in (("adamw", 0.1, True, 0.9, torch.bfloat16), ("adam_l2", 0.05, False, 0.3,
                                          torch.float16), ("no_decay", 0.0, True, 0.9, torch.float32)):
        w0, m0, v0 = torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.rand(n, generator=gen)
        got, ref = [w0.clone(), m0.clone(), v0.clone()], [w0.clone(), m0.clone(), v0.clone()]
        o = torch.empty(n, dtype=dt)
        unchanged = True
        for step in range(1, 4):
            g = torch.randn(n, generator=gen) * 2
            g0 = g.clone()
            s = k.AdamScalars(lr=1e-2, beta1=beta1, beta2=0.95, eps=1e-8, weight_decay=wd, decoupled=decoupled,
                              step=step, grad_scale=0.5)
            k._launch(*got[:1], g, *got[1:], s, o)
            unchanged &= bool(torch.equal(g, g0))
            k.adam_step_reference(*ref[:1], g, *ref[1:], s)
        step_of = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}[dt]
        out[tag] = dict(weight=rel(got[0], ref[0]), exp_avg=rel(got[1], ref[1]), exp_avg_sq=rel(got[2], ref[2]),
                        out_steps=float(((o.double() - got[0].double()).abs() / got[0].double().abs()).max()
                                        / (2 * step_of)),
                        grad_unchanged=unchanged)
    return out


# ---------------------------------------------------------------------------------------------- sparse_mla
def _sparse_mla() -> dict:
    """fp32 q ``[1, 37, 5, 32]`` (5 heads padded to a 16-head block), kv ``[1, 37, 32]``, 11 slots a query: up to 10
    distinct causal positions in random order with unused slots (-1) between them, query 0's row empty. Forward
    (4 rows a step: several steps, a partial last one) and backward against ``sparse_mla_reference`` and autograd,
    in two launch forms: the fp32 default (the fused backward kernel), the 16-bit default's split (dq kernel, then
    the persistent transposed-form dkv kernel with 3 programs walking the 37 queries), each with and without
    ``prefetch`` (the next step's rows gathered before this step's products)."""
    from megatron_glm5.kernels import sparse_mla as k
    from megatron_glm5.kernels import triton_support

    _set(triton_support, tensor_limits=lambda t: (triton_support.SMEM_BUDGET, False))   # no CUDA device: the sm_90
    #                                                                                      budget, scalar atomics
    gen = torch.Generator().manual_seed(5)
    s, H, R, W = 37, 5, 32, 11
    q = torch.randn(1, s, H, R, generator=gen)
    kv = torch.randn(1, s, R, generator=gen)
    idx = torch.full((1, s, W), -1, dtype=torch.int64)
    for i in range(1, s):
        pos = torch.randperm(i + 1, generator=gen)[:min(i + 1, W - 1)]
        slots = torch.randperm(W, generator=gen)[:pos.numel()]
        idx[0, i, slots] = pos
    scale = R ** -0.5
    g = torch.randn(1, s, H, R, generator=gen)
    want = _run(lambda a, b: k.sparse_mla_reference(a, b, idx, scale), (q, kv), (g,))
    names = ("o", "dq", "dkv")
    fwd, bwd = dict(k.FWD_CONFIG_FP32), dict(k.BWD_CONFIG_FP32)
    split = dict(BLOCK_H=16, BLOCK_N=4, num_warps=4, num_stages=1, split=True, vec_red=0,
                 dkv=dict(form="dkv_t", programs=3))
    out = {}
    for tag, bwd_cfg in (("fused", dict(bwd, BLOCK_N=4)), ("split", split)):
        for prefetch in (0, 1):
            k.FWD_CONFIG_FP32.update(fwd, BLOCK_N=4, prefetch=prefetch)
            k.BWD_CONFIG_FP32.clear()
            k.BWD_CONFIG_FP32.update(bwd_cfg, prefetch=prefetch)
            got = _run(lambda a, b: k.sparse_mla(a, b, idx, scale), (q, kv), (g,))
            out[f"{tag}_prefetch{prefetch}"] = _errors(names, got, want)
    out["empty_row_zero"] = bool(got[0][0, 0].eq(0).all())
    return out


KERNELS = dict(rms_norm=_rms_norm, mhc=_mhc, sinkhorn=_sinkhorn, indexer_scores=_indexer_scores,
               cross_entropy=_cross_entropy, glu=_glu, short_conv=_short_conv, gather_sum=_gather_sum,
               grouped_wgrad=_grouped_wgrad, adam=_adam, sparse_mla=_sparse_mla)


def _interpreter_checks(names=None) -> dict:
    """Runs in a process started with ``TRITON_INTERPRET=1``; returns each kernel's measured errors (and seconds)."""
    out = {}
    for name in names or KERNELS:
        t0 = time.perf_counter()
        out[name] = KERNELS[name]()
        out[name]["seconds"] = round(time.perf_counter() - t0, 2)
    return out


@pytest.fixture(scope="module")
def interpreted():
    return run_on_the_interpreter(__file__)


def _within(errors: dict, bound: float, keys=None):
    """Every (chosen) float in ``errors`` is at most ``bound``."""
    bad = {k: v for k, v in errors.items() if (keys is None or k in keys) and isinstance(v, float) and not v <= bound}
    assert not bad, (bad, bound)


def test_rms_norm(interpreted):
    """``_RMSNormFunction`` (forward kernel, backward kernel + the sum of its dw partials) against
    ``rms_norm_reference`` and autograd: x ``[3, 9, 48]`` (7 forward programs of 4 rows, the last with 3; 2 backward
    programs walking 4 and 3 row blocks) and x ``[1, 7]``, weight ``[48]`` / ``[7]``: y, dx, dw and the saved rstd to
    1e-6 (fp32); with a frozen weight (no dw partials) the same dx bitwise. fp16 / bf16 x and weight (``[3, 9, 48]``)
    against the fp32 reference of the same values, the results in the input's dtype: dx within one rounding (one
    16-bit step, below); y and dw round the formula's ``round(xn)`` too, so two roundings (fp16: still within one
    step; bf16: two steps, measured 6.5e-3 and 4.3e-3); fp16 y bitwise the PyTorch formula in fp16."""
    r = interpreted["rms_norm"]
    for tag in ("rows27_d48", "row1_d7"):
        _within(r[tag], 1e-6)
    assert r["no_dw_dx_bitwise"]
    assert r["float16"]["dtypes_kept"] and r["bfloat16"]["dtypes_kept"], r
    _within(r["float16"], FP16_STEP)
    assert r["fp16_y_differing_from_torch_fp16"] == 0.0, r
    _within(r["bfloat16"], BF16_STEP, ("dx",))
    _within(r["bfloat16"], 2 * BF16_STEP)


def test_mhc(interpreted):
    """``hyper_connection`` + ``apply_output`` (fp32 streams ``[37, 3, 100]``, fn ``[15, 300]``, base ``[15]``, scale
    ``[3]``, block output ``[37, 100]``; tiles in ``_mhc``'s docstring: partial token blocks, D splits, column splits)
    against ``mixes_reference`` / ``weights_from_mixes`` / ``collapse_reference`` / ``apply_output_reference`` and
    autograd, with the streams gradient of the output side added by autograd and handed to the projection kernel
    (``pass_streams``): the projection's mixes, post, comb, collapsed, new streams and the gradients of streams, fn,
    base, block output to 1e-6, d_scale to 5e-6 (3 values, each a sum over 37 x 15 mixes with cancellation:
    PyTorch's own fp32 d_scale is 8e-7 from an fp64 evaluation, the kernel's 1.4e-6 from the fp32 one). The bf16
    streams' path (bf16 dots) is left to the GPU test (module docstring)."""
    r = interpreted["mhc"]
    assert r["mixes"] <= 1e-6, r
    for tag in ("autograd_add", "pass_streams"):
        _within(r[tag], 5e-6, ("d_scale",))
        _within({k: v for k, v in r[tag].items() if k != "d_scale"}, 1e-6)


def test_sinkhorn(interpreted):
    """``sinkhorn`` on ``[2, 19, n, n]`` fp32 (n = 3 padded to 4 with 5 iterations, n = 4 with 20; blocks of 8
    tokens, the last 6; 2 backward programs walking 3 and 2 blocks through their scratch) against
    ``sinkhorn_reference`` and autograd, y and dx; ``mhc_weights`` on mixes ``[38, 15]`` (n = 3, 5 iterations) and
    ``[5, 3]`` (n = 1, 1 iteration) against ``weights_from_mixes``: pre, post, comb, d_mixes, d_base, d_scale (summed
    over the backward programs' partials). All to 1e-6."""
    r = interpreted["sinkhorn"]
    for tag in ("sinkhorn_n3_it5", "sinkhorn_n4_it20", "weights_n3_it5_T38", "weights_n1_it1_T5"):
        _within(r[tag], 1e-6)


def test_indexer_scores(interpreted):
    """``indexer_scores`` (q ``[2, 37, 3, 20]`` a row-strided slice, keys ``[2, 40, 20]``, weights ``[2, 37, 3]``,
    16 x 16 tiles: 3 x 3 x 2 programs, partial last tiles, D padded to 32) for fp32, fp16 and bf16 queries against
    ``indexer_scores_reference`` to 1e-6 (relative, and of the largest score), exact zeros where every head's ReLU is
    0; ``indexer_topk_keys`` (3 documents, query rows from position 5) against ``indexer_topk_keys_reference``: int64,
    the index bits and the masked keys bitwise (fully masked tiles, skipped, and mixed ones present), the valid
    pairs' scores to 1e-6 of the largest."""
    r = interpreted["indexer_scores"]
    for dt in ("float32", "float16", "bfloat16"):
        assert r[dt]["zeros"] > 0 and r[dt]["zeros_exact"], (dt, r[dt])
        _within(r[dt], 1e-6)
    keys = r["keys"]
    assert keys["dtype"] == "torch.int64" and keys["index_bits_equal"] and keys["masked_bitwise"], keys
    assert keys["masked_tiles"] > 0 and keys["mixed_tiles"] > 0 and keys["valid"] > 0, keys
    assert keys["valid_scores"] <= 1e-6, keys


def test_cross_entropy(interpreted):
    """``row_stats`` / ``softmax_grad`` (x ``[6, 150]``, 64-column steps / programs, the last 22 wide; targets 0,
    149, 70, 64 and -1 twice) against their references: max and target logit bitwise, sum of exponentials and the
    gradient to 1e-6. ``vocab_parallel_cross_entropy`` on a row-strided view of logits ``[3, 2, 150]`` against
    ``F.cross_entropy`` and autograd: loss to 1e-6 for fp32, fp16 and bf16 logits (fp32 arithmetic on the same
    values), the logits' gradient in their dtype: fp32 1e-6, fp16 / bf16 one rounding."""
    r = interpreted["cross_entropy"]
    assert r["m_bitwise"] and r["x_t_bitwise"], r
    assert r["l"] <= 1e-6 and r["softmax_grad"] <= 1e-6, r
    for dt, bound in (("float32", 1e-6), ("float16", FP16_STEP), ("bfloat16", BF16_STEP)):
        assert r[dt]["grad_dtype_kept"] and r[dt]["row_strided"], (dt, r[dt])
        assert r[dt]["loss"] <= 1e-6 and r[dt]["dlogits"] <= bound, (dt, r[dt])


def test_glu(interpreted):
    """``clamped_swiglu`` (y1 ``[11, 200]``, probs ``[11]``; 4-row x 64-column blocks, the last 3 rows and 36
    columns) without a clamp and with limit 1.5 / offset 0.5 (values beyond and exactly at +-1.5) against
    ``grouped_glu`` and autograd: out, d_y1, d_probs to 1e-6 in fp32; fp16 / bf16 y1 against fp32 of the same values:
    out and d_y1 (in y1's dtype) within one rounding, d_probs (fp32) to 1e-6."""
    r = interpreted["glu"]
    assert r["clamp"]["clamped"] > 0, r
    for tag in ("plain", "clamp"):
        _within(r[tag]["float32"], 1e-6)
        for dt, bound in (("float16", FP16_STEP), ("bfloat16", BF16_STEP)):
            _within(r[tag][dt], bound, ("out", "d_y1"))
            _within(r[tag][dt], 1e-6, ("d_probs",))


def test_short_conv(interpreted):
    """``short_conv_silu`` (8-row x 32-channel forward tiles, 8-row backward blocks; tiles and documents in
    ``_short_conv``'s docstring) on x ``[2, 37, 40]`` with 4 taps and 7 documents (one-token ones, boundaries at the
    backward's blocks), ``[2, 37, 40]`` with 3 taps and one document, ``[1, 1, 5]`` with 4 taps, against
    ``short_conv_silu_reference`` and autograd: y, dx, dw to 1e-6 (fp32); fp16 / bf16 x (4 taps, documents) against
    fp32 of the same values: y and dx within one rounding, dw (fp32) to 1e-6."""
    r = interpreted["short_conv"]
    for tag in ("docs_w4", "one_doc_w3", "one_token_w4"):
        _within(r[tag]["float32"], 1e-6)
    for dt, bound in (("float16", FP16_STEP), ("bfloat16", BF16_STEP)):
        _within(r["docs_w4"][dt], bound, ("y", "dx"))
        _within(r["docs_w4"][dt], 1e-6, ("dw",))


def test_gather_sum(interpreted):
    """The gather-sum kernel (4-token x 32-column blocks) on src ``[30, 70]``, index ``[11, 3]`` (the last token block
    3 tokens, the last column block 6 wide, repeated rows) against ``gather_sum_reference`` and an fp64 sum: fp32 to
    1e-6 (also a row-strided src, and src ``[30, 1]``), fp16 / bf16 within one rounding of both; ``k = 1`` (the
    ``gather_rows`` launch) bitwise ``index_select``."""
    r = interpreted["gather_sum"]
    assert r["k1_bitwise"], r
    assert all(r[dt]["dtype_kept"] for dt in ("float32", "float16", "bfloat16")), r
    _within(r["float32"], 1e-6)
    assert r["strided"] <= 1e-6 and r["h1"] <= 1e-6, r
    _within(r["float16"], FP16_STEP)
    _within(r["bfloat16"], BF16_STEP)


def test_grouped_wgrad(interpreted):
    """The grouped weight-gradient kernel (16 x 16 output tiles, 8-row steps; shapes in ``_grouped_wgrad``'s
    docstring: an empty group, partial tiles and steps, rows past the last group, a row-strided x) accumulated into a
    random fp32 main_grad against an fp64 sum and ``grouped_wgrad_accum_reference`` to 1e-6, fp32 and fp16 inputs;
    the empty group's slice untouched."""
    r = interpreted["grouped_wgrad"]
    for dt in ("float32", "float16"):
        assert r[dt]["empty_group_unchanged"], r
        _within(r[dt], 1e-6)


def test_adam(interpreted):
    """The Adam step kernel (64-element blocks; cases in ``_adam``'s docstring) against ``adam_step_reference``:
    weights and moments to 1e-6 after three steps; ``out`` within one step of its dtype of the updated weight (the
    interpreter truncates to bf16); the gradient left as it was."""
    r = interpreted["adam"]
    for tag in ("adamw", "adam_l2", "no_decay"):
        assert r[tag]["grad_unchanged"], r
        _within(r[tag], 1e-6, ("weight", "exp_avg", "exp_avg_sq"))
        assert r[tag]["out_steps"] <= 1.0, r


def test_sparse_mla(interpreted):
    """The sparse MLA kernels (cases in ``_sparse_mla``'s docstring) against ``sparse_mla_reference`` and autograd:
    o, dq and dkv to 1e-6 in each launch form, with and without ``prefetch``; the empty row's output zero."""
    r = interpreted["sparse_mla"]
    for tag in ("fused_prefetch0", "fused_prefetch1", "split_prefetch0", "split_prefetch1"):
        _within(r[tag], 1e-6)
    assert r["empty_row_zero"], r


if __name__ == "__main__":
    print(json.dumps(_interpreter_checks(sys.argv[1:] or None)))
