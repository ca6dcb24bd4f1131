"""KPool indexer and KPool DSA attention vs the HF reference (Glm5NextTextIndexer / Glm5NextTextAttention).

Packed rows are compared with HF run on every document separately (HF has no packing).
"""

import os

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextAttention, Glm5NextTextIndexer

from megatron_glm5.config import Glm5Config, tiny_hf_config
from megatron_glm5.models import kpool_dsa
from megatron_glm5.models.kpool_dsa import get_dsa_module_spec
from megatron_glm5.kernels.indexer_scores import stable_topk_reference, tie_ordered_keys
from megatron_glm5.models.kpool_indexer import KPoolIndexer

from megatron_glm5.models.packing import make_packed_seq_params
from tests.helpers import free_port
from megatron.core.transformer.spec_utils import build_module

# Config variants (HF text-config overrides); tiny_hf_config has 4 attention heads, 8 indexer heads, kpool 4, topk 8.
MAIN = dict(index_n_heads=16, index_kpool=4, index_topk=8, index_kpool_always_select_tail=True)
SMALL_K2 = dict(index_n_heads=4, index_kpool=2, index_topk=4, index_kpool_always_select_tail=False,
                num_attention_heads=2, num_key_value_heads=2)
SMALL_K8 = dict(index_n_heads=4, index_kpool=8, index_topk=16, index_kpool_always_select_tail=False,
                num_attention_heads=2, num_key_value_heads=2)
LENS = [13, 29, 22]


def _text_dict(**over):
    t = dict(tiny_hf_config(with_vision=False)["text_config"])
    t.update(over)
    return t


def _configs(backend="torch", **over):
    t = _text_dict(**over)
    ours = Glm5Config.from_hf(dict(t), dsa_backend=backend, use_cpu_initialization=True)  # CPU tensors, GPU or not
    hf = Glm5NextTextConfig(**t)
    hf._attn_implementation = "eager"
    return ours, hf


def _randomize_indexer(ix: torch.nn.Module, antithetic: bool):
    """Random indexer weights with wide spread (HF inits ape/gate to 0/1). ``antithetic``: odd heads' query weights
    are the negated even heads', so never all heads' relu scores vanish (no exact ties with few heads)."""
    with torch.no_grad():
        for p in ix.parameters():
            p.normal_(0.0, 0.5)
        ix.k_norm.weight.add_(1.0)
        if antithetic:
            w = ix.wq_b.weight.view(ix.n_heads, ix.head_dim, -1)
            w[1::2] = -w[0::2]


def _randomize_attention(m: torch.nn.Module, antithetic: bool):
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.startswith("indexer."):
                continue
            if name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    if getattr(m, "indexer", None) is not None:
        _randomize_indexer(m.indexer, antithetic)


def _hf_state(m: torch.nn.Module):
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def _doc_bounds(lens):
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    return cu, [(int(cu[i]), int(cu[i + 1])) for i in range(len(lens))]


def _sets(row):
    return {int(i) for i in row if i >= 0}


# ---------------------------------------------------------------------------- indexer
@pytest.mark.parametrize("over,antithetic", [
    (MAIN, False), (SMALL_K2, True), (SMALL_K8, True), ({**SMALL_K8, "index_kpool_always_select_tail": True}, True),
])
def test_indexer_matches_hf_per_document(mcore, monkeypatch, over, antithetic):
    torch.manual_seed(0)
    cfg, hf_cfg = _configs(**over)
    ours = KPoolIndexer(cfg)
    _randomize_indexer(ours, antithetic)
    hf = Glm5NextTextIndexer(hf_cfg, layer_idx=1)
    hf.load_state_dict(_hf_state(ours))

    cu, bounds = _doc_bounds(LENS)
    s = int(cu[-1])
    x = torch.randn(1, s, cfg.hidden_size)
    qr = torch.randn(1, s, cfg.q_lora_rank)
    got = ours(x.transpose(0, 1), qr.transpose(0, 1), packed_seq_params=make_packed_seq_params(cu))
    assert got.dtype == torch.int32 and got.shape == (1, s, ours.output_width)

    dropped = 0
    for st, en in bounds:
        ref = hf(x[:, st:en], qr[:, st:en], torch.ones(1, en - st, dtype=torch.bool), None)
        for i in range(en - st):
            want = {st + j for j in _sets(ref[0, i])}
            have = _sets(got[0, st + i])
            assert have == want, f"query {st + i} (doc start {st}): {sorted(have)} != {sorted(want)}"
            assert all(st <= j <= st + i for j in have)
            dropped += len(have) < i + 1
    assert dropped > 0, "the indexer never dropped a position; make index_topk smaller"

    # Query chunks of 16 (candidate pool ranges per chunk) select the same sets.
    monkeypatch.setattr(ours, "plan", ours.plan.replace(indexer_score_chunk_elements=1))
    chunked = ours(x.transpose(0, 1), qr.transpose(0, 1), packed_seq_params=make_packed_seq_params(cu))
    assert all(_sets(chunked[0, i]) == _sets(got[0, i]) for i in range(s))

    # Unpacked batch of 2 rows == HF batch.
    xb, qb = torch.randn(2, 21, cfg.hidden_size), torch.randn(2, 21, cfg.q_lora_rank)
    got = ours(xb.transpose(0, 1), qb.transpose(0, 1))
    ref = hf(xb, qb, torch.ones(2, 21, dtype=torch.bool), None)
    for bi in range(2):
        for i in range(21):
            assert _sets(got[bi, i]) == _sets(ref[bi, i])


