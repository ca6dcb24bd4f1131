"""The indexer's scores at the selected pools (megatron_glm5/kernels/selected_pool_scores.py) against their
PyTorch reference (``selected_pool_scores_reference``, the loss's PyTorch path, and its autograd), and the sparse
indexer loss that runs on them against the loss's chunked PyTorch path.

CPU (CI): Triton's interpreter (``TRITON_INTERPRET=1``, in a fresh process as in tests/test_pool_mass.py) on tiny
random inputs: two batch rows, head count and selection width not multiples of the tiles (padded heads, a partial
last step), unused (-1) slots anywhere and a query with none used, pools repeated across queries (the backward's
atomics add into the same rows); fp32, fp16 and bf16 queries (the kernels cast them to fp32 before the products, so
the interpreter's bf16 products, see test_pool_mass.py, are not involved), forward and the three gradients to 1e-6
relative. The whole ``kpool_indexer_kl(fused=True)``
(sparse, with the attention's ``lse``, a context-parallel padding cut ``row_length``) against ``fused=False``.

GPU: the released widths (32 index heads, D 128, 512 selected pools, 4096 queries), fp32 and bf16 queries.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from test_pool_mass import _features, released_width_case, run_on_the_interpreter  # noqa: E402

from tests.helpers import rel  # noqa: E402


def _random_case(b, s, H, D, P, n, gen, device="cpu"):
    """Random indexer tensors and a selection of ``n`` distinct pools per query out of ``P`` (so most pools are
    selected by many queries), a quarter of the slots ``-1`` and query 3 selecting nothing."""
    q = torch.randn(b, s, H, D, generator=gen)
    keys = torch.randn(b, P, D, generator=gen)
    w = torch.randn(b, s, H, generator=gen)
    sel = torch.rand(b, s, P, generator=gen).argsort(-1)[..., :n]
    sel = sel.masked_fill(torch.rand(b, s, n, generator=gen) < 0.25, -1)
    sel[:, 3] = -1
    dout = torch.randn(b, s, n, generator=gen)
    return [t.to(device) for t in (q, keys, w, sel, dout)]


def _compare(q, keys, w, sel, dout, scale) -> dict:
    """Forward and gradients of the kernel against ``selected_pool_scores_reference`` (unused slots masked to 0) and autograd."""
    from megatron_glm5.kernels.selected_pool_scores import selected_pool_scores
    from megatron_glm5.kernels.selected_pool_scores import selected_pool_scores_reference

    res = {}
    for name in ("kernel", "torch"):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, keys, w)]
        if name == "kernel":
            out = selected_pool_scores(*leaves, sel, scale)
        else:
            out = selected_pool_scores_reference(*leaves, sel.clamp(min=0), scale).masked_fill(sel < 0, 0.0)
        out.backward(dout)
        res[name] = [out.detach()] + [t.grad for t in leaves]
    k, t = res["kernel"], res["torch"]
    return dict(logits=rel(k[0], t[0]), dq=rel(k[1].float(), t[1].float()), dkeys=rel(k[2], t[2]),
                dweights=rel(k[3], t[3]), unused_logits_zero=bool((k[0][sel < 0] == 0).all()),
                dq_dtype_kept=k[1].dtype == q.dtype, relu_zeros=int((t[0] == 0).sum()))


def _interpreter_checks() -> dict:
    """Runs in a process started with ``TRITON_INTERPRET=1``; returns the measured relative differences."""
    from megatron_glm5.kernels import selected_pool_scores as sps
    from megatron_glm5.kernels.sparse_mla import sparse_mla_reference
    from megatron_glm5.models import indexer_loss as il

    sps.SELECTED_POOL_SCORES_CONFIG.update(BLOCK_N=16, bwd_BLOCK_N=16)       # 40 slots: two full steps, a partial
    out = {}
    gen = torch.Generator().manual_seed(0)
    q, keys, w, sel, dout = _random_case(2, 13, 20, 16, 50, 40, gen)
    out["fp32"] = _compare(q, keys, w, sel, dout, 0.25)
    out["fp16"] = _compare(q.half(), keys, w, sel, dout, 0.25)
    out["bf16"] = _compare(q.bfloat16(), keys, w, sel, dout, 0.25)

    # the sparse loss: kernels (one pass) against the chunked PyTorch path, with a CP padding cut
    lens, kpool, index_topk, H, R = [3, 4, 21, 2, 30], 4, 16, 20, 16
    feats, leaf, idx, _ = _features(lens, kpool, index_topk, seed=5, Hi=4, D=16)
    s = sum(lens)
    gen = torch.Generator().manual_seed(9)
    q_lat = torch.randn(1, s, H, R, generator=gen) * 0.5
    c = torch.randn(1, s, R, generator=gen)
    scale = 8 ** -0.5
    _, lse = sparse_mla_reference(q_lat, c, idx, scale, return_lse=True)
    for row_length in (None, s - 9):
        got = {}
        for fused in (True, False):
            for t in vars(leaf).values():
                t.grad = None
            kl, rows = il.kpool_indexer_kl(feats, q_lat, c, scale, 0.25, idx, kpool, index_topk, True,
                                           chunk_elements=200, row_length=row_length, lse=lse, fused=fused)
            kl.backward()
            got[fused] = (kl.detach(), int(rows), {n: t.grad.clone() for n, t in vars(leaf).items()})
        tag = f"loss_cut{row_length}" if row_length else "loss"
        out[tag] = dict(rows=[got[True][1], got[False][1]], kl=rel(got[True][0], got[False][0]),
                        grads=max(rel(got[True][2][n], got[False][2][n]) for n in got[False][2]),
                        kl_value=float(got[False][0]))
    return out


@pytest.fixture(scope="module")
def interpreted():
    return run_on_the_interpreter(__file__)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_kernel_forward_and_gradients_on_the_interpreter(interpreted, dtype):
    """Logits, dq, dpool_keys, dweights to 1e-6 relative; unused slots give exactly 0; the inputs have ReLU zeros.
    ``dq`` comes in the queries' dtype, rounded from fp32 as autograd rounds it: fp16 1e-5 (the rare value whose
    fp32 sums straddle a rounding point), bf16 1e-2 (Triton 3.7.1's interpreter converts fp32 to bf16 by
    truncation, PyTorch rounds to nearest: one bf16 step, ~4e-3 measured)."""
    r = interpreted[dtype]
    assert r["unused_logits_zero"] and r["dq_dtype_kept"] and r["relu_zeros"] > 100, r
    for key in ("logits", "dkeys", "dweights"):
        assert r[key] <= 1e-6, (key, r)
    assert r["dq"] <= {"fp32": 1e-6, "fp16": 1e-5, "bf16": 1e-2}[dtype], r


def test_sparse_loss_in_one_pass_equals_the_chunked_pytorch_path_on_the_interpreter(interpreted):
    """``kpool_indexer_kl(fused=True)`` (mass and logits kernels over all queries, one KL) equals the chunked PyTorch
    path to 1e-6 relative, values and every indexer gradient, the same rows counted; with ``row_length`` the cut
    rows drop out of both."""
    full, cut = interpreted["loss"], next(v for k, v in interpreted.items() if k.startswith("loss_cut"))
    for r in (full, cut):
        assert r["rows"][0] == r["rows"][1] > 0 and r["kl_value"] > 0, r
        assert r["kl"] <= 1e-6 and r["grads"] <= 1e-6, r
    assert cut["rows"][0] < full["rows"][0], (cut, full)


# ---------------------------------------------------------------------------- GPU, released widths
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_released_widths_gpu(dtype):
    """32 index heads, D 128, 512 selected pools of 1024 (4096 queries, kpool 4): the kernel's logits and
    ``dweights`` against ``selected_pool_scores_reference`` + autograd to 1e-5 of their norm (TF32x3 products,
    atomics), ``dq`` and
    ``dpool_keys`` to 3e-3 (the backward's TF32 products, and the ReLU: a score within rounding of 0 lands on the
    other side of it in one of the two computations and moves a whole term; ~9e-4 measured on an H100); the sparse
    loss from the kernels against the PyTorch path (64 heads, latent 512): value 1e-5, indexer gradients 3e-3."""
    from megatron_glm5.kernels.sparse_mla import HAVE_TRITON
    from megatron_glm5.models import indexer_loss as il

    if not HAVE_TRITON:
        pytest.skip("needs triton")
    gen = torch.Generator().manual_seed(0)
    q, keys, w, sel, dout = _random_case(1, 4096, 32, 128, 1024, 512, gen, device="cuda")
    r = _compare(q.to(dtype), keys, w, sel, dout, 128 ** -0.5)
    assert r["unused_logits_zero"] and r["dq_dtype_kept"], r
    for key in ("logits", "dweights"):
        assert r[key] <= 1e-5, (key, r)
    for key in ("dq", "dkeys"):
        assert r[key] <= (3e-3 if key != "dq" or dtype == torch.float32 else 1e-2), (key, r)

    feats, leaf, idx, q_lat, c, scale, lse, kpool, index_topk = released_width_case(dtype)
    got = {}
    for fused in (True, False):
        for t in vars(leaf).values():
            t.grad = None
        kl, rows = il.kpool_indexer_kl(feats, q_lat, c, scale, 128 ** -0.5, idx, kpool, index_topk, True,
                                       lse=lse, fused=fused)
        kl.backward()
        got[fused] = (kl.detach(), int(rows), {n: t.grad.clone() for n, t in vars(leaf).items()})
    assert got[True][1] == got[False][1] > 0
    assert rel(got[True][0], got[False][0]) <= 1e-5, (got[True][0].item(), got[False][0].item())
    for n in got[False][2]:
        assert rel(got[True][2][n], got[False][2][n]) <= 3e-3, (n, rel(got[True][2][n], got[False][2][n]))


if __name__ == "__main__":
    print(json.dumps(_interpreter_checks()))
