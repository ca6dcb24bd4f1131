"""The indexer loss's target kernels (megatron_glm5/kernels/pool_mass.py) against the PyTorch target of
megatron_glm5/models/indexer_loss.py, which is their reference.

CPU (CI): the kernels run on Triton's interpreter (``TRITON_INTERPRET=1`` is read when the kernels are decorated,
so :func:`_interpreter_checks` runs in a fresh process) on tiny packed rows with document boundaries, documents
shorter than a pool (queries with no candidate), pool tails, unused (-1) slots and empty rows, two head blocks (the
second partly padded), several steps per row, chunks of queries, two batch rows; fp32 and fp16 to 1e-6 relative,
the loss (values and the indexer's gradients) against ``kpool_indexer_kl_reference`` too. (bf16 is left to the GPU:
the interpreter of Triton 3.7.1 multiplies bf16 matrix operands as their uint16 bit patterns.)

GPU: the same comparisons at the released widths (64 heads, latent 512, kpool 4, index_topk 2048, 4096 queries),
fp32 and bf16, and the loss from the kernels against the loss from the PyTorch path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import rel

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _selection(lens, kpool: int, index_topk: int, gen: torch.Generator, holes: float = 0.25) -> torch.Tensor:
    """``[1, s, index_topk + kpool - 1]`` indexer-order selection of a packed row: random visible complete pools of
    the query's document in pool-major slots (a ``holes`` fraction of the pool slots left ``-1``, anywhere), then
    the tail (``kpool_tail_indices``); query 20 selects nothing at all (an empty row)."""
    from megatron_glm5.models.kpool_indexer import kpool_tail_indices
    from megatron_glm5.kernels.documents import document_starts

    s, n_sel = sum(lens), index_topk // kpool
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    pos = torch.arange(s)
    start = document_starts(cu, s)
    n_vis = (pos - start + 1) // kpool                                              # complete visible pools
    rank = torch.rand(s, max(lens) // kpool + n_sel, generator=gen)
    rank = rank.masked_fill(torch.arange(rank.shape[1])[None, :] >= n_vis[:, None], -1.0)
    top, pool = rank.topk(n_sel, dim=-1)                                            # [s, n_sel] local pools
    ok = (top >= 0) & (torch.rand(s, n_sel, generator=gen) >= holes)
    tokens = (start[:, None] + pool * kpool)[..., None] + torch.arange(kpool)      # [s, n_sel, kpool]
    pools = torch.where(ok[..., None], tokens, -1).flatten(1)
    idx = torch.cat([pools, kpool_tail_indices(cu, s, kpool)], dim=-1)[None]
    idx[0, 20] = -1
    return idx


def _features(lens, kpool, index_topk, seed, Hi=4, D=16, holes=0.25):
    """A random packed row's indexer features (pools, documents, selection) with a differentiable indexer side."""
    from types import SimpleNamespace

    from megatron_glm5.models.kpool_indexer import KPoolFeatures, kpool_pool_layout
    from megatron_glm5.kernels.documents import document_ids

    gen = torch.Generator().manual_seed(seed)
    s = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    pool_tokens, pool_doc = kpool_pool_layout(cu, kpool)
    pool_end = pool_tokens[:, -1].contiguous()
    idx = _selection(lens, kpool, index_topk, gen, holes)
    n_sel = index_topk // kpool
    first = idx[..., : index_topk].view(1, s, n_sel, kpool)[..., 0]
    # selected pool numbers: the pool whose first token is `first` (pool_tokens[:, 0] is sorted)
    selected = torch.where(first >= 0, torch.searchsorted(pool_tokens[:, 0].contiguous(), first.clamp(min=0)), -1)
    leaf = SimpleNamespace(q=torch.randn(1, s, Hi, D, generator=gen).requires_grad_(True),
                           pool_keys=torch.randn(1, pool_doc.numel(), D, generator=gen).requires_grad_(True),
                           weights=torch.randn(1, s, Hi, generator=gen).requires_grad_(True))
    feats = KPoolFeatures(q=leaf.q, pool_keys=leaf.pool_keys, weights=leaf.weights, cu_seqlens=cu, offset=0,
                          global_len=s, bounds=cu.tolist(), pool_tokens=pool_tokens, pool_doc=pool_doc,
                          pool_end=pool_end, pool_doc_h=pool_doc, pool_end_h=pool_end,
                          query_doc=document_ids(cu, s), selected_pools=selected)
    return feats, leaf, idx, cu