# ---------------------------------------------------------------------------- attention
def _build(cfg, layer_number):
    return build_module(get_dsa_module_spec(), config=cfg, layer_number=layer_number)


def _run_hf_per_doc(hf, x, bounds, prev=None):
    outs, topks = [], []
    for di, (st, en) in enumerate(bounds):
        o, _, t = hf(x[:, st:en], attention_mask=torch.ones(1, en - st, dtype=torch.bool),
                     prev_topk_indices=None if prev is None else prev[di])
        outs.append(o)
        topks.append(t)
    return torch.cat(outs, dim=1), topks


def _valid_rows(topk):
    """[s] rows whose selection is non-empty (HF's output is undefined on empty rows)."""
    return (topk[0] >= 0).any(-1)


def _grads_check(ours, hf, x_ours, x_hf, tol=1e-4):
    worst = 0.0
    gx = (x_ours.grad - x_hf.grad).norm() / x_hf.grad.norm()
    assert gx <= tol, ("input", gx.item())
    worst = max(worst, gx.item())
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        q = hf_params[name]
        if name.startswith("indexer."):
            assert p.grad is None and q.grad is None, name
            continue
        r = (p.grad - q.grad).norm() / q.grad.norm()
        assert r <= tol, (name, r.item())
        worst = max(worst, r.item())
    return worst


@pytest.mark.parametrize("backend", ["torch", "sparse"])
@pytest.mark.parametrize("over,antithetic,lens", [
    ({}, True, LENS),
    (SMALL_K2, True, [7, 17, 12, 5]),
    (SMALL_K8, True, [19, 33, 9]),
])
def test_attention_matches_hf_per_document(mcore, backend, over, antithetic, lens):
    torch.manual_seed(1)
    cfg, hf_cfg = _configs(backend=backend, **over)
    ours = _build(cfg, layer_number=2)
    ours.sparse_query_chunk = 16  # several query chunks
    _randomize_attention(ours, antithetic)
    hf = Glm5NextTextAttention(hf_cfg, layer_idx=1)
    hf.load_state_dict(_hf_state(ours))

    cu, bounds = _doc_bounds(lens)
    s = int(cu[-1])
    x = torch.randn(1, s, cfg.hidden_size)
    x_ours, x_hf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out, topk = ours(x_ours.transpose(0, 1), packed_seq_params=make_packed_seq_params(cu))
    out = out.transpose(0, 1)
    ref, _ = _run_hf_per_doc(hf, x_hf, bounds)

    rows = _valid_rows(topk)
    if cfg.index_kpool_always_select_tail:
        assert bool(rows.all())
    else:
        assert not bool(rows.all()) and bool((out[0, ~rows] == 0).all())
    err = (out - ref)[:, rows].abs().max().item() / ref[:, rows].abs().max().item()
    assert err <= 1e-5, err

    g = torch.randn_like(ref) * rows[None, :, None]
    (out * g).sum().backward()
    (ref * g).sum().backward()
    worst = _grads_check(ours, hf, x_ours, x_hf)
    print(f"[{backend} {over or 'tiny'}] fwd rel err {err:.2e}, worst grad rel L2 {worst:.2e}")


