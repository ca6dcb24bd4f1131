"""Training the KPool indexer (issue 35, docs/indexer_training.md): the indexer KL against its plain-PyTorch
reference (values and gradients), the detach structure, frozen-by-default, the warm-up and sparse stages through
the trainer, the re-initialised indexer's warm-up, and the loss under TP + SP, CP and PP."""

from __future__ import annotations

import pytest
import torch

from megatron_glm5.config import Glm5Config, tiny_hf_config
from megatron_glm5.models.indexer_loss import kpool_indexer_kl, kpool_indexer_kl_reference
from megatron_glm5.models.kpool_indexer import KPoolIndexer
from megatron_glm5.models.packing import make_packed_seq_params


def _cfg(**over):
    t = dict(tiny_hf_config(with_vision=False)["text_config"])
    extra = {k: over.pop(k) for k in list(over) if k.startswith("dsa_")}
    t.update(over)
    return Glm5Config.from_hf({"text_config": t, "architectures": ["Glm5NextForConditionalGeneration"],
                               "model_type": "glm5_next"}, use_cpu_initialization=True, **extra)


def _random_indexer(cfg, seed):
    torch.manual_seed(seed)
    ix = KPoolIndexer(cfg)
    with torch.no_grad():
        for p in ix.parameters():
            p.normal_(0.0, 0.5)
        ix.k_norm.weight.add_(1.0)
    return ix


# Rows: documents shorter than a pool, exactly a pool, ragged; kpool 4, topk 8 (2 pools) or 12 (3 pools).
CASES = [
    dict(lens=[3, 4, 17, 9, 30], index_topk=8, sparse=False),
    dict(lens=[3, 4, 17, 9, 30], index_topk=8, sparse=True),
    dict(lens=[12, 1, 23], index_topk=12, sparse=True),          # top-k = every pool of the 12-token document
    dict(lens=[40], index_topk=8, sparse=True, antithetic=False),  # ReLU ties among the pool scores
    dict(lens=[2, 5, 9], index_topk=8, sparse=False),            # few pools, rows without any candidate
]


@pytest.mark.parametrize("case", CASES, ids=[f"{'sparse' if c['sparse'] else 'dense'}-{c['lens']}" for c in CASES])
def test_indexer_kl_equals_reference_values_and_gradients(case):
    """The chunked loss (absorbed latents, per-chunk candidate pools, gathered selected pools) equals the
    whole-matrix reference (expanded keys, token-to-pool matrix, scatter masks) to 1e-6 relative in fp32, and so
    do the gradients of every indexer parameter; chunks of one query give the same."""
    cfg = _cfg(index_topk=case["index_topk"], index_n_heads=4, dsa_indexer_loss_coeff=1.0)
    ix = _random_indexer(cfg, seed=len(case["lens"]) + case["index_topk"])
    if case.get("antithetic", True) is False:
        with torch.no_grad():
            ix.wq_b.weight.abs_().neg_()            # most per-head scores ReLU to 0: equal pool scores
    lens = case["lens"]
    s = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    psp = make_packed_seq_params(cu)
    H, dq, r = 3, 8, 6
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(s, 1, cfg.hidden_size, generator=gen)
    qr = torch.randn(s, 1, cfg.q_lora_rank, generator=gen)
    q = torch.randn(1, s, H, dq, generator=gen)
    c = torch.randn(1, s, r, generator=gen)
    w_kc = torch.randn(H, dq, r, generator=gen) * 0.5
    k = torch.einsum("hdr,bsr->bshd", w_kc, c)
    q_lat = torch.einsum("bshd,hdr->bshr", q, w_kc)
    scale = dq ** -0.5

    def ours(chunk_elements):
        ix.zero_grad(set_to_none=True)
        idx, f = ix(x, qr, packed_seq_params=psp, return_features=True)
        kl, rows = kpool_indexer_kl(f, q_lat, c, scale, ix.softmax_scale, idx, ix.kpool, ix.index_topk,
                                    case["sparse"], chunk_elements=chunk_elements)
        kl.backward()
        return kl.detach(), rows, {n: p.grad.clone() for n, p in ix.named_parameters()}, idx, f

    kl, rows, grads, idx, f = ours(1 << 24)
    ix.zero_grad(set_to_none=True)
    f2 = ix.features(x, qr, psp)
    sel = dict(topk_indices=idx, selected_pools=f.selected_pools) if case["sparse"] else {}
    ref_kl, ref_rows = kpool_indexer_kl_reference(f2.q, f2.pool_keys, f2.weights, q, k, cu, ix.kpool, scale,
                                                  ix.softmax_scale, **sel)
    ref_kl.backward()
    print(f"{case}: kl {kl.item():.6f} over {int(rows)} rows, reference {ref_kl.item():.6f}")
    assert int(rows) == int(ref_rows) and int(rows) > 0
    assert int(rows) < s                                             # rows before the first pool have no term
    assert abs(kl - ref_kl) <= 1e-6 * abs(ref_kl), (kl.item(), ref_kl.item())
    for n, p in ix.named_parameters():
        g, rg = grads[n], p.grad
        assert rg is not None and rg.abs().max() > 0, n
        assert (g - rg).norm() <= 1e-6 * rg.norm(), (n, ((g - rg).norm() / rg.norm()).item())
    kl1, rows1, grads1, _, _ = ours(1)                               # one query per chunk
    assert int(rows1) == int(rows) and abs(kl1 - kl) <= 1e-6 * abs(kl)
    assert all((grads1[n] - grads[n]).norm() <= 1e-6 * grads[n].norm() for n in grads)