def released_width_case(dtype):
    """The GPU tests' case at released widths on CUDA: a row of two documents (3000 and 1096 tokens), kpool 4,
    index_topk 2048, 32 index heads of 128, 5 % unused slots (``_features``, its indexer side as CUDA leaves), and
    the attention's side: ``q_lat [1, s, 64, 512]``, ``c [1, s, 512]`` in ``dtype``, the scale and the fused
    attention's ``lse``. Returns ``(feats, leaf, idx, q_lat, c, scale, lse, kpool, index_topk)``."""
    from megatron_glm5.kernels.sparse_mla import sparse_mla

    lens, kpool, index_topk, H, R = [3000, 1096], 4, 2048, 64, 512
    s = sum(lens)
    feats, leaf, idx, _ = _features(lens, kpool, index_topk, seed=1, Hi=32, D=128, holes=0.05)
    dev = torch.device("cuda")
    for f in ("cu_seqlens", "pool_tokens", "pool_doc", "pool_end", "query_doc", "selected_pools"):
        setattr(feats, f, getattr(feats, f).to(dev))
    for n, t in vars(leaf).items():
        cuda_leaf = t.detach().to(dev).requires_grad_(True)
        setattr(leaf, n, cuda_leaf)
        setattr(feats, n, cuda_leaf)
    idx = idx.to(dev)
    gen = torch.Generator(device="cuda").manual_seed(3)
    q_lat = (torch.randn(1, s, H, R, device=dev, generator=gen) * 0.1).to(dtype)
    c = torch.randn(1, s, R, device=dev, generator=gen).to(dtype)
    scale = 192 ** -0.5
    _, lse = sparse_mla(q_lat, c, idx, scale, return_lse=True)
    return feats, leaf, idx, q_lat, c, scale, lse, kpool, index_topk