def test_dense_prefix_layout_lists_each_documents_leading_positions():
    lay = kpool_dsa.dense_prefix_layout([0, 3, 10, 12], prefix=4)
    assert lay.docs_padded.tolist() == [[0, 1, 2, 2], [3, 4, 5, 6], [10, 11, 11, 11]]
    assert lay.valid.tolist() == [[True, True, True, False], [True] * 4, [True, True, False, False]]
    assert lay.dense.tolist() == [0, 1, 2, 3, 4, 5, 6, 10, 11] and lay.rest.tolist() == [7, 8, 9]
    assert kpool_dsa.dense_prefix_layout([0, 5, 9], prefix=6).rest.tolist() == []
    assert kpool_dsa.dense_prefix_layout([0, 9], prefix=0) is None


@pytest.mark.parametrize("over,lens", [
    ({}, [5, 11, 12, 30, 3]),                                    # tiny: topk 8, kpool 4 -> prefix 11
    ({**SMALL_K8, "index_kpool_always_select_tail": True}, [23, 40, 9]),    # topk 16, kpool 8 -> prefix 23
])
def test_dense_prefix_queries_select_every_earlier_position(mcore, over, lens):
    """The premise of the fused backend's dense prefix: with the tail always selected, each document's first
    dense_prefix_length() queries select exactly every position of their document up to themselves, and the next
    query does not (it is the first that drops a pool)."""
    torch.manual_seed(5)
    cfg, _ = _configs(backend="sparse", **over)
    ours = _build(cfg, layer_number=2)
    _randomize_attention(ours, antithetic=True)
    cu, bounds = _doc_bounds(lens)
    x = torch.randn(int(cu[-1]), 1, cfg.hidden_size)
    _, topk = ours(x, packed_seq_params=make_packed_seq_params(cu))
    prefix = ours.dense_prefix_length()
    assert prefix == cfg.index_topk + cfg.index_kpool - 1
    for a, e in bounds:
        for i in range(a, e):
            assert (_sets(topk[0, i]) == set(range(a, i + 1))) == (i - a < prefix), i


@pytest.mark.parametrize("lens,b", [([5, 11, 12, 30, 3], 1), ([5, 9], 1), ([40], 1), ([7], 1), (None, 2)])
def test_fused_backend_dense_prefix_equals_the_reference(mcore, monkeypatch, lens, b):
    """The 'fused' backend's split (dense causal attention for each document's leading queries, the sparse path for
    the rest) gives the masked dense reference's output and gradients: packed rows with documents shorter and longer
    than the prefix, one long document, one short one, and an unpacked batch. The sparse kernel's own part is
    stood in for by the 'sparse' backend (same contract; the kernel has its own tests)."""
    torch.manual_seed(6)
    cfg, _ = _configs(backend="torch")
    ref = _build(cfg, layer_number=2)
    _randomize_attention(ref, antithetic=True)
    fused = _build(cfg, layer_number=2)
    fused.load_state_dict(ref.state_dict())
    fused.backend = "fused"
    calls = []

    def sparse_stand_in(q, kv_lat, topk_indices, return_lse=False):
        calls.append(q.shape[0])
        return fused._attention_sparse(q, kv_lat, topk_indices)

    monkeypatch.setattr(fused, "_attention_fused_all", sparse_stand_in)
    if lens is None:
        s, psp = 29, None
    else:
        cu, _ = _doc_bounds(lens)
        s, psp = int(cu[-1]), make_packed_seq_params(cu)
    x = torch.randn(s, b, cfg.hidden_size)
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    outs = [m(xi, packed_seq_params=psp)[0] for m, xi in zip((ref, fused), xs)]
    prefix = fused.dense_prefix_length()
    bounds = [0, s] if lens is None else cu.tolist()
    n_dense = sum(min(e - a, prefix) for a, e in zip(bounds[:-1], bounds[1:]))
    assert calls == ([s - n_dense] if s > n_dense else [])
    err = (outs[1] - outs[0]).abs().max().item() / outs[0].abs().max().item()
    assert err <= 1e-5, err
    g = torch.randn_like(outs[0])
    for o in outs:
        (o * g).sum().backward()
    assert (xs[1].grad - xs[0].grad).norm() / xs[0].grad.norm() <= 1e-5
    for (name, p), q in zip(fused.named_parameters(), ref.parameters()):
        if p.grad is not None or q.grad is not None:
            assert (p.grad - q.grad).norm() / q.grad.norm() <= 1e-5, name


@pytest.mark.parametrize("backend", ["torch", "sparse"])
def test_attention_unpacked_batch_matches_hf_sdpa(mcore, backend):
    torch.manual_seed(2)
    cfg, hf_cfg = _configs(backend=backend)
    hf_cfg._attn_implementation = "sdpa"
    ours = _build(cfg, layer_number=2)
    _randomize_attention(ours, antithetic=True)
    hf = Glm5NextTextAttention(hf_cfg, layer_idx=1)
    hf.load_state_dict(_hf_state(ours))
    x = torch.randn(2, 23, cfg.hidden_size)
    out, _ = ours(x.transpose(0, 1))
    ref, _, _ = hf(x, attention_mask=torch.ones(2, 23, dtype=torch.bool))
    err = (out.transpose(0, 1) - ref).abs().max().item() / ref.abs().max().item()
    assert err <= 1e-5, err


@pytest.mark.parametrize("backend", ["torch", "sparse"])
def test_shared_layer_matches_hf_prev_topk(mcore, backend):
    torch.manual_seed(3)
    over = dict(layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
                indexer_types=["full", "full", "shared", "full"])
    cfg, hf_cfg = _configs(backend=backend, **over)
    full, shared = _build(cfg, layer_number=2), _build(cfg, layer_number=3)
    assert full.indexer is not None and shared.indexer is None
    assert not any(n.startswith("indexer.") for n, _ in shared.named_parameters())
    _randomize_attention(full, antithetic=True)
    _randomize_attention(shared, antithetic=True)
    hf_full, hf_shared = Glm5NextTextAttention(hf_cfg, 1), Glm5NextTextAttention(hf_cfg, 2)
    assert hf_full.next_skip_topk and hf_shared.indexer is None
    hf_full.load_state_dict(_hf_state(full))
    hf_shared.load_state_dict(_hf_state(shared))

    cu, bounds = _doc_bounds(LENS)
    psp = make_packed_seq_params(cu)
    x1, x2 = torch.randn(1, int(cu[-1]), cfg.hidden_size), torch.randn(1, int(cu[-1]), cfg.hidden_size)
    with torch.no_grad():
        _, topk = full(x1.transpose(0, 1), packed_seq_params=psp)
        _, hf_topks = _run_hf_per_doc(hf_full, x1, bounds)
    with pytest.raises(ValueError):
        shared(x2.transpose(0, 1), packed_seq_params=psp)

    x_ours, x_hf = x2.clone().requires_grad_(True), x2.clone().requires_grad_(True)
    out, topk_out = shared(x_ours.transpose(0, 1), packed_seq_params=psp, shared_topk_indices=topk)
    assert topk_out is topk
    out = out.transpose(0, 1)
    ref, _ = _run_hf_per_doc(hf_shared, x_hf, bounds, prev=hf_topks)
    err = (out - ref).abs().max().item() / ref.abs().max().item()
    assert err <= 1e-5, err
    g = torch.randn_like(ref)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    worst = _grads_check(shared, hf_shared, x_ours, x_hf)
    print(f"[shared {backend}] fwd rel err {err:.2e}, worst grad rel L2 {worst:.2e}")