def _interpreter_checks() -> dict:
    """Runs in a process started with ``TRITON_INTERPRET=1``; returns the measured relative differences."""
    from megatron_glm5.kernels import pool_mass
    from megatron_glm5.kernels.sparse_mla import sparse_mla_reference
    from megatron_glm5.models import indexer_loss as il

    # small tiles: two head blocks (20 heads, 16 per block: the second partly padded), several steps per row
    pool_mass.POOL_MASS_CONFIG.update(BLOCK_H=16, BLOCK_N=16)
    out = {}
    lens, kpool, index_topk, H, R = [3, 4, 21, 2, 30], 4, 16, 20, 16
    feats, leaf, idx, cu = _features(lens, kpool, index_topk, seed=5)
    s = sum(lens)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(1, s, H, 8, generator=gen)
    w_kc = torch.randn(H, 8, R, generator=gen) * 0.5
    c = torch.randn(1, s, R, generator=gen)
    q_lat = torch.einsum("bshd,hdr->bshr", q, w_kc)
    k = torch.einsum("hdr,bsr->bshd", w_kc, c)
    scale = 8 ** -0.5
    _, lse = sparse_mla_reference(q_lat, c, idx, scale, return_lse=True)
    out["empty_rows"] = int((idx < 0).all(-1).sum())

    # kernel level, fp32: sparse (every query in one launch) and dense (a chunk in the middle of the row)
    n_sel = index_topk // kpool
    got = pool_mass.sparse_pool_mass(q_lat, c, idx, lse, scale, kpool, index_topk)
    ref = pool_mass.sparse_pool_mass_reference(q_lat, c, idx, scale, kpool, n_sel, lse)
    out["sparse_mass"] = rel(got, ref)
    out["sparse_mass_nonzero"] = int((ref > 0).sum())
    for tag, (a, e) in (("row", (0, s)), ("chunk", (9, 41))):
        lo, hi = feats.candidate_range(a, e)
        got, vis = il.dense_pool_mass(feats, q_lat, c, scale, a, e, lo, hi, fused=True)
        ref, ref_vis = il.dense_pool_mass(feats, q_lat, c, scale, a, e, lo, hi, fused=False)
        out[f"dense_mass_{tag}"] = rel(got, ref)
        out[f"dense_visible_equal_{tag}"] = bool(torch.equal(vis, ref_vis))
        out[f"dense_rows_without_candidate_{tag}"] = int((~vis.any(-1)).sum())

    # two batch rows (the same document layout in each; the rows' latents differ)
    q2, c2 = torch.cat([q_lat, q_lat.flip(1)]), torch.cat([c, c.roll(7, 1)])
    pools_reversed = idx[..., :index_topk].view(1, s, n_sel, kpool).flip(2).flatten(2)
    idx2 = torch.cat([idx, torch.cat([pools_reversed, idx[..., index_topk:]], -1)])   # row 2: pools in another order
    _, lse2 = sparse_mla_reference(q2, c2, idx2, scale, return_lse=True)
    out["batch2_sparse_mass"] = rel(pool_mass.sparse_pool_mass(q2, c2, idx2, lse2, scale, kpool, index_topk),
                                    pool_mass.sparse_pool_mass_reference(q2, c2, idx2, scale, kpool, n_sel, lse2))
    lo, hi = feats.candidate_range(9, 41)
    out["batch2_dense_mass"] = rel(il.dense_pool_mass(feats, q2, c2, scale, 9, 41, lo, hi, fused=True)[0],
                                    il.dense_pool_mass(feats, q2, c2, scale, 9, 41, lo, hi, fused=False)[0])

    # the loss, values and the indexer's gradients: kernels vs the PyTorch path vs the whole-matrix reference
    for sparse in (False, True):
        grads = {}
        for name, fused in (("kernel", True), ("torch", False)):
            for t in vars(leaf).values():
                t.grad = None
            kl, rows = il.kpool_indexer_kl(feats, q_lat, c, scale, 0.25, idx, kpool, index_topk, sparse,
                                           chunk_elements=200, lse=lse if sparse else None, fused=fused)
            kl.backward()
            grads[name] = (kl.detach(), int(rows), {n: t.grad.clone() for n, t in vars(leaf).items()})
        sel = dict(topk_indices=idx, selected_pools=feats.selected_pools) if sparse else {}
        ref_kl, ref_rows = il.kpool_indexer_kl_reference(leaf.q.detach(), leaf.pool_keys.detach(),
                                                         leaf.weights.detach(), q, k, cu, kpool, scale, 0.25, **sel)
        tag = "sparse" if sparse else "dense"
        (kl_k, rows_k, g_k), (kl_t, rows_t, g_t) = grads["kernel"], grads["torch"]
        out[f"{tag}_rows"] = [rows_k, rows_t, int(ref_rows)]
        out[f"{tag}_loss_vs_reference"] = rel(kl_k, ref_kl)
        out[f"{tag}_loss_vs_torch"] = rel(kl_k, kl_t)
        out[f"{tag}_grad_vs_torch"] = max(rel(g_k[n], g_t[n]) for n in g_t)

    # 16-bit inputs: fp16 (the interpreter's tl.dot multiplies bf16 operands as their uint16 bit patterns, Triton
    # 3.7.1; the kernel's code path is the same for both): 16-bit products, fp32 accumulation, against the fp32 target
    # of the same values
    qh, ch = q_lat.half(), c.half()
    _, lse_h = sparse_mla_reference(qh.float(), ch.float(), idx, scale, return_lse=True)
    out["fp16_sparse_mass"] = rel(pool_mass.sparse_pool_mass(qh, ch, idx, lse_h, scale, kpool, index_topk),
                                  pool_mass.sparse_pool_mass_reference(qh, ch, idx, scale, kpool, n_sel, lse_h))
    lo, hi = feats.candidate_range(0, s)
    out["fp16_dense_mass"] = rel(il.dense_pool_mass(feats, qh, ch, scale, 0, s, lo, hi, fused=True)[0],
                                  il.dense_pool_mass(feats, qh, ch, scale, 0, s, lo, hi, fused=False)[0])
    return out