def topk_first_on_ties(scores, k):
    """The indexer's selection: ``topk`` of the tie-ordered keys."""
    return tie_ordered_keys(scores).topk(k, dim=-1).indices


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_topk_first_on_ties_matches_stable_sort(device):
    """The indexer's pool top-k gives equal scores to the lower index, as a stable descending sort does, on fresh
    random rows full of exact ties (0.0 next to -0.0, rounded values, the finfo.min of masked candidates); and a
    candidate range cut in two picks the same pools (the CP / chunking case where torch.topk alone differed)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    low = torch.finfo(torch.float32).min
    for _ in range(100):
        n = int(torch.randint(1, 50, (1,), generator=g))
        k = int(torch.randint(1, n + 1, (1,), generator=g))
        x = torch.randn(2, 7, n, generator=g)
        for p, value in ((0.4, 0.0), (0.1, -0.0), (0.2, low)):
            x = torch.where(torch.rand(x.shape, generator=g) < p, torch.full_like(x, value), x)
        x = torch.where(torch.rand(x.shape, generator=g) < 0.2, x.round(), x).to(device)
        assert torch.equal(topk_first_on_ties(x, k), stable_topk_reference(x, k))
        cut = int(torch.randint(1, n + 1, (1,), generator=g))   # a wider candidate range: extra masked candidates
        wider = torch.cat([x, torch.full_like(x[..., :cut], low)], dim=-1)
        assert torch.equal(topk_first_on_ties(wider, k).sort(-1).values, topk_first_on_ties(x, k).sort(-1).values)


@pytest.mark.gpu
@pytest.mark.parametrize("b,c,H,D,p,qdtype,bf16x3", [(1, 333, 32, 128, 517, torch.bfloat16, False),
                                                      (1, 333, 32, 128, 517, torch.bfloat16, True),
                                                      (2, 70, 3, 100, 65, torch.bfloat16, True),
                                                      (2, 70, 3, 100, 65, torch.float32, False),
                                                      (1, 1, 5, 8, 1, torch.float32, False)])
def test_fused_indexer_scores_match_reference_gpu(b, c, H, D, p, qdtype, bf16x3, monkeypatch):
    """The Triton pool scores (kernels/indexer_scores.py) against the PyTorch ops on fresh random inputs with ragged
    sizes (query rows strided as the indexer slices them, D and H not powers of two, single query / pool), to 2e-6
    of the largest score (tf32x3 or bf16x3 products for bf16 queries, exact fp32 for fp32 ones; another summation
    order); exact zeros where every head's ReLU is 0."""
    pytest.importorskip("triton")
    from megatron_glm5.kernels.indexer_scores import INDEXER_SCORES_CONFIG, indexer_scores, indexer_scores_reference

    monkeypatch.setitem(INDEXER_SCORES_CONFIG, "bf16x3", bf16x3)

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    q = torch.randn(b, c + 3, H, D, generator=g).to(qdtype).cuda()[:, 3:]
    keys = torch.randn(b, p, D, generator=g).cuda()
    w = torch.randn(b, c, H, generator=g).cuda()
    keys[:, : p // 3] = -keys[:, : p // 3].abs()   # pools with all-negative products for positive queries
    q[0, 0] = q[0, 0].abs()
    got = indexer_scores(q, keys, w, D ** -0.5)
    ref = indexer_scores_reference(q, keys, w, D ** -0.5)
    assert got.shape == ref.shape == (b, c, p) and got.dtype == torch.float32
    assert (got - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()   # (all zeros possible at c = p = 1)
    zero = ref[0, 0] == 0
    assert torch.equal(got[0, 0][zero], ref[0, 0][zero])


def _decode_keys(keys: torch.Tensor):
    """(scores, low 32 bits) of int64 sort keys (the inverse of tie_ordered_keys)."""
    mono = (keys >> 32).to(torch.int32)
    bits = mono ^ ((mono >> 31) & 0x7FFFFFFF)
    return bits.view(torch.float32), keys & 0xFFFFFFFF


@pytest.mark.gpu
@pytest.mark.parametrize("b,c,H,D,p,qdtype,docs", [(1, 333, 32, 128, 517, torch.bfloat16, [0, 700, 1400, 2100]),
                                                    (2, 70, 3, 100, 65, torch.float32, [0, 30, 1000]),
                                                    (1, 1, 5, 8, 1, torch.float32, [0, 64])])
def test_fused_indexer_topk_keys_match_reference_gpu(b, c, H, D, p, qdtype, docs):
    """The masked sort keys from the kernel (kernels/indexer_scores.py, ``KEYS``) against masked_topk_keys of the
    PyTorch scores on fresh random inputs: masked pairs (other document, pool past the query; whole tiles of them
    skipped) bitwise equal, valid pairs' scores to 2e-6 of the largest, the index bits exact."""
    pytest.importorskip("triton")
    from megatron_glm5.kernels.indexer_scores import indexer_topk_keys, indexer_topk_keys_reference

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    q = torch.randn(b, c + 3, H, D, generator=g).to(qdtype).cuda()[:, 3:]
    keys = torch.randn(b, p, D, generator=g).cuda()
    w = torch.randn(b, c, H, generator=g).cuda()
    first_pos = int(torch.randint(0, 200, (1,), generator=g))
    bounds = torch.tensor(docs)
    pos = first_pos + torch.arange(c)
    query_doc = (torch.searchsorted(bounds, pos, right=True) - 1).cuda()
    pool_end = torch.sort(torch.randint(0, first_pos + c + 50, (p,), generator=g)).values
    pool_doc = (torch.searchsorted(bounds, pool_end, right=True) - 1).cuda()
    pool_end = pool_end.cuda()
    got = indexer_topk_keys(q, keys, w, D ** -0.5, query_doc, first_pos, pool_doc, pool_end)
    ref = indexer_topk_keys_reference(q, keys, w, D ** -0.5, query_doc, first_pos, pool_doc, pool_end)
    assert got.shape == ref.shape == (b, c, p) and got.dtype == torch.int64
    (gs, gi), (rs, ri) = _decode_keys(got), _decode_keys(ref)
    assert torch.equal(gi, ri)
    masked = rs == torch.finfo(torch.float32).min
    assert torch.equal(got[masked], ref[masked]) and torch.equal(gs == torch.finfo(torch.float32).min, masked)
    scale = rs[~masked].abs().max().item() if (~masked).any() else 0.0
    assert (gs[~masked] - rs[~masked]).abs().max().item() <= 2e-6 * scale if (~masked).any() else True


@pytest.mark.gpu
@pytest.mark.parametrize("keys", [False, True])
def test_fused_indexer_selects_as_reference_gpu(mcore, monkeypatch, keys):
    """The indexer module on CUDA, fused scores (``keys``: with ``fuse_topk_keys``, the masking and sort keys in the
    kernel, over several query chunks) vs its PyTorch scores, on a packed row of several documents with the
    always-selected tails: the same positions for every query (the scores agree to ~1e-7; random ties would need a
    margin below that)."""
    pytest.importorskip("triton")
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    cfg, _ = _configs(**{**MAIN, "index_topk": 16})
    ix = KPoolIndexer(cfg)
    _randomize_indexer(ix, antithetic=True)
    ix = ix.cuda()
    cu, _ = _doc_bounds([157, 3, 400, 91])
    s = int(cu[-1])
    x = torch.randn(s, 1, cfg.hidden_size, device="cuda")
    qr = torch.randn(s, 1, cfg.q_lora_rank, device="cuda")
    psp = make_packed_seq_params(cu.cuda())
    if keys:
        ix.plan = ix.plan.replace(indexer_score_chunk_elements=200 * 64,   # several query chunks
                                  indexer_fuse_topk_keys=True)
    fused = ix(x, qr, packed_seq_params=psp)
    ix.plan = ix.plan.replace(indexer_fused_scores=False)
    ref = ix(x, qr, packed_seq_params=psp)
    assert all(_sets(fused[0, i]) == _sets(ref[0, i]) for i in range(s))


def test_parameters_and_sharded_state_dict(mcore):
    cfg, _ = _configs()
    m = _build(cfg, layer_number=2)
    H, dq, dv, r, h = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.hidden_size
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {
        "q_a_proj.weight": (cfg.q_lora_rank, h), "q_a_layernorm.weight": (cfg.q_lora_rank,),
        "q_b_proj.weight": (H * dq, cfg.q_lora_rank), "kv_a_proj_with_mqa.weight": (r, h),
        "kv_a_layernorm.weight": (r,), "kv_b_proj.weight": (H * (dq + dv), r), "o_proj.weight": (h, H * dv),
        "indexer.wq_b.weight": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
        "indexer.wk.weight": (cfg.index_head_dim, h), "indexer.k_norm.weight": (cfg.index_head_dim,),
        "indexer.k_norm.bias": (cfg.index_head_dim,), "indexer.weights_proj.weight": (cfg.index_n_heads, h),
        "indexer.index_kpool_compress_ape": (cfg.index_kpool, cfg.index_head_dim),
        "indexer.index_kpool_compress_gate": (cfg.index_head_dim, h),
    }
    assert m.indexer.index_kpool_compress_ape.keep_fp32
    for n, p in m.named_parameters():
        assert p.tensor_model_parallel == (n in ("q_b_proj.weight", "kv_b_proj.weight", "o_proj.weight")), n
    sd = m.sharded_state_dict(prefix="layers.1.self_attention.")
    params = dict(m.named_parameters())
    assert {k for k in sd if not k.endswith("_extra_state")} == {f"layers.1.self_attention.{n}" for n in params}
    for n, p in params.items():
        t = sd[f"layers.1.self_attention.{n}"]
        assert t.key == f"layers.1.self_attention.{n}" and t.global_shape == tuple(p.shape), n


# ---------------------------------------------------------------------------- linearity
class _MaxNumel(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_sparse_backend_is_linear_in_sequence_length(mcore, monkeypatch):
    """s = 8192: no [s, s] tensor is ever built by the 'sparse' backend (forward + backward, indexer included)."""
    torch.manual_seed(4)
    cfg, _ = _configs(backend="sparse")
    m = _build(cfg, layer_number=2)
    monkeypatch.setattr(m.indexer, "plan", m.indexer.plan.replace(indexer_score_chunk_elements=1 << 20))

    def _no_dense(*a, **k):
        raise AssertionError("the sparse backend must not build a dense mask")

    monkeypatch.setattr(kpool_dsa, "topk_indices_to_mask", _no_dense)
    monkeypatch.setattr(kpool_dsa, "dense_topk_attention", _no_dense)
    s = 8192
    cu = torch.tensor([0, 3000, 5000, s], dtype=torch.int32)
    x = torch.randn(s, 1, cfg.hidden_size, requires_grad=True)
    with _MaxNumel() as mode:
        out, topk = m(x, packed_seq_params=make_packed_seq_params(cu))
        out.square().sum().backward()
    assert out.shape == (s, 1, cfg.hidden_size) and torch.isfinite(x.grad).all()
    assert mode.max_numel < s * s // 16, mode.max_numel
    print(f"[linearity] s={s}: largest tensor {mode.max_numel} elements (s^2 = {s * s})")


# ---------------------------------------------------------------------------- tensor parallel
_TP_SHARD_AXIS = {"q_b_proj.weight": 0, "kv_b_proj.weight": 0, "o_proj.weight": 1}


def _tp_worker(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    from megatron_glm5.initialize import destroy_megatron, initialize_megatron

    initialize_megatron(tp=world)
    try:
        for backend in ("torch", "sparse"):
            torch.manual_seed(6)  # same HF weights and inputs on every rank
            cfg, hf_cfg = _configs(backend=backend)
            hf = Glm5NextTextAttention(hf_cfg, layer_idx=1)
            _randomize_attention(hf, antithetic=True)
            ours = _build(cfg, layer_number=2)
            assert ours.num_heads_local == cfg.num_attention_heads // world
            with torch.no_grad():
                for n, p in ours.named_parameters():
                    full = dict(hf.named_parameters())[n]
                    if n in _TP_SHARD_AXIS:
                        full = full.chunk(world, dim=_TP_SHARD_AXIS[n])[rank]
                    p.copy_(full)
            cu, bounds = _doc_bounds(LENS)
            x = torch.randn(1, int(cu[-1]), cfg.hidden_size)
            x_ours, x_hf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            out, _ = ours(x_ours.transpose(0, 1), packed_seq_params=make_packed_seq_params(cu))
            out = out.transpose(0, 1)
            ref, _ = _run_hf_per_doc(hf, x_hf, bounds)
            err = (out - ref).abs().max().item() / ref.abs().max().item()
            assert err <= 1e-5, (backend, err)
            g = torch.randn_like(ref)
            (out * g).sum().backward()
            (ref * g).sum().backward()
            gx = ((x_ours.grad - x_hf.grad).norm() / x_hf.grad.norm()).item()
            assert gx <= 1e-4, (backend, "input", gx)
            for n, p in ours.named_parameters():
                if n.startswith("indexer."):
                    continue
                want = dict(hf.named_parameters())[n].grad
                if n in _TP_SHARD_AXIS:
                    want = want.chunk(world, dim=_TP_SHARD_AXIS[n])[rank]
                r = ((p.grad - want).norm() / want.norm()).item()
                assert r <= 1e-4, (backend, n, r)
    finally:
        destroy_megatron()


def test_tensor_parallel_2_matches_hf():
    """TP = 2 (2 gloo processes): heads sharded, both backends, forward and gradients vs HF per document."""
    mp.start_processes(_tp_worker, args=(2, free_port()), nprocs=2, join=True, start_method="spawn")