def run_on_the_interpreter(script: str) -> dict:
    """Run the test file ``script`` as a program under Triton's interpreter (``TRITON_INTERPRET=1`` is read when the
    kernels are decorated, so it needs its own process) and return the JSON its last stdout line holds."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, os.path.abspath(script)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(res)
    return res


@pytest.fixture(scope="module")
def interpreted():
    return run_on_the_interpreter(__file__)


def test_kernels_equal_the_pytorch_target_on_the_interpreter(interpreted):
    """fp32: the per-pool masses and the loss (values, every indexer gradient) to 1e-6 relative; the inputs have
    the edge cases they are meant to have."""
    r = interpreted
    assert r["empty_rows"] >= 1 and r["sparse_mass_nonzero"] > 0
    assert r["dense_rows_without_candidate_row"] == 14 and r["dense_visible_equal_row"]
    assert r["dense_visible_equal_chunk"]
    for key in ("sparse_mass", "dense_mass_row", "dense_mass_chunk", "batch2_sparse_mass", "batch2_dense_mass"):
        assert r[key] <= 1e-6, (key, r[key])
    for tag in ("dense", "sparse"):
        rows = r[f"{tag}_rows"]
        assert rows[0] == rows[1] == rows[2] > 0, rows
        for key in ("loss_vs_reference", "loss_vs_torch", "grad_vs_torch"):
            assert r[f"{tag}_{key}"] <= 1e-6, (tag, key, r[f"{tag}_{key}"])


def test_16bit_inputs_on_the_interpreter(interpreted):
    """16-bit inputs (fp16 here, bf16 on the GPU): the kernel multiplies the 16-bit values exactly and accumulates in
    fp32, as the PyTorch target does after casting them up, so only the summation order differs (measured ~1e-7;
    bound 1e-6)."""
    assert interpreted["fp16_sparse_mass"] <= 1e-6 and interpreted["fp16_dense_mass"] <= 1e-6, interpreted


# ---------------------------------------------------------------------------- GPU, released widths
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_at_released_widths_gpu(dtype):
    """64 heads, latent 512, kpool 4, index_topk 2048 (W = 2051), 4096 queries in documents of 3000 and 1096:
    the sparse mass with the fused attention's lse, the dense mass and both losses equal the PyTorch path's (fp32
    1e-6 relative; bf16 1e-5: the same 16-bit values multiplied exactly, accumulated in fp32 in another order)."""
    from megatron_glm5.kernels import pool_mass
    from megatron_glm5.kernels.sparse_mla import HAVE_TRITON
    from megatron_glm5.models import indexer_loss as il

    if not HAVE_TRITON:
        pytest.skip("needs triton")
    feats, _, idx, q_lat, c, scale, lse, kpool, index_topk = released_width_case(dtype)
    s = q_lat.shape[1]
    tol = 1e-6 if dtype == torch.float32 else 1e-5
    got = pool_mass.sparse_pool_mass(q_lat, c, idx, lse, scale, kpool, index_topk)
    ref = torch.cat([pool_mass.sparse_pool_mass_reference(q_lat[:, a:a + 256], c, idx[:, a:a + 256], scale, kpool,
                                          index_topk // kpool, lse[:, a:a + 256]) for a in range(0, s, 256)], 1)
    assert (ref > 0).sum() > s * 100                            # most of the 512 pool slots are in use
    assert rel(got, ref) <= tol, rel(got, ref)
    a, e = 2900, 3300                                          # across the document boundary
    lo, hi = feats.candidate_range(a, e)
    got, _ = il.dense_pool_mass(feats, q_lat, c, scale, a, e, lo, hi, fused=True)
    ref, _ = il.dense_pool_mass(feats, q_lat, c, scale, a, e, lo, hi, fused=False)
    assert rel(got, ref) <= tol, rel(got, ref)
    with torch.no_grad():
        for sparse in (True, False):
            kl_k, rows_k = il.kpool_indexer_kl(feats, q_lat, c, scale, 128 ** -0.5, idx, kpool, index_topk, sparse,
                                               lse=lse if sparse else None, fused=True)
            kl_t, rows_t = il.kpool_indexer_kl(feats, q_lat, c, scale, 128 ** -0.5, idx, kpool, index_topk, sparse,
                                               lse=lse if sparse else None, fused=False)
            assert int(rows_k) == int(rows_t) > 0
            assert rel(kl_k, kl_t) <= tol, (sparse, kl_k.item(), kl_t.item())


if __name__ == "__main__":
    print(json.dumps(_interpreter_checks()))
